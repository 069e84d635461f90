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
  (tests/operator/test_status_and_crd.py checks the schema against what the
  operator writes); no validation of built-in kinds either: a test that needs
  the API server to refuse an object sets :attr:`ApiServerEmulator.refuse`;
* no status/scale subresource semantics: a patch to ``/status`` merges into the
  whole object, ``/scale`` returns the object itself;
* no server-side apply (an apply patch is a merge patch; apply does not create,
  the operator falls back to create), no strategic merge;
* no label selectors on list/watch (kopf filters pods by label itself);
* no controllers: no Deployment controller, no kubelet, no garbage collection
  through owner references. :class:`FakeCluster` plays the Deployment controller
  and the kubelet: it creates Ready pods with IPs on 127.1.x.y for the
  Deployment's replicas, starts a publisher per pod and rank, replaces every pod
  when the pod template changes (a rollout, all at once rather than one by one)
  and writes the Deployment's ``status.replicas``/``readyReplicas``;
* no RBAC and no authentication: :attr:`ApiServerEmulator.calls` records what the
  operator asked for, and the ``api`` fixture checks it against the permissions the
  chart grants in the mode the test ran (:attr:`ApiServerEmulator.namespaced`);
  with :attr:`ApiServerEmulator.rbac_namespaces` set, the emulator answers 403, as
  the chart's Roles would, to every operator request outside those namespaces or
  not granted, and records it in :attr:`ApiServerEmulator.forbidden`;
  :attr:`ApiServerEmulator.authorizations` records the credentials the operator
  presented, and the fixture checks that every request carried the token of the
  kubeconfig (or service account) it was started with;
* plain HTTP only: the in-cluster tests put a TLS proxy with a CA made in the test
  in front of it (:mod:`tests.operator.tls_proxy`).

The operator runs as users run it: :func:`operator_running` parses ``stepscale
operator`` arguments with the CLI's own parser and starts the operator with
``KUBECONFIG`` naming a kubeconfig file for the emulator; kopf and the client log
in through the operator's login path (``test_entry_auth.py`` runs the CLI as a
process, with a kubeconfig and in-cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import hashlib
import itertools
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
import kmock
import pytest
import pytest_asyncio
from kmock._internal import enums

from stepscale_engine import wire
from stepscale_engine.publisher import FpmPublisher
from stepscale_operator.cli import build_parser
from stepscale_operator.controller.cli_command import operator_options
from stepscale_operator.controller.entry import controller_state_from_environment, run_operator
from stepscale_operator.controller.handlers import ControllerState
from stepscale_operator.controller.permissions import Call, required_calls

NAMESPACE = "llm"
VD_RESOURCE = "stepscale.io/v1alpha1/vllmdeployments"
DEPLOY_RESOURCE = "apps/v1/deployments"
FPM_BASE_PORT = 20380
# The bearer token of the operator's kubeconfig (and service account): every request the
# operator makes must carry it.
OPERATOR_TOKEN = "stepscale-operator-test-token"
# ``stepscale operator`` arguments of the tests: fast ticks, frequent pod listings.
TEST_OPERATOR_ARGS = (
    "--standalone",
    "--tick-seconds",
    "0.25",
    "--pod-resync-seconds",
    "1",
    "--metrics-port",
    "0",
    "--health-port",
    "0",
)

_resource_versions = itertools.count(1000)
# Pod IPs are never reused within a test run: a publisher that one test leaves
# bound (zmq closes listeners on its own I/O thread) cannot take the address of a
# pod in the next test. 127.0.0.0/8 is all loopback; 127.0.0.x is left to tests
# that name their own addresses.
_pod_ips = itertools.count(0)


def next_pod_ip() -> str:
    """A loopback address no earlier pod of this test run had."""
    k = next(_pod_ips)
    return f"127.1.{k // 250}.{k % 250 + 2}"


def request_call(request: Any) -> Call | None:
    """(group, resource[/subresource], verb) of an API request; None for discovery paths."""
    if request.resource is None or not request.resource.plural:
        return None  # discovery (/api, /apis/GROUP/VERSION, /version): open to every user
    resource = request.resource.plural
    if request.subresource:
        resource = f"{resource}/{request.subresource}"
    method = str(getattr(request.method, "value", request.method)).upper()
    if method == "GET":
        if str(request.params.get("watch", "")).lower() in ("true", "1"):
            verb = "watch"
        else:
            verb = "get" if request.name else "list"
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method, "delete")
    return (request.resource.group or "", resource, verb)


