"""Planner: turns a step-time model and a load estimate into a replica count.

Pure and deterministic, no I/O: the same sequence of ``decide`` calls always gives
the same decisions. :meth:`Planner.decide` is a short sequence of named stages,
each in its own module and each returning a typed value with its reason
(:mod:`~stepscale_operator.planner_stages`); the binding stage's reason is the
decision's:

1. the fleet and the spec's bounds (here), and whether the data may be judged;
2. demand (:mod:`~stepscale_operator.demand`): the served load corrected by the
   queue's growth, the load one pod start-up ahead, the survivors' heavier mix;
3. measured latency (:mod:`~stepscale_operator.closed_loop`): the realized latency
   against the SLO and the model, the model's learned correction;
4. capacity need (:mod:`~stepscale_operator.capacity_need`): the fewest replicas
   whose predicted latency meets the SLO less a margin, with the out-of-reach rules;
5. floors: bursts (:mod:`~stepscale_operator.burst_floor`), then the backlog, a
   sustained measured miss (:mod:`~stepscale_operator.capacity_floors`);
6. the verdict (:mod:`~stepscale_operator.scale_verdict`): scale up, scale down
   once the stabilization window agrees, or hold.

The tunables are :class:`~stepscale_operator.planner_policy.PlannerPolicy`; the
capacity model is :mod:`stepscale_operator.latency_model`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict

from stepscale_operator.burst_floor import BurstMemory
from stepscale_operator.capacity_floors import apply_floors
from stepscale_operator.capacity_need import (
    Predict,
    capacity_need,
    latency_predictions,
    remembered_need,
)
from stepscale_operator.closed_loop import NO_FEEDBACK, Feedback, LatencyFeedback
from stepscale_operator.demand import DemandStage, forecast_load, with_demand
from stepscale_operator.latency_model import LatencyPrediction
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner_policy import PlannerPolicy
from stepscale_operator.planner_stages import (
    Decision,
    FleetNow,
    PlannerInputs,
    ReplicaCounts,
)
from stepscale_operator.scale_verdict import (
    StabilizationWindow,
    scale_down_or_hold,
    scale_up,
    unseen_load,
)

__all__ = [
    "Decision",
    "Planner",
    "PlannerInputs",
    "PlannerPolicy",
    "ReplicaCounts",
    "forecast_load",
    "with_demand",
]


class Planner:
    """Decides the replica count of one deployment; call :meth:`decide` each period."""

    def __init__(self, policy: PlannerPolicy | None = None) -> None:
        self.policy = policy or PlannerPolicy()
        self._window = StabilizationWindow(self.policy)
        self._demand = DemandStage(self.policy)
        self._bursts = BurstMemory(self.policy)
        self._feedback = LatencyFeedback(
            settle_s=self.policy.measured_miss_s,
            persistence_s=self.policy.measured_miss_s,
            max_correction=self.policy.max_latency_correction,
            tail_share=1.0 - self.policy.latency_quantile,
            steady_z=self.policy.burst_min_z,
            step_ratio=self.policy.burst_ratio,
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
        may be judged at all, the demand, the measured latency, the capacity it
        needs, the floors (bursts, backlog, a sustained miss, pods stuck starting,
        bounds), then scale up, scale down (the stabilization window) or hold. The
        binding stage gives the reason.
        """
        policy = self.policy
        fleet = self._fleet(inputs, now)
        record = self._base_record(inputs, fleet, now)
        self._window.observe_fleet(now, fleet, inputs.pod_startup_s)
        if fleet.total > fleet.high:
            return self._clamp_to_max(inputs, now, fleet, record)
        stale_reason = self._stale_reason(inputs, now)
        if stale_reason:
            return self._hold_or_raise_to_min(
                inputs, now, fleet, record, f"{stale_reason}; never scale down on missing data"
            )
        if not inputs.model_ready:
            return self._queue_rule(inputs, now, fleet, record)
        self._window.start(now)

        demand = self._demand.demand(inputs, now)
        feedback, predict = self._measured_latency(inputs, fleet, now)
        need = capacity_need(policy, inputs, demand, fleet, predict)
        # Bursts are judged, and remembered, on the measured load's need: not on a
        # forecast or a backlog allowance, which would keep an overshoot.
        assert self._window.first_decision_time is not None

        def resize(load: LoadEstimate) -> int:
            return remembered_need(policy, inputs, load, need.search_high, predict)

        bursts = self._bursts.floor(
            now,
            need.measured_need,
            demand.horizon_s,
            self._window.first_decision_time,
            demand.measured,
            resize,
        )
        floors = apply_floors(need, demand, bursts, feedback, fleet)
        for part in (demand, feedback, need, bursts, floors):
            record.update(part.record())
        confidence = max(0.0, 1.0 - 2.0 * (inputs.model_mape or 0.0)) * (
            1.0 if need.reachable else 0.5
        )
        if floors.needed + fleet.timed_out > fleet.total or fleet.total < fleet.low:
            verdict = scale_up(
                policy, self._window, inputs, now, fleet, demand, need, bursts, feedback, floors
            )
        else:
            verdict = scale_down_or_hold(
                policy, self._window, now, fleet, need, bursts, floors, unseen_load(inputs, policy)
            )
            record["stabilised_recommendation"] = self._window.highest()
        record["predictions_load"] = verdict.basis
        record["undoes_scale_down_s_ago"] = verdict.undoes_scale_down_s_ago
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

    # -- stages kept here: the fleet, the data's freshness, the closed loop's wiring -----

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

    def _measured_latency(
        self, inputs: PlannerInputs, fleet: FleetNow, now: float
    ) -> tuple[Feedback, Predict]:
        """The closed loop: the realized latency against the SLO and the model, and
        the predictions with the model's learned correction applied."""
        raw = latency_predictions(inputs, self.policy)
        assert inputs.load is not None
        if not self.policy.closed_loop or fleet.ready <= 0:
            return NO_FEEDBACK, raw
        feedback = self._feedback.observe(
            now, fleet.ready, fleet.starting, inputs.load, raw(fleet.ready, inputs.load), inputs.slo
        )
        if feedback.itl_correction == 1.0 and feedback.ttft_correction == 1.0:
            return feedback, raw  # its cache already holds this decision's batches
        return feedback, latency_predictions(inputs, self.policy, feedback)

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
        self._window.remember(now, desired)
        return self._finish(inputs, now, total, desired, why, 0.3, record, None, None)

    def _clamp_to_max(
        self, inputs: PlannerInputs, now: float, fleet: FleetNow, record: dict[str, object]
    ) -> Decision:
        """More replicas than ``max_replicas``: the user lowered the bound, so it applies now.

        A spec change, not a load decision: it is taken whatever the data (even
        stale), and reported as such, never as a hold.
        """
        hi = fleet.high
        self._window.remember(now, hi)
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
        self._window.remember(now, desired)
        return self._finish(inputs, now, total, desired, reason, confidence, record, None, None)

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
