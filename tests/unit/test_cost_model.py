"""CostModel against synthetic ground truth whose coefficients are known.

Ground truth is the model's own functional form (so recovery is testable) with
multiplicative log-normal noise: mostly a linear truth (a roofline whose memory side
is zero, as on a CPU engine), and the simulator's H100 roofline. Tolerances are
stated per test.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.cost_model import (
    COEFFICIENT_NAMES,
    SCHEMA_V1,
    CostModel,
    feature_matrix,
    nnls_normal,
    regressor_matrix,
    roofline,
    sched_matrix,
)
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B

# A linear truth: 4 ms + 20 us per prompt token + 0.5 ms per prefill request + 100 us
# per decode request (80 us of host cost + the 20 us every computed token costs) + ...
# It is a roofline whose memory side is zero: the model must find no knee in it.
TRUE = {
    "intercept": 4e-3,
    "prefill_requests": 5e-4,
    "decode_requests": 8e-5,
    "compute.tokens": 2e-5,
    "compute.prefill_attention": 3e-9,
    "compute.decode_kv_tokens": 2e-7,
    "memory.intercept": 0.0,
    "memory.kv_read_tokens": 0.0,
    "memory.kv_write_tokens": 0.0,
}
TRUE_VEC = np.array([TRUE[name] for name in COEFFICIENT_NAMES])
MEMORY_NAMES = [name for name in COEFFICIENT_NAMES if name.startswith("memory.")]


def scaled(factors: dict[str, float]) -> np.ndarray:
    """TRUE_VEC with some coefficients multiplied (the others kept)."""
    return np.array([TRUE[n] * factors.get(n, 1.0) for n in COEFFICIENT_NAMES])


def truth_times(sched: np.ndarray, coef: np.ndarray = TRUE_VEC) -> np.ndarray:
    return roofline(regressor_matrix(sched), coef)


def compositions(
    rng: np.random.Generator, n: int, p_prefill: float = 0.6, p_decode: float = 0.7
) -> np.ndarray:
    """(n, 7) batch compositions spanning prefill-only, decode-only and mixed passes."""
    rows = np.zeros((n, 7))
    has_p = rng.random(n) < p_prefill
    has_d = (rng.random(n) < p_decode) | ~has_p
    n_pre = np.where(has_p, rng.integers(1, 4, n), 0)
    for i in np.flatnonzero(has_p):
        lens = rng.integers(16, 2048, n_pre[i])
        rows[i, 0] = n_pre[i]
        rows[i, 1] = lens.sum()
        rows[i, 2] = lens.var()
        rows[i, 3] = rng.integers(0, 512) * n_pre[i]
    n_dec = np.where(has_d, rng.integers(1, 256, n), 0)
    rows[:, 4] = n_dec
    rows[:, 5] = n_dec * rng.integers(64, 4096, n)
    return rows


def step_times(
    rng: np.random.Generator, sched: np.ndarray, noise: float, coef: np.ndarray = TRUE_VEC
) -> np.ndarray:
    return truth_times(sched, coef) * np.exp(rng.normal(0.0, noise, sched.shape[0]))


def trained(
    rng: np.random.Generator, n: int = 20000, noise: float = 0.05, **kw: float
) -> CostModel:
    model = CostModel(warmup_passes=0, **kw)
    sched = compositions(rng, n)
    model.update_batch(sched, step_times(rng, sched, noise), [("w", 0)] * n)
    return model


def rel_err(model: CostModel, sched: np.ndarray, coef: np.ndarray = TRUE_VEC) -> np.ndarray:
    truth = truth_times(sched, coef)
    return np.abs(model.predict_many(sched) - truth) / truth


def test_recovers_true_coefficients_within_10_percent() -> None:
    model = trained(np.random.default_rng(1))
    coef = model.coefficients
    se = model.std_errors
    for name, true in TRUE.items():
        if name in MEMORY_NAMES:
            continue
        assert coef[name] == pytest.approx(true, rel=0.10), name
        # The reported standard errors are honest: truth within 4 of them.
        assert abs(coef[name] - true) <= 4 * se[name] + 1e-15, name
    # No knee in a linear truth: the memory side stays empty (no data, no error).
    assert not model.roofline_active
    assert all(coef[name] == 0.0 and math.isnan(se[name]) for name in MEMORY_NAMES)
    assert model.ready


def test_prequential_quality_matches_noise_level() -> None:
    noise = 0.10
    model = trained(np.random.default_rng(2), noise=noise)
    q = model.quality
    assert q.window == 2000
    # E|exp(N(0, s)) - 1| ~= s*sqrt(2/pi) ~= 0.08 for s = 0.1: the model adds little.
    assert 0.06 < q.mape < 0.10
    assert q.median_ape < q.mape < q.p90_ape
    assert q.r2 > 0.8
    assert q.prefill_only_samples + q.decode_only_samples + q.mixed_samples == q.samples
    # Every coefficient whose regressor saw data has a standard error; the memory side
    # has none here (the linear fit was kept): NaN, left out of the JSON form.
    assert all(v > 0 and math.isfinite(v) for k, v in q.std_errors.items() if k not in MEMORY_NAMES)
    assert all(math.isnan(q.std_errors[k]) for k in MEMORY_NAMES)
    assert set(q.to_dict()["std_errors"]) == set(COEFFICIENT_NAMES) - set(MEMORY_NAMES)


def test_coefficients_never_negative() -> None:
    rng = np.random.default_rng(3)
    # No per-request host cost: unconstrained OLS goes negative half the time.
    truth = scaled({"decode_requests": 0.0, "prefill_requests": 0.0})
    model = CostModel(warmup_passes=0)
    sched = compositions(rng, 5000)
    model.update_batch(sched, step_times(rng, sched, 0.15, truth), [("w", 0)] * 5000)
    assert all(v >= 0.0 for v in model.coefficients.values())
    assert (model.predict_many(compositions(rng, 100)) > 0).all()


def test_decode_flood_does_not_wash_out_prefill() -> None:
    rng = np.random.default_rng(4)
    model = trained(rng, n=10000, half_life_passes=2000)
    prefill_only = compositions(rng, 200, p_prefill=1.0, p_decode=0.0)
    before = rel_err(model, prefill_only)
    flood = compositions(rng, 100_000, p_prefill=0.0)
    model.update_batch(flood, step_times(rng, flood, 0.05), [("w", 0)] * flood.shape[0])
    after = rel_err(model, prefill_only)
    assert before.mean() < 0.03
    assert after.mean() < 0.05  # still right, 50 half-lives of decode-only later
    assert model.quality.prefill_only_samples > 0


def test_outliers_do_not_drag_the_fit() -> None:
    rng = np.random.default_rng(5)
    model = CostModel(warmup_passes=0)
    sched = compositions(rng, 20000)
    y = step_times(rng, sched, 0.05)
    stalled = np.less(rng.random(y.shape[0]), 0.05)
    y[stalled] *= 6.0  # a pass stalled by something else
    model.update_batch(sched, y, [("w", 0)] * y.shape[0])
    assert model.quality.outliers_rejected >= 0.8 * int(stalled[1000:].sum())
    assert rel_err(model, compositions(rng, 500)).mean() < 0.03


def test_follows_a_changed_engine() -> None:
    rng = np.random.default_rng(6)
    model = trained(rng, n=10000, half_life_passes=1000)
    faster_gpu = scaled(
        {
            "intercept": 0.5,
            "prefill_requests": 0.5,
            "decode_requests": 0.5,
            "compute.tokens": 0.4,
            "compute.prefill_attention": 0.6,
            "compute.decode_kv_tokens": 0.3,
        }
    )
    sched = compositions(rng, 10000)
    model.update_batch(sched, step_times(rng, sched, 0.05, faster_gpu), [("w", 0)] * 10000)
    assert rel_err(model, compositions(rng, 500), faster_gpu).mean() < 0.05


def test_warmup_per_stream_and_after_restart() -> None:
    model = CostModel(warmup_passes=5, min_samples=10)
    sched = [ScheduledRequestMetrics(num_decode_requests=8, sum_decode_kv_tokens=800)] * 40
    results = [model.update(s, 0.01, ("a", 0), counter_id=i) for i, s in enumerate(sched)]
    assert results[:5] == [None] * 5
    assert model.samples == 35
    assert model.warmup_skipped == 5
    # A new stream warms up on its own; "a" restarting (counter back to 0) warms up again.
    assert model.update(sched[0], 0.01, ("b", 0), counter_id=100) is None
    assert model.update(sched[0], 0.01, ("a", 0), counter_id=0) is None
    assert model.samples == 35
    assert model.warmup_skipped == 7


def test_heartbeats_are_ignored() -> None:
    model = CostModel(warmup_passes=0)
    assert model.update(ScheduledRequestMetrics(), 0.0) is None
    assert model.update(ScheduledRequestMetrics(), float("nan")) is None
    assert model.samples == 0
    assert model.heartbeats_ignored == 1
    assert math.isnan(model.predict(ScheduledRequestMetrics(num_decode_requests=1)))
    assert not model.ready


def test_serialization_round_trip_is_small_json() -> None:
    rng = np.random.default_rng(8)
    model = trained(rng, n=5000)
    snapshot = json.loads(json.dumps(model.to_dict()))
    assert len(json.dumps(snapshot)) < 8000
    assert [c["name"] for c in snapshot["coefficients"]] == list(COEFFICIENT_NAMES)
    units = {c["name"]: (c["unit"], c["feature_unit"]) for c in snapshot["coefficients"]}
    assert units["compute.tokens"] == ("s/token", "token")
    assert units["memory.intercept"] == ("s/pass", "pass")
    assert snapshot["formula"].startswith("step_ms = ")
    restored = CostModel.from_dict(snapshot)
    probe = compositions(rng, 50)
    np.testing.assert_allclose(restored.predict_many(probe), model.predict_many(probe), rtol=1e-9)
    assert restored.ready and restored.samples == model.samples
    assert restored.formula() == model.formula()
    # The warm start keeps learning: a changed engine replaces the restored knowledge.
    sched = compositions(rng, 20000)
    restored.update_batch(sched, step_times(rng, sched, 0.05, TRUE_VEC * 2), [("w", 0)] * 20000)
    assert rel_err(restored, probe, TRUE_VEC * 2).mean() < 0.05


def test_from_dict_rejects_foreign_snapshots() -> None:
    with pytest.raises(ValueError):
        CostModel.from_dict({"schema": "something/else"})
    # A snapshot of the linear model (v1) cannot be mapped onto the roofline: refused,
    # with a reason, and the operator starts afresh.
    old = CostModel().to_dict()
    old["schema"] = SCHEMA_V1
    with pytest.raises(ValueError, match="linear model"):
        CostModel.from_dict(old)
    snapshot = CostModel().to_dict()
    snapshot["coefficients"] = snapshot["coefficients"][:-1]
    with pytest.raises(ValueError):
        CostModel.from_dict(snapshot)


def _set(snapshot: dict[str, Any], path: str, value: object) -> None:
    *parents, last = path.split(".")
    node = snapshot
    for key in parents:
        node = node[key]
    node[last] = value


@pytest.mark.parametrize(
    ("path", "value", "names"),
    [
        ("state.gram", [[math.nan] * 9] * 9, "state.gram"),
        ("state.gram", [[1.0] * 9] * 8, "state.gram"),
        ("state.gram", [[1.0] * 6] * 6, "state.gram"),  # the linear model's shape
        ("state.gram", "not a matrix", "state.gram"),
        ("state.xty", [0.0] * 8, "state.xty"),
        ("state.xty", [0.0] * 8 + [math.inf], "state.xty"),
        ("state.scales", [1.0, "x"] + [1.0] * 7, "state.scales"),
        ("state.scales", [1.0, 0.0] + [1.0] * 7, "state.scales"),
        ("state.n_eff", -5.0, "state.n_eff"),
        ("state.yty", math.nan, "state.yty"),
        ("state.residual_scale", math.nan, "state.residual_scale"),
        ("state", [1, 2], "state"),
        ("samples", -1, "samples"),
        ("regime_samples", {"mixed": 1.5}, "regime_samples.mixed"),
        ("quality.outliers_rejected", "many", "quality.outliers_rejected"),
        ("config.half_life_passes", math.inf, "config.half_life_passes"),
    ],
)
def test_from_dict_rejects_malformed_snapshots(path: str, value: object, names: str) -> None:
    snapshot = trained(np.random.default_rng(15), n=1000).to_dict()
    CostModel.from_dict(json.loads(json.dumps(snapshot)))  # the unmodified one restores
    _set(snapshot, path, value)
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        CostModel.from_dict(snapshot)


def _stalled_passes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    sched = compositions(rng, n)
    y = step_times(rng, sched, 0.05)
    y[rng.random(n) < 0.05] *= 6.0
    return sched, y


def test_restored_model_keeps_its_outlier_gate_and_counters() -> None:
    rng = np.random.default_rng(16)
    model = CostModel(warmup_passes=0)
    sched, y = _stalled_passes(rng, 5000)
    model.update_batch(sched, y, [("w", 0)] * 5000)
    model.update(ScheduledRequestMetrics(), 0.0)  # a heartbeat
    snapshot = json.loads(json.dumps(model.to_dict()))
    restored = CostModel.from_dict(snapshot)
    q, rq = model.quality, restored.quality
    assert rq.residual_scale == pytest.approx(q.residual_scale)
    assert (rq.outliers_rejected, rq.heartbeats_ignored) == (q.outliers_rejected, 1)
    assert rq.outliers_rejected > 100
    # Its very first pass after the restart is a stall: the gate is already up.
    stall = compositions(rng, 1)
    slow = step_times(rng, stall, 0.0) * 6.0
    restored.update_batch(stall, slow, [("w", 0)])
    assert restored.outliers_rejected == q.outliers_rejected + 1
    assert restored.samples == model.samples
    # A snapshot without the gate (an older version) would have learned it.
    del snapshot["state"]["residual_scale"]
    ungated = CostModel.from_dict(snapshot)
    ungated.update_batch(stall, slow, [("w", 0)])
    assert ungated.samples == model.samples + 1


def _row(prefill_tokens: float, decode_requests: float = 0.0) -> np.ndarray:
    """One composition: one prefill request of ``prefill_tokens``, plus decode requests."""
    return np.array([[1.0, prefill_tokens, 0.0, 0.0, decode_requests, 100 * decode_requests, 0.0]])


@pytest.mark.parametrize(
    ("tokens", "wall", "reason"),
    [
        (1e12, 0.010, "size"),  # beyond any engine
        (2e7, 0.5, "size"),
        (5e6, 0.010, "rate"),  # 5e8 tokens/s
        (5e5, 5.0, "budget"),  # plausible rate, but 80x this stream's largest pass
        (2e5, 0.010, "fast"),  # within every limit, 7000x faster than predicted
    ],
)
def test_implausible_pass_does_not_move_the_fit(tokens: float, wall: float, reason: str) -> None:
    model = trained(np.random.default_rng(17), n=5000)
    before = model.coefficients
    samples = model.samples
    model.update_batch(_row(tokens), [wall], [("w", 0)])
    assert model.coefficients == before
    assert model.samples == samples
    assert model.implausible_rejected == {reason: 1}
    assert model.to_dict()["quality"]["implausible_rejected"] == {reason: 1}


def test_without_plausibility_checks_one_hostile_pass_still_has_bounded_leverage() -> None:
    """Rows are least squares on log(time), weighted by the model's prediction: a pass
    7000x faster than predicted pulls like a log residual of -9, not like a 1/y^2
    weight of 7000^2 (which halved ``compute.tokens`` when weights were 1/y^2)."""
    model = trained(np.random.default_rng(17), n=5000, fast_factor=1e12, budget_factor=1e12)
    before = model.coefficients["compute.tokens"]
    model.update_batch(_row(2e5), [0.010], [("w", 0)])
    assert model.coefficients["compute.tokens"] == pytest.approx(before, rel=0.2)


def test_ready_needs_prefill_and_decode_passes() -> None:
    rng = np.random.default_rng(18)
    model = CostModel(warmup_passes=0)  # min_samples 200, so 20 of each regime
    decode = compositions(rng, 300, p_prefill=0.0)
    model.update_batch(decode, step_times(rng, decode, 0.05), [("w", 0)] * 300)
    assert model.samples >= model.min_samples
    assert not model.ready  # the prefill coefficients never saw a prompt
    assert not model.to_dict()["ready"]
    prefill = compositions(rng, 30, p_prefill=1.0, p_decode=0.0)
    model.update_batch(prefill, step_times(rng, prefill, 0.05), [("w", 0)] * 30)
    assert model.prefill_bearing_samples >= model.min_regime_samples
    assert model.ready
    # The requirement is configurable (0: samples alone, e.g. a prefill-only worker).
    lenient = CostModel(warmup_passes=0, min_regime_samples=0)
    lenient.update_batch(decode, step_times(rng, decode, 0.05), [("w", 0)] * 300)
    assert lenient.ready


def test_update_cost_is_amortised() -> None:
    """Fed one pass at a time, the O(window) robust scale and the O(buckets*d^2) solve
    run once per many samples, not per call (counted, not timed)."""
    rng = np.random.default_rng(19)
    model = trained(rng, n=5000)
    calls = {"scale": 0, "solve": 0}

    def counting(name: str, method: Callable[[], None]) -> Callable[[], None]:
        def wrapped() -> None:
            calls[name] += 1
            method()

        return wrapped

    model.gate._update = counting("scale", model.gate._update)  # type: ignore[method-assign]
    model.regression.solve = counting("solve", model.regression.solve)  # type: ignore[method-assign]
    n = 2048
    sched = compositions(rng, n)
    y = step_times(rng, sched, 0.05)
    preds = [model.update_batch(sched[i : i + 1], y[i : i + 1], [("w", 0)])[0] for i in range(n)]
    assert calls["scale"] <= n // model.gate.every + 1
    assert calls["solve"] <= n // 64 + 1  # the period is samples/64 (>= 78 here), up to 256
    # Still accurate prequentially, and a lazy solve brings the coefficients up to date.
    assert np.median(np.abs(np.array(preds) - y) / y) < 0.06
    model.coefficients  # noqa: B018 - solves if samples arrived since the last solve
    assert model.regression.since_solve == 0


def test_stream_state_evicts_the_least_recently_active() -> None:
    model = CostModel(warmup_passes=0, max_streams=2)
    pass_ = ScheduledRequestMetrics(num_decode_requests=4, sum_decode_kv_tokens=400)
    for stream in (("a", 0), ("b", 0), ("a", 0), ("c", 0)):
        model.update(pass_, 0.01, stream)
    assert set(model.stream_residuals()) == {("a", 0), ("c", 0)}


def test_stream_residuals_single_out_a_slow_pod() -> None:
    rng = np.random.default_rng(9)
    model = trained(rng, n=5000)
    sched = compositions(rng, 6000)
    y = step_times(rng, sched, 0.03)
    streams = [("pod", i % 3) for i in range(6000)]
    y[np.arange(6000) % 3 == 2] *= 1.3
    model.update_batch(sched, y, streams)
    res = model.stream_residuals()
    assert res[("pod", 2)]["mean_relative_residual"] > 0.15
    assert abs(res[("pod", 0)]["mean_relative_residual"]) < 0.1


def test_formula_names_features_in_milliseconds() -> None:
    model = trained(np.random.default_rng(10), n=3000, noise=0.01)
    formula = model.formula()
    assert formula.startswith("step_ms = ")
    intercept_ms = float(formula.removeprefix("step_ms = ").split(" + ")[0])
    assert intercept_ms == pytest.approx(4.0, rel=0.05)  # the true 4 ms
    assert "*tokens" in formula and "*decode_kv" in formula
    assert "max(" not in formula  # linear: no memory side, so no max


def test_attention_term_exact_for_single_request_and_equal_chunks() -> None:
    one = sched_matrix([ScheduledRequestMetrics(1, 300, 0.0, 1000, 0, 0, 0.0)])
    assert feature_matrix(one)[0, 2] == pytest.approx(300 * 1000 + 300**2 / 2)
    # Two requests of 100 and 300 whole prompts: sum c_i^2/2 = (100^2 + 300^2)/2.
    two = sched_matrix([ScheduledRequestMetrics(2, 400, 10000.0, 0, 0, 0, 0.0)])
    assert feature_matrix(two)[0, 2] == pytest.approx((100**2 + 300**2) / 2)
    # A huge prompt-length variance cannot push sum c_i^2 beyond C^2.
    clamped = sched_matrix([ScheduledRequestMetrics(2, 400, 1e9, 0, 0, 0, 0.0)])
    assert feature_matrix(clamped)[0, 2] == pytest.approx(400**2 / 2)


def test_predicts_hypothetical_batches() -> None:
    model = trained(np.random.default_rng(11), n=5000, noise=0.02)
    big = ScheduledRequestMetrics(num_decode_requests=200, sum_decode_kv_tokens=400_000)
    truth = float(truth_times(sched_matrix([big]))[0])
    assert model.predict(big) == pytest.approx(truth, rel=0.05)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_nnls_normal_matches_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(30, 5))
    b = rng.normal(size=30)
    ours = nnls_normal(a.T @ a, a.T @ b)
    # Warm-started on any support (a previous solution's), the answer is the same.
    warm = nnls_normal(a.T @ a, a.T @ b, support=rng.random(5) < 0.5)
    ref, _ = nnls(a, b)
    cost = lambda x: float(np.sum((a @ x - b) ** 2))  # noqa: E731
    for x in (ours, warm):
        assert (x >= 0).all()
        assert cost(x) <= cost(ref) + 1e-8 * max(1.0, cost(ref))


def test_runs_of_stalled_passes_do_not_open_the_gate() -> None:
    """Stalls come in runs (the OS gave the core away): long enough to dominate a short
    residual window. Here runs of 400 passes, 10-30x slow, a quarter of all passes,
    plus 5% partially stalled ones. The fit must stay on the engine's cost."""
    rng = np.random.default_rng(12)
    model = CostModel(warmup_passes=0)
    n = 30000
    sched = compositions(rng, n)
    y = step_times(rng, sched, 0.05)
    stalled = np.zeros(n, dtype=bool)
    for start in range(2000, n, 1500):
        stalled[start : start + 400] = True
    y[stalled] *= rng.uniform(10.0, 30.0, int(stalled.sum()))
    partial = ~stalled & (rng.random(n) < 0.05)
    y[partial] *= rng.uniform(1.3, 3.0, int(partial.sum()))
    preds = np.concatenate(
        [
            model.update_batch(sched[s : s + 16], y[s : s + 16], [("w", 0)] * 16)
            for s in range(0, n, 16)
        ]
    )
    assert rel_err(model, compositions(rng, 500)).mean() < 0.03
    # Prequentially too: on clean passes after the first run, median |error| near the noise.
    clean = ~stalled & ~partial & np.isfinite(preds)
    clean[:2000] = False
    ape = np.abs(preds[clean] - y[clean]) / y[clean]
    assert np.median(ape) < 0.06  # median |N(0, 0.05)| is 0.034


