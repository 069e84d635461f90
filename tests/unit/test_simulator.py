"""Simulator behaviour: engine scheduling and FPM, router, lifecycle, traffic, wiring."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics
from stepscale_operator.planner import EngineLimits, SloTargets
from stepscale_operator.simulator.engine import RequestTable, SimEngine
from stepscale_operator.simulator.fleet import Fleet, FleetConfig, FleetView
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B, StepTimeProfile
from stepscale_operator.simulator.policies import (
    PlannerDrivenPolicy,
    ScalingSetup,
    StaticPolicy,
)
from stepscale_operator.simulator.report import request_latencies, summarise
from stepscale_operator.simulator.traffic import (
    Traffic,
    load_azure_csv,
    load_mooncake_jsonl,
    synthetic,
)

QUIET = StepTimeProfile(noise_sigma=0.0)


def run_engine(
    prompts: list[int], outputs: list[int], limits: EngineLimits, profile: StepTimeProfile = QUIET
) -> tuple[RequestTable, list[ForwardPassMetrics]]:
    """All requests arrive at t=0 on one engine; run it dry."""
    table = RequestTable.create(prompts, outputs)
    engine = SimEngine("e", table, limits, profile, seed=1, on_finish=lambda e, r: None)
    engine.emit_fpm = True
    for rid in range(len(prompts)):
        engine.add_request(rid)
    end = engine.start_step(0.0)
    while end is not None:
        now = engine.finish_step()
        end = engine.start_step(now)
    return table, [m for _, m in engine.outbox]


def test_single_request_timing_matches_the_profile() -> None:
    table, msgs = run_engine([1000], [11], EngineLimits())
    prefill = QUIET.mean_time(1000, 0, 1, 0, 0)
    assert table.first_token_s[0] == pytest.approx(prefill)
    assert len(msgs) == 11  # one prefill pass, ten decode passes
    assert msgs[0].scheduled_requests.num_prefill_requests == 1
    decodes = [m.scheduled_requests for m in msgs[1:]]
    assert all(s.num_decode_requests == 1 for s in decodes)
    # Context grows by one token per pass.
    kv = [s.sum_decode_kv_tokens for s in decodes]
    assert kv == list(range(kv[0], kv[0] + 10))
    assert table.finish_s[0] == pytest.approx(sum(m.wall_time for m in msgs))


def test_chunked_prefill_under_the_token_budget() -> None:
    _, msgs = run_engine([5000], [2], EngineLimits(max_num_batched_tokens=2048))
    prefills = [m.scheduled_requests for m in msgs if m.scheduled_requests.num_prefill_requests]
    assert [s.sum_prefill_tokens for s in prefills] == [2048, 2048, 904]
    assert [s.sum_prefill_kv_tokens for s in prefills] == [0, 2048, 4096]


def test_decodes_share_the_budget_with_prefill() -> None:
    _, msgs = run_engine([100, 3000], [50, 2], EngineLimits(max_num_batched_tokens=1024))
    mixed = [
        m.scheduled_requests
        for m in msgs
        if m.scheduled_requests.num_prefill_requests and m.scheduled_requests.num_decode_requests
    ]
    assert mixed, "the long prompt's chunks run alongside the short request's decodes"
    for s in mixed:
        assert s.sum_prefill_tokens + s.num_decode_requests <= 1024


def test_max_num_seqs_queues_the_rest() -> None:
    table, msgs = run_engine([200] * 5, [20] * 5, EngineLimits(max_num_seqs=2))
    for m in msgs:
        s = m.scheduled_requests
        assert s.num_prefill_requests + s.num_decode_requests <= 2
    assert msgs[0].queued_requests.num_prefill_requests == 3
    assert not np.isnan(table.finish_s).any()


def test_kv_pressure_preempts_and_recomputes() -> None:
    limits = EngineLimits(max_num_batched_tokens=4096, max_num_seqs=64, kv_capacity_tokens=3000)
    table, msgs = run_engine([800] * 4, [400] * 4, limits)
    assert table.preemptions.sum() > 0
    assert not np.isnan(table.finish_s).any()
    assert any(m.queued_requests.num_decode_requests for m in msgs)
    for m in msgs:
        s = m.scheduled_requests
        assert s.sum_decode_kv_tokens + s.sum_prefill_kv_tokens + s.sum_prefill_tokens <= 3000 + 64


def test_rejects_prompts_larger_than_the_cache() -> None:
    table, _ = run_engine([5000, 100], [5, 5], EngineLimits(kv_capacity_tokens=4000))
    assert np.isnan(table.first_token_s[0]) and not np.isnan(table.finish_s[0])
    assert not np.isnan(table.first_token_s[1])


def flat_traffic(n: int, gap_s: float, prompt: int = 500, output: int = 50) -> Traffic:
    t = np.arange(n, dtype=np.float64) * gap_s
    return Traffic(
        t,
        np.full(n, prompt, dtype=np.int64),
        np.full(n, output, dtype=np.int64),
        float(n * gap_s),
    )


def test_router_balances_outstanding_requests() -> None:
    traffic = flat_traffic(400, 0.01)
    result = Fleet(traffic, StaticPolicy(4), FleetConfig(initial_replicas=4)).run()
    counts = np.bincount(result.replica_of, minlength=4)
    assert counts.min() >= 80 and counts.max() <= 120


def test_gpu_seconds_and_startup_delay() -> None:
    class StepUp(StaticPolicy):
        def desired(self, view: FleetView) -> int:
            return 1 if view.now < 100.0 else 2

    traffic = flat_traffic(300, 1.0)
    config = FleetConfig(initial_replicas=1, startup_s=50.0)
    policy = StepUp(1)
    policy.interval_s = 10.0
    result = Fleet(traffic, policy, config).run()
    # Replica 0 for 300 s, replica 1 requested at t=100 (billed while it starts).
    assert result.gpu_seconds == pytest.approx(300.0 + 200.0)
    second = np.flatnonzero(result.replica_of == 1)
    assert second.size > 0
    assert traffic.arrival_s[second].min() >= 150.0


def test_same_seed_same_outcome() -> None:
    traffic = synthetic("bursts", duration_s=400.0, base_rps=4.0, seed=3)
    a = Fleet(traffic, StaticPolicy(2), FleetConfig(initial_replicas=2, seed=5)).run()
    b = Fleet(traffic, StaticPolicy(2), FleetConfig(initial_replicas=2, seed=5)).run()
    np.testing.assert_array_equal(a.requests.finish_s, b.requests.finish_s)
    c = Fleet(traffic, StaticPolicy(2), FleetConfig(initial_replicas=2, seed=6)).run()
    assert not np.array_equal(a.requests.finish_s, c.requests.finish_s)


def test_trace_loaders(tmp_path: Path) -> None:
    csv_path = tmp_path / "azure.csv"
    csv_path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:48.0000000,10,0\n"
    )
    azure = load_azure_csv(csv_path)
    assert azure.arrival_s.tolist() == pytest.approx([0.0, 1.31941, 4.314579], abs=1e-5)
    assert azure.prompt_tokens.tolist() == [374, 10, 396]
    assert azure.output_tokens.tolist() == [44, 1, 109]  # zero outputs become one token
    jsonl = tmp_path / "mooncake.jsonl"
    jsonl.write_text(
        '{"timestamp": 0, "input_length": 6000, "output_length": 20, "hash_ids": [1]}\n'
        '{"timestamp": 2500, "input_length": 700, "output_length": 3}\n'
    )
    moon = load_mooncake_jsonl(jsonl)
    assert moon.arrival_s.tolist() == [0.0, 2.5]
    assert moon.prompt_tokens.tolist() == [6000, 700]


def test_rate_scale_and_time_compression() -> None:
    base = synthetic("flat", duration_s=600.0, base_rps=5.0, seed=1)
    doubled = base.scaled(rate_scale=2.0, seed=1)
    assert len(doubled) == 2 * len(base)
    assert doubled.duration_s == base.duration_s
    fast = base.scaled(time_compress=2.0)
    assert len(fast) == len(base) and fast.duration_s == pytest.approx(300.0)
    partial = base.scaled(rate_scale=1.5, seed=1)
    assert abs(len(partial) - 1.5 * len(base)) < 0.1 * len(base)
    head = base.scaled(duration_s=60.0)
    assert head.arrival_s.max() < 60.0


def test_synthetic_shapes() -> None:
    bursts = synthetic("bursts", duration_s=1200.0, base_rps=10.0, seed=2)
    t = bursts.arrival_s
    quiet = np.count_nonzero((t >= 100) & (t < 200))
    burst = np.count_nonzero((t >= 400) & (t < 500))
    assert 2.0 < burst / quiet < 3.0
    steps = synthetic("steps", duration_s=1000.0, base_rps=10.0, seed=2)
    first = np.count_nonzero(steps.arrival_s < 200)
    second = np.count_nonzero((steps.arrival_s >= 200) & (steps.arrival_s < 400))
    assert 1.7 < second / first < 2.3


def test_report_attainment_counts_both_targets() -> None:
    traffic = flat_traffic(50, 0.5)
    result = Fleet(traffic, StaticPolicy(1), FleetConfig(initial_replicas=1)).run()
    lat = request_latencies(result)
    assert np.isfinite(lat.ttft_ms).all() and np.isfinite(lat.itl_ms).all()
    strict = summarise(result, SloTargets(ttft_ms=1.0, itl_ms=1000.0), "s", 0.0)
    loose = summarise(result, SloTargets(ttft_ms=10_000.0, itl_ms=10_000.0), "s", 0.0)
    assert strict.ttft_attainment == 0.0 and strict.attainment == 0.0
    assert loose.attainment == 1.0
    assert loose.gpu_hours == pytest.approx(25.0 / 3600.0)


def test_fpm_flow_through_the_operator_pipeline_into_the_planner() -> None:
    traffic = synthetic("flat", duration_s=240.0, base_rps=8.0, seed=4)
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    policy = PlannerDrivenPolicy(setup)
    result = Fleet(traffic, policy, FleetConfig(initial_replicas=2, startup_s=30.0)).run()
    assert result.fpm_messages > 1000
    cost = policy.model.cost_model
    assert cost.ready
    sched = ScheduledRequestMetrics(num_decode_requests=16, sum_decode_kv_tokens=16 * 1300)
    assert cost.predict(sched) == pytest.approx(H100_LLAMA_8B.predict(sched), rel=0.1)
    load = policy.model.estimate(240.0)
    true_prefill = traffic.prompt_tokens[traffic.arrival_s > 210].sum() / 30.0
    assert load.prefill_tokens_per_s == pytest.approx(true_prefill, rel=0.35)
    assert policy.decisions and all(isinstance(d["reason"], str) for d in policy.decisions)
    assert any(not math.isnan(c.itl_mean_ms) for c in policy.checks)


def test_oracle_is_sized_by_the_measured_ground_truth_capacity() -> None:
    from stepscale_operator.simulator.policies import (
        OraclePolicy,
        arrival_rate_series,
        calibrate_capacity,
        steady_segments,
    )

    traffic = synthetic("steps", duration_s=400.0, base_rps=6.0, seed=3)
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    # Segments keep the traffic's own requests, replayed at the asked rate.
    (segment,) = steady_segments(traffic, 10.0, 50.0, count=1)
    assert len(segment) == 500 and segment.arrival_s[-1] < 50.0
    assert set(segment.prompt_tokens.tolist()) <= set(traffic.prompt_tokens.tolist())
    cap = calibrate_capacity(
        traffic, setup, H100_LLAMA_8B, replicas=1, duration_s=60.0, warmup_s=10.0, iterations=3
    )
    assert 3.0 < cap < 40.0
    oracle = OraclePolicy(traffic, setup, cap)
    rates = arrival_rate_series(traffic)
    assert oracle.needs.tolist() == np.maximum(np.ceil(rates / cap), 1).astype(int).tolist()
    # It asks now for what the slots up to one start-up time ahead need.
    view = FleetView(0.0, 1, (), 0.0, None, 0)
    assert oracle.desired(view) == int(oracle.needs[: int(35 // 10) + 1].max())