class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what an API server adds to objects (see the module docstring).

    ``refuse``: called with each create/update request's (resource plural, body);
    a message it returns is answered as a 422 Invalid, the way a real server
    refuses an invalid object. ``calls``: the operator's requests (not the tests').
    """

    refuse: Callable[[str, Any], str | None] | None = None
    # Seconds each read of a Deployment by the operator takes (a slow API server).
    deployment_read_delay_s: float = 0.0
    # Which RBAC the operator runs under: namespaced Roles (in rbac_namespaces, which
    # turns 403s on) or the cluster-wide ClusterRole.
    namespaced: bool = False
    rbac_namespaces: frozenset[str] = frozenset()
    forbidden: list[tuple[Call, str | None]]
    calls: set[Call]
    authorizations: set[str]

    async def _handle(self, request: Any) -> Any:
        if not hasattr(self, "calls"):
            self.calls = set()
            self.authorizations = set()
            self.forbidden = []
        user_agent = str(request.headers.get("User-Agent", ""))
        call = request_call(request)
        if not user_agent.startswith("kmock/"):
            # The scheme is case-insensitive (RFC 7235): kopf sends "Bearer", the
            # kubernetes client's in-cluster loader "bearer".
            scheme, _, credentials = str(request.headers.get("Authorization", "")).partition(" ")
            self.authorizations.add(f"{scheme.lower()} {credentials}")
            if call is not None:
                self.calls.add(call)
                if self.rbac_namespaces and (
                    call not in required_calls(self.namespaced)
                    or request.namespace not in self.rbac_namespaces
                ):
                    self.forbidden.append((call, request.namespace))
                    raise kmock.KubernetesError(
                        status=403, reason="Forbidden", message=f"{call} is not granted"
                    )
            if call == ("apps", "deployments", "get") and self.deployment_read_delay_s:
                await asyncio.sleep(self.deployment_read_delay_s)
        if (
            self.refuse is not None
            and request.resource is not None
            and request.action in (enums.action.CREATE, enums.action.UPDATE)
            and isinstance(request.data, dict)  # not kopf's JSON patches
        ):
            message = self.refuse(request.resource.plural, request.data)
            if message:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=message)
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
    api.resources["kopf.dev/v1/kopfpeerings"] = kmock.ResourceInfo(
        kind="KopfPeering", namespaced=True, verbs=verbs
    )
    # kopf waits for namespaces to be discoverable even when it runs cluster-wide.
    api.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"list", "watch", "get"}
    )


@pytest_asyncio.fixture
async def api() -> AsyncIterator[ApiServerEmulator]:
    """An emulated API server on a loopback port; afterwards, every request the operator
    made must be one the chart's ClusterRole grants (operator tests run cluster-wide)
    and must have carried the operator's token."""
    async with ApiServerEmulator() as emulator, kmock.Server(emulator):
        declare_resources(emulator)
        emulator.calls = set()
        emulator.authorizations = set()
        emulator.forbidden = []
        yield emulator
    not_granted = emulator.calls - required_calls(namespaced=emulator.namespaced)
    assert not not_granted, f"requests the chart's RBAC does not grant: {sorted(not_granted)}"
    unauthenticated = emulator.authorizations - {f"bearer {OPERATOR_TOKEN}"}
    assert not unauthenticated, f"requests without the operator's token: {unauthenticated}"


def write_kubeconfig(path: str, server: str, token: str = OPERATOR_TOKEN) -> str:
    """A kubeconfig file naming ``server`` (the emulator) and a bearer token; returns ``path``."""
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator"}}],
        "current-context": "kmock",
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(kubeconfig, f)  # JSON is YAML
    return path


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
        "scaleDown": {"stabilizationWindowSeconds": 2, "initialHoldSeconds": 0},
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
STEP_PER_PREFILL_TOKEN_S = 0.00002
DECODE_CONTEXT = 1000
# Every 8th pass also computes a small prompt chunk: the cost model needs prefill-bearing
# passes before it is ready, and chunks this small keep the decode ITL near the decode law.
PREFILL_EVERY = 8
PREFILL_CHUNKS = (8, 16, 32)


