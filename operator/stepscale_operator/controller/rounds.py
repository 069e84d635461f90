"""What one decision round reports besides status (pure): its event and its metrics.

* :func:`scaling_event`: the Kubernetes Event a decision deserves, if any;
  :class:`EventGate` keeps a round that repeats the previous recommendation
  from posting it again (advisory mode would otherwise post every interval).
* :class:`ScaleBackoff`: after the API server refuses a replica count, wait
  longer and longer before trying again, and report one failure per streak;
* :func:`observe_decision`: the decision counters (by action, and the scale-ups
  that undid a scale-down);
* :func:`observe_metrics`: the declared metrics of one deployment after a round.
  Counters advance by the increase of monotonic totals; a gauge whose value is
  gone (no prediction, no fitted coefficient) loses its series instead of
  keeping a stale value.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from stepscale_operator.controller.metrics import OperatorMetrics
from stepscale_operator.planner import Decision

COEFFICIENT_GAUGE = "stepscale_cost_model_coefficient_seconds"
# DeploymentAutoscaler.totals() names -> counters (malformed:REASON has a reason label).
TOTAL_COUNTERS = {
    "messages": "stepscale_fpm_messages_total",
    "passes": "stepscale_fpm_passes_total",
    "lost": "stepscale_fpm_lost_messages_total",
    "restarts": "stepscale_fpm_stream_restarts_total",
    "shed_messages": "stepscale_fpm_shed_messages_total",
    "stray_messages": "stepscale_fpm_stray_messages_total",
}
LOAD_GAUGES = (
    ("prefill", "prefillTokensPerSecond"),
    ("prefill_cached", "prefillCachedTokensPerSecond"),
    ("decode", "decodeTokensPerSecond"),
)


@dataclass(frozen=True)
class ScalingEvent:
    """A Kubernetes Event: ``type`` (Normal or Warning), reason, message."""

    type: str
    reason: str
    message: str


def scaling_event(decision: Decision, applied: bool) -> ScalingEvent | None:
    """The event for a decision: Scaled* when applied, ScaleFailed when applying it
    failed, Advise* when it is not to be applied (advisory, autoscaling off); None for a hold."""
    if decision.action == "hold":
        return None
    direction = "Up" if decision.action == "scale_up" else "Down"
    message = f"{decision.current_replicas} -> {decision.desired_replicas}: {decision.reason}"
    if applied:
        return ScalingEvent("Normal", f"Scaled{direction}", message[:1024])
    if decision.apply:
        return ScalingEvent("Warning", "ScaleFailed", message[:1024])
    return ScalingEvent("Normal", f"Advise{direction}", message[:1024])


@dataclass
class EventGate:
    """Lets an event through only when the round's recommendation differs from the last one.

    Applied scalings always pass (each one changes the replica count); an advice or
    a failure passes once per recommendation (reason, from, to), not every round.
    """

    last: dict[Any, tuple[str, int, int]] = field(default_factory=dict)

    def admit(self, key: Any, decision: Decision, event: ScalingEvent | None) -> bool:
        """Record this round's recommendation; True when ``event`` should be posted."""
        reason = event.reason if event is not None else "Hold"
        signature = (reason, decision.current_replicas, decision.desired_replicas)
        changed = self.last.get(key) != signature
        self.last[key] = signature
        if event is None:
            return False
        return changed or event.reason.startswith("Scaled")

    def forget(self, key: Any) -> None:
        """The deployment is no longer decided for here."""
        self.last.pop(key, None)


@dataclass
class _Refusals:
    count: int  # consecutive refused scalings
    retry_at: float  # no new attempt before this (monotonic seconds)
    message: str  # what the API server said the last time


@dataclass
class ScaleBackoff:
    """Backs off after the API server refuses to scale (a quota, an admission policy).

    The first refusal waits ``base_s``, each further one twice as long, up to
    ``max_s``; a successful scaling ends the streak. While it waits no scaling is
    attempted, whatever the planner's target, so that a refused count and its
    neighbours are not tried (and reported) by turns every round.
    """

    max_s: float = 300.0
    refusals: dict[Any, _Refusals] = field(default_factory=dict)

    def waiting(self, key: Any, now: float) -> str | None:
        """The last refusal's message while the next attempt must wait, else None."""
        r = self.refusals.get(key)
        if r is None or now >= r.retry_at:
            return None
        return f"{r.message}; next attempt in {r.retry_at - now:.0f} s"

    def refused(self, key: Any, now: float, base_s: float, message: str) -> bool:
        """Record a refusal; True when it starts a streak (the one to post an event for)."""
        r = self.refusals.get(key)
        count = 1 if r is None else r.count + 1
        delay = min(self.max_s, base_s * 2 ** (count - 1))
        self.refusals[key] = _Refusals(count, now + delay, message)
        return count == 1

    def succeeded(self, key: Any) -> None:
        """A scaling went through: the streak is over."""
        self.refusals.pop(key, None)

    forget = succeeded


