"""Admission: which passes are learned, and with what robust weight.

A pass reaches the regression only if it is

1. **warm**: past the first ``warmup_passes`` passes of its stream since it (re)started
   (cold caches, compilation). Restarts and pass counts are the stream table's
   (:class:`~stepscale_operator.stream_state.StreamTable`); heartbeats are not samples;
2. **plausible** (:class:`Plausibility`): within the hard limits of
   :class:`~stepscale_operator.load_types.PassLimits` (``size``, ``rate``), at most
   ``budget_factor`` times the largest pass its stream had before (``budget``; at
   least ``budget_floor`` tokens), and, once the model has ``min_samples``, not more
   than ``fast_factor`` times faster than predicted about the centre (``fast``). A
   payload can be valid and still absurd (1e12 prompt tokens in 10 ms); such a pass
   would outweigh everything learned. Implausible passes are counted by reason;
3. **from a stream that agrees with the others** (:class:`StreamLedger`): a stream
   whose recent log residuals stay far from the other streams' (one vote per
   stream, so one pod sending most of the passes cannot outvote the rest) is
   *quarantined*: its passes are still predicted and scored against the pooled
   model, and it is let back once it agrees again, but nothing it sends is learned
   nor moves the residual centre. A pod whose clock or engine is broken in a
   plausible way (50x faster, 20x slower) cannot take the model over;
4. **not a stall** (:class:`ResidualGate`).
Stalls. On a shared CPU a pass can be stalled 10-30x by the scheduler, in *runs* of
up to a few hundred passes, so per-pass outlier tests on a short window fail: a run
fills the window, widens the scale, and the stalls get learned (that was the old
behaviour: ~2x predictions for thousands of passes). Here, residuals are
``log(y/pred)``; their median and MAD over a long window (``robust_window`` passes,
all residuals, rejected ones included) give a centre and a scale that a run shorter
than half the window cannot move much. A pass more than ``reject_k`` scales *slower*
than the centre is rejected (stalls only ever slow a pass; a pass faster than
predicted is not an outlier, the fit is simply too high). Accepted passes get Huber
weights on their relative residual about the centre, which bounds any pass's pull on
the fit. A bucket with little data gets a 3x wider gate and knee, and at least
``unlearned_factor`` (3x slower than predicted) whatever the noise, so an unlearned
regime is not mistaken for a stall. A bucket the model is wrong in (:mod:`.misfit`:
the gate keeps rejecting its passes, or rejects them while the same stream's other
passes are on time, or for longer than any stall) gets none rejected and every
pass at full weight, whatever the size (a kind of pass 4-30x its extrapolation is
learned so, in 160-440 of them when it is a fifth of the passes). A persistently
slower engine moves
the centre; while the median of the newest ``drift_window`` residuals is off by more
than ``drift_floor`` (3%: the bias the model tolerates) the model is *drifting* and
forgets at ``drift_half_life_passes`` without coverage floors, so it follows the
change in a few thousand passes whatever the half-life. The same test per regime
(:mod:`.regime_residuals`) catches a fit that is off in the rare prefill regime
alone, which the median of all residuals cannot see.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stepscale_operator.cost_model.features import FloatArray
from stepscale_operator.load_types import implausible_passes, over_budget, tally_implausible
from stepscale_operator.stream_state import StreamKey, stream_label


class Plausibility:
    """Hard limits, per-stream token budgets and the ``fast`` test, counted by reason."""

    def __init__(self, budget_factor: float, budget_floor: float, fast_factor: float) -> None:
        self.budget_factor = float(budget_factor)
        self.budget_floor = float(budget_floor)
        self._log_fast = math.log(max(float(fast_factor), 1.0))
        self.rejected: dict[str, int] = {}

    def implausible_input(
        self, sched: FloatArray, y: FloatArray, used: FloatArray, budgets: FloatArray
    ) -> npt.NDArray[np.bool_]:
        """Rows beyond hard limits or far beyond their stream's token budget (counted)."""
        code = implausible_passes(sched, y)
        beyond = (code == 0) & over_budget(used, budgets, self.budget_factor, self.budget_floor)
        tally_implausible(self.rejected, code, beyond)
        return (code > 0) | beyond

    def implausibly_fast(
        self, excess: FloatArray, eligible: npt.NDArray[np.bool_]
    ) -> npt.NDArray[np.bool_]:
        """``eligible`` rows more than ``fast_factor`` times faster than predicted about the
        residual centre (``excess``: log residual minus the centre; NaN: no prediction)."""
        fast = eligible & (np.nan_to_num(excess, nan=0.0) < -self._log_fast)
        if fast.any():
            self.rejected["fast"] = self.rejected.get("fast", 0) + int(np.count_nonzero(fast))
        return fast


