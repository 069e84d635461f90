"""The quantile of a latency given its exceedance function: by bisection, or on a
grid when the function is vectorised."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
# The grid search: this many cells, refined this many times on the cell that holds
# the quantile (the bracket shrinks 64^4 = 1.7e7-fold).
_GRID_POINTS = 64
_GRID_PASSES = 4


def exceedance_quantile(
    exceed: Callable[[float], float], lo: float, hi: float, tail: float, iterations: int = 50
) -> float:
    """Smallest t >= ``lo`` with ``exceed(t) <= tail``: ``hi`` is doubled (away from
    ``lo``) until it qualifies, then the interval is bisected. ``exceed`` must be
    non-increasing."""
    hi = max(hi, lo + 1e-6)
    while exceed(hi) > tail:
        hi = lo + 2.0 * (hi - lo)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if exceed(mid) > tail:
            lo = mid
        else:
            hi = mid
    return hi


def exceedance_quantile_on_grid(
    exceed: Callable[[FloatArray], FloatArray], lo: float, hi: float, tail: float
) -> float:
    """:func:`exceedance_quantile` for a vectorised ``exceed``: ``lo`` itself when it
    qualifies; else ``hi`` doubled as there, then a grid over the bracket, refined on
    the cell of its first point within ``tail``. Each pass evaluates every point at
    once (a mixture of many classes costs one call, not one per point)."""
    if exceed(np.array([lo]))[0] <= tail:
        return lo
    hi = max(hi, lo + 1e-6)
    while exceed(np.array([hi]))[0] > tail:
        hi = lo + 2.0 * (hi - lo)
    for _ in range(_GRID_PASSES):
        grid = np.linspace(lo, hi, _GRID_POINTS + 1)
        first = int(np.argmax(exceed(grid) <= tail))
        lo, hi = float(grid[max(first - 1, 0)]), float(grid[first])
    return hi
