"""bench_policies.py's scenarios: a pod start-up for all of them, or each one's own."""

from __future__ import annotations

from tests.conftest import benchmark_module


def test_startup_s_sets_every_scenarios_pod_start_up() -> None:
    bench = benchmark_module("bench_policies")
    short = ["--only", "synthetic-bursts", "--no-shapes", "--slow-burst-duration-s", "0"]
    own, _ = bench.build_scenarios(bench.parse_args(short))
    slow, _ = bench.build_scenarios(bench.parse_args([*short, "--startup-s", "180"]))
    assert [name for name, _, _ in slow] == [name for name, _, _ in own] == ["synthetic-bursts"]
    assert [setup.startup_s for _, _, setup in own] == [60.0]
    assert [setup.startup_s for _, _, setup in slow] == [180.0]
    # Only the start-up differs: the same traffic, SLO and bounds.
    assert slow[0][2].slo == own[0][2].slo and slow[0][2].max_replicas == own[0][2].max_replicas
    assert len(slow[0][1]) == len(own[0][1])
