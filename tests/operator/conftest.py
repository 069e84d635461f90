"""The operator against an emulated Kubernetes API, with FPM publishers standing in for pods.

Real parts: the kopf operator (in-process, the same handlers as in a cluster),
the ``kubernetes`` client, kmock's Kubernetes API emulation over HTTP, ZMQ
publishers (:class:`FpmPublisher`, the engine plugin's own) on loopback
addresses 127.0.0.x, and the whole core (subscriber, cost model, load, planner).

What kmock (0.8) does not emulate, and what these fixtures do about it:

* no ``uid``, ``creationTimestamp``, ``resourceVersion``, ``generation``, nor
  ``generateName``: :class:`ApiServerEmulator` fills them in as an API server
  would (kopf's JSON patches test ``resourceVersion``);
* a watch replays every object as ADDED even when it continues from a listing
  (``resourceVersion=``); :class:`ApiServerEmulator` does not replay then;
* a failed JSON-patch ``test`` is a 500 (kopf retries it forever) instead of a
  422: :class:`ApiServerEmulator` answers 422;
* ``GET /api/v1/namespaces`` fails, so kopf runs cluster-wide here;
* no schema validation, defaulting, pruning or CEL: the CRD is not enforced
  (tests/operator/test_crd.py checks the schema against what the operator writes);
* no status/scale subresource semantics: a patch to ``/status`` merges into the
  whole object, ``/scale`` returns the object itself;
* no server-side apply (an apply patch is a merge patch; apply does not create,
  the operator falls back to create), no strategic merge;
* no label selectors on list/watch (kopf filters pods by label itself);
* no controllers: no Deployment controller, no kubelet, no garbage collection
  through owner references. :class:`FakeCluster` plays the Deployment controller
  and the kubelet: it creates Ready pods with IPs on 127.0.0.x for the
  Deployment's replicas and starts a publisher per pod and rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
import kmock
import pytest
import pytest_asyncio
from kmock._internal import enums

from stepscale_engine import wire
from stepscale_engine.publisher import FpmPublisher
from stepscale_operator.controller.entry import run_operator
from stepscale_operator.controller.handlers import ControllerConfig, ControllerState
from stepscale_operator.controller.kube_api import KubernetesApi, api_client_from_environment
from stepscale_operator.controller.metrics import OperatorMetrics

NAMESPACE = "llm"
VD_RESOURCE = "stepscale.io/v1alpha1/vllmdeployments"
DEPLOY_RESOURCE = "apps/v1/deployments"
FPM_BASE_PORT = 20380

_resource_versions = itertools.count(1000)


class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what an API server adds to objects (see the module docstring)."""

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None:
            rv = str(next(_resource_versions))
            data = request.data
            if request.action == enums.action.CREATE and isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault(
                    "creationTimestamp",
                    datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                )
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = rv
            elif request.action == enums.action.UPDATE and isinstance(data, list):
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    try:
                        jsonpatch.apply_patch(copy.deepcopy(self.objects[key].raw), data)
                    except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
                        raise kmock.KubernetesError(
                            status=422, reason="Invalid", message=str(exc)
                        ) from exc
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": rv})
            elif request.action == enums.action.UPDATE and isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = rv
                key = (request.resource, request.namespace, request.name)
                if "spec" in data and key in self.objects and not self.objects[key].deleted:
                    old = self.objects[key].raw
                    meta["generation"] = int(old.get("metadata", {}).get("generation", 1)) + 1
        return await super()._handle(request)

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        # A watch that continues from a listing's resourceVersion must not replay the
        # objects as ADDED again (kmock does; kopf would then act on stale bodies).
        if not request.params.get("resourceVersion"):
            async for item in super()._serve_watch(request):
                yield item
            return
        yield b""
        async for event in self._buses[request.resource]:
            meta = event.get("object", {}).get("metadata", {})
            if request.namespace is None or meta.get("namespace") == request.namespace:
                yield event


