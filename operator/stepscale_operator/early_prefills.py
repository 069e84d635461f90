"""The prefill passes a request meets over its first passes, measured from the streams.

A short output's ITL is the mean of a few passes, so it is slow when some of them
carry another prompt's prefill. Those passes are not a stationary draw: a request
comes out of its own prefill, and prompts that queued behind it or arrived with it
(a clump of parallel calls, a retry storm) are prefilled next, on the passes right
after its first token. On held fleets of the simulator the passes after a finished
prefill carried prefill 1.6-4.7 times as often as passes at large over the first
two, and 1.6-2.6 times over the first twelve; a latency model that started its
chain of prefill passes from the stationary share put the p99 ITL of clustered
traffic 13-31% low on few replicas (docs/planner-history.md, 2026-11-30).

No FPM field names a request, but every pass says whether it carried prefill and
how many prompts finished prefill there (the load estimator's count: prefill
requests less the one a full pass leaves partial). For a prompt that finished in
pass ``j`` and each ``m`` of :data:`SPANS`, the count ``K`` of passes among
``j + 1 .. j + m`` that carry prefill is what a request of ``m`` intervals from
that prompt would meet. Per span, over the window: the finished prompts, their
``sum K`` and ``sum K^2``; with the passes and prefill passes at large, that gives

* the **lift**: the share of prefill passes over a request's first ``m`` passes,
  over the share among all passes (1: no different); the latency model multiplies
  the share it predicts at any count by it, and
* the **overdispersion** ``rho`` of ``K`` over a binomial of that share
  (``Var K = m q (1 - q) (1 + (m - 1) rho)``): a beta-binomial of the two moments
  matched the measured tails of ``K`` within about 10% on four scenarios.

An idle engine runs no passes, so a heartbeat ends the run of passes: a prompt
whose ``m`` passes would span one is not counted at that span (its request ended
before the engine went idle, or never had ``m`` intervals). Pure numpy; the load
estimator calls :meth:`EarlyPrefillEstimator.observe` per stream and reads
:meth:`EarlyPrefillEstimator.measured` with its estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# Intervals after a request's first token at which its prefill passes are counted;
# the latency model interpolates between them (short outputs set the ITL tail).
SPANS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
_LONGEST = SPANS[-1]
# Columns of a bucket: passes, prefill passes, then per span finished, sum K, sum K^2.
_PASSES, _PREFILL_PASSES = 0, 1
_N_COLS = 2 + 3 * len(SPANS)
# Fewer finished prompts than this in the window at a span say nothing of its tail.
MIN_FINISHED = 100.0


@dataclass(frozen=True)
class EarlyPrefills:
    """What a request meets over its first ``m`` passes, per measured span ``m``."""

    spans: tuple[int, ...]
    lift: tuple[float, ...]  # share of prefill passes there over the share at large
    overdispersion: tuple[float, ...]  # rho of the count over a binomial (0 at m = 1)

    def at(self, m: int) -> tuple[float, float]:
        """(lift, rho) at ``m`` intervals: linear in log m between the measured
        spans, the nearest beyond them."""
        x = math.log(max(m, 1))
        logs = [math.log(s) for s in self.spans]
        lift = float(np.interp(x, logs, self.lift))
        rho = float(np.interp(x, logs, self.overdispersion))
        return lift, rho


def beta_binomial_pmf(m: int, share: float, rho: float) -> FloatArray:
    """P(K = k), k = 0..m, of ``m`` passes each carrying prefill with a share drawn
    from a beta of mean ``share`` and intra-class correlation ``rho`` (0: binomial)."""
    q = min(max(share, 0.0), 1.0)
    k = np.arange(m + 1, dtype=np.float64)
    log_choose = np.array(
        [math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1) for i in range(m + 1)]
    )
    if q <= 0.0 or q >= 1.0:
        out = np.zeros(m + 1)
        out[m if q >= 1.0 else 0] = 1.0
        return out
    if rho <= 1e-9 or m == 1:
        logp = log_choose + k * math.log(q) + (m - k) * math.log1p(-q)
        return np.exp(logp)
    total = 1.0 / min(rho, 1.0 - 1e-9) - 1.0  # alpha + beta
    a, b = q * total, (1.0 - q) * total
    lbeta_ab = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    lbeta = np.array(
        [math.lgamma(i + a) + math.lgamma(m - i + b) - math.lgamma(m + a + b) for i in range(m + 1)]
    )
    p = np.exp(log_choose + lbeta - lbeta_ab)
    return p / p.sum()


class EarlyPrefillEstimator:
    """Per-span sums over a sliding window of ``bucket_s`` buckets (see the module
    docstring). Streams are numbered slots, as the load estimator keeps them."""

    def __init__(self, window_s: float = 30.0, bucket_s: float = 1.0) -> None:
        self.window_s = float(window_s)
        self.bucket_s = float(bucket_s)
        self._n_window = int(math.ceil(self.window_s / self.bucket_s))
        self._ring = np.zeros((self._n_window + 1, _N_COLS))
        self._bucket_id = np.full(self._n_window + 1, -1, dtype=np.int64)
        # Per slot, its last passes (at most the longest span): prefill flag,
        # prompts finished, and the run of passes each belongs to.
        self._history: dict[int, tuple[FloatArray, FloatArray, npt.NDArray[np.int64]]] = {}
        self._run: dict[int, int] = {}  # per slot: its current run of passes

    def forget(self, slot: int) -> None:
        """Drop a stream's history (its pod is gone, or the slot is reused)."""
        self._history.pop(slot, None)
        self._run.pop(slot, None)

    def observe(
        self, slot: int, wall: FloatArray, prefill: FloatArray, finished: FloatArray, now: float
    ) -> None:
        """A stream's new messages, in order: wall time (0: a heartbeat), whether the
        pass carried prefill (> 0) and the prompts that finished prefill there."""
        if wall.shape[0] == 0:
            return
        beat = wall <= 0.0
        run = self._run.get(slot, 0) + np.cumsum(beat)
        self._run[slot] = int(run[-1])
        passes = ~beat
        if not passes.any():
            return
        old_pre, old_fin, old_run = self._history.get(
            slot, (np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
        )
        pre = np.concatenate([old_pre, (prefill[passes] > 0.0).astype(np.float64)])
        fin = np.concatenate([old_fin, finished[passes]])
        runs = np.concatenate([old_run, run[passes]])
        kept = old_pre.shape[0]
        row = np.zeros(_N_COLS)
        row[_PASSES] = pre.shape[0] - kept
        row[_PREFILL_PASSES] = pre[kept:].sum()
        cum = np.concatenate([[0.0], np.cumsum(pre)])
        for i, m in enumerate(SPANS):
            # Prompts whose m passes end in this batch (earlier ones were counted).
            j = np.arange(max(kept - m, 0), pre.shape[0] - m)
            if j.size == 0:
                continue
            count = cum[j + 1 + m] - cum[j + 1]
            weight = np.where(runs[j] == runs[j + m], fin[j], 0.0)
            row[2 + 3 * i] += weight.sum()
            row[3 + 3 * i] += weight @ count
            row[4 + 3 * i] += weight @ (count * count)
        self._history[slot] = (pre[-_LONGEST:], fin[-_LONGEST:], runs[-_LONGEST:])
        bucket = int(math.floor(now / self.bucket_s))
        pos = bucket % self._ring.shape[0]
        if self._bucket_id[pos] != bucket:
            self._ring[pos] = 0.0
            self._bucket_id[pos] = bucket
        self._ring[pos] += row

    def measured(self, now: float) -> EarlyPrefills | None:
        """The lift and overdispersion per span over the window (None: too few
        prompts finished, or no prefill pass, to tell)."""
        bucket = int(math.floor(now / self.bucket_s))
        inside = (self._bucket_id >= 0) & (self._bucket_id > bucket - self._n_window)
        totals = self._ring[inside & (self._bucket_id <= bucket)].sum(axis=0)
        if totals[_PASSES] <= 0.0 or totals[_PREFILL_PASSES] <= 0.0:
            return None
        share = totals[_PREFILL_PASSES] / totals[_PASSES]
        spans: list[int] = []
        lifts: list[float] = []
        rhos: list[float] = []
        for i, m in enumerate(SPANS):
            n, s1, s2 = totals[2 + 3 * i : 5 + 3 * i]
            if n < MIN_FINISHED:
                continue
            mean = s1 / n
            q = min(mean / m, 1.0)
            spans.append(m)
            lifts.append(q / share)
            if m == 1 or q <= 0.0 or q >= 1.0:
                rhos.append(0.0)
                continue
            var = max(s2 / n - mean * mean, 0.0)
            rhos.append(min(max((var / (m * q * (1.0 - q)) - 1.0) / (m - 1), 0.0), 1.0))
        if not spans:
            return None
        if len(rhos) > 1 and spans[0] == 1:
            rhos[0] = rhos[1]  # a single pass has none; keep the interpolation flat
        return EarlyPrefills(tuple(spans), tuple(lifts), tuple(rhos))
