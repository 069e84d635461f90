"""The kopf handlers of the ``VllmDeployment`` controller.

:func:`build_registry` returns a fresh :class:`kopf.OperatorRegistry` bound to a
:class:`ControllerState`, so that tests can run several operators in one process.

* create/update/resume: parse the spec (an invalid one sets ``Degraded`` and an
  event, and is not retried), start or reconfigure the
  :class:`~.autoscaler.DeploymentAutoscaler` (on first sight the cost model is
  restored from ``status.costModel.checkpoint``), apply the child Deployment and
  Service;
* pod events (pods labelled :data:`~.children.INSTANCE_LABEL`): follow each pod's
  FPM endpoints;
* a timer per ``VllmDeployment``: every ``autoscaling.intervalSeconds``, ingest,
  decide, apply the replica count (not in advisory mode), write status, record
  an event for each scaling decision and update the metrics;
* ``VllmDeployment`` deleted: stop listening. The children go with their owner
  (Kubernetes garbage collection, through the owner references).

Handlers are synchronous (kopf runs them in its thread pool): the ``kubernetes``
client blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from stepscale_operator.controller.autoscaler import DecisionRound, DeploymentAutoscaler
from stepscale_operator.controller.children import (
    INSTANCE_LABEL,
    build_deployment,
    build_service,
    selector_string,
)
from stepscale_operator.controller.discovery import pod_view
from stepscale_operator.controller.kube_api import KubernetesApi
from stepscale_operator.controller.metrics import OperatorMetrics
from stepscale_operator.controller.spec import (
    GROUP,
    PLURAL,
    VERSION,
    SpecError,
    VllmDeploymentSpec,
    parse_spec,
)
from stepscale_operator.controller.status import (
    build_conditions,
    build_status,
    checkpoint_from_status,
)
from stepscale_operator.stream_state import stream_label

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
ANNOTATION_PREFIX = "stepscale.io"


@dataclass(frozen=True)
class ControllerConfig:
    """Operator-wide settings."""

    tick_s: float = 1.0  # how often each VllmDeployment's timer wakes (decisions follow the spec)
    peering_name: str = "stepscale"
    peering_priority: int = 0
    standalone: bool = False  # no peering (a single replica, tests)


@dataclass
class ControllerState:
    """What the handlers share: autoscalers by object, pods seen early, metrics, the API."""

    kube: KubernetesApi
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    autoscalers: dict[Key, DeploymentAutoscaler] = field(default_factory=dict)
    problems: dict[Key, tuple[str, ...]] = field(default_factory=dict)
    early_pods: dict[Key, dict[str, dict[str, Any]]] = field(default_factory=dict)
    last_round: dict[Key, float] = field(default_factory=dict)
    totals: dict[Key, dict[str, int]] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def close(self) -> None:
        """Stop every autoscaler."""
        with self.lock:
            for autoscaler in self.autoscalers.values():
                autoscaler.close()
            self.autoscalers.clear()


def deployment_label(key: Key) -> str:
    """The ``deployment`` metric label of an object."""
    return f"{key[0]}/{key[1]}"


def target_replicas(spec: VllmDeploymentSpec, existing: Mapping[str, Any] | None) -> int:
    """Replicas the child Deployment should have when the spec is (re)applied.

    Without autoscaling (or in advisory mode) ``spec.replicas`` rules, so that
    ``kubectl scale`` and an HPA work through the scale subresource. In ``auto``
    mode the count the operator last set is kept (clamped to the new bounds).
    """
    a = spec.autoscaling
    if not a.enabled or a.advisory:
        return spec.replicas
    current = ((existing or {}).get("spec") or {}).get("replicas")
    if isinstance(current, int):
        return min(max(current, a.min_replicas), a.max_replicas)
    return spec.initial_replicas()


def mode_of(spec: VllmDeploymentSpec) -> str:
    """``auto``, ``advisory`` or ``disabled``."""
    return spec.autoscaling.mode if spec.autoscaling.enabled else "disabled"


def build_registry(state: ControllerState, config: ControllerConfig) -> kopf.OperatorRegistry:
    """The operator's handlers, registered on a new registry."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=ANNOTATION_PREFIX
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    @kopf.on.cleanup(registry=registry)
    def stop(**_: Any) -> None:
        state.close()

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    def reconcile(
        *,
        body: kopf.Body,
        spec: kopf.Spec,
        status: kopf.Status,
        meta: kopf.Meta,
        namespace: str | None,
        name: str,
        patch: kopf.Patch,
        **_: Any,
    ) -> None:
        key: Key = (namespace or "", name)
        namespace = key[0]
        label = deployment_label(key)
        try:
            parsed = parse_spec(dict(spec))
        except SpecError as exc:
            state.problems[key] = exc.problems
            state.metrics.counter("stepscale_spec_errors_total").labels(label).inc()
            kopf.warn(body, reason="InvalidSpec", message=str(exc)[:1024])
            log.warning("%s: invalid spec: %s", label, exc)
            patch.status["conditions"] = build_conditions(
                now_wall=time.time(),
                generation=meta.get("generation"),
                previous=list(status.get("conditions") or []),
                problems=exc.problems,
                mode="invalid",
                load=None,
                model_ready=False,
                samples=0,
                min_samples=0,
                mape=None,
            )
            patch.status["observedGeneration"] = meta.get("generation")
            return  # no retry: the user has to fix the spec, which triggers an update
        state.problems.pop(key, None)
        with state.lock:
            autoscaler = state.autoscalers.get(key)
            if autoscaler is None:
                autoscaler = DeploymentAutoscaler(
                    label, parsed, checkpoint=checkpoint_from_status(dict(status))
                )
                state.autoscalers[key] = autoscaler
                for pod in state.early_pods.pop(key, {}).values():
                    autoscaler.observe_pod(pod_view(pod))
                if autoscaler.model_origin == "checkpoint":
                    kopf.info(
                        body,
                        reason="WarmStart",
                        message="cost model restored from status: "
                        + autoscaler.model.cost_model.formula(),
                    )
            else:
                autoscaler.reconfigure(parsed)
        uid = str(meta.get("uid", ""))
        existing = state.kube.get_deployment(namespace, name)
        replicas = target_replicas(parsed, existing)
        state.kube.apply(build_deployment(name, namespace, uid, parsed, replicas))
        state.kube.apply(build_service(name, namespace, uid, parsed))
        patch.status["selector"] = selector_string(name)
        patch.status["mode"] = mode_of(parsed)
        patch.status["observedGeneration"] = meta.get("generation")

    @kopf.on.event("", "v1", "pods", labels={INSTANCE_LABEL: kopf.PRESENT}, registry=registry)
    def pod_event(
        *, event: kopf.RawEvent, body: kopf.Body, namespace: str | None, **_: Any
    ) -> None:
        labels = body.get("metadata", {}).get("labels", {}) or {}
        owner = labels.get(INSTANCE_LABEL)
        pod_name = body.get("metadata", {}).get("name")
        if not owner or not pod_name:
            return
        key: Key = (namespace or "", owner)
        deleted = event.get("type") == "DELETED"
        with state.lock:
            autoscaler = state.autoscalers.get(key)
            if autoscaler is None:
                pods = state.early_pods.setdefault(key, {})
                if deleted:
                    pods.pop(pod_name, None)
                else:
                    pods[pod_name] = dict(body)
                return
        if deleted:
            changes = autoscaler.forget_pod(pod_name)
        else:
            changes = autoscaler.observe_pod(pod_view(body))
        for endpoint, stream in changes.added.items():
            log.info("%s: subscribed to %s (%s)", autoscaler.name, endpoint, stream_label(stream))
        for endpoint, stream in changes.removed.items():
            log.info("%s: unsubscribed %s (%s)", autoscaler.name, endpoint, stream_label(stream))

    @kopf.on.event(*resource, registry=registry)
    def vd_event(*, type: str, namespace: str | None, name: str, **_: Any) -> None:
        if type != "DELETED":
            return
        key: Key = (namespace or "", name)
        with state.lock:
            autoscaler = state.autoscalers.pop(key, None)
            state.problems.pop(key, None)
            state.last_round.pop(key, None)
            state.totals.pop(key, None)
            state.early_pods.pop(key, None)
        if autoscaler is not None:
            autoscaler.close()
        state.metrics.forget(deployment_label(key))

    @kopf.timer(*resource, interval=config.tick_s, registry=registry)
    def autoscale(
        *,
        body: kopf.Body,
        status: kopf.Status,
        meta: kopf.Meta,
        namespace: str | None,
        name: str,
        patch: kopf.Patch,
        **_: Any,
    ) -> None:
        key: Key = (namespace or "", name)
        namespace = key[0]
        if key in state.problems:
            return
        autoscaler = state.autoscalers.get(key)
        if autoscaler is None:
            return
        spec = autoscaler.spec
        now = time.monotonic()
        if now - state.last_round.get(key, -1e18) < spec.autoscaling.interval_s:
            return
        state.last_round[key] = now
        label = deployment_label(key)
        api_error: str | None = None
        started = time.perf_counter()
        try:
            existing = state.kube.get_deployment(namespace, name)
        except ApiException as exc:
            existing = None
            api_error = f"reading the Deployment failed: {exc.status} {exc.reason}"
            state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(
                label, "get_deployment"
            ).inc()
        if existing is None and api_error is None:
            # The Deployment was deleted behind our back: put it (and the Service) back.
            try:
                uid = str(meta.get("uid", ""))
                existing = state.kube.apply(
                    build_deployment(name, namespace, uid, spec, target_replicas(spec, None))
                )
                state.kube.apply(build_service(name, namespace, uid, spec))
            except ApiException as exc:
                api_error = f"recreating the children failed: {exc.status} {exc.reason}"
                state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(
                    label, "apply"
                ).inc()
        dep_spec = (existing or {}).get("spec") or {}
        dep_status = (existing or {}).get("status") or {}
        current = dep_spec.get("replicas")
        current = current if isinstance(current, int) else None
        result = autoscaler.decide(current_replicas=current)
        state.metrics.histogram("stepscale_decision_duration_seconds").labels(label).observe(
            time.perf_counter() - started
        )
        decision = result.decision
        applied = False
        desired = current if current is not None else spec.replicas
        if decision is not None:
            desired = decision.desired_replicas
            if decision.apply and existing is not None:
                try:
                    uid = str(meta.get("uid", ""))
                    state.kube.apply(build_deployment(name, namespace, uid, spec, desired))
                    applied = True
                except ApiException as exc:
                    api_error = f"scaling the Deployment failed: {exc.status} {exc.reason}"
                    state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(
                        label, "scale"
                    ).inc()
            if decision.action != "hold":
                verb = "ScaledUp" if decision.action == "scale_up" else "ScaledDown"
                kopf.info(
                    body,
                    reason=verb if applied else verb.replace("Scaled", "Advise"),
                    message=(
                        f"{decision.current_replicas} -> {decision.desired_replicas}: "
                        f"{decision.reason}"
                    )[:1024],
                )
            state.metrics.counter("stepscale_scaling_decisions_total").labels(
                label, decision.action, str(applied).lower()
            ).inc()
        snapshot = result.cost_model_snapshot
        quality = snapshot.get("quality") or {}
        conditions = build_conditions(
            now_wall=time.time(),
            generation=meta.get("generation"),
            previous=list(status.get("conditions") or []),
            problems=(),
            mode=mode_of(spec),
            load=result.load,
            model_ready=bool(snapshot.get("ready")),
            samples=int(snapshot.get("samples", 0) or 0),
            min_samples=spec.autoscaling.cost_model.min_samples,
            mape=quality.get("mape"),
            api_error=api_error,
        )
        new_status = build_status(
            now_wall=time.time(),
            generation=meta.get("generation"),
            selector=selector_string(name),
            mode=mode_of(spec),
            replicas=int(dep_status.get("replicas") or 0),
            ready_replicas=int(dep_status.get("readyReplicas") or 0),
            desired_replicas=int(desired),
            conditions=conditions,
            cost_model_snapshot=snapshot,
            load=result.load,
            decision=decision,
            decision_applied=applied,
            last_scaling=status.get("lastScaling"),
            stream_health=result.stream_health,
            endpoints=result.endpoints,
        )
        for k, v in new_status.items():
            patch.status[k] = v
        observe_metrics(state, key, result, new_status, autoscaler.dropped_batches)

    return registry


