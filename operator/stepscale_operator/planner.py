"""Planner: turns a step-time model and a load estimate into a replica count.

Pure and deterministic, no I/O. The only state a :class:`Planner` keeps is the
history of its own recommendations and needs (for the stabilization window and
burst memory), recent forecast ratios (for trend persistence) and measured
demand (for the long trend); the same sequence of ``decide`` calls always gives
the same decisions.

The capacity model (predicted TTFT and ITL of one replica for a given load) is
in :mod:`stepscale_operator.latency_model`.

The target is the smallest replica count whose predicted TTFT and ITL (at the
planning quantile) are within the SLO less a margin (grown by the model's error),
for the load expected one pod start-up ahead. :meth:`Planner.decide` is a short
sequence of stages, each returning a typed value with its reason
(:mod:`~stepscale_operator.planner_stages`): fleet, demand, measured latency
(the closed loop, :mod:`~stepscale_operator.closed_loop`), capacity need, burst
floor (:mod:`~stepscale_operator.burst_floor`), floors, then scale up, scale
down or hold; the binding stage's reason is the decision's. On top of the target:

* Out of reach: prompts whose prefill alone exceeds the TTFT SLO on an idle
  replica load the fleet but are not planned for (their share is reported); where
  no count meets the SLO at all, the target is what the most replicas achieve plus
  ``out_of_reach_slack``, never maxReplicas for nothing.
* Closed loop: predictions carry the correction learned from the realized latency,
  and a sustained realized miss adds a replica whatever the model says.

* Backlog: the load estimate measures *served* work. Once the queued prefill
  tokens exceed a share of the TTFT budget per replica, the fleet is behind: the
  demand is the served load plus the queue's growth over the same window (less
  its shrinking while a backlog drains, when the served rate overstates the
  arrivals and its rise is not extrapolated), and the replicas that drain the
  queue within one start-up time are added.
* Look-ahead: the trend raises the planned load only as far as it persisted over
  the last few decisions (a noisy one-window trend is ignored) and as far as the
  demand's slope over the last two minutes supports it, capped.
* Bursts: a need that jumps by ``burst_ratio`` within one start-up horizon rose
  faster than pods can start; its peak (on the queue-corrected demand, counted
  from the low point it rose from) is kept for ``burst_memory_s`` so a burst
  coming back soon finds its capacity already there. The planner's own first
  horizon (load windows and batches still filling) is no burst. Once bursts come
  at a steady period (:mod:`~stepscale_operator.burst_recurrence`), the next one's
  peak is provisioned one horizon before it is due, and nothing is held between.
* Scale-down: survivors must carry the measured load within the SLO less the
  margin plus hysteresis, for the whole stabilization window; the window
  remembers those measured floors, not the look-ahead's needs (the forecast counts
  for the decision at hand). The measured load is taken at the heavier of its
  own request mix and the mean mix over ``mix_memory_s``: a light mix passes, and
  the usual one returns at the same request rate faster than pods start.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.burst_floor import BurstMemory
from stepscale_operator.closed_loop import Feedback, LatencyFeedback
from stepscale_operator.latency_model import (
    EngineLimits,
    LatencyPrediction,
    PerReplicaLoad,
    SloTargets,
    StepTimePredictor,
    no_replicas_prediction,
    predict_latency,
    prefill_tokens_per_s,
    smallest_replicas_within_slo,
)
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner_stages import (
    BurstFloor,
    CapacityNeed,
    Demand,
    FleetNow,
    Floors,
    Verdict,
)


class _RememberedPredictions:
    """Caches a predictor's answers within one decision (the searches repeat batches)."""

    def __init__(self, predictor: StepTimePredictor) -> None:
        self._predictor = predictor
        self._seen: dict[ScheduledRequestMetrics, float] = {}

    def predict(self, sched: ScheduledRequestMetrics) -> float:
        """The wrapped predictor's answer, computed once per distinct batch."""
        value = self._seen.get(sched)
        if value is None:
            value = self._predictor.predict(sched)
            self._seen[sched] = value
        return value


@dataclass(frozen=True)
class ReplicaCounts:
    """Replicas serving now, and the start times of those still starting."""

    ready: int
    starting_since: tuple[float, ...] = ()


