"""Recent offsets: the machine's and each regime's recent error against the current fit.

Synthetic streams from the unit tests' known step-time function (5% log-normal
noise). What is checked: the trailing medians are exact; the offsets are taken
against the fit that predicts now, and clipped; a machine that becomes 12% slower is followed
within a few dozen passes (the regression alone, with its long memory, stays
low); a stall run does not make the passes after it predicted high; the offsets
survive a snapshot and show on status.
"""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_operator.controller.status import cost_model_status
from stepscale_operator.cost_model import CostModel
from stepscale_operator.cost_model.recent_offsets import RecentOffsets, trailing_medians
from stepscale_operator.cost_model.regime_residuals import regime_cells
from tests.unit.test_cost_model import compositions, step_times


def _naive(history: np.ndarray, values: np.ndarray, window: int, minimum: int) -> np.ndarray:
    series = np.concatenate([history, values])
    out = []
    for i in range(values.shape[0] + 1):
        before = series[: history.shape[0] + i][-window:]
        out.append(float(np.median(before)) if before.shape[0] >= minimum else np.nan)
    return np.array(out)


@pytest.mark.parametrize("window", [31, 32])
@pytest.mark.parametrize("history_len", [0, 5, 40])
def test_trailing_medians_use_only_the_values_before_each(history_len: int, window: int) -> None:
    rng = np.random.default_rng(history_len)
    history, values = rng.normal(size=history_len), rng.normal(size=57)
    got = trailing_medians(history, values, window, minimum=16)
    np.testing.assert_allclose(got, _naive(history, values, window, 16), equal_nan=True)


def test_offsets_are_taken_against_the_fit_that_predicts_now() -> None:
    rng = np.random.default_rng(3)
    rows = compositions(rng, 600)
    cells = regime_cells(rows)
    fit = 1e-3 + rows[:, 4] * 1e-5  # any fit: the offsets are relative to it
    # The machine runs 10% above the fit; prefill-bearing passes 15% more on top.
    truth = fit * 1.1 * np.where(cells == 0, 1.15, 1.0) * np.exp(rng.normal(0, 0.02, 600))
    offsets = RecentOffsets()
    offsets.add(rows, truth, cells)

    def fit_of(scale: float):  # noqa: ANN202 - a fit as the model hands it over
        return lambda sched: scale * (1e-3 + sched[:, 4] * 1e-5)

    offsets.refresh(fit_of(1.0), np.array([1.0]))
    factors = offsets.factors()
    machine_share = float(np.mean(cells[-32:] == 0))  # the machine's window mixes regimes
    assert factors["machine"] == pytest.approx(1.1 * 1.15**machine_share, rel=0.04)
    assert factors["machine"] * factors["prefill"] == pytest.approx(1.1 * 1.15, rel=0.03)
    assert factors["machine"] * factors["decode"] == pytest.approx(1.1, rel=0.03)
    # The fit learned the machine's 10%: the offsets are re-taken, not added to it.
    offsets.refresh(fit_of(1.1), np.array([1.1]))
    factors = offsets.factors()
    assert factors["machine"] * factors["decode"] == pytest.approx(1.0, abs=0.03)
    assert factors["machine"] * factors["prefill"] == pytest.approx(1.15, rel=0.03)


def test_offsets_are_clipped() -> None:
    rng = np.random.default_rng(4)
    rows = compositions(rng, 200)
    offsets = RecentOffsets(max_factor=1.2)
    offsets.add(rows, np.full(200, 20.0), regime_cells(rows))  # a stall: 20 s passes
    offsets.refresh(lambda sched: np.ones(sched.shape[0]), np.array([1.0]))
    assert offsets.factors()["machine"] == pytest.approx(1.2)


