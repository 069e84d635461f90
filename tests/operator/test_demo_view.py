"""The demo's operator core and its kubectl view, without vLLM (a publisher stands in)."""

from __future__ import annotations

import socket
import time

import pytest

from stepscale_engine import wire
from stepscale_engine.publisher import FpmPublisher
from stepscale_operator.demo import DemoOperator, demo_spec, detail_lines, kubectl_table
from tests.operator.test_status_and_crd import drop_nulls, fitted_status, pruned, schema


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_demo_spec_is_an_advisory_cpu_deployment() -> None:
    spec = demo_spec(20999, ttft_ms=1500, itl_ms=60, refresh_s=3)
    assert spec.autoscaling.advisory and spec.resources.gpus == 0
    assert spec.fpm_ports == [20999]
    assert (spec.autoscaling.slo.ttft_ms, spec.autoscaling.slo.itl_ms) == (1500, 60)
    assert spec.engine.max_num_batched_tokens == 512 and spec.engine.max_num_seqs == 64


def test_kubectl_columns_come_from_status_ready_is_ready_replicas() -> None:
    status = fitted_status()
    status.update(replicas=3, readyReplicas=2, desiredReplicas=4)
    status["predictions"]["current"] = {"replicas": 2, "ttftMs": 168.4, "itlMs": 9.6}
    status["predictions"]["measured"] = {"ttftMs": 201.2, "itlMs": 12.7, "itlCorrection": 1.3}
    header, row = kubectl_table(status, "demo", 50).splitlines()
    assert header.split()[4:8] == ["TTFT", "TTFT-MEASURED", "ITL", "ITL-MEASURED"]
    assert header.startswith("NAME     REPLICAS  READY  DESIRED")
    cells = row.split()
    # Each predicted latency beside the one the fleet realized.
    assert cells[:8] == ["demo", "3", "2", "4", "168ms", "201ms", "10ms", "13ms"]
    assert cells[8] == f"{status['costModel']['mapePercent']:.0f}%" and cells[9] == "50s"
    model, load, streams, decision = detail_lines(status)
    assert model.startswith("  model   ready: step_ms = ")
    assert "malformed 2" in streams
    assert decision.startswith(f"  decision {status['lastDecision']['action']} 1 -> ")


def test_missing_values_print_as_dashes() -> None:
    header, row = kubectl_table({"replicas": 1}, "demo", 0).splitlines()
    assert row.split() == ["demo", "1", "-", "-", "-", "-", "-", "-", "-", "0s"]
    assert len(detail_lines({})) == 4


def test_demo_operator_runs_the_controller_core_on_a_local_stream() -> None:
    port = free_port()
    operator = DemoOperator(demo_spec(port, 1500, 60, 1), "local-engine-0")
    publisher = FpmPublisher(f"tcp://127.0.0.1:{port}", "local-engine-0", 0).start()
    try:
        starting = operator.status()
        assert (starting["replicas"], starting["readyReplicas"]) == (1, 0)
        assert starting["streams"]["endpoints"] == 0
        operator.pod_ready()
        deadline = time.monotonic() + 20.0  # bounds a broken test only
        status = operator.status()
        while status["streams"]["passes"] < 50 and time.monotonic() < deadline:
            for b in (1, 2, 4, 8):
                publisher.publish(
                    0.004 + 0.0003 * b,
                    wire.ScheduledRequestMetrics(
                        num_decode_requests=b, sum_decode_kv_tokens=100 * b
                    ),
                    wire.QueuedRequestMetrics(),
                )
            time.sleep(0.02)
            status = operator.status()
        assert status["streams"]["passes"] >= 50, status["streams"]
        assert (status["replicas"], status["readyReplicas"]) == (1, 1)
        assert status["streams"]["connected"] == 1 and status["mode"] == "advisory"
        assert status["lastDecision"]["applied"] is False
        assert status["costModel"]["samples"] > 0
        # What the demo writes is a status the CRD declares in full.
        stored = drop_nulls(status)
        assert pruned(stored, schema()["properties"]["status"]) == stored
        assert "NAME     REPLICAS  READY  DESIRED" in kubectl_table(status, "demo", 1)
    finally:
        publisher.close()
        operator.close()


@pytest.mark.parametrize("ready", [False, True])
def test_ready_column_follows_the_pod(ready: bool) -> None:
    operator = DemoOperator(demo_spec(free_port(), 1500, 60, 1), "p")
    try:
        if ready:
            operator.pod_ready()
        _, row = kubectl_table(operator.status(), "demo", 0).splitlines()
        assert row.split()[1:3] == ["1", "1" if ready else "0"]
    finally:
        operator.close()


def test_the_demo_waits_long_enough_for_the_planners_own_descent() -> None:
    """The demo waits for the fall by the planner's real rules: from its peak, the real
    ``Planner`` on the demo's policy, decided every 3 s on a light load, is back at one
    within ``wind_down_s``, whose bound grows by one settling time per replica."""
    from stepscale_operator.controller.autoscaler import planner_policy
    from stepscale_operator.demo import wind_down_s
    from stepscale_operator.planner import Planner
    from tests.unit.test_planner import inputs_for, load_of

    spec = demo_spec(20999, ttft_ms=1500, itl_ms=60, refresh_s=3)
    settle_s = spec.autoscaling.load_window_s
    assert wind_down_s(spec, 6) - wind_down_s(spec, 5) == pytest.approx(settle_s)
    planner, total, t = Planner(planner_policy(spec)), 8, 0.0
    while total > 1 and t < 2 * wind_down_s(spec, 8):
        d = planner.decide(inputs_for(load_of(0.5), total, now=t, max_replicas=8), now=t)
        total = d.desired_replicas
        t += 3.0
    assert total == 1
    # Counted from the last request the load window still holds the overload: the
    # descent alone fits the bound less that window, stepping once per settling time.
    assert 7 * settle_s <= t <= wind_down_s(spec, 8) - spec.autoscaling.load_window_s