def declare_resources(api: kmock.KubernetesEmulator) -> None:
    """The resources the operator uses, as API discovery shows them."""
    verbs = {"list", "watch", "get", "patch", "create", "delete", "update"}
    api.resources[VD_RESOURCE] = kmock.ResourceInfo(
        kind="VllmDeployment",
        singular="vllmdeployment",
        namespaced=True,
        shortnames={"vd"},
        subresources={"status", "scale"},
        verbs=verbs,
    )
    api.resources[DEPLOY_RESOURCE] = kmock.ResourceInfo(
        kind="Deployment", namespaced=True, subresources={"status", "scale"}, verbs=verbs
    )
    api.resources["v1/services"] = kmock.ResourceInfo(kind="Service", namespaced=True, verbs=verbs)
    api.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, subresources={"status"}, verbs=verbs
    )
    api.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=verbs)
    api.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
        kind="ClusterKopfPeering", namespaced=False, verbs=verbs
    )
    # kopf waits for namespaces to be discoverable even when it runs cluster-wide.
    api.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"list", "watch", "get"}
    )


@pytest_asyncio.fixture
async def api() -> AsyncIterator[ApiServerEmulator]:
    """An emulated API server on a loopback port."""
    async with ApiServerEmulator() as emulator, kmock.Server(emulator):
        declare_resources(emulator)
        yield emulator


def get_object(
    api: kmock.KubernetesEmulator, resource: str, name: str, namespace: str | None = NAMESPACE
) -> dict[str, Any] | None:
    """The stored object (``namespace=None``: cluster-scoped), or None."""
    key = (kmock.resource(resource), namespace, name)
    if key not in api.objects or api.objects[key].deleted:
        return None
    return copy.deepcopy(api.objects[key].raw)


async def create(api: kmock.KubernetesEmulator, path: str, body: dict[str, Any]) -> None:
    """POST an object (through HTTP, so watchers see it)."""
    async with api.post(path, json=body) as response:
        assert response.status == 200, await response.text()


async def patch(api: kmock.KubernetesEmulator, path: str, body: dict[str, Any]) -> None:
    """Merge-patch an object."""
    headers = {"Content-Type": "application/merge-patch+json"}
    async with api.patch(path, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()


async def delete(api: kmock.KubernetesEmulator, path: str) -> None:
    """DELETE an object."""
    async with api.delete(path) as response:
        assert response.status in (200, 404), await response.text()


def vd_path(name: str = "") -> str:
    """URL of VllmDeployments (or one of them)."""
    base = f"/apis/stepscale.io/v1alpha1/namespaces/{NAMESPACE}/vllmdeployments"
    return f"{base}/{name}" if name else base


def vd_body(name: str, **autoscaling: Any) -> dict[str, Any]:
    """A VllmDeployment with time compressed for tests (decisions every second)."""
    scaling = {
        "mode": "auto",
        "minReplicas": 1,
        "maxReplicas": 4,
        "intervalSeconds": 1,
        "startupSeconds": 1,
        "slo": {"ttftMs": 2000, "itlMs": 10},
        "scaleDown": {"stabilizationWindowSeconds": 2},
        "metrics": {"windowSeconds": 3, "staleAfterSeconds": 2},
        "costModel": {"warmupPasses": 2, "minSamples": 60},
    }
    scaling.update(autoscaling)
    return {
        "apiVersion": "stepscale.io/v1alpha1",
        "kind": "VllmDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "image": "registry.example/vllm-stepscale:0.1.0",
            "replicas": 1,
            "fpm": {"basePort": FPM_BASE_PORT},
            "autoscaling": scaling,
        },
    }


# -- the engines: a known step-time law, open-loop decode load ----------------------

STEP_INTERCEPT_S = 0.004
STEP_PER_DECODE_S = 0.00031
DECODE_CONTEXT = 1000


def step_time(batch: int) -> float:
    """The fake engine's forward-pass time for ``batch`` decode requests."""
    return STEP_INTERCEPT_S + STEP_PER_DECODE_S * batch


