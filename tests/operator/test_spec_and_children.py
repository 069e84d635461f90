"""Spec parsing/validation and the child objects built from it (pure)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from stepscale_operator.controller.autoscaler import planner_policy
from stepscale_operator.controller.children import (
    INSTANCE_LABEL,
    build_deployment,
    build_service,
    selector_string,
    vllm_args,
)
from stepscale_operator.controller.discovery import (
    PendingPods,
    PodDirectory,
    StreamChanges,
    pod_view,
)
from stepscale_operator.controller.spec import SpecError, parse_spec

BASE: dict[str, Any] = {"model": "m", "image": "img:1"}


def spec_with(**changes: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    raw.update(changes)
    return raw


def test_defaults_match_the_crd_defaults() -> None:
    spec = parse_spec(BASE)
    assert spec.replicas == 1 and spec.port == 8000 and spec.fpm_base_port == 20380
    assert spec.autoscaling.mode == "auto" and spec.autoscaling.enabled
    assert (spec.autoscaling.min_replicas, spec.autoscaling.max_replicas) == (1, 8)
    assert spec.autoscaling.slo.ttft_ms == 1000.0 and spec.autoscaling.slo.itl_ms == 50.0
    assert spec.resources.gpus == 1 and spec.engine.max_num_batched_tokens == 2048
    assert spec.autoscaling.burst_memory_s == 900.0 and spec.autoscaling.recurring_bursts == 3


def test_burst_settings_reach_the_planner() -> None:
    spec = parse_spec(
        spec_with(autoscaling={"bursts": {"memorySeconds": 1800, "recurringAfter": 0}})
    )
    policy = planner_policy(spec)
    assert policy.burst_memory_s == 1800.0 and policy.recurring_bursts == 0
    assert planner_policy(parse_spec(BASE)).recurring_bursts == 3


def test_routing_reaches_the_planner_and_defaults_to_the_services_random_spread() -> None:
    assert parse_spec(BASE).autoscaling.routing == "random"
    assert not planner_policy(parse_spec(BASE)).balanced_routing
    balanced = parse_spec(spec_with(autoscaling={"routing": "balanced"}))
    assert planner_policy(balanced).balanced_routing
    with pytest.raises(SpecError, match="routing"):
        parse_spec(spec_with(autoscaling={"routing": "round-robin"}))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "lower minReplicas"),
        ({"resources": {"gpus": 3}, "tensorParallelSize": 2}, "tensorParallelSize * dataParallel"),
        ({"port": 20381, "dataParallelSize": 2}, "must not include port"),
        ({"fpm": {"basePort": 65535}, "dataParallelSize": 2}, "lower fpm.basePort"),
        ({"engine": {"maxNumSeqs": 512, "maxNumBatchedTokens": 256}}, "raise maxNumBatchedTokens"),
        ({"env": [{"name": "STEPSCALE_FPM_PORT", "value": "1"}]}, "STEPSCALE_FPM_"),
        ({"autoscaling": {"mode": "yolo"}}, "must be one of auto, advisory"),
        (
            {"autoscaling": {"bursts": {"recurringAfter": -1}}},
            "spec.autoscaling.bursts.recurringAfter: must be >= 0",
        ),
        ({"replicas": "two"}, "spec.replicas: must be an integer"),
        ({"autoscaling": {"startupSeconds": 1e10}}, "startupSeconds: must be <= 86400"),
        ({"autoscaling": {"slo": {"itlMs": 0}}}, "spec.autoscaling.slo.itlMs: must be > 0"),
        ({"model": ""}, "spec.model"),
        ({"autoscaling": {"costModel": {"initialCoefficients": {"bogus": 1}}}}, "unknown"),
        ({"resources": {"gpus": 1, "cpu": "4 cores"}}, "spec.resources.cpu: '4 cores' is not"),
        ({"resources": {"gpus": 1, "memory": "16gb"}}, "write it like 500m, 4, 16Gi"),
        (
            {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
            "spec.env: A set more than once",
        ),
    ],
)
def test_invalid_specs_say_what_to_fix(changes: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(**changes))
    assert fragment in str(info.value)


def test_gpus_default_to_one_per_rank() -> None:
    """Only tensorParallelSize (or dataParallelSize) given: gpus follows, the spec is valid."""
    assert parse_spec(spec_with(tensorParallelSize=2)).resources.gpus == 2
    assert parse_spec(spec_with(tensorParallelSize=2, dataParallelSize=2)).resources.gpus == 4
    assert parse_spec(spec_with(tensorParallelSize=2, resources={"gpus": 0})).resources.gpus == 0


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"replicas": -1, "autoscaling": {"minReplicas": 9, "maxReplicas": 2}})
    text = str(info.value)
    assert "spec.model: is required" in text and "spec.image: is required" in text
    assert "spec.replicas: must be >= 0" in text and "lower minReplicas" in text


def test_not_an_object_is_an_error_not_a_crash() -> None:
    for raw in (None, [], "x", {"autoscaling": "on", **BASE}):
        with pytest.raises(SpecError):
            parse_spec(raw)  # type: ignore[arg-type]


def test_deployment_runs_vllm_with_the_plugin_and_a_port_per_rank() -> None:
    spec = parse_spec(
        spec_with(
            dataParallelSize=2,
            tensorParallelSize=2,
            resources={"gpus": 4, "memory": "64Gi"},
            servedModelName="chat",
            engine={"extraArgs": ["--enable-prefix-caching"], "maxModelLen": 8192},
            env=[{"name": "HF_HOME", "value": "/cache"}],
            podTemplate={"nodeSelector": {"gpu": "h100"}, "labels": {"team": "a"}},
        )
    )
    dep = build_deployment("chat", "ns", "uid-1", spec, replicas=3)
    assert dep["spec"]["replicas"] == 3
    assert dep["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "stepscale.io/v1alpha1",
            "kind": "VllmDeployment",
            "name": "chat",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    template = dep["spec"]["template"]
    assert template["metadata"]["labels"][INSTANCE_LABEL] == "chat"
    assert template["metadata"]["labels"]["team"] == "a"
    assert dep["spec"]["selector"]["matchLabels"] == {INSTANCE_LABEL: "chat"}
    pod = template["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    args = c["args"]
    assert args[args.index("--model") + 1] == "m"
    assert args[args.index("--data-parallel-size") + 1] == "2"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[-1] == "--enable-prefix-caching"
    env = {e["name"]: e for e in c["env"]}
    assert env["STEPSCALE_FPM_PORT"]["value"] == "20380"
    assert env["STEPSCALE_FPM_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["HF_HOME"]["value"] == "/cache"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "fpm-0": 20380, "fpm-1": 20381}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_service_selects_the_pods_and_serves_the_api_port() -> None:
    spec = parse_spec(spec_with(port=9000))
    svc = build_service("chat", "ns", "u", spec)
    assert svc["spec"]["selector"] == {INSTANCE_LABEL: "chat"}
    assert svc["spec"]["ports"][0]["port"] == 9000
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert selector_string("chat") == f"{INSTANCE_LABEL}=chat"


def test_cpu_pods_request_no_gpu() -> None:
    spec = parse_spec(spec_with(resources={"gpus": 0, "cpu": "4"}))
    (c,) = build_deployment("x", "ns", "u", spec, 1)["spec"]["template"]["spec"]["containers"]
    assert "limits" not in c["resources"] or "nvidia.com/gpu" not in c["resources"]["limits"]
    assert "--data-parallel-size" not in vllm_args(spec)


def pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_discovery_subscribes_every_rank_of_ready_pods_only() -> None:
    pods = PodDirectory(base_port=20380, data_parallel_size=2)
    assert not pods.observe(pod_view(pod("a", None, ready=False)))
    assert pods.starting_since() and pods.ready_count() == 0
    changes = pods.observe(pod_view(pod("a", "10.0.0.1", ready=True)))
    assert changes.added == {
        "tcp://10.0.0.1:20380": ("a", 0),
        "tcp://10.0.0.1:20381": ("a", 1),
    }
    assert pods.ready_count() == 1
    # Unready: both ranks dropped; terminating counts as gone.
    assert set(pods.observe(pod_view(pod("a", "10.0.0.1", ready=False))).removed) == {
        "tcp://10.0.0.1:20380",
        "tcp://10.0.0.1:20381",
    }
    pods.observe(pod_view(pod("a", "10.0.0.1", ready=True)))
    assert len(pods.observe(pod_view(pod("a", "10.0.0.1", True, deleting=True))).removed) == 2
    assert pods.starting_since() == []
    pods.observe(pod_view(pod("b", "fd00::5", ready=True)))
    assert "tcp://[fd00::5]:20380" in pods.endpoints
    assert len(pods.forget("b").removed) == 2 and pods.endpoints == {}


def test_discovery_follows_a_port_change() -> None:
    pods = PodDirectory(base_port=20380, data_parallel_size=1)
    pods.observe(pod_view(pod("a", "10.0.0.1", ready=True)))
    changes = pods.reconfigure(30000, 1)
    assert changes.removed == {"tcp://10.0.0.1:20380": ("a", 0)}
    assert changes.added == {"tcp://10.0.0.1:30000": ("a", 0)}


def test_malformed_pods_read_as_not_ready() -> None:
    for raw in (
        {},
        {"status": {"conditions": "nope"}},
        {"metadata": {"name": "x"}, "status": None},
    ):
        view = pod_view(raw)
        assert not view.serving


def test_valid_quantities_pass() -> None:
    pairs = (("500m", "16Gi"), ("4", "64G"), ("0.5", "1e9"), ("2", "512Mi"), ("+1", "+16Gi"))
    for cpu, memory in pairs:
        spec = parse_spec(spec_with(resources={"gpus": 1, "cpu": cpu, "memory": memory}))
        assert (spec.resources.cpu, spec.resources.memory) == (cpu, memory)


def test_resync_forgets_pods_a_listing_lacks() -> None:
    """A deletion the watch missed: the listing drops the pod and its streams."""
    pods = PodDirectory(base_port=20380, data_parallel_size=1)
    pods.observe(pod_view(pod("a", "10.0.0.1", ready=True)))
    pods.observe(pod_view(pod("b", "10.0.0.2", ready=True)))
    since = pods.mark()
    changes = pods.resync([pod_view(pod("a", "10.0.0.1", ready=True))], since)
    assert changes.removed == {"tcp://10.0.0.2:20380": ("b", 0)} and not changes.added
    assert set(pods.pods) == {"a"}
    # A pod the watch never reported (a missed ADDED) comes in from the listing.
    changes = pods.resync(
        [pod_view(pod("a", "10.0.0.1", ready=True)), pod_view(pod("c", "10.0.0.3", ready=True))],
        pods.mark(),
    )
    assert changes.added == {"tcp://10.0.0.3:20380": ("c", 0)} and not changes.removed


def test_resync_does_not_undo_events_newer_than_the_listing() -> None:
    pods = PodDirectory(base_port=20380, data_parallel_size=1)
    pods.observe(pod_view(pod("a", "10.0.0.1", ready=True)))
    since = pods.mark()  # the listing starts here...
    pods.observe(pod_view(pod("b", "10.0.0.2", ready=True)))  # ...an ADDED arrives meanwhile
    pods.forget("a")  # ...and a DELETED
    listed = [pod_view(pod("a", "10.0.0.1", ready=True))]  # the listing predates both
    changes = pods.resync(listed, since)
    assert not changes
    assert set(pods.pods) == {"b"}
    # The next listing (after both events) agrees; forgotten pods are not kept forever.
    assert not pods.resync([pod_view(pod("b", "10.0.0.2", ready=True))], pods.mark())
    assert set(pods.pods) == {"b"}


def test_stream_changes_merge_cancels_a_drop_and_re_add() -> None:
    a = {"tcp://x:1": ("p", 0)}
    merged = StreamChanges.merge([StreamChanges({}, dict(a)), StreamChanges(dict(a), {})])
    assert not merged
    merged = StreamChanges.merge([StreamChanges(dict(a), {}), StreamChanges({}, dict(a))])
    assert not merged


def test_pending_pods_are_bounded_oldest_first() -> None:
    pending = PendingPods(limit=3)
    for i in range(5):
        pending.put(("ns", "vd"), f"p{i}", {"metadata": {"name": f"p{i}"}})
    assert len(pending) == 3
    pending.discard(("ns", "vd"), "p3")
    pending.put(("ns", "other"), "q", {"metadata": {"name": "q"}})
    names = [b["metadata"]["name"] for b in pending.pop_owner(("ns", "vd"))]
    assert names == ["p2", "p4"]
    assert len(pending) == 1