def test_follows_a_slower_engine_despite_a_long_half_life() -> None:
    """A slower engine first looks like a stall; once the long-window median shows the
    shift is persistent, the model forgets faster (drift) and follows."""
    rng = np.random.default_rng(14)
    model = trained(rng, n=10000)  # default half-life of 20,000 passes
    slower = scaled(
        {
            "intercept": 2.0,
            "prefill_requests": 2.0,
            "decode_requests": 2.0,
            "compute.tokens": 2.5,
            "compute.prefill_attention": 1.6,
            "compute.decode_kv_tokens": 3.0,
        }
    )
    for _ in range(10):
        sched = compositions(rng, 1000)
        model.update_batch(sched, step_times(rng, sched, 0.05, slower), [("w", 0)] * 1000)
    assert rel_err(model, compositions(rng, 500), slower).mean() < 0.05


def test_regime_requirement_survives_a_restart_and_follows_min_samples() -> None:
    explicit = CostModel(min_regime_samples=7).to_dict()
    assert CostModel.from_dict(explicit, min_samples=50).min_regime_samples == 7
    derived = CostModel().to_dict()  # a tenth of min_samples, re-derived on restore
    assert CostModel.from_dict(derived, min_samples=50).min_regime_samples == 5


# -- the simulator's H100 roofline ---------------------------------------------

