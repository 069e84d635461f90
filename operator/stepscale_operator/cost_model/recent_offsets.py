"""Recent offsets: how far the fit is off on the latest passes, for the machine and
per regime.

The regression learns batch composition with a long memory (a 20,000-pass
half-life), and it should: a composition seen an hour ago costs the same now. But
what a pass costs also moves with the machine (clock, other tenants, memory
pressure) over tens to hundreds of passes, and a regime that is rarely visited
(prefill-bearing passes are one in five to one in fifty) keeps an offset the
shared coefficients cannot remove. Measured on the repository's recordings, the
same work done at other moments is -13% to +12% off tenth by tenth of a recording,
and the fit's median signed error per regime was -6% to +5% on the quiet ones.

So every prediction, the planner's and the prequential one, is multiplied by
``exp(machine + regime[cell])``, medians of log residuals ``log(actual / fit)``
of the latest ``keep`` informative passes, taken against the fit that predicts now
(:meth:`RecentOffsets.refresh`, whenever the fit or the passes changed):

* ``machine``: the median over the last ``machine_window`` of them, every regime
  and stream together (the fleet's recent speed against the fit);
* ``regime[cell]``: the median over the last ``regime_window`` passes of that cell
  (:data:`~.regime_residuals.CELLS`) of what is left after the machine's offset
  at each pass's time (the trailing median of the ``machine_window`` before it).

Taking them against the current fit matters: offsets measured against an older fit
would add to what the fit has since learned (measured: after an engine 2-3x
faster, learned in one batch, offsets kept from before the last solve were 4-18%
off). Each offset is clipped to ``+-log(max_factor)``: they follow a machine that
drifts, not a stall (a run of passes slowed 10-30x, seen on a contended machine,
would otherwise set the median for as long as it lasts). Stalls are the admission
gate's (:mod:`.admission`). Every pass of a batch gets the offsets as of the
batch's start, so they are prequential. The planner's predictions
(:meth:`~.model.CostModel.predict_many`) leave out an offset within the model's
3% tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from stepscale_operator.cost_model.features import FloatArray
from stepscale_operator.cost_model.regime_residuals import CELLS
from stepscale_operator.pass_columns import SCHED_FIELDS

Fit = Callable[[FloatArray], FloatArray]
"""The fit's predicted times of an (n, 7) composition matrix."""


def row_medians(rows: FloatArray) -> FloatArray:
    """Median of each row of an (m, w) array (``np.median`` on a strided view of
    windows took 20x as long as this one partition)."""
    k = rows.shape[1] // 2
    part = np.partition(rows, k, axis=1)
    if rows.shape[1] % 2:
        return np.asarray(part[:, k])
    # The lower middle is the largest of the lower half (one partition, not two).
    return np.asarray(0.5 * (part[:, :k].max(axis=1) + part[:, k]))


def trailing_medians(
    history: FloatArray, values: FloatArray, window: int, minimum: int
) -> FloatArray:
    """Median of the ``window`` values before each position of ``values`` (``history``
    comes first, oldest first); NaN where fewer than ``minimum`` precede it.

    Returns ``len(values) + 1`` medians: the last one is the median after all of
    them, the state for the next batch.
    """
    series = np.concatenate([history[-window:], values])
    h = series.shape[0] - values.shape[0]
    ends = h + np.arange(values.shape[0] + 1)  # the window of position i ends before ends[i]
    out = np.full(ends.shape[0], np.nan)
    full = ends >= window
    if full.any():
        windows = np.lib.stride_tricks.sliding_window_view(series, window)
        out[full] = row_medians(windows[ends[full] - window])
    for i in np.flatnonzero(~full & (ends >= minimum)):
        out[i] = float(np.median(series[: ends[i]]))
    return out


