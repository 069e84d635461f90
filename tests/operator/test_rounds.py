"""What a decision round reports besides status: events, metrics, monotonic totals (no API)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from stepscale_engine import wire
from stepscale_engine.publisher import FpmPublisher
from stepscale_operator.controller.autoscaler import DeploymentAutoscaler
from stepscale_operator.controller.discovery import PodView
from stepscale_operator.controller.metrics import OperatorMetrics
from stepscale_operator.controller.rounds import (
    EventGate,
    ScaleBackoff,
    observe_decision,
    observe_metrics,
    scaling_event,
)
from stepscale_operator.controller.spec import parse_spec
from stepscale_operator.planner import Decision

DEPLOYMENT = "ns/chat"


def decision(action: str, current: int, desired: int, apply: bool) -> Decision:
    return Decision(
        time=0.0,
        desired_replicas=desired,
        current_replicas=current,
        action=action,
        apply=apply,
        reason=f"{action} because",
        confidence=1.0,
        predicted_current=None,
        predicted_desired=None,
    )


def test_scale_backoff_doubles_reports_one_refusal_per_streak_and_ends_on_success() -> None:
    backoff = ScaleBackoff(max_s=8.0)
    key = ("ns", "chat")
    assert backoff.waiting(key, 0.0) is None
    assert backoff.refused(key, 0.0, 1.0, "quota exceeded") is True  # the streak's first
    assert backoff.waiting(key, 0.5) == "quota exceeded; next attempt in 0 s"
    assert backoff.waiting(key, 1.0) is None  # waited base_s
    assert backoff.refused(key, 1.0, 1.0, "quota exceeded") is False  # same streak
    assert backoff.waiting(key, 2.9) is not None and backoff.waiting(key, 3.0) is None
    for now in (3.0, 7.0, 15.0):
        backoff.refused(key, now, 1.0, "quota exceeded")
    assert backoff.waiting(key, 22.9) is not None  # capped at max_s: 15 + 8
    assert backoff.waiting(key, 23.0) is None
    backoff.succeeded(key)
    assert backoff.waiting(key, 23.0) is None
    assert backoff.refused(key, 30.0, 1.0, "again") is True  # a new streak


def test_decisions_are_counted_and_an_applied_scale_up_that_undoes_a_scale_down_is_a_flap() -> None:
    metrics = OperatorMetrics()

    def count(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, {"deployment": DEPLOYMENT, **labels})
        return value or 0.0

    up = decision("scale_up", 2, 3, True)
    flap = replace(up, inputs={"undoes_scale_down_s_ago": 15.0})
    observe_decision(metrics, DEPLOYMENT, up, applied=True)  # a new need, no flap
    observe_decision(metrics, DEPLOYMENT, flap, applied=True)
    observe_decision(metrics, DEPLOYMENT, flap, applied=False)  # refused: nothing changed
    observe_decision(metrics, DEPLOYMENT, decision("hold", 3, 3, False), applied=False)
    decisions = "stepscale_scaling_decisions_total"
    assert count(decisions, action="scale_up", applied="true") == 2.0
    assert count(decisions, action="scale_up", applied="false") == 1.0
    assert count(decisions, action="hold", applied="false") == 1.0
    assert count("stepscale_scale_downs_undone_total") == 1.0


def test_event_reasons() -> None:
    assert scaling_event(decision("hold", 2, 2, False), applied=False) is None
    up = scaling_event(decision("scale_up", 1, 3, True), applied=True)
    assert up is not None and (up.type, up.reason) == ("Normal", "ScaledUp")
    assert up.message == "1 -> 3: scale_up because"
    failed = scaling_event(decision("scale_down", 3, 2, True), applied=False)
    assert failed is not None and (failed.type, failed.reason) == ("Warning", "ScaleFailed")
    advice = scaling_event(decision("scale_down", 3, 2, False), applied=False)
    assert advice is not None and advice.reason == "AdviseDown"


def test_advice_is_posted_when_it_changes_not_every_round() -> None:
    gate = EventGate()
    key = ("ns", "chat")
    posted = []
    for current, desired in [(1, 2), (1, 2), (1, 2), (1, 3), (1, 3), (1, 1), (1, 2)]:
        action = "hold" if desired == current else "scale_up"
        d = decision(action, current, desired, apply=False)
        event = scaling_event(d, applied=False)
        if gate.admit(key, d, event):
            assert event is not None
            posted.append((event.reason, desired))
    assert posted == [("AdviseUp", 2), ("AdviseUp", 3), ("AdviseUp", 2)]
    # Applied scalings are always posted; a repeated failure once.
    applied = decision("scale_up", 1, 2, apply=True)
    assert gate.admit(key, applied, scaling_event(applied, applied=True))
    assert gate.admit(key, applied, scaling_event(applied, applied=True))
    assert gate.admit(key, applied, scaling_event(applied, applied=False))
    assert not gate.admit(key, applied, scaling_event(applied, applied=False))


def status(mape: float | None, ttft_ms: float | None, coef: float | None) -> dict[str, Any]:
    return {
        "replicas": 2,
        "desiredReplicas": 2,
        "streams": {"connected": 2, "stale": 0},
        "costModel": {
            "ready": mape is not None,
            "samples": 500,
            "mape": mape,
            "r2": None if mape is None else 0.99,
            "coefficients": [
                {"name": "intercept", "unit": "s/pass", "value": coef},
                {"name": "decode_requests", "unit": "s/request", "value": 0.0003},
            ],
        },
        "load": {"decodeTokensPerSecond": 100.0, "prefillTokensPerSecond": None},
        "predictions": {"current": {"ttftMs": ttft_ms, "itlMs": 8.0}, "desired": None},
    }


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == {"deployment": DEPLOYMENT, **labels}:
                return float(sample.value)
    return None


def test_gauges_lose_their_series_when_the_value_goes() -> None:
    metrics = OperatorMetrics()
    previous: dict[str, int] = {}
    kwargs: dict[str, Any] = {"totals": {}, "previous": previous, "endpoints": 2, "ready": 2}
    observe_metrics(metrics, DEPLOYMENT, status=status(0.03, 120.0, 0.004), **kwargs)
    assert value(metrics, "stepscale_cost_model_mape_ratio") == pytest.approx(0.03)
    assert value(metrics, "stepscale_predicted_ttft_seconds", at="current") == pytest.approx(0.12)
    assert value(metrics, "stepscale_predicted_itl_seconds", at="current") == pytest.approx(0.008)
    assert value(
        metrics, "stepscale_cost_model_coefficient_seconds", coefficient="intercept", per="pass"
    ) == pytest.approx(0.004)
    # The model is reset / overloaded / no prediction: no stale values remain.
    assert value(metrics, "stepscale_cost_model_misfit_buckets") == 0.0
    # The model is far off in one kind of pass (status names it), then in none.
    learning = status(0.03, 120.0, 0.004)
    learning["costModel"]["misfitBuckets"] = {
        "prefill 1024-4095 tokens, decode 0, context 4096+": 0.6
    }
    observe_metrics(metrics, DEPLOYMENT, status=learning, **kwargs)
    assert value(metrics, "stepscale_cost_model_misfit_buckets") == 1.0
    observe_metrics(metrics, DEPLOYMENT, status=status(None, None, None), **kwargs)
    assert value(metrics, "stepscale_cost_model_misfit_buckets") == 0.0
    assert value(metrics, "stepscale_cost_model_mape_ratio") is None
    assert value(metrics, "stepscale_cost_model_r2_ratio") is None
    assert value(metrics, "stepscale_predicted_ttft_seconds", at="current") is None
    assert value(metrics, "stepscale_predicted_itl_seconds", at="desired") is None
    assert value(metrics, "stepscale_load_tokens_per_second", kind="prefill") is None
    assert (
        value(
            metrics,
            "stepscale_cost_model_coefficient_seconds",
            coefficient="intercept",
            per="pass",
        )
        is None
    )
    assert value(
        metrics,
        "stepscale_cost_model_coefficient_seconds",
        coefficient="decode_requests",
        per="request",
    ) == pytest.approx(0.0003)


def test_counters_follow_totals() -> None:
    metrics = OperatorMetrics()
    previous: dict[str, int] = {}
    st = status(0.03, 120.0, 0.004)
    for totals in (
        {"passes": 10, "messages": 12, "malformed:not_msgpack": 1},
        {"passes": 25, "messages": 30, "malformed:not_msgpack": 3},
    ):
        observe_metrics(
            metrics, DEPLOYMENT, totals=totals, previous=previous, status=st, endpoints=1, ready=1
        )
    assert value(metrics, "stepscale_fpm_passes_total") == 25
    assert value(metrics, "stepscale_fpm_messages_total") == 30
    assert value(metrics, "stepscale_fpm_malformed_total", reason="not_msgpack") == 3


def test_totals_keep_what_a_forgotten_stream_sent() -> None:
    """A pod goes away in the same round as others publish: no increment is lost."""
    spec = parse_spec({"model": "m", "image": "i", "fpm": {"basePort": 20380}})
    autoscaler = DeploymentAutoscaler("ns/chat", spec)
    publishers = {
        name: FpmPublisher(f"tcp://{ip}:20380", name, 0).start()
        for name, ip in (("a", "127.0.0.41"), ("b", "127.0.0.42"))
    }
    try:
        for name, ip in (("a", "127.0.0.41"), ("b", "127.0.0.42")):
            autoscaler.observe_pod(PodView(name, ip, True, False, None))

        def publish_until(seen: int) -> int:
            deadline = time.monotonic() + 20.0  # bounds a broken test only
            while time.monotonic() < deadline:
                for publisher in publishers.values():
                    publisher.publish(
                        0.005,
                        wire.ScheduledRequestMetrics(num_decode_requests=1),
                        wire.QueuedRequestMetrics(),
                    )
                time.sleep(0.02)
                autoscaler.ingest()
                passes = autoscaler.totals()["passes"]
                if passes >= seen:
                    return passes
            pytest.fail("no passes arrived")

        before = publish_until(20)
        autoscaler.forget_pod("b")
        after_forget = autoscaler.totals()["passes"]
        assert after_forget >= before  # b's passes stay counted
        assert autoscaler.decide().stream_health["streams"] == 1
        assert publish_until(after_forget + 5) > after_forget  # a still counts up
    finally:
        autoscaler.close()
        for publisher in publishers.values():
            publisher.close()


def test_learned_bursts_survive_a_restart_and_a_spec_change() -> None:
    """Saved as wall-clock onsets, restored on the new autoscaler's own clock."""
    spec = parse_spec({"model": "m", "image": "i", "fpm": {"basePort": 20390}})
    wall_now, mono_now = 1.7e9, 5000.0
    saved = [(wall_now - 1500.0, 7), (wall_now - 900.0, 8), (wall_now - 300.0, 7)]
    autoscaler = DeploymentAutoscaler(
        "ns/chat", spec, bursts=saved, clock=lambda: mono_now, wall_clock=lambda: wall_now
    )
    try:
        assert autoscaler.planner.burst_onsets() == [(3500.0, 7), (4100.0, 8), (4700.0, 7)]
        # A spec change that rebuilds the planner keeps what it learned.
        changed = parse_spec(
            {
                "model": "m",
                "image": "i",
                "fpm": {"basePort": 20390},
                "autoscaling": {"scaleUp": {"maxSurge": 2}},
            }
        )
        old_planner = autoscaler.planner
        autoscaler.reconfigure(changed)
        assert autoscaler.planner is not old_planner
        assert autoscaler.planner.burst_onsets() == [(3500.0, 7), (4100.0, 8), (4700.0, 7)]
    finally:
        autoscaler.close()