def observe_metrics(
    state: ControllerState,
    key: Key,
    result: DecisionRound,
    status: Mapping[str, Any],
    dropped_batches: int,
) -> None:
    """Update the declared metrics of one deployment after a decision round."""
    m = state.metrics
    label = deployment_label(key)
    streams = status.get("streams") or {}
    totals = {
        "stepscale_fpm_messages_total": int(streams.get("messages", 0)),
        "stepscale_fpm_passes_total": int(streams.get("passes", 0)),
        "stepscale_fpm_lost_messages_total": int(streams.get("gaps", 0)),
        "stepscale_fpm_stream_restarts_total": int(streams.get("restarts", 0)),
        "stepscale_fpm_dropped_batches_total": dropped_batches,
    }
    for reason, count in (streams.get("malformedByReason") or {}).items():
        totals[f"malformed:{reason}"] = int(count)
    previous = state.totals.setdefault(key, {})
    for name, value in totals.items():
        delta = value - previous.get(name, 0)
        previous[name] = value
        if delta <= 0:  # a stream was forgotten (pod gone): its counts leave the sums
            continue
        if name.startswith("malformed:"):
            m.counter("stepscale_fpm_malformed_total").labels(label, name.split(":", 1)[1]).inc(
                delta
            )
        else:
            m.counter(name).labels(label).inc(delta)
    m.gauge("stepscale_fpm_streams").labels(label, "fresh").set(streams.get("connected", 0))
    m.gauge("stepscale_fpm_streams").labels(label, "stale").set(streams.get("stale", 0))
    m.gauge("stepscale_fpm_endpoints").labels(label).set(result.endpoints)
    cm = status.get("costModel") or {}
    for coef in cm.get("coefficients", []):
        if coef.get("value") is not None:
            per = str(coef.get("unit", "")).split("/", 1)[-1]
            m.gauge("stepscale_cost_model_coefficient_seconds").labels(
                label, coef["name"], per
            ).set(coef["value"])
    if cm.get("mape") is not None:
        m.gauge("stepscale_cost_model_mape_ratio").labels(label).set(cm["mape"])
    if cm.get("r2") is not None:
        m.gauge("stepscale_cost_model_r2_ratio").labels(label).set(cm["r2"])
    m.gauge("stepscale_cost_model_samples").labels(label).set(cm.get("samples", 0))
    m.gauge("stepscale_cost_model_ready").labels(label).set(1 if cm.get("ready") else 0)
    load = status.get("load") or {}
    for kind, field_name in (
        ("prefill", "prefillTokensPerSecond"),
        ("prefill_cached", "prefillCachedTokensPerSecond"),
        ("decode", "decodeTokensPerSecond"),
    ):
        if load.get(field_name) is not None:
            m.gauge("stepscale_load_tokens_per_second").labels(label, kind).set(load[field_name])
    for which in ("current", "desired"):
        pred = (status.get("predictions") or {}).get(which) or {}
        if pred.get("ttftMs") is not None:
            m.gauge("stepscale_predicted_ttft_seconds").labels(label, which).set(
                pred["ttftMs"] / 1e3
            )
        if pred.get("itlMs") is not None:
            m.gauge("stepscale_predicted_itl_seconds").labels(label, which).set(pred["itlMs"] / 1e3)
    m.gauge("stepscale_replicas").labels(label, "ready").set(result.ready)
    m.gauge("stepscale_replicas").labels(label, "current").set(status.get("replicas", 0))
    m.gauge("stepscale_replicas").labels(label, "desired").set(status.get("desiredReplicas", 0))