H100 = H100_LLAMA_8B
# The profile's physics as coefficients (see simulator/ground_truth.py).
H100_COEF = {
    "intercept": H100.overhead_s,
    "prefill_requests": H100.per_request_s,
    "decode_requests": H100.per_request_s,
    "compute.tokens": 2.0 * H100.params / H100.flops_per_s,
    "compute.prefill_attention": 4.0 * H100.layers * H100.d_model / H100.flops_per_s,
    "compute.decode_kv_tokens": 4.0 * H100.layers * H100.d_model / H100.flops_per_s,
    "memory.intercept": H100.weight_bytes / H100.hbm_bytes_per_s,
    "memory.kv_read_tokens": H100.kv_bytes_per_token / H100.hbm_bytes_per_s,
    "memory.kv_write_tokens": H100.kv_bytes_per_token / H100.hbm_bytes_per_s,
}


def gpu_compositions(rng: np.random.Generator, n: int) -> np.ndarray:
    """Decode-only, mixed and prefill-only passes of a GPU engine: decode batches of 1-256
    at 64-8192 tokens of context, prefill chunks of 16-2048 tokens on 0-4096 cached."""
    rows = np.zeros((n, 7))
    kind = rng.random(n)
    has_p = kind >= 0.5
    has_d = kind < 0.85
    n_pre = np.where(has_p, rng.integers(1, 4, n), 0)
    chunk = np.exp(rng.uniform(np.log(16), np.log(2048), n)).round()
    rows[:, 0] = n_pre
    rows[:, 1] = np.where(has_p, chunk, 0.0)
    rows[:, 3] = np.where(has_p, rng.integers(0, 4096, n) * n_pre, 0.0)
    n_dec = np.where(has_d, np.exp(rng.uniform(0.0, np.log(256), n)).round(), 0.0)
    rows[:, 4] = n_dec
    rows[:, 5] = n_dec * np.exp(rng.uniform(np.log(64), np.log(8192), n)).round()
    return rows