def test_no_trend_from_a_partly_filled_window_after_start_or_reconfigure() -> None:
    """A warm restart (a new autoscaler) or a new load window starts with an empty
    window: until a whole window has data, its trends are withheld (zero, named
    unavailable), not read off a slope across the empty part (a spurious rise)."""
    from stepscale_operator.fpm_pipeline import MessageBatch

    raw = {
        "model": "m",
        "image": "i",
        "fpm": {"basePort": 20395},
        "autoscaling": {"intervalSeconds": 1, "metrics": {"windowSeconds": 3}},
    }
    clock = [100.3]  # mid-bucket, as a restart lands
    autoscaler = DeploymentAutoscaler("ns/chat", parse_spec(raw), clock=lambda: clock[0])
    counter = 0

    def run_until(end: float) -> None:
        """Steady decode load: a pass of 16 requests every 10 ms, ingested as it arrives."""
        nonlocal counter
        while clock[0] < end:
            msgs = []
            for _ in range(10):
                counter += 1
                msgs.append(
                    wire.ForwardPassMetrics(
                        worker_id="pod-a",
                        dp_rank=0,
                        counter_id=counter,
                        wall_time=0.01,
                        scheduled_requests=wire.ScheduledRequestMetrics(
                            num_decode_requests=16, sum_decode_kv_tokens=16000
                        ),
                    )
                )
            autoscaler._on_batch(MessageBatch.of(msgs))
            autoscaler.ingest()
            clock[0] += 0.1

    try:
        autoscaler.observe_pod(PodView("pod-a", "127.0.0.51", True, False, None))
        for end in (101.5, 102.5, 103.2):  # the window is still filling
            run_until(end)
            load = autoscaler.decide(current_replicas=1).load
            assert load is not None and load.decode_tokens_per_s > 0
            assert load.decode_tokens_per_s_trend == 0.0
            assert "decode_tokens_per_s_trend" in load.unavailable
        run_until(105.0)  # a whole window (and a bucket) of data: trends come back
        load = autoscaler.decide(current_replicas=1).load
        assert load is not None and "decode_tokens_per_s_trend" not in load.unavailable
        # A new window length rebuilds the window: withheld again until it fills.
        raw["autoscaling"]["metrics"] = {"windowSeconds": 4}
        autoscaler.reconfigure(parse_spec(raw))
        run_until(106.0)
        load = autoscaler.decide(current_replicas=1).load
        assert load is not None and "decode_tokens_per_s_trend" in load.unavailable
    finally:
        autoscaler.close()


def test_pods_found_before_the_autoscaler_are_logged_when_subscribed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Pods the watch reported before their VllmDeployment was handled are subscribed
    when its autoscaler starts, with the same log line as any other subscription."""
    import logging

    from stepscale_operator.controller.handlers import ControllerState, start_autoscaler

    state = ControllerState(kube=None)  # type: ignore[arg-type]  # no API call here
    key = ("ns", "chat")
    pod = {
        "metadata": {"name": "chat-0"},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.61",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    state.pending_pods.put(key, "chat-0", pod)
    spec = parse_spec({"model": "m", "image": "i", "fpm": {"basePort": 20396}})
    caplog.set_level(logging.INFO, logger="stepscale_operator.controller.handlers")
    autoscaler = start_autoscaler(state, key, spec, {}, {})  # type: ignore[arg-type]
    try:
        assert set(autoscaler.pods.endpoints) == {"tcp://127.0.0.61:20396"}
        lines = [r.getMessage() for r in caplog.records]
        assert any(
            "subscribed to tcp://127.0.0.61:20396" in x and "found at start" in x for x in lines
        )
    finally:
        autoscaler.close()
