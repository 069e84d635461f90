"""Unbiased per regime: a change in the rare (prefill) regime is followed.

A synthetic stream from a known step-time function with 5% log-normal noise; one
pass in 20 computes prompt tokens. After 2,000 passes the engine's prefill cost
changes (x0.5: prefix caching or a faster kernel; x1.6: a slower one) while decode
stays as it was. The median of all residuals hardly moves (decode passes are 95%
of them), so the global drift test does not fire, and the coverage floors keep the
prefill buckets' old passes. Without the per-regime staleness test
(:mod:`stepscale_operator.cost_model.regime_residuals`) prefill passes stayed
20-24% off at the median 4,000 passes after the change (measured when written,
four seeds); with it, within 2.3%.
"""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.cost_model import CostModel, sched_matrix
from stepscale_operator.cost_model.recent_offsets import RecentOffsets
from stepscale_operator.cost_model.regime_residuals import (
    BUCKET_CELLS,
    CELLS,
    RegimeResiduals,
    regime_cells,
)

CHANGE_AT = 2000
PASSES = 8000


def _stream(prefill_factor: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Compositions and wall times; prefill cost times ``prefill_factor`` from CHANGE_AT."""
    rng = np.random.default_rng(seed)
    scheds, walls = [], []
    for i in range(PASSES):
        n_dec = int(rng.integers(1, 48))
        ctx = rng.integers(64, 2048, n_dec)
        prefill = rng.random() < 1.0 / 20
        n_pre = int(rng.integers(1, 3)) if prefill else 0
        tokens = int(rng.integers(32, 512)) if prefill else 0
        factor = prefill_factor if i >= CHANGE_AT else 1.0
        t = 2e-3 + factor * (4e-3 * n_pre + 2e-5 * tokens) + 5e-5 * n_dec + 2e-7 * ctx.sum()
        walls.append(t * float(np.exp(rng.normal(0.0, 0.05))))
        scheds.append(
            ScheduledRequestMetrics(
                num_prefill_requests=n_pre,
                sum_prefill_tokens=tokens,
                num_decode_requests=n_dec,
                sum_decode_kv_tokens=int(ctx.sum()),
                var_decode_kv_tokens=float(ctx.var()),
            )
        )
    return sched_matrix(scheds), np.array(walls)


def _prequential(model: CostModel, sched: np.ndarray, wall: np.ndarray) -> np.ndarray:
    preds = np.full(wall.shape[0], np.nan)
    for s in range(0, wall.shape[0], 16):
        e = min(s + 16, wall.shape[0])
        preds[s:e] = model.update_batch(sched[s:e], wall[s:e], [("pod", 0)] * (e - s), range(s, e))
    return preds


@pytest.mark.parametrize("prefill_factor", [0.5, 1.6])
@pytest.mark.parametrize("seed", [0, 1])
def test_median_signed_error_per_regime_after_a_prefill_change(
    prefill_factor: float, seed: int
) -> None:
    sched, wall = _stream(prefill_factor, seed)
    preds = _prequential(CostModel(), sched, wall)
    signed = (preds - wall) / wall
    late = np.arange(wall.shape[0]) >= PASSES - 2000
    prefill = sched[:, 1] > 0
    assert np.isfinite(signed[late]).all()
    assert (late & prefill).sum() >= 80
    assert abs(float(np.median(signed[late & prefill]))) < 0.03
    assert abs(float(np.median(signed[late & ~prefill]))) < 0.03


def test_without_the_staleness_test_the_prefill_regime_stays_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same stream with no bucket ever stale: the test above can fail. (The
    recent offsets are held at zero too: within their clip they would hide it.)"""
    monkeypatch.setattr(
        RegimeResiduals,
        "stale_buckets",
        lambda self, tolerance: np.zeros(BUCKET_CELLS.shape[0], dtype=bool),
    )
    monkeypatch.setattr(RecentOffsets, "current", lambda self, cells: np.zeros(cells.shape))
    sched, wall = _stream(0.5, 0)
    preds = _prequential(CostModel(), sched, wall)
    signed = (preds - wall) / wall
    late = (np.arange(wall.shape[0]) >= PASSES - 2000) & (sched[:, 1] > 0)
    assert float(np.median(signed[late])) > 0.1  # predicted the old, slower prefill


def test_regime_residuals_mark_only_the_cell_that_is_off() -> None:
    rows = np.zeros((3, 7))
    rows[0, 1] = 100.0  # prefill tokens
    rows[1, 4] = 2.0  # two decodes
    rows[2, 4] = 40.0
    cells = regime_cells(rows)
    assert [CELLS[c] for c in cells] == ["prefill", "small_decode", "decode"]
    residuals = RegimeResiduals(window=100, min_residuals=50)
    for _ in range(60):
        residuals.push(cells, np.array([-0.3, 0.01, -0.01]))
    assert residuals.stale_cells(0.03).tolist() == [True, False, False]
    stale = residuals.stale_buckets(0.03)
    assert stale[BUCKET_CELLS == 0].all() and not stale[BUCKET_CELLS != 0].any()
    # A few slow prefill passes do not reach the median of a full window.
    fresh = RegimeResiduals(window=100, min_residuals=50)
    fresh.push(np.zeros(40, dtype=np.int64), np.full(40, 0.5))
    assert not fresh.stale_cells(0.03).any()
