"""Simulator behaviour: engine scheduling and FPM, router, lifecycle, traffic, wiring."""

from __future__ import annotations

import math
import socket
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stepscale_engine.wire import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)
from stepscale_operator.fpm_pipeline import DeploymentModel
from stepscale_operator.latency_model import EngineLimits, SloTargets
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner import Planner, PlannerPolicy
from stepscale_operator.simulator.capacity import (
    BRACKET_RATIO,
    Calibration,
    CapacityCurve,
    calibrate_capacity,
    calibrate_capacity_curve,
    calibration_segments,
    non_decreasing,
    oracle_attainment,
    replayed_at,
)
from stepscale_operator.simulator.engine import RequestTable, SimEngine
from stepscale_operator.simulator.fleet import Fleet, FleetConfig, FleetView, frontend_estimate
from stepscale_operator.simulator.ground_truth import (
    H100_LLAMA_8B,
    StepTimeProfile,
    profile_with,
)
from stepscale_operator.simulator.policies import (
    DynamoPolicy,
    HindsightPolicy,
    OraclePolicy,
    PlannerDrivenPolicy,
    ScalingSetup,
    StaticPolicy,
    WindowedOraclePolicy,
    arrival_rate_series,
    prediction_errors,
    sample_p99_error,
)
from stepscale_operator.simulator.publish import SimulatedPodPublishers, pod_host
from stepscale_operator.simulator.report import (
    attainment_in_windows,
    plot_timeline,
    replica_seconds,
    request_latencies,
    scale_downs_undone,
    summarise,
)
from stepscale_operator.simulator.scenario import build_policy, ground_truth_sizing
from stepscale_operator.simulator.traffic import (
    Traffic,
    TrafficShape,
    burst_windows,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
    merged,
    shaped_synthetic,
    synthetic,
)
from stepscale_operator.subscriber import FpmSubscriber

QUIET = StepTimeProfile(noise_sigma=0.0)


def run_engine(
    prompts: list[int], outputs: list[int], limits: EngineLimits, profile: StepTimeProfile = QUIET
) -> tuple[RequestTable, list[ForwardPassMetrics]]:
    """All requests arrive at t=0 on one engine; run it dry."""
    table = RequestTable.create(prompts, outputs)
    engine = SimEngine("e", table, limits, profile, seed=1)
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


def test_the_engine_counts_the_prompt_tokens_beside_its_decodes() -> None:
    # What bench_prediction.py sets against the latency model: over every pass, its
    # decode requests times its prompt tokens, as its FPM messages report them.
    prompts, outputs = [100, 3000, 200, 5000], [60, 2, 40, 3]
    table = RequestTable.create(prompts, outputs)
    engine = SimEngine("e", table, EngineLimits(max_num_batched_tokens=1024), QUIET, seed=1)
    engine.emit_fpm = True
    for rid in range(len(prompts)):
        engine.add_request(rid)
    end = engine.start_step(0.0)
    while end is not None:
        end = engine.start_step(engine.finish_step())
    scheds = [m.scheduled_requests for _, m in engine.outbox]
    beside = sum(s.num_decode_requests * s.sum_prefill_tokens for s in scheds)
    assert beside > 0
    # Per second of each pass's end, with the decode tokens beside them.
    by_second = engine.beside_by_second
    assert sum(b for _, b in by_second.values()) == beside
    assert sum(d for d, _ in by_second.values()) == sum(s.num_decode_requests for s in scheds)


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
    # The burst windows cover every rise above the base rate, and nothing else.
    windows = burst_windows(1200.0)
    assert windows == [(300.0, 510.0), (900.0, 1110.0)]
    per_10s = np.histogram(t, bins=np.arange(0.0, 1210.0, 10.0))[0]
    starts = np.arange(0.0, 1200.0, 10.0)
    inside = np.array([any(a <= x and x + 10.0 <= b for a, b in windows) for x in starts])
    outside = np.array([all(x + 10.0 <= a or x >= b for a, b in windows) for x in starts])
    assert per_10s[outside].mean() == pytest.approx(100.0, rel=0.15)
    assert per_10s[inside].mean() > 1.7 * per_10s[outside].mean()
    # Another period: the same bursts, further apart.
    slow = synthetic("bursts", duration_s=3000.0, base_rps=10.0, seed=2, burst_period_s=1200.0)
    assert burst_windows(3000.0, 1200.0) == [(300.0, 510.0), (1500.0, 1710.0), (2700.0, 2910.0)]
    between = np.count_nonzero((slow.arrival_s >= 900) & (slow.arrival_s < 1000))
    during = np.count_nonzero((slow.arrival_s >= 1550) & (slow.arrival_s < 1650))
    assert 2.0 < during / between < 3.0
    steps = synthetic("steps", duration_s=1000.0, base_rps=10.0, seed=2)
    first = np.count_nonzero(steps.arrival_s < 200)
    second = np.count_nonzero((steps.arrival_s >= 200) & (steps.arrival_s < 400))
    assert 1.7 < second / first < 2.3