def observe_decision(
    metrics: OperatorMetrics, deployment: str, decision: Decision, applied: bool
) -> None:
    """Count one decision by action and whether it was applied; an applied
    scale-up that undid the planner's last scale-down (its window had not passed)
    is also a flap."""
    metrics.counter("stepscale_scaling_decisions_total").labels(
        deployment, decision.action, str(applied).lower()
    ).inc()
    undone = decision.inputs.get("undoes_scale_down_s_ago")
    if applied and decision.action == "scale_up" and undone is not None:
        metrics.counter("stepscale_scale_downs_undone_total").labels(deployment).inc()


def observe_metrics(
    metrics: OperatorMetrics,
    deployment: str,
    *,
    totals: Mapping[str, int],
    previous: MutableMapping[str, int],
    status: Mapping[str, Any],
    endpoints: int,
    ready: int,
) -> None:
    """Update the declared metrics of ``deployment`` after a decision round.

    ``totals`` are :meth:`DeploymentAutoscaler.totals` (never decreasing while the
    autoscaler lives); ``previous`` holds the totals already counted and is updated.
    """
    _count_totals(metrics, deployment, totals, previous)
    streams = status.get("streams") or {}
    metrics.set_gauge("stepscale_fpm_streams", (deployment, "fresh"), streams.get("connected", 0))
    metrics.set_gauge("stepscale_fpm_streams", (deployment, "stale"), streams.get("stale", 0))
    stray = streams.get("strayStreams", 0)
    metrics.set_gauge("stepscale_fpm_streams", (deployment, "stray"), stray)
    metrics.set_gauge("stepscale_fpm_endpoints", (deployment,), endpoints)
    cm = status.get("costModel") or {}
    _coefficients(metrics, deployment, cm.get("coefficients") or [])
    metrics.set_gauge("stepscale_cost_model_mape_ratio", (deployment,), cm.get("mape"))
    metrics.set_gauge("stepscale_cost_model_r2_ratio", (deployment,), cm.get("r2"))
    metrics.set_gauge("stepscale_cost_model_samples", (deployment,), cm.get("samples", 0))
    metrics.set_gauge("stepscale_cost_model_ready", (deployment,), 1 if cm.get("ready") else 0)
    misfit = cm.get("misfitBuckets") or {}
    metrics.set_gauge("stepscale_cost_model_misfit_buckets", (deployment,), len(misfit))
    load = status.get("load") or {}
    for kind, name in LOAD_GAUGES:
        metrics.set_gauge("stepscale_load_tokens_per_second", (deployment, kind), load.get(name))
    predictions = status.get("predictions") or {}
    for at in ("current", "desired"):
        pred = predictions.get(at) or {}
        for gauge, name in (
            ("stepscale_predicted_ttft_seconds", "ttftMs"),
            ("stepscale_predicted_itl_seconds", "itlMs"),
        ):
            value = pred.get(name)
            metrics.set_gauge(gauge, (deployment, at), None if value is None else value / 1e3)
    for state, value in (
        ("ready", ready),
        ("current", status.get("replicas", 0)),
        ("desired", status.get("desiredReplicas", 0)),
    ):
        metrics.set_gauge("stepscale_replicas", (deployment, state), value)


def _count_totals(
    metrics: OperatorMetrics,
    deployment: str,
    totals: Mapping[str, int],
    previous: MutableMapping[str, int],
) -> None:
    for name, value in totals.items():
        delta = value - previous.get(name, 0)
        previous[name] = value
        if delta <= 0:  # nothing new (or totals restarted with a new autoscaler)
            continue
        if name.startswith("malformed:"):
            reason = name.split(":", 1)[1]
            metrics.counter("stepscale_fpm_malformed_total").labels(deployment, reason).inc(delta)
        elif name in TOTAL_COUNTERS:
            metrics.counter(TOTAL_COUNTERS[name]).labels(deployment).inc(delta)


def _coefficients(
    metrics: OperatorMetrics, deployment: str, coefficients: list[Mapping[str, Any]]
) -> None:
    """One series per fitted coefficient; series of coefficients without a value go."""
    wanted: dict[tuple[str, str], float] = {}
    for coef in coefficients:
        if coef.get("value") is not None and coef.get("name"):
            per = str(coef.get("unit", "")).split("/", 1)[-1]
            wanted[(str(coef["name"]), per)] = float(coef["value"])
    for labels in metrics.series(COEFFICIENT_GAUGE, deployment):
        if (labels.get("coefficient", ""), labels.get("per", "")) not in wanted:
            metrics.set_gauge(
                COEFFICIENT_GAUGE, (deployment, labels["coefficient"], labels["per"]), None
            )
    for (name, per), value in wanted.items():
        metrics.set_gauge(COEFFICIENT_GAUGE, (deployment, name, per), value)
