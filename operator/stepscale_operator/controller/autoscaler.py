"""One ``VllmDeployment``'s ingest, cost model, load estimate and planner.

No Kubernetes here: the handlers feed it pods (:meth:`DeploymentAutoscaler.observe_pod`)
and ask it to decide (:meth:`DeploymentAutoscaler.decide`); it owns the
:class:`~stepscale_operator.subscriber.FpmSubscriber` that listens to every pod
and rank.

Threads: the subscriber's thread appends received batches (with their
arrival time) to a queue bounded in bytes (:class:`.ingest_queue.IngestQueue`,
which sheds and counts what does not fit); everything that touches the model
(ingest, stream membership, predictions, snapshots) runs under one lock. Work
under the lock is bounded per turn: the subscriber thread ingests one merged
chunk at a time, and only when the lock is free and no one waits for it, so a
decision round, a status snapshot or a pod event waits for at most one chunk;
a decision round ingests what was queued when it began, not what arrives
meanwhile, and at most ``ROUND_INGEST_MESSAGES`` of it: under overload the
oldest part of a backlog is shed (counted, and said on status) so that rounds
stay on time. The model therefore has a single writer at a time and the
planner never reads a half-updated fit.

Streams follow pods: messages from an identity that no current pod backs (in
flight when its pod was deleted, or no pod at all) never reach the model; they
are counted by :class:`~stepscale_operator.stray_streams.StrayStreams` and
forgotten once silent.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from stepscale_engine.rate_limited_log import RateLimitedLog
from stepscale_operator.controller.cost_model_prior import prior_snapshot
from stepscale_operator.controller.discovery import PodDirectory, PodView, StreamChanges
from stepscale_operator.controller.ingest_queue import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MERGE_SPAN_S,
    IngestQueue,
)
from stepscale_operator.controller.round_priority import ROUNDS
from stepscale_operator.controller.spec import AutoscalingSpec, VllmDeploymentSpec
from stepscale_operator.cost_model import CostModel
from stepscale_operator.fpm_pipeline import DeploymentModel, MessageBatch, PassMatrices
from stepscale_operator.ingest_coverage import IngestCoverage
from stepscale_operator.latency_model import EngineLimits, SloTargets
from stepscale_operator.load_estimate import TREND_FIELDS, LoadEstimator
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner import (
    Decision,
    Planner,
    PlannerInputs,
    PlannerPolicy,
    ReplicaCounts,
)
from stepscale_operator.stray_streams import StrayStreams
from stepscale_operator.subscriber import FpmSubscriber

log = logging.getLogger(__name__)

# The subscriber thread ingests once this many messages are queued, or once the
# oldest queued batch is this old (seconds), whichever comes first.
INGEST_AT_MESSAGES = 8192
INGEST_AFTER_S = 2.0
# The subscriber's thread lets messages gather this long between receives: a receive
# costs about the same for one message or a thousand, and each connection's queue
# that a receive empties costs a wake-up when its next message comes. Queued
# batches reach the model every INGEST_AFTER_S anyway, so this delays nothing the
# planner sees (in one run of benchmarks/bench_operator_ingest.py at 5k msg/s over
# 1,000 connections, 0.1 s cost about 20% more CPU per message). At high rates the
# subscriber waits less (FpmSubscriber._coalesce_wait: memory). One engine sends
# 25-50 passes in 0.5 s, far below the subscriber's per-connection high-water mark.
RECEIVE_COALESCE_S = 0.5
# A decision round ingests at most about this many queued messages (one chunk:
# about 15 ms of a core); a backlog beyond it means the subscriber thread is not
# keeping up, and its oldest part is shed (counted) so that the round decides on
# fresh data, on time.
ROUND_INGEST_MESSAGES = 8192
# Per-stream counts that the operator's counters total (stream_state.StreamState fields).
COUNTED_FIELDS = ("messages", "passes", "lost", "restarts")


@dataclass(frozen=True)
class DecisionRound:
    """What one :meth:`DeploymentAutoscaler.decide` call saw and decided."""

    decision: Decision | None  # None when autoscaling is disabled
    load: LoadEstimate
    cost_model_snapshot: dict[str, Any]
    stream_health: dict[str, Any]
    endpoints: int
    ready: int
    starting: int
    ingested_messages: int
    # Monotonic totals since this autoscaler started (see DeploymentAutoscaler.totals).
    totals: dict[str, int] = field(default_factory=dict)


def silence_safe_window(a: AutoscalingSpec) -> float:
    """The scale-down window, at least as long as a silent stream takes to go stale.

    A pod that goes silent first looks like falling load (its passes leave the
    load window) and only after ``staleAfterSeconds`` like missing data. A window
    shorter than that, plus two decision rounds, could scale down on the silence;
    with the defaults (120 s vs 3 s) it never matters.
    """
    return max(a.scale_down_stabilization_s, a.stale_after_s + 2.0 * a.interval_s)


def without_trends(load: LoadEstimate) -> LoadEstimate:
    """``load`` with its trends withheld, as the estimator itself withholds them when it
    has too little data: zero and named in ``unavailable``."""
    zeros: dict[str, Any] = dict.fromkeys(TREND_FIELDS, 0.0)
    return replace(load, **zeros, unavailable=load.unavailable | TREND_FIELDS)


def merge_span(spec: VllmDeploymentSpec) -> float:
    """How far apart received batches merged into one model call may be: at most
    2 s, and a small part of the load window (a short window must not turn lumpy)."""
    return min(DEFAULT_MERGE_SPAN_S, spec.autoscaling.load_window_s / 15.0)


def planner_policy(spec: VllmDeploymentSpec) -> PlannerPolicy:
    """The planner's tunables from ``spec.autoscaling``."""
    a = spec.autoscaling
    return PlannerPolicy(
        max_surge=a.max_surge,
        scale_down_step=a.scale_down_max_step,
        # Each scale-down step waits for one load window at the new size.
        scale_down_settle_s=a.load_window_s,
        scale_down_stabilization_s=silence_safe_window(a),
        initial_hold_s=a.scale_down_initial_hold_s,
        burst_memory_s=a.burst_memory_s,
        recurring_bursts=a.recurring_bursts,
        balanced_routing=a.routing == "balanced",
        starting_timeout_s=max(600.0, 5.0 * a.startup_s),
        # A load estimate is made every round; it is "old" only if rounds stall.
        max_load_age_s=max(30.0, 3.0 * a.interval_s),
        lookahead_extra_s=a.interval_s,
        advisory=a.advisory or not a.enabled,
    )


