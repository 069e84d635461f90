"""The capacity stage: the fewest replicas whose predicted latency meets the SLO.

The target is the smallest replica count whose predicted TTFT and ITL (at the
planning quantile) are within the SLO less a margin (grown by the model's error).
Out of reach: prompts whose prefill alone exceeds the TTFT SLO on an idle replica
load the fleet but are not planned for (their share is reported); where no count
meets the SLO at all, the target is what the most replicas achieve plus
``out_of_reach_slack``, never maxReplicas for nothing. Where a latency quantile
meets the SLO only at many times the count that serves all but a few more
requests in time (prompts that nearly fill the TTFT budget, decodes a long
prefill delays whatever the count), a count whose predicted misses are within
``out_of_reach_miss_share`` of the most replicas' meets it.

The latency model itself is :mod:`stepscale_operator.latency_model`; this module
only searches it. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.closed_loop import NO_FEEDBACK, Feedback, with_correction
from stepscale_operator.demand import with_demand
from stepscale_operator.latency_model import (
    LatencyPrediction,
    PerReplicaLoad,
    SloTargets,
    StepTimePredictor,
    no_replicas_prediction,
    predict_latency,
    smallest_replicas_within_slo,
)
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner_policy import PlannerPolicy
from stepscale_operator.planner_stages import CapacityNeed, Demand, FleetNow, PlannerInputs

Predict = Callable[[int, LoadEstimate], LatencyPrediction]
"""Predicted latency of ``n`` replicas sharing a load."""


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


def planning_margin(policy: PlannerPolicy, model_mape: float | None) -> float:
    """The SLO margin, grown by the cost model's error."""
    mape = model_mape if model_mape is not None else 0.0
    return policy.margin + min(
        policy.model_error_weight * max(mape, 0.0), policy.max_model_error_margin
    )


def latency_predictions(
    inputs: PlannerInputs, policy: PlannerPolicy, feedback: Feedback = NO_FEEDBACK
) -> Predict:
    """Predicted latency at ``n`` replicas for a load (one cache per decision), with
    the closed loop's learned corrections (``feedback``) applied."""
    predictor = _RememberedPredictions(inputs.predictor)
    # A prompt is out of reach when its prefill alone, on an idle replica, exceeds
    # the SLO: no count can serve it in time, so the TTFT quantile is planned over
    # the rest. The others are planned for the SLO less the margin, or, where their
    # prefill alone exceeds that, for the SLO itself (see latency_model._ttft_tail).
    scale = 1.0 - planning_margin(policy, inputs.model_mape)
    # A correction c says the latencies run c times the model's: a share of the
    # model's requests above limit / c is the share above the limit.
    itl_c, ttft_c = feedback.itl_correction, feedback.ttft_correction

    def prediction(n: int, load: LoadEstimate) -> LatencyPrediction:
        if n <= 0:
            return no_replicas_prediction()
        per = PerReplicaLoad.from_estimate(load, n)
        return predict_latency(
            predictor,
            per,
            inputs.engine,
            policy,
            n,
            ttft_limit_ms=inputs.slo.ttft_ms * scale / ttft_c,
            ttft_slo_ms=inputs.slo.ttft_ms,
            itl_limit_ms=inputs.slo.itl_ms * scale / itl_c,
        )

    return with_correction(prediction, feedback)


def capacity_need(
    policy: PlannerPolicy,
    inputs: PlannerInputs,
    demand: Demand,
    fleet: FleetNow,
    predict: Predict,
) -> CapacityNeed:
    """Smallest counts within the SLO less the margin: for the planned load (scale
    up), the survivors' load with hysteresis (scale down), and the measured demand
    with headroom but no trend (what a burst memory keeps)."""
    margin = planning_margin(policy, inputs.model_mape)
    search_high = max(fleet.high, fleet.coming, 1)
    if demand.idle:
        return CapacityNeed(0, True, 0, 0, margin, search_high, 0.0, "nothing to serve", "")
    slo = inputs.slo
    needed, reachable, words = smallest_within_reach(
        policy, slo, demand.planned, margin, search_high, predict
    )
    # Removing capacity is judged on the measured load, not on a forecast:
    # survivors must carry today's load with the wider margin.
    down_ok, _, _ = smallest_within_reach(
        policy, slo, demand.survivors, margin + policy.hysteresis, search_high, predict
    )
    measured_need = steady_need(policy, inputs, demand.measured, search_high, predict)
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


