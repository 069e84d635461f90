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
that prompt would meet, and ``s``, the share of prefill passes among its stream's
last :data:`SHARE_PASSES` passes (up to its own), what a pass there carries at
large. Per span, over the window, weighted by the prompts that finished:

* the **lift** ``sum K / (m sum s)``: how much more often a request's first ``m``
  passes carry prefill than its replica's passes at large (1: no different); the
  latency model multiplies the share it predicts at any count by it (carried to
  another count with the router's pick, see ``latency_model``). Against each
  replica's own share, not the fleet's: pooled, a replica busy with prefill and
  one left nearly idle read as clumping (on the simulator's silence-burst
  scale-up the pooled lift reached 7 and held 35 replicas where 4 would do);
* the **overdispersion** ``rho`` of ``K`` around ``m`` times that lift times ``s``
  over a binomial's (``Var K = m q (1 - q) (1 + (m - 1) rho)``): a beta-binomial
  of the two moments matched the measured tails of ``K`` within about 10% on four
  scenarios.

A prompt counts once its stream has :data:`SHARE_PASSES` passes up to it (a
replica that just joined has no share yet: its first passes are all prefill), and
not where a prompt or more waited there on average over those passes' time; and
none of a stream's prompts count while a prompt or more waited there on average
over the busy time of its passes in the window. That is a backlog, and what
follows a finish in a backlog is the next prompt in it, which a count with room
would not have: on silence-burst's first burst one replica's backlog read as a
lift of 7 and an overdispersion of 1 and sent the planner to 26 replicas where
4 would do (the backlog rules size that fleet; the model goes back to its
chain). Over the passes' time, not their count: a backlog's passes are the long
ones, and counted by passes the same burst on seed 1 slipped through at 1.7-2.3
prompts waiting per replica and sent the planner to 14. Per stream, not over
the streams together: the first prompts of a burst have calm passes behind them
and the backlog after, and when four replicas joined one still working off its
burst (seed 1 again) the fleet as a whole waited under a prompt, the old
replica's burst read as a lift of 3.8 and an overdispersion of 0.63, and the
planner went from 5 replicas to 12 where 5 did.

Every prompt counts at every span, whether its request lasted that long or not.
A pass that decodes nothing, or the first after an idle second's heartbeat, says
the prompt's request had ended (an idle engine runs no passes and sends no
heartbeat for under a second): a request with ``m`` intervals would have kept
the engine stepping, and the prompt that woke it would have come some time into
passes it never ran. So ``K`` counts the passes up to that one as they were, and
the rest of the span as a binomial at the share of prefill among the stream's
passes that decode (what a decode meets at large; its mean and variance enter
the sums). Counted across such passes, every short request on a replica with
room met the prompt that woke its engine next: on bursty code held at 16
replicas the lift read 1.7-20 times what the requests of 2-8 tokens had; and
counted only where the stream kept stepping ``m`` passes (heartbeats alone
ended a count until 2026-12-01, fifth), the prompts that count on a roomy
replica are those with company. Pure numpy; the load estimator calls
:meth:`EarlyPrefillEstimator.observe` per stream and reads
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
# The passes a finished prompt's stream share is taken over (up to its own): long
# against the spans, so the share is the replica's load and not the clump; short
# against the window, so a replica that just joined or was just left idle is
# judged by its own recent passes.
SHARE_PASSES = 512
_LONGEST = SPANS[-1]
_KEEP = SHARE_PASSES + _LONGEST
# Per pass in a stream's history: prefill flag, prompts finished, prompts waiting,
# its run (heartbeats part runs), wall time, decoding flag.
_HISTORY_COLS = 6
# Columns of a bucket per span: sum f, f K, f K^2, f s, f s^2, f K s over the finished
# prompts f (weights), their counts K and their stream's share s; then the passes'
# time and the prompts waiting times it (their time-weighted mean, over the time).
_PER_SPAN = 6
_BUSY_S = _PER_SPAN * len(SPANS)
_WAITING_S = _BUSY_S + 1
_N_COLS = _WAITING_S + 1
# Passes a stream buffers before they are counted (see EarlyPrefillEstimator).
_RUN = 1024
# Fewer finished prompts than this in the window at a span say nothing of its tail.
MIN_FINISHED = 100.0
_NEVER = np.iinfo(np.int64).min // 2  # the last bucket of a row never written