def h100_times(sched: np.ndarray) -> np.ndarray:
    # Equal chunks (variance 0): the model's prefill attention is then the profile's.
    return np.array([H100.mean_time(r[1], r[3], r[0], r[4], r[5]) for r in sched])


def steady_grid() -> np.ndarray:
    """Steady-state mixed batches (a prefill chunk beside a decode batch) and decode batches."""
    rows = [
        [1, p, 0, 0, dq, dq * ctx, 0]
        for p in (0, 256, 512, 1024, 2048, 4096, 8192)
        for dq in (1, 8, 32, 64, 128, 256)
        for ctx in (500, 1500, 4000)
    ]
    grid = np.array(rows, dtype=np.float64)
    grid[grid[:, 1] == 0, 0] = 0  # no prefill request without prefill tokens
    return grid


@pytest.fixture(scope="module")
def h100_model() -> CostModel:
    rng = np.random.default_rng(21)
    model = CostModel(warmup_passes=0)
    n = 30000
    sched = gpu_compositions(rng, n)
    y = h100_times(sched) * np.exp(rng.normal(0.0, H100.noise_sigma, n))
    for s in range(0, n, 64):  # in small batches, as the ingest pipeline feeds it
        model.update_batch(sched[s : s + 64], y[s : s + 64], [("gpu", 0)] * len(y[s : s + 64]))
    return model


