"""Recent offsets: the machine's and each regime's recent error, applied prequentially.

Synthetic streams from the unit tests' known step-time function (5% log-normal
noise). What is checked: the trailing medians are exact and use only earlier
passes whatever the batch size; a machine that becomes 12% slower is followed
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


def _stream(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cells = rng.integers(-1, 3, n)
    log_res = rng.normal(0.05, 0.1, n) + np.where(cells == 0, 0.08, 0.0)
    informative = rng.random(n) > 0.1
    return cells, log_res, informative


def test_offsets_do_not_depend_on_the_batch_size() -> None:
    rng = np.random.default_rng(3)
    cells, log_res, informative = _stream(rng, 3000)
    results = []
    for batch in (1, 16, 3000):
        offsets = RecentOffsets(max_age=10**9)  # the age is checked per batch: not here
        parts = [
            offsets.apply(cells[s : s + batch], log_res[s : s + batch], informative[s : s + batch])
            for s in range(0, 3000, batch)
        ]
        results.append(np.concatenate(parts))
    np.testing.assert_allclose(results[0], results[1])
    np.testing.assert_allclose(results[0], results[2])
    # It learned the machine's +5% and the prefill regime's further +8%.
    assert results[0][-1000:][cells[-1000:] == 0].mean() == pytest.approx(0.13, abs=0.03)
    assert results[0][-1000:][cells[-1000:] == 2].mean() == pytest.approx(0.05, abs=0.03)


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
    sched = compositions(rng, 6000)
    wall = step_times(rng, sched, 0.05) * 1.1  # all of it 10% above the fit's first guess
    model = CostModel(warmup_passes=0)
    model.update_batch(sched[:5000], wall[:5000] / 1.1, [("w", 0)] * 5000)
    model.update_batch(sched[5000:], wall[5000:], [("w", 0)] * 1000)
    factors = model.quality.recent_factors
    assert factors["machine"] > 1.05
    restored = CostModel.from_dict(model.to_dict())
    assert restored.quality.recent_factors == pytest.approx(factors)
    np.testing.assert_allclose(restored.predict_many(sched[:50]), model.predict_many(sched[:50]))
    status = cost_model_status(model.to_dict())
    assert set(status["recentFactors"]) == {"machine", "prefill", "smallDecode", "decode"}
    assert status["recentFactors"]["machine"] == pytest.approx(factors["machine"], abs=1e-4)
