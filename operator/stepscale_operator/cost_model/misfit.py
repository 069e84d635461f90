"""Misfit buckets: where the stall gate's rejections are the model being wrong.

The stall gate (:class:`~stepscale_operator.cost_model.admission.ResidualGate`)
rejects passes far slower than predicted, because stalls (the OS or a neighbour
took the machine) slow a pass 10-30x. A kind of pass the fit extrapolates badly
(chunks over a long cached prefix, say, 4-30x their extrapolation) looks the same
pass by pass. Two tells separate them, per coverage bucket:

* **persistence**: the share of the bucket's passes the gate rejected, with a memory
  of ``half_life`` (500) of its own passes. A stall run is a few hundred passes and
  falls on every kind running, so it cannot push one bucket past half. Slow: at
  4-30x a kind waited 1,300-1,940 of its passes.
* **contrast**: a stall slows every pass of its pod at once; a misfit slows one
  kind while the same stream's other passes are on time. A pass has a contrast when

  - its stream's recent passes, without its own bucket in the batch, were mostly
    let in: each stream keeps the share of its recent passes the gate rejected
    (half-life ``stream_half_life``, 16 of its passes), and that share is under
    half over at least ``min_others`` passes. A stall run gives at most the
    stream's first ~16 stalled passes a contrast (its share of rejected passes
    passes half after that), even a run on one kind of pass alone, since the
    other kinds' passes then stop coming and their weight decays;
  - or the stream's pass just before it, or just after it in the same batch, was
    let in. A stall slows the passes around it too, so of a run only its first
    and last passes have this contrast; a kind that is most of its stream's
    passes (four in five: a prefill worker that now meets a cached prefix on most
    requests) has no contrast by share, but one beside each pass of another kind.
    Most stalls on a shared CPU are single passes (0.6-0.9 of the runs the gate
    rejected in the kept recordings), and a bucket takes them at their rate,
    under half;
  - or it comes after ``longest_stall`` (400) rejections in a row: no stall is
    that long (the longest runs seen on a shared CPU are ~110-160 passes). A
    stream of the new kind alone has no other contrast.

  The share of a bucket's contrasted passes that the gate rejected, with a memory
  of ``contrast_half_life`` (50) of them, tells a misfit within about that many
  (a stall run's first 16 of 50 leave it at 0.2).

A bucket is misfit when either share is at least half: nothing in it is rejected,
and its passes are learned at full weight and at their own time (see
:meth:`~stepscale_operator.cost_model.admission.ResidualGate.weights` and the cost
model's working rows). Each needs the other: a pass 8x its
prediction, linearised at that prediction, has a target a third of the way there,
and full weight on it pulls the fit to a compromise (8x: 1,500 passes); at its own
time but the unlearned knee's Huber weight, each pass pulls a seventh as hard (8x:
780). At its own time a pass's pull is bounded anyway (a prediction below it is off
by at most all of it, however slow it is), so stalls a tell takes for a misfit now
and then move the fit little: seven in ten passes of one composition stalled 10-30x,
scattered over 600, leave it within 1% of the truth (9% linearised at the
prediction). Both count the passes the gate rejected, so a misfit bucket's shares
fall back under half as soon as its passes are let in, and it hovers there, learning
about half of them, until the fit comes close enough for the gate to let them all
in. (Counting every pass beyond the gate, rejected or not, holds a bucket misfit
until it is learned; it learned more slowly, under the old weights, in
``bench_new_pass_kind.py``: 680 passes at 4x against 380, 1,220 at 8x against 780.)

Measured (``bench_new_pass_kind.py``, 2,000 passes of a new kind): passes until
learned at 4 / 8 / 16 / 30x its extrapolation, a fifth of the passes:

=========================================  =====  =====  =====  =====
tells, weights                             4x     8x     16x    30x
=========================================  =====  =====  =====  =====
persistence alone, Huber, linearised       1,300  1,640  1,700  1,940
and the contrast by share                  380    780    880    960
misfit from pass 1 (the old bound)         220    540    680    800
both tells, full weight, own time          160    200    320    440
=========================================  =====  =====  =====  =====

Four in five passes of the new kind: by share and persistence 1,120 / never / never
/ never, with the previous pass 660 / 1,120 / 1,520 / 1,840, at full weight and own
time 640 / 640 / 640 / 720, with the next pass too 320 / 320 / 320 / 480. Every
pass: 1,100 / never / never / never, with the long run 740 / 1,300 / 1,760 / never,
at full weight and own time 700 at each factor: there, most of it is the 400 passes
a stall may last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from stepscale_operator.cost_model.features import N_BUCKETS, FloatArray

# A bucket is misfit once either of its shares of rejected passes reaches this.
MISFIT_SHARE = 0.5


class RecentPasses(Protocol):
    """A stream's exponentially weighted count of recent gated passes and of those
    the gate rejected, and how many it rejected in a row last
    (:class:`~stepscale_operator.cost_model.admission.StreamRecord`)."""

    recent_passes: float
    recent_rejected: float
    rejected_run: int


class MisfitBuckets:
    """Per coverage bucket, whether the model is wrong there (see the module)."""

    def __init__(
        self,
        half_life: float = 500.0,
        contrast_half_life: float = 50.0,
        stream_half_life: float = 16.0,
        min_others: float = 2.0,
        longest_stall: int = 400,
    ) -> None:
        self.half_life = float(half_life)
        self.contrast_half_life = float(contrast_half_life)
        self.stream_half_life = float(stream_half_life)
        self.min_others = float(min_others)
        self.longest_stall = int(longest_stall)
        self._decay = 2.0 ** (-1.0 / self.half_life)
        self._contrast_decay = 2.0 ** (-1.0 / self.contrast_half_life)
        self._stream_decay = 2.0 ** (-1.0 / self.stream_half_life)
        # Per bucket: the weighted share of its passes the gate rejected, of all of them
        # (persistence) and of those with a contrast.
        self.reject_rate = np.zeros(N_BUCKETS + 1)
        self.contrast_rate = np.zeros(N_BUCKETS + 1)

    def emptied(self) -> MisfitBuckets:
        """The same settings, nothing observed."""
        return MisfitBuckets(
            self.half_life,
            self.contrast_half_life,
            self.stream_half_life,
            self.min_others,
            self.longest_stall,
        )

    def misfit(self, buckets: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Per row: its bucket is one the model is wrong in."""
        share = np.maximum(self.reject_rate[buckets], self.contrast_rate[buckets])
        return share >= MISFIT_SHARE

    def shares(self) -> dict[int, float]:
        """Each misfit bucket -> the larger of its two shares of rejected passes."""
        share = np.maximum(self.reject_rate, self.contrast_rate)
        return {int(b): float(share[b]) for b in np.flatnonzero(share >= MISFIT_SHARE)}

    def observe(
        self,
        buckets: npt.NDArray[np.int64],
        rejected: npt.NDArray[np.bool_],
        slot: npt.NDArray[np.int64],
        streams: Sequence[RecentPasses],
    ) -> None:
        """Take one chunk of gated passes: each row's bucket, whether the gate rejected
        it, and its stream (``streams[slot]``). A chunk is taken at once: the other
        passes of a stream in the chunk count as concurrent with each row."""
        if buckets.shape[0] == 0:
            return
        _update_rates(self.reject_rate, self._decay, buckets, rejected)
        contrast = self._contrast(buckets, rejected, slot, streams)
        _update_rates(
            self.contrast_rate, self._contrast_decay, buckets[contrast], rejected[contrast]
        )

    def _contrast(
        self,
        buckets: npt.NDArray[np.int64],
        rejected: npt.NDArray[np.bool_],
        slot: npt.NDArray[np.int64],
        streams: Sequence[RecentPasses],
    ) -> npt.NDArray[np.bool_]:
        """Rows whose stream's other recent passes were mostly let in, whose stream's
        previous or next pass was, or that come after more rejections in a row than
        any stall (and updates each stream's recent passes)."""
        n_slots = len(streams)
        far = rejected.astype(np.float64)
        per_stream = np.bincount(slot, minlength=n_slots).astype(np.float64)
        far_stream = np.bincount(slot, weights=far, minlength=n_slots)
        # The same per (stream, bucket) pair, for each row (counted over the pairs'
        # range: cheaper than sorting the rows).
        pair = slot * (N_BUCKETS + 1) + buckets
        pair_n = np.bincount(pair)[pair]
        pair_far = np.bincount(pair, weights=far)[pair]
        prior_n = np.array([s.recent_passes for s in streams])
        prior_far = np.array([s.recent_rejected for s in streams])
        prior_run = np.array([s.rejected_run for s in streams], dtype=np.int64)
        keep = self._stream_decay**per_stream
        # Each of a stream's k rows in the chunk weighs the mean of the k newest
        # weights of the exponential memory, so the chunk adds what k passes in turn
        # would (at most the memory's 1 / (1 - decay) in all, however long it is).
        row_weight = np.where(
            per_stream > 0,
            (1.0 - keep) / (1.0 - self._stream_decay) / np.maximum(per_stream, 1.0),
            0.0,
        )
        after_n = prior_n * keep + row_weight * per_stream
        after_far = prior_far * keep + row_weight * far_stream
        run_before, next_let_in, run_after = _rejected_runs(rejected, slot, prior_run)
        # Every stream written back (one without rows here keeps its counts): plain
        # values in one pass, the cost of a batch spread over a hundred streams.
        for stream, n, n_rejected, run in zip(
            streams, after_n.tolist(), after_far.tolist(), run_after.tolist(), strict=True
        ):
            stream.recent_passes = n
            stream.recent_rejected = n_rejected
            stream.rejected_run = run
        # The stream's passes without this row's bucket in the chunk (its earlier
        # passes in that bucket stay in: the stream keeps no per-bucket counts).
        others_n = after_n[slot] - row_weight[slot] * pair_n
        others_far = after_far[slot] - row_weight[slot] * pair_far
        mostly_on_time = (others_n >= self.min_others) & (2.0 * others_far < others_n)
        # A pass right before or after one let in (a stall slows the passes around
        # it too), or one in a run of rejections longer than any stall.
        return mostly_on_time | (run_before == 0) | next_let_in | (run_before >= self.longest_stall)