def test_recovers_the_h100_roofline(h100_model: CostModel) -> None:
    """The simulator's ground truth is a roofline; its physics comes back.

    Stated tolerances, for what the passes identify (the worst of seeds 21-26 in
    brackets): the GEMM cost per token, the weight read and the KV read per token within
    1% (0.6%), prefill attention and the per-decode-request host cost within 5% (3%,
    0.9%), the fixed overhead within 5% (3.9%). Not identified, so not asserted beyond
    >= 0: the 10 us per prefill request (beside a 2-70 ms prefill pass; off by up to
    35%), decode attention FLOPs (1 ns per context token, a few % of the compute-bound
    passes; up to 58%) and the KV write of prompt tokens (memory-bound passes that
    compute prompt tokens compute few).
    """
    model = h100_model
    assert model.ready and model.roofline_active
    coef, se = model.coefficients, model.std_errors
    tolerance = {
        "compute.tokens": 0.01,
        "memory.intercept": 0.01,
        "memory.kv_read_tokens": 0.01,
        "compute.prefill_attention": 0.05,
        "decode_requests": 0.05,
        "intercept": 0.05,
    }
    for name, rel in tolerance.items():
        assert coef[name] == pytest.approx(H100_COEF[name], rel=rel), name
        assert math.isfinite(se[name]) and se[name] > 0, name
    assert all(v >= 0.0 for v in coef.values())
    formula = model.formula()
    assert "+ max(" in formula and "*tokens" in formula and "*kv_read" in formula