def test_merged_tenants_keep_every_request_in_arrival_order() -> None:
    chat = shaped_synthetic(TrafficShape(prompt_median=600.0), lambda t: 4.0, 300.0, seed=1)
    docs = shaped_synthetic(
        TrafficShape(prompt_median=5000.0, prompt_sigma=0.3, max_prompt=30_000),
        lambda t: 2.0 if t >= 150.0 else 0.0,
        300.0,
        seed=2,
    )
    both = merged([chat, docs], "two tenants")
    assert len(both) == len(chat) + len(docs) and both.name == "two tenants"
    assert np.all(np.diff(both.arrival_s) >= 0.0)
    # Each request keeps its own lengths: the documents arrive only in the second half.
    early = both.arrival_s < 150.0
    assert both.prompt_tokens[early].sum() == chat.prompt_tokens[chat.arrival_s < 150.0].sum()
    assert sorted(both.output_tokens.tolist()) == sorted(
        chat.output_tokens.tolist() + docs.output_tokens.tolist()
    )
    with pytest.raises(ValueError):
        merged([], "none")


def test_a_scale_down_asked_back_within_the_window_counts_as_undone() -> None:
    t = np.arange(0.0, 1000.0, 10.0)
    total = np.full(t.size, 4.0)
    total[t >= 100] = 3  # down at 100 ...
    total[t >= 200] = 5  # ... asked back 100 s later: undone
    total[t >= 400] = 4  # down at 400, up only at 600: a new need, not a flap
    total[t >= 600] = 6
    total[t >= 700] = 5  # down at 700, 710 (twice) then up at 800: both undone
    total[t >= 710] = 4
    total[t >= 800] = 7
    total[t >= 900] = 6  # a last scale-down nothing followed
    assert scale_downs_undone(t, total) == 3
    assert scale_downs_undone(t, total, within_s=200.0) == 4
    assert scale_downs_undone(t, np.full(t.size, 4.0)) == 0
    assert scale_downs_undone(t[:1], total[:1]) == 0


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
    # Per window: the share of the requests arriving there, NaN where none arrive.
    arrival = traffic.arrival_s
    half = float(np.median(arrival))
    early, late, empty = attainment_in_windows(
        result,
        SloTargets(ttft_ms=10_000.0, itl_ms=10_000.0),
        [(0.0, half), (half, 1e9), (-10.0, -5.0)],
    )
    assert early == late == 1.0 and np.isnan(empty)
    lat_ok = np.nan_to_num(lat.ttft_ms, nan=np.inf) <= float(np.median(lat.ttft_ms))
    (share,) = attainment_in_windows(
        result, SloTargets(ttft_ms=float(np.median(lat.ttft_ms)), itl_ms=10_000.0), [(0.0, 1e9)]
    )
    assert share == pytest.approx(lat_ok.mean())
    # One replica for the whole run: replica-seconds are the span asked for.
    first, end = float(result.timeline["t"][0]), float(result.timeline["t"][-1])
    assert replica_seconds(result, first, end) == pytest.approx(end - first)
    assert replica_seconds(result, 5.0, 15.0) == pytest.approx(10.0, abs=1.0)
    assert replica_seconds(result, -10.0, -5.0) == 0.0


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
    # The planner's ITL prediction at the ready count matches what the requests of
    # the last 30 s measured (steady load, learned cost model).
    assert len(policy.checks) >= 20
    check = policy.checks[-1]
    lat = request_latencies(result)
    recent = (traffic.arrival_s >= check.time - 30.0) & (traffic.arrival_s < check.time)
    itl = lat.itl_ms[recent]
    measured_itl = float(itl[np.isfinite(itl) & (itl > 0)].mean())
    assert check.itl_mean_ms == pytest.approx(measured_itl, rel=0.15)


