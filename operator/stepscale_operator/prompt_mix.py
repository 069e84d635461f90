"""The extra time the prompts a long output meets add to its passes: a compound sum.

Over a request's ``m`` passes a count of prompts arrives (negative binomial: a mean
per pass, a variance the arrival dispersion times that), each adding its chunks'
extra time over a decode pass (at most ``m`` chunks fit in ``m`` passes). The sum's
distribution comes from its characteristic function on a grid (FFT); see
:mod:`~stepscale_operator.itl_quantile` for why a normal does not serve.

A distribution of the ITL asks for the sum at some twenty ``m`` and, for each, at
up to a dozen mean counts (the prompts queued behind each prompt class's own
prefill add to the count; :func:`~stepscale_operator.itl_quantile.itl_distribution`).
The rows of one ``m`` differ little: a few prompts behind a prefill beside the
tens that arrive over ``m`` passes. So the transform is taken at a few counts per
``m`` (nodes, evenly spaced in the square root of the count) and each row is the
mixture of its two neighbouring nodes' sums, weighted to keep its mean count. The
mixture's variance exceeds the row's by at most the spacing squared (1%), and where
the rows are fewer than the nodes would be, the nodes are the rows themselves.
On the heavy-prompt scenario held at 8 replicas, the rows taken one at a time were
two thirds of the simulator's time; in one table on these nodes the run took 0.71x
as long (quantiles within 0.07% of the rows taken exactly; docs/planner-history.md).

Pure functions over numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stepscale_operator.quantile_search import FloatArray

# Spacing of the nodes in sqrt(mean count): a row between two nodes is their
# mixture, which keeps its mean and adds at most this squared to its variance.
COUNT_NODE_SPACING = 0.1


@dataclass(frozen=True)
class CompoundCdfTable:
    """The sum's CDF for every (``m``, mean count) row, as nodes and mixing weights."""

    steps: npt.NDArray[np.float64]  # (m,): grid step of each m's CDFs, seconds
    node_cdfs: npt.NDArray[np.float64]  # (nodes, points): CDF at 0, step, 2 step, ...
    below: npt.NDArray[np.int64]  # (m, rows): the node below each row
    weight: npt.NDArray[np.float64]  # (m, rows): the row's weight on the node above

    def rows(self, j: int) -> npt.NDArray[np.float64]:
        """The CDFs of ``m`` number ``j``, one per row, on grid step ``steps[j]``."""
        below = self.below[j]
        above = np.minimum(below + 1, len(self.node_cdfs) - 1)
        weight = self.weight[j][:, None]
        return (1.0 - weight) * self.node_cdfs[below] + weight * self.node_cdfs[above]

    def cdf_at(self, at: FloatArray, rows: npt.NDArray[np.int64]) -> FloatArray:
        """The CDF at ``at[j, x, c]`` grid steps of ``m`` number ``j``, of row
        ``rows[c]``; linear between grid points, 0 below the grid, 1 past it."""
        points = self.node_cdfs.shape[1]
        table = self.node_cdfs.ravel()
        i = np.clip(at.astype(np.int64), 0, points - 2)
        frac = at - i

        def on(node: npt.NDArray[np.int64]) -> FloatArray:
            start = node * points + i
            lower = table[start]
            return lower + frac * (table[start + 1] - lower)

        below = self.below[:, rows][:, None, :]
        weight = self.weight[:, rows][:, None, :]
        above = np.minimum(below + 1, len(self.node_cdfs) - 1)
        inside = (1.0 - weight) * on(below) + weight * on(above)
        return np.where(at < 0.0, 0.0, np.where(at < points - 1, inside, 1.0))


