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
    applied_mode,
    build_deployment,
    build_service,
    selector_string,
)
from stepscale_operator.controller.discovery import PendingPods, StreamChanges, pod_view
from stepscale_operator.controller.kube_api import KubernetesApi
from stepscale_operator.controller.metrics import OperatorMetrics
from stepscale_operator.controller.rounds import (
    EventGate,
    ScaleBackoff,
    ScalingEvent,
    observe_decision,
    observe_metrics,
    scaling_event,
)
from stepscale_operator.controller.spec import (
    GROUP,
    PLURAL,
    VERSION,
    SpecError,
    VllmDeploymentSpec,
    name_problems,
    parse_spec,
)
from stepscale_operator.controller.status import (
    build_conditions,
    bursts_from_status,
    checkpoint_from_status,
    round_status,
)
from stepscale_operator.planner import Decision
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
    scale_backoff: ScaleBackoff = field(default_factory=ScaleBackoff)
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
            self.scale_backoff.forget(key)
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


def target_replicas(
    spec: VllmDeploymentSpec, existing: Mapping[str, Any] | None, previous_mode: str | None
) -> int:
    """Replicas the child Deployment should have when the spec is (re)applied.

    Who owns the count: in ``auto`` mode the operator (the count it last set is
    kept, clamped to the new bounds); with autoscaling disabled or advisory,
    ``spec.replicas`` (``kubectl scale``, an HPA). Leaving ``auto`` keeps the
    current count: switching to advisory to watch, or disabling, never moves
    capacity. ``previous_mode`` is the mode the Deployment was last applied in
    (its annotation), else ``status.mode``.
    """
    a = spec.autoscaling
    current = ((existing or {}).get("spec") or {}).get("replicas")
    current = current if isinstance(current, int) else None
    if mode_of(spec) == "auto":
        if current is not None:
            return min(max(current, a.min_replicas), a.max_replicas)
        return spec.initial_replicas()
    if previous_mode == "auto" and current is not None:
        return current
    return spec.replicas


def mode_of(spec: VllmDeploymentSpec) -> str:
    """``auto``, ``advisory`` or ``disabled``."""
    return spec.mode()


def server_message(exc: ApiException) -> str:
    """What the API server said: the Status body's message, else the HTTP reason."""
    detail = str(exc.reason or "")
    try:
        body = json.loads(exc.body or "{}")
        if isinstance(body, dict):
            detail = str(body.get("message") or detail)
    except (TypeError, ValueError):
        pass
    return detail


def refused_problem(kind: str, exc: ApiException) -> str:
    """A ``Degraded`` message for a child object the API server refused as invalid."""
    detail = server_message(exc)
    return (
        f"spec: the API server refused the {kind} built from this spec ({exc.status}): "
        f"{detail}; fix the field it names in the VllmDeployment (resources, env, "
        "podTemplate, engine.extraArgs) and apply it again"
    )


def apply_children(
    kube: KubernetesApi,
    name: str,
    namespace: str,
    uid: str,
    spec: VllmDeploymentSpec,
    previous_mode: str | None,
) -> tuple[int, str | None]:
    """Apply the Service, then the Deployment; returns the Deployment's replicas and
    the mode it was applied in before (its annotation, else ``previous_mode``).

    A refused one raises :class:`SpecError`. The Service goes first: a refused
    Service must not leave a Deployment running behind it (a Service without pods
    costs nothing).
    """
    existing = kube.get_deployment(namespace, name)
    previous_mode = applied_mode(existing) or previous_mode
    replicas = target_replicas(spec, existing, previous_mode)
    for kind, body in (
        ("Service", build_service(name, namespace, uid, spec)),
        ("Deployment", build_deployment(name, namespace, uid, spec, replicas)),
    ):
        try:
            kube.apply(body)
        except ApiException as exc:
            if exc.status in REFUSED_STATUSES:
                raise SpecError([refused_problem(kind, exc)]) from exc
            raise
    return replicas, previous_mode


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
        log_changes(autoscaler.name, autoscaler.observe_pod(pod_view(pod)), "found at start")
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


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Where kopf keeps its state on our objects, and how fast it polls and watches."""
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # A timer that is mid-round when its object is deleted is polled for its exit
    # every cancellation_polling seconds (kopf's default: 60), and the finalizer,
    # hence the deletion, waits that long: a round takes well under a second.
    settings.background.cancellation_polling = 1.0
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def refuse_spec(
    state: ControllerState,
    key: Key,
    problems: tuple[str, ...],
    *,
    body: kopf.Body,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
) -> None:
    """Mark ``key``'s spec invalid on status, in an event and a counter; stop serving it."""
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
    patch.status["mode"] = "invalid"
    patch.status["observedGeneration"] = meta.get("generation")