def step_time(batch: int, prefill_tokens: int = 0) -> float:
    """The fake engine's forward-pass time for ``batch`` decode requests and a prompt chunk."""
    return STEP_INTERCEPT_S + STEP_PER_DECODE_S * batch + STEP_PER_PREFILL_TOKEN_S * prefill_tokens


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
        chunks = itertools.cycle(PREFILL_CHUNKS)
        sim = time.monotonic()
        passes = 0
        while not self._stop.is_set():
            now = time.monotonic()
            while sim < now:
                batch_scale, context_scale = next(spread)
                b = max(1, round(self._batch() * batch_scale))
                prefill = next(chunks) if passes % PREFILL_EVERY == 0 else 0
                wall = step_time(b, prefill)
                self.publisher.publish(
                    wall,
                    wire.ScheduledRequestMetrics(
                        num_prefill_requests=1 if prefill else 0,
                        sum_prefill_tokens=prefill,
                        num_decode_requests=b,
                        sum_decode_kv_tokens=int(b * DECODE_CONTEXT * context_scale),
                    ),
                    wire.QueuedRequestMetrics(),
                )
                sim += wall
                passes += 1
            self._stop.wait(0.05)

    def close(self) -> None:
        """Stop publishing (the stream goes silent: no heartbeats either)."""
        self._stop.set()
        self._thread.join(2.0)
        self.publisher.close()


@dataclass
class FakePod:
    """A pod as the fake kubelet runs it."""

    owner: str | None  # the Deployment that made it (None: created by a test)
    ip: str
    ready: bool
    template: str = ""  # digest of the pod template it was made from


def template_digest(deployment: dict[str, Any]) -> str:
    """Digest of a Deployment's pod template (a change means a rollout)."""
    template = deployment.get("spec", {}).get("template", {})
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:12]


def fpm_ports_of(deployment: dict[str, Any]) -> list[int]:
    """The FPM container ports (``fpm-<rank>``) of a Deployment's vLLM container."""
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers")
    ports = (containers or [{}])[0].get("ports", [])
    return [int(p["containerPort"]) for p in ports if str(p.get("name", "")).startswith("fpm-")]