def test_predicts_the_h100_steady_grid_within_2_percent(h100_model: CostModel) -> None:
    """Steady-state mixed and decode batches (where the linear model was ~15% off, up to
    57%): every one within 2% of the profile's noise-free time (0.6% at worst measured)."""
    grid = steady_grid()
    err = np.abs(h100_model.predict_many(grid) / h100_times(grid) - 1.0)
    assert err.max() < 0.02, err.max()
    # And prequentially the error is the 3% noise: median |N(0, 0.03)| = 2.0%.
    assert h100_model.quality.median_ape < 0.025


def test_linear_model_misses_the_h100_roofline(h100_model: CostModel) -> None:
    """Why the roofline: the best linear fit (NNLS, relative error) of the same passes is
    far off somewhere on the steady grid."""
    rng = np.random.default_rng(22)
    sched = gpu_compositions(rng, 20000)
    y = h100_times(sched)
    x = feature_matrix(sched)[:, :6] / np.array([1, 1e3, 1e6, 1, 1e2, 1e5])
    w = 1.0 / y**2
    gram = (x * w[:, None]).T @ x
    coef = nnls_normal(gram + np.eye(6) * 1e-9 * np.trace(gram), x.T @ (w * y))
    grid = steady_grid()
    xg = feature_matrix(grid)[:, :6] / np.array([1, 1e3, 1e6, 1, 1e2, 1e5])
    linear_err = np.abs(xg @ coef / h100_times(grid) - 1.0)
    roof_err = np.abs(h100_model.predict_many(grid) / h100_times(grid) - 1.0)
    assert linear_err.max() > 0.15 > 10 * roof_err.max()