def _rejected_runs(
    rejected: npt.NDArray[np.bool_],
    slot: npt.NDArray[np.int64],
    run_before: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """A chunk's rows in each stream's pass order (a stream's rows are in it): per
    row, how many of its stream's gated passes in a row the gate had rejected just
    before it (``run_before``: per stream, before the chunk) and whether its
    stream's next pass in the chunk was let in; per stream, the run after the chunk."""
    n = rejected.shape[0]
    order = np.argsort(slot, kind="stable")
    by_stream = slot[order]
    far = rejected[order]
    idx = np.arange(n)
    first = np.ones(n, dtype=bool)
    first[1:] = by_stream[1:] != by_stream[:-1]
    last = np.ones(n, dtype=bool)
    last[:-1] = first[1:]
    # The run after each row: rows since the stream's latest pass let in, or since its
    # first row here plus the run it came with.
    start = np.maximum.accumulate(np.where(first | ~far, idx, 0))
    carried = first[start] & far[start]
    run_after = np.where(
        far, idx - start + np.where(carried, 1 + run_before[by_stream[start]], 0), 0
    )
    before = np.empty(n, dtype=np.int64)
    before[1:] = run_after[:-1]
    before[first] = run_before[by_stream[first]]
    # The last row of a stream here does not know its next pass yet: no contrast.
    next_let_in = np.zeros(n, dtype=bool)
    next_let_in[:-1] = ~last[:-1] & ~far[1:]
    row_before = np.empty_like(before)
    row_before[order] = before
    row_next = np.empty_like(next_let_in)
    row_next[order] = next_let_in
    updated = run_before.copy()
    updated[by_stream[last]] = run_after[last]
    return row_before, row_next, updated


def _update_rates(
    rates: FloatArray,
    decay: float,
    buckets: npt.NDArray[np.int64],
    hit: npt.NDArray[np.bool_],
) -> None:
    """Exponentially weighted share of ``hit`` rows per bucket, in each bucket's own
    rows (chunk-level approximation; only the buckets present move)."""
    if buckets.shape[0] == 0:
        return
    # Counted over every bucket (a few hundred): cheaper than sorting the rows.
    n = np.bincount(buckets, minlength=rates.shape[0]).astype(np.float64)
    k = np.bincount(buckets, weights=hit.astype(np.float64), minlength=rates.shape[0])
    present = n > 0
    keep = decay ** n[present]
    rates[present] = rates[present] * keep + (1.0 - keep) * k[present] / n[present]