@dataclass
class FleetLoad:
    """Fleet-wide decode demand (tokens/s), split evenly over the serving pods."""

    decode_tokens_per_s: float = 600.0

    def batch_for(self, replicas: int) -> int:
        """Steady-state decode batch of one replica: B = (D/n) * step_time(B)."""
        share = self.decode_tokens_per_s / max(replicas, 1)
        utilisation = share * STEP_PER_DECODE_S
        if utilisation >= 0.95:
            return 256
        return max(1, round(share * STEP_INTERCEPT_S / (1.0 - utilisation)))


class EngineStandIn:
    """One pod rank: an FpmPublisher publishing passes of the fake engine, on its own thread."""

    def __init__(self, endpoint: str, worker_id: str, rank: int, batch: Callable[[], int]) -> None:
        self.publisher = FpmPublisher(endpoint, worker_id, rank).start()
        self._batch = batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Simulated engine time advances pass by pass; passes are published in
        # bursts that keep it level with the wall clock (exact rates, no sleeps per pass).
        # Batches and contexts vary around their means (as requests come and go), so
        # that the model can tell the fixed cost from the per-request cost.
        spread = itertools.cycle([(0.5, 0.5), (1.0, 1.5), (1.5, 1.0), (1.0, 1.0)])
        sim = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            while sim < now:
                batch_scale, context_scale = next(spread)
                b = max(1, round(self._batch() * batch_scale))
                wall = step_time(b)
                self.publisher.publish(
                    wall,
                    wire.ScheduledRequestMetrics(
                        num_decode_requests=b,
                        sum_decode_kv_tokens=int(b * DECODE_CONTEXT * context_scale),
                    ),
                    wire.QueuedRequestMetrics(),
                )
                sim += wall
            self._stop.wait(0.05)

    def close(self) -> None:
        """Stop publishing (the stream goes silent: no heartbeats either)."""
        self._stop.set()
        self._thread.join(2.0)
        self.publisher.close()


