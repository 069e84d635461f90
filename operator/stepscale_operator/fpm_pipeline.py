"""One deployment's view of its FPM streams: stream health, cost model and load.

:class:`DeploymentModel` glues :class:`~stepscale_operator.stream_state.StreamTable`,
:class:`~stepscale_operator.cost_model.CostModel` and
:class:`~stepscale_operator.load_estimate.LoadEstimator`; the operator and the
simulator call :meth:`DeploymentModel.ingest` with batches of decoded messages.

Messages are turned into columns once per batch (:class:`PassMatrices`) and every
component works on those, so per-message Python work stays small.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, overload

import numpy as np
import numpy.typing as npt
from msgspec.structs import astuple

from stepscale_engine.wire import (
    ForwardPassMetrics,
)
from stepscale_operator.cost_model import CostModel
from stepscale_operator.load_estimate import LoadEstimator
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.pass_columns import (
    COL_COUNTER,
    COL_QUEUED,
    COL_SCHED,
    COL_WALL,
    N_NUMERIC,
)
from stepscale_operator.stream_state import StreamGroups, StreamKey, StreamTable, stream_label

FloatArray = npt.NDArray[np.float64]

_COUNTER_CAP = float(2**62)  # counters are exact in float64 far beyond any real stream


@dataclass(frozen=True)
class PassMatrices:
    """A batch of messages as columns: every numeric field of every message."""

    keys: list[StreamKey]
    numeric: FloatArray  # (n, N_NUMERIC), layout in pass_columns

    @classmethod
    def from_messages(cls, msgs: Sequence[ForwardPassMetrics]) -> PassMatrices:
        """Columns of ``msgs`` (one pass over the structs)."""
        if not msgs:
            return cls([], np.zeros((0, N_NUMERIC)))
        # One flat float stream into a preallocated array: about 30% faster than
        # np.array over a list of row tuples (benchmarks/bench_ingest.py).
        n = len(msgs)
        numeric = np.fromiter(
            itertools.chain.from_iterable(
                (m.version, m.dp_rank, m.counter_id, m.wall_time)
                + astuple(m.scheduled_requests)
                + astuple(m.queued_requests)
                for m in msgs
            ),
            dtype=np.float64,
            count=n * N_NUMERIC,
        ).reshape(n, N_NUMERIC)
        return cls([(m.worker_id, m.dp_rank) for m in msgs], numeric)

    @classmethod
    def concat(cls, parts: Sequence[PassMatrices]) -> PassMatrices:
        """The rows of ``parts`` one after the other (one ingest for many receives)."""
        if len(parts) == 1:
            return parts[0]
        keys = list(itertools.chain.from_iterable(p.keys for p in parts))
        numeric = np.concatenate([p.numeric for p in parts]) if parts else np.zeros((0, N_NUMERIC))
        return cls(keys, numeric)

    @cached_property
    def groups(self) -> StreamGroups:
        """The rows grouped by stream (computed once, shared by every consumer)."""
        return StreamGroups.of(self.keys)

    def select(self, mask: npt.NDArray[np.bool_]) -> PassMatrices:
        """The rows where ``mask`` is True."""
        idx = np.flatnonzero(mask)
        return PassMatrices([self.keys[i] for i in idx], self.numeric[idx])

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def wall(self) -> FloatArray:
        """Wall time of each pass in seconds (0 for heartbeats)."""
        return self.numeric[:, COL_WALL]

    @property
    def counters(self) -> npt.NDArray[np.int64]:
        """Sequence numbers as int64."""
        return np.minimum(self.numeric[:, COL_COUNTER], _COUNTER_CAP).astype(np.int64)

    @property
    def sched(self) -> FloatArray:
        """(n, 7) ScheduledRequestMetrics columns in wire order."""
        return self.numeric[:, COL_SCHED:COL_QUEUED]

    @property
    def queued(self) -> FloatArray:
        """(n, 6) QueuedRequestMetrics columns in wire order."""
        return self.numeric[:, COL_QUEUED:]


class MessageBatch(Sequence[ForwardPassMetrics]):
    """The accepted messages of one receive: their columns, and the structs on demand.

    Ingest works on :attr:`matrices` only. The message structs are built the first
    time something reads the batch as a sequence (tests, tools), so a receive that
    decoded straight into columns (the native path) never pays for them.
    """

    def __init__(
        self,
        matrices: PassMatrices,
        messages: list[ForwardPassMetrics] | Callable[[], list[ForwardPassMetrics]],
    ) -> None:
        self.matrices = matrices
        self._messages = messages

    @classmethod
    def of(cls, msgs: Sequence[ForwardPassMetrics]) -> MessageBatch:
        """A batch of already decoded messages."""
        return cls(PassMatrices.from_messages(msgs), list(msgs))

    def messages(self) -> list[ForwardPassMetrics]:
        """The message structs, in row order (built once, then kept)."""
        if callable(self._messages):
            self._messages = self._messages()
        return self._messages

    def __len__(self) -> int:
        return len(self.matrices)

    @overload
    def __getitem__(self, index: int) -> ForwardPassMetrics: ...
    @overload
    def __getitem__(self, index: slice) -> list[ForwardPassMetrics]: ...
    def __getitem__(self, index: int | slice) -> ForwardPassMetrics | list[ForwardPassMetrics]:
        return self.messages()[index]


@dataclass(frozen=True)
class IngestResult:
    """What one :meth:`DeploymentModel.ingest` call did."""

    messages: int  # accepted (duplicates excluded)
    passes: int
    heartbeats: int
    restarted: tuple[StreamKey, ...]


class DeploymentModel:
    """Stream health, cost model and load estimate of one deployment (thread-safe)."""

    def __init__(
        self,
        name: str = "",
        *,
        cost_model: CostModel | None = None,
        load: LoadEstimator | None = None,
        streams: StreamTable | None = None,
        observe_streams: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``observe_streams=False`` when a subscriber already records the same table."""
        self.name = name
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.load = load if load is not None else LoadEstimator()
        self.streams = streams if streams is not None else StreamTable(self.load.stale_after_s)
        self.observe_streams = observe_streams
        self._clock = clock
        self._lock = threading.Lock()

    def add_stream(self, key: StreamKey) -> None:
        """Expect a stream (a pod/rank that exists); it is missing until it reports."""
        with self._lock:
            self.streams.expect(key)
            self.load.add_stream(key)

    def remove_stream(self, key: StreamKey) -> None:
        """Forget a stream whose pod is gone."""
        with self._lock:
            self.streams.forget(key)
            self.load.remove_stream(key)
            self.cost_model.forget_stream(key)

    def ingest(self, msgs: Sequence[ForwardPassMetrics], now: float | None = None) -> IngestResult:
        """Account a batch of decoded messages received at ``now`` (default: the clock)."""
        if now is None:
            now = self._clock()
        if isinstance(msgs, MessageBatch):
            matrices = msgs.matrices
        else:
            matrices = PassMatrices.from_messages(msgs)
        return self.ingest_matrices(matrices, now)

    def ingest_matrices(self, matrices: PassMatrices, now: float) -> IngestResult:
        """:meth:`ingest` of a batch already in columns (several receives may be merged:
        a call costs about as much whatever its size, so fewer, larger calls are cheaper)."""
        with self._lock:
            restarted: tuple[StreamKey, ...] = ()
            pass_index = None  # the cost model counts warm-up itself unless we tell it
            if self.observe_streams:
                seen = self.streams.observe_columns(
                    matrices.groups, matrices.counters, matrices.wall, now
                )
                restarted = seen.restarted
                pass_index = seen.pass_index
                if not seen.all_accepted:
                    # Duplicates were counted by the table; learning them twice would
                    # double-count their passes in the model and the load.
                    matrices = matrices.select(seen.mask)
                    pass_index = pass_index[seen.mask]
            wall = matrices.wall
            # Heartbeats go in too: they are not samples, but their sequence numbers
            # show the model when a stream restarted.
            groups = matrices.groups
            self.cost_model.update_batch(
                matrices.sched, wall, groups, matrices.counters, pass_index=pass_index
            )
            self.load.observe_matrices(groups, wall, matrices.sched, matrices.queued, now)
        passes = int(np.count_nonzero(wall > 0.0))
        return IngestResult(len(matrices), passes, len(matrices) - passes, restarted)

    def on_batch(self, msgs: Sequence[ForwardPassMetrics]) -> None:
        """Sink for :class:`~stepscale_operator.subscriber.FpmSubscriber`."""
        self.ingest(msgs)

    def estimate(self, now: float | None = None) -> LoadEstimate:
        """The deployment's load over the estimator's window."""
        with self._lock:
            return self.load.estimate(self._clock() if now is None else now)

    def status(self, now: float | None = None) -> dict[str, Any]:
        """JSON-able snapshot for the custom resource status and logs."""
        if now is None:
            now = self._clock()
        with self._lock:
            return {
                "name": self.name,
                "streams": self.streams.health(now, per_stream=False),
                "cost_model": self.cost_model.to_dict(),
                "stream_residuals": {
                    stream_label(k): v for k, v in self.cost_model.stream_residuals().items()
                },
                "load": self.load.estimate(now).to_dict(),
            }
