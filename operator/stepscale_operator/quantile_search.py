"""The quantile of a latency given its exceedance function, by bisection."""

from __future__ import annotations

from collections.abc import Callable


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
