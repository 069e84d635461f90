"""Per-stream bookkeeping for FPM streams: sequence gaps, restarts, liveness, rejections.

A stream is one publisher, identified by ``(worker_id, dp_rank)`` from the payload.
Pure data structures: no sockets, no clocks (callers pass ``now``), so the same
code runs in the subscriber, the simulator and the tests.

Sequence rules (``docs/fpm-wire-v1.md``): a publisher numbers every message,
heartbeats included, from 0 upwards by one. So

* ``sequence > last + 1`` means ``sequence - last - 1`` messages were lost;
* ``sequence == last`` is a duplicate (two publishers claiming one identity, or a
  replay); it is counted and otherwise ignored: :class:`ObserveResult` carries a
  mask of the messages that were not duplicates, so consumers learn each pass once;
* ``sequence < last`` means the engine restarted: a new publisher starts at 0, and
  the messages it sent before we saw it are counted as lost.

A stream is stale when nothing (not even a heartbeat) arrived for
``stale_after_s`` (3 heartbeat intervals by default): its load is unknown, not zero.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from stepscale_engine import wire
from stepscale_engine.wire import ForwardPassMetrics, FrameError

StreamKey = tuple[str, int]
"""``(worker_id, dp_rank)`` of one publisher."""

DEFAULT_STALE_AFTER_S = 3.0 * wire.HEARTBEAT_INTERVAL_S
DEFAULT_MAX_STREAMS = 4096
# StreamState counters kept in StreamTable.evicted_counts when a stream is evicted.
EVICTED_COUNTED = ("messages", "passes", "heartbeats", "lost", "restarts", "duplicates")


@dataclass(frozen=True)
class StreamGroups:
    """The rows of a batch grouped by stream: the distinct keys, and each row's one.

    Built once per batch (:attr:`PassMatrices.groups`) and shared by the stream
    table, the cost model and the load estimator, which all work per stream.
    """

    keys: list[StreamKey]  # distinct, in order of first appearance
    index: npt.NDArray[np.int64]  # per row: the position of its key in ``keys``

    @classmethod
    def of(cls, rows: Sequence[StreamKey] | StreamGroups) -> StreamGroups:
        """Group ``rows`` (returned as is when already grouped)."""
        if isinstance(rows, StreamGroups):
            return rows
        n = len(rows)
        # Each row -> the position of its key's first row (a C-level loop over the
        # rows), then positions -> dense ranks; first positions ascend with the keys.
        first: dict[StreamKey, int] = {}
        pos = np.fromiter(map(first.setdefault, rows, range(n)), np.int64, n)
        rank = np.empty(n, dtype=np.int64)
        rank[np.fromiter(first.values(), np.int64, len(first))] = np.arange(len(first))
        return cls(list(first), rank[pos])

    def __len__(self) -> int:
        return int(self.index.shape[0])


def stream_label(key: StreamKey) -> str:
    """``worker_id/dp_rank``: a string form of a stream key for JSON and logs."""
    return f"{key[0]}/{key[1]}"


@dataclass
class StreamState:
    """What we know about one publisher."""

    key: StreamKey
    expected: bool = False  # registered by add/expect (e.g. a pod we know exists)
    first_seen: float | None = None
    last_seen: float | None = None
    last_pass_time: float | None = None
    last_sequence: int | None = None
    messages: int = 0  # accepted messages, heartbeats included
    passes: int = 0  # forward passes (non-heartbeat messages)
    heartbeats: int = 0
    lost: int = 0  # messages missing from sequence gaps
    restarts: int = 0
    duplicates: int = 0
    passes_since_restart: int = 0  # forward passes since the stream (re)started
    rejected: dict[str, int] = field(default_factory=dict)  # FrameError value -> count

    def is_stale(self, now: float, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> bool:
        """True when never seen or silent for longer than ``stale_after_s``."""
        return self.last_seen is None or now - self.last_seen > stale_after_s

    def summary(
        self, now: float, stale_after_s: float = DEFAULT_STALE_AFTER_S
    ) -> dict[str, object]:
        """JSON-able counters of this stream."""
        return {
            "worker_id": self.key[0],
            "dp_rank": self.key[1],
            "expected": self.expected,
            "stale": self.is_stale(now, stale_after_s),
            "age_s": None if self.last_seen is None else round(now - self.last_seen, 3),
            "last_sequence": self.last_sequence,
            "messages": self.messages,
            "passes": self.passes,
            "heartbeats": self.heartbeats,
            "lost": self.lost,
            "restarts": self.restarts,
            "duplicates": self.duplicates,
            "rejected": dict(self.rejected),
        }


@dataclass(frozen=True)
class ObserveResult:
    """What one batch changed, for consumers that react to restarts or must skip duplicates."""

    restarted: tuple[StreamKey, ...]  # streams that restarted within the batch
    new: tuple[StreamKey, ...]  # streams seen for the first time
    # Per input message, in input order: False for a duplicate (already counted).
    mask: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # Per input message: forward passes of its stream since its last (re)start, this one
    # included (what warm-up is judged by); meaningful for passes only.
    pass_index: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def all_accepted(self) -> bool:
        """True when the batch held no duplicate."""
        return bool(self.mask.all())


class StreamTable:
    """All streams of one subscriber or deployment, with a health summary.

    Memory is bounded by ``max_streams``: beyond it, the stream silent for the
    longest time that nobody registered as expected is forgotten. Streams are kept
    in least-recently-seen order (expected ones apart), so that costs O(1) however
    many identities churn through.
    """

    def __init__(
        self,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        self.stale_after_s = stale_after_s
        self.max_streams = max_streams
        self._streams: dict[StreamKey, StreamState] = {}
        # Least recently seen first; expected streams are evicted only when nothing else is.
        self._lru: OrderedDict[StreamKey, None] = OrderedDict()
        self._lru_expected: OrderedDict[StreamKey, None] = OrderedDict()
        # Rejections whose stream is unknown (the payload did not decode) land here too.
        self.rejected: dict[str, int] = {}
        self.evicted = 0
        # The counts of evicted streams, so that totals over the table never go down.
        self.evicted_counts: dict[str, int] = dict.fromkeys(EVICTED_COUNTED, 0)

    # -- membership ------------------------------------------------------------

    def expect(self, key: StreamKey) -> StreamState:
        """Register a stream that should exist (a known pod/rank); missing until it speaks."""
        state = self._get_or_create(key)
        if not state.expected:
            state.expected = True
            self._lru.pop(key, None)
            self._lru_expected[key] = None
        return state

    def forget(self, key: StreamKey) -> None:
        """Drop a stream (its pod is gone)."""
        self._streams.pop(key, None)
        self._lru.pop(key, None)
        self._lru_expected.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[StreamKey]:
        """The stream keys (a snapshot: the table may change while callers iterate)."""
        return iter(list(self._streams))

    def get(self, key: StreamKey) -> StreamState | None:
        """The state of one stream, or None."""
        return self._streams.get(key)

    def keys(self) -> list[StreamKey]:
        """All known stream keys."""
        return list(self._streams)

    # -- observation -----------------------------------------------------------

    def observe(self, msg: ForwardPassMetrics, now: float) -> bool:
        """Record one accepted message; True if it shows the stream restarted."""
        return bool(self.observe_batch((msg,), now).restarted)

    def observe_batch(self, msgs: Sequence[ForwardPassMetrics], now: float) -> ObserveResult:
        """Record accepted messages in arrival order, all received at ``now``."""
        n = len(msgs)
        keys = [(m.worker_id, m.dp_rank) for m in msgs]
        counters = np.fromiter((m.counter_id for m in msgs), np.int64, n)
        wall = np.fromiter((m.wall_time for m in msgs), np.float64, n)
        return self.observe_columns(keys, counters, wall, now)

    def observe_columns(
        self,
        keys: Sequence[StreamKey] | StreamGroups,
        counters: npt.NDArray[np.int64],
        wall: npt.NDArray[np.float64],
        now: float,
    ) -> ObserveResult:
        """Columnar :meth:`observe_batch`: stream keys, sequence numbers and wall times.

        Vectorised over the batch; Python work is per distinct stream, not per message.
        """
        n = len(keys)
        if n == 0:
            return ObserveResult((), (), np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64))
        groups = StreamGroups.of(keys)
        slot = groups.index
        states: list[StreamState] = []
        new: list[StreamKey] = []
        for key in groups.keys:
            state = self._streams.get(key)
            if state is None:
                state = self._get_or_create(key)
            if state.first_seen is None:
                state.first_seen = now
                new.append(key)
            self._touch(state)
            states.append(state)
        last = np.array(
            [-1 if s.last_sequence is None else s.last_sequence for s in states], np.int64
        )
        since_restart = np.array([s.passes_since_restart for s in states], np.int64)
        order = np.argsort(slot, kind="stable")
        sl, seq, w = slot[order], counters[order], wall[order]
        starts = np.flatnonzero(np.r_[True, sl[1:] != sl[:-1]])
        first = np.zeros(n, dtype=bool)
        first[starts] = True
        prev = np.where(first, last[sl], np.r_[-1, seq[:-1]])
        known = prev >= 0
        dup = known & (seq == prev)
        restart = known & (seq < prev)
        gap = np.where(known & (seq > prev), seq - prev - 1, 0)
        lost = gap + np.where(restart, seq, 0)
        counted = ~dup
        is_pass = counted & (w != 0.0)
        heartbeat = counted & (w == 0.0)
        idx = np.arange(n)
        # Passes after the last restart of each stream (all of them if none).
        last_restart = np.maximum.reduceat(np.where(restart, idx, -1), starts)
        passes_cum = np.cumsum(is_pass)
        ends = np.r_[starts[1:], n] - 1
        before = np.where(
            last_restart >= 0,
            passes_cum[np.maximum(last_restart, 0)] - is_pass[np.maximum(last_restart, 0)],
            passes_cum[starts] - is_pass[starts],
        )
        passes_after = passes_cum[ends] - before
        # Per row: passes since its segment began (a stream's first row or a restart),
        # carrying on from the table's count where the segment is not a restart.
        seg_start = first | restart
        seg_idx = np.flatnonzero(seg_start)
        carried = np.where(restart[seg_idx], 0, since_restart[sl[seg_idx]])
        offset = passes_cum[seg_idx] - is_pass[seg_idx] - carried
        pass_index = np.empty(n, dtype=np.int64)
        pass_index[order] = passes_cum - offset[np.cumsum(seg_start) - 1]
        sums = np.add.reduceat(
            np.stack([counted, is_pass, heartbeat, lost, restart, dup], axis=1).astype(np.int64),
            starts,
            axis=0,
        )
        # The last non-duplicate sequence of each stream (a duplicate equals it anyway).
        last_seq = seq[ends].tolist()
        after = passes_after.tolist()
        restarted: list[StreamKey] = []
        # Python ints once for the whole batch: the loop below is per stream.
        for j, (state, row) in enumerate(zip(states, sums.tolist(), strict=True)):
            n_msgs, n_pass, n_hb, n_lost, n_restart, n_dup = row
            if self._streams.get(state.key) is not state:
                # Evicted by a newer stream of this same batch: its counts still count.
                for name, value in zip(
                    EVICTED_COUNTED, (n_msgs, n_pass, n_hb, n_lost, n_restart, n_dup), strict=True
                ):
                    self.evicted_counts[name] += value
            state.duplicates += n_dup
            if n_msgs == 0:
                continue
            state.messages += n_msgs
            state.passes += n_pass
            state.heartbeats += n_hb
            state.lost += n_lost
            state.restarts += n_restart
            if n_restart:
                state.passes_since_restart = after[j]
                restarted.append(state.key)
            else:
                state.passes_since_restart += n_pass
            state.last_sequence = last_seq[j]
            state.last_seen = now
            if n_pass:
                state.last_pass_time = now
        mask = np.empty(n, dtype=bool)
        mask[order] = counted
        return ObserveResult(tuple(restarted), tuple(new), mask, pass_index)

    def record_rejected(self, reason: FrameError, key: StreamKey | None = None) -> None:
        """Count one rejected frame, against its stream when the identity is known."""
        name = reason.value
        self.rejected[name] = self.rejected.get(name, 0) + 1
        if key is not None:
            state = self._streams.get(key)
            if state is not None:
                state.rejected[name] = state.rejected.get(name, 0) + 1

    # -- queries ---------------------------------------------------------------

    def fresh(self, now: float) -> list[StreamKey]:
        """Streams that spoke within ``stale_after_s``."""
        return [k for k, s in self._streams.items() if not s.is_stale(now, self.stale_after_s)]

    def stale(self, now: float) -> list[StreamKey]:
        """Streams that are known but silent (or never heard from)."""
        return [k for k, s in self._streams.items() if s.is_stale(now, self.stale_after_s)]

    def health(self, now: float, per_stream: bool = True) -> dict[str, object]:
        """A JSON-able health summary: totals, stale streams, rejections by reason."""
        states = list(self._streams.values())
        stale = [stream_label(s.key) for s in states if s.is_stale(now, self.stale_after_s)]
        summary: dict[str, object] = {
            "streams": len(states),
            "fresh": len(states) - len(stale),
            "stale": sorted(stale),
            "messages": sum(s.messages for s in states),
            "passes": sum(s.passes for s in states),
            "heartbeats": sum(s.heartbeats for s in states),
            "lost": sum(s.lost for s in states),
            "restarts": sum(s.restarts for s in states),
            "duplicates": sum(s.duplicates for s in states),
            "rejected": dict(self.rejected),
            "evicted": self.evicted,
        }
        if per_stream:
            summary["per_stream"] = {
                stream_label(s.key): s.summary(now, self.stale_after_s) for s in states
            }
        return summary

    # -- internals -------------------------------------------------------------

    def _get_or_create(self, key: StreamKey) -> StreamState:
        state = self._streams.get(key)
        if state is None:
            if len(self._streams) >= self.max_streams:
                self._evict_one()
            state = StreamState(key=key)
            self._streams[key] = state
            self._lru[key] = None
        return state

    def _touch(self, state: StreamState) -> None:
        """Mark a stream as just seen (most recent in its LRU order)."""
        (self._lru_expected if state.expected else self._lru).move_to_end(state.key)

    def _evict_one(self) -> None:
        """Forget the least recently seen unexpected stream, else the oldest expected one."""
        lru = self._lru if self._lru else self._lru_expected
        victim, _ = lru.popitem(last=False)
        state = self._streams.pop(victim)
        self.evicted += 1
        for name in EVICTED_COUNTED:
            self.evicted_counts[name] += int(getattr(state, name))