@dataclass
class FakeCluster:
    """Plays the Deployment controller and the kubelet for the Deployments of one test."""

    api: kmock.KubernetesEmulator
    load: FleetLoad = field(default_factory=FleetLoad)
    publishing: bool = True
    engines: dict[str, list[EngineStandIn]] = field(default_factory=dict)
    pods: dict[str, FakePod] = field(default_factory=dict)
    _serial: itertools.count[int] = field(default_factory=itertools.count)
    _written_status: dict[str, tuple[int, int]] = field(default_factory=dict)

    def serving(self) -> int:
        """Pods with engines."""
        return max(1, len(self.engines))

    def pods_of(self, deployment: str) -> list[str]:
        """Names of the pods ``deployment`` made, oldest first."""
        return [name for name, pod in self.pods.items() if pod.owner == deployment]

    async def reconcile(self, deployment: str) -> None:
        """Make the pods of ``deployment`` match its replicas and template; write its status."""
        dep = get_object(self.api, DEPLOY_RESOURCE, deployment)
        want = int(dep.get("spec", {}).get("replicas", 0)) if dep else 0
        template = template_digest(dep) if dep else ""
        # A new pod template rolls every pod (all at once here).
        for name in self.pods_of(deployment):
            if self.pods[name].template != template:
                await self.remove_pod(name)
        current = self.pods_of(deployment)
        labels = (dep or {}).get("spec", {}).get("template", {}).get("metadata", {}).get("labels")
        for _ in range(len(current), want):
            await self.add_pod(
                f"{deployment}-{next(self._serial)}",
                dict(labels or {}),
                owner=deployment,
                template=template,
                fpm_ports=fpm_ports_of(dep or {}) or [FPM_BASE_PORT],
            )
        for name in current[want:][::-1]:
            await self.remove_pod(name)
        if dep is not None:
            await self.write_status(deployment)

    async def write_status(self, deployment: str) -> None:
        """Deployment status as its controller reports it: pods, and Ready pods."""
        names = self.pods_of(deployment)
        counts = (len(names), sum(1 for n in names if self.pods[n].ready))
        if self._written_status.get(deployment) == counts:
            return
        self._written_status[deployment] = counts
        await patch(
            self.api,
            f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{deployment}/status",
            {"status": {"replicas": counts[0], "readyReplicas": counts[1]}},
        )

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

    async def add_pod(
        self,
        name: str,
        labels: dict[str, str],
        ready: bool = True,
        *,
        owner: str | None = None,
        template: str = "",
        fpm_ports: Sequence[int] = (FPM_BASE_PORT,),
        ip: str | None = None,
        engines: bool = True,
    ) -> str:
        """Create a pod as the kubelet reports it: Running, Ready, with a 127.1.x.y IP,
        and (``engines``, while publishing) an engine stand-in per FPM port (rank)."""
        ip = ip or next_pod_ip()
        self.pods[name] = FakePod(owner, ip, ready, template)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "startTime": now,
        }
        if engines and self.publishing:
            self.engines[name] = [
                EngineStandIn(
                    f"tcp://{ip}:{port}", name, rank, lambda: self.load.batch_for(self.serving())
                )
                for rank, port in enumerate(fpm_ports)
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
        self.pods[name].ready = ready
        cond = [{"type": "Ready", "status": "True" if ready else "False"}]
        await patch(
            self.api,
            f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status",
            {"status": {"conditions": cond}},
        )

    def _stop_engines(self, name: str) -> None:
        for engine in self.engines.pop(name, []):
            engine.close()

    async def remove_pod(self, name: str) -> None:
        """Delete a pod and stop its engines."""
        self._stop_engines(name)
        self.pods.pop(name, None)
        await delete(self.api, f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")

    def vanish_pod(self, name: str) -> None:
        """Delete a pod without a watch event: what a watcher that was down (re-list,
        peering pause) never hears about."""
        self._stop_engines(name)
        self.pods.pop(name, None)
        self.api.objects[(kmock.resource("v1/pods"), NAMESPACE, name)].delete()

    def silence(self) -> None:
        """Every engine stops publishing (pods stay Ready): the streams go stale."""
        self.publishing = False
        for name in list(self.engines):
            self._stop_engines(name)

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
    args: Sequence[str] = TEST_OPERATOR_ARGS,
    identity: str | None = None,
) -> AsyncIterator[RunningOperator]:
    """Run the real operator (handlers, timer, subscriber) against ``api``, in this loop.

    ``args`` are ``stepscale operator`` arguments, parsed by the CLI's parser; the
    operator logs in from ``KUBECONFIG``, a kubeconfig file naming the emulator (set
    while it runs). Only ``identity`` (kopf's name for this peer, by default from
    host and process) is given directly: tests run peers in one process.
    """
    parsed = build_parser().parse_args(["operator", *args])
    with tempfile.TemporaryDirectory() as tmp:
        path = write_kubeconfig(os.path.join(tmp, "kubeconfig"), str(api.url).rstrip("/"))
        saved = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = path
        try:
            async with _operator_task(parsed, identity) as running:
                yield running
        finally:
            if saved is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = saved


@contextlib.asynccontextmanager
async def _operator_task(args: Any, identity: str | None) -> AsyncIterator[RunningOperator]:
    state = controller_state_from_environment()
    stop_flag = asyncio.Event()
    ready_flag = asyncio.Event()
    task = asyncio.create_task(
        run_operator(
            **operator_options(args),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            state=state,
            identity=identity,
        )
    )
    ready = asyncio.create_task(ready_flag.wait())
    await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        if task.done():
            task.result()  # the operator failed to start: its error
        pytest.fail("the operator did not become ready")
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


def scaling_events(api: kmock.KubernetesEmulator) -> list[dict[str, Any]]:
    """ScaledUp/ScaledDown events posted so far."""
    return [e for e in events(api) if e.get("reason") in ("ScaledUp", "ScaledDown")]


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
