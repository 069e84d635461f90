"""Fleet of simulated engines: event loop, router, replica lifecycle, GPU-seconds.

One heap holds the end of every engine's pass in flight; arrivals come from the
traffic arrays in order; a 1 s housekeeping tick flushes the engines' FPM to the
policy (heartbeats for idle engines included) and samples queue lengths, and the
policy decides the replica count every ``policy.interval_s``.

Replicas cost GPU time from the moment they are requested (the pod holds the GPU
while it starts) until they stop; a removed replica first cancels a starting pod,
otherwise drains the least loaded one (no new requests, stops when empty).
The router sends each request to the ready replica with the fewest outstanding
requests (ties in turn).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import ForwardPassMetrics
from stepscale_operator.latency_model import EngineLimits
from stepscale_operator.load_types import (
    LoadEstimate,
    prompt_bin_tokens_of,
    prompt_histogram_of,
)
from stepscale_operator.simulator.engine import RequestTable, SimEngine
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B, StepTimeProfile
from stepscale_operator.simulator.traffic import Traffic

HOUSEKEEPING_S = 1.0
TIMELINE_EVERY_S = 10.0


@dataclass
class Replica:
    """One pod: its engine and lifecycle times."""

    index: int
    engine: SimEngine
    requested_s: float
    ready_s: float
    state: str = "starting"  # starting -> ready -> draining -> stopped
    stopped_s: float | None = None


@dataclass
class FleetView:
    """What a scaling policy may look at when it decides."""

    now: float
    ready: int
    starting_since: tuple[float, ...]
    waiting_per_replica: float  # mean over the last 30 s of queued requests per ready replica
    frontend_load: LoadEstimate | None  # arrivals seen by the router over the last window
    outstanding: int


class FpmTap(Protocol):
    """Receives every simulated pod's FPM (e.g. to publish it over ZMQ)."""

    def __call__(self, batch: Sequence[tuple[float, ForwardPassMetrics]]) -> None:
        """One housekeeping tick's messages of every live pod, in time order."""
        ...

    def replica_stopped(self, worker_id: str) -> None:
        """A pod stopped: its stream ends."""
        ...

    def close(self) -> None:
        """The simulated fleet is gone: end every stream."""
        ...


class ScalingPolicy(Protocol):
    """A replica-count policy driven by the fleet."""

    name: str
    interval_s: float
    wants_fpm: bool

    def observe_fpm(self, msgs: Sequence[ForwardPassMetrics], now: float) -> None:
        """Receive the engines' FPM published up to ``now``."""
        ...

    def replica_ready(self, worker_id: str, now: float) -> None:
        """A replica started serving (its stream will appear)."""
        ...

    def replica_stopped(self, worker_id: str, now: float) -> None:
        """A replica went away (its stream ends)."""
        ...

    def desired(self, view: FleetView) -> int:
        """Replica count wanted now (ready + starting)."""
        ...


@dataclass
class FleetConfig:
    """Simulation settings."""

    initial_replicas: int = 1
    startup_s: float = 60.0
    limits: EngineLimits = field(default_factory=EngineLimits)
    profile: StepTimeProfile = H100_LLAMA_8B
    seed: int = 0
    frontend_window_s: float = 60.0
    drain_timeout_s: float = 900.0  # stop counting after the traffic ends + this


@dataclass
class SimResult:
    """Everything a report needs from one run."""

    policy: str
    traffic: Traffic
    requests: RequestTable
    replica_of: npt.NDArray[np.int64]
    gpu_seconds: float
    timeline: dict[str, list[float]]
    decisions: list[dict[str, object]]
    steps: int
    fpm_messages: int
    # Per second, fleet-wide: [decode tokens, prompt tokens computed beside them]
    # (see SimEngine).
    beside_by_second: dict[int, list[int]] = field(default_factory=dict)


def _summed_by_second(parts: Iterable[dict[int, list[int]]]) -> dict[int, list[int]]:
    """Per-second [decode tokens, prompt tokens beside them] of the replicas, summed."""
    total: dict[int, list[int]] = {}
    for part in parts:
        for second, (decodes, beside) in part.items():
            cell = total.setdefault(second, [0, 0])
            cell[0] += decodes
            cell[1] += beside
    return total