def test_roofline_snapshot_round_trip(h100_model: CostModel) -> None:
    snapshot = json.loads(json.dumps(h100_model.to_dict()))
    assert len(json.dumps(snapshot)) < 8000
    restored = CostModel.from_dict(snapshot)
    grid = steady_grid()
    np.testing.assert_allclose(
        restored.predict_many(grid), h100_model.predict_many(grid), rtol=1e-6
    )
    assert restored.roofline_active and restored.formula() == h100_model.formula()
    # It keeps learning: new buckets start on the side the restored roofline says.
    rng = np.random.default_rng(23)
    sched = gpu_compositions(rng, 5000)
    restored.update_batch(sched, h100_times(sched), [("gpu", 0)] * 5000)
    err = np.abs(restored.predict_many(grid) / h100_times(grid) - 1.0)
    assert restored.roofline_active and err.max() < 0.02


def test_each_pass_is_predicted_on_its_larger_side(h100_model: CostModel) -> None:
    coef = h100_model.coefficients
    small = sched_matrix(
        [ScheduledRequestMetrics(num_decode_requests=4, sum_decode_kv_tokens=4000)]
    )
    big = sched_matrix([ScheduledRequestMetrics(1, 2048, 0.0, 0, 16, 16000, 0.0)])
    base_small = coef["intercept"] + 4 * coef["decode_requests"]
    memory_small = coef["memory.intercept"] + 4000 * coef["memory.kv_read_tokens"]
    # The fit alone: the recent offsets (tested on their own) scale what it says.
    fit = h100_model.predict_many(small, recent_offsets=False)[0]
    assert fit == pytest.approx(base_small + memory_small)
    compute_big = (
        2064 * coef["compute.tokens"]
        + (2048**2 / 2) * coef["compute.prefill_attention"]
        + 16000 * coef["compute.decode_kv_tokens"]
    )
    base_big = coef["intercept"] + coef["prefill_requests"] + 16 * coef["decode_requests"]
    fit = h100_model.predict_many(big, recent_offsets=False)[0]
    assert fit == pytest.approx(base_big + compute_big)