@dataclass(frozen=True)
class PlannerPolicy:
    """Tunables of the planner; defaults suit pods that start in about a minute."""

    margin: float = 0.10  # predicted latency must be within (1 - margin) * SLO
    hysteresis: float = 0.04  # extra headroom required before removing replicas
    model_error_weight: float = 0.25  # margin grows by this times the model's MAPE
    max_model_error_margin: float = 0.15
    max_surge: int = 8  # replicas added by one decision at most
    scale_down_step: int = 1  # replicas removed by one decision at most
    # Scale-down waits until every recommendation of this window allows it. HPA's
    # default is 300 s, for a rule that sees one metric; here each recommendation
    # already requires the survivors within the SLO less margin plus hysteresis on
    # the heavier request mix, so a shorter window suffices (Azure trace: 300 s held
    # ~2 replicas above the oracle through the whole peak, 1.28x vs 1.13x its
    # GPU-hours, at 99.8% vs 99.6% attainment).
    scale_down_stabilization_s: float = 120.0
    # A planner that has just started has not seen how the load varies: no scale-down
    # before it has decided for this long (with 120 s from the start, the Azure
    # trace's first minutes fell to 83% attainment).
    initial_hold_s: float = 300.0
    starting_timeout_s: float = 600.0  # a pod starting longer than this is not counted
    max_load_age_s: float = 30.0  # older load estimates are stale
    lookahead_extra_s: float = 10.0  # added to the pod start-up time (one decision period)
    # A trend measured over a short window is noisy: use half of it, let it raise
    # the planned load by at most 30%, and only as far as it persisted. (15% saves
    # ~10% GPU-hours on the Azure trace but misses diurnal ramps: 92% attainment.)
    trend_weight: float = 0.5
    max_forecast_ratio: float = 1.3
    trend_persistence_s: float = 15.0  # a rise counts as far as it held this long
    # ... and only as far as the demand's slope over this long a history shows it
    # (0: no such bound).
    trend_history_s: float = 120.0
    # Headroom for what no trend shows yet: the load can jump within one pod
    # start-up time (the scaled Azure trace moves 10-15% from one minute to the
    # next), so plan for at least this multiple of the measured load.
    min_lookahead_ratio: float = 1.1
    latency_quantile: float = 0.99  # TTFT/ITL are planned at this quantile
    # Priors for a load estimate without a measured prompt-length distribution (a
    # stream too young, a hand-made estimate): the quantile prompt is this many
    # times the mean, and the prefill service time has this CV^2. Once the streams
    # report prompt lengths, both come from the measured distribution.
    prompt_tail_ratio: float = 3.5
    service_cv2: float = 1.0
    # Where no replica count meets the SLO, plan for this much above what the most
    # replicas achieve (never pin at maxReplicas for a target no count reaches).
    out_of_reach_slack: float = 0.10
    # ... and where TTFT is out of reach, plan for at most this share of requests
    # more missing it than the most replicas would (half a point).
    out_of_reach_miss_share: float = 0.005
    # Closed loop (:mod:`~stepscale_operator.closed_loop`): the realized latency above
    # the SLO for this long at a settled fleet adds a replica even when the model
    # says all is well, and the model's learned correction is bounded by this factor
    # (closed_loop False: neither).
    closed_loop: bool = True
    measured_miss_s: float = 30.0
    max_latency_correction: float = 3.0
    # A router that balances requests (least outstanding, round robin) splits the
    # fleet's Poisson arrivals into per-replica streams with interarrival CV^2 of
    # about 1/replicas (exactly, for round robin: Erlang-n gaps); a random spread
    # (kube-proxy) leaves each replica Poisson (CV^2 = 1).
    balanced_routing: bool = True
    # The ITL tail is set by short requests: plan for one with this share of the
    # mean output length. Calibrated so the predicted p99 ITL of a 30 s window is
    # unbiased against the simulation (median signed error +0.4% on the Azure
    # trace); 0.14 over-predicted it by 11%, i.e. ~10% more replicas than the SLO needs.
    itl_tail_output_fraction: float = 0.25
    min_itl_tail_tokens: float = 4.0
    queue_per_replica_target: float = 4.0  # queue rule used before the model is ready
    # Backlog: the load estimate measures what was *served*; when the fleet falls
    # behind, the arrivals exceed it by the growth of the queued prefill tokens.
    # Demand = served + that growth, and once the queue holds more than
    # ``backlog_trigger`` of the TTFT target in prefill work per ready replica, add
    # the replicas that clear it within ``backlog_drain_s`` (0: the pod start-up time).
    backlog_trigger: float = 0.25
    backlog_drain_s: float = 0.0
    max_demand_ratio: float = 3.0
    # Bursts: a rise of the needed count by ``burst_ratio`` (and at least
    # ``burst_min_step`` replicas) within one look-ahead horizon is faster than pods
    # start, so reacting cannot serve it. After one, keep the peak need for
    # ``burst_memory_s`` (scale-down waits that long instead of the stabilization
    # window) so a recurring burst finds its capacity already there.
    # The request mix (tokens per request) changes without the request rate
    # changing, and a heavier mix can return within seconds: on the Azure
    # conversation trace the mean prompt went from ~830 to ~1240 tokens in 30 s at
    # an unchanged request rate, faster than pods start. Scale-down judges the
    # survivors on the measured request rate at the heavier of the recent mix and
    # the mean mix over this long a history (0: the recent mix only).
    mix_memory_s: float = 900.0
    burst_ratio: float = 1.6
    burst_min_step: int = 3
    burst_memory_s: float = 900.0
    # Bursts recur: after two onsets, the next burst's peak need is provisioned one
    # look-ahead horizon before it is due; once the gaps between the last
    # ``recurring_bursts`` onsets agree within ``burst_period_tolerance`` of their
    # mean, the memory is also let go between bursts (0: neither; the memory alone).
    recurring_bursts: int = 3
    burst_period_tolerance: float = 0.1
    advisory: bool = False  # decide and explain, but change nothing


@dataclass(frozen=True)
class PlannerInputs:
    """Everything one decision depends on."""

    predictor: StepTimePredictor
    model_ready: bool
    model_mape: float | None
    load: LoadEstimate | None
    load_time: float | None  # when ``load`` was computed (same clock as ``now``)
    replicas: ReplicaCounts
    slo: SloTargets
    min_replicas: int
    max_replicas: int
    engine: EngineLimits
    pod_startup_s: float


