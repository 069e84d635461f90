"""The operator's own Prometheus metrics, declared once in :data:`METRICS`.

Observation code never creates a metric: it looks one up by name
(:meth:`OperatorMetrics.counter`, :meth:`~OperatorMetrics.gauge`,
:meth:`~OperatorMetrics.histogram`). Counters are totals (``_total``), gauges
current values; units are in the names; every series carries ``deployment``
(``namespace/name``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class MetricSpec:
    """One metric: name, type, help text, labels and (histograms) buckets."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ("deployment",)
    buckets: tuple[float, ...] = ()


D = ("deployment",)
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "stepscale_fpm_messages_total", "counter", "FPM messages accepted, heartbeats included"
    ),
    MetricSpec("stepscale_fpm_passes_total", "counter", "Forward passes received"),
    MetricSpec(
        "stepscale_fpm_lost_messages_total", "counter", "Messages missing from sequence gaps"
    ),
    MetricSpec("stepscale_fpm_stream_restarts_total", "counter", "Publisher restarts seen"),
    MetricSpec(
        "stepscale_fpm_malformed_total",
        "counter",
        "FPM frames rejected as malformed, by reason",
        (*D, "reason"),
    ),
    MetricSpec(
        "stepscale_fpm_shed_messages_total",
        "counter",
        "Received messages shed because the operator fell behind (its queue is bounded in bytes)",
    ),
    MetricSpec(
        "stepscale_fpm_stray_messages_total",
        "counter",
        "Messages from identities no current pod backs (in flight at a deletion, or no pod)",
    ),
    MetricSpec("stepscale_fpm_streams", "gauge", "FPM streams by state", (*D, "state")),
    MetricSpec("stepscale_fpm_endpoints", "gauge", "FPM endpoints subscribed to"),
    MetricSpec(
        "stepscale_cost_model_coefficient_seconds",
        "gauge",
        "Fitted step-time coefficient, seconds per unit of its feature",
        (*D, "coefficient", "per"),
    ),
    MetricSpec(
        "stepscale_cost_model_mape_ratio",
        "gauge",
        "Prequential mean absolute percentage error of the step-time model (0.05 = 5%)",
    ),
    MetricSpec("stepscale_cost_model_r2_ratio", "gauge", "Prequential R^2 of the step-time model"),
    MetricSpec("stepscale_cost_model_samples", "gauge", "Passes the step-time model learned"),
    MetricSpec("stepscale_cost_model_ready", "gauge", "1 when the step-time model is trusted"),
    MetricSpec(
        "stepscale_cost_model_misfit_buckets",
        "gauge",
        "Kinds of pass (coverage buckets) the step-time model is far off in, learned "
        "without the stall gate until it catches up",
    ),
    MetricSpec(
        "stepscale_load_tokens_per_second",
        "gauge",
        "Measured load, tokens per second, by kind (prefill, prefill_cached, decode)",
        (*D, "kind"),
    ),
    MetricSpec(
        "stepscale_predicted_ttft_seconds",
        "gauge",
        "Predicted time to first token at the planning quantile, at the current or the "
        "desired replica count (label at)",
        (*D, "at"),
    ),
    MetricSpec(
        "stepscale_predicted_itl_seconds",
        "gauge",
        "Predicted inter-token latency at the planning quantile, at the current or the "
        "desired replica count (label at)",
        (*D, "at"),
    ),
    MetricSpec(
        "stepscale_replicas", "gauge", "Replicas by state (ready, current, desired)", (*D, "state")
    ),
    MetricSpec(
        "stepscale_scaling_decisions_total",
        "counter",
        "Planner decisions by action (scale_up, scale_down, hold) and whether applied",
        (*D, "action", "applied"),
    ),
    MetricSpec(
        "stepscale_scale_downs_undone_total",
        "counter",
        "Applied scale-ups that undid the planner's last scale-down within its "
        "stabilization window (flaps)",
    ),
    MetricSpec(
        "stepscale_decision_duration_seconds",
        "histogram",
        "Time of one decision round up to the decision: reading the child Deployment "
        "(re-creating it if it was deleted), ingesting the queued FPM messages, estimating "
        "the load and planning; applying the replica count and writing status are not included",
        D,
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    ),
    MetricSpec("stepscale_spec_errors_total", "counter", "Reconciles refused for an invalid spec"),
    MetricSpec(
        "stepscale_kubernetes_api_errors_total",
        "counter",
        "Kubernetes API calls that failed, by operation",
        (*D, "operation"),
    ),
)

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


class OperatorMetrics:
    """The metrics of :data:`METRICS`, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._by_name: dict[str, Counter | Gauge | Histogram] = {}
        for spec in METRICS:
            cls = _KINDS[spec.kind]
            # prometheus-client adds "_total" to counters itself.
            name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
            if spec.kind == "histogram":
                metric: Counter | Gauge | Histogram = Histogram(
                    name, spec.help, spec.labels, registry=self.registry, buckets=spec.buckets
                )
            else:
                metric = cls(name, spec.help, spec.labels, registry=self.registry)
            self._by_name[spec.name] = metric

    def _get(self, name: str, kind: type) -> Counter | Gauge | Histogram:
        metric = self._by_name.get(name)
        if metric is None or not isinstance(metric, kind):
            raise KeyError(f"{name} is not a declared {kind.__name__.lower()} (see METRICS)")
        return metric

    def counter(self, name: str) -> Counter:
        """The declared counter ``name``."""
        metric = self._get(name, Counter)
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str) -> Gauge:
        """The declared gauge ``name``."""
        metric = self._get(name, Gauge)
        assert isinstance(metric, Gauge)
        return metric

    def histogram(self, name: str) -> Histogram:
        """The declared histogram ``name``."""
        metric = self._get(name, Histogram)
        assert isinstance(metric, Histogram)
        return metric

    def set_gauge(self, name: str, labels: tuple[str, ...], value: float | None) -> None:
        """Set a gauge series, or remove it when ``value`` is None (no stale values)."""
        gauge = self.gauge(name)
        if value is None:
            gauge.remove(*labels)
        else:
            gauge.labels(*labels).set(value)

    def series(self, name: str, deployment: str) -> list[dict[str, str]]:
        """Label sets of the series of ``name`` that belong to ``deployment``."""
        metric = self._by_name[name]
        return [s for s in _series_labels(metric) if s.get("deployment") == deployment]

    def forget(self, deployment: str, *, counters: bool = True) -> None:
        """Remove the series of ``deployment``: all of them (it was deleted), or all but the
        counters (it is no longer observed here, but what was counted stays true)."""
        for spec in METRICS:
            if spec.kind == "counter" and not counters:
                continue
            metric = self._by_name[spec.name]
            for labels in list(_series_labels(metric)):
                if labels.get("deployment") == deployment:
                    metric.remove(*[labels[name] for name in spec.labels])


def _series_labels(metric: Counter | Gauge | Histogram) -> list[dict[str, str]]:
    seen: list[dict[str, str]] = []
    for family in metric.collect():
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("le",)}
            if labels not in seen:
                seen.append(labels)
    return seen
