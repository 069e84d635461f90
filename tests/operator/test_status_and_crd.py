"""Status builder and the CRD: nothing the operator writes would be pruned by a real API server.

A real API server prunes fields that the structural schema does not declare;
kmock does not, so :func:`pruned` emulates pruning here (properties,
additionalProperties, items, x-kubernetes-preserve-unknown-fields) and the
status built from a real, fitted core must come through unchanged.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics
from stepscale_operator.controller.autoscaler import new_cost_model, planner_policy
from stepscale_operator.controller.metrics import METRICS, OperatorMetrics
from stepscale_operator.controller.spec import QUANTITY_PATTERN, parse_spec
from stepscale_operator.controller.status import (
    build_conditions,
    build_status,
    burst_status,
    bursts_from_status,
    checkpoint_from_status,
    condition,
)
from stepscale_operator.cost_model import CostModel
from stepscale_operator.fpm_pipeline import DeploymentModel
from stepscale_operator.latency_model import EngineLimits, SloTargets
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner import (
    Decision,
    Planner,
    PlannerInputs,
    PlannerPolicy,
    ReplicaCounts,
)

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "vllmdeployment.yaml"


def crd() -> dict[str, Any]:
    return dict(yaml.safe_load(CRD_PATH.read_text()))


def schema() -> dict[str, Any]:
    return dict(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def pruned(value: Any, node: dict[str, Any]) -> Any:
    """``value`` as a structural-schema API server would store it (unknown fields dropped)."""
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict):
        props = node.get("properties")
        extra = node.get("additionalProperties")
        out = {}
        for k, v in value.items():
            if props is not None and k in props:
                out[k] = pruned(v, props[k])
            elif isinstance(extra, dict):
                out[k] = pruned(v, extra)
        return out
    if isinstance(value, list):
        return [pruned(v, node.get("items", {})) for v in value]
    return value


def types_ok(value: Any, node: dict[str, Any], path: str = "") -> list[str]:
    """Type mismatches against the schema (numbers, integers, strings, booleans)."""
    t = node.get("type")
    problems: list[str] = []
    if value is None:
        return problems  # a merge patch's null: the field is removed
    expected = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    if t in expected and not expected[t](value):
        problems.append(f"{path}: {value!r} is not {t}")
    if isinstance(value, dict):
        for k, v in value.items():
            sub = (node.get("properties") or {}).get(k) or node.get("additionalProperties")
            if isinstance(sub, dict):
                problems += types_ok(v, sub, f"{path}.{k}")
    if isinstance(value, list):
        for i, v in enumerate(value):
            problems += types_ok(v, node.get("items", {}), f"{path}[{i}]")
    return problems


def drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def fitted_status() -> dict[str, Any]:
    """A status from a real core that learned a few hundred passes and decided."""
    spec = parse_spec(
        {"model": "m", "image": "i", "autoscaling": {"costModel": {"minSamples": 50}}}
    )
    model = DeploymentModel("ns/x", cost_model=CostModel(min_samples=50, warmup_passes=2))
    rng = np.random.default_rng(0)
    msgs = []
    for i in range(400):
        b = int(rng.integers(1, 64))
        c = int(rng.integers(0, 512)) if i % 3 == 0 else 0
        wall = 0.004 + 0.0003 * b + 2e-5 * c
        msgs.append(
            ForwardPassMetrics(
                worker_id="pod-0",
                counter_id=i,
                wall_time=wall,
                scheduled_requests=ScheduledRequestMetrics(
                    num_prefill_requests=1 if c else 0,
                    sum_prefill_tokens=c,
                    num_decode_requests=b,
                    sum_decode_kv_tokens=b * 900,
                ),
            )
        )
    model.add_stream(("pod-0", 0))
    model.ingest(msgs, now=100.0)
    load = model.estimate(100.5)
    decision = Planner(planner_policy(spec)).decide(
        PlannerInputs(
            predictor=model.cost_model,
            model_ready=model.cost_model.ready,
            model_mape=model.cost_model.quality.mape,
            load=load,
            load_time=100.5,
            replicas=ReplicaCounts(ready=1),
            slo=SloTargets(1000, 50),
            min_replicas=1,
            max_replicas=8,
            engine=EngineLimits(),
            pod_startup_s=60,
        ),
        100.5,
    )
    conditions = build_conditions(
        now_wall=1.7e9,
        generation=3,
        previous=[],
        problems=(),
        mode="auto",
        load=load,
        model_ready=model.cost_model.ready,
        samples=model.cost_model.samples,
        min_samples=50,
        mape=model.cost_model.quality.mape,
    )
    return build_status(
        now_wall=1.7e9,
        generation=3,
        selector="stepscale.io/vllmdeployment=x",
        mode="auto",
        replicas=1,
        ready_replicas=1,
        desired_replicas=decision.desired_replicas,
        conditions=conditions,
        cost_model_snapshot=model.cost_model.to_dict(),
        load=load,
        decision=decision,
        decision_applied=decision.apply,
        last_scaling=None,
        stream_health={
            **model.streams.health(100.5, per_stream=False),
            "rejected": {"schema": 2},
        },
        endpoints=1,
    )


def test_status_is_json_and_nothing_would_be_pruned() -> None:
    status = fitted_status()
    json.dumps(status, allow_nan=False)
    stored = drop_nulls(status)
    status_schema = schema()["properties"]["status"]
    assert pruned(stored, status_schema) == stored
    assert types_ok(stored, status_schema) == []
    assert stored["costModel"]["ready"] is True
    assert stored["streams"]["malformed"] == 2
    assert {c["type"] for c in stored["conditions"]} == {
        "MetricsFresh",
        "ModelReady",
        "ScalingActive",
        "Degraded",
    }


def test_status_shows_how_often_a_requests_first_passes_carry_prefill() -> None:
    from stepscale_operator.controller.status import load_status
    from stepscale_operator.early_prefills import SPANS, EarlyPrefills

    status = fitted_status()
    assert status["load"]["earlyPrefillLift"] is None  # too few prompts to tell
    load = replace(
        _load(1.0, 2),
        early_prefills=EarlyPrefills(SPANS, (4.12345, 3.0, 2.5, 2.0, 1.5, 1.2), (0.3,) * 6),
    )
    shown = load_status(load)
    assert shown is not None
    assert shown["earlyPrefillLift"] == [4.123, 3.0, 2.5, 2.0, 1.5, 1.2]
    stored = drop_nulls({**status, "load": shown})
    status_schema = schema()["properties"]["status"]
    assert pruned(stored, status_schema) == stored
    assert types_ok(stored, status_schema) == []


class _LinearStepTime:
    def predict(self, sched: ScheduledRequestMetrics) -> float:
        return 0.006 + 30e-6 * sched.sum_prefill_tokens + 40e-9 * sched.sum_decode_kv_tokens


def _load(rate: float, total: int) -> LoadEstimate:
    """``rate`` req/s of 1000-token prompts and 200 output tokens on ``total`` streams."""
    return LoadEstimate(
        window_s=30.0,
        streams_total=total,
        streams_missing=0,
        prefill_tokens_per_s=rate * 1000.0,
        prefill_cached_tokens_per_s=0.0,
        prefill_requests_per_s=rate,
        decode_tokens_per_s=rate * 200.0,
        mean_prompt_tokens=1000.0,
        mean_decode_context_tokens=1100.0,
        prefix_cache_hit_fraction=0.0,
        queued_prefill_requests=0.0,
        queued_prefill_tokens=0.0,
        queued_decode_requests=0.0,
    )


def _decide(planner: Planner, t: float, rate: float, total: int) -> Decision:
    """One planner decision at ``rate`` req/s (1000-token prompts, 200 out) on ``total``."""
    load = _load(rate, total)
    return planner.decide(
        PlannerInputs(
            predictor=_LinearStepTime(),
            model_ready=True,
            model_mape=0.02,
            load=load,
            load_time=t,
            replicas=ReplicaCounts(ready=total),
            slo=SloTargets(1000, 50),
            min_replicas=1,
            max_replicas=40,
            engine=EngineLimits(),
            pod_startup_s=60,
        ),
        t,
    )


def test_status_says_when_the_next_recurring_burst_is_due() -> None:
    # Bursts every 600 s (20 -> 100 req/s for 120 s) through a real planner.
    planner = Planner(replace(PlannerPolicy(), initial_hold_s=0.0))
    total, t, decisions = 2, 0.0, []
    while t <= 1600.0:
        rate = 100.0 if (t - 300.0) % 600.0 < 120.0 and t >= 300.0 else 20.0
        d = _decide(planner, t, rate, total)
        total = d.desired_replicas
        decisions.append(d)
        t += 10.0
    assert burst_status(decisions[10], 1.7e9) is None  # before any burst
    first = burst_status(decisions[40], 1.7e9)  # t = 400: after the first
    assert first is not None and first["lastSeenSecondsAgo"] >= 0.0
    assert "periodSeconds" not in first
    # After three bursts at 300, 900, 1500: confirmed, the next due at ~2100.
    last = burst_status(decisions[-1], 1.7e9)
    assert last is not None and last["confirmed"] is True
    assert last["periodSeconds"] == pytest.approx(600.0, abs=20.0)
    assert last["nextDueInSeconds"] == pytest.approx(500.0, abs=20.0)
    assert isinstance(last["peakNeed"], int) and last["peakNeed"] > 2
    status_schema = schema()["properties"]["status"]["properties"]["bursts"]
    assert pruned(last, status_schema) == last
    assert types_ok(last, status_schema) == []
    # The onsets go to status in wall-clock time (the planner's clock is monotonic,
    # here 0 at 1.7e9 - 1600 s) and come back from it for a restarted operator.
    wall_now = 1.7e9
    saved = burst_status(decisions[-1], wall_now)
    assert saved is not None and len(saved["recent"]) == 3
    restored = bursts_from_status({"bursts": saved})
    assert [peak for _, peak in restored] == [peak for _, peak in planner.burst_onsets()]
    for (wall, _), (mono, _) in zip(restored, planner.burst_onsets(), strict=True):
        assert wall == pytest.approx(wall_now - (1600.0 - mono), abs=1.0)
    assert bursts_from_status({"bursts": {"recent": [{"onset": "x"}, 3, {"peakNeed": 2}]}}) == []
    assert bursts_from_status(None) == []


def test_status_says_when_a_bursts_load_faded_and_its_peak_was_let_go() -> None:
    # A rise faster than pods start (20 -> 100 req/s), ten minutes up, then down to
    # 20 over ten minutes: a level that went, not a burst that may come back as fast.
    planner = Planner(replace(PlannerPolicy(), initial_hold_s=0.0))
    total, t, decisions = 2, 0.0, []
    while t <= 2400.0:
        rate = 20.0 if t < 300.0 else 100.0 if t < 900.0 else max(20.0, 100.0 - (t - 900.0) / 7.5)
        d = _decide(planner, t, rate, total)
        total = d.desired_replicas
        decisions.append(d)
        t += 10.0
    up = burst_status(decisions[60], 1.7e9)  # t = 600: the level holds
    assert up is not None and "fadedSecondsAgo" not in up
    last = burst_status(decisions[-1], 1.7e9)
    assert last is not None and last["lastSeenSecondsAgo"] > last["fadedSecondsAgo"]
    # Let go during the fall (900-1500 s), not before it and not after it ended.
    assert 2400.0 - 1500.0 < last["fadedSecondsAgo"] < 2400.0 - 900.0
    status_schema = schema()["properties"]["status"]["properties"]["bursts"]
    assert pruned(last, status_schema) == last
    assert types_ok(last, status_schema) == []


def test_status_says_when_a_burst_was_seen_only_leaving() -> None:
    # Requests from the start (no onset after the warm-up), then silence within
    # seconds: the level is kept like a burst's peak, and status says how it was seen.
    planner = Planner(replace(PlannerPolicy(), initial_hold_s=0.0))
    total, t, decisions = 2, 0.0, []
    while t <= 700.0:
        d = _decide(planner, t, 100.0 if t < 400.0 else 0.5, total)
        total = d.desired_replicas
        decisions.append(d)
        t += 10.0
    assert burst_status(decisions[35], 1.7e9) is None  # t = 350: the level holds
    last = burst_status(decisions[-1], 1.7e9)
    assert last is not None and last["seenLeaving"] is True
    assert 300.0 - 30.0 <= last["lastSeenSecondsAgo"] <= 300.0 + 30.0
    assert "left faster than pod start-up" in decisions[-1].reason
    status_schema = schema()["properties"]["status"]["properties"]["bursts"]
    assert pruned(last, status_schema) == last
    assert types_ok(last, status_schema) == []
    # A burst seen at its onset is not marked.
    onset = Planner(replace(PlannerPolicy(), initial_hold_s=0.0))
    total, t = 2, 0.0
    while t <= 500.0:
        d = _decide(onset, t, 20.0 if t < 300.0 else 100.0, total)
        total, t = d.desired_replicas, t + 10.0
    seen = burst_status(d, 1.7e9)
    assert seen is not None and "seenLeaving" not in seen


def test_restored_bursts_stay_in_status_before_a_burst_is_seen() -> None:
    planner = Planner()
    planner.restore_burst_onsets([(100.0, 5), (700.0, 6), (1300.0, 5)])
    d = _decide(planner, 1400.0, 20.0, 2)
    assert d.inputs["burst_seen_s_ago"] is None
    saved = burst_status(d, 1.7e9)
    assert saved is not None and saved["lastSeenSecondsAgo"] is None
    assert [b["peakNeed"] for b in saved["recent"]] == [5, 6, 5]
    assert burst_status(_decide(Planner(), 1400.0, 20.0, 2), 1.7e9) is None


def test_checkpoint_in_status_warm_starts_the_same_model() -> None:
    status = drop_nulls(fitted_status())
    checkpoint = checkpoint_from_status(status)
    assert checkpoint is not None
    spec = parse_spec(
        {"model": "m", "image": "i", "autoscaling": {"costModel": {"minSamples": 50}}}
    )
    model, origin = new_cost_model(spec, checkpoint)
    assert origin == "checkpoint" and model.ready
    saved = {c["name"]: c.get("value", 0.0) for c in status["costModel"]["coefficients"]}
    for name, value in model.coefficients.items():
        assert value == pytest.approx(saved.get(name, 0.0), rel=0.05, abs=1e-7)


def test_a_broken_checkpoint_is_ignored_not_fatal() -> None:
    spec = parse_spec({"model": "m", "image": "i"})
    model, origin = new_cost_model(spec, {"schema": "something else"})
    assert origin == "new" and not model.ready


def test_initial_coefficients_seed_predictions_but_not_readiness() -> None:
    spec = parse_spec(
        {
            "model": "m",
            "image": "i",
            "autoscaling": {
                "costModel": {"initialCoefficients": {"intercept": 0.005, "decodeRequests": 0.0002}}
            },
        }
    )
    model, origin = new_cost_model(spec, None)
    assert origin == "initialCoefficients" and not model.ready
    pred = model.predict(ScheduledRequestMetrics(num_decode_requests=10))
    assert pred == pytest.approx(0.005 + 10 * 0.0002, rel=0.02)


def test_conditions_keep_their_transition_time() -> None:
    first = condition("ModelReady", True, "Fitted", "", 1000.0, 1)
    again = condition("ModelReady", True, "Fitted", "", 2000.0, 1, [first])
    flipped = condition("ModelReady", False, "Learning", "", 3000.0, 1, [again])
    assert again["lastTransitionTime"] == first["lastTransitionTime"]
    assert flipped["lastTransitionTime"] != first["lastTransitionTime"]


def test_invalid_spec_conditions_are_degraded() -> None:
    conds = build_conditions(
        now_wall=0.0,
        generation=1,
        previous=[],
        problems=["spec: fix it"],
        mode="auto",
        load=None,
        model_ready=False,
        samples=0,
        min_samples=200,
        mape=None,
    )
    by_type = {c["type"]: c for c in conds}
    assert by_type["Degraded"]["status"] == "True"
    assert by_type["Degraded"]["message"] == "spec: fix it"
    assert by_type["ScalingActive"]["reason"] == "InvalidSpec"


def test_crd_shape() -> None:
    doc = crd()
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["names"]["shortNames"] == ["vd"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    status_columns = [c for c in columns.values() if c["jsonPath"].startswith(".status")]
    assert len(status_columns) >= 6
    for column in status_columns:
        # Every printer column reads a declared status field of its own type.
        node = schema()
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == column["type"], column["name"]
    assert set(columns) >= {"Replicas", "Ready", "Desired", "TTFT(ms)", "ITL(ms)", "MAPE(%)", "Age"}
    # kubectl get vd shows the realized latency beside each prediction.
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    for latency in ("TTFT", "ITL"):
        predicted = names.index(f"{latency}(ms)")
        assert names[predicted + 1] == f"{latency}-Measured(ms)"
        assert columns[f"{latency}-Measured(ms)"]["jsonPath"] == (
            f".status.predictions.measured.{latency.lower()}Ms"
        )
    rules = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    from stepscale_operator.controller import spec as spec_module

    messages = {r["message"] for r in rules}
    for name in (
        "MSG_MIN_MAX",
        "MSG_GPUS",
        "MSG_PORT_OVERLAP",
        "MSG_PORT_RANGE",
        "MSG_SEQS_TOKENS",
        "MSG_RESERVED_ENV",
    ):
        assert getattr(spec_module, name) in messages, name


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("g14-int-as-float-1.0", "DNS-1035"),  # a dot: no Service can have this name
        ("Chat", "DNS-1035"),
        ("1chat", "DNS-1035"),
        ("chat-", "DNS-1035"),
        ("x" * 64, "at most 63"),
    ],
)
def test_names_no_service_or_label_can_carry_are_refused(name: str, fragment: str) -> None:
    """The CRD's rules on metadata.name and the operator's check refuse the same names
    with the same message. No CEL runs here: the rules' regular expression and length
    are read out of the CRD and applied (RE2 and Python agree on this pattern)."""
    from stepscale_operator.controller.spec import (
        MSG_NAME_LABEL,
        MSG_NAME_LENGTH,
        NAME_PATTERN,
        name_problems,
    )

    rules = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    by_message = {r["message"]: r["rule"] for r in rules}
    assert by_message[MSG_NAME_LENGTH] == "size(self.metadata.name) <= 63"
    assert by_message[MSG_NAME_LABEL] == f"self.metadata.name.matches('{NAME_PATTERN}')"
    crd_refuses = len(name) > 63 or not re.match(NAME_PATTERN, name)
    problems = name_problems(name)
    assert crd_refuses and problems and fragment in problems[0]
    for good in ("chat", "g14-int-as-float-1-0", "a" * 63, "a1"):
        assert name_problems(good) == [] and re.match(NAME_PATTERN, good)


def test_every_spec_field_has_a_description_for_kubectl_explain() -> None:
    missing: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for key, sub in (node.get("properties") or {}).items():
            if not str(sub.get("description", "")).strip():
                missing.append(f"{path}.{key}")
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema()["properties"]["spec"], "spec")
    assert missing == []


def test_crd_spec_defaults_are_the_parser_defaults() -> None:
    """Apply the CRD's defaults to an empty spec; the parser must see no difference."""

    def defaults(node: dict[str, Any]) -> Any:
        if node.get("type") == "object" and "properties" in node:
            out = dict(node.get("default", {}))
            for k, sub in node["properties"].items():
                d = defaults(sub)
                if d is not None and (k in out or "default" in sub):
                    out[k] = d
            return out if ("default" in node or out) else None
        return node.get("default")

    spec_schema = schema()["properties"]["spec"]
    defaulted = {**defaults(spec_schema), "model": "m", "image": "i"}
    assert parse_spec(defaulted) == parse_spec({"model": "m", "image": "i"})


