"""Closed loop: the latency the fleet realized, against the SLO and the prediction.

The load estimate measures what the passes themselves show (see
:class:`~stepscale_operator.load_types.LoadEstimate`): the token-weighted
inter-token latency and the TTFT (queue wait by Little's law plus time in
prefill), each with a tail (TTFT's over (stream, second) cells, ITL's over
requests: :mod:`~stepscale_operator.request_itl_tail`). :class:`LatencyFeedback`
compares them with the model's prediction for the same load at the same ready
count, and keeps two things the planner uses:

* a learned correction per latency (ITL, TTFT): how much the model
  under-predicts the realized mean, smoothed over decisions at a settled fleet,
  and raised to the realized tail's ratio when a miss persists. Predictions are
  multiplied by it before they are judged against the SLO. It only corrects
  upwards: a model that over-predicts costs GPU-hours, not the SLO. It learns
  only from a window of one load: where the demand stepped since the last
  decision by a burst's ratio, beyond its sampling noise (see
  :mod:`~stepscale_operator.demand_rise`), the window holds two loads, and its
  realized latency, weighted to the busy seconds, is the step's, not the
  model's error at the window's mean load (a burst's first seconds on one
  replica taught x1.68, which then sized the burst at twice its need for two
  minutes). Learning resumes one window later. Both bounds are needed: a
  busy trace's windows tell a 2% drift from noise, and its learning on such
  drifts is the model's real lag on a ramp (pausing there cost the trace
  0.06 points); heavy-tailed windows swing by half at a steady rate.
* a sustained miss: the realized tail above the SLO for ``persistence_s`` of
  decisions at a settled fleet, even when the (corrected) model says all is
  well, asks for one more replica than serve now (again after each
  ``persistence_s`` while it lasts, as long as the last one reduced the miss).

TTFT misses of prompts no replica count serves in time (their prefill alone
exceeds the SLO) are no reason to add capacity: while the model sees any such
prompts, the measured TTFT tail is theirs and is not acted on.

Pure and deterministic: measurements in, a :class:`Feedback` out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from stepscale_operator.demand_rise import demand_ratio, demand_rise_z
from stepscale_operator.latency_model import LatencyPrediction, SloTargets
from stepscale_operator.load_types import LoadEstimate


@dataclass(frozen=True)
class Feedback:
    """What the realized latency says, for one decision."""

    itl_correction: float  # multiply predicted ITL by this (>= 1)
    ttft_correction: float  # multiply predicted TTFT by this (>= 1)
    measured_itl_ms: float | None  # realized tail (None: not measured)
    measured_ttft_ms: float | None
    measured_itl_mean_ms: float | None
    measured_ttft_mean_ms: float | None
    missing_for_s: float  # how long the realized tail has exceeded the SLO
    floor: int  # replicas a sustained miss asks for (0: none)
    reason: str

    def record(self) -> dict[str, object]:
        """Status/log fields."""
        return {
            "itl_correction": self.itl_correction,
            "ttft_correction": self.ttft_correction,
            "measured_itl_ms": self.measured_itl_ms,
            "measured_ttft_ms": self.measured_ttft_ms,
            "measured_itl_mean_ms": self.measured_itl_mean_ms,
            "measured_ttft_mean_ms": self.measured_ttft_mean_ms,
            "measured_miss_s": self.missing_for_s,
            "measured_miss_floor": self.floor,
        }


NO_FEEDBACK = Feedback(1.0, 1.0, None, None, None, None, 0.0, 0, "")
"""The closed loop off (or no replica serving): no correction, no floor."""


def with_correction(
    predict: Callable[[int, LoadEstimate], LatencyPrediction], feedback: Feedback
) -> Callable[[int, LoadEstimate], LatencyPrediction]:
    """``predict`` with the feedback's learned corrections applied to every feasible answer."""
    itl_c, ttft_c = feedback.itl_correction, feedback.ttft_correction
    if itl_c == 1.0 and ttft_c == 1.0:
        return predict

    def corrected(n: int, load: LoadEstimate) -> LatencyPrediction:
        pred = predict(n, load)
        if not pred.feasible:
            return pred
        return replace(
            pred,
            ttft_ms=pred.ttft_ms * ttft_c,
            itl_ms=pred.itl_ms * itl_c,
            ttft_mean_ms=pred.ttft_mean_ms * ttft_c,
            itl_mean_ms=pred.itl_mean_ms * itl_c,
        )

    return corrected


def _measured(value: float) -> float | None:
    return value if value > 0.0 else None


