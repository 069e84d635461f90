"""The kopf handlers of the ``VllmDeployment`` controller.

:func:`build_registry` returns a fresh :class:`kopf.OperatorRegistry` bound to a
:class:`ControllerState`, so that tests can run several operators in one process.

* create/update/resume: parse the spec and apply the child Deployment and
  Service, then start or reconfigure the :class:`~.autoscaler.DeploymentAutoscaler`
  (on first sight the cost model is restored from ``status.costModel.checkpoint``).
  A spec that the parser or the API server refuses sets ``Degraded`` and an
  event, closes the autoscaler and is not retried until the spec changes;
* pod events (pods labelled :data:`~.children.INSTANCE_LABEL`): follow each pod's
  FPM endpoints. Every ``pod_resync_s`` the pods are also listed, because a watch
  that was down (re-list, peering pause) never reports the deletions it missed;
* a timer per ``VllmDeployment``: every ``autoscaling.intervalSeconds``, ingest,
  decide, apply the replica count (not in advisory mode), write status, record
  an event when the scaling recommendation changes and update the metrics;
* a daemon per ``VllmDeployment`` that lives as long as its timer: when kopf
  stops them (deletion, a peering pause, the operator exiting) it closes the
  autoscaler; after a pause the timer starts a new one from the status checkpoint;
* ``VllmDeployment`` deleted: forget it. The children go with their owner
  (Kubernetes garbage collection, through the owner references).

Handlers are synchronous (kopf runs them in its thread pool): the ``kubernetes``
client blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from stepscale_operator.controller.autoscaler import DeploymentAutoscaler
from stepscale_operator.controller.children import (
    INSTANCE_LABEL,
    build_deployment,
    build_service,
    selector_string,
)
from stepscale_operator.controller.discovery import PendingPods, StreamChanges, pod_view
from stepscale_operator.controller.kube_api import KubernetesApi
from stepscale_operator.controller.metrics import OperatorMetrics
from stepscale_operator.controller.rounds import EventGate, observe_metrics, scaling_event
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
    bursts_from_status,
    checkpoint_from_status,
)
from stepscale_operator.stream_state import stream_label

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
ANNOTATION_PREFIX = "stepscale.io"
# API answers that mean "this object is invalid": retrying the same spec cannot help.
REFUSED_STATUSES = (400, 422)


@dataclass(frozen=True)
class ControllerConfig:
    """Operator-wide settings."""

    tick_s: float = 1.0  # how often each VllmDeployment's timer wakes (decisions follow the spec)
    pod_resync_s: float = 60.0  # how often each VllmDeployment's pods are listed
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
    reconciled: set[Key] = field(default_factory=set)  # children applied by this process
    pending_pods: PendingPods = field(default_factory=PendingPods)
    last_round: dict[Key, float] = field(default_factory=dict)
    last_resync: dict[Key, float] = field(default_factory=dict)
    totals: dict[Key, dict[str, int]] = field(default_factory=dict)
    events: EventGate = field(default_factory=EventGate)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def release(self, key: Key, *, deleted: bool = False) -> None:
        """Stop listening for ``key`` and drop what this process learned about it.

        ``deleted``: the object is gone, forget everything, counters included.
        Otherwise (a peering pause, an invalid spec) counters stay and the spec's
        problems are kept until a new spec is handled.
        """
        with self.lock:
            autoscaler = self.autoscalers.pop(key, None)
            for per_key in (self.last_round, self.last_resync, self.totals):
                per_key.pop(key, None)
            self.events.forget(key)
            if deleted:
                self.problems.pop(key, None)
                self.reconciled.discard(key)
                self.pending_pods.pop_owner(key)
        if autoscaler is not None:
            autoscaler.close()
        self.metrics.forget(deployment_label(key), counters=deleted)

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


def refused_problem(kind: str, exc: ApiException) -> str:
    """A ``Degraded`` message for a child object the API server refused as invalid."""
    detail = str(exc.reason or "")
    try:
        body = json.loads(exc.body or "{}")
        detail = str(body.get("message") or detail)
    except (TypeError, ValueError):
        pass
    return (
        f"spec: the API server refused the {kind} built from this spec ({exc.status}): "
        f"{detail}; fix the field it names in the VllmDeployment (resources, env, "
        "podTemplate, engine.extraArgs) and apply it again"
    )


def apply_children(
    kube: KubernetesApi, name: str, namespace: str, uid: str, spec: VllmDeploymentSpec
) -> None:
    """Apply the Deployment and the Service; a refused one raises :class:`SpecError`."""
    replicas = target_replicas(spec, kube.get_deployment(namespace, name))
    for kind, body in (
        ("Deployment", build_deployment(name, namespace, uid, spec, replicas)),
        ("Service", build_service(name, namespace, uid, spec)),
    ):
        try:
            kube.apply(body)
        except ApiException as exc:
            if exc.status in REFUSED_STATUSES:
                raise SpecError([refused_problem(kind, exc)]) from exc
            raise


def log_changes(owner: str, changes: StreamChanges, why: str = "") -> None:
    """One log line per endpoint subscribed to or dropped."""
    suffix = f" ({why})" if why else ""
    for endpoint, stream in changes.added.items():
        log.info("%s: subscribed to %s (%s)%s", owner, endpoint, stream_label(stream), suffix)
    for endpoint, stream in changes.removed.items():
        log.info("%s: unsubscribed %s (%s)%s", owner, endpoint, stream_label(stream), suffix)


def start_autoscaler(
    state: ControllerState,
    key: Key,
    spec: VllmDeploymentSpec,
    status: Mapping[str, Any],
    body: kopf.Body,
) -> DeploymentAutoscaler:
    """A new autoscaler for ``key`` (caller holds ``state.lock``), warm from the checkpoint."""
    autoscaler = DeploymentAutoscaler(
        deployment_label(key),
        spec,
        checkpoint=checkpoint_from_status(dict(status)),
        bursts=bursts_from_status(dict(status)),
    )
    state.autoscalers[key] = autoscaler
    for pod in state.pending_pods.pop_owner(key):
        autoscaler.observe_pod(pod_view(pod))
    if autoscaler.model_origin == "checkpoint":
        kopf.info(
            body,
            reason="WarmStart",
            message="cost model restored from status: " + autoscaler.model.cost_model.formula(),
        )
    return autoscaler


def resync_pods(state: ControllerState, key: Key, autoscaler: DeploymentAutoscaler) -> None:
    """List the deployment's pods and forget those the watch did not report deleted."""
    namespace, name = key
    since = autoscaler.pod_mark()
    try:
        bodies = state.kube.list_pods(namespace, selector_string(name))
    except ApiException as exc:
        log.warning("%s: listing pods failed: %s %s", autoscaler.name, exc.status, exc.reason)
        state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(
            deployment_label(key), "list_pods"
        ).inc()
        return
    # Filter here too: a server (or emulator) that ignores the selector must not add pods.
    listed = [
        pod_view(b)
        for b in bodies
        if ((b.get("metadata") or {}).get("labels") or {}).get(INSTANCE_LABEL) == name
    ]
    log_changes(autoscaler.name, autoscaler.resync_pods(listed, since), "pod listing")


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

    def refuse_spec(
        key: Key,
        problems: tuple[str, ...],
        *,
        body: kopf.Body,
        meta: kopf.Meta,
        status: kopf.Status,
        patch: kopf.Patch,
    ) -> None:
        # Nothing to listen to or decide for until the spec is fixed (which is an update).
        state.release(key)
        state.problems[key] = problems
        label = deployment_label(key)
        state.metrics.counter("stepscale_spec_errors_total").labels(label).inc()
        message = "; ".join(problems)
        kopf.warn(body, reason="InvalidSpec", message=message[:1024])
        log.warning("%s: invalid spec: %s", label, message)
        patch.status["conditions"] = build_conditions(
            now_wall=time.time(),
            generation=meta.get("generation"),
            previous=list(status.get("conditions") or []),
            problems=problems,
            mode="invalid",
            load=None,
            model_ready=False,
            samples=0,
            min_samples=0,
            mape=None,
        )
        patch.status["observedGeneration"] = meta.get("generation")

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
        try:
            parsed = parse_spec(dict(spec))
        except SpecError as exc:
            refuse_spec(key, exc.problems, body=body, meta=meta, status=status, patch=patch)
            return  # no retry: the user has to fix the spec, which triggers an update
        try:
            apply_children(state.kube, name, key[0], str(meta.get("uid", "")), parsed)
        except SpecError as exc:
            refuse_spec(key, exc.problems, body=body, meta=meta, status=status, patch=patch)
            # Permanent: kopf stops retrying this spec; a changed spec is handled anew.
            raise kopf.PermanentError(str(exc)) from exc
        with state.lock:
            state.problems.pop(key, None)
            state.reconciled.add(key)
            autoscaler = state.autoscalers.get(key)
            if autoscaler is None:
                start_autoscaler(state, key, parsed, status, body)
            else:
                autoscaler.reconfigure(parsed)
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
                if deleted:
                    state.pending_pods.discard(key, pod_name)
                else:
                    state.pending_pods.put(key, pod_name, body)
                return
        if deleted:
            changes = autoscaler.forget_pod(pod_name)
        else:
            changes = autoscaler.observe_pod(pod_view(body))
        log_changes(autoscaler.name, changes)

    @kopf.on.event(*resource, registry=registry)
    def vd_event(*, type: str, namespace: str | None, name: str, **_: Any) -> None:
        if type == "DELETED":
            state.release((namespace or "", name), deleted=True)

    # Give release() time to close the subscriber before kopf gives up on the daemon.
    @kopf.daemon(*resource, cancellation_backoff=5.0, cancellation_timeout=5.0, registry=registry)
    async def listening(
        *, stopped: kopf.DaemonStopped, namespace: str | None, name: str, **_: Any
    ) -> None:
        # Kopf starts and stops this together with the timer below (on deletion, on a
        # peering pause, on exit): a stopped timer must not leave its subscriber open.
        await stopped.wait()
        await asyncio.to_thread(state.release, (namespace or "", name))

    @kopf.timer(*resource, interval=config.tick_s, registry=registry)
    def autoscale(
        *,
        body: kopf.Body,
        spec: kopf.Spec,
        status: kopf.Status,
        meta: kopf.Meta,
        namespace: str | None,
        name: str,
        patch: kopf.Patch,
        **kwargs: Any,
    ) -> None:
        key: Key = (namespace or "", name)
        if kwargs.get("stopped") or key in state.problems:
            return
        autoscaler = timer_autoscaler(key, spec, status, body)
        if autoscaler is None:
            return
        now = time.monotonic()
        if now - state.last_round.get(key, -1e18) < autoscaler.spec.autoscaling.interval_s:
            return
        state.last_round[key] = now
        if now - state.last_resync.get(key, -1e18) >= config.pod_resync_s:
            state.last_resync[key] = now
            resync_pods(state, key, autoscaler)
        new_status = decision_round(state, key, autoscaler, body=body, meta=meta, status=status)
        for k, v in new_status.items():
            patch.status[k] = v

    def timer_autoscaler(
        key: Key, spec: kopf.Spec, status: kopf.Status, body: kopf.Body
    ) -> DeploymentAutoscaler | None:
        """The autoscaler of ``key``; after a release (peering pause) a new one, warm from
        the status checkpoint, once this process has reconciled the object."""
        with state.lock:
            autoscaler = state.autoscalers.get(key)
            if autoscaler is not None or key not in state.reconciled:
                return autoscaler
            try:
                parsed = parse_spec(dict(spec))
            except SpecError:
                return None  # reconcile reports it
            return start_autoscaler(state, key, parsed, status, body)

    return registry


