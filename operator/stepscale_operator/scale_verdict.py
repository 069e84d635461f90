"""The verdict stage: scale up, scale down or hold, and why.

Scale-up aims for the floored need at once (within ``max_surge`` and the spec's
bounds). Scale-down removes at most ``scale_down_step`` replicas, and only once
every recommendation of the stabilization window (while pods start, at least a
start-up long) allows it and the planner has decided for ``initial_hold_s``:
survivors must carry the measured load within the SLO less the margin plus
hysteresis. The window remembers the measured floors, not the look-ahead's
needs. Pure and deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stepscale_operator.closed_loop import Feedback
from stepscale_operator.planner_policy import PlannerPolicy
from stepscale_operator.planner_stages import (
    BurstFloor,
    CapacityNeed,
    Demand,
    FleetNow,
    Floors,
    PlannerInputs,
    Verdict,
)


def stabilization_span_s(policy: PlannerPolicy, pod_startup_s: float, starting: int) -> float:
    """How far back scale-down looks: ``scale_down_stabilization_s``; while pods are
    starting, one look-ahead horizon (a pod start-up plus a decision period) where
    that is longer.

    The pods a recommendation asks for serve one start-up after it. A shorter
    window lets a scale-down undo a scale-up before its pods have served, and the
    pod added back takes a whole start-up again (pods that start in 180 s, the
    shared trace: 10 -> 9 replicas with 7 serving and the load still rising, then
    9 -> 10 again 15 s later). Once no pod is starting, the fleet serves at the
    size it was asked for and the usual window applies: held for a horizon
    regardless, a slow fall (diurnal) kept its replicas longer for nothing.
    """
    if starting <= 0:
        return policy.scale_down_stabilization_s
    return max(policy.scale_down_stabilization_s, policy.lookahead_horizon_s(pod_startup_s))


@dataclass
class _Recommendation:
    time: float
    replicas: int


class StabilizationWindow:
    """The recommendations of the window's span (:func:`stabilization_span_s`), and
    since when the planner has judged the load (scale-down waits for both)."""

    def __init__(self, policy: PlannerPolicy) -> None:
        self.policy = policy
        self.span_s = policy.scale_down_stabilization_s
        self._keep_s = policy.scale_down_stabilization_s  # the longest span it may need
        self._history: list[_Recommendation] = []
        self.first_decision_time: float | None = None
        self._last_down: float | None = None  # the last scale-down's time
        self._fleet: tuple[int, int] | None = None  # (ready, starting) last seen
        self._fleet_since = 0.0

    def start(self, now: float) -> None:
        """The first decision on the model with fresh data (the queue rule and stale
        holds never justify scale-down); later calls change nothing."""
        if self.first_decision_time is None:
            self.first_decision_time = now

    def observe_fleet(self, now: float, fleet: FleetNow, pod_startup_s: float) -> None:
        """Note the fleet each decision sees (a change restarts its settling time) and
        how long its pods take to start (while some are, the window spans at least
        that horizon)."""
        # A pod stuck starting past ``starting_timeout_s`` is not coming (the planner
        # replaces it): it does not hold the window open.
        coming = fleet.starting - fleet.timed_out
        self.span_s = stabilization_span_s(self.policy, pod_startup_s, coming)
        self._keep_s = stabilization_span_s(self.policy, pod_startup_s, 1)
        key = (fleet.ready, fleet.starting)
        if key != self._fleet:
            # The fleet as first seen was not changed by this planner: settled.
            self._fleet_since = now if self._fleet is not None else -math.inf
            self._fleet = key

    def fleet_unchanged_s(self, now: float) -> float:
        """How long the fleet has been as it is now."""
        return now - self._fleet_since

    def scaled_down(self, now: float) -> None:
        """A scale-down now: one the window judged safe for its span."""
        self._last_down = now

    def scaled_up(self, now: float) -> float | None:
        """A scale-up now. Within the window's span of the last scale-down it undoes
        that one: how long ago it was (None: it did not). The scale-down claimed the
        survivors enough for the whole window; asked back sooner, the claim failed
        (a flap), and the decision says so. Each scale-down is undone at most once:
        the scale-ups after the first follow a scale-up."""
        down, self._last_down = self._last_down, None
        if down is None or now - down > self.span_s:
            return None
        return now - down

    def remember(self, now: float, replicas: int) -> None:
        """One decision's recommendation; older ones than the window are dropped."""
        self._history.append(_Recommendation(now, replicas))
        oldest = now - self._keep_s
        self._history = [r for r in self._history if r.time >= oldest]

    def highest(self) -> int:
        """The highest recommendation in the window (0: none yet)."""
        if not self._history:
            return 0
        oldest = self._history[-1].time - self.span_s
        return max(r.replicas for r in self._history if r.time >= oldest)

    def judged_s(self, now: float) -> float:
        """How long the planner has judged the load (0 before its first decision)."""
        start = self.first_decision_time
        return 0.0 if start is None else now - start

    def first_scale_down_after_s(self) -> float:
        """How long the planner judges the load before its first scale-down: the
        initial hold, and a whole stabilization window at least."""
        return max(self.policy.scale_down_stabilization_s, self.policy.initial_hold_s)

    def covered(self, now: float) -> bool:
        """Whether the planner has judged the load for a whole window (and the initial hold)."""
        if self.first_decision_time is None:
            return False
        return self.judged_s(now) >= self.first_scale_down_after_s()