def timer_autoscaler(
    state: ControllerState, key: Key, spec: kopf.Spec, status: kopf.Status, body: kopf.Body
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


def build_registry(state: ControllerState, config: ControllerConfig) -> kopf.OperatorRegistry:
    """The operator's handlers, registered on a new registry."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings)

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
        bad_name = name_problems(name)
        if bad_name:  # the CRD refuses these; an API server without CEL may not
            refuse_spec(
                state, key, tuple(bad_name), body=body, meta=meta, status=status, patch=patch
            )
            return  # no child can be made under this name
        try:
            parsed = parse_spec(dict(spec))
        except SpecError as exc:
            refuse_spec(state, key, exc.problems, body=body, meta=meta, status=status, patch=patch)
            return  # no retry: the user has to fix the spec, which triggers an update
        previous_mode = status.get("mode")
        try:
            replicas, previous_mode = apply_children(
                state.kube, name, key[0], str(meta.get("uid", "")), parsed, previous_mode
            )
        except SpecError as exc:
            refuse_spec(state, key, exc.problems, body=body, meta=meta, status=status, patch=patch)
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
        sync_spec_replicas(body, spec, patch, replicas, previous_mode, mode_of(parsed))
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
        autoscaler = timer_autoscaler(state, key, spec, status, body)
        if autoscaler is None:
            return
        now = time.monotonic()
        if now - state.last_round.get(key, -1e18) < autoscaler.spec.autoscaling.interval_s:
            return
        state.last_round[key] = now
        if now - state.last_resync.get(key, -1e18) >= config.pod_resync_s:
            state.last_resync[key] = now
            resync_pods(state, key, autoscaler)
        new_status, replicas = decision_round(
            state, key, autoscaler, body=body, meta=meta, status=status
        )
        for k, v in new_status.items():
            patch.status[k] = v
        # In auto mode the scale subresource's spec follows the count the operator set.
        auto = mode_of(autoscaler.spec) == "auto"
        if auto and replicas is not None and spec.get("replicas") != replicas:
            patch.spec["replicas"] = replicas

    return registry


def sync_spec_replicas(
    body: kopf.Body,
    spec: kopf.Spec,
    patch: kopf.Patch,
    replicas: int,
    previous_mode: str | None,
    mode: str,
) -> None:
    """Make ``spec.replicas`` (the scale subresource's spec) show the Deployment's count.

    In auto mode the operator owns the count: a ``kubectl scale`` is undone (with an
    event that says so). Leaving auto keeps the count, which ``spec.replicas`` then
    holds, so that it goes on ruling at the same value.
    """
    requested = spec.get("replicas")
    if requested == replicas:
        return
    patch.spec["replicas"] = replicas
    if mode == "auto" and previous_mode == "auto" and isinstance(requested, int):
        kopf.info(
            body,
            reason="ReplicasOwnedByAutoscaler",
            message=(
                f"spec.replicas {requested} is not applied: in auto mode the operator sets "
                f"the replica count ({replicas}); change autoscaling.minReplicas/maxReplicas, "
                "or switch to advisory mode to set it yourself"
            ),
        )
    elif mode != "auto" and previous_mode == "auto":
        kopf.info(
            body,
            reason="ReplicasKept",
            message=(
                f"autoscaling is now {mode}: the replica count stays at {replicas} "
                "(spec.replicas set to it); scale with kubectl scale from here"
            ),
        )


def decision_round(
    state: ControllerState,
    key: Key,
    autoscaler: DeploymentAutoscaler,
    *,
    body: kopf.Body,
    meta: kopf.Meta,
    status: kopf.Status,
) -> tuple[dict[str, Any], int | None]:
    """Decide once, apply it (auto mode), post its event.

    Returns the status patch and the Deployment's replica count after the round
    (None when the Deployment could not be read).
    """
    namespace, name = key
    label = deployment_label(key)
    spec = autoscaler.spec
    uid = str(meta.get("uid", ""))
    started = time.perf_counter()
    existing, api_error = read_or_restore_children(state, key, uid, spec, body)
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
    replicas_now = current
    if decision is not None:
        desired = decision.desired_replicas
        event = scaling_event(decision, applied)
        if decision.apply and existing is not None and decision.action != "hold":
            applied, event, refused = scale(state, key, uid, spec, decision)
            replicas_now = decision.desired_replicas if applied else current
            api_error = refused or api_error
        elif not state.events.admit(key, decision, event):
            event = None
        if event is not None:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        observe_decision(state.metrics, label, decision, applied)
    new_status = round_status(
        result,
        now_wall=time.time(),
        generation=meta.get("generation"),
        previous_conditions=list(status.get("conditions") or []),
        mode=mode_of(spec),
        min_samples=spec.autoscaling.cost_model.min_samples,
        selector=selector_string(name),
        replicas=int(dep_status.get("replicas") or 0),
        ready_replicas=int(dep_status.get("readyReplicas") or 0),
        desired_replicas=int(desired),
        decision_applied=applied,
        last_scaling=status.get("lastScaling"),
        api_error=api_error,
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
    return new_status, replicas_now


def scale(
    state: ControllerState,
    key: Key,
    uid: str,
    spec: VllmDeploymentSpec,
    decision: Decision,
) -> tuple[bool, ScalingEvent | None, str | None]:
    """Set the Deployment's replicas to the decision's (auto mode), backing off after
    a refusal.

    Returns whether it was applied, the event to post (if any) and the refusal to
    report (if any).
    A refusal is reported with the server's message; its event goes out once per
    streak of refusals, and no attempt is made until the back-off has passed.
    """
    namespace, name = key
    label = deployment_label(key)
    now = time.monotonic()
    replicas = decision.desired_replicas
    waiting = state.scale_backoff.waiting(key, now)
    if waiting is not None:
        return False, None, waiting
    try:
        state.kube.apply(build_deployment(name, namespace, uid, spec, replicas))
    except ApiException as exc:
        state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(label, "scale").inc()
        message = (
            f"the API server refused {decision.current_replicas} -> {replicas} replicas "
            f"({exc.status}): {server_message(exc)}"
        )
        first = state.scale_backoff.refused(key, now, spec.autoscaling.interval_s, message)
        event = ScalingEvent("Warning", "ScaleFailed", f"{message[:900]}; backing off")
        return False, event if first else None, message
    state.scale_backoff.succeeded(key)
    applied_event = scaling_event(decision, True)
    if not state.events.admit(key, decision, applied_event):
        applied_event = None
    return True, applied_event, None


def read_or_restore_children(
    state: ControllerState, key: Key, uid: str, spec: VllmDeploymentSpec, body: kopf.Body
) -> tuple[dict[str, Any] | None, str | None]:
    """The child Deployment, after re-creating any child deleted behind the operator's
    back (each one it owns: the Service, the Deployment), or an API error."""
    namespace, name = key
    label = deployment_label(key)
    try:
        existing = state.kube.get_deployment(namespace, name)
        service = state.kube.get_service(namespace, name)
    except ApiException as exc:
        state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(
            label, "get_children"
        ).inc()
        return None, f"reading the children failed: {exc.status} {server_message(exc)}"
    restored: list[str] = []
    try:
        if service is None:
            state.kube.apply(build_service(name, namespace, uid, spec))
            restored.append("Service")
        if existing is None:
            # In auto mode spec.replicas follows the count the operator set.
            replicas = target_replicas(spec, None, None)
            existing = state.kube.apply(build_deployment(name, namespace, uid, spec, replicas))
            restored.append("Deployment")
    except ApiException as exc:
        state.metrics.counter("stepscale_kubernetes_api_errors_total").labels(label, "apply").inc()
        missing = "Service" if service is None and "Service" not in restored else "Deployment"
        return existing, (
            f"the {missing} was deleted and re-creating it failed: "
            f"{exc.status} {server_message(exc)}"
        )
    if restored:
        message = f"{' and '.join(restored)} {name} deleted behind the operator's back: re-created"
        log.warning("%s: %s", label, message)
        kopf.warn(body, reason="ChildRestored", message=message)
    return existing, None