class Fleet:
    """Runs one policy over one traffic."""

    def __init__(
        self,
        traffic: Traffic,
        policy: ScalingPolicy,
        config: FleetConfig | None = None,
        fpm_tap: FpmTap | None = None,
    ) -> None:
        self.traffic = traffic
        self.policy = policy
        self.config = config or FleetConfig()
        self.fpm_tap = fpm_tap
        self.requests = RequestTable.create(
            traffic.prompt_tokens.tolist(), traffic.output_tokens.tolist()
        )
        self.replica_of = np.full(len(traffic), -1, dtype=np.int64)
        self.replicas: list[Replica] = []
        self._heap: list[tuple[float, int, int]] = []  # (end time, replica index, version)
        self._version: list[int] = []
        self._pending: deque[int] = deque()  # arrivals while no replica was ready
        self._rr = 0
        self._waiting_samples: deque[tuple[float, float]] = deque()
        self.decisions: list[dict[str, object]] = []
        self.timeline: dict[str, list[float]] = {
            k: [] for k in ("t", "ready", "starting", "total", "arrival_rps", "outstanding")
        }
        self._arrivals_since_timeline = 0
        self.fpm_messages = 0

    # -- lifecycle -----------------------------------------------------------------

    def _emit_fpm(self) -> bool:
        return self.policy.wants_fpm or self.fpm_tap is not None

    def _add_replica(self, now: float, ready_now: bool) -> None:
        index = len(self.replicas)
        engine = SimEngine(
            f"sim-{index}",
            self.requests,
            self.config.limits,
            self.config.profile,
            seed=self.config.seed * 100_003 + index,
            emit_fpm=self._emit_fpm(),
        )
        ready_s = now if ready_now else now + self.config.startup_s
        replica = Replica(index, engine, now, ready_s)
        self.replicas.append(replica)
        self._version.append(0)
        if ready_now:
            self._make_ready(replica, now)
        else:
            heapq.heappush(self._heap, (ready_s, index, -1))

    def _make_ready(self, replica: Replica, now: float) -> None:
        if replica.state != "starting":
            return
        replica.state = "ready"
        replica.engine.last_emit_s = now - 1.0  # heartbeat at the next tick
        self.policy.replica_ready(replica.engine.worker_id, now)
        while self._pending:
            self._route(self._pending.popleft(), now)

    def _stop(self, replica: Replica, now: float) -> None:
        replica.state = "stopped"
        replica.stopped_s = now
        self._version[replica.index] += 1
        self.policy.replica_stopped(replica.engine.worker_id, now)
        if self.fpm_tap is not None:
            self.fpm_tap.replica_stopped(replica.engine.worker_id)

    def _apply(self, desired: int, now: float) -> None:
        active = [r for r in self.replicas if r.state in ("starting", "ready")]
        desired = max(desired, 1)
        for _ in range(desired - len(active)):
            self._add_replica(now, ready_now=False)
        surplus = len(active) - desired
        if surplus <= 0:
            return
        # Cancel pods still starting first (newest first): they serve nobody yet.
        for replica in sorted(
            (r for r in active if r.state == "starting"), key=lambda r: -r.requested_s
        ):
            if surplus == 0:
                return
            self._stop(replica, now)
            surplus -= 1
        ready = sorted(
            (r for r in active if r.state == "ready"), key=lambda r: r.engine.outstanding
        )
        # Keep at least one replica serving.
        for replica in ready[: min(surplus, len(ready) - 1)]:
            replica.state = "draining"
            if replica.engine.outstanding == 0:
                self._stop(replica, now)

    # -- requests ------------------------------------------------------------------

    def _route(self, rid: int, now: float) -> None:
        best: Replica | None = None
        best_load = math.inf
        n = len(self.replicas)
        for k in range(n):
            replica = self.replicas[(self._rr + k) % n]
            if replica.state != "ready":
                continue
            load = replica.engine.outstanding
            if load < best_load:
                best, best_load = replica, load
        if best is None:
            self._pending.append(rid)
            return
        self._rr = (best.index + 1) % n
        self.replica_of[rid] = best.index
        engine = best.engine
        engine.add_request(rid)
        if not engine.busy:
            self._start(best, now)
        else:
            new_end = engine.cut_run(now)
            if new_end is not None:
                self._version[best.index] += 1
                heapq.heappush(self._heap, (new_end, best.index, self._version[best.index]))

    def _start(self, replica: Replica, now: float) -> None:
        end = replica.engine.start_step(now)
        if end is not None:
            self._version[replica.index] += 1
            heapq.heappush(self._heap, (end, replica.index, self._version[replica.index]))

    # -- housekeeping --------------------------------------------------------------

    def _housekeeping(self, now: float, decide: bool) -> None:
        live = [r for r in self.replicas if r.state in ("ready", "draining")]
        if self._emit_fpm():
            batch: list[tuple[float, ForwardPassMetrics]] = []
            for replica in live:
                engine = replica.engine
                # Publish the part of a long decode run that is already done.
                new_end = engine.cut_run(now)
                if new_end is not None:
                    self._version[replica.index] += 1
                    heapq.heappush(
                        self._heap, (new_end, replica.index, self._version[replica.index])
                    )
                engine.heartbeat_if_idle(now)
                batch.extend(engine.outbox)
                engine.outbox.clear()
            batch.sort(key=lambda x: x[0])
            self.fpm_messages += len(batch)
            if self.fpm_tap is not None:
                self.fpm_tap(batch)
            if self.policy.wants_fpm:
                self.policy.observe_fpm([m for _, m in batch], now)
        ready = [r for r in live if r.state == "ready"]
        waiting = sum(len(r.engine.waiting) for r in ready)
        self._waiting_samples.append((now, waiting / max(len(ready), 1)))
        while self._waiting_samples and self._waiting_samples[0][0] < now - 30.0:
            self._waiting_samples.popleft()
        if decide:
            view = self._view(now, ready)
            desired = self.policy.desired(view)
            self._apply(desired, now)
        for replica in self.replicas:
            if replica.state == "draining" and replica.engine.outstanding == 0:
                self._stop(replica, now)

    def _view(self, now: float, ready: list[Replica]) -> FleetView:
        return FleetView(
            now=now,
            ready=len(ready),
            starting_since=tuple(r.requested_s for r in self.replicas if r.state == "starting"),
            waiting_per_replica=float(np.mean([w for _, w in self._waiting_samples])),
            frontend_load=self._frontend_load(now),
            outstanding=sum(r.engine.outstanding for r in ready),
        )

    def _frontend_load(self, now: float) -> LoadEstimate | None:
        window = self.config.frontend_window_s
        lo = int(np.searchsorted(self.traffic.arrival_s, now - window))
        hi = int(np.searchsorted(self.traffic.arrival_s, now))
        span = min(window, max(now, 1e-9))
        return frontend_estimate(
            self.traffic, lo, hi, span, streams=sum(r.state == "ready" for r in self.replicas)
        )

    # -- main loop -----------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        """Simulate until the traffic ends and the fleet has drained."""
        cfg = self.config
        for _ in range(max(cfg.initial_replicas, 1)):
            self._add_replica(0.0, ready_now=True)
        arrivals = self.traffic.arrival_s.tolist()
        n_req = len(arrivals)
        i = 0
        end_s = self.traffic.duration_s
        hard_stop = end_s + cfg.drain_timeout_s
        next_tick = HOUSEKEEPING_S
        next_decide = self.policy.interval_s
        next_timeline = 0.0
        heap = self._heap
        finished_seen = 0
        while True:
            t_arr = arrivals[i] if i < n_req else math.inf
            t_heap = heap[0][0] if heap else math.inf
            if t_arr <= t_heap and t_arr <= next_tick:
                self._arrivals_since_timeline += 1
                self._route(i, t_arr)
                i += 1
                continue
            if t_heap < next_tick:
                when, index, version = heapq.heappop(heap)
                replica = self.replicas[index]
                if version == -1:
                    self._make_ready(replica, when)
                    continue
                if version != self._version[index] or replica.state == "stopped":
                    continue
                replica.engine.finish_step()
                self._start(replica, when)
                continue
            now = next_tick
            next_tick += HOUSEKEEPING_S
            decide = now >= next_decide and now <= end_s
            if decide:
                next_decide += self.policy.interval_s
            self._housekeeping(now, decide)
            if now >= next_timeline:
                self._record_timeline(now)
                next_timeline += TIMELINE_EVERY_S
            if progress is not None:
                progress(min(now, end_s))
            if now >= end_s and i >= n_req:
                finished_seen = int(np.count_nonzero(~np.isnan(self.requests.finish_s)))
                if finished_seen == n_req or now >= hard_stop:
                    break
        for replica in self.replicas:
            if replica.state != "stopped":
                replica.stopped_s = next_tick
        gpu_s = sum(
            max(0.0, min(r.stopped_s if r.stopped_s is not None else end_s, end_s) - r.requested_s)
            for r in self.replicas
        )
        return SimResult(
            policy=self.policy.name,
            traffic=self.traffic,
            requests=self.requests,
            replica_of=self.replica_of,
            gpu_seconds=gpu_s,
            timeline=self.timeline,
            decisions=self.decisions,
            steps=sum(r.engine.steps for r in self.replicas),
            fpm_messages=self.fpm_messages,
            beside_by_second=_summed_by_second(r.engine.beside_by_second for r in self.replicas),
        )

    def _record_timeline(self, now: float) -> None:
        tl = self.timeline
        starting = sum(r.state == "starting" for r in self.replicas)
        ready = sum(r.state == "ready" for r in self.replicas)
        tl["t"].append(now)
        tl["ready"].append(float(ready))
        tl["starting"].append(float(starting))
        tl["total"].append(float(ready + starting))
        tl["arrival_rps"].append(self._arrivals_since_timeline / TIMELINE_EVERY_S)
        tl["outstanding"].append(
            float(sum(r.engine.outstanding for r in self.replicas if r.state != "stopped"))
        )
        self._arrivals_since_timeline = 0