def test_predicted_mean_itl_is_what_the_passes_measure_on_long_prompts() -> None:
    # The closed loop learns its ITL correction from the measured mean (the passes'
    # wall times weighted by their decodes) over the predicted one. With long prompts
    # a balancing router keeps prefill off the replicas with many decodes, so a
    # decode meets less of it than the mean pass has: the mean pass read 1.12x the
    # measured mean here (1.10-1.15x on 4-8 replicas of such prompts), and the loop
    # never saw a model that was low. Held at 6 replicas, real FPM through the
    # operator's pipeline, the realized mean read by the load estimate at each
    # decision (recorded by wrapping the model's own estimate, which is unchanged).
    shape = TrafficShape(
        prompt_median=6000.0,
        prompt_sigma=0.5,
        max_prompt=30_000,
        output_median=80.0,
        output_sigma=0.8,
    )
    traffic = shaped_synthetic(shape, lambda t: 7.5, 240.0, seed=3)
    setup = ScalingSetup(
        SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0, min_replicas=6, max_replicas=6
    )
    policy = PlannerDrivenPolicy(setup)
    realized: dict[float, float] = {}
    estimate = policy.model.estimate

    def recorded(now: float | None = None) -> LoadEstimate:
        load = estimate(now)
        realized[now or 0.0] = load.realized_itl_mean_ms
        return load

    policy.model.estimate = recorded  # type: ignore[method-assign,unused-ignore]
    Fleet(traffic, policy, FleetConfig(initial_replicas=6, startup_s=30.0)).run()
    ratios = [
        check.itl_mean_ms / realized[check.time]
        for check in policy.checks
        if check.time >= 60.0 and realized.get(check.time, 0.0) > 0.0
    ]
    assert len(ratios) >= 30
    assert float(np.median(ratios)) == pytest.approx(1.0, abs=0.07)


