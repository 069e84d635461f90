"""Per-regime residuals: is the fit off in one regime while the others are fine?

Prefill-bearing passes are rare (one in five to one in fifty on the recordings), so
the coverage buckets that hold them are rarely visited, and the coverage floors
keep what those buckets learned from fading with time. When the fit is wrong there
the global drift test cannot see it, as decode-only passes outnumber the others
and set the median of all residuals. Seen on a real recording: the machine ran
50-80x slow for the first hundred passes; the decode buckets soon forgot them, the
prefill buckets held them for the rest of the run, and prefill passes were
predicted 51% high at the median.

So the prequential log residuals ``log(actual / predicted)`` are also kept per
regime cell (:data:`CELLS`: prefill-bearing, decode-only of 1-3 requests,
larger decode-only batches), the last ``window`` of each. A cell whose median is
off by more than the tolerance the model allows (the gate's ``drift_floor``, 3%)
is *stale*: its buckets forget at the drift half-life with their floors suspended
(:attr:`~stepscale_operator.cost_model.regression.Regression.stale`), as the whole
model does when it drifts, until new passes of that regime put it right. The
median is over at least ``min_residuals`` residuals, so a handful of slow passes
is not enough.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from stepscale_operator.cost_model.features import D_BINS, K_BINS, N_BUCKETS, FloatArray
from stepscale_operator.pass_columns import SCHED_DECODE_REQS, SCHED_PREFILL_TOKENS

# Prefill-bearing passes; decode-only passes of 1-3 requests (where host overhead,
# not arithmetic, sets the time); larger decode-only batches. The decode split is
# the buckets' own first decode bin (log4: 1-3 requests), so a bucket is in one cell.
CELLS = ("prefill", "small_decode", "decode")
SMALL_DECODE_MAX = 3
NO_CELL = -1  # an empty pass (no prefill tokens, no decodes), and the prior bucket


def regime_cells(sched: FloatArray) -> npt.NDArray[np.int64]:
    """Index into :data:`CELLS` of each row of an (n, 7) composition matrix."""
    prefill = sched[:, SCHED_PREFILL_TOKENS] > 0
    decodes = sched[:, SCHED_DECODE_REQS]
    decode_cell = np.where(decodes <= SMALL_DECODE_MAX, 1, 2)
    return np.where(prefill, 0, np.where(decodes > 0, decode_cell, NO_CELL)).astype(np.int64)


def bucket_cells() -> npt.NDArray[np.int64]:
    """Cell of every coverage bucket, the prior bucket last (:data:`NO_CELL`)."""
    bucket = np.arange(N_BUCKETS)
    prefill_bin = bucket // (D_BINS * K_BINS)
    decode_bin = (bucket // K_BINS) % D_BINS
    decode_cell = np.where(decode_bin == 1, 1, 2)
    cells = np.where(prefill_bin > 0, 0, np.where(decode_bin > 0, decode_cell, NO_CELL))
    return np.append(cells, NO_CELL).astype(np.int64)


BUCKET_CELLS = bucket_cells()


class RegimeResiduals:
    """The last ``window`` prequential log residuals of each cell, and their medians."""

    def __init__(self, window: int = 100, min_residuals: int = 50) -> None:
        self.window = max(1, int(window))
        self.min_residuals = max(1, min(int(min_residuals), self.window))
        n = len(CELLS)
        self._rings = np.zeros((n, self.window))
        self._length = np.zeros(n, dtype=np.int64)
        self._pos = np.zeros(n, dtype=np.int64)
        self.median = np.full(n, np.nan)  # NaN: fewer than min_residuals yet

    def emptied(self) -> RegimeResiduals:
        """The same settings, no residuals."""
        return RegimeResiduals(self.window, self.min_residuals)

    def push(self, cells: npt.NDArray[np.int64], log_res: FloatArray) -> None:
        """Residuals ``log(actual / predicted)`` of passes just scored, in arrival order.
        O(window) per cell present."""
        ok = (cells >= 0) & np.isfinite(log_res)
        for c in np.unique(cells[ok]):
            values = log_res[ok & (cells == c)][-self.window :]
            k = values.shape[0]
            idx = (self._pos[c] + np.arange(k)) % self.window
            self._rings[c, idx] = values
            self._pos[c] = (self._pos[c] + k) % self.window
            self._length[c] = min(self.window, self._length[c] + k)
            if self._length[c] >= self.min_residuals:
                self.median[c] = float(np.median(self._rings[c, : self._length[c]]))

    def stale_cells(self, tolerance: float) -> npt.NDArray[np.bool_]:
        """Cells whose recent median log residual is beyond ``tolerance``."""
        return np.asarray(np.nan_to_num(np.abs(self.median), nan=0.0) > tolerance)

    def stale_buckets(self, tolerance: float) -> npt.NDArray[np.bool_]:
        """Per coverage bucket (the prior bucket last, never stale): in a stale cell."""
        stale = self.stale_cells(tolerance)
        return np.asarray((BUCKET_CELLS >= 0) & stale[np.maximum(BUCKET_CELLS, 0)])
