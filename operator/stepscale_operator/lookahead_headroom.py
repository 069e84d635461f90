"""The look-ahead's headroom for rises no trend shows yet, grown with the horizon
as far as the demand's own history shows rises growing with it.

``min_lookahead_ratio`` was set for pods that start in 60 s (a 70 s horizon):
the scaled Azure trace moves 10-15% within a minute. Over a longer start-up the
load moves further, by how much depends on the traffic: a steady load's 30 s
readings swing by the same sampling noise at any horizon, a drifting one's by
more the further ahead. So the headroom is the floor times how much larger the
demand's rises over this horizon were than over the reference one, both read as
the same upper quantile of the measured demand's ratios ``d(t + H) / d(t)``.

Pure: the caller keeps the history of the measured demand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rise_quantile(
    history: Sequence[tuple[float, float]], horizon_s: float, quantile: float, min_pairs: int
) -> float | None:
    """The ``quantile`` of ``d(t + horizon_s) / d(t)`` over ``history`` ((time, demand)
    in time order); None with fewer than ``min_pairs`` pairs with a demand at both ends.

    Each reading is paired with the first reading at least ``horizon_s`` later.
    """
    if len(history) < 2 or horizon_s <= 0.0:
        return None
    times = np.fromiter((t for t, _ in history), dtype=float, count=len(history))
    rates = np.fromiter((r for _, r in history), dtype=float, count=len(history))
    later = np.searchsorted(times, times + horizon_s, side="left")
    paired = later < len(times)
    if not paired.any():
        return None
    start = rates[paired]
    end = rates[later[paired]]
    known = start > 0.0
    if int(known.sum()) < min_pairs:
        return None
    return float(np.quantile(end[known] / start[known], quantile))


def lookahead_headroom(
    history: Sequence[tuple[float, float]],
    horizon_s: float,
    reference_horizon_s: float,
    floor: float,
    cap: float,
    quantile: float,
    min_pairs: int,
) -> float:
    """The planned load's least multiple of the measured one at ``horizon_s``.

    ``floor`` up to ``reference_horizon_s`` (the horizon it was set at); beyond
    it, ``floor`` times the growth of the demand's ``quantile`` rise from the
    reference horizon to this one, never below ``floor`` nor above ``cap``.
    Until the history holds ``min_pairs`` pairs at both horizons it is ``floor``:
    no rise is assumed that was not seen.
    """
    floor = max(floor, 1.0)
    if horizon_s <= reference_horizon_s:
        return floor
    here = rise_quantile(history, horizon_s, quantile, min_pairs)
    there = rise_quantile(history, reference_horizon_s, quantile, min_pairs)
    if here is None or there is None or there <= 0.0:
        return floor
    return min(max(floor * here / there, floor), max(cap, floor))