@dataclass(frozen=True)
class EarlyPrefills:
    """What a request meets over its first ``m`` passes, per measured span ``m``."""

    spans: tuple[int, ...]
    lift: tuple[float, ...]  # share of prefill passes there over the share at large
    overdispersion: tuple[float, ...]  # rho of the count over a binomial (0 at m = 1)

    def scaled(self, factor: float) -> EarlyPrefills:
        """The same measurement with every lift times ``factor`` (the overdispersion
        kept): what the latency model carries to another replica count."""
        return EarlyPrefills(
            self.spans, tuple(lift * factor for lift in self.lift), self.overdispersion
        )

    def at(self, m: int) -> tuple[float, float]:
        """(lift, rho) at ``m`` intervals: linear in log m between the measured
        spans, the nearest beyond them."""
        lift, rho = self.up_to(m)
        return float(lift[-1]), float(rho[-1])

    def up_to(self, longest: int) -> tuple[FloatArray, FloatArray]:
        """(lift, rho) at 1..``longest`` intervals, as :meth:`at` gives each."""
        x = np.log(np.arange(1, max(longest, 1) + 1))
        logs = np.log(np.array(self.spans, dtype=np.float64))
        return np.interp(x, logs, self.lift), np.interp(x, logs, self.overdispersion)


def beta_binomial_rows(shares: FloatArray, rhos: FloatArray) -> FloatArray:
    """Beta-binomials for m = 1..M at once (M = ``shares.size``): row ``m - 1``
    holds P(K = k), k = 0..m, of ``m`` passes each carrying prefill with a share
    drawn from a beta of mean ``shares[m - 1]`` and intra-class correlation
    ``rhos[m - 1]`` (0: binomial), zero beyond ``m``: the planner asks for every
    short span at every count it weighs."""
    return beta_binomials(np.arange(1, shares.size + 1), shares, rhos)


def beta_binomials(
    passes: npt.NDArray[np.int64], shares: FloatArray, rhos: FloatArray
) -> FloatArray:
    """One beta-binomial per row: row ``i`` holds P(K = k), k = 0..max(passes), of
    ``passes[i]`` passes each carrying prefill with a share drawn from a beta of
    mean ``shares[i]`` and intra-class correlation ``rhos[i]`` (0: binomial), zero
    beyond ``passes[i]``. By the ratio of consecutive terms, in logs, so every
    row is one array expression."""
    longest = int(passes.max()) if passes.size else 0
    m = passes.astype(np.float64)[:, None]
    k = np.arange(longest, dtype=np.float64)[None, :]  # P(k + 1) / P(k)
    q = np.clip(shares, 1e-12, 1.0 - 1e-12)[:, None]
    rho = np.clip(rhos, 0.0, 1.0 - 1e-9)[:, None]
    below = k < m
    safe_m = np.where(below, m, k + 1.0)  # rows' unused terms kept finite
    binomial_step = np.log((safe_m - k) / (k + 1.0) * q / (1.0 - q))
    binomial_first = m[:, 0] * np.log1p(-q[:, 0])
    total = np.where(rho > 1e-9, 1.0 / np.maximum(rho, 1e-9) - 1.0, 1.0)  # alpha + beta
    a, b = q * total, (1.0 - q) * total
    beta_step = np.log((safe_m - k) * (k + a) / ((k + 1.0) * (safe_m - k - 1.0 + b)))
    beta_first = np.where(below, np.log(b + k) - np.log(total + k), 0.0).sum(axis=1)
    beta = (rho[:, 0] > 1e-9) & (m[:, 0] > 1.0)
    step = np.where(below, np.where(beta[:, None], beta_step, binomial_step), 0.0)
    first = np.where(beta, beta_first, binomial_first)
    logp = first[:, None] + np.concatenate(
        [np.zeros((m.shape[0], 1)), np.cumsum(step, axis=1)], axis=1
    )
    inside = np.arange(longest + 1)[None, :] <= m
    p = np.where(inside, np.exp(np.where(inside, logp, 0.0)), 0.0)
    return p / p.sum(axis=1, keepdims=True)