def frontend_estimate(
    traffic: Traffic, lo: int, hi: int, span_s: float, streams: int = 1
) -> LoadEstimate | None:
    """The load of requests ``lo:hi`` spread over ``span_s`` seconds, as a router sees it.

    Decode context is the mean context over a request's decode: prompt plus half
    its output.
    """
    if span_s <= 0.0:
        return None
    prompt = traffic.prompt_tokens[lo:hi].astype(np.float64)
    output = traffic.output_tokens[lo:hi].astype(np.float64)
    n = prompt.size
    mean_prompt = float(prompt.mean()) if n else 0.0
    decode_tokens = float(output.sum())
    mean_ctx = float((output * (prompt + output / 2.0)).sum() / decode_tokens) if n else 0.0
    return LoadEstimate(
        window_s=span_s,
        streams_total=max(streams, 1),
        streams_missing=0,
        prefill_tokens_per_s=float(prompt.sum()) / span_s,
        prefill_cached_tokens_per_s=0.0,
        prefill_requests_per_s=n / span_s,
        decode_tokens_per_s=decode_tokens / span_s,
        mean_prompt_tokens=mean_prompt,
        mean_decode_context_tokens=mean_ctx,
        prefix_cache_hit_fraction=0.0,
        queued_prefill_requests=0.0,
        queued_prefill_tokens=0.0,
        queued_decode_requests=0.0,
        prompt_histogram=prompt_histogram_of(prompt) if n else (),
        prompt_bin_tokens=prompt_bin_tokens_of(prompt) if n else (),
        arrival_dispersion=_dispersion_per_second(traffic.arrival_s[lo:hi]),
    )


def _dispersion_per_second(arrival_s: npt.NDArray[np.float64]) -> float:
    """Variance over mean of arrivals per whole second (0: too few to tell)."""
    if arrival_s.size < 20:
        return 0.0
    start = float(arrival_s[0])
    seconds = int(arrival_s[-1] - start)
    if seconds < 3:
        return 0.0
    counts = np.bincount((arrival_s - start).astype(np.int64), minlength=seconds + 1)[:seconds]
    mean = float(counts.mean())
    return float(counts.var(ddof=1) / mean) if mean > 0.0 else 0.0
