"""The kopf operator in-process against an emulated API server, engines on loopback.

See ``conftest.py`` for what is real and what the emulator does not do. Time is
compressed through the spec (decisions every second, 3 s load window, 2 s
scale-down window) and the fake engines' step-time law is known, so the
scaling decisions are predictable: demand of 2400 decode tokens/s needs two
replicas for a 10 ms ITL target, 600 needs one.
"""

from __future__ import annotations

import asyncio
import datetime

import pytest
import zmq
from prometheus_client import generate_latest

from stepscale_operator.controller.handlers import ControllerConfig
from tests.operator.conftest import (
    DEPLOY_RESOURCE,
    FPM_BASE_PORT,
    NAMESPACE,
    STEP_INTERCEPT_S,
    STEP_PER_DECODE_S,
    FakeCluster,
    condition,
    create,
    deployment_replicas,
    events,
    eventually,
    get_object,
    operator_running,
    patch,
    status_of,
    vd_body,
    vd_path,
)

pytestmark = pytest.mark.asyncio

HIGH_DEMAND = 2400.0  # decode tokens/s: two replicas needed
LOW_DEMAND = 600.0  # one replica is enough


async def test_children_subscriptions_and_garbage(api, cluster: FakeCluster) -> None:
    """Children with owner, env and ports; subscriptions follow pods; junk is counted."""
    async with operator_running(api) as op:
        await create(api, vd_path(), vd_body("chat"))
        dep = await eventually(lambda: get_object(api, DEPLOY_RESOURCE, "chat"), what="Deployment")
        svc = await eventually(lambda: get_object(api, "v1/services", "chat"), what="Service")
        vd = get_object(api, "stepscale.io/v1alpha1/vllmdeployments", "chat")
        assert vd is not None
        for child in (dep, svc):
            (owner,) = child["metadata"]["ownerReferences"]
            assert owner["uid"] == vd["metadata"]["uid"] and owner["controller"] is True
        c = dep["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["STEPSCALE_FPM_PORT"]["value"] == str(FPM_BASE_PORT)
        assert env["STEPSCALE_FPM_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.name"
        )
        assert {"name": "fpm-0", "containerPort": FPM_BASE_PORT, "protocol": "TCP"} in c["ports"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        assert dep["spec"]["replicas"] == 1

        labels = dep["spec"]["template"]["metadata"]["labels"]
        key = (NAMESPACE, "chat")
        ip = await cluster.add_pod("chat-0", labels)
        endpoint = f"tcp://{ip}:{FPM_BASE_PORT}"
        await eventually(
            lambda: op.state.autoscalers[key].subscriber.endpoints == {endpoint},
            what="subscription to the Ready pod",
        )
        # A pod that is not Ready is not subscribed to; when it turns Ready it is.
        ip1 = await cluster.add_pod("chat-1", labels, ready=False)
        await asyncio.sleep(1.0)
        assert op.state.autoscalers[key].subscriber.endpoints == {endpoint}
        await cluster.set_ready("chat-1", True)
        both = {endpoint, f"tcp://{ip1}:{FPM_BASE_PORT}"}
        await eventually(
            lambda: op.state.autoscalers[key].subscriber.endpoints == both, what="second pod"
        )
        # Unready again, then deleted: unsubscribed.
        await cluster.set_ready("chat-1", False)
        await eventually(
            lambda: op.state.autoscalers[key].subscriber.endpoints == {endpoint},
            what="unsubscribe on unready",
        )
        await cluster.remove_pod("chat-0")
        await eventually(
            lambda: op.state.autoscalers[key].subscriber.endpoints == set(),
            what="unsubscribe on delete",
        )

        # A pod that publishes garbage: counted, ignored, nothing crashes.
        ctx = zmq.Context.instance()
        junk = ctx.socket(zmq.PUB)
        junk.setsockopt(zmq.LINGER, 0)
        junk_ip = "127.0.0.250"
        junk.bind(f"tcp://{junk_ip}:{FPM_BASE_PORT}")
        try:
            cluster._pod_ip["chat-junk"] = junk_ip
            ns = NAMESPACE
            await create(
                api,
                f"/api/v1/namespaces/{ns}/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "chat-junk", "namespace": ns, "labels": labels},
                    "status": {
                        "phase": "Running",
                        "podIP": junk_ip,
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                },
            )

            def malformed() -> int:
                junk.send_multipart([b"", b"\x00" * 8, b"\xc1not msgpack"])
                junk.send_multipart([b"only one frame"])
                return int(status_of(api, "chat").get("streams", {}).get("malformed", 0))

            await eventually(lambda: malformed() > 0, what="malformed frames counted on status")
        finally:
            junk.close(0)
        assert not op.task.done()


async def test_model_fits_scales_up_and_down_then_holds_on_stale(api, cluster: FakeCluster) -> None:
    """Model fits and shows on status; load up -> scale up; down -> scale down; stale -> hold."""
    cluster.load.decode_tokens_per_s = LOW_DEMAND
    async with operator_running(api) as op, cluster.following("chat"):
        await create(api, vd_path(), vd_body("chat"))
        await eventually(
            lambda: status_of(api, "chat").get("costModel", {}).get("ready"), what="model ready"
        )
        cm = status_of(api, "chat")["costModel"]
        coef = {c["name"]: c["value"] for c in cm["coefficients"]}
        assert coef["intercept"] == pytest.approx(STEP_INTERCEPT_S, rel=0.2)
        assert coef["decode_requests"] == pytest.approx(STEP_PER_DECODE_S, rel=0.2)
        assert cm["mape"] < 0.05 and cm["formula"].startswith("step_ms = ")
        assert condition(api, "chat", "ModelReady")["status"] == "True"
        await eventually(
            lambda: condition(api, "chat", "MetricsFresh").get("status") == "True",
            what="fresh metrics",
        )
        assert deployment_replicas(api, "chat") == 1

        cluster.load.decode_tokens_per_s = HIGH_DEMAND
        await eventually(
            lambda: (deployment_replicas(api, "chat") or 0) >= 2, what="scale up to 2 or more"
        )
        # The status patch follows the Deployment's within the same round.
        await eventually(
            lambda: status_of(api, "chat").get("lastScaling", {}).get("to", 0) >= 2,
            what="scale-up on status",
        )
        st = status_of(api, "chat")
        assert st["lastScaling"]["action"] == "scale_up" and st["lastScaling"]["applied"] is True
        assert events(api, "ScaledUp"), "a ScaledUp event is recorded"
        # With the new replicas serving, predictions at the current count meet the SLO.
        await eventually(
            lambda: (
                (status_of(api, "chat").get("predictions", {}).get("current") or {}).get(
                    "replicas", 0
                )
                >= 2
            ),
            what="predictions at the new replica count",
        )
        pred = status_of(api, "chat")["predictions"]["current"]
        assert pred["itlMs"] < 10.0

        cluster.load.decode_tokens_per_s = LOW_DEMAND
        await eventually(lambda: deployment_replicas(api, "chat") == 1, what="scale down to 1")
        await eventually(
            lambda: status_of(api, "chat").get("lastScaling", {}).get("action") == "scale_down",
            what="scale-down on status",
        )
        assert events(api, "ScaledDown")
        exposition = generate_latest(op.state.metrics.registry).decode()
        for line in (
            'stepscale_scaling_decisions_total{action="scale_up",applied="true",'
            'deployment="llm/chat"}',
            'stepscale_cost_model_coefficient_seconds{coefficient="intercept",'
            'deployment="llm/chat",per="pass"}',
            'stepscale_fpm_passes_total{deployment="llm/chat"}',
        ):
            assert line in exposition, line

        # Every engine goes silent while demand would justify more: hold, never guess.
        cluster.load.decode_tokens_per_s = HIGH_DEMAND
        cluster.silence()
        await eventually(
            lambda: condition(api, "chat", "MetricsFresh").get("status") == "False",
            what="stale streams",
        )
        await eventually(
            lambda: (
                status_of(api, "chat").get("lastDecision", {}).get("reason", "").startswith("hold")
            ),
            what="hold decision",
        )
        await asyncio.sleep(3.0)
        assert deployment_replicas(api, "chat") == 1
        assert condition(api, "chat", "ScalingActive")["reason"] == "HoldingOnMissingData"


async def test_advisory_changes_nothing(api, cluster: FakeCluster) -> None:
    """Advisory mode decides and explains, and leaves the Deployment alone."""
    cluster.load.decode_tokens_per_s = HIGH_DEMAND
    async with operator_running(api), cluster.following("chat"):
        await create(api, vd_path(), vd_body("chat", mode="advisory"))
        await eventually(
            lambda: status_of(api, "chat").get("desiredReplicas", 0) >= 2,
            what="advised 2 or more replicas",
        )
        st = status_of(api, "chat")
        assert st["lastScaling"]["applied"] is False
        assert st["lastScaling"]["reason"].startswith("advisory, not applied")
        assert condition(api, "chat", "ScalingActive")["reason"] == "Advisory"
        assert events(api, "AdviseUp")
        await asyncio.sleep(2.0)
        assert deployment_replicas(api, "chat") == 1
        assert not events(api, "ScaledUp")


async def test_restart_warm_starts_from_status(api, cluster: FakeCluster) -> None:
    """A restarted operator restores the cost model from status and does not flap."""
    cluster.load.decode_tokens_per_s = HIGH_DEMAND
    async with operator_running(api), cluster.following("chat"):
        await create(api, vd_path(), vd_body("chat"))
        await eventually(lambda: deployment_replicas(api, "chat") == 2, what="scaled to 2")
        await eventually(
            lambda: status_of(api, "chat").get("costModel", {}).get("samples", 0) > 200,
            what="samples learned",
        )
    saved = status_of(api, "chat")["costModel"]
    replicas_before = deployment_replicas(api, "chat")
    assert replicas_before is not None and replicas_before >= 2
    # No new passes while the operator is down and after: only the checkpoint can explain
    # a ready model.
    cluster.silence()
    async with operator_running(api) as op:
        await eventually(lambda: events(api, "WarmStart"), what="WarmStart event")
        model = op.state.autoscalers[(NAMESPACE, "chat")].model.cost_model
        assert model.ready
        assert model.samples >= saved["samples"]
        restored = model.coefficients
        for c in saved["coefficients"]:
            assert restored[c["name"]] == pytest.approx(c["value"] or 0.0, rel=0.05, abs=1e-9)
        await asyncio.sleep(3.0)
        assert deployment_replicas(api, "chat") == replicas_before, "no flap after a restart"
        assert status_of(api, "chat")["costModel"]["ready"] is True


async def test_invalid_spec_is_degraded_not_a_crash(api, cluster: FakeCluster) -> None:
    """An invalid spec that slipped past the API server: Degraded + event; fixing it recovers."""
    async with operator_running(api) as op:
        await create(api, vd_path(), vd_body("bad", minReplicas=5, maxReplicas=2))
        await eventually(
            lambda: condition(api, "bad", "Degraded").get("status") == "True", what="Degraded"
        )
        cond = condition(api, "bad", "Degraded")
        assert cond["reason"] == "InvalidSpec"
        assert "minReplicas must be <= autoscaling.maxReplicas" in cond["message"]
        assert events(api, "InvalidSpec")
        assert get_object(api, DEPLOY_RESOURCE, "bad") is None
        assert not op.task.done()
        await patch(api, vd_path("bad"), {"spec": {"autoscaling": {"minReplicas": 1}}})
        await eventually(lambda: get_object(api, DEPLOY_RESOURCE, "bad"), what="Deployment")
        await eventually(
            lambda: condition(api, "bad", "Degraded").get("status") == "False",
            what="Degraded cleared",
        )


async def test_without_autoscaling_the_scale_subresource_rules(api, cluster: FakeCluster) -> None:
    """autoscaling.enabled=false: spec.replicas (what kubectl scale / an HPA write) is applied."""
    async with operator_running(api) as op:
        body = vd_body("fixed", enabled=False)
        body["spec"]["replicas"] = 2
        await create(api, vd_path(), body)
        await eventually(lambda: deployment_replicas(api, "fixed") == 2, what="2 replicas")
        await eventually(
            lambda: status_of(api, "fixed").get("mode") == "disabled", what="mode on status"
        )
        # kubectl scale vd fixed --replicas 3 writes spec.replicas through the scale subresource.
        await patch(api, vd_path("fixed"), {"spec": {"replicas": 3}})
        await eventually(lambda: deployment_replicas(api, "fixed") == 3, what="scaled to 3")
        assert status_of(api, "fixed")["selector"] == "stepscale.io/vllmdeployment=fixed"
        assert condition(api, "fixed", "ScalingActive").get("reason") == "Disabled"
        # Deleting the object stops listening (the children go by garbage collection,
        # which the emulator does not run).
        async with api.delete(vd_path("fixed")) as response:
            assert response.status == 200
        await eventually(
            lambda: (NAMESPACE, "fixed") not in op.state.autoscalers, what="autoscaler stopped"
        )


async def test_peering_standby_does_nothing_while_a_higher_peer_lives(api) -> None:
    """kopf peering: a replica stands by while a higher-priority peer is alive.

    The other replica is played by its record in the peering object (what kopf's
    keep-alive writes); two kopf operators in one process share kopf's global
    state, so the second replica is not run for real here.
    """
    now = datetime.datetime.now(datetime.UTC).isoformat()
    async with api.post(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        json={
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": "stepscale"},
            "status": {"replica-a": {"priority": 1000, "lifetime": 60, "lastseen": now}},
        },
    ) as response:
        assert response.status == 200
    config = ControllerConfig(tick_s=0.25, peering_name="stepscale", peering_priority=100)
    async with operator_running(api, config, identity="replica-b") as standby:
        await create(api, vd_path(), vd_body("chat"))
        await eventually(
            lambda: (
                "replica-b"
                in (
                    get_object(api, "kopf.dev/v1/clusterkopfpeerings", "stepscale", None) or {}
                ).get("status", {})
            ),
            what="the standby announced itself",
        )
        await asyncio.sleep(2.0)
        assert get_object(api, DEPLOY_RESOURCE, "chat") is None
        assert (NAMESPACE, "chat") not in standby.state.autoscalers
        # The other replica leaves the peering (it died and its record expired): take over.
        await patch(
            api, "/apis/kopf.dev/v1/clusterkopfpeerings/stepscale", {"status": {"replica-a": None}}
        )
        await eventually(lambda: get_object(api, DEPLOY_RESOURCE, "chat"), what="takeover")