class EarlyPrefillEstimator:
    """Per-span sums over a sliding window of ``bucket_s`` buckets (see the module
    docstring). Streams are numbered slots, as the load estimator keeps them.

    A stream's passes are buffered and counted in runs of at least :data:`_RUN`
    (or when :meth:`measured` is asked), so the per-call cost is paid rarely; a
    run's sums go to the bucket of its last message."""

    def __init__(self, window_s: float = 30.0, bucket_s: float = 1.0) -> None:
        self.window_s = float(window_s)
        self.bucket_s = float(bucket_s)
        self._n_window = int(math.ceil(self.window_s / self.bucket_s))
        # Per stream, per bucket, the sums (a stream is judged on its own window:
        # see measured). Rows are streams; a forgotten stream's row keeps its
        # buckets until they leave the window, then serves a new stream.
        self._ring = np.zeros((4, self._n_window + 1, _N_COLS))
        self._bucket_id = np.full(self._n_window + 1, -1, dtype=np.int64)
        self._row_of: dict[int, int] = {}  # slot -> its row (rows not in it are free)
        self._row_last = np.full(4, _NEVER, dtype=np.int64)  # per row: its last bucket
        # Per slot, its last passes (_KEEP at most), one row each (_HISTORY_COLS).
        self._history: dict[int, FloatArray] = {}
        self._run: dict[int, int] = {}  # per slot: its current run of passes
        self._seen: dict[int, int] = {}  # per slot: passes seen
        self._pending: dict[int, list[FloatArray]] = {}  # per slot: passes not counted yet
        self._pending_rows: dict[int, int] = {}
        self._pending_time: dict[int, float] = {}  # per slot: its last message's time

    def forget(self, slot: int) -> None:
        """Drop a stream's history (its pod is gone, or the slot is reused)."""
        self._flush(slot)
        # Its row's sums stay in the window until they age; then the row is free.
        self._row_of.pop(slot, None)
        self._history.pop(slot, None)
        self._run.pop(slot, None)
        self._seen.pop(slot, None)

    def observe(
        self,
        slot: int,
        wall: FloatArray,
        prefill: FloatArray,
        finished: FloatArray,
        waiting: FloatArray,
        decoding: FloatArray,
        now: float,
    ) -> None:
        """A stream's new messages, in order: wall time (0: a heartbeat), whether the
        pass carried prefill (> 0), the prompts that finished prefill there, the
        prompts left waiting in its queue and the requests it decoded."""
        if wall.shape[0] == 0:
            return
        beat = wall <= 0.0
        current = self._run.get(slot, 0)
        if beat.any():  # heartbeats: the passes after each belong to a new run
            run = current + np.cumsum(beat)
            self._run[slot] = int(run[-1])
            passes = ~beat
            if not passes.any():
                return
            prefill, finished, waiting = prefill[passes], finished[passes], waiting[passes]
            wall, decoding = wall[passes], decoding[passes]
            runs = run[passes].astype(np.float64)
        else:
            runs = np.full(wall.shape[0], float(current))
        self._pending.setdefault(slot, []).append(
            np.concatenate([prefill > 0.0, finished, waiting, runs, wall, decoding > 0.0])
        )
        self._pending_rows[slot] = self._pending_rows.get(slot, 0) + runs.shape[0]
        self._pending_time[slot] = now
        if self._pending_rows[slot] >= _RUN:
            self._flush(slot)

    def _flush(self, slot: int) -> None:
        """Count a stream's buffered passes (every span at once)."""
        pending = self._pending.pop(slot, None)
        self._pending_rows.pop(slot, None)
        now = self._pending_time.pop(slot, None)
        if not pending or now is None:
            return
        old = self._history.get(slot, np.zeros((0, _HISTORY_COLS)))
        # Each buffered call is its columns end to end.
        rows = np.concatenate([old, *(p.reshape(_HISTORY_COLS, -1).T for p in pending)])
        pre, fin, runs, wall, dec = rows[:, 0], rows[:, 1], rows[:, 3], rows[:, 4], rows[:, 5]
        waiting_s = rows[:, 2] * wall
        kept, end = old.shape[0], rows.shape[0]
        # Stream pass number of each row: a prompt counts once its stream has
        # SHARE_PASSES passes up to it, so its share and backlog are known.
        first_number = self._seen.get(slot, 0) - kept
        self._seen[slot] = first_number + end
        self._history[slot] = rows[-_KEEP:]
        # Prompts whose last counted pass is new: finished in j, span m, j + m >= kept.
        lo = max(kept - _LONGEST, SHARE_PASSES - 1 - first_number, 0)
        j = np.arange(lo, end - 1)
        j = j[fin[j] > 0.0]
        row = np.zeros(_N_COLS)
        row[_BUSY_S] = wall[kept:].sum()
        row[_WAITING_S] = waiting_s[kept:].sum()
        if j.size == 0:
            self._add(slot, row, now)
            return
        cum = np.concatenate([[0.0], np.cumsum(pre)])
        back = j + 1 - SHARE_PASSES
        share = (cum[j + 1] - cum[back]) / SHARE_PASSES
        # What a decode meets at large: the share of prefill among passes with one.
        cum_dec = np.concatenate([[0.0], np.cumsum(dec)])
        cum_pre_dec = np.concatenate([[0.0], np.cumsum(pre * dec)])
        n_dec = cum_dec[j + 1] - cum_dec[back]
        decode_share = np.where(
            n_dec > 0.0, (cum_pre_dec[j + 1] - cum_pre_dec[back]) / np.maximum(n_dec, 1.0), share
        )
        # A backlog (a prompt or more waiting, on average over the passes' time):
        # what follows a finish is the backlog, which a count with room would not
        # have. Over time, not passes: a backlog's passes are the long ones.
        cum_s = np.concatenate([[0.0], np.cumsum(wall)])
        cum_waiting_s = np.concatenate([[0.0], np.cumsum(waiting_s)])
        calm = cum_waiting_s[j + 1] - cum_waiting_s[back] < cum_s[j + 1] - cum_s[back]
        # The passes a request from the prompt is known to have met: up to the first
        # that decodes nothing or follows an idle second (see the module docstring).
        ends_run = (dec <= 0.0) | np.r_[True, runs[1:] != runs[:-1]]
        next_end = np.minimum.accumulate(np.where(ends_run, np.arange(end), end)[::-1])[::-1]
        met = (next_end[j + 1] - (j + 1))[:, None]  # passes before it
        spans = np.array(SPANS)
        last = j[:, None] + spans[None, :]  # (prompts, spans)
        counted = (last < end) & (last >= kept) & calm[:, None]
        seen = np.minimum(met, spans[None, :])
        observed = cum[j[:, None] + 1 + seen] - cum[j + 1][:, None]  # seen <= met: in range
        # The rest at the share a decode meets, as a binomial (its mean and variance).
        rest = (spans[None, :] - seen) * decode_share[:, None]
        rest_var = rest * (1.0 - decode_share[:, None])
        f = np.where(counted, fin[j][:, None], 0.0)
        count = observed + rest
        fk = f * count
        per_span = row[:_BUSY_S].reshape(len(SPANS), _PER_SPAN)
        per_span[:, 0] = f.sum(axis=0)
        per_span[:, 1] = fk.sum(axis=0)
        per_span[:, 2] = (fk * count + f * rest_var).sum(axis=0)
        per_span[:, 3] = share @ f
        per_span[:, 4] = (share * share) @ f
        per_span[:, 5] = share @ fk
        self._add(slot, row, now)

    def _add(self, slot: int, row: FloatArray, now: float) -> None:
        bucket = int(math.floor(now / self.bucket_s))
        pos = bucket % self._bucket_id.shape[0]
        if self._bucket_id[pos] != bucket:
            self._ring[:, pos] = 0.0
            self._bucket_id[pos] = bucket
        r = self._row(slot, bucket)
        self._ring[r, pos] += row
        self._row_last[r] = bucket

    def _row(self, slot: int, bucket: int) -> int:
        """The slot's row: a row whose sums all left the window, or a new one."""
        row = self._row_of.get(slot)
        if row is not None:
            return row
        used = np.zeros(self._row_last.shape[0], dtype=bool)
        used[list(self._row_of.values())] = True
        free = np.flatnonzero(~used & (self._row_last <= bucket - self._n_window))
        if free.size == 0:
            n = self._row_last.shape[0]
            self._ring = np.concatenate([self._ring, np.zeros_like(self._ring)])
            self._row_last = np.concatenate([self._row_last, np.full(n, _NEVER)])
            free = np.arange(n, 2 * n)
        row = int(free[0])
        self._ring[row] = 0.0
        self._row_of[slot] = row
        return row

    def measured(self, now: float) -> EarlyPrefills | None:
        """The lift and overdispersion per span over the window (None: too few
        prompts finished to tell, or the streams had a backlog)."""
        for slot in list(self._pending):
            self._flush(slot)
        bucket = int(math.floor(now / self.bucket_s))
        inside = (self._bucket_id > bucket - self._n_window) & (self._bucket_id <= bucket)
        per_stream = self._ring[:, inside].sum(axis=1)
        # A stream with a backlog over the window says nothing of a replica with
        # room (see the module docstring); the others still do.
        calm = per_stream[:, _WAITING_S] < per_stream[:, _BUSY_S]
        if not calm.any():
            return None
        totals = per_stream[calm].sum(axis=0)
        spans: list[int] = []
        lifts: list[float] = []
        rhos: list[float] = []
        for i, m in enumerate(SPANS):
            n, s1, s2, e1, e2, x = totals[_PER_SPAN * i : _PER_SPAN * (i + 1)]
            if n < MIN_FINISHED or e1 <= 0.0:
                continue
            # K against m times its stream's share scaled by the lift: the lift
            # that fits the mean, and what K varies by beyond a binomial there.
            lift = s1 / (m * e1)
            spans.append(m)
            lifts.append(lift)
            binomial = m * (lift * e1 - lift * lift * e2)
            if m == 1 or binomial <= 0.0:
                rhos.append(0.0)
                continue
            residual = s2 - 2.0 * m * lift * x + m * m * lift * lift * e2
            rhos.append(min(max((residual / binomial - 1.0) / (m - 1), 0.0), 1.0))
        if not spans:
            return None
        if len(rhos) > 1 and spans[0] == 1:
            rhos[0] = rhos[1]  # a single pass has none; keep the interpolation flat
        return EarlyPrefills(tuple(spans), tuple(lifts), tuple(rhos))