def decision_round(
    state: ControllerState,
    key: Key,
    autoscaler: DeploymentAutoscaler,
    *,
    body: kopf.Body,
    meta: kopf.Meta,
    status: kopf.Status,
) -> dict[str, Any]:
    """Decide once, apply it (auto mode), post its event; returns the status patch."""
    namespace, name = key
    label = deployment_label(key)
    spec = autoscaler.spec
    uid = str(meta.get("uid", ""))
    started = time.perf_counter()
    existing, api_error = read_or_restore_children(state, key, uid, spec)
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
                state.kube.apply(build_deployment(name, namespace, uid, spec, desired))
                applied = True
            except ApiException as exc:
                api_error = f"scaling the Deployment failed: {exc.status} {exc.reason}"
                state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(
                    label, "scale"
                ).inc()
        event = scaling_event(decision, applied)
        if state.events.admit(key, decision, event) and event is not None:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        state.metrics.counter("stepscale_scaling_decisions_total").labels(
            label, decision.action, str(applied).lower()
        ).inc()
    snapshot = result.cost_model_snapshot
    quality = snapshot.get("quality") or {}
    now_wall = time.time()
    conditions = build_conditions(
        now_wall=now_wall,
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
        decision=decision,
    )
    new_status = build_status(
        now_wall=now_wall,
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
    observe_metrics(
        state.metrics,
        label,
        totals=result.totals,
        previous=state.totals.setdefault(key, {}),
        status=new_status,
        endpoints=result.endpoints,
        ready=result.ready,
    )
    return new_status


def read_or_restore_children(
    state: ControllerState, key: Key, uid: str, spec: VllmDeploymentSpec
) -> tuple[dict[str, Any] | None, str | None]:
    """The child Deployment (re-created with the Service if it was deleted), or an API error."""
    namespace, name = key
    label = deployment_label(key)
    try:
        existing = state.kube.get_deployment(namespace, name)
    except ApiException as exc:
        state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(
            label, "get_deployment"
        ).inc()
        return None, f"reading the Deployment failed: {exc.status} {exc.reason}"
    if existing is not None:
        return existing, None
    # The Deployment was deleted behind our back: put it (and the Service) back.
    try:
        existing = state.kube.apply(
            build_deployment(name, namespace, uid, spec, target_replicas(spec, None))
        )
        state.kube.apply(build_service(name, namespace, uid, spec))
    except ApiException as exc:
        state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(label, "apply").inc()
        return existing, f"recreating the children failed: {exc.status} {exc.reason}"
    return existing, None