def steady_need(
    policy: PlannerPolicy,
    inputs: PlannerInputs,
    measured: LoadEstimate,
    search_high: int,
    predict: Predict,
) -> int:
    """Replicas a measured demand needs with the look-ahead headroom but no trend,
    within the SLO less the margin: the need bursts are judged on."""
    margin = planning_margin(policy, inputs.model_mape)
    steady = with_demand(measured, max(policy.min_lookahead_ratio, 1.0))
    n, _, _ = smallest_within_reach(policy, inputs.slo, steady, margin, search_high, predict)
    return n


def remembered_need(
    policy: PlannerPolicy,
    inputs: PlannerInputs,
    remembered: LoadEstimate,
    search_high: int,
    predict: Predict,
) -> int:
    """Replicas a burst memory holds for a demand it remembers: what the model says
    meets the SLO itself, with neither the look-ahead headroom nor the margin.

    Both are for a load being served: the headroom for a rise no measurement shows
    yet, the margin for the model's error on what it measures. A remembered peak is
    a load that may come back; when it does, the planner's own need (margin and
    headroom included) asks for the rest at once, and the held replicas carry the
    burst at the SLO while those start. Held with the margin, the memory kept a
    replica the returning burst did not need where the margin decided the count
    (silence-burst, seed 0: 1.52 -> 1.33 GPU-hours for 0.11 point; on seed 1 the
    margin did not decide it and nothing moved; see docs/planner-history.md).
    """
    n, _, _ = smallest_within_reach(policy, inputs.slo, remembered, 0.0, search_high, predict)
    return n


def smallest_within_reach(
    policy: PlannerPolicy,
    slo: SloTargets,
    load: LoadEstimate,
    margin: float,
    search_high: int,
    predict: Predict,
) -> tuple[int, bool, str]:
    """The fewest replicas (up to ``search_high``) within what ``load`` can reach at
    ``margin`` (see :func:`slo_within_reach`): the count, whether one met it, and
    the out-of-reach words. Each search judges against its own load and margin."""
    meets, words = slo_within_reach(policy, slo, load, margin, search_high, predict)
    n, ok = smallest_replicas_within_slo(lambda k: meets(predict(k, load), margin), 1, search_high)
    return n, ok, words


def slo_within_reach(
    policy: PlannerPolicy,
    slo: SloTargets,
    load: LoadEstimate,
    margin: float,
    search_high: int,
    predict: Predict,
) -> tuple[Callable[[LatencyPrediction, float], bool], str]:
    """What "within the SLO" means for this load: ``slo`` itself, or, where no
    replica count meets it, what the most replicas achieve (and why, in words).

    A target no count reaches would pin the fleet at maxReplicas for nothing: a
    latency floor (the decode step alone, prompts whose prefill nearly fills the
    TTFT budget) does not move with the count. Then TTFT is judged by the share
    of requests predicted to miss it, which may exceed the most replicas' share
    by ``out_of_reach_miss_share``, and ITL may exceed the most replicas' by
    ``out_of_reach_slack``: the replicas that still help, and no more. Where the
    SLO is in reach, a count whose TTFT misses are that close to the most
    replicas' also meets it (with ITL within the SLO).
    """
    best = predict(search_high, load)
    if not best.feasible:
        return (lambda pred, m: pred.within(slo, m)), ""
    if best.within(slo, margin):
        # Reachable, but a TTFT quantile set by prompts whose prefill nearly fills the
        # budget falls only as the queueing vanishes: the count that meets it can be
        # many times the one that serves all but a few more of those prompts in time.
        # A count whose predicted TTFT misses are within ``out_of_reach_miss_share``
        # of the most replicas' does too: the replicas past it buy less than that.
        # The same for ITL: where a prefill delays the decodes of the replica the
        # router sends it to whatever the count, the ITL quantile falls slowly too.
        enough_ttft = best.ttft_miss_share + policy.out_of_reach_miss_share
        enough_itl = best.itl_miss_share + policy.out_of_reach_miss_share

        def meets_or_enough(pred: LatencyPrediction, m: float) -> bool:
            if pred.within(slo, m):
                return True
            return (
                pred.feasible
                and (pred.itl_ms <= slo.itl_ms * (1.0 - m) or pred.itl_miss_share <= enough_itl)
                and (pred.ttft_ms <= slo.ttft_ms * (1.0 - m) or pred.ttft_miss_share <= enough_ttft)
            )

        return meets_or_enough, ""
    itl_limit = max(slo.itl_ms, best.itl_ms * (1.0 + policy.out_of_reach_slack) / (1.0 - margin))
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