def test_metrics_are_declared_once_with_units_and_deployment_label() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert "deployment" in m.labels
        if m.kind == "counter":
            assert m.name.endswith("_total")
        else:
            assert not m.name.endswith("_total")
    metrics = OperatorMetrics()
    metrics.counter("stepscale_fpm_messages_total").labels("ns/x").inc(3)
    metrics.gauge("stepscale_fpm_streams").labels("ns/x", "fresh").set(2)
    with pytest.raises(KeyError):
        metrics.counter("stepscale_not_declared_total")
    metrics.forget("ns/x")
    samples = [s for f in metrics.registry.collect() for s in f.samples]
    assert not [s for s in samples if s.labels.get("deployment") == "ns/x"]


def test_crd_env_is_a_map_and_quantities_have_a_pattern() -> None:
    """Duplicate env names and bad quantities are refused by the CRD, as by the parser."""
    spec_props = schema()["properties"]["spec"]["properties"]
    env = spec_props["env"]
    assert env["x-kubernetes-list-type"] == "map"
    assert env["x-kubernetes-list-map-keys"] == ["name"]
    assert "name" in env["items"]["required"]  # a list-map key must be required
    resources = spec_props["resources"]["properties"]
    for field in ("cpu", "memory"):
        assert resources[field]["pattern"] == QUANTITY_PATTERN
    crd_text = CRD_PATH.read_text()
    chart_text = (REPO / "charts" / "stepscale" / "crds" / "vllmdeployment.yaml").read_text()
    assert crd_text == chart_text