def scale_up(
    policy: PlannerPolicy,
    window: StabilizationWindow,
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
    total, lo, hi = fleet.total, fleet.low, fleet.high
    target = max(floors.needed + fleet.timed_out, lo)
    # The surge limits growth; the spec's bounds always apply.
    desired = max(min(target, total + policy.max_surge, hi), lo)
    window.remember(now, desired)
    undone_s = window.scaled_up(now) if desired > total else None
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
    if undone_s is not None:
        why += f"; this undoes the scale-down {undone_s:.0f}s ago"
    return Verdict(desired, why, "planned", desired - fleet.timed_out, undone_s)


def scale_down_pause_s(policy: PlannerPolicy, total: int) -> float:
    """How long the fleet must be unchanged before the next scale-down step: at most
    ``scale_down_share`` of the fleet per ``scale_down_settle_s``, the step at least.

    A small fleet waits the whole settling time after each step (one replica of 8 is
    an eighth of its capacity); a large one may take its one-replica steps sooner,
    as each is a small share of it.
    """
    if total <= 0 or policy.scale_down_share <= 0.0:
        return policy.scale_down_settle_s
    per_window = policy.scale_down_share * total
    return policy.scale_down_settle_s * min(1.0, policy.scale_down_step / per_window)


def unseen_load(inputs: PlannerInputs, policy: PlannerPolicy) -> str:
    """Why the measured load is a lower bound ("" when it is not): more than
    ``max_unseen_load_share`` of the window's passes never reached the estimate."""
    unseen = 1.0 - inputs.load_seen_fraction
    if unseen <= policy.max_unseen_load_share:
        return ""
    return (
        f"{unseen:.1%} of the passes sent in the load window were shed or lost "
        "(operator overloaded or ZMQ drops), so the load reads low"
    )


def scale_down_or_hold(
    policy: PlannerPolicy,
    window: StabilizationWindow,
    now: float,
    fleet: FleetNow,
    need: CapacityNeed,
    bursts: BurstFloor,
    floors: Floors,
    unseen: str = "",
) -> Verdict:
    """Fewer may do: scale down once the whole stabilization window agrees, else hold.

    ``unseen`` says why the measured load is a lower bound (passes shed or lost),
    "" when it is not: then no scale-down, and the window remembers the current
    count, so the low reading cannot justify one later either.
    """
    total, lo = fleet.total, fleet.low
    candidate = max(floors.scale_down_floor + fleet.timed_out, lo)
    measured = max(floors.measured_floor + fleet.timed_out, lo)
    window.remember(now, max(measured, total) if unseen else measured)
    stabilised = window.highest()
    window_covered = window.covered(now)
    unchanged_s = window.fleet_unchanged_s(now)
    settle_s = scale_down_pause_s(policy, total)
    settled = unchanged_s >= settle_s
    if candidate < total and window_covered and stabilised < total and settled:
        desired = max(stabilised, candidate, total - policy.scale_down_step, lo)
        n_after = desired - fleet.timed_out
        window.scaled_down(now)
        why = (
            f"scale down {total} -> {desired}: the measured load split over {n_after} "
            f"replicas (now {fleet.ready} serving) is predicted within the SLO "
            f"less {need.margin + policy.hysteresis:.0%}, for the whole "
            f"{window.span_s:.0f}s stabilization window"
        )
        return Verdict(desired, why, "measured", n_after)
    held_by_burst = floors.load_floor < total <= bursts.floor + fleet.timed_out
    if held_by_burst:
        why = f"hold: {bursts.reason}"
    elif candidate < total and unseen:
        why = (
            f"hold: {candidate} would do on the measured load, but {unseen}; "
            "never scale down on missing data"
        )
    elif candidate < total and window_covered and stabilised < total:
        why = (
            f"hold: {candidate} would do, but the fleet changed {unchanged_s:.0f}s ago; "
            f"the next step waits {settle_s:.0f}s for the load at this "
            "size to be measured"
        )
    elif candidate < total and stabilised < total:
        # The window agrees; what holds is the planner's own first minutes.
        why = (
            f"hold: {candidate} would do, but the planner has judged the load for "
            f"{window.judged_s(now):.0f}s; no scale-down before "
            f"{window.first_scale_down_after_s():.0f}s of it (how the load varies is not yet seen)"
        )
    elif candidate < total:
        why = (
            f"hold: {candidate} would do, but scale-down waits for the "
            f"{window.span_s:.0f}s stabilization window "
            f"(highest recent recommendation {stabilised})"
        )
    elif floors.for_backlog:
        why = (
            f"hold: {total} replicas; fewer would leave a queued prefill backlog "
            "that scale-up would add them back for"
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