def _prequential(model: CostModel, sched: np.ndarray, wall: np.ndarray) -> np.ndarray:
    preds = np.full(wall.shape[0], np.nan)
    for s in range(0, wall.shape[0], 16):
        e = min(s + 16, wall.shape[0])
        preds[s:e] = model.update_batch(sched[s:e], wall[s:e], [("w", 0)] * (e - s))
    return preds


def test_a_machine_that_slows_down_is_followed_within_a_few_dozen_passes() -> None:
    rng = np.random.default_rng(5)
    sched = compositions(rng, 12000)
    wall = step_times(rng, sched, 0.05)
    wall[10000:] *= 1.12  # the machine is 12% slower from here (a clock, a neighbour)
    signed = {}
    for name, factor in (("offsets", 1.2), ("fit alone", 1.0)):
        preds = _prequential(CostModel(warmup_passes=0, offset_max_factor=factor), sched, wall)
        late = slice(10100, 12000)
        signed[name] = float(np.median((preds[late] - wall[late]) / wall[late]))
    assert abs(signed["offsets"]) < 0.02, signed
    assert signed["fit alone"] < -0.05, signed  # the long memory still predicts the old speed


def test_a_stall_run_does_not_make_the_passes_after_it_predicted_high() -> None:
    rng = np.random.default_rng(6)
    sched = compositions(rng, 8000)
    wall = step_times(rng, sched, 0.05)
    wall[6000:6040] *= 20.0  # 40 passes stalled 20x
    model = CostModel(warmup_passes=0)
    preds = _prequential(model, sched, wall)
    after = slice(6040, 6100)
    signed = (preds[after] - wall[after]) / wall[after]
    assert float(np.max(signed)) < 0.2 + 0.25  # at most the clip, plus the noise
    assert float(np.median(signed[-20:])) < 0.1  # and back within 20 passes


def test_offsets_survive_a_snapshot_and_show_on_status() -> None:
    rng = np.random.default_rng(7)
    sched = compositions(rng, 5200)
    wall = step_times(rng, sched, 0.05)
    wall[5000:] *= 1.1  # the last 200 passes on a machine 10% slower than learned
    model = CostModel(warmup_passes=0)
    model.update_batch(sched[:5000], wall[:5000], [("w", 0)] * 5000)
    model.update_batch(sched[5000:], wall[5000:], [("w", 0)] * 200)
    probe = compositions(rng, 50)
    before = model.predict_many(probe)
    factors = model.quality.recent_factors
    assert factors["machine"] == pytest.approx(1.1, abs=0.04)
    restored = CostModel.from_dict(model.to_dict())
    assert restored.quality.recent_factors == pytest.approx(factors)
    np.testing.assert_allclose(restored.predict_many(probe), before, rtol=1e-9)
    status = cost_model_status(model.to_dict())
    assert set(status["recentFactors"]) == {"machine", "prefill", "smallDecode", "decode"}
    assert status["recentFactors"]["machine"] == pytest.approx(factors["machine"], abs=1e-4)


@pytest.mark.parametrize(("slower", "applied"), [(1.015, False), (1.1, True)])
def test_the_planner_leaves_out_offsets_within_the_models_tolerance(
    slower: float, applied: bool
) -> None:
    rng = np.random.default_rng(8)
    sched = compositions(rng, 5100)
    wall = step_times(rng, sched, 0.01)
    wall[5000:] *= slower
    model = CostModel(warmup_passes=0)
    model.update_batch(sched[:5000], wall[:5000], [("w", 0)] * 5000)
    model.update_batch(sched[5000:], wall[5000:], [("w", 0)] * 100)
    probe = compositions(rng, 20)
    fit = model.predict_many(probe, recent_offsets=False)
    planned = model.predict_many(probe)
    # The status says what the passes show either way.
    assert model.quality.recent_factors["machine"] == pytest.approx(slower, abs=0.01)
    if applied:
        np.testing.assert_allclose(planned / fit, slower, atol=0.02)
    else:
        np.testing.assert_allclose(planned, fit)
