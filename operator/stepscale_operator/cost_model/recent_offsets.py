"""Recent offsets: how far the fit is off right now, for the machine and per regime.

The regression learns batch composition with a long memory (a 20,000-pass
half-life), and it should: a composition seen an hour ago costs the same now. But
what a pass costs also moves with the machine (clock, other tenants, memory
pressure) over tens to hundreds of passes, and a regime that is rarely visited
(prefill-bearing passes are one in five to one in fifty) has a residual offset the
shared coefficients cannot remove. Measured on the repository's recordings, the
same work done at other moments is -13% to +12% off tenth by tenth of a recording,
and the fit's median signed error per regime was -6% to +5% on the quiet ones.

So each prediction is multiplied by ``exp(machine + regime[cell])``, two prequential
medians of log residuals ``log(actual / predicted)``:

* ``machine``: the median over the last ``machine_window`` passes of every regime
  and stream (the fleet's recent speed against the fit);
* ``regime[cell]``: the median over the last ``regime_window`` passes of that cell
  (:data:`~.regime_residuals.CELLS`) of what is left after ``machine``.

The residuals are the prequential ones, against the fit that predicted each pass.
Two rules keep the offsets and the regression from correcting one error twice:
the regression's fast forgetting of a regime the fit is off in
(:mod:`.regime_residuals`) judges what the offsets leave, and a regime's offset
counts only the residuals of the last ``max_age`` passes (the model sets it to two
of that forgetting's half-lives), as older ones measured a fit that has since
moved. Measured on a synthetic 1.6x change of the prefill cost (the unit tests'),
4,000-6,000 passes after it: with neither rule prefill passes were predicted up to
7% high; with both, within 2.3%.

Each is clipped to ``+-log(max_factor)``. The offsets follow a machine that drifts,
not a stall: a run of passes slowed 10-30x (seen on a contended machine) would
otherwise set the median for as long as it lasts and every pass after it would be
predicted 10x high. Stalls are the admission gate's (:mod:`.admission`).

Every row's offset uses only the residuals of rows before it, so the predictions
stay prequential whatever the batch size. Until a window holds ``min_residuals``,
the last offset stands: zero for a new model, the snapshot's for a restored one
(:meth:`RecentOffsets.restore`); a regime with no residual of the last ``max_age``
passes is back to zero. The age is checked as of a batch's start.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from stepscale_operator.cost_model.features import FloatArray
from stepscale_operator.cost_model.regime_residuals import CELLS


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
    """The machine's and each regime's recent log offset from the fit (see module doc)."""

    def __init__(
        self,
        machine_window: int = 32,
        regime_window: int = 100,
        max_factor: float = 1.2,
        min_residuals: int = 16,
        max_age: int = 1000,
    ) -> None:
        if max_factor < 1.0:
            raise ValueError("max_factor must be at least 1")
        self.machine_window = max(1, int(machine_window))
        self.regime_window = max(0, int(regime_window))  # 0: no regime offsets
        self.max_factor = float(max_factor)
        self.min_residuals = max(1, int(min_residuals))
        self.max_age = max(1, int(max_age))
        self._seen = 0  # residual-bearing passes so far: each regime residual's age is in these
        self._seen_at_start = 0
        self._limit = math.log(self.max_factor)
        self._machine_residuals = np.zeros(0)
        self._regime_residuals = [np.zeros(0) for _ in CELLS]  # after the machine's offset
        self._regime_seen = [np.zeros(0, dtype=np.int64) for _ in CELLS]  # _seen at each
        self.machine = 0.0
        self.regime = np.zeros(len(CELLS))

    def emptied(self) -> RecentOffsets:
        """The same settings, no residuals."""
        return RecentOffsets(
            self.machine_window,
            self.regime_window,
            self.max_factor,
            self.min_residuals,
            self.max_age,
        )

    def restore(self, machine: float, regime: FloatArray) -> None:
        """Start from saved offsets (log), clipped to this model's limit; no residuals."""
        if regime.shape != (len(CELLS),):
            raise ValueError(f"regime offsets must be {len(CELLS)} numbers")
        self.machine = float(np.clip(machine, -self._limit, self._limit))
        self.regime = np.clip(np.asarray(regime, dtype=np.float64), -self._limit, self._limit)

    def state(self) -> list[float]:
        """The current offsets (log) for a snapshot: the machine's, then each cell's."""
        return [self.machine, *map(float, self.regime)]

    def _offsets(self, medians: FloatArray, standing: float) -> FloatArray:
        return np.clip(np.nan_to_num(medians, nan=standing), -self._limit, self._limit)

    def apply(
        self,
        cells: npt.NDArray[np.int64],
        log_res: FloatArray,
        informative: npt.NDArray[np.bool_],
    ) -> FloatArray:
        """Log offset of each row of a batch in arrival order, from the rows before it;
        then learn the batch's ``informative`` residuals (``log(actual / predicted)``
        against the fit). A row of no cell (an empty pass) gets the machine's alone.
        """
        use = informative & np.isfinite(log_res)
        # Machine: the trailing median of the residuals before each row.
        values = log_res[use]
        medians = self._offsets(
            trailing_medians(
                self._machine_residuals,
                values,
                self.machine_window,
                self.min_residuals,
            ),
            self.machine,
        )
        machine = medians[np.cumsum(use) - use]  # indexed by the residuals before each row
        self.machine = float(medians[-1])
        self._machine_residuals = np.concatenate([self._machine_residuals, values])[
            -self.machine_window :
        ]

        # Regimes: the same over each cell's residuals left after the machine's offset,
        # those of the last ``max_age`` passes (as of the batch's start).
        offset = machine.copy()
        self._seen_at_start = self._seen
        seen = self._seen + np.cumsum(use) - use
        self._seen += int(np.count_nonzero(use))
        for c in range(len(CELLS) if self.regime_window else 0):
            rows = cells == c
            in_cell = use & rows
            fresh = self._regime_seen[c] >= self._seen_at_start - self.max_age
            if not fresh.all():
                self._regime_residuals[c] = self._regime_residuals[c][fresh]
                self._regime_seen[c] = self._regime_seen[c][fresh]
                if not fresh.any():
                    self.regime[c] = 0.0  # no recent residual: the fit alone
            if not in_cell.any() and fresh.all():  # nothing new: the standing offset
                offset[rows] += self.regime[c]
                continue
            left = log_res[in_cell] - machine[in_cell]
            medians = self._offsets(
                trailing_medians(
                    self._regime_residuals[c],
                    left,
                    self.regime_window,
                    self.min_residuals,
                ),
                float(self.regime[c]),
            )
            offset[rows] += medians[(np.cumsum(in_cell) - in_cell)[rows]]
            self.regime[c] = float(medians[-1])
            keep = self.regime_window
            self._regime_residuals[c] = np.concatenate([self._regime_residuals[c], left])[-keep:]
            self._regime_seen[c] = np.concatenate([self._regime_seen[c], seen[in_cell]])[-keep:]
        return offset

    def current(self, cells: npt.NDArray[np.int64]) -> FloatArray:
        """Log offset for passes of these cells now (hypothetical batches too)."""
        regime = np.where(cells >= 0, self.regime[np.maximum(cells, 0)], 0.0)
        return np.asarray(self.machine + regime)

    def factors(self) -> dict[str, float]:
        """Current multiplicative factors: ``machine`` and one per cell."""
        out = {"machine": math.exp(self.machine)}
        out.update({cell: math.exp(v) for cell, v in zip(CELLS, self.regime, strict=True)})
        return out