class RecentOffsets:
    """The machine's and each regime's offset from the current fit on recent passes."""

    def __init__(
        self,
        machine_window: int = 32,
        regime_window: int = 100,
        max_factor: float = 1.2,
        min_residuals: int = 16,
        keep: int = 1000,
    ) -> None:
        if max_factor < 1.0:
            raise ValueError("max_factor must be at least 1")
        self.machine_window = max(1, int(machine_window))
        self.regime_window = max(0, int(regime_window))  # 0: no regime offsets
        self.max_factor = float(max_factor)
        self.min_residuals = max(1, int(min_residuals))
        # Passes kept: a regime's window is its last regime_window passes among these.
        self.keep = max(self.machine_window, int(keep))
        self._limit = math.log(self.max_factor)
        self._rows = np.zeros((0, len(SCHED_FIELDS)))
        self._y = np.zeros(0)
        self._cells = np.zeros(0, dtype=np.int64)
        # Against the fit of the last refresh, per kept pass: its log residual and the
        # machine's offset at its time; the last ``_pending`` passes have neither yet.
        self._res = np.zeros(0)
        self._at_time = np.zeros(0)
        self._pending = 0
        self._coef: FloatArray | None = None  # the fit's coefficients the residuals are against
        self.machine = 0.0
        self.regime = np.zeros(len(CELLS))

    def emptied(self) -> RecentOffsets:
        """The same settings, no passes."""
        return RecentOffsets(
            self.machine_window,
            self.regime_window,
            self.max_factor,
            self.min_residuals,
            self.keep,
        )

    def restore(self, machine: float, regime: FloatArray) -> None:
        """Start from saved offsets (log), clipped to this model's limit; no passes."""
        if regime.shape != (len(CELLS),):
            raise ValueError(f"regime offsets must be {len(CELLS)} numbers")
        self.machine = float(np.clip(machine, -self._limit, self._limit))
        self.regime = np.clip(np.asarray(regime, dtype=np.float64), -self._limit, self._limit)

    def state(self) -> list[float]:
        """The offsets (log) for a snapshot: the machine's, then each cell's."""
        return [self.machine, *map(float, self.regime)]

    def add(self, sched: FloatArray, y: FloatArray, cells: npt.NDArray[np.int64]) -> None:
        """Keep a batch's informative passes (arrival order)."""
        n = y.shape[0]
        if not n:
            return
        self._rows = np.concatenate([self._rows, sched])[-self.keep :]
        self._y = np.concatenate([self._y, y])[-self.keep :]
        self._cells = np.concatenate([self._cells, cells])[-self.keep :]
        self._pending = min(self._pending + n, self._y.shape[0])
        done = self._y.shape[0] - self._pending
        self._res = self._res[self._res.shape[0] - done :]
        self._at_time = self._at_time[self._at_time.shape[0] - done :]

    def refresh(self, fit: Fit, coef: FloatArray) -> None:
        """Take the offsets against ``fit`` (of coefficients ``coef``): every kept
        pass's residual when the coefficients changed (a solve), only the new
        passes' otherwise (what a batch costs: its own passes)."""
        if self._coef is None or not np.array_equal(coef, self._coef):
            self._pending = self._y.shape[0]
            self._res, self._at_time = np.zeros(0), np.zeros(0)
            self._coef = np.array(coef, dtype=np.float64)
        p = self._pending
        if not p:
            return
        self._pending = 0
        new = slice(self._y.shape[0] - p, None)
        pred = fit(self._rows[new])
        res = np.log(np.maximum(self._y[new], 1e-12) / np.where(pred > 0, pred, np.nan))
        res = np.nan_to_num(res, nan=0.0)  # no prediction to compare with: no offset
        limit = self._limit
        # The machine's offset at each pass's time: the trailing median before it.
        at_time = trailing_medians(self._res, res, self.machine_window, self.min_residuals)
        self._at_time = np.concatenate(
            [self._at_time, np.clip(np.nan_to_num(at_time[:-1], nan=0.0), -limit, limit)]
        )
        self._res = np.concatenate([self._res, res])
        if self._res.shape[0] < self.min_residuals:
            return
        self.machine = float(np.clip(np.median(self._res[-self.machine_window :]), -limit, limit))
        if not self.regime_window:
            return
        left = self._res - self._at_time
        for c in range(len(CELLS)):
            mine = left[self._cells == c][-self.regime_window :]
            value = float(np.median(mine)) if mine.shape[0] >= self.min_residuals else 0.0
            self.regime[c] = float(np.clip(value, -limit, limit))

    def current(self, cells: npt.NDArray[np.int64], tolerance: float = 0.0) -> FloatArray:
        """Log offset for passes of these cells (as of the last refresh); an offset
        within ``tolerance`` of zero is taken as zero."""
        regime = np.where(cells >= 0, self.regime[np.maximum(cells, 0)], 0.0)
        total = self.machine + regime
        return np.asarray(np.where(np.abs(total) > tolerance, total, 0.0))

    def factors(self) -> dict[str, float]:
        """Current multiplicative factors: ``machine`` and one per cell."""
        out = {"machine": math.exp(self.machine)}
        out.update({cell: math.exp(v) for cell, v in zip(CELLS, self.regime, strict=True)})
        return out