class ResidualGate:
    """Median and MAD of a long window of log residuals: the centre and scale that the
    stall gate, the Huber weights and drift detection are taken about."""

    def __init__(
        self,
        window: int,
        every: int,
        huber_k: float,
        reject_k: float,
        bucket_trust: float,
        drift_k: float,
        drift_floor: float,
        drift_window: int = 500,
        unlearned_factor: float = 3.0,
    ) -> None:
        self.window = int(window)
        self.every = max(1, int(every))
        self.huber_k = float(huber_k)
        self.reject_k = float(reject_k)
        self.bucket_trust = float(bucket_trust)
        self.unlearned_factor = max(float(unlearned_factor), 1.0)
        self.drift_k = float(drift_k)
        self.drift_floor = float(drift_floor)
        self.drift_window = max(1, min(int(drift_window), self.window))
        self._ring = np.zeros(self.window)
        self.length = 0
        self._pos = 0
        self._since = 0  # residuals pushed since the centre and scale were computed
        # Residuals the window needs before its median replaces the centre and scale
        # (raised after a warm start so the restored ones hold for a while).
        self.min_length = 20
        self.scale = math.nan
        self.center = 0.0

    def emptied(self) -> ResidualGate:
        """A gate with the same settings and no residuals."""
        gate = ResidualGate(
            self.window,
            self.every,
            self.huber_k,
            self.reject_k,
            self.bucket_trust,
            self.drift_k,
            self.drift_floor,
            self.drift_window,
            self.unlearned_factor,
        )
        return gate

    @property
    def active(self) -> bool:
        """True once there is a scale to gate by."""
        return math.isfinite(self.scale)

    def restore(self, center: float, scale: float, count: int) -> None:
        """A snapshot's centre and scale, held until a quarter of the window is new."""
        self.center = center
        self.scale = scale
        self.min_length = max(20, min(self.window // 4, count))

    def drifting(self) -> bool:
        """The median of the newest ``drift_window`` (500) log residuals is the model's
        bias on recent passes. A stall run moves it little unless it fills half that
        window (the runs seen on a shared CPU are up to ~110 passes); an engine (or a
        machine) that became slower or faster moves it for good. While it is off by
        more than ``drift_floor`` (the bias the model tolerates, 3%) and ``drift_k``
        scales, the model forgets fast (see
        :class:`~stepscale_operator.cost_model.regression.Regression`). Judged once
        ``drift_window`` residuals are in (not half the long window: a model that
        learned a slow start was 10% off for 500 passes more before it was judged)."""
        if self.length < self.drift_window or not self.active:
            return False
        recent = self.recent_median()
        return abs(recent) > max(self.drift_k * self.scale, self.drift_floor)

    def recent_median(self) -> float:
        """Median of the newest ``drift_window`` residuals (O(that) per call)."""
        k = min(self.length, self.drift_window)
        idx = (self._pos - 1 - np.arange(k)) % self.window
        return float(np.median(self._ring[idx]))

    def weights(
        self,
        rel: FloatArray,
        log_res: FloatArray,
        buckets: npt.NDArray[np.int64],
        uncovered: npt.NDArray[np.bool_],
        bucket_counts: FloatArray,
        misfit: npt.NDArray[np.bool_],
    ) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
        """Huber weights about the residual centre; passes far on the slow side get 0.
        Also returns which passes it rejected.

        Stalls (the OS or a neighbour took the CPU) only ever make a pass slower, by
        up to 30x, and come in runs of hundreds of passes. So the gate is one-sided
        and its centre and scale are the median and MAD of a long window of *all*
        residuals: a stall run shorter than half the window cannot open it, while a
        persistently slower engine moves the median and is learned. A pass that is
        faster than predicted is never rejected (the fit is too high; let it learn).
        Buckets with little data get a wider gate, so a regime the model has not
        learned yet is not mistaken for a stall, and buckets it keeps rejecting none
        (the model is wrong there: full weight); passes
        of a regime with fewer than ``min_regime_samples`` learned (``uncovered``) are
        never gated: the model cannot know their cost yet (after a long decode-only
        stretch, a prefill pass can be 10x slower than predicted and still be right).
        """
        scale = self.scale
        n = log_res.shape[0]
        if not math.isfinite(scale):
            return np.ones(n), np.zeros(n, dtype=bool)
        r = np.nan_to_num(log_res, nan=0.0)
        excess = r - self.center
        # A bucket is trusted once it holds data (a misfit one's passes are taken
        # whole below, whichever it is).
        trusted = bucket_counts[buckets] >= self.bucket_trust
        # Huber on the relative residual (what the weighted least squares sees, so a
        # pass's pull is bounded by the knee whatever its size), taken about the
        # centre: after an engine change every pass is off, and all must count fully.
        abs_rel = np.abs(np.expm1(excess))
        knee = self.huber_k * scale
        gate = self.reject_k * scale
        # An unlearned regime (an untrusted bucket) is off by the model's error, not by
        # noise: its knee and gate are 3x as wide, and never narrower than
        # ``unlearned_factor`` (full weight up to 3x slower than predicted; stalls are
        # 10-30x). Tied to the scale alone, a quiet GPU's (~0.04) let 1.43x through:
        # the first 2,048-token chunks of an H200 run, 2.2-2.9x their extrapolation,
        # were rejected as stalls for 400 passes and predicted 40-65% low meanwhile.
        knee_untrusted = max(3.0 * knee, self.unlearned_factor - 1.0)
        gate_untrusted = max(3.0 * gate, math.log(self.unlearned_factor))
        weight = np.minimum(
            1.0, np.where(trusted, knee, knee_untrusted) / np.maximum(abs_rel, 1e-300)
        )
        beyond = np.where(trusted, excess > gate, excess > gate_untrusted) & ~uncovered
        rejected = beyond & ~misfit
        weight[rejected] = 0.0
        # In a misfit bucket the model is wrong: its passes count fully, whatever the
        # size (chunks over a cached prefix 4x or more their extrapolation were
        # rejected for as long as they came, and, let in at the unlearned knee's
        # weight, took 380-960 of them to learn).
        weight[misfit] = 1.0
        return weight, rejected

    def push(self, log_res: FloatArray) -> None:
        for chunk_start in range(0, log_res.shape[0], self.window):
            part = log_res[chunk_start : chunk_start + self.window]
            idx = (self._pos + np.arange(part.shape[0])) % self.window
            self._ring[idx] = part
            self._pos = int((self._pos + part.shape[0]) % self.window)
            self.length = min(self.window, self.length + part.shape[0])
        self._since += log_res.shape[0]
        # The median is O(window): recompute it every robust_every residuals (sooner
        # while the window is short), so a sample costs O(window / robust_every).
        due = self._since >= min(self.every, max(1, self.length // 4))
        if self.length >= self.min_length and (due or not math.isfinite(self.scale)):
            self._update()

    def _update(self) -> None:
        """Median and MAD of the residual window: the gate's centre and scale."""
        self._since = 0
        ring = self._ring[: self.length]
        # Median and MAD about it over a long window: robust to stall runs, but a
        # persistently changed engine shifts the median and re-opens the gate.
        center = float(np.median(ring))
        mad = float(np.median(np.abs(ring - center)))
        self.center = center
        # Floor at 1% so noise-free data does not turn every rounding error into an outlier.
        self.scale = max(1.4826 * mad, 0.01)


@dataclass
class StreamRecord:
    """What the cost model knows about one stream's passes (not its sequence: that is
    the stream table's)."""

    samples: int = 0
    outliers: int = 0
    n_eff: float = 0.0  # exponentially weighted count of predicted passes
    sum_rel: float = 0.0  # exponentially weighted sums of relative residuals
    sum_abs_rel: float = 0.0
    sum_log: float = 0.0  # and of log residuals (what consistency is judged on)
    budget: float = 0.0  # largest prefill tokens + decode requests of a learned pass
    # Exponentially weighted counts of its recent gated passes and of those the gate
    # rejected (short memory: :class:`~stepscale_operator.cost_model.misfit.MisfitBuckets`).
    recent_passes: float = 0.0
    recent_rejected: float = 0.0
    rejected_run: int = 0  # its latest gated passes the gate rejected, in a row
    quarantined: bool = False
    quarantines: int = 0  # times it was quarantined
    judged: bool = False  # has had enough predicted passes to be compared with the others

    @property
    def mean_log_residual(self) -> float:
        """Recent mean of ``log(actual / predicted)``; NaN before any prediction."""
        return self.sum_log / self.n_eff if self.n_eff else math.nan


class StreamLedger:
    """Per-stream budgets, residual tallies and quarantine, bounded in size.

    Consistency is judged on each stream's recent mean log residual against those
    of the other streams with enough passes, one vote per stream: residuals shared
    by every stream are the model's error, residuals of one stream alone are that
    stream's. A stream that more than half of the others are farther than
    ``log(quarantine_factor)`` from is quarantined; it is let back once at least
    half of them are within ``log(release_factor)`` of it.
    At least ``min_voters`` other streams must have voted, so a deployment of one or
    two pods is never judged (two pods that disagree cannot tell which is wrong).
    """

    def __init__(
        self,
        max_streams: int,
        half_life_passes: float,
        quarantine_factor: float = 1.5,
        release_factor: float = 1.2,
        min_passes: float = 30.0,
        min_voters: int = 2,
    ) -> None:
        self.max_streams = int(max_streams)
        self._decay = 2.0 ** (-1.0 / float(half_life_passes))
        self._enter = math.log(max(quarantine_factor, 1.0 + 1e-9))
        self._leave = math.log(max(min(release_factor, quarantine_factor), 1.0))
        self.min_passes = float(min_passes)
        self.min_voters = int(min_voters)
        # Least recently active first, so evicting the oldest stream is O(1).
        self._records: OrderedDict[StreamKey, StreamRecord] = OrderedDict()

    def records(self, keys: list[StreamKey]) -> list[StreamRecord]:
        """The record of each key (created if new, marked most recently active)."""
        out = []
        for key in keys:
            record = self._records.get(key)
            if record is None:
                if len(self._records) >= self.max_streams:
                    self._records.popitem(last=False)
                record = self._records[key] = StreamRecord()
            else:
                self._records.move_to_end(key)
            out.append(record)
        return out

    def forget(self, key: StreamKey) -> None:
        """Drop a stream's record (its pod is gone)."""
        self._records.pop(key, None)

    def items(self) -> list[tuple[StreamKey, StreamRecord]]:
        """Every (key, record), least recently active first."""
        return list(self._records.items())

    def budgets(self, records: list[StreamRecord], slot: npt.NDArray[np.int64]) -> FloatArray:
        """Each row's stream token budget."""
        return np.array([r.budget for r in records])[slot]

    def raise_budgets(
        self,
        used: FloatArray,
        accepted: npt.NDArray[np.bool_],
        slot: npt.NDArray[np.int64],
        records: list[StreamRecord],
    ) -> None:
        """Grow each stream's token budget to the largest pass it had accepted."""
        if not accepted.any():
            return
        largest = np.zeros(len(records))
        np.maximum.at(largest, slot[accepted], used[accepted])
        for j in np.flatnonzero(largest):
            records[int(j)].budget = max(records[int(j)].budget, float(largest[j]))

    def tally(
        self,
        rel: FloatArray,
        log_res: FloatArray,
        scored: npt.NDArray[np.bool_],
        learned: npt.NDArray[np.bool_],
        accepted: npt.NDArray[np.bool_],
        slot: npt.NDArray[np.int64],
        records: list[StreamRecord],
    ) -> None:
        """Per-stream sample and outlier counts (``learned`` rows) and recent residuals
        (``scored`` rows: every plausible predicted pass, quarantined ones included)."""
        n_slots = len(records)
        finite = np.isfinite(rel) & scored
        counts = np.bincount(slot[learned], minlength=n_slots)
        outliers = np.bincount(slot[learned & ~accepted], minlength=n_slots)
        pred_counts = np.bincount(slot[finite], minlength=n_slots)
        sum_rel = np.bincount(slot[finite], weights=rel[finite], minlength=n_slots)
        sum_abs = np.bincount(slot[finite], weights=np.abs(rel[finite]), minlength=n_slots)
        sum_log = np.bincount(slot[finite], weights=log_res[finite], minlength=n_slots)
        for s in np.flatnonzero(counts + pred_counts):
            record = records[int(s)]
            record.samples += int(counts[s] - outliers[s])
            record.outliers += int(outliers[s])
            k = float(pred_counts[s])
            if k:
                # Batch-level approximation of a per-sample exponential average.
                keep = self._decay**k
                record.n_eff = record.n_eff * keep + k
                record.sum_rel = record.sum_rel * keep + float(sum_rel[s])
                record.sum_abs_rel = record.sum_abs_rel * keep + float(sum_abs[s])
                record.sum_log = record.sum_log * keep + float(sum_log[s])

    @property
    def can_judge(self) -> bool:
        """True when there are enough streams for one to be outvoted."""
        return len(self._records) > self.min_voters

    def on_probation(self, records: list[StreamRecord]) -> npt.NDArray[np.bool_]:
        """Per stream: not judged yet while judging is possible (a new pod among many is
        not learned from until it has shown it agrees with the others)."""
        if not self.can_judge:
            return np.zeros(len(records), dtype=bool)
        return np.array([not r.judged for r in records], dtype=bool)

    def judge(self) -> list[StreamRecord]:
        """Quarantine the streams that disagree with the others; release those that agree.

        Returns the streams quarantined by this call. O(streams log streams) per call;
        called once per learned chunk.
        """
        voters = [(k, r) for k, r in self._records.items() if r.n_eff >= self.min_passes]
        for _, record in voters:
            record.judged = True
        if len(voters) <= self.min_voters:
            return []  # too few to outvote anyone: no one's standing changes
        residuals = np.array([r.mean_log_residual for _, r in voters])
        # Judged by how many of the others it agrees with, not by their median: with
        # one bad stream among three, the median of a good one's two others is
        # halfway to the bad one. Counted on the sorted residuals (O(n log n)).
        agree_leave = _agreeing_others(residuals, self._leave).tolist()
        agree_enter = _agreeing_others(residuals, self._enter).tolist()
        n_others = len(voters) - 1
        entered = []
        for (_, record), leave, enter in zip(voters, agree_leave, agree_enter, strict=True):
            if record.quarantined:
                # Back once at least half of the others agree with it closely.
                record.quarantined = 2 * leave < n_others
            elif 2 * enter < n_others:
                record.quarantined = True
                record.quarantines += 1
                entered.append(record)
        return entered

    def quarantined(self) -> dict[str, float]:
        """``worker_id/dp_rank`` of each quarantined stream -> its relative error against
        the other streams (``0.5``: its passes run 50% slower than the model predicts
        for the others)."""
        voters = [r for r in self._records.values() if r.n_eff >= self.min_passes]
        out: dict[str, float] = {}
        for key, record in self._records.items():
            if not record.quarantined:
                continue
            others = [v.mean_log_residual for v in voters if v is not record]
            centre = float(np.median(others)) if others else 0.0
            out[stream_label(key)] = math.expm1(record.mean_log_residual - centre)
        return out


def _agreeing_others(values: FloatArray, within: float) -> npt.NDArray[np.int64]:
    """For each value, how many of the other values lie within ``within`` of it."""
    ordered = np.sort(values)
    upper = np.searchsorted(ordered, values + within, side="right")
    lower = np.searchsorted(ordered, values - within, side="left")
    return (upper - lower - 1).astype(np.int64)