class LatencyFeedback:
    """Learns the correction and detects sustained misses (see the module docstring)."""

    def __init__(
        self,
        settle_s: float = 30.0,
        persistence_s: float = 30.0,
        smoothing: float = 0.2,
        max_correction: float = 3.0,
        tail_share: float = 0.01,
        steady_z: float = math.inf,
        step_ratio: float = math.inf,
    ) -> None:
        self.settle_s = settle_s  # the fleet unchanged this long: the window shows it
        self.persistence_s = persistence_s
        self.smoothing = smoothing
        self.max_correction = max_correction
        self.tail_share = tail_share  # 1 - the planning quantile
        # A demand step by this factor, beyond this many standard errors of noise,
        # pauses learning (inf: never).
        self.steady_z = steady_z
        self.step_ratio = step_ratio
        self._last_load: LoadEstimate | None = None
        self._load_steady_since = -math.inf
        self.itl_correction = 1.0
        self.ttft_correction = 1.0
        self._fleet: tuple[int, int] | None = None
        self._fleet_since = 0.0
        self._miss_since: float | None = None
        # How far above the SLO the tail was when the last replica was added for it.
        self._worst_at_step: float | None = None

    def observe(
        self,
        now: float,
        ready: int,
        starting: int,
        load: LoadEstimate,
        predicted: LatencyPrediction,
        slo: SloTargets,
    ) -> Feedback:
        """One decision's comparison. ``predicted``: the model's uncorrected
        prediction for ``load`` (the served load) at ``ready`` replicas."""
        if self._fleet != (ready, starting):
            self._fleet = (ready, starting)
            self._fleet_since = now
            self._miss_since = None
        itl_tail = _measured(load.realized_itl_tail_ms)
        ttft_tail = _measured(load.realized_ttft_tail_ms)
        itl_mean = _measured(load.realized_itl_mean_ms)
        ttft_mean = _measured(load.realized_ttft_mean_ms)
        settled = starting == 0 and now - self._fleet_since >= self.settle_s
        if self._demand_moved(load):
            self._load_steady_since = now
        self._last_load = load
        one_load = now - self._load_steady_since >= load.window_s
        if settled and one_load and predicted.feasible:
            self.itl_correction = self._learn(self.itl_correction, itl_mean, predicted.itl_mean_ms)
            self.ttft_correction = self._learn(
                self.ttft_correction, ttft_mean, predicted.ttft_mean_ms
            )
        itl_miss = itl_tail is not None and itl_tail > slo.itl_ms
        # Prompts that no count serves in time fill the measured TTFT tail by themselves.
        ttft_acts = predicted.unreachable_share <= 0.0
        ttft_miss = ttft_acts and ttft_tail is not None and ttft_tail > slo.ttft_ms
        floor = 0
        missing = 0.0
        reason = ""
        if settled and (itl_miss or ttft_miss):
            if self._miss_since is None:
                self._miss_since = now
            missing = now - self._miss_since
            worst = max(
                (itl_tail or 0.0) / slo.itl_ms if itl_miss else 0.0,
                (ttft_tail or 0.0) / slo.ttft_ms if ttft_miss else 0.0,
            )
            helped = self._worst_at_step is None or worst < 0.95 * self._worst_at_step
            if missing >= self.persistence_s and not helped:
                # The last replica added for a miss did not reduce it: more will not.
                reason = ""
                self._miss_since = now
            elif missing >= self.persistence_s:
                floor = ready + 1
                self._worst_at_step = worst
                self._miss_since = now  # the next step after another persistence
                what = []
                if itl_miss and itl_tail is not None:
                    self.itl_correction = self._raise(
                        self.itl_correction, itl_tail, predicted.itl_ms
                    )
                    what.append(f"ITL {itl_tail:.1f}ms (predicted {predicted.itl_ms:.1f}ms)")
                if ttft_miss and ttft_tail is not None:
                    self.ttft_correction = self._raise(
                        self.ttft_correction, ttft_tail, predicted.ttft_ms
                    )
                    what.append(f"TTFT {ttft_tail:.0f}ms (predicted {predicted.ttft_ms:.0f}ms)")
                reason = (
                    f"measured {' and '.join(what)} above the SLO for {missing:.0f}s at "
                    f"{ready} replicas; one more, and the model's correction is now "
                    f"ITL x{self.itl_correction:.2f}, TTFT x{self.ttft_correction:.2f}"
                )
        else:
            self._miss_since = None
            if settled:
                self._worst_at_step = None
        return Feedback(
            itl_correction=self.itl_correction,
            ttft_correction=self.ttft_correction,
            measured_itl_ms=itl_tail,
            measured_ttft_ms=ttft_tail,
            measured_itl_mean_ms=itl_mean,
            measured_ttft_mean_ms=ttft_mean,
            missing_for_s=missing,
            floor=floor,
            reason=reason,
        )

    def _demand_moved(self, load: LoadEstimate) -> bool:
        """Whether the demand rose or fell by the step ratio, beyond sampling noise,
        since the last load."""
        last = self._last_load
        if last is None or not math.isfinite(self.steady_z):
            return False
        if last.prefill_requests_per_s <= 0.0 and load.prefill_requests_per_s <= 0.0:
            return False  # no prompts in either window: nothing moved
        z = max(demand_rise_z(last, load), demand_rise_z(load, last))
        step = max(demand_ratio(last, load), demand_ratio(load, last))
        return z > self.steady_z and step >= self.step_ratio

    def _learn(self, current: float, measured: float | None, predicted: float) -> float:
        """One smoothing step towards measured / predicted (means), within bounds."""
        if measured is None or not predicted > 0.0:
            return current
        target = min(max(measured / predicted, 1.0), self.max_correction)
        return current + self.smoothing * (target - current)

    def _raise(self, current: float, measured: float, predicted: float) -> float:
        """At least the realized tail over the predicted one (uncorrected), bounded."""
        if not predicted > 0.0:
            return current
        return min(max(current, measured / predicted), self.max_correction)
