"""Scaling policies the simulator compares: ours and the baselines people use today.

* ``ours``: the engines' FPM go through the operator's own
  :class:`~stepscale_operator.fpm_pipeline.DeploymentModel` (stream table, learned
  cost model, load estimator) into the :class:`~stepscale_operator.planner.Planner`.
* ``static``: a fixed count sized for the peak of the traffic.
* ``hpa``: Kubernetes HPA on waiting requests per replica (15 s sync, 10%
  tolerance, immediate scale-up, 300 s scale-down stabilization).
* ``dynamo``: a Dynamo-style load planner: every 5 s, +1 replica when predicted
  TTFT or ITL exceeds the SLO, -1 when both are under 80% of it. Replicas still
  starting count as coming capacity (the prediction spreads the load over ready
  + starting), so it neither overshoots during a start-up nor waits a whole
  start-up per step; no -1 while a replica starts, and no -1 that its own
  prediction says would miss the SLO (it would undo it on the next tick: a
  2 -> 1 -> 2 flap on small fleets).
* ``oracle``: knows the future arrival rate; starts replicas exactly one start-up
  time ahead, sized by the *ground-truth* capacity (the rate at which a simulated
  fleet of each size meets the attainment target on this traffic), and removes
  them as soon as the future allows (no stabilization): the lower bound on
  GPU-hours at the target attainment.
* ``oracle+window`` (a bound, not a baseline): the oracle, but it removes capacity
  only after the stabilization window the issue asks of a planner ("scale down
  slowly"). No policy that keeps that window can use fewer GPU-hours.
* ``hindsight`` (a reference): exact past load, no margin, never scales down.

Baselines get perfect information (the router's true arrivals and the noise-free
ground-truth step time), so any advantage of ``ours`` comes from the control law
and not from better data.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import ForwardPassMetrics
from stepscale_operator.fpm_pipeline import DeploymentModel
from stepscale_operator.latency_model import (
    EngineLimits,
    LatencyPrediction,
    PerReplicaLoad,
    SloTargets,
    StepTimePredictor,
    predict_latency,
)
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner import Planner, PlannerInputs, PlannerPolicy, ReplicaCounts
from stepscale_operator.simulator.fleet import FleetConfig, FleetView, SimResult
from stepscale_operator.simulator.ground_truth import StepTimeProfile
from stepscale_operator.simulator.report import request_latencies
from stepscale_operator.simulator.traffic import Traffic

if TYPE_CHECKING:  # capacity.py calibrates with the policies here
    from stepscale_operator.simulator.capacity import CapacityCurve


@dataclass(frozen=True)
class ScalingSetup:
    """What every policy is told about the deployment."""

    slo: SloTargets
    limits: EngineLimits
    startup_s: float
    min_replicas: int = 1
    max_replicas: int = 64

    def fleet_config(
        self, profile: StepTimeProfile, initial_replicas: int, seed: int
    ) -> FleetConfig:
        """The simulated fleet this deployment runs on, starting at ``initial_replicas``."""
        return FleetConfig(
            initial_replicas=initial_replicas,
            startup_s=self.startup_s,
            limits=self.limits,
            profile=profile,
            seed=seed,
        )


class _NoFpm:
    """Mixin for policies that do not read FPM."""

    wants_fpm = False

    def observe_fpm(self, msgs: Sequence[ForwardPassMetrics], now: float) -> None:
        """Ignored."""

    def replica_ready(self, worker_id: str, now: float) -> None:
        """Ignored."""

    def replica_stopped(self, worker_id: str, now: float) -> None:
        """Ignored."""


class StaticPolicy(_NoFpm):
    """A fixed replica count."""

    def __init__(self, replicas: int, name: str = "static") -> None:
        self.name = name
        self.interval_s = 60.0
        self.replicas = replicas

    def desired(self, view: FleetView) -> int:
        """Always the same count."""
        return self.replicas


class HpaPolicy(_NoFpm):
    """Kubernetes HPA (autoscaling/v2 defaults) on waiting requests per replica.

    The default target, 0.3 waiting requests per replica (30 s average), is where a
    static fleet on the scaled Azure trace just meets 99%: a well-tuned HPA.
    """

    def __init__(
        self,
        setup: ScalingSetup,
        target_waiting: float = 0.3,
        scale_down_window_s: float = 300.0,
        tolerance: float = 0.1,
    ) -> None:
        self.name = "hpa"
        self.interval_s = 15.0
        self.setup = setup
        self.target = target_waiting
        self.window_s = scale_down_window_s
        self.tolerance = tolerance
        self._recommendations: deque[tuple[float, int]] = deque()

    def desired(self, view: FleetView) -> int:
        """``ceil(current * metric / target)``, max over the window when scaling down."""
        current = view.ready + len(view.starting_since)
        if not self._recommendations:
            # The deployment ran at its current size before the HPA was created.
            self._recommendations.append((view.now, current))
        ratio = view.waiting_per_replica / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            wanted = current
        else:
            wanted = math.ceil(max(view.ready, 1) * ratio)
        # HPA's default scale-up limit: +100% or +4 pods per period, whichever is more.
        wanted = min(wanted, max(2 * current, current + 4))
        wanted = min(max(wanted, self.setup.min_replicas), self.setup.max_replicas)
        self._recommendations.append((view.now, wanted))
        while len(self._recommendations) > 1 and (
            self._recommendations[0][0] < view.now - self.window_s
        ):
            self._recommendations.popleft()
        if wanted >= current:
            return wanted
        return min(current, max(r for _, r in self._recommendations))


class DynamoPolicy(_NoFpm):
    """Dynamo-style: +-1 replica per tick on predicted TTFT/ITL versus the SLO."""

    def __init__(
        self,
        setup: ScalingSetup,
        predictor: StepTimePredictor,
        undershoot: float = 0.8,
        interval_s: float = 5.0,
        policy: PlannerPolicy | None = None,
        headroom: float = 0.0,
    ) -> None:
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom {headroom} must be in [0, 1)")
        # headroom > 0 aims below the SLO: +1 above (1 - headroom) of it, -1 under
        # undershoot * (1 - headroom). The baseline is headroom 0; the
        # benchmark sweeps it to compare GPU-hours at equal attainment.
        self.name = "dynamo" if headroom == 0.0 else f"dynamo@{headroom:g}"
        self.headroom = headroom
        self.interval_s = interval_s
        self.setup = setup
        self.predictor = predictor
        self.undershoot = undershoot
        self.policy = policy or PlannerPolicy()

    def desired(self, view: FleetView) -> int:
        """One step up when over the SLO, one down when well under it.

        Replicas still starting count as coming capacity (the prediction spreads
        the load over ready + starting): predicting on the ready ones alone would
        add one more every tick of the start-up time and overshoot, while waiting
        for each start-up before the next step would ramp one replica per
        start-up time. Down steps also need N-1 to be predicted within the SLO,
        else a tight undershoot band flaps N, N-1, N.
        """
        current = view.ready + len(view.starting_since)
        load = view.frontend_load
        if load is None or view.ready == 0:
            return current
        slo = self.setup.slo
        up_margin = self.headroom
        down_margin = 1.0 - self.undershoot * (1.0 - self.headroom)
        at_current = self._predict(load, current)
        if not at_current.within(slo, up_margin):
            wanted = current + 1
        elif (
            not view.starting_since
            and at_current.within(slo, down_margin)
            and current > 1
            and self._predict(load, current - 1).within(slo, up_margin)
        ):
            wanted = current - 1
        else:
            wanted = current
        return min(max(wanted, self.setup.min_replicas), self.setup.max_replicas)

    def _predict(self, load: LoadEstimate, replicas: int) -> LatencyPrediction:
        per = PerReplicaLoad.from_estimate(load, replicas)
        return predict_latency(self.predictor, per, self.setup.limits, self.policy, replicas)


def arrival_rate_series(
    traffic: Traffic, bucket_s: float = 10.0, window_s: float = 30.0
) -> npt.NDArray[np.float64]:
    """Requests per second over ``[k*bucket_s, k*bucket_s + window_s)`` for each slot."""
    n = max(1, math.ceil(traffic.duration_s / bucket_s))
    starts = np.arange(n, dtype=np.float64) * bucket_s
    lo = np.searchsorted(traffic.arrival_s, starts)
    hi = np.searchsorted(traffic.arrival_s, starts + window_s)
    span = np.maximum(np.minimum(window_s, traffic.duration_s - starts), bucket_s)
    return (hi - lo).astype(np.float64) / span


class OraclePolicy(_NoFpm):
    """Knows the future: provisions one start-up time ahead for the true arrival rate.

    Sized by the ground truth, not by the planner's model: ``capacity`` is the
    request rate at which a simulated fleet of each size meets the attainment
    target on this traffic (:mod:`~stepscale_operator.simulator.capacity`). Each
    ``bucket_s`` slot needs the smallest fleet serving its rate over the next
    ``window_s``; the oracle asks, at every tick, for the most any slot needs from
    now until a pod started now would be serving, and removes capacity as soon as
    the future allows (no stabilization). Pods still pay their start-up time, as for every
    policy; the oracle is the lower bound on GPU-hours at the target attainment.
    """

    def __init__(
        self,
        traffic: Traffic,
        setup: ScalingSetup,
        capacity: CapacityCurve,
        interval_s: float = 5.0,
        bucket_s: float = 10.0,
        window_s: float = 30.0,
    ) -> None:
        self.name = "oracle"
        self.interval_s = interval_s
        self.setup = setup
        self.bucket_s = bucket_s
        self.window_s = window_s
        self.capacity = capacity
        rates = arrival_rate_series(traffic, bucket_s, window_s)
        needs = capacity.replicas_for(rates, setup.max_replicas)
        self.needs = np.clip(needs, setup.min_replicas, setup.max_replicas)

    def desired(self, view: FleetView) -> int:
        """Max need from now until a pod started now would be serving, plus one period."""
        lo = int(view.now // self.bucket_s)
        hi = int((view.now + self.setup.startup_s + self.interval_s) // self.bucket_s) + 1
        window = self.needs[lo : max(hi, lo + 1)]
        if window.size == 0:
            return int(self.needs[-1])
        return int(window.max())


class WindowedOraclePolicy(OraclePolicy):
    """The oracle, scaling down only as slowly as a stabilization window allows.

    It knows the future and sizes by the ground truth with no margin, like the
    oracle, but gives capacity back only once every ask of the last
    ``stabilization_s`` allows it (the rule the issue asks of the planner: scale
    down slowly). So it bounds from below the GPU-hours of any policy that keeps
    such a window: on traffic that falls and rises again within minutes (bursts)
    that bound sits well above the oracle's.
    """

    def __init__(
        self,
        traffic: Traffic,
        setup: ScalingSetup,
        capacity: CapacityCurve,
        stabilization_s: float,
    ) -> None:
        super().__init__(traffic, setup, capacity)
        self.name = "oracle+window"
        self.stabilization_s = stabilization_s
        self._asks: deque[tuple[float, int]] = deque()

    def desired(self, view: FleetView) -> int:
        """The most the oracle asked for over the stabilization window."""
        self._asks.append((view.now, super().desired(view)))
        while self._asks[0][0] < view.now - self.stabilization_s:
            self._asks.popleft()
        return max(ask for _, ask in self._asks)


class HindsightPolicy(OraclePolicy):
    """Knows the past exactly, not the future: a reference for reacting without headroom.

    At every tick it asks for the most any slot needed so far (true arrival rates,
    ground-truth capacity; a slot's rate counts once its window has passed) and
    never gives capacity back, so a recurring burst always finds its capacity.
    What it misses is a rise faster than pods start that it sees for the first
    time; a policy does better there only by holding capacity nobody has asked
    for yet (a margin, a static peak size) or by knowing the future (the oracle).
    """

    def __init__(self, traffic: Traffic, setup: ScalingSetup, capacity: CapacityCurve) -> None:
        super().__init__(traffic, setup, capacity)
        self.name = "hindsight"

    def desired(self, view: FleetView) -> int:
        """The highest need of every slot whose window has passed (the first slot's at t=0)."""
        known = int((view.now - self.window_s) // self.bucket_s) + 1
        return int(self.needs[: max(known, 1)].max())


@dataclass
class PredictionCheck:
    """The planner's prediction for the measured load at the ready count."""

    time: float
    replicas: int
    ttft_mean_ms: float
    itl_mean_ms: float
    ttft_ms: float
    itl_ms: float
    prefill_tokens_per_decode: float = 0.0


@dataclass
class PlannerDrivenPolicy:
    """Ours: FPM -> DeploymentModel (cost model + load estimate) -> Planner.

    ``predictor``, when given, replaces the learned cost model (e.g. the
    ground-truth profile, to judge the planner's capacity model on its own).
    """

    setup: ScalingSetup
    planner: Planner = field(default_factory=Planner)
    model: DeploymentModel = field(default_factory=lambda: DeploymentModel("sim"))
    predictor: StepTimePredictor | None = None
    interval_s: float = 5.0
    name: str = "ours"
    wants_fpm: bool = True
    decisions: list[dict[str, object]] = field(default_factory=list)
    checks: list[PredictionCheck] = field(default_factory=list)

    def observe_fpm(self, msgs: Sequence[ForwardPassMetrics], now: float) -> None:
        """Feed one housekeeping tick's messages to the deployment model."""
        if msgs:
            self.model.ingest(msgs, now)

    def replica_ready(self, worker_id: str, now: float) -> None:
        """The operator registers a pod's stream once the pod is ready."""
        self.model.add_stream((worker_id, 0))

    def replica_stopped(self, worker_id: str, now: float) -> None:
        """The operator forgets a deleted pod's stream."""
        self.model.remove_stream((worker_id, 0))

    def desired(self, view: FleetView) -> int:
        """One planner decision from the model's current state."""
        load = self.model.estimate(view.now)
        cost = self.model.cost_model
        quality = cost.quality
        mape = quality.mape if math.isfinite(quality.mape) else None
        predictor: StepTimePredictor = cost if self.predictor is None else self.predictor
        ready = cost.ready or self.predictor is not None
        inputs = PlannerInputs(
            predictor=predictor,
            model_ready=ready,
            model_mape=mape,
            load=load,
            load_time=view.now,
            replicas=ReplicaCounts(view.ready, view.starting_since),
            slo=self.setup.slo,
            min_replicas=self.setup.min_replicas,
            max_replicas=self.setup.max_replicas,
            engine=self.setup.limits,
            pod_startup_s=self.setup.startup_s,
        )
        decision = self.planner.decide(inputs, view.now)
        self.decisions.append(
            {
                "t": view.now,
                "desired": decision.desired_replicas,
                "action": decision.action,
                "reason": decision.reason,
                "confidence": decision.confidence,
            }
        )
        if ready and load.complete and view.ready > 0:
            per = PerReplicaLoad.from_estimate(load, view.ready)
            pred = predict_latency(
                predictor, per, self.setup.limits, self.planner.policy, view.ready
            )
            if pred.feasible:
                self.checks.append(
                    PredictionCheck(
                        view.now,
                        view.ready,
                        pred.ttft_mean_ms,
                        pred.itl_mean_ms,
                        pred.ttft_ms,
                        pred.itl_ms,
                        pred.prefill_tokens_per_decode,
                    )
                )
        return decision.desired_replicas if decision.apply else decision.current_replicas


def sample_p99_error(
    values: npt.NDArray[np.float64], rng: np.random.Generator, draws: int = 200
) -> float:
    """The median relative error of a sample's p99 as an estimate of its population's:
    ``|p99(resample) - p99(sample)| / p99(sample)`` over bootstrap resamples of
    ``values`` (0 for fewer than two values). A floor under what a prediction that
    knew the true p99 exactly would still show against a window this small: the
    resamples cannot reach past the window's worst value, so it reads low (50
    lognormal values of sigma 1.5: 23% where the exact prediction is 47% off)."""
    if values.size < 2:
        return 0.0
    sample = float(np.percentile(values, 99))
    if sample <= 0.0:
        return 0.0
    resampled = rng.choice(values, size=(draws, values.size), replace=True)
    p99s = np.percentile(resampled, 99, axis=1)
    return float(np.median(np.abs(p99s - sample)) / sample)


def prediction_errors(
    policy: PlannerDrivenPolicy, result: SimResult, window_s: float = 30.0, min_requests: int = 50
) -> dict[str, float]:
    """Median relative error of the planner's predictions against the simulation.

    For each decision where the ready count did not change over the load
    estimator's window, the prediction for the measured load at that count is
    compared with the requests that arrived in the window (at least
    ``min_requests`` of them). Keys ``median_error_{ttft,itl}_{mean,p99}`` (of the
    absolute relative error), ``median_bias_...`` (signed: positive over-predicts)
    and ``windows`` (how many windows were compared). Also
    ``share_above_predicted_{ttft,itl}_p99``: of the compared windows' requests,
    pooled, the share above their window's predicted p99 (1% when calibrated). A
    30 s window of a few dozen long prompts has a sample p99 that falls short of the
    traffic's at the median window (0.90 of the 5-minute p99 prompt on the
    long-context and heavy-prompt scenarios), which the pooled share does not.
    ``sampling_error_{ttft,itl}_p99``: the median over the windows of
    :func:`sample_p99_error`, a floor under the error a prediction of each
    window's true p99 would show from the window's size alone (the p99 of 50
    requests is nearly their worst one).
    """
    lat = request_latencies(result)
    arrival = result.traffic.arrival_s
    errors: dict[str, list[float]] = {
        k: [] for k in ("ttft_mean", "itl_mean", "ttft_p99", "itl_p99")
    }
    above = {"ttft": [0, 0], "itl": [0, 0]}  # requests above the predicted p99, compared
    sampling: dict[str, list[float]] = {"ttft": [], "itl": []}
    rng = np.random.default_rng(0)  # the same resamples run to run
    history: list[tuple[float, int]] = []
    for check in policy.checks:
        history.append((check.time, check.replicas))
        recent = [n for t, n in history if t >= check.time - window_s]
        if len(recent) < window_s / policy.interval_s or len(set(recent)) != 1:
            continue
        lo, hi = np.searchsorted(arrival, [check.time - window_s, check.time])
        ttft = lat.ttft_ms[lo:hi]
        itl = lat.itl_ms[lo:hi]
        itl = itl[np.isfinite(itl) & (itl > 0)]
        ttft = ttft[np.isfinite(ttft)]
        if ttft.size < min_requests or itl.size < min_requests:
            continue
        pairs = {
            "ttft_mean": (check.ttft_mean_ms, float(ttft.mean())),
            "itl_mean": (check.itl_mean_ms, float(itl.mean())),
            "ttft_p99": (check.ttft_ms, float(np.percentile(ttft, 99))),
            "itl_p99": (check.itl_ms, float(np.percentile(itl, 99))),
        }
        for key, (pred, sim) in pairs.items():
            errors[key].append((pred - sim) / sim)
        for key, values, limit in (("ttft", ttft, check.ttft_ms), ("itl", itl, check.itl_ms)):
            above[key][0] += int((values > limit).sum())
            above[key][1] += int(values.size)
            sampling[key].append(sample_p99_error(values, rng))
    out = {f"median_error_{k}": float(np.median(np.abs(v))) for k, v in errors.items() if v}
    out.update({f"median_bias_{k}": float(np.median(v)) for k, v in errors.items() if v})
    for key, (count, total) in above.items():
        if total:
            out[f"share_above_predicted_{key}_p99"] = count / total
    for key, floors in sampling.items():
        if floors:
            out[f"sampling_error_{key}_p99"] = float(np.median(floors))
    out["windows"] = float(len(errors["itl_mean"]))
    return out