@dataclass
class FakeCluster:
    """Plays the Deployment controller and the kubelet for the Deployments of one test."""

    api: kmock.KubernetesEmulator
    load: FleetLoad = field(default_factory=FleetLoad)
    publishing: bool = True
    engines: dict[str, list[EngineStandIn]] = field(default_factory=dict)
    _ips: itertools.count[int] = field(default_factory=lambda: itertools.count(2))
    _pod_ip: dict[str, str] = field(default_factory=dict)

    def serving(self) -> int:
        """Pods with engines."""
        return max(1, len(self.engines))

    async def reconcile(self, deployment: str) -> None:
        """Make the pods of ``deployment`` match its replicas (Ready, with engines)."""
        dep = get_object(self.api, DEPLOY_RESOURCE, deployment)
        want = int((dep or {}).get("spec", {}).get("replicas", 0)) if dep else 0
        labels = (
            (dep or {}).get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
        )
        pods = sorted(p for p in self._pod_ip if p.startswith(f"{deployment}-"))
        for i in range(len(pods), want):
            await self.add_pod(f"{deployment}-{i}", labels)
        for pod in pods[want:]:
            await self.remove_pod(pod)

    @contextlib.asynccontextmanager
    async def following(self, deployment: str) -> AsyncIterator[None]:
        """Keep the pods of ``deployment`` matching its replicas while the block runs."""

        async def loop() -> None:
            while True:
                await self.reconcile(deployment)
                await asyncio.sleep(0.2)

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def add_pod(self, name: str, labels: dict[str, str], ready: bool = True) -> str:
        """Create a pod as the kubelet reports it: Running, Ready, with a 127.0.0.x IP."""
        ip = f"127.0.0.{next(self._ips)}"
        self._pod_ip[name] = ip
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "startTime": now,
        }
        if self.publishing:
            self.engines[name] = [
                EngineStandIn(
                    f"tcp://{ip}:{FPM_BASE_PORT}",
                    name,
                    0,
                    lambda: self.load.batch_for(self.serving()),
                )
            ]
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": dict(labels)},
            "spec": {"containers": [{"name": "vllm", "image": "x"}]},
            "status": status,
        }
        await create(self.api, f"/api/v1/namespaces/{NAMESPACE}/pods", body)
        return ip

    async def set_ready(self, name: str, ready: bool) -> None:
        """Flip a pod's Ready condition (as the kubelet does when a probe fails)."""
        cond = [{"type": "Ready", "status": "True" if ready else "False"}]
        await patch(
            self.api,
            f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status",
            {"status": {"conditions": cond}},
        )

    async def remove_pod(self, name: str) -> None:
        """Delete a pod and stop its engines."""
        for engine in self.engines.pop(name, []):
            engine.close()
        self._pod_ip.pop(name, None)
        await delete(self.api, f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")

    def silence(self) -> None:
        """Every engine stops publishing (pods stay Ready): the streams go stale."""
        self.publishing = False
        for engines in self.engines.values():
            for engine in engines:
                engine.close()
        self.engines.clear()

    def close(self) -> None:
        """Stop every engine."""
        self.silence()


@pytest_asyncio.fixture
async def cluster(api: ApiServerEmulator) -> AsyncIterator[FakeCluster]:
    """The fake controllers; engines stopped at the end."""
    fake = FakeCluster(api)
    yield fake
    fake.close()


@dataclass
class RunningOperator:
    """An operator running in this event loop."""

    state: ControllerState
    task: asyncio.Task[None]
    stop_flag: asyncio.Event

    async def stop(self) -> None:
        """Stop it the way kopf stops on SIGTERM."""
        self.stop_flag.set()
        await asyncio.wait_for(self.task, 30)


@contextlib.asynccontextmanager
async def operator_running(
    api: kmock.KubernetesEmulator,
    config: ControllerConfig | None = None,
    identity: str | None = None,
) -> AsyncIterator[RunningOperator]:
    """Run the real operator (handlers, timer, subscriber) against ``api``."""
    url = str(api.url).rstrip("/")
    state = ControllerState(
        kube=KubernetesApi(api_client_from_environment(url)), metrics=OperatorMetrics()
    )
    stop_flag = asyncio.Event()
    ready_flag = asyncio.Event()
    task = asyncio.create_task(
        run_operator(
            config=config or ControllerConfig(tick_s=0.25, standalone=True),
            metrics_port=None,
            liveness_endpoint=None,
            kube_host=url,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            state=state,
            identity=identity,
        )
    )
    await asyncio.wait_for(ready_flag.wait(), 30)
    running = RunningOperator(state, task, stop_flag)
    try:
        yield running
    finally:
        if not task.done():
            await running.stop()


async def eventually(
    check: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after the timeout.

    The timeout only bounds a broken test; nothing asserts on how long it took.
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        await asyncio.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}; last value: {last!r}")


def status_of(api: kmock.KubernetesEmulator, name: str) -> dict[str, Any]:
    """The VllmDeployment's status (empty when none yet)."""
    return (get_object(api, VD_RESOURCE, name) or {}).get("status") or {}


def condition(api: kmock.KubernetesEmulator, name: str, ctype: str) -> dict[str, Any]:
    """One condition of the VllmDeployment (empty when absent)."""
    for cond in status_of(api, name).get("conditions", []):
        if cond.get("type") == ctype:
            return dict(cond)
    return {}


def deployment_replicas(api: kmock.KubernetesEmulator, name: str) -> int | None:
    """The child Deployment's spec.replicas."""
    dep = get_object(api, DEPLOY_RESOURCE, name)
    return None if dep is None else int(dep["spec"]["replicas"])


def events(api: kmock.KubernetesEmulator, reason: str | None = None) -> list[dict[str, Any]]:
    """Events posted so far (optionally of one reason)."""
    out = []
    for (resource, _ns, _name), obj in list(api.objects.items()):
        if resource.plural == "events" and not obj.deleted:
            raw = obj.raw
            if reason is None or raw.get("reason") == reason:
                out.append(raw)
    return out


@pytest.fixture
def fleet_load() -> FleetLoad:
    """A fresh load level."""
    return FleetLoad()