def test_oracle_is_sized_by_the_measured_ground_truth_capacity() -> None:
    traffic = synthetic("steps", duration_s=400.0, base_rps=6.0, seed=3)
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    # Segments keep the traffic's own requests; every probe replays the same ones,
    # only stretched to the asked rate.
    (segment,) = calibration_segments(traffic, 500, count=1)
    at_10, at_20 = replayed_at(segment, 10.0), replayed_at(segment, 20.0)
    assert len(at_10) == 500 and at_10.arrival_s[-1] < 50.0 <= at_10.duration_s
    assert at_10.prompt_tokens.tolist() == at_20.prompt_tokens.tolist()
    assert np.allclose(at_10.arrival_s, 2.0 * at_20.arrival_s)
    assert set(segment.prompt_tokens.tolist()) <= set(traffic.prompt_tokens.tolist())
    cap = calibrate_capacity(
        traffic, setup, H100_LLAMA_8B, replicas=1, calibration=Calibration(60.0, 10.0, 3)
    )
    assert 3.0 < cap < 40.0
    oracle = OraclePolicy(traffic, setup, CapacityCurve.flat(cap))
    rates = arrival_rate_series(traffic)
    assert oracle.needs.tolist() == np.maximum(np.ceil(rates / cap), 1).astype(int).tolist()
    # It asks now for what the slots up to one start-up time ahead need.
    view = FleetView(0.0, 1, (), 0.0, None, 0)
    assert oracle.desired(view) == int(oracle.needs[: int(35 // 10) + 1].max())


def test_hindsight_sizes_to_the_highest_need_seen_and_never_ahead() -> None:
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    traffic = synthetic("bursts", duration_s=900.0, base_rps=10.0, seed=2)
    hindsight = HindsightPolicy(traffic, setup, CapacityCurve.flat(5.0))
    needs = hindsight.needs
    assert needs.max() > needs[0]  # the bursts need more than the start
    seen_max = np.maximum.accumulate(needs)
    for now in (0.0, 35.0, 290.0, 330.0, 600.0, 899.0):
        want = int(seen_max[max(int((now - 30.0) // 10.0), 0)])
        assert hindsight.desired(FleetView(now, 1, (), 0.0, None, 0)) == want
    # Never ahead of the load: before the first burst has been seen it asks for less
    # than the oracle, which provisions for it a start-up time early.
    first = int(np.argmax(needs > needs[0])) * 10.0
    before = FleetView(first - 20.0, 1, (), 0.0, None, 0)
    oracle = OraclePolicy(traffic, setup, CapacityCurve.flat(5.0))
    assert hindsight.desired(before) < oracle.desired(before)


def test_ours_at_memory_is_ours_without_recurring_bursts() -> None:
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    traffic = synthetic("flat", duration_s=60.0, base_rps=2.0, seed=1)
    ours = build_policy("ours", traffic, setup, H100_LLAMA_8B, PlannerPolicy())
    memory = build_policy("ours@memory", traffic, setup, H100_LLAMA_8B, PlannerPolicy())
    assert isinstance(ours, PlannerDrivenPolicy) and isinstance(memory, PlannerDrivenPolicy)
    assert memory.name == "ours@memory" and ours.name == "ours"
    assert ours.planner.policy.recurring_bursts >= 3
    assert memory.planner.policy == replace(ours.planner.policy, recurring_bursts=0)


def test_windowed_oracle_scales_down_only_after_its_window() -> None:
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    traffic = synthetic("bursts", duration_s=900.0, base_rps=10.0, seed=2)
    oracle = OraclePolicy(traffic, setup, CapacityCurve.flat(5.0))
    windowed = WindowedOraclePolicy(traffic, setup, CapacityCurve.flat(5.0), stabilization_s=60.0)
    asks: list[tuple[float, int]] = []
    held: list[int] = []
    for k in range(180):
        now = k * 5.0
        view = FleetView(now, 1, (), 0.0, None, 0)
        asks.append((now, oracle.desired(view)))
        held.append(windowed.desired(view))
        # Never below the oracle, and exactly its highest ask of the last minute.
        assert held[-1] == max(ask for t, ask in asks if t >= now - 60.0), now
    # A burst's end (a fall that does not come back within the minute): the oracle
    # lets go at once, the window keeps the peak for exactly its 60 s.
    peak = [a for _, a in asks]
    fall = next(k for k in range(1, 160) if max(peak[k : k + 13]) < peak[k - 1])
    assert held[fall] == held[fall + 11] == peak[fall - 1]
    assert held[fall + 12] < peak[fall - 1]


def test_planner_predictions_match_the_simulation_on_steady_traffic() -> None:
    # Fixed count (advisory planner), flat Poisson load, the ground-truth step time
    # as the cost model: judges the planner's capacity and queueing model alone,
    # on the load estimate the operator measures from FPM.
    traffic = synthetic("flat", duration_s=300.0, base_rps=8.0, seed=1)
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=60.0)
    policy = PlannerDrivenPolicy(
        setup, planner=Planner(PlannerPolicy(advisory=True)), predictor=H100_LLAMA_8B
    )
    result = Fleet(traffic, policy, FleetConfig(initial_replicas=2)).run()
    assert {c.replicas for c in policy.checks} == {2}
    errors = prediction_errors(policy, result)
    assert errors["windows"] >= 30
    assert errors["median_error_ttft_mean"] <= 0.10
    assert errors["median_error_itl_mean"] <= 0.10
    # Pooled over the windows, about 1% of requests exceed their predicted p99.
    assert 0.001 < errors["share_above_predicted_ttft_p99"] < 0.05
    assert 0.0 < errors["sampling_error_ttft_p99"] < 0.5
    # The comparison can fail: predictions 30% off are reported as such.
    for check in policy.checks:
        check.ttft_mean_ms *= 1.3
        check.itl_mean_ms *= 1.3
        check.ttft_ms *= 0.5
    off = prediction_errors(policy, result)
    assert off["median_error_ttft_mean"] > 0.10 and off["median_error_itl_mean"] > 0.10
    assert off["share_above_predicted_ttft_p99"] > 0.05


def test_a_small_windows_p99_is_off_by_at_least_its_sampling_error() -> None:
    # Windows of lognormal latencies whose true p99 is known: a prediction of exactly
    # that p99 is still off against each window's sample p99. The bootstrap error is
    # a floor under that (it cannot see past the window's worst value), and shrinks
    # as the windows grow.
    rng = np.random.default_rng(1)
    true_p99 = float(np.exp(1.5 * 2.3263))
    floors: dict[int, float] = {}
    for n in (50, 5000):
        boot, exact = [], []
        for _ in range(60):
            values = rng.lognormal(0.0, 1.5, n)
            boot.append(sample_p99_error(values, np.random.default_rng(0)))
            sample = float(np.percentile(values, 99))
            exact.append(abs(true_p99 - sample) / sample)
        floors[n] = float(np.median(boot))
        assert 0.0 < floors[n] <= float(np.median(exact))
    assert floors[50] > 0.15 > 0.06 > floors[5000]
    assert sample_p99_error(np.array([3.0]), rng) == 0.0


def test_dynamo_style_counts_a_starting_replica_as_coming_capacity() -> None:
    # Far more load than one replica serves. It steps +1 per tick, counting the
    # replicas still starting as capacity, and stops at the count its prediction
    # says is enough instead of adding one more every tick of the 60 s start-up.
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=60.0)
    asked: list[tuple[float, int, int, int]] = []

    class Recording(DynamoPolicy):
        def desired(self, view: FleetView) -> int:
            wanted = super().desired(view)
            asked.append((view.now, view.ready, len(view.starting_since), wanted))
            return wanted

    policy = Recording(setup, H100_LLAMA_8B)
    traffic = synthetic("flat", duration_s=50.0, base_rps=60.0, seed=2)
    Fleet(traffic, policy, FleetConfig(startup_s=60.0)).run()
    load = frontend_estimate(traffic, 0, len(traffic), 60.0)
    assert load is not None
    enough = next(n for n in range(1, 64) if policy._predict(load, n).within(setup.slo, 0.0))
    assert enough >= 3  # the test needs a ramp of several steps
    wanted = [w for _, _, _, w in asked]
    totals = [ready + starting for _, ready, starting, _ in asked]
    assert all(w - t <= 1 for w, t in zip(wanted, totals, strict=True))  # one step a tick
    assert all(ready == 1 for _, ready, _, _ in asked)  # nothing finished starting
    # It stops near what it predicts it needs (the live window's load differs a
    # little from the whole trace's); one step every tick for 60 s would reach 12.
    assert enough - 1 <= max(wanted) <= enough + 1
    assert len(set(wanted[len(wanted) // 2 :])) == 1  # and then holds


def test_dynamo_style_does_not_remove_a_replica_it_predicts_it_would_need_back() -> None:
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=60.0)
    policy = DynamoPolicy(setup, H100_LLAMA_8B)
    traffic = synthetic("flat", duration_s=60.0, base_rps=30.0, seed=2)
    load = frontend_estimate(traffic, 0, len(traffic), 60.0)
    assert load is not None
    # Two replicas undershoot 80% of the SLO; one alone would miss it.
    assert policy._predict(load, 2).within(setup.slo, 0.2)
    assert not policy._predict(load, 1).within(setup.slo, 0.0)
    assert policy.desired(FleetView(60.0, 2, (), 0.0, load, 0)) == 2
    # With a third replica to spare, the undershoot removes one.
    assert policy.desired(FleetView(60.0, 3, (), 0.0, load, 0)) == 2


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _collect_until(
    sub: FpmSubscriber, done: object, timeout_s: float = 10.0
) -> list[ForwardPassMetrics]:
    got: list[ForwardPassMetrics] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got.extend(sub.poll_batch(0.1))
        if callable(done) and done(got):
            break
    return got


def test_simulated_pods_publish_at_their_own_loopback_address() -> None:
    port = _free_port(pod_host(0))
    taps = SimulatedPodPublishers(port)
    assert taps.endpoint_of("sim-0") == f"tcp://127.0.0.2:{port}"
    assert taps.endpoint_of("sim-300") == f"tcp://127.0.1.46:{port}"

    class ThreeThenTwo(StaticPolicy):
        def desired(self, view: FleetView) -> int:
            return 3 if view.now < 5.0 else 2

    policy = ThreeThenTwo(3)
    policy.interval_s = 5.0
    try:
        Fleet(flat_traffic(200, 0.05), policy, FleetConfig(initial_replicas=3), fpm_tap=taps).run()
        # The replica the fleet stopped closed its socket; the two others publish.
        assert len(taps.endpoints) == 2
        live = dict(taps.endpoints)
        for worker, endpoint in live.items():
            assert endpoint == f"tcp://{pod_host(int(worker.split('-')[1]))}:{port}"
        with FpmSubscriber(endpoints=[taps.endpoint_of(f"sim-{i}") for i in range(3)]) as sub:
            # Idle publishers heartbeat in real time: both live pods show up.
            got = _collect_until(sub, lambda g: {m.worker_id for m in g} >= set(live))
            assert {m.worker_id for m in got} == set(live)
            # A simulated pass reaches the subscriber from that pod's address.
            worker = sorted(live)[-1]
            sched = ScheduledRequestMetrics(num_decode_requests=3, sum_decode_kv_tokens=900)
            pass_msg = ForwardPassMetrics(
                worker_id=worker,
                counter_id=0,
                wall_time=0.01,
                scheduled_requests=sched,
                queued_requests=QueuedRequestMetrics(),
            )
            taps([(0.0, pass_msg)])
            got = _collect_until(sub, lambda g: any(m.scheduled_requests == sched for m in g))
            mine = [m for m in got if m.scheduled_requests == sched]
            assert mine and mine[0].worker_id == worker and not mine[0].is_heartbeat
    finally:
        taps.close()
    assert taps.endpoints == {}


def test_plot_timeline_writes_a_png(tmp_path: Path) -> None:
    traffic = flat_traffic(60, 0.5)
    result = Fleet(traffic, StaticPolicy(1), FleetConfig(initial_replicas=1)).run()
    path = tmp_path / "timeline.png"
    plot_timeline([result], SloTargets(1000.0, 40.0), str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_trace_picks_the_loader_by_extension(tmp_path: Path) -> None:
    (tmp_path / "a.CSV").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,374,44\n"
    )
    (tmp_path / "b.jsonl").write_text('{"timestamp": 0, "input_length": 70, "output_length": 3}\n')
    assert load_trace(tmp_path / "a.CSV").prompt_tokens.tolist() == [374]
    assert load_trace(tmp_path / "b.jsonl").prompt_tokens.tolist() == [70]
    (tmp_path / "c.parquet").write_text("")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "c.parquet")


def test_azure_timestamps_are_utc_whatever_the_local_zone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 06:59:59Z and 07:00:01Z straddle New York's 2023 spring-forward (2 s apart in
    # UTC); read as New York local time they would be an hour and 2 s apart.
    path = tmp_path / "dst.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-03-12 01:59:59.0000000,10,1\n"
        "2023-03-12 03:00:01.0000000,10,1\n"
    )
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        trace = load_azure_csv(path)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert trace.arrival_s.tolist() == [0.0, 3602.0]


def test_profile_overrides_are_checked() -> None:
    quiet = profile_with(H100_LLAMA_8B, {"noise_sigma": 0.0, "layers": 40})
    assert quiet == replace(H100_LLAMA_8B, noise_sigma=0.0, layers=40)
    assert isinstance(quiet.layers, int)
    with pytest.raises(ValueError, match="unknown profile fields"):
        profile_with(H100_LLAMA_8B, {"hbm_tb_s": 3.0})
    with pytest.raises(ValueError, match="out of range"):
        profile_with(H100_LLAMA_8B, {"flops_per_s": 0})
    with pytest.raises(ValueError, match="must be a number"):
        profile_with(H100_LLAMA_8B, {"overhead_s": "1ms"})


def test_dynamo_style_headroom_aims_below_the_slo() -> None:
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=60.0)
    traffic = synthetic("flat", duration_s=60.0, base_rps=30.0, seed=2)
    load = frontend_estimate(traffic, 0, len(traffic), 60.0)
    assert load is not None
    plain = DynamoPolicy(setup, H100_LLAMA_8B)
    # The smallest count within the SLO, and within 60% of it.
    n_slo = next(n for n in range(1, 64) if plain._predict(load, n).within(setup.slo, 0.0))
    n_60 = next(n for n in range(1, 64) if plain._predict(load, n).within(setup.slo, 0.4))
    assert n_60 > n_slo
    roomy = build_policy("dynamo@0.4", traffic, setup, H100_LLAMA_8B, PlannerPolicy())
    assert isinstance(roomy, DynamoPolicy) and roomy.name == "dynamo@0.4"
    view = FleetView(60.0, n_slo, (), 0.0, load, 0)
    assert plain.desired(view) == n_slo  # the baseline holds at the SLO
    assert roomy.desired(view) == n_slo + 1  # with headroom it steps up
    with pytest.raises(ValueError):
        DynamoPolicy(setup, H100_LLAMA_8B, headroom=1.0)


def test_shaped_traffic_has_the_shapes_it_is_asked_for() -> None:
    shape = TrafficShape(
        cluster_mean=2.0,
        silent_share=0.5,
        mean_on_s=60.0,
        prompt_sigma=1.5,
        max_prompt=126_000,
        short_output_share=0.35,
    )
    traffic = shaped_synthetic(shape, lambda t: 10.0, 1800.0, seed=2)
    poisson = synthetic("flat", 1800.0, 10.0, seed=2)

    def dispersion(t: Traffic) -> float:
        counts = np.bincount(t.arrival_s.astype(np.int64))
        windows = [counts[i : i + 30] for i in range(0, counts.size - 30, 30)]
        return float(np.median([w.var(ddof=1) / w.mean() for w in windows if w.mean() > 0]))

    def gap_cv2(t: Traffic) -> float:
        gaps = np.diff(t.arrival_s)
        return float(gaps.var() / gaps.mean() ** 2)

    assert dispersion(poisson) < 1.5 < dispersion(traffic)
    assert gap_cv2(poisson) < 2.0 and gap_cv2(traffic) > 50.0
    assert 0.3 < float((traffic.output_tokens <= 10).mean()) < 0.4
    assert (
        traffic.prompt_tokens.max() <= 126_000
        and np.percentile(traffic.prompt_tokens, 99.9) > 20_000
    )
    assert len(traffic) / 1800.0 == pytest.approx(10.0, rel=0.25)


def test_the_oracle_stays_a_bound_when_part_of_the_traffic_is_out_of_reach() -> None:
    # A tenth of the prompts take 60k tokens: ~2 s of prefill alone, beyond the 1 s
    # TTFT SLO at any count. The calibration aims at what a large, nearly idle fleet
    # attains on the same requests (less half a point) instead of failing to the
    # bracket's floor at every size.
    rng = np.random.default_rng(4)
    n = 1200
    arrival = np.sort(rng.uniform(0.0, 300.0, n))
    prompt = np.where(rng.random(n) < 0.1, 60_000, 800).astype(np.int64)
    traffic = Traffic(arrival, prompt, np.full(n, 100, dtype=np.int64), 300.0, "long")
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    floor = 30_000.0 / float(prompt.mean()) / BRACKET_RATIO  # the bracket's low end
    peak = float(arrival_rate_series(traffic).max())
    curve = calibrate_capacity_curve(
        traffic, setup, H100_LLAMA_8B, peak, calibration=Calibration(60.0, 10.0, 5)
    )
    assert curve.per_replica(curve.sizes[-1]) > 10.0 * floor, curve.describe()
    oracle = OraclePolicy(traffic, setup, curve)
    assert oracle.needs.max() < setup.max_replicas


def test_capacity_curve_sizes_each_rate_by_what_a_fleet_of_that_size_serves() -> None:
    # Measured dips are noise under a balancing router: pooled to a non-decreasing fit.
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([5.0, 1.0, 0.0]) == [2.0, 2.0, 2.0]
    curve = CapacityCurve.measured([1, 4], [1.0, 2.0])
    # Interpolated in log of the size: 1.5 per replica at 2, held at 2.0 beyond 4.
    assert curve.per_replica(2) == pytest.approx(1.5)
    assert curve.per_replica(9) == pytest.approx(2.0)
    # Fleets of 1..5 serve 1, 3, ~5.4, 8, 10 req/s.
    rates = np.array([0.0, 1.0, 2.5, 8.0, 8.01, 100.0])
    assert curve.replicas_for(rates, max_replicas=10).tolist() == [1, 1, 2, 4, 5, 10]
    # A flat curve is the old single capacity: ceil(rate / capacity).
    flat = CapacityCurve.flat(5.0)
    assert flat.replicas_for(np.array([4.0, 11.0, 49.0]), 64).tolist() == [1, 3, 10]
    with pytest.raises(ValueError, match="increase"):
        CapacityCurve((2, 1), (1.0, 1.0))


def test_a_balancing_router_pools_rare_long_prompts_so_capacity_grows_with_the_fleet() -> None:
    # One prompt in 20 takes 24k tokens (~0.8 s of prefill): on one replica it stalls
    # every request behind it past the 1 s TTFT SLO; on four the router sends the
    # rest around it. Measured by the simulator, not assumed.
    rng = np.random.default_rng(7)
    n = 4000
    arrival = np.sort(rng.uniform(0.0, 400.0, n))
    prompt = np.where(rng.random(n) < 0.05, 24_000, 600).astype(np.int64)
    traffic = Traffic(arrival, prompt, np.full(n, 80, dtype=np.int64), 400.0, "rare-long")
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0, max_replicas=4)
    curve = calibrate_capacity_curve(
        traffic, setup, H100_LLAMA_8B, peak_rps=1e9, calibration=Calibration(60.0, 10.0, 4)
    )
    assert curve.sizes == (1, 2, 4)  # doubling up to max_replicas: no size served 1e9 req/s
    assert curve.per_replica(4) > 1.2 * curve.per_replica(1), curve.describe()
    # So the oracle sizes a rate four replicas serve with fewer than a single
    # replica's capacity would ask for.
    rate = 4 * curve.per_replica(4)
    (need,) = curve.replicas_for(np.array([rate]), setup.max_replicas)
    assert need < math.ceil(rate / curve.per_replica(1))


def test_the_oracle_level_is_fitted_to_meet_the_target_on_the_traffic_itself() -> None:
    # Steady stretches overstate what a fleet serves while bursts come and go within
    # the oracle's 30 s windows; the level is fitted on the whole traffic, so the
    # oracle meets the target there, and only just (a bound, not a generous one).
    traffic = synthetic("bursts", duration_s=600.0, base_rps=10.0, seed=5)
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=30.0)
    sizing = ground_truth_sizing(
        traffic, setup, H100_LLAMA_8B, calibration=Calibration(60.0, 10.0, 4, fit_iterations=5)
    )
    assert 0.5 <= sizing.fit_factor < 2.0
    assert oracle_attainment(traffic, setup, H100_LLAMA_8B, sizing.capacity) >= 0.99
    generous = sizing.capacity.scaled(1.25)
    assert oracle_attainment(traffic, setup, H100_LLAMA_8B, generous) < 0.99
    assert OraclePolicy(traffic, setup, sizing.capacity).needs.tolist() == sizing.needs.tolist()


class _DeficitUnmeasured(DeploymentModel):
    """The operator's model with the prefill-pass decode deficit left unknown."""

    def estimate(self, now: float | None = None) -> LoadEstimate:
        return replace(super().estimate(now), prefill_pass_decode_deficit=0.0)


def test_long_outputs_p99_itl_counts_only_the_decodes_a_balancing_router_exposes() -> None:
    # Heavy-tailed prompts on roomy fleets behind a balancing router: prompts go to
    # the replicas with the fewest requests, so a long prefill delays fewer decode
    # requests than a uniform spread would. Fixed counts, ground-truth step time: the
    # latency model alone is judged, on the load the operator measures from FPM.
    shape = TrafficShape(
        cluster_mean=1.5, prompt_median=1000.0, prompt_sigma=1.5, max_prompt=126_000
    )
    traffic = shaped_synthetic(shape, lambda t: 5.0, 600.0, seed=3)
    setup = ScalingSetup(SloTargets(1000.0, 40.0), EngineLimits(), startup_s=60.0)
    for replicas in (6, 8):
        bias = {}
        for name, model in (
            ("measured", DeploymentModel("sim")),
            ("unmeasured", _DeficitUnmeasured("sim")),
        ):
            policy = PlannerDrivenPolicy(
                setup,
                planner=Planner(PlannerPolicy(advisory=True)),
                model=model,
                predictor=H100_LLAMA_8B,
            )
            result = Fleet(traffic, policy, FleetConfig(initial_replicas=replicas)).run()
            errors = prediction_errors(policy, result)
            assert errors["windows"] >= 10
            bias[name] = errors["median_bias_itl_p99"]
        assert model.estimate(600.0).prefill_pass_decode_deficit == 0.0
        # Measured: 4.4% high on 6 replicas, 7.5% low on 8; unmeasured, 20-23% high.
        assert abs(bias["measured"]) <= 0.15, (replicas, bias)
        assert bias["unmeasured"] > abs(bias["measured"]) + 0.05, (replicas, bias)