def test_the_scale_down_window_outlasts_a_silent_streams_way_to_stale() -> None:
    """A silent pod looks like falling load until it is stale: the planner's window is
    never shorter than that (plus two rounds), whatever the spec asks."""
    short = parse_spec(
        {
            "model": "m",
            "image": "i",
            "autoscaling": {
                "intervalSeconds": 1,
                "scaleDown": {"stabilizationWindowSeconds": 2},
                "metrics": {"staleAfterSeconds": 2},
            },
        }
    )
    assert planner_policy(short).scale_down_stabilization_s == 4.0
    default = parse_spec({"model": "m", "image": "i"})
    assert planner_policy(default).scale_down_stabilization_s == 120.0


def test_status_shows_measured_latency_and_the_unreachable_share() -> None:
    status = fitted_status()
    stored = drop_nulls(status)
    status_schema = schema()["properties"]["status"]
    assert pruned(stored, status_schema) == stored
    measured = stored["predictions"]["measured"]
    assert measured["itlCorrection"] >= 1.0 and measured["ttftCorrection"] >= 1.0
    assert "unreachableShare" in stored["predictions"]


def test_slo_reachable_condition_carries_the_unreachable_share() -> None:
    from stepscale_operator.controller.status import build_conditions
    from stepscale_operator.planner import Decision

    def decision(share: float, reason: str = "hold") -> Decision:
        return Decision(
            0.0, 3, 3, "hold", False, reason, 1.0, None, None, {"unreachable_share": share}
        )

    def conditions(d: Decision) -> dict[str, dict[str, object]]:
        conds = build_conditions(
            now_wall=1.7e9,
            generation=1,
            previous=[],
            problems=(),
            mode="auto",
            load=None,
            model_ready=True,
            samples=100,
            min_samples=50,
            mape=0.02,
            decision=d,
        )
        return {str(c["type"]): c for c in conds}

    partly = conditions(decision(0.143))["SloReachable"]
    assert partly["status"] == "False" and partly["reason"] == "PartlyOutOfReach"
    assert "14.3%" in str(partly["message"])
    assert conditions(decision(0.0))["SloReachable"]["status"] == "True"
    floor = conditions(decision(0.0, "hold; SLO out of reach at any count (...)"))
    assert floor["SloReachable"]["reason"] == "OutOfReachAtAnyCount"
