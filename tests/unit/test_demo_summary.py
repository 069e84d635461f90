"""The demo's load profile, its client-side measurements and its closing summary
(no engine: the rounds are built from statuses as the operator writes them)."""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_operator import cli
from stepscale_operator.demo import demo_spec, demo_traffic
from stepscale_operator.demo_summary import DemoRecord, MeasuredLatency, summary_lines
from stepscale_operator.latency_model import SloTargets
from stepscale_operator.local_engine import ClientLatency


def _status(
    desired: int, action: str, ttft: float | None = 400.0, queued: int = 0
) -> dict[str, object]:
    return {
        "load": {"queuedPrefillRequests": queued},
        "desiredReplicas": desired,
        "lastDecision": {"action": action, "reason": f"{action} because"},
        "predictions": {"current": {"ttftMs": ttft, "itlMs": 20.0}},
        "costModel": {"mapePercent": 12.0},
        "streams": {"passes": 5000},
    }


def _requests(n: int, ttft_ms: float, at: float = 0.0) -> list[ClientLatency]:
    return [ClientLatency(at, at + 1.0, ttft_ms, 20.0) for _ in range(n)]


def test_client_latency_lines_round_trip() -> None:
    latency = ClientLatency(1.25, 3.5, 812.5, 24.75)
    assert ClientLatency.parse(latency.line()) == latency
    assert ClientLatency.parse("DONE") is None and ClientLatency.parse("REQ 1 2") is None


def test_measured_latency_is_the_windows_p99() -> None:
    window = _requests(99, 100.0) + _requests(1, 5000.0)
    measured = MeasuredLatency.of(window)
    assert measured.requests == 100 and 100.0 < measured.ttft_p99_ms < 5000.0  # type: ignore[operator]
    assert MeasuredLatency.of([]) == MeasuredLatency(0, None, None)


def test_summary_lists_changes_accuracy_and_cost() -> None:
    record = DemoRecord()
    plan = [
        (1, "hold"),
        (1, "hold"),
        (3, "scale_up"),
        (3, "hold"),
        (2, "scale_down"),
        (1, "scale_down"),
    ]
    for k, (desired, action) in enumerate(plan):
        # A queue in the rounds around the rise: there the TTFT measured is 5 s.
        queued = 9 if desired == 3 else 0
        window = _requests(10, 5000.0 if queued else 500.0)
        record.add(10.0 * k, _status(desired, action, queued=queued), MeasuredLatency.of(window))
    assert [(before, r.desired) for before, r in record.changes()] == [(1, 3), (3, 2), (2, 1)]
    # Predicted 400 ms against measured 500 ms: 20% off in every round without a queue.
    assert record.prediction_errors(queued=False)["ttft"] == (pytest.approx(0.2), 4)
    assert record.prediction_errors(queued=True)["ttft"] == (pytest.approx(0.92), 2)
    assert record.prediction_errors()["ttft"][1] == len(plan)
    assert record.replica_seconds() == pytest.approx(10.0 * (1 + 1 + 3 + 3 + 2))
    lines = "\n".join(
        summary_lines(record, _requests(8, 500.0) + _requests(2, 3000.0), SloTargets(1500, 60),
                      _status(1, "hold"), running_replicas=1)
    )  # fmt: skip
    assert "the recommendation changed 3 times" in lines
    assert "at   20s  1 -> 3  scale_up: scale_up because" in lines
    assert "prequential MAPE 12% over 5000 passes" in lines
    assert "rounds without a queue: TTFT 20% off (4)" in lines
    assert "rounds with requests queued: TTFT 92% off (2)" in lines and "mostly waiting" in lines
    assert "TTFT within 1500 ms 80%" in lines
    assert "would have run up to 3 replicas (at 20s); 100 replica-seconds over 50s" in lines


def test_rounds_without_enough_requests_are_not_compared() -> None:
    record = DemoRecord()
    record.add(0.0, _status(1, "hold"), MeasuredLatency.of(_requests(4, 500.0)))
    record.add(3.0, _status(1, "hold", ttft=None), MeasuredLatency.of(_requests(50, 500.0)))
    # Round 1: too few requests; round 2: no TTFT prediction (its ITL one is compared).
    assert record.prediction_errors() == {"itl": (0.0, 1)}


def test_the_default_load_is_calm_overload_calm() -> None:
    args = cli.build_parser().parse_args(["demo"])
    traffic = demo_traffic(args)
    calm, overload, after = args.phases_s
    assert traffic.duration_s == pytest.approx(calm + overload + after)
    arrivals = traffic.arrival_s
    rate = [
        np.count_nonzero((arrivals >= a) & (arrivals < b)) / (b - a)
        for a, b in ((0, calm), (calm, calm + overload), (calm + overload, traffic.duration_s))
    ]
    assert rate[1] > 4 * rate[0] and rate[1] > 4 * rate[2]


def test_demo_spec_shortens_the_scale_down_timings_and_says_how() -> None:
    spec = demo_spec(20999, 1500, 60, 3, stabilization_s=45)
    a = spec.autoscaling
    assert a.scale_down_stabilization_s == 45 and a.scale_down_initial_hold_s < 300
    assert a.burst_memory_s < 900 and a.advisory
