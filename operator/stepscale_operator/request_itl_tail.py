"""The realized ITL tail over requests, from (stream, second) cells of pass times.

The SLO counts requests, and a request's ITL is the mean time of the passes it
decoded in. The streams give, per stream and second, the pass wall times
weighted by decode requests: each cell's token-weighted ITL. A quantile over
cells is not one over requests. An output of a few hundred tokens decodes for
several seconds, and its ITL is the mean over those seconds, so the requests'
tail lies below the worst cells: on the shared trace the cells' p99 read
1.04-1.17x the requests' own p99 at 2 to 15 replicas, and at 28 req/s (x5) it
fired the closed loop's sustained-miss rule with the cells at 43-50 ms while the
requests' p99 was 31-41 ms.

So each output-length class is taken over its own span. A request of ``m``
inter-token intervals at the mean ITL ``t`` decodes for ``m * t`` seconds, and
its ITL is the token-weighted mean of that many consecutive cells of its
stream. The classes are the measured output-length shares
(:mod:`~stepscale_operator.output_lengths`); outputs longer than the last class
share the rest of the mean output length.

An output that decodes in under a second meets a few passes of one cell, and
the cell's mean dilutes the one or two slow passes it meets: taken over one
cell, the short outputs' tail read 0.62x the requests' p99 on silence-burst and
0.66x on bursty code. So a class of ``m`` intervals that decodes within one
cell starts where prompts finish prefill (:class:`CellPasses`) and meets ``K``
prefill-bearing passes, a beta-binomial of its stream's share of prefill passes
over the window times the measured lift of a request's first ``m`` passes,
with their overdispersion (:mod:`~stepscale_operator.early_prefills`; a
binomial of the share where none is measured); its ITL is the mean of
``m - K`` decode-only and ``K`` prefill-bearing passes at that cell's mean
time of each. The lift is what counts the passes *after* a request's first
token: the cell's own share counts the prompts prefilled beside it as well,
and read 1.4x the requests' p99 on bursty code, where prompts come in clumps.
Outputs of one token have no ITL and are left out. Without measured shares
every request is taken over one cell, the cells' own quantile.

Pure numpy: grids in, milliseconds out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stepscale_operator.early_prefills import EarlyPrefills, beta_binomials
from stepscale_operator.load_types import OUTPUT_INTERVAL_BINS

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class OutputSpan:
    """Requests that decode over ``cells`` consecutive cells, and their share;
    ``passes`` > 0: they decode within one cell over that many of its passes."""

    cells: int
    share: float
    passes: int = 0


@dataclass(frozen=True)
class CellPasses:
    """Per (stream, cell), the passes a request decoding within the cell meets (grids
    of the cells' shape): how many passes ran and how many of them carried a
    prefill, the mean time a decode took on a pass without prefill and on one
    with, and the prompts that finished prefill there (where short outputs start
    decoding)."""

    passes: FloatArray
    prefill_passes: FloatArray
    decode_pass_s: FloatArray
    prefill_pass_s: FloatArray
    finished: FloatArray


ONE_CELL = (OutputSpan(1, 1.0),)
"""Every request over one cell: the cells' own quantile."""


def output_spans(
    shares: Sequence[float],
    mean_intervals: float | None,
    itl_mean_s: float,
    cell_s: float,
    max_cells: int,
) -> tuple[OutputSpan, ...]:
    """The cells each output-length class decodes over, with its share of requests.

    ``shares`` per :data:`OUTPUT_INTERVAL_BINS` bin (each at its middle); the rest
    of the requests are longer than the last bin and carry what the mean output
    (``mean_intervals``, None: unknown) leaves over the bins, at least one more
    than the last bin (all of them when every share is 0). A class that decodes
    in less than a cell keeps its passes (outputs of no interval, one token, have
    no ITL and are left out); the others span at least one cell and at most
    ``max_cells`` (the window). :data:`ONE_CELL` without shares (not measured) or
    a mean ITL.
    """
    if not shares or not itl_mean_s > 0.0 or not cell_s > 0.0:
        return ONE_CELL
    measured = sum(shares)
    classes = [
        (0.5 * (low + high), share)
        for (low, high), share in zip(OUTPUT_INTERVAL_BINS, shares, strict=False)
        if share > 0.0
    ]
    rest = 1.0 - measured
    if rest > 1e-9:
        covered = sum(m * share for m, share in classes)
        longest = OUTPUT_INTERVAL_BINS[min(len(shares), len(OUTPUT_INTERVAL_BINS)) - 1][1] + 1
        left = (mean_intervals - covered) / rest if mean_intervals is not None else 0.0
        classes.append((max(left, float(longest)), rest))
    spans: dict[tuple[int, int], float] = {}
    for intervals, share in classes:
        passes = math.floor(intervals + 0.5)
        if passes < 1:
            continue
        if intervals * itl_mean_s < cell_s:
            key = (1, passes)
        else:
            key = (min(math.floor(intervals * itl_mean_s / cell_s + 0.5), max(max_cells, 1)), 0)
        spans[key] = spans.get(key, 0.0) + share
    if not spans:
        return ONE_CELL
    return tuple(
        OutputSpan(cells, share, passes) for (cells, passes), share in sorted(spans.items())
    )


def request_itl_tail(
    decode_wall_s: FloatArray,
    decode_tokens: FloatArray,
    spans: Sequence[OutputSpan],
    quantile: float,
    cell_passes: CellPasses | None = None,
    early: EarlyPrefills | None = None,
) -> float:
    """The ``quantile`` of the requests' ITL in ms (0.0: nothing decoded).

    ``decode_wall_s`` and ``decode_tokens`` are (stream, cell) grids in time order:
    per cell, the decode requests times pass wall time, summed, and the decode
    requests. Each span's requests are spread over every run of that many
    consecutive cells of a stream in proportion to the tokens decoded there; a
    span within one cell draws its passes from ``cell_passes`` with the lift of
    ``early`` (see the module docstring; without ``cell_passes`` it takes the
    cell's mean).
    """
    n_cells = decode_wall_s.shape[1]
    if n_cells == 0:
        return 0.0
    values: list[FloatArray] = []
    weights: list[FloatArray] = []
    # Prefix sums: a run of k cells is one subtraction, for every span.
    wall = np.cumsum(np.pad(decode_wall_s, ((0, 0), (1, 0))), axis=1)
    tokens = np.cumsum(np.pad(decode_tokens, ((0, 0), (1, 0))), axis=1)
    starts = _StartCells.of(cell_passes) if cell_passes is not None else None
    for span in spans:
        if span.share <= 0.0:
            continue
        if span.passes > 0 and cell_passes is not None:
            if starts is not None:  # None: no prompt finished, no short output started
                itl, share = starts.draw(span.passes, early)
                values.append(itl)
                weights.append(span.share * share)
            continue
        k = min(max(span.cells, 1), n_cells)
        run_wall = wall[:, k:] - wall[:, :-k]
        run_tokens = tokens[:, k:] - tokens[:, :-k]
        has = run_tokens > 1e-12
        if not has.any():
            continue
        counted = run_tokens[has]
        values.append(run_wall[has] / counted)
        weights.append(span.share * counted / counted.sum())
    if not values:
        return 0.0
    return weighted_quantile(np.concatenate(values), np.concatenate(weights), quantile) * 1e3


@dataclass(frozen=True)
class _StartCells:
    """The cells where prompts finished prefill (where short outputs start), with
    what every short class's draw reads there: taken once per tail."""

    stream: npt.NDArray[np.intp]  # each cell's stream
    stream_share: FloatArray  # per stream, its share of prefill-bearing passes
    decode_pass_s: FloatArray  # per cell
    prefill_pass_s: FloatArray
    weight: FloatArray  # per cell, its share of the finished prompts

    @classmethod
    def of(cls, cells: CellPasses) -> _StartCells | None:
        """None where no prompt finished."""
        start = cells.finished > 0.0
        if not start.any():
            return None
        ran = cells.passes.sum(axis=1)
        share = np.divide(
            cells.prefill_passes.sum(axis=1), ran, out=np.zeros_like(ran), where=ran > 0.0
        )
        finished = cells.finished[start]
        return cls(
            np.nonzero(start)[0],
            share,
            cells.decode_pass_s[start],
            cells.prefill_pass_s[start],
            finished / finished.sum(),
        )

    def draw(self, passes: int, early: EarlyPrefills | None) -> tuple[FloatArray, FloatArray]:
        """The ITL of a request of ``passes`` intervals, per start cell and count of
        prefill passes it meets, and each one's share (summing to 1)."""
        lift, rho = early.at(passes) if early is not None else (1.0, 0.0)
        share = np.minimum(self.stream_share * lift, 1.0)
        # One draw per stream, taken by each of its cells.
        per_stream = beta_binomials(np.full(share.size, passes), share, np.full(share.size, rho))
        met = np.arange(passes + 1, dtype=np.float64)[None, :] / passes
        decode = self.decode_pass_s[:, None]
        itl = decode + met * (self.prefill_pass_s[:, None] - decode)
        return itl.ravel(), (per_stream[self.stream] * self.weight[:, None]).ravel()


def weighted_quantile(values: FloatArray, weights: FloatArray, quantile: float) -> float:
    """The smallest of ``values`` whose cumulative share of ``weights`` reaches
    ``quantile`` (``values`` non-empty, ``weights`` non-negative, not all 0).

    Many values (short outputs' draws: a few hundred thousand on 64 replicas) are
    first binned by value, and only the bin that holds the quantile is sorted:
    the same value as a sort of them all, in linear time."""
    if values.size > _SORT_ALL_BELOW:
        low, high = float(values.min()), float(values.max())
        if high > low:
            scaled = (values - low) * (_BINS / (high - low))
            bins = np.minimum(scaled.astype(np.int64), _BINS - 1)
            mass = np.cumsum(np.bincount(bins, weights, minlength=_BINS))
            at = min(int(np.searchsorted(mass, quantile * mass[-1])), _BINS - 1)
            inside = bins == at
            below = float(mass[at - 1]) if at > 0 else 0.0
            return _sorted_quantile(values[inside], weights[inside], quantile * mass[-1] - below)
    return _sorted_quantile(values, weights, quantile * float(weights.sum()))


# Beyond this many values the quantile bins them first (see weighted_quantile).
_SORT_ALL_BELOW = 8192
_BINS = 1024


def _sorted_quantile(values: FloatArray, weights: FloatArray, mass: float) -> float:
    """The smallest of ``values`` whose cumulative ``weights`` in value order reach ``mass``."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order[min(int(np.searchsorted(cumulative, mass)), values.size - 1)]])