def new_cost_model(
    spec: VllmDeploymentSpec, checkpoint: dict[str, Any] | None
) -> tuple[CostModel, str]:
    """A cost model restored from ``checkpoint``, else seeded from initial coefficients, else new.

    Returns the model and where it came from (``checkpoint``, ``initialCoefficients``
    or ``new``); a checkpoint that does not restore is logged and ignored.
    """
    cm = spec.autoscaling.cost_model
    overrides = {
        "half_life_passes": cm.half_life_passes,
        "warmup_passes": cm.warmup_passes,
        "min_samples": cm.min_samples,
    }
    if checkpoint:
        try:
            return CostModel.from_dict(checkpoint, **overrides), "checkpoint"
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring a cost model checkpoint that does not restore: %s", exc)
    if cm.initial_coefficients:
        snapshot = prior_snapshot(cm.initial_coefficients, **overrides)  # type: ignore[arg-type]
        return CostModel.from_dict(snapshot, **overrides), "initialCoefficients"
    return CostModel(**overrides), "new"  # type: ignore[arg-type]


class DeploymentAutoscaler:
    """Listens to a deployment's pods, learns its cost model and decides its replica count."""

    def __init__(
        self,
        name: str,
        spec: VllmDeploymentSpec,
        *,
        checkpoint: dict[str, Any] | None = None,
        bursts: Sequence[tuple[float, int]] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_queued_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        """``checkpoint``: a cost model to start from; ``bursts``: recent bursts
        (wall-clock onset, peak need) the planner learns their period from again;
        ``max_queued_bytes``: received messages waiting for the model, beyond which
        they are shed (counted)."""
        self.name = name
        self.spec = spec
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.RLock()
        # Operator-side callers waiting for the lock (see _turn); its own small lock.
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self.queue = IngestQueue(max_bytes=max_queued_bytes, merge_span_s=merge_span(spec))
        self.strays = StrayStreams(expire_after_s=max(60.0, 4.0 * spec.autoscaling.interval_s))
        # The identities of the streams the pods publish (the model ingests only these).
        self._expected: set[tuple[str, int]] = set()
        self._last_ingest = clock()
        # Counts of streams no longer in the model (pods gone, model rebuilt), so that
        # the totals never go down when a stream leaves.
        self._retired: Counter[str] = Counter()
        self._rate_log = RateLimitedLog(log)
        cost_model, self.model_origin = new_cost_model(spec, checkpoint)
        self.model = self._new_model(spec, cost_model)
        # When the load window began to fill (the first batch since start or since the
        # window was rebuilt): until a whole window has passed since, its oldest part
        # holds no data, and a slope across it reads as a rise that is not there.
        self._window_filling_since: float | None = None
        # The share of the window's passes the load estimate saw (shed, lost: not).
        self.coverage = IngestCoverage(spec.autoscaling.load_window_s)
        self.planner = Planner(planner_policy(spec))
        if bursts:
            # Saved as wall-clock times; the planner decides on ``clock``.
            ago = self._wall_clock() - self._clock()
            self.planner.restore_burst_onsets([(t - ago, peak) for t, peak in bursts])
        self.pods = PodDirectory(spec.fpm_base_port, spec.data_parallel_size)
        self.subscriber = FpmSubscriber(
            self._on_batch,
            streams=self.model.streams,
            observe_streams=False,
            clock=clock,
            coalesce_s=RECEIVE_COALESCE_S,
        )
        self.subscriber.start()

    def _new_model(self, spec: VllmDeploymentSpec, cost_model: CostModel) -> DeploymentModel:
        a = spec.autoscaling
        load = LoadEstimator(window_s=a.load_window_s, stale_after_s=a.stale_after_s)
        return DeploymentModel(self.name, cost_model=cost_model, load=load, clock=self._clock)

    # -- subscriber thread -------------------------------------------------------

    def _on_batch(self, msgs: MessageBatch) -> None:
        """Sink of the subscriber: queue the batch with its arrival time, then ingest
        merged chunks while the lock is free (never waits for it)."""
        now = self._clock()
        if not self.queue.put(now, msgs.matrices):
            self._rate_log.warning(
                "queue-full",
                "%s: FPM messages arrive faster than they are ingested; shedding (counted)",
                self.name,
            )
        try:
            self._ingest_queued(now)
        finally:
            ROUNDS.wait_for_rounds()  # a round anywhere in the process goes first

    def _ingest_queued(self, now: float) -> None:
        """Ingest merged chunks while enough is queued and the lock is free."""
        while len(self.queue) >= INGEST_AT_MESSAGES or (
            len(self.queue) and now - self._last_ingest >= INGEST_AFTER_S
        ):
            if self._waiting or ROUNDS.running or not self._lock.acquire(blocking=False):
                # A round (of any deployment: it goes first) or a pod event wants the
                # CPU or the lock: it ingests, or the next batch will.
                return
            try:
                self._ingest_chunk(self.queue.chunk_messages)
                self._last_ingest = now
            finally:
                self._lock.release()

    # -- operator side -----------------------------------------------------------

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """The lock, for the operator's side (rounds, pod events, status).

        The subscriber thread takes the lock only when it is free and no one is
        waiting for it: Python's locks are not fair, and a thread that releases and
        re-takes one in a loop (ingesting a backlog chunk by chunk) would keep a
        waiting round out for as long as the backlog lasts.
        """
        with self._waiting_lock:
            self._waiting += 1
        self._lock.acquire()
        with self._waiting_lock:
            self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def reconfigure(self, spec: VllmDeploymentSpec) -> None:
        """Apply a changed spec: planner policy, load window, FPM ports; the fit is kept."""
        with self._turn():
            old = self.spec
            self.spec = spec
            self.queue.merge_span_s = merge_span(spec)
            self.coverage.window_s = spec.autoscaling.load_window_s
            if planner_policy(old) != planner_policy(spec):
                learned = self.planner.burst_onsets()
                self.planner = Planner(planner_policy(spec))
                self.planner.restore_burst_onsets(learned)
            a_old, a_new = old.autoscaling, spec.autoscaling
            if (a_old.load_window_s, a_old.stale_after_s) != (
                a_new.load_window_s,
                a_new.stale_after_s,
            ):
                self.ingest()
                keys = list(self.pods.endpoints.values())
                self._retire(self.model.streams.keys(), rejected=True)
                self.model = self._new_model(spec, self.model.cost_model)
                self._window_filling_since = None
                self.subscriber.streams = self.model.streams
                for key in keys:
                    self.model.add_stream(key)
            if (old.fpm_base_port, old.data_parallel_size) != (
                spec.fpm_base_port,
                spec.data_parallel_size,
            ):
                self._apply(self.pods.reconfigure(spec.fpm_base_port, spec.data_parallel_size))

    def observe_pod(self, pod: PodView) -> StreamChanges:
        """A pod of this deployment was added or changed: follow its streams."""
        with self._turn():
            changes = self.pods.observe(pod)
            self._apply(changes)
            return changes

    def forget_pod(self, pod_name: str) -> StreamChanges:
        """A pod of this deployment was deleted: drop its streams."""
        with self._turn():
            changes = self.pods.forget(pod_name)
            self._apply(changes)
            return changes

    def pod_mark(self) -> int:
        """Take before listing the pods; pass to :meth:`resync_pods` with the listing."""
        with self._turn():
            return self.pods.mark()

    def resync_pods(self, listed: Iterable[PodView], since: int) -> StreamChanges:
        """Match a full pod listing: drop pods whose deletion the watch missed."""
        with self._turn():
            changes = self.pods.resync(listed, since)
            self._apply(changes)
            return changes

    def _apply(self, changes: StreamChanges) -> None:
        if changes.removed:
            self.ingest()  # count what the leaving streams sent before they go
            self._retire(changes.removed.values())
        for endpoint, key in changes.removed.items():
            self.subscriber.remove_endpoint(endpoint)
            self.model.remove_stream(key)
            self._expected.discard(key)
        for endpoint, key in changes.added.items():
            self.model.add_stream(key)
            self._expected.add(key)
            self.subscriber.add_endpoint(endpoint)

    def ingest(self, max_messages: int | None = None) -> int:
        """Feed queued messages to the model in merged chunks at their arrival times:
        at most ``max_messages`` (default: what is queued now, not what arrives while
        this runs); returns the messages taken from the queue."""
        with self._turn():
            budget = len(self.queue) if max_messages is None else max_messages
            n = 0
            while n < budget:
                taken = self._ingest_chunk(budget - n)
                if taken == 0:
                    break
                n += taken
            return n

    def _ingest_chunk(self, max_messages: int) -> int:
        """Ingest one merged chunk (the lock held); returns the messages taken."""
        chunk = self.queue.take(max_messages)
        if chunk is None:
            return 0
        arrived, matrices = chunk
        if self._window_filling_since is None:
            self._window_filling_since = arrived
        self.model.ingest_matrices(self._pod_streams_only(matrices, arrived), arrived)
        return len(matrices)

    def _pod_streams_only(self, matrices: PassMatrices, now: float) -> PassMatrices:
        """The rows of streams a current pod backs; the others are counted as strays."""
        groups = matrices.groups
        known = [key in self._expected for key in groups.keys]
        if all(known):
            return matrices
        counts = np.bincount(groups.index, minlength=len(groups.keys))
        self.strays.observe(
            ((k, int(c)) for k, c, ok in zip(groups.keys, counts, known, strict=True) if not ok),
            now,
        )
        return matrices.select(np.asarray(known, dtype=bool)[groups.index])

    def _retire(self, keys: Iterable[tuple[str, int]], rejected: bool = False) -> None:
        """Move the counts of streams about to leave (or of the whole table) to the totals."""
        self._retired += self._stream_counts(keys, rejected)

    def _stream_counts(self, keys: Iterable[tuple[str, int]], rejected: bool) -> Counter[str]:
        """The counted fields of the streams ``keys`` of the table, and (``rejected``) its
        malformed frames by reason (those are per table, not per stream)."""
        counts: Counter[str] = Counter()
        streams = self.model.streams
        for state in (streams.get(k) for k in keys):
            if state is not None:
                for name in COUNTED_FIELDS:
                    counts[name] += int(getattr(state, name))
        if rejected:
            for reason, count in streams.rejected.items():
                counts[f"malformed:{reason}"] += int(count)
            for name in COUNTED_FIELDS:  # streams the table evicted to stay bounded
                counts[name] += int(streams.evicted_counts.get(name, 0))
        return counts

    def totals(self) -> dict[str, int]:
        """Messages, passes, lost, restarts, malformed frames by reason (``malformed:REASON``),
        messages shed (queue full) and stray messages (no pod's stream) since this
        autoscaler started; they never decrease."""
        with self._turn():
            totals = self._retired + self._stream_counts(self.model.streams.keys(), True)
            totals["shed_messages"] = self.queue.shed_messages
            totals["stray_messages"] = self.strays.messages
            return {name: int(totals[name]) for name in (*COUNTED_FIELDS, *totals)}

    def shedding(self, now: float) -> bool:
        """True when messages were shed within the last decision interval."""
        last = self.queue.last_shed
        return last is not None and now - last <= max(1.0, self.spec.autoscaling.interval_s)

    def stream_health(self, now: float) -> dict[str, Any]:
        """The stream table's health, with the ingest's shedding and the stray identities."""
        with self._turn():
            health = self.model.streams.health(now, per_stream=False)
            health["shedding"] = self.shedding(now)
            health["shed_messages"] = self.queue.shed_messages
            health["stray_streams"] = self.strays.active(now)
            health["stray_messages"] = self.strays.messages
            return health

    def replica_counts(self, now: float) -> ReplicaCounts:
        """Ready pods, and the start times (on this object's clock) of those still starting."""
        wall = self._wall_clock()
        starting = tuple(
            now - max(0.0, wall - created) if created is not None else now
            for created in self.pods.starting_since()
        )
        return ReplicaCounts(ready=self.pods.ready_count(), starting_since=starting)

    def _window_filled(self, now: float) -> bool:
        """Whether a whole load window (plus the bucket it began in) has data since the
        first batch after start or after the window was rebuilt."""
        since = self._window_filling_since
        load = self.model.load
        return since is not None and now - since >= load.window_s + load.bucket_s

    def decide(self, current_replicas: int | None = None) -> DecisionRound:
        """Ingest, estimate the load and (autoscaling enabled) ask the planner.

        ``current_replicas`` is the child Deployment's replica count: pods that it
        asked for but that do not exist yet count as starting.
        """
        with ROUNDS.round(), self._turn():
            # A backlog the subscriber thread did not keep up with: its oldest part is
            # shed (counted) rather than decided on late.
            self.queue.shed_oldest(ROUND_INGEST_MESSAGES, self._clock())
            ingested = self.ingest()
            now = self._clock()
            load = self.model.estimate(now)
            if not self._window_filled(now):
                load = without_trends(load)
            counts = self.replica_counts(now)
            known = counts.ready + len(counts.starting_since)
            if current_replicas is not None and current_replicas > known:
                counts = ReplicaCounts(
                    counts.ready, counts.starting_since + (now,) * (current_replicas - known)
                )
            totals = self.totals()
            unseen = max(totals["lost"], totals["shed_messages"])
            seen = self.coverage.observe(now, totals["messages"], unseen)
            cost_model = self.model.cost_model
            decision: Decision | None = None
            a = self.spec.autoscaling
            if a.enabled:
                mape = cost_model.quality.mape
                inputs = PlannerInputs(
                    predictor=cost_model,
                    model_ready=cost_model.ready,
                    model_mape=mape if math.isfinite(mape) else None,
                    load=load,
                    load_time=now,
                    replicas=counts,
                    slo=SloTargets(ttft_ms=a.slo.ttft_ms, itl_ms=a.slo.itl_ms),
                    min_replicas=a.min_replicas,
                    max_replicas=a.max_replicas,
                    engine=EngineLimits(
                        max_num_batched_tokens=self.spec.engine.max_num_batched_tokens,
                        max_num_seqs=self.spec.engine.max_num_seqs,
                        kv_capacity_tokens=self.spec.engine.kv_capacity_tokens,
                    ),
                    pod_startup_s=a.startup_s,
                    load_seen_fraction=seen,
                )
                decision = self.planner.decide(inputs, now)
            return DecisionRound(
                decision=decision,
                load=load,
                cost_model_snapshot=cost_model.to_dict(),
                stream_health=self.stream_health(now),
                endpoints=len(self.pods.endpoints),
                ready=counts.ready,
                starting=len(counts.starting_since),
                ingested_messages=ingested,
                totals=totals,
            )

    def close(self) -> None:
        """Stop listening; give the queue's bytes back to the process's budget."""
        self.subscriber.close()
        self.queue.clear()