@dataclass(frozen=True)
class PromptMix:
    """The prompts a replica serves, as the ITL of long outputs sees them."""

    per_pass: float  # prompts arriving per pass
    dispersion: float  # variance / mean of their counts (1: Poisson)
    # (chunks, extra seconds per chunk over a decode pass, probability) per class
    classes: tuple[tuple[float, float, float], ...]

    def extra_cdf_table(
        self, intervals: Sequence[int] | FloatArray, behind: FloatArray, points: int = 2048
    ) -> CompoundCdfTable:
        """The distribution of the extra time the prompts arriving over ``m`` passes
        add to them, plus ``behind[r]`` more prompts on average (queued behind the
        request's own prefill), for every ``m`` in ``intervals`` and every ``r``, in
        one transform: row ``(j, r)`` is the CDF at 0, ``steps[j]``, 2 ``steps[j]``, ..."""
        m = np.asarray(intervals, dtype=np.float64)[:, None]
        if m.size == 0:  # every output short: nothing to take the sum over
            rows = np.shape(behind)[0]
            below = np.zeros((0, rows), dtype=np.int64)
            return CompoundCdfTable(np.zeros(0), np.zeros((0, points)), below, np.zeros((0, rows)))
        chunks = np.minimum(np.array([max(n, 1.0) for n, _, _ in self.classes])[None, :], m)
        extra = np.array([max(e, 0.0) for _, e, _ in self.classes])[None, :] * chunks
        prob = np.array([p for _, _, p in self.classes])
        prob = prob / prob.sum()
        mus = max(self.per_pass, 0.0) * m + np.maximum(np.asarray(behind), 0.0)[None, :]
        top = mus.max(axis=1)
        d = max(self.dispersion, 1.0)
        sd = np.sqrt(d * top * (extra**2 @ prob))
        span = top * (extra @ prob) + 8.0 * sd + extra.max(axis=1)
        empty = ~(span > 0.0) | (top <= 0.0)  # no prompts: all the mass at 0
        steps = np.where(empty, 1.0, span / (points // 2))  # half the grid: no wrap-around
        # Each class's mass split between its two grid neighbours: keeps the mean.
        at = np.minimum(extra / steps[:, None], points - 2.0)
        low = np.floor(at).astype(np.int64) + points * np.arange(m.size)[:, None]
        upper = at - np.floor(at)
        size = m.size * points
        px = np.bincount(low.ravel(), weights=(prob * (1.0 - upper)).ravel(), minlength=size)
        px += np.bincount(low.ravel() + 1, weights=(prob * upper).ravel(), minlength=size)
        z = np.fft.rfft(px.reshape(m.size, points), axis=1)
        # The count's generating function is exp(mu log_g): negative binomial,
        # (1 + (d - 1)(1 - z))^(-mu / (d - 1)), or Poisson; one log for every m.
        nb = d > 1.0 + 1e-6
        log_g = np.log(1.0 + (d - 1.0) * (1.0 - z)) / -(d - 1.0) if nb else z - 1.0
        nodes = [count_nodes(row) for row in mus]
        sizes = [counts.size for counts, _, _ in nodes]
        of_m = np.repeat(np.arange(m.size), sizes)
        g = np.exp(np.concatenate([counts for counts, _, _ in nodes])[:, None] * log_g[of_m])
        density = np.clip(np.fft.irfft(g, points, axis=1), 0.0, None)
        total = np.maximum(density.sum(axis=1, keepdims=True), 1e-300)
        node_cdfs = np.minimum(np.cumsum(density, axis=1) / total, 1.0)
        node_cdfs[empty[of_m]] = 1.0
        first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        below = first[:, None] + np.array([lower for _, lower, _ in nodes])
        weight = np.array([w for _, _, w in nodes])
        return CompoundCdfTable(steps, node_cdfs, below, weight)


def count_nodes(
    mus: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """The counts to transform at for the mean counts ``mus`` (one ``m``'s rows),
    and for each row the node below it and its weight on the node above. The nodes
    are some of the counts: from the least, each next node is the farthest count
    within :data:`COUNT_NODE_SPACING` in sqrt of the last (else the next count), so
    every other row lies between two nodes that close, and a row that is a node
    has weight 0 or 1 (it is exact)."""
    distinct = np.unique(mus)
    roots = np.sqrt(distinct)
    kept = [0]
    while kept[-1] < distinct.size - 1:
        farthest = int(np.searchsorted(roots, roots[kept[-1]] + COUNT_NODE_SPACING, "right")) - 1
        kept.append(max(farthest, kept[-1] + 1))
    nodes = distinct[kept]
    if nodes.size == 1:
        return nodes, np.zeros(mus.size, dtype=np.int64), np.zeros(mus.size)
    below = np.clip(np.searchsorted(nodes, mus, side="right") - 1, 0, nodes.size - 2)
    weight = (mus - nodes[below]) / (nodes[below + 1] - nodes[below])
    return nodes, below, np.clip(weight, 0.0, 1.0)