def forecast_load(load: LoadEstimate, horizon_s: float, max_ratio: float) -> LoadEstimate:
    """The load expected ``horizon_s`` ahead from its trend; never below today's load.

    A falling trend is ignored: the planner never removes capacity on a forecast,
    only on what it measured.
    """
    horizon = max(horizon_s, 0.0)

    def ahead(rate: float, trend: float) -> float:
        if rate <= 0.0:
            return max(trend, 0.0) * horizon
        return min(rate + max(trend, 0.0) * horizon, rate * max_ratio)

    prefill = ahead(load.prefill_tokens_per_s, load.prefill_tokens_per_s_trend)
    decode = ahead(load.decode_tokens_per_s, load.decode_tokens_per_s_trend)
    ratio = prefill / load.prefill_tokens_per_s if load.prefill_tokens_per_s > 0.0 else 1.0
    requests = load.prefill_requests_per_s * ratio
    if requests <= 0.0 and prefill > 0.0:
        requests = prefill / max(load.mean_prompt_tokens, 1.0)
    return replace(
        load,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        prefill_requests_per_s=requests,
        prefill_cached_tokens_per_s=load.prefill_cached_tokens_per_s * ratio,
    )


@dataclass(frozen=True)
class Decision:
    """One planner decision, explainable from ``inputs``.

    ``desired_replicas`` is what the planner recommends; ``apply`` is False when
    nothing should change (a hold, or advisory mode).
    """

    time: float
    desired_replicas: int
    current_replicas: int  # ready + starting, as the Deployment counts them
    action: str  # "scale_up", "scale_down" or "hold"
    apply: bool
    reason: str
    confidence: float
    # At the ready replicas and at the desired count (less pods stuck starting), both
    # on the load named by ``inputs["predictions_load"]`` ("planned": the forecast
    # a scale-up or hold is judged on; "measured": what a scale-down is judged on).
    # Zero replicas serve nothing: an infeasible "no_replicas" prediction. None when
    # no load was judged (stale data, no cost model, a clamp to the bounds).
    predicted_current: LatencyPrediction | None
    predicted_desired: LatencyPrediction | None
    inputs: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-able form for status, events and logs."""
        return asdict(self)


@dataclass
class _Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True)
class _Backlog:
    ratio: float  # arrivals over served (the demand ratio)
    extra: int  # replicas that drain the queue within the drain time
    queued: float  # queued prefill tokens now
    growth: float  # their change per second over the window


def with_demand(load: LoadEstimate, ratio: float) -> LoadEstimate:
    """``load`` with its request and token rates multiplied by ``ratio``."""
    if ratio == 1.0:
        return load
    return replace(
        load,
        prefill_tokens_per_s=load.prefill_tokens_per_s * ratio,
        prefill_requests_per_s=load.prefill_requests_per_s * ratio,
        prefill_cached_tokens_per_s=load.prefill_cached_tokens_per_s * ratio,
        decode_tokens_per_s=load.decode_tokens_per_s * ratio,
    )


class Planner:
    """Decides the replica count of one deployment; call :meth:`decide` each period."""

    def __init__(self, policy: PlannerPolicy | None = None) -> None:
        self.policy = policy or PlannerPolicy()
        self._history: list[_Recommendation] = []
        self._first_decision_time: float | None = None
        self._demand_history: list[tuple[float, float]] = []  # (time, measured demand rate)
        self._ratios: list[tuple[float, float]] = []  # (time, raw forecast ratio)
        # (time, prefill tokens per request), for the mix memory
        self._mix: list[tuple[float, float]] = []
        # (time, prompt-length histogram), for the usual shape
        self._shapes: list[tuple[float, tuple[float, ...], float]] = []
        self._bursts = BurstMemory(self.policy)
        self._feedback = LatencyFeedback(
            settle_s=self.policy.measured_miss_s,
            persistence_s=self.policy.measured_miss_s,
            max_correction=self.policy.max_latency_correction,
            tail_share=1.0 - self.policy.latency_quantile,
        )

    def burst_onsets(self) -> list[tuple[float, int]]:
        """The bursts the period is learned from: (onset, peak need), on the clock of
        ``decide``; what to save so a new planner need not learn them again."""
        return self._bursts.onsets()

    def restore_burst_onsets(self, onsets: Sequence[tuple[float, int]]) -> None:
        """Start from bursts seen before (see :meth:`burst_onsets`), on this clock."""
        self._bursts.restore(onsets)

    def decide(self, inputs: PlannerInputs, now: float) -> Decision:
        """One decision at time ``now`` (seconds, same clock as ``inputs.load_time``).

        The stages, in order: the fleet (and the spec's bounds), whether the data
        may be judged at all, the demand, the capacity it needs, the floors
        (backlog, bursts, pods stuck starting, bounds), then scale up, scale down
        (the stabilization window) or hold. The binding stage gives the reason.
        """
        fleet = self._fleet(inputs, now)
        record = self._base_record(inputs, fleet, now)
        if fleet.total > fleet.high:
            return self._clamp_to_max(inputs, now, fleet, record)
        stale_reason = self._stale_reason(inputs, now)
        if stale_reason:
            return self._hold_or_raise_to_min(
                inputs, now, fleet, record, f"{stale_reason}; never scale down on missing data"
            )
        if not inputs.model_ready:
            return self._queue_rule(inputs, now, fleet, record)
        # The stabilization window counts from the first decision made on the model
        # with fresh data: the queue rule and stale holds never justify scale-down.
        if self._first_decision_time is None:
            self._first_decision_time = now

        demand = self._demand(inputs, now)
        feedback, predict = self._measured_latency(inputs, fleet, now)
        need = self._capacity_need(inputs, demand, fleet, predict)
        # Bursts are judged, and remembered, on the measured load's need: not on a
        # forecast or a backlog allowance, which would keep an overshoot.
        bursts = self._bursts.floor(
            now, need.measured_need, demand.horizon_s, self._first_decision_time
        )
        floors = self._floors(need, demand, bursts, feedback, fleet)
        for part in (demand, feedback, need, bursts, floors):
            record.update(part.record())
        confidence = max(0.0, 1.0 - 2.0 * (inputs.model_mape or 0.0)) * (
            1.0 if need.reachable else 0.5
        )
        if floors.needed + fleet.timed_out > fleet.total or fleet.total < fleet.low:
            verdict = self._scale_up(inputs, now, fleet, demand, need, bursts, feedback, floors)
        else:
            verdict = self._scale_down_or_hold(now, fleet, need, bursts, floors, record)
        record["predictions_load"] = verdict.basis
        reason = f"{verdict.reason}; {need.caveat}" if need.caveat else verdict.reason
        load = demand.measured if verdict.basis == "measured" else demand.planned
        return self._finish(
            inputs,
            now,
            fleet.total,
            verdict.desired,
            reason,
            confidence,
            record,
            predict(fleet.ready, load),
            predict(verdict.serving_after, load),
        )

    # -- stages ------------------------------------------------------------------

    def _fleet(self, inputs: PlannerInputs, now: float) -> FleetNow:
        """The replicas now and the bounds (maxReplicas never below minReplicas)."""
        timed_out = sum(
            1 for t in inputs.replicas.starting_since if now - t > self.policy.starting_timeout_s
        )
        return FleetNow(
            ready=inputs.replicas.ready,
            starting=len(inputs.replicas.starting_since),
            timed_out=timed_out,
            low=inputs.min_replicas,
            high=max(inputs.max_replicas, inputs.min_replicas),
        )

    def _base_record(self, inputs: PlannerInputs, fleet: FleetNow, now: float) -> dict[str, object]:
        """What every decision records of its inputs."""
        return {
            **fleet.record(),
            "model_ready": inputs.model_ready,
            "model_mape": inputs.model_mape,
            "load": inputs.load.to_dict() if inputs.load is not None else None,
            "load_age_s": (now - inputs.load_time) if inputs.load_time is not None else None,
            "slo": asdict(inputs.slo),
            "min_replicas": inputs.min_replicas,
            "max_replicas": inputs.max_replicas,
            "engine": asdict(inputs.engine),
            "pod_startup_s": inputs.pod_startup_s,
            "policy": asdict(self.policy),
        }

    def _predictions(
        self, inputs: PlannerInputs
    ) -> Callable[[int, LoadEstimate], LatencyPrediction]:
        """Predicted latency at ``n`` replicas for a load (one cache per decision)."""
        predictor = _RememberedPredictions(inputs.predictor)
        # A prompt is out of reach when its prefill alone, on an idle replica, is
        # beyond what the planner aims for (the SLO less the margin): no count can
        # bring it within the target, so the TTFT quantile is planned over the rest.
        limit = inputs.slo.ttft_ms * (1.0 - self._margin(inputs))

        def prediction(n: int, load: LoadEstimate) -> LatencyPrediction:
            if n <= 0:
                return no_replicas_prediction()
            per = PerReplicaLoad.from_estimate(load, n)
            return predict_latency(
                predictor, per, inputs.engine, self.policy, n, ttft_limit_ms=limit
            )

        return prediction

    def _measured_latency(
        self, inputs: PlannerInputs, fleet: FleetNow, now: float
    ) -> tuple[Feedback, Callable[[int, LoadEstimate], LatencyPrediction]]:
        """The closed loop: the realized latency against the SLO and the model, and
        the predictions with the model's learned correction applied."""
        raw = self._predictions(inputs)
        assert inputs.load is not None
        if not self.policy.closed_loop or fleet.ready <= 0:
            feedback = Feedback(1.0, 1.0, None, None, None, None, 0.0, 0, "")
            return feedback, raw
        feedback = self._feedback.observe(
            now, fleet.ready, fleet.starting, inputs.load, raw(fleet.ready, inputs.load), inputs.slo
        )
        itl_c, ttft_c = feedback.itl_correction, feedback.ttft_correction
        if itl_c == 1.0 and ttft_c == 1.0:
            return feedback, raw

        def corrected(n: int, load: LoadEstimate) -> LatencyPrediction:
            pred = raw(n, load)
            if not pred.feasible:
                return pred
            return replace(
                pred,
                ttft_ms=pred.ttft_ms * ttft_c,
                itl_ms=pred.itl_ms * itl_c,
                ttft_mean_ms=pred.ttft_mean_ms * ttft_c,
                itl_mean_ms=pred.itl_mean_ms * itl_c,
            )

        return feedback, corrected

    def _margin(self, inputs: PlannerInputs) -> float:
        """The SLO margin, grown by the cost model's error."""
        policy = self.policy
        mape = inputs.model_mape if inputs.model_mape is not None else 0.0
        return policy.margin + min(
            policy.model_error_weight * max(mape, 0.0), policy.max_model_error_margin
        )

    def _demand(self, inputs: PlannerInputs, now: float) -> Demand:
        """The served load corrected by the queue's growth, and the load one horizon ahead."""
        policy = self.policy
        assert inputs.load is not None
        horizon = inputs.pod_startup_s + policy.lookahead_extra_s
        backlog = self._backlog(inputs)
        measured = with_demand(self._with_usual_shape(inputs.load, now), backlog.ratio)
        if backlog.ratio < 1.0:
            # Draining a backlog: the served rate rises as the queue empties, and
            # that rise is the drain, not arrivals; it must not be extrapolated.
            measured = replace(
                measured,
                prefill_tokens_per_s_trend=min(measured.prefill_tokens_per_s_trend, 0.0),
                decode_tokens_per_s_trend=min(measured.decode_tokens_per_s_trend, 0.0),
            )
        planned, forecast_ratio, long_ratio = self._persistent_forecast(measured, horizon, now)
        survivors, mix_ratio = self._with_heavier_mix(measured, now)
        reason = f"the load {horizon:.0f}s ahead"
        return Demand(
            measured=measured,
            planned=planned,
            survivors=survivors,
            horizon_s=horizon,
            demand_ratio=backlog.ratio,
            backlog_replicas=backlog.extra,
            queued_prefill_tokens=backlog.queued,
            queue_growth_tokens_per_s=backlog.growth,
            forecast_ratio=forecast_ratio,
            long_trend_ratio=long_ratio,
            mix_ratio=mix_ratio,
            reason=reason,
        )

    def _capacity_need(
        self,
        inputs: PlannerInputs,
        demand: Demand,
        fleet: FleetNow,
        predict: Callable[[int, LoadEstimate], LatencyPrediction],
    ) -> CapacityNeed:
        """Smallest counts within the SLO less the margin: for the planned load (scale
        up), the survivors' load with hysteresis (scale down), and the measured demand
        with headroom but no trend (what a burst memory keeps)."""
        policy = self.policy
        margin = self._margin(inputs)
        search_high = max(fleet.high, fleet.coming, 1)
        if demand.idle:
            return CapacityNeed(0, True, 0, 0, margin, search_high, 0.0, "nothing to serve", "")
        slo = inputs.slo

        def smallest(load: LoadEstimate, m: float) -> tuple[int, bool, str]:
            # Each search judges against what its own load and margin can reach.
            meets, words = self._reachable_slo(slo, load, m, search_high, predict)
            n, ok = smallest_replicas_within_slo(
                lambda k: meets(predict(k, load), m), 1, search_high
            )
            return n, ok, words

        needed, reachable, words = smallest(demand.planned, margin)
        # Removing capacity is judged on the measured load, not on a forecast:
        # survivors must carry today's load with the wider margin.
        down_ok, _, _ = smallest(demand.survivors, margin + policy.hysteresis)
        # What the measured demand needs, with the look-ahead headroom but no trend:
        # the need a burst memory keeps.
        steady = with_demand(demand.measured, max(policy.min_lookahead_ratio, 1.0))
        measured_need, _, _ = smallest(steady, margin)
        share = predict(max(needed, 1), demand.planned).unreachable_share
        caveats = []
        if share > 0.0:
            caveats.append(
                f"{share:.1%} of requests cannot meet the TTFT SLO at any replica count "
                "(their prefill alone exceeds it), planned for the rest"
            )
        if words:
            caveats.append(words)
        if not reachable:
            reason = f"SLO not reachable even at {search_high}"
        else:
            reason = f"{needed} needed for {demand.reason} within the SLO less {margin:.0%} margin"
        return CapacityNeed(
            needed,
            reachable,
            down_ok,
            measured_need,
            margin,
            search_high,
            share,
            reason,
            "; ".join(caveats),
        )

    def _reachable_slo(
        self,
        slo: SloTargets,
        load: LoadEstimate,
        margin: float,
        search_high: int,
        predict: Callable[[int, LoadEstimate], LatencyPrediction],
    ) -> tuple[Callable[[LatencyPrediction, float], bool], str]:
        """What "within the SLO" means for this load: ``slo`` itself, or, where no
        replica count meets it, what the most replicas achieve (and why, in words).

        A target no count reaches would pin the fleet at maxReplicas for nothing: a
        latency floor (the decode step alone, prompts whose prefill nearly fills the
        TTFT budget) does not move with the count. Then TTFT is judged by the share
        of requests predicted to miss it, which may exceed the most replicas' share
        by ``out_of_reach_miss_share``, and ITL may exceed the most replicas' by
        ``out_of_reach_slack``: the replicas that still help, and no more.
        """
        best = predict(search_high, load)
        if not best.feasible or best.within(slo, margin):
            return (lambda pred, m: pred.within(slo, m)), ""
        policy = self.policy
        itl_limit = max(
            slo.itl_ms, best.itl_ms * (1.0 + policy.out_of_reach_slack) / (1.0 - margin)
        )
        ttft_reached = best.ttft_ms <= slo.ttft_ms * (1.0 - margin)
        miss_limit = best.ttft_miss_share + policy.out_of_reach_miss_share

        def meets(pred: LatencyPrediction, m: float) -> bool:
            if not pred.feasible or pred.itl_ms > itl_limit * (1.0 - m):
                return False
            if ttft_reached:
                return pred.ttft_ms <= slo.ttft_ms * (1.0 - m)
            return pred.ttft_miss_share <= miss_limit

        parts = []
        if not ttft_reached:
            parts.append(
                f"TTFT: {best.ttft_miss_share:.1%} of the servable requests miss it even at "
                f"{search_high} replicas, planned for at most {miss_limit:.1%}"
            )
        if itl_limit > slo.itl_ms:
            parts.append(
                f"ITL: {best.itl_ms:.1f}ms at best, planned for within "
                f"{policy.out_of_reach_slack:.0%} of that"
            )
        return meets, "SLO out of reach at any count (" + "; ".join(parts) + ")"

    def _floors(
        self,
        need: CapacityNeed,
        demand: Demand,
        bursts: BurstFloor,
        feedback: Feedback,
        fleet: FleetNow,
    ) -> Floors:
        """The need with the backlog allowance, the burst floor and a sustained measured
        miss; the scale-down floor."""
        # What the stabilization window remembers: the measured load's floor (and a
        # burst's peak). The forecast's need counts for the decision at hand only:
        # remembered, the window's maximum of a noisy look-ahead would add its
        # headroom on top of the look-ahead's own (on the Azure trace the held count
        # sat 1-2 replicas above what any measured window needed).
        measured_floor = max(need.down_ok, bursts.floor)
        down_ok = max(need.down_ok, need.needed)
        load_floor = max(down_ok + fleet.timed_out, fleet.low)
        down_ok = max(down_ok, bursts.floor)
        needed = min(need.needed + demand.backlog_replicas, need.search_high)
        # A recurring burst due within a start-up: its peak is needed now.
        for_burst = bursts.prepared is not None and bursts.floor > needed
        if for_burst:
            needed = min(bursts.floor, need.search_high)
        # The realized latency missed the SLO for a while: more, whatever the model says.
        for_miss = feedback.floor > needed
        if for_miss:
            needed = min(feedback.floor, need.search_high)
        return Floors(needed, for_burst, for_miss, down_ok, measured_floor, load_floor)

    def _scale_up(
        self,
        inputs: PlannerInputs,
        now: float,
        fleet: FleetNow,
        demand: Demand,
        need: CapacityNeed,
        bursts: BurstFloor,
        feedback: Feedback,
        floors: Floors,
    ) -> Verdict:
        """More is needed (or the count is below minReplicas): how many, and why."""
        policy = self.policy
        total, lo, hi = fleet.total, fleet.low, fleet.high
        target = max(floors.needed + fleet.timed_out, lo)
        # The surge limits growth; the spec's bounds always apply.
        desired = max(min(target, total + policy.max_surge, hi), lo)
        self._remember(now, desired)
        if floors.needed + fleet.timed_out > total:
            head = "scale up" if desired > total else f"hold at maxReplicas {hi}"
            if floors.for_measured_miss:
                why = f"{head}: {feedback.reason}"
            elif floors.for_burst:
                assert bursts.prepared is not None
                why = f"{head}: {bursts.reason}; pods take {inputs.pod_startup_s:.0f}s to start"
            else:
                why = (
                    f"{head}: predicted latency at {fleet.coming} replicas exceeds the SLO "
                    f"less {need.margin:.0%} margin for {demand.reason}; "
                    f"{floors.needed} needed"
                )
        else:
            why = f"scale up to minReplicas {lo} (spec bound); {floors.needed} needed for " + (
                demand.reason
            )
        if demand.backlog_replicas:
            why += f" (incl. {demand.backlog_replicas} to drain the queued prefill backlog)"
        if fleet.timed_out:
            why += f", plus {fleet.timed_out} replacing pods stuck starting"
        if not need.reachable:
            why += f" ({need.reason})"
        if total < desired < target:
            why += f"; limited to {desired} by max surge/max replicas"
        return Verdict(desired, why, "planned", desired - fleet.timed_out)

    def _scale_down_or_hold(
        self,
        now: float,
        fleet: FleetNow,
        need: CapacityNeed,
        bursts: BurstFloor,
        floors: Floors,
        record: dict[str, object],
    ) -> Verdict:
        """Fewer may do: scale down once the whole stabilization window agrees, else hold."""
        policy = self.policy
        total, lo = fleet.total, fleet.low
        assert self._first_decision_time is not None
        candidate = max(floors.scale_down_floor + fleet.timed_out, lo)
        self._remember(now, max(floors.measured_floor + fleet.timed_out, lo))
        stabilised = max(r.replicas for r in self._history)
        window_covered = now - self._first_decision_time >= max(
            policy.scale_down_stabilization_s, policy.initial_hold_s
        )
        record["stabilised_recommendation"] = stabilised
        if candidate < total and window_covered and stabilised < total:
            desired = max(stabilised, candidate, total - policy.scale_down_step, lo)
            n_after = desired - fleet.timed_out
            why = (
                f"scale down {total} -> {desired}: the measured load split over {n_after} "
                f"replicas (now {fleet.ready} serving) is predicted within the SLO "
                f"less {need.margin + policy.hysteresis:.0%}, for the whole "
                f"{policy.scale_down_stabilization_s:.0f}s stabilization window"
            )
            return Verdict(desired, why, "measured", n_after)
        held_by_burst = floors.load_floor < total <= bursts.floor + fleet.timed_out
        if held_by_burst:
            why = f"hold: {bursts.reason}"
        elif candidate < total:
            why = (
                f"hold: {candidate} would do, but scale-down waits for the "
                f"{policy.scale_down_stabilization_s:.0f}s stabilization window "
                f"(highest recent recommendation {stabilised})"
            )
        elif not need.reachable:
            why = (
                f"hold at maxReplicas {fleet.high}: predicted latency exceeds the SLO less "
                f"{need.margin:.0%} margin even at {need.search_high} (SLO not reachable)"
            )
        else:
            why = f"hold: {total} replicas meet the SLO with margin; fewer would not"
        # lo <= total <= hi here: a hold never changes the count.
        return Verdict(total, why, "planned", fleet.coming)

    # -- pieces ------------------------------------------------------------------

    def _persistent_forecast(
        self, measured: LoadEstimate, horizon: float, now: float
    ) -> tuple[LoadEstimate, float, float | None]:
        """The trend forecast, raised only as far as it held over the persistence window;
        with the ratio it raised the load by and the long trend's bound.

        A trend fitted on a 30 s window is noisy; one that persists for a few
        decisions is a ramp. Fast up (a persistent rise is followed at once),
        never down on a forecast (see :func:`forecast_load`).
        """
        policy = self.policy
        ahead = forecast_load(measured, horizon * policy.trend_weight, policy.max_forecast_ratio)
        base = measured.prefill_tokens_per_s or measured.decode_tokens_per_s
        raised = ahead.prefill_tokens_per_s or ahead.decode_tokens_per_s
        ratio = raised / base if base > 0.0 else 1.0
        self._ratios.append((now, ratio))
        self._ratios = [r for r in self._ratios if r[0] >= now - policy.trend_persistence_s]
        held = min(r for _, r in self._ratios)
        long_ratio = self._long_trend_ratio(base, horizon, now)
        if long_ratio is not None:
            held = min(held, long_ratio)
        floor = max(policy.min_lookahead_ratio, 1.0)
        forecast_ratio = max(held, floor)
        if held >= ratio and ratio >= floor:
            return ahead, forecast_ratio, long_ratio
        return with_demand(measured, forecast_ratio), forecast_ratio, long_ratio

    def _with_heavier_mix(
        self, load: LoadEstimate, now: float
    ) -> tuple[LoadEstimate, float | None]:
        """``load`` at its request rate, with the heavier of its own prompt length and
        the mean prompt length over ``mix_memory_s``; and that ratio (None: no memory).

        Only scale-down is judged on it: prompts shorter than usual let the fleet
        shrink, and the usual ones coming back at the same request rate is a rise
        faster than pods start. The mean, not the peak, of the history: one window's
        heavy prompts are noise, the usual mix is what returns. The output side is
        not remembered: generated tokens per request also fall when a fleet's
        decode load falls at a steady prompt rate, which is a real drop in load.
        """
        window = self.policy.mix_memory_s
        rate = load.prefill_requests_per_s
        if window <= 0.0 or rate <= 0.0:
            return load, None
        prefill_each = load.prefill_tokens_per_s / rate
        self._mix.append((now, prefill_each))
        self._mix = [m for m in self._mix if m[0] >= now - window]
        usual_prefill = sum(m[1] for m in self._mix) / len(self._mix)
        ratio = max(usual_prefill / prefill_each, 1.0) if prefill_each > 0.0 else 1.0
        if ratio == 1.0:
            return load, ratio
        return (
            replace(
                load,
                prefill_tokens_per_s=load.prefill_tokens_per_s * ratio,
                prefill_cached_tokens_per_s=load.prefill_cached_tokens_per_s * ratio,
                mean_prompt_tokens=load.mean_prompt_tokens * ratio,
                # The decode context is mostly the prompt: it scales with it.
                mean_decode_context_tokens=load.mean_decode_context_tokens * ratio,
            ),
            ratio,
        )

    def _with_usual_shape(self, load: LoadEstimate, now: float) -> LoadEstimate:
        """``load`` with its prompt-length histogram pooled over ``mix_memory_s``.

        Rates change within seconds, the shape of the prompt lengths slowly; one
        window holds few prompts of the tail (at one long prompt a second, a 30 s
        window has 30), so its tail share swings with every long prompt and the
        need with it. Pooled over the mix memory, the tail is the traffic's.
        """
        window = self.policy.mix_memory_s
        if window <= 0.0 or not load.prompt_histogram or load.mean_prompt_tokens <= 0.0:
            return load
        self._shapes.append((now, load.prompt_histogram, load.mean_prompt_tokens))
        self._shapes = [h for h in self._shapes if h[0] >= now - window]
        pooled = tuple(sum(column) for column in zip(*(h for _, h, _ in self._shapes), strict=True))
        # Only the shape: the window's mean prompt and request rate stay the load's
        # (pooling them too cost the shared trace 1.5 points of attainment: the
        # usual mean lags the window's mix, and the request rate derived from it
        # under-states the short-request load).
        return replace(load, prompt_histogram=pooled)

    def _long_trend_ratio(self, rate: float, horizon: float, now: float) -> float | None:
        """How far the measured demand's slope over ``trend_history_s`` raises it by
        ``horizon`` (>= 1); None until half that history is known.

        The 30 s window's slope of a busy trace is mostly noise, and noise can hold
        for the persistence window; a real ramp shows over minutes too. On the Azure
        trace this bound cut GPU-hours by 10% at the same attainment.
        """
        span = self.policy.trend_history_s
        if span <= 0.0 or rate <= 0.0:
            return None
        self._demand_history.append((now, rate))
        self._demand_history = [d for d in self._demand_history if d[0] >= now - span]
        if now - self._demand_history[0][0] < 0.5 * span or len(self._demand_history) < 3:
            return None
        times = [t for t, _ in self._demand_history]
        rates = [r for _, r in self._demand_history]
        mean_t, mean_r = sum(times) / len(times), sum(rates) / len(rates)
        spread = sum((t - mean_t) ** 2 for t in times)
        slope = sum((t - mean_t) * (r - mean_r) for t, r in zip(times, rates, strict=True)) / spread
        return 1.0 + max(slope, 0.0) * horizon / rate

    def _backlog(self, inputs: PlannerInputs) -> _Backlog:
        """Demand ratio (arrivals over served) and replicas to drain the queue.

        Mass balance over the load estimate's window: arrivals = served + the
        queue's growth, both measured over the same window (the estimator's
        end-to-end queue change). A growing queue means the fleet is behind; a
        shrinking one means it is draining a backlog, and serves more than arrives.
        """
        policy = self.policy
        load = inputs.load
        assert load is not None
        queued = max(load.queued_prefill_tokens, 0.0)
        recent = max(queued, load.queued_prefill_tokens_mean)
        growth = load.queued_prefill_tokens_change_per_s
        served = max(load.prefill_tokens_per_s, 0.0)
        per_replica = prefill_tokens_per_s(inputs.predictor, inputs.engine)
        ready = max(inputs.replicas.ready, 1)
        trigger = policy.backlog_trigger * inputs.slo.ttft_ms / 1e3 * per_replica * ready
        ratio = 1.0
        extra = 0
        # One long prompt waiting is not a backlog of arrivals: the fleet is behind
        # only when more prompts wait than replicas serve (each takes one at a time).
        waiting = max(load.queued_prefill_requests, load.queued_prefill_requests_mean)
        if waiting <= ready:
            trigger = math.inf
        # Only a queue past the trigger means the fleet is or was behind; below it,
        # queue changes are the noise of normal batching.
        if recent > trigger and served > 0.0:
            ratio = (served + growth) / served
            # A step in the arrivals shows in the newest seconds' balance long before
            # the window's: react to it (rises only; a drain is judged on the window).
            ratio = max(ratio, load.prefill_demand_tokens_per_s_recent / served)
            ratio = min(max(ratio, 1.0 / policy.max_demand_ratio), policy.max_demand_ratio)
        if queued > trigger:
            drain = policy.backlog_drain_s or max(inputs.pod_startup_s, 1.0)
            extra = min(math.ceil(queued / (per_replica * drain)), policy.max_surge)
        return _Backlog(ratio, extra, queued, growth)

    def _stale_reason(self, inputs: PlannerInputs, now: float) -> str:
        load = inputs.load
        if load is None or inputs.load_time is None:
            return "no load estimate"
        if now - inputs.load_time > self.policy.max_load_age_s:
            return f"load estimate is {now - inputs.load_time:.0f}s old"
        if not load.complete:
            return f"metrics missing from {load.streams_missing} of {load.streams_total} streams"
        return ""

    def _queue_rule(
        self, inputs: PlannerInputs, now: float, fleet: FleetNow, record: dict[str, object]
    ) -> Decision:
        """Before the model is ready: scale up on queued requests, never down."""
        assert inputs.load is not None
        total, lo, hi = fleet.total, fleet.low, fleet.high
        queued = inputs.load.queued_prefill_requests + inputs.load.queued_decode_requests
        serving = max(inputs.replicas.ready, 1)
        per_replica = queued / serving
        record["queued_per_replica"] = per_replica
        target = self.policy.queue_per_replica_target
        needed = math.ceil(serving * per_replica / target) if per_replica > target else 0
        if needed <= total or total >= hi:
            capped = f" ({needed} wanted, at maxReplicas {hi})" if needed > total else ""
            return self._hold_or_raise_to_min(
                inputs,
                now,
                fleet,
                record,
                f"cost model not ready, {per_replica:.1f} queued requests per replica{capped}; "
                "the queue rule never scales down",
                confidence=0.3,
            )
        desired = max(min(needed, total + self.policy.max_surge, hi), lo)
        why = (
            f"scale up (cost model not ready): {per_replica:.1f} queued requests per "
            f"replica exceed the target {target:.1f}"
        )
        self._remember(now, desired)
        return self._finish(inputs, now, total, desired, why, 0.3, record, None, None)

    def _clamp_to_max(
        self, inputs: PlannerInputs, now: float, fleet: FleetNow, record: dict[str, object]
    ) -> Decision:
        """More replicas than ``max_replicas``: the user lowered the bound, so it applies now.

        A spec change, not a load decision: it is taken whatever the data (even
        stale), and reported as such, never as a hold.
        """
        hi = fleet.high
        self._remember(now, hi)
        why = (
            f"scale down to maxReplicas {hi}: clamped to maxReplicas, {fleet.total} replicas "
            "exceed the spec's bound"
        )
        return self._finish(inputs, now, fleet.total, hi, why, 1.0, record, None, None)

    def _hold_or_raise_to_min(
        self,
        inputs: PlannerInputs,
        now: float,
        fleet: FleetNow,
        record: dict[str, object],
        why: str,
        confidence: float = 0.0,
    ) -> Decision:
        """Keep the current count (``total <= max_replicas``), or raise it to ``min_replicas``.

        Used where the planner may not judge the load (missing or stale data, no
        cost model): it never goes below the current count.
        """
        total, lo = fleet.total, fleet.low
        desired = max(total, lo)
        reason = (
            f"scale up to minReplicas {lo} (spec bound); {why}"
            if desired > total
            else f"hold: {why}"
        )
        self._remember(now, desired)
        return self._finish(inputs, now, total, desired, reason, confidence, record, None, None)

    def _remember(self, now: float, replicas: int) -> None:
        self._history.append(_Recommendation(now, replicas))
        horizon = now - self.policy.scale_down_stabilization_s
        self._history = [r for r in self._history if r.time >= horizon]

    def _finish(
        self,
        inputs: PlannerInputs,
        now: float,
        total: int,
        desired: int,
        reason: str,
        confidence: float,
        record: dict[str, object],
        predicted_current: LatencyPrediction | None,
        predicted_desired: LatencyPrediction | None,
    ) -> Decision:
        if desired > total:
            action = "scale_up"
        elif desired < total:
            action = "scale_down"
        else:
            action = "hold"
        advisory = self.policy.advisory
        if advisory and action != "hold":
            reason = f"advisory, not applied: {reason}"
        return Decision(
            time=now,
            desired_replicas=desired,
            current_replicas=total,
            action=action,
            apply=action != "hold" and not advisory,
            reason=reason,
            confidence=round(confidence, 4),
            predicted_current=predicted_current,
            predicted_desired=predicted_desired,
            inputs=record,
        )
