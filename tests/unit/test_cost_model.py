"""CostModel against synthetic ground truth whose coefficients are known.

Ground truth is the model's own functional form (so recovery is testable) with
multiplicative log-normal noise. Tolerances are stated per test.
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
    FEATURE_NAMES,
    CostModel,
    feature_matrix,
    nnls_normal,
    sched_matrix,
)

TRUE = {
    "intercept": 4e-3,
    "prefill_tokens": 2e-5,
    "prefill_attention": 3e-9,
    "prefill_requests": 5e-4,
    "decode_requests": 1e-4,
    "decode_kv_tokens": 2e-7,
}
TRUE_VEC = np.array([TRUE[name] for name in FEATURE_NAMES])


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
    return (feature_matrix(sched) @ coef) * np.exp(rng.normal(0.0, noise, sched.shape[0]))


def trained(
    rng: np.random.Generator, n: int = 20000, noise: float = 0.05, **kw: float
) -> CostModel:
    model = CostModel(warmup_passes=0, **kw)
    sched = compositions(rng, n)
    model.update_batch(sched, step_times(rng, sched, noise), [("w", 0)] * n)
    return model


def rel_err(model: CostModel, sched: np.ndarray, coef: np.ndarray = TRUE_VEC) -> np.ndarray:
    truth = feature_matrix(sched) @ coef
    return np.abs(model.predict_many(sched) - truth) / truth


def test_recovers_true_coefficients_within_10_percent() -> None:
    model = trained(np.random.default_rng(1))
    coef = model.coefficients
    se = model.std_errors
    for name, true in TRUE.items():
        assert coef[name] == pytest.approx(true, rel=0.10), name
        # The reported standard errors are honest: truth within 4 of them.
        assert abs(coef[name] - true) <= 4 * se[name] + 1e-15, name
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
    assert all(v > 0 and math.isfinite(v) for v in q.std_errors.values())


def test_coefficients_never_negative() -> None:
    rng = np.random.default_rng(3)
    truth = TRUE_VEC.copy()
    truth[4] = 0.0  # decode requests cost nothing: unconstrained OLS goes negative half the time
    truth[3] = 0.0
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
    faster_gpu = TRUE_VEC * np.array([0.5, 0.4, 0.6, 0.5, 0.5, 0.3])
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
    assert [c["name"] for c in snapshot["coefficients"]] == list(FEATURE_NAMES)
    assert snapshot["coefficients"][1]["unit"] == "s/token"
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
        ("state.gram", [[math.nan] * 6] * 6, "state.gram"),
        ("state.gram", [[1.0] * 6] * 5, "state.gram"),
        ("state.gram", "not a matrix", "state.gram"),
        ("state.xty", [0.0] * 5, "state.xty"),
        ("state.xty", [0.0] * 5 + [math.inf], "state.xty"),
        ("state.scales", [1.0, "x", 1.0, 1.0, 1.0, 1.0], "state.scales"),
        ("state.scales", [1.0, 0.0, 1.0, 1.0, 1.0, 1.0], "state.scales"),
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


def test_without_plausibility_checks_one_hostile_pass_wrecks_the_fit() -> None:
    """Why the checks exist (and why the test above can fail): 1/y^2 weighting gives a
    very fast pass enormous leverage, and a one-sided gate never rejects it."""
    model = trained(np.random.default_rng(17), n=5000, fast_factor=1e12, budget_factor=1e12)
    before = model.coefficients["prefill_tokens"]
    model.update_batch(_row(2e5), [0.010], [("w", 0)])
    assert model.coefficients["prefill_tokens"] < 0.5 * before


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

    model._update_robust_scale = counting("scale", model._update_robust_scale)  # type: ignore[method-assign]
    model._solve = counting("solve", model._solve)  # type: ignore[method-assign]
    n = 2048
    sched = compositions(rng, n)
    y = step_times(rng, sched, 0.05)
    preds = [model.update_batch(sched[i : i + 1], y[i : i + 1], [("w", 0)])[0] for i in range(n)]
    assert calls["scale"] <= n // model.robust_every + 1
    assert calls["solve"] <= n // 64 + 1  # the period is samples/64 (>= 78 here), up to 256
    # Still accurate prequentially, and a lazy solve brings the coefficients up to date.
    assert np.median(np.abs(np.array(preds) - y) / y) < 0.06
    model.coefficients  # noqa: B018 - solves if samples arrived since the last solve
    assert model._since_solve == 0


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
    assert "*prefill_tok" in formula and "*decode_kv" in formula


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
    truth = float(feature_matrix(sched_matrix([big]))[0] @ TRUE_VEC)
    assert model.predict(big) == pytest.approx(truth, rel=0.05)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_nnls_normal_matches_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(30, 5))
    b = rng.normal(size=30)
    ours = nnls_normal(a.T @ a, a.T @ b)
    ref, _ = nnls(a, b)
    assert (ours >= 0).all()
    cost = lambda x: float(np.sum((a @ x - b) ** 2))  # noqa: E731
    assert cost(ours) <= cost(ref) + 1e-8 * max(1.0, cost(ref))


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
    slower = TRUE_VEC * np.array([2.0, 2.5, 1.6, 2.0, 2.0, 3.0])
    for _ in range(10):
        sched = compositions(rng, 1000)
        model.update_batch(sched, step_times(rng, sched, 0.05, slower), [("w", 0)] * 1000)
    assert rel_err(model, compositions(rng, 500), slower).mean() < 0.05


def test_regime_requirement_survives_a_restart_and_follows_min_samples() -> None:
    explicit = CostModel(min_regime_samples=7).to_dict()
    assert CostModel.from_dict(explicit, min_samples=50).min_regime_samples == 7
    derived = CostModel().to_dict()  # a tenth of min_samples, re-derived on restore
    assert CostModel.from_dict(derived, min_samples=50).min_regime_samples == 5
