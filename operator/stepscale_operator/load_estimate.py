"""Load estimation from FPM streams: token rates, context sizes, cache hits, queues, trends.

Every stream keeps a ring of per-``bucket_s`` sums (bounded memory whatever the
message rate); :meth:`LoadEstimator.estimate` sums the buckets inside the window.
Rates are per wall-clock second: the fresh streams' sums over the window, divided
by the time the fleet was observed within it (``min(window_s, now - first_seen)``
of its oldest stream), so a pod that joins adds what it serves without being
counted at its own short-window rate. Stale or never-seen streams are reported as
missing (and named), never as zero load; with no fresh stream at all the estimate's
values are unavailable (null in :meth:`LoadEstimate.to_dict`). Heartbeats count as
liveness, and as idle time for the output lengths, only. Implausible passes
(:func:`~stepscale_operator.load_types.implausible_passes`, or far beyond their
stream's token budget) count as liveness only too, and are counted by reason in
:attr:`LoadEstimator.rejected`.

Approximations the wire format forces on us (it carries per-pass aggregates, not
per-request data), documented here because the planner relies on them:

* Chunked prefill. ``sum_prefill_kv_tokens`` holds prefix-cache hits *and* the
  earlier chunks of a chunked prompt. A prompt is chunked only when a pass used
  the whole token budget, so we estimate the budget per stream as the largest
  ``prefill_tokens + decode_requests`` seen and call a prefill pass *full* when
  it reaches 95% of it. The first prefill request of the pass after a full pass is
  a continuation: that pass's KV tokens are not counted as cache hits (hits of
  other requests in the same pass are lost, an under-estimate). On other passes,
  prefill KV tokens are cache hits: on a prompt's first chunk ``k_i`` is exactly
  its cached prefix.
* Finished prompts. On a full pass the last prefill request is (probably) cut
  short, so it finishes ``n - 1`` prompts; otherwise ``n``.
* Prompt length. On passes that are not full, every prefill request runs its
  final chunk, so ``(C + K) / n`` is its full prompt length; the mean prompt
  length uses those passes (all passes if there are none).
* Decode tokens. One generated token per decode request per pass (no speculative
  decoding; a prefill's final chunk also emits a token, not counted here).
* Queues. The latest pass's queue of each fresh stream (``queued_*``, what a
  burst detector wants), and its time-weighted mean over the window
  (``queued_*_mean``: each value holds until the stream's next message, at most
  ``stale_after_s``); a heartbeat (idle engine) means an empty queue.
* Trends. Least-squares slope over ``trend_subwindows`` equal parts of the window,
  of the token rates and of the mean queues; and the end-to-end change of the
  queued prefill tokens (oldest part's mean to now), which with the served rate
  gives the arrivals by mass balance; and the same balance over the newest one
  to two parts only (``prefill_demand_tokens_per_s_recent``), which sees a step in the
  arrivals within seconds, while the window's still averages it with the load
  before.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import (
    ForwardPassMetrics,
)
from stepscale_operator.early_prefills import EarlyPrefillEstimator, EarlyPrefills
from stepscale_operator.load_types import (
    BUDGET_FACTOR,
    BUDGET_FLOOR,
    PROMPT_BIN_EDGES,
    LoadEstimate,
    implausible_passes,
    over_budget,
    tally_implausible,
)
from stepscale_operator.output_lengths import OutputLengthEstimator
from stepscale_operator.pass_columns import (
    QUEUED_DECODE_REQS,
    QUEUED_FIELDS,
    QUEUED_PREFILL_REQS,
    QUEUED_PREFILL_TOKENS,
    SCHED_DECODE_KV,
    SCHED_DECODE_REQS,
    SCHED_FIELDS,
    SCHED_PREFILL_KV,
    SCHED_PREFILL_REQS,
    SCHED_PREFILL_TOKENS,
    SCHED_PREFILL_VAR,
)
from stepscale_operator.request_itl_tail import (
    CellPasses,
    output_spans,
    request_itl_tail,
    weighted_quantile,
)
from stepscale_operator.stream_state import (
    DEFAULT_STALE_AFTER_S,
    StreamGroups,
    StreamKey,
    stream_label,
)

FloatArray = npt.NDArray[np.float64]

# What a stream's latest queue keeps.
_Q_COLS = [QUEUED_PREFILL_REQS, QUEUED_PREFILL_TOKENS, QUEUED_DECODE_REQS]

# Columns of a per-bucket sum.
(
    _PASSES,
    _BUSY_S,
    _PREFILL_TOKENS,
    _PREFILL_CACHED,
    _PREFILL_FINISHED,
    _DECODE_TOKENS,
    _DECODE_KV,
    _PROMPT_TOKENS_FINAL,
    _PROMPT_REQS_FINAL,
    _PROMPT_TOKENS_ALL,
    _PROMPT_REQS_ALL,
    _QS_PREFILL_REQS,  # queue x seconds: integrals that give time-weighted mean queues
    _QS_PREFILL_TOKENS,
    _QS_DECODE_REQS,
    _DECODE_WALL_S,  # sum of decode requests x pass wall time: token-weighted ITL
    _PREFILL_WALL_S,  # sum of prefill requests x pass wall time: time spent in prefill
    _PREFILL_PASSES,  # passes that carry a prefill chunk
    _DECODE_AT_PREFILL,  # decode requests on those passes: who a prefill delays
    _DECODE_WALL_AT_PREFILL_S,  # their decode requests x pass wall time
    _QUEUE_LAST,  # queued prefill requests at the bucket's last message (not a sum)
    _QUEUE_SEEN,  # 1 when the bucket has a message (not a sum)
) = range(21)
_HIST = 21  # first of the prompt-length histogram columns (PROMPT_BIN_EDGES)
# First of the columns of prompt tokens per histogram bin: each bin's mean length.
_BIN_TOKENS = _HIST + len(PROMPT_BIN_EDGES)
_N_COLS = _BIN_TOKENS + len(PROMPT_BIN_EDGES)
_QS_COLS = [_QS_PREFILL_REQS, _QS_PREFILL_TOKENS, _QS_DECODE_REQS]
# Columns whose trend is reported, in LoadEstimate order.
_TREND_COLS = [_PREFILL_TOKENS, _DECODE_TOKENS, _QS_PREFILL_TOKENS, _QS_DECODE_REQS]
FULL_BUDGET_FRACTION = 0.95
# Columns of a stream's pending full pass (see _finished_in_full_passes).
_PEND_TOKENS, _PEND_REQS, _PEND_VAR, _PEND_TIME = range(4)

# Fields that need at least one fresh stream.
_NEEDS_FRESH = frozenset(
    {
        "prefill_tokens_per_s",
        "prefill_cached_tokens_per_s",
        "prefill_requests_per_s",
        "decode_tokens_per_s",
        "mean_prompt_tokens",
        "mean_decode_context_tokens",
        "prefix_cache_hit_fraction",
        "queued_prefill_requests",
        "queued_prefill_tokens",
        "queued_decode_requests",
        "queued_prefill_requests_mean",
        "queued_prefill_tokens_mean",
        "queued_decode_requests_mean",
        "busy_fraction",
        "prompt_histogram",
        "prompt_bin_tokens",
        "arrival_dispersion",
        "replica_arrival_dispersion",
        "prefill_pass_decode_deficit",
        "realized_itl_mean_ms",
        "realized_itl_tail_ms",
        "realized_ttft_mean_ms",
        "realized_ttft_tail_ms",
    }
)
# Fewer prefill passes than this in the window say nothing of who they delay.
_MIN_PREFILL_PASSES_FOR_DEFICIT = 20
# Fewer arrivals than this in the window say nothing of their dispersion.
_MIN_ARRIVALS_FOR_DISPERSION = 20.0
_TREND_FIELDS = frozenset(
    {
        "prefill_tokens_per_s_trend",
        "decode_tokens_per_s_trend",
        "queued_prefill_tokens_trend",
        "queued_decode_requests_trend",
        "queued_prefill_tokens_change_per_s",
        "prefill_demand_tokens_per_s_recent",
    }
)
# Public name: the autoscaler withholds these until a whole window has been observed.
TREND_FIELDS = _TREND_FIELDS


def load_matrices(msgs: Sequence[ForwardPassMetrics]) -> tuple[FloatArray, FloatArray]:
    """(n, 7) scheduled and (n, 6) queued matrices in wire field order."""
    from msgspec.structs import astuple

    if not msgs:
        return np.zeros((0, len(SCHED_FIELDS))), np.zeros((0, len(QUEUED_FIELDS)))
    sched = np.array([astuple(m.scheduled_requests) for m in msgs], dtype=np.float64)
    queued = np.array([astuple(m.queued_requests) for m in msgs], dtype=np.float64)
    return sched, queued


class LoadEstimator:
    """Fleet load of one deployment over a sliding window, from its FPM streams."""

    # Per-stream state, one row per slot (see _per_stream for what a new or forgotten
    # stream starts from).
    _bucket_id: npt.NDArray[np.int64]  # the ring's bucket numbers (-1: empty)
    _sums: FloatArray  # the ring's per-bucket sums (_N_COLS columns)
    _first_seen: FloatArray
    _last_seen: FloatArray
    _queued: FloatArray  # latest: prefill requests, prefill tokens, decode requests
    _q_time: FloatArray  # when the latest queue was reported
    _budget: FloatArray  # largest prefill_tokens + decode_requests seen
    _prev_full: npt.NDArray[np.bool_]
    # The last full pass of each stream, until its next message tells which of its
    # prompts went on (_PEND_* columns; no requests: none pending).
    _pending_full: FloatArray

    def __init__(
        self,
        window_s: float = 30.0,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        *,
        bucket_s: float = 1.0,
        trend_subwindows: int = 6,
        max_streams: int = 4096,
        budget_factor: float = BUDGET_FACTOR,
        budget_floor: float = BUDGET_FLOOR,
        tail_quantile: float = 0.99,
    ) -> None:
        if window_s <= 0 or bucket_s <= 0 or window_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= window_s")
        self.window_s = float(window_s)
        self.stale_after_s = float(stale_after_s)
        self.bucket_s = float(bucket_s)
        self.trend_subwindows = max(2, int(trend_subwindows))
        self.max_streams = int(max_streams)
        self.budget_factor = float(budget_factor)
        self.budget_floor = float(budget_floor)
        self.tail_quantile = float(tail_quantile)
        self._n_window = int(math.ceil(self.window_s / self.bucket_s))
        self._ring_len = self._n_window + 1
        # Least recently seen first, so evicting the longest-silent stream is O(1).
        self._slots: OrderedDict[StreamKey, int] = OrderedDict()
        cap = 8
        self._free: list[int] = list(range(cap - 1, -1, -1))
        for name, shape, fill in self._per_stream():
            setattr(self, name, np.full((cap, *shape), fill))
        self._outputs = OutputLengthEstimator()
        self._early = EarlyPrefillEstimator(self.window_s, self.bucket_s)
        self.rejected: dict[str, int] = {}  # implausible messages by reason

    # -- membership ------------------------------------------------------------

    def add_stream(self, key: StreamKey) -> None:
        """Register a stream that should report; it counts as missing until it does."""
        self._slot(key)

    def remove_stream(self, key: StreamKey) -> None:
        """Forget a stream and its data (its pod is gone)."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._reset_slot(slot)
            self._free.append(slot)

    @property
    def streams(self) -> list[StreamKey]:
        """Known streams."""
        return list(self._slots)

    def _slot(self, key: StreamKey) -> int:
        """The slot of ``key``, made most recently used; creates it if new."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if len(self._slots) >= self.max_streams:
            # Bounded memory: forget the stream silent for longest (front of the LRU order).
            self.remove_stream(next(iter(self._slots)))
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[key] = slot
        return slot

    def _per_stream(self) -> tuple[tuple[str, tuple[int, ...], Any], ...]:
        """Each per-stream array: its name, the shape of one stream's row, its fill."""
        return (
            ("_bucket_id", (self._ring_len,), np.int64(-1)),
            ("_sums", (self._ring_len, _N_COLS), 0.0),
            ("_first_seen", (), np.nan),
            ("_last_seen", (), np.nan),
            ("_queued", (3,), 0.0),
            ("_q_time", (), np.nan),
            ("_budget", (), 0.0),
            ("_prev_full", (), False),
            ("_pending_full", (4,), 0.0),
        )

    def _grow(self) -> None:
        """Double the slot capacity (amortised O(1) per new stream)."""
        old = self._bucket_id.shape[0]
        for name, shape, fill in self._per_stream():
            setattr(self, name, np.concatenate([getattr(self, name), np.full((old, *shape), fill)]))
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _reset_slot(self, slot: int) -> None:
        for name, _, fill in self._per_stream():
            getattr(self, name)[slot] = fill
        self._outputs.forget(slot)
        self._early.forget(slot)

    # -- observation -----------------------------------------------------------

    def observe(self, msg: ForwardPassMetrics, now: float) -> None:
        """Account one message received at ``now`` (heartbeats: liveness only)."""
        self.observe_batch([msg], now)

    def observe_batch(
        self,
        msgs: Sequence[ForwardPassMetrics],
        now: float,
        sched: FloatArray | None = None,
        queued: FloatArray | None = None,
    ) -> None:
        """Account messages received at ``now``, in arrival order.

        ``sched``/``queued`` are the (n, 7)/(n, 6) matrices in wire field order,
        when the caller already built them.
        """
        n = len(msgs)
        if n == 0:
            return
        if sched is None or queued is None:
            sched, queued = load_matrices(msgs)
        keys = [(m.worker_id, m.dp_rank) for m in msgs]
        wall = np.fromiter((m.wall_time for m in msgs), np.float64, n)
        self.observe_matrices(keys, wall, sched, queued, now)

    def observe_matrices(
        self,
        keys: Sequence[StreamKey] | StreamGroups,
        wall: FloatArray,
        sched: FloatArray,
        queued: FloatArray,
        now: float,
    ) -> None:
        """Columnar form of :meth:`observe_batch` for callers that built the matrices."""
        n = len(keys)
        if n == 0:
            return
        groups = StreamGroups.of(keys)  # distinct streams are mapped, not every row
        inverse = groups.index
        slots = np.array([self._slot(key) for key in groups.keys], dtype=np.int64)
        # Every message is liveness, even one whose content is not believed.
        first_time = np.isnan(self._first_seen[slots])
        self._first_seen[slots[first_time]] = now
        self._last_seen[slots] = now
        row_slot = slots[inverse]
        ok = self._plausible(row_slot, wall, sched, queued)
        if ok.all():
            self._accumulate(row_slot, wall, sched, queued, now)
        elif ok.any():
            self._accumulate(row_slot[ok], wall[ok], sched[ok], queued[ok], now)

    def _plausible(
        self,
        slot: npt.NDArray[np.int64],
        wall: FloatArray,
        sched: FloatArray,
        queued: FloatArray,
    ) -> npt.NDArray[np.bool_]:
        """Rows to learn from: within hard limits and their stream's token budget."""
        code = implausible_passes(sched, wall, queued)
        used = sched[:, SCHED_PREFILL_TOKENS] + sched[:, SCHED_DECODE_REQS]
        beyond = (code == 0) & over_budget(
            used, self._budget[slot], self.budget_factor, self.budget_floor
        )
        tally_implausible(self.rejected, code, beyond)
        return (code == 0) & ~beyond

    def _accumulate(
        self,
        slot: npt.NDArray[np.int64],
        wall: FloatArray,
        sched: FloatArray,
        queued: FloatArray,
        now: float,
    ) -> None:
        order = np.argsort(slot, kind="stable")
        sl = slot[order]
        starts = np.flatnonzero(np.r_[True, sl[1:] != sl[:-1]])
        ends = np.r_[starts[1:], sl.shape[0]]
        streams = sl[starts]
        w, s, q = wall[order], sched[order], queued[order]

        # The previous queue of each stream held until now: integrate it (time-weighted
        # mean), then keep this batch's latest (a heartbeat means an empty queue).
        queue_seconds = self._queued[streams] * self._held_for(streams, now)[:, None]
        last = ends - 1
        is_pass_last = w[last] > 0
        self._queued[streams] = np.where(is_pass_last[:, None], q[last][:, _Q_COLS], 0.0)
        self._q_time[streams] = now

        is_pass = w > 0
        c = np.where(is_pass, s[:, SCHED_PREFILL_TOKENS], 0.0)
        k = np.where(is_pass, s[:, SCHED_PREFILL_KV], 0.0)
        n_pre = np.where(is_pass, s[:, SCHED_PREFILL_REQS], 0.0)
        n_dec = np.where(is_pass, s[:, SCHED_DECODE_REQS], 0.0)
        used = c + n_dec
        budget = np.maximum(self._budget[streams], np.maximum.reduceat(used, starts))
        self._budget[streams] = budget
        row_budget = np.repeat(budget, ends - starts)
        full = (c > 0) & (used >= FULL_BUDGET_FRACTION * row_budget)
        # Continuation flag: the previous pass of the same stream was full.
        prev_full = np.r_[False, full[:-1]]
        prev_full[starts] = self._prev_full[streams]
        # Heartbeats do not break a chunk sequence: carry the flag over them.
        prev_full = np.where(is_pass, prev_full, False)
        self._prev_full[streams] = full[last] | (~is_pass[last] & self._prev_full[streams])

        has_prefill = c > 0
        final = has_prefill & ~full
        cols = np.zeros((sl.shape[0], _HIST))  # the per-pass columns; prompt lengths below
        cols[:, _PASSES] = is_pass
        cols[:, _BUSY_S] = np.where(is_pass, w, 0.0)
        cols[:, _PREFILL_TOKENS] = c
        cols[:, _PREFILL_CACHED] = np.where(prev_full, 0.0, k)
        cols[:, _PREFILL_FINISHED] = np.maximum(n_pre - full, 0.0)
        cols[:, _DECODE_TOKENS] = n_dec
        cols[:, _DECODE_KV] = np.where(is_pass, s[:, SCHED_DECODE_KV], 0.0)
        cols[:, _PROMPT_TOKENS_ALL] = np.where(has_prefill, c + k, 0.0)
        cols[:, _PROMPT_REQS_ALL] = np.where(has_prefill, n_pre, 0.0)
        cols[:, _DECODE_WALL_S] = n_dec * cols[:, _BUSY_S]
        cols[:, _PREFILL_WALL_S] = n_pre * cols[:, _BUSY_S]
        cols[:, _PREFILL_PASSES] = has_prefill
        cols[:, _DECODE_AT_PREFILL] = np.where(has_prefill, n_dec, 0.0)
        cols[:, _DECODE_WALL_AT_PREFILL_S] = np.where(has_prefill, cols[:, _DECODE_WALL_S], 0.0)
        for stream, lo, hi in zip(streams, starts, ends, strict=True):
            # Heartbeats too: they tell the output lengths how long the engine idled.
            self._outputs.observe(
                int(stream), cols[lo:hi, _PREFILL_FINISHED], n_dec[lo:hi], w[lo:hi], now
            )
            self._early.observe(
                int(stream),
                cols[lo:hi, _BUSY_S],
                cols[lo:hi, _PREFILL_PASSES],
                cols[lo:hi, _PREFILL_FINISHED],
                np.where(is_pass[lo:hi], q[lo:hi, QUEUED_PREFILL_REQS], 0.0),
                n_dec[lo:hi],
                now,
            )
        per_stream = np.zeros((streams.shape[0], _N_COLS))
        per_stream[:, :_HIST] = np.add.reduceat(cols, starts, axis=0)
        per_stream[:, _QS_COLS] = queue_seconds
        # Few passes finish a prompt: their lengths go straight to their stream's row.
        stream_of_row = np.repeat(np.arange(streams.shape[0]), ends - starts)
        var = s[:, SCHED_PREFILL_VAR]
        rows = np.flatnonzero(final & (n_pre > 0))
        finished = _FinishedPrompts(stream_of_row[rows], n_pre[rows], (c + k)[rows], var[rows])
        _add_prompt_lengths(per_stream, finished)
        # Prompts that finished in full passes (a long prompt's last chunk with the
        # next prompt's first): the final passes alone missed 20-40% of the prompts
        # beyond 3k tokens on a fleet where prompts queue behind long ones.
        in_full = self._finished_in_full_passes(
            streams, starts, stream_of_row, full, c, k, n_pre, var, now
        )
        _add_prompt_lengths(per_stream, in_full)

        bucket = int(math.floor(now / self.bucket_s))
        pos = bucket % self._ring_len
        stale_bucket = self._bucket_id[streams, pos] != bucket
        self._sums[streams[stale_bucket], pos] = 0.0
        self._bucket_id[streams, pos] = bucket
        self._sums[streams, pos] += per_stream
        # Not sums: the queue as the bucket ends, for the arrivals' mass balance.
        self._sums[streams, pos, _QUEUE_LAST] = self._queued[streams, 0]
        self._sums[streams, pos, _QUEUE_SEEN] = 1.0

    def _finished_in_full_passes(
        self,
        streams: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        stream_of_row: npt.NDArray[np.int64],
        full: npt.NDArray[np.bool_],
        computed: FloatArray,
        cached: FloatArray,
        requests: FloatArray,
        variance: FloatArray,
        now: float,
    ) -> _FinishedPrompts:
        """The prompts that finished in full passes, told by each one's next message.

        A full pass ends with a prompt the budget cut, which the engine goes on with
        in its very next pass, unless that next message computes no prompt (a
        decode-only pass, or a heartbeat: the engine went idle). The prompt going on
        holds all it has computed in the KV cache there: that pass's cached tokens
        (exact unless it also starts a prompt with a prefix-cache hit). What the full
        pass held beyond that is the prompts it finished. A stream's last message of
        a batch, when a full pass, waits for the stream's next message (in a later
        batch), and is dropped if that comes after the window has moved past it.
        Where several finished, the pass's length variance (the prompt going on
        included) stands for theirs.
        """
        rows = np.arange(full.shape[0])
        last = np.r_[stream_of_row[1:] != stream_of_row[:-1], True]
        tokens_of = computed + cached
        # Full passes whose next message is in this batch, then those of the batches
        # before (their next message: their stream's first here).
        here = full & ~last
        pend = self._pending_full[streams]
        waiting = (pend[:, _PEND_REQS] > 0) & (pend[:, _PEND_TIME] >= now - self.window_s)
        tokens = np.r_[tokens_of[here], pend[waiting, _PEND_TOKENS]]
        reqs = np.r_[requests[here], pend[waiting, _PEND_REQS]]
        var = np.r_[variance[here], pend[waiting, _PEND_VAR]]
        stream = np.r_[stream_of_row[here], np.flatnonzero(waiting)]
        nxt = np.r_[rows[1:][here[:-1]], starts[waiting]]
        # Each stream's last message waits when a full pass; the others are done.
        ends_full = last & full
        self._pending_full[streams] = 0.0
        self._pending_full[streams[stream_of_row[ends_full]]] = np.c_[  # _PEND_* order
            tokens_of[ends_full],
            requests[ends_full],
            variance[ends_full],
            np.full(int(ends_full.sum()), now),
        ]
        carry = np.where(computed[nxt] > 0, np.minimum(cached[nxt], tokens), 0.0)
        count = reqs - (carry > 0.0)
        ok = (count > 0) & (tokens - carry > 0.0)
        return _FinishedPrompts(stream[ok], count[ok], (tokens - carry)[ok], var[ok])

    def _held_for(self, slots: npt.NDArray[np.int64], now: float) -> FloatArray:
        """Seconds each stream's latest queue has held (0 if none; capped at staleness)."""
        since = now - self._q_time[slots]
        return np.where(np.isnan(since), 0.0, np.clip(since, 0.0, self.stale_after_s))

    # -- estimation ------------------------------------------------------------

    def estimate(self, now: float) -> LoadEstimate:
        """Fleet load over the last ``window_s`` seconds; missing streams are flagged."""
        keys = list(self._slots)
        slots = np.fromiter(self._slots.values(), np.int64, len(keys))
        last_seen = self._last_seen[slots]
        fresh_mask = ~np.isnan(last_seen) & (now - np.nan_to_num(last_seen) <= self.stale_after_s)
        fresh = slots[fresh_mask]
        missing = tuple(
            sorted(stream_label(k) for k, ok in zip(keys, fresh_mask, strict=True) if not ok)
        )

        bucket = int(math.floor(now / self.bucket_s))
        oldest = bucket - self._n_window + 1
        ids = self._bucket_id[fresh]  # (f, ring)
        in_window = (ids >= oldest) & (ids <= bucket)
        sums = np.where(in_window[:, :, None], self._sums[fresh], 0.0)  # (f, ring, cols)
        # The queue each fresh stream reports now has held since its last message.
        partial = np.zeros((fresh.shape[0], _N_COLS))
        partial[:, _QS_COLS] = self._queued[fresh] * self._held_for(fresh, now)[:, None]
        window_start = max(now - self.window_s, oldest * self.bucket_s)
        span = np.maximum(now - np.maximum(self._first_seen[fresh], window_start), self.bucket_s)
        per_stream = sums.sum(axis=1) + partial  # (f, cols)
        totals = per_stream.sum(axis=0)
        # Fleet rates: everything served over the time the fleet was observed. Not
        # the sum of per-stream rates: a pod that joined 10 s ago would count at its
        # rate now on top of the others' 30 s averages (which still hold the load it
        # took over), overstating the load after every scale-up.
        fleet_span = float(span.max()) if fresh.size else self.bucket_s
        rates = totals / fleet_span  # zeros when nothing is fresh

        unavailable = set() if fresh.size else set(_NEEDS_FRESH)
        prefill = float(rates[_PREFILL_TOKENS])
        cached = float(rates[_PREFILL_CACHED])
        mean_prompt = _ratio(totals[_PROMPT_TOKENS_FINAL], totals[_PROMPT_REQS_FINAL])
        if mean_prompt is None:
            mean_prompt = _ratio(totals[_PROMPT_TOKENS_ALL], totals[_PROMPT_REQS_ALL])
        decode_ctx = _ratio(totals[_DECODE_KV], totals[_DECODE_TOKENS])
        deficit = _prefill_pass_decode_deficit(totals)
        hit_fraction = _ratio(cached, cached + prefill)
        for name, value in (
            ("mean_prompt_tokens", mean_prompt),
            ("mean_decode_context_tokens", decode_ctx),
            ("prefix_cache_hit_fraction", hit_fraction),
            ("prefill_pass_decode_deficit", deficit),
        ):
            if value is None:
                unavailable.add(name)
        queued = self._queued[fresh].sum(axis=0)
        found = self._trends(ids, in_window, sums, partial.sum(axis=0), now, bucket, queued[1])
        if found is None:
            unavailable |= _TREND_FIELDS
            found = (np.zeros(len(_TREND_COLS)), 0.0, 0.0)
        trends, prefill_queue_change, recent_demand = found
        # The window's buckets before the fleet's first message were not observed,
        # which is no silence: counted as buckets without arrivals, an operator that
        # started 5 s ago read the bursts scenario's steady 40 req/s as a dispersion
        # of 36 and sized for a burst. The same span as the rates' (``fleet_span``).
        observed_from = max(int(math.floor((now - fleet_span) / self.bucket_s)) - oldest, 0)
        output_shares = self._outputs.shares()
        early_prefills = self._early.measured(now)
        shapes = self._shapes(
            ids, in_window, sums, bucket, observed_from, output_shares, early_prefills
        )
        if shapes is None:
            unavailable |= {"prompt_histogram", "prompt_bin_tokens"}
            unavailable |= {"arrival_dispersion", "replica_arrival_dispersion"}
            unavailable |= {n for n in _REALIZED_FIELDS}
            shapes = _Shapes((), (), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        else:
            if not shapes.prompt_histogram:
                unavailable |= {"prompt_histogram", "prompt_bin_tokens"}
            if shapes.arrival_dispersion <= 0.0:
                unavailable.add("arrival_dispersion")
            if shapes.replica_arrival_dispersion <= 0.0:
                unavailable.add("replica_arrival_dispersion")
            for name in _REALIZED_FIELDS:
                if getattr(shapes, name) <= 0.0:
                    unavailable.add(name)
        return LoadEstimate(
            window_s=self.window_s,
            streams_total=len(keys),
            streams_missing=len(missing),
            prefill_tokens_per_s=prefill,
            prefill_cached_tokens_per_s=cached,
            prefill_requests_per_s=float(rates[_PREFILL_FINISHED]),
            decode_tokens_per_s=float(rates[_DECODE_TOKENS]),
            mean_prompt_tokens=mean_prompt or 0.0,
            mean_decode_context_tokens=decode_ctx or 0.0,
            prefix_cache_hit_fraction=hit_fraction or 0.0,
            queued_prefill_requests=float(queued[0]),
            queued_prefill_tokens=float(queued[1]),
            queued_decode_requests=float(queued[2]),
            prefill_tokens_per_s_trend=float(trends[0]),
            decode_tokens_per_s_trend=float(trends[1]),
            busy_fraction=float(totals[_BUSY_S] / span.sum()) if fresh.size else 0.0,
            queued_prefill_requests_mean=float(rates[_QS_PREFILL_REQS]),
            queued_prefill_tokens_mean=float(rates[_QS_PREFILL_TOKENS]),
            queued_decode_requests_mean=float(rates[_QS_DECODE_REQS]),
            queued_prefill_tokens_trend=float(trends[2]),
            queued_prefill_tokens_change_per_s=prefill_queue_change,
            prefill_demand_tokens_per_s_recent=recent_demand,
            queued_decode_requests_trend=float(trends[3]),
            prompt_histogram=shapes.prompt_histogram,
            prompt_bin_tokens=shapes.prompt_bin_tokens,
            arrival_dispersion=shapes.arrival_dispersion,
            replica_arrival_dispersion=shapes.replica_arrival_dispersion,
            prefill_pass_decode_deficit=deficit or 0.0,
            output_interval_shares=output_shares,
            early_prefills=early_prefills,
            realized_itl_mean_ms=shapes.realized_itl_mean_ms,
            realized_itl_tail_ms=shapes.realized_itl_tail_ms,
            realized_ttft_mean_ms=shapes.realized_ttft_mean_ms,
            realized_ttft_tail_ms=shapes.realized_ttft_tail_ms,
            missing_streams=missing,
            unavailable=frozenset(unavailable),
        )

    def _shapes(
        self,
        ids: npt.NDArray[np.int64],
        in_window: npt.NDArray[np.bool_],
        sums: FloatArray,
        bucket: int,
        observed_from: int,
        output_shares: tuple[float, ...],
        early_prefills: EarlyPrefills | None,
    ) -> _Shapes | None:
        """Prompt-length histogram and tokens per bin, dispersion of arrivals per
        second (over the buckets from ``observed_from`` on, oldest first), and the
        realized latency of the window's (stream, second) cells: the ITL tail over
        requests, each output-length class (``output_shares``) over its own span of
        cells, or, within a cell, over its passes with the lift of
        ``early_prefills`` (:mod:`~stepscale_operator.request_itl_tail`); None with
        no fresh stream."""
        if ids.size == 0:
            return None
        totals = sums.sum(axis=(0, 1))
        hist = totals[_HIST:_BIN_TOKENS]
        measured = hist.sum() > 0.0
        histogram = tuple(float(h) for h in hist) if measured else ()
        bin_tokens = tuple(float(t) for t in totals[_BIN_TOKENS:]) if measured else ()
        # Dense (stream, age) grid of the per-pass columns (not the histogram),
        # newest bucket first; ring entries outside the window are zero.
        n = self._n_window
        age = np.where(in_window, bucket - ids, n)
        grid = np.zeros((ids.shape[0], n + 1, _HIST))
        rows = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
        grid[rows, age.ravel()] = sums[:, :, :_HIST].reshape(-1, _HIST)
        grid = grid[:, :n][:, ::-1]  # oldest first
        dispersion, replica_dispersion = _dispersions(grid[:, observed_from:])
        cells = grid.reshape(-1, _HIST)
        q = self.tail_quantile
        itl_mean_ms = (_ratio(totals[_DECODE_WALL_S], totals[_DECODE_TOKENS]) or 0.0) * 1e3
        spans = output_spans(
            output_shares,
            _ratio(totals[_DECODE_TOKENS], totals[_PREFILL_FINISHED]),
            itl_mean_ms / 1e3,
            self.bucket_s,
            n,
        )
        # The passes within a cell only matter to classes shorter than one.
        within = _cell_passes(grid, totals) if any(s.passes for s in spans) else None
        itl_tail_ms = request_itl_tail(
            grid[:, :, _DECODE_WALL_S], grid[:, :, _DECODE_TOKENS], spans, q, within, early_prefills
        )
        ttft = _cell_latency(
            cells[:, _QS_PREFILL_REQS] + cells[:, _PREFILL_WALL_S], cells[:, _PREFILL_FINISHED], q
        )
        return _Shapes(
            histogram, bin_tokens, dispersion, replica_dispersion, itl_mean_ms, itl_tail_ms, *ttft
        )

    def _trends(
        self,
        ids: npt.NDArray[np.int64],
        in_window: npt.NDArray[np.bool_],
        sums: FloatArray,
        partial: FloatArray,
        now: float,
        bucket: int,
        latest_prefill_queue: float,
    ) -> tuple[FloatArray, float, float] | None:
        """Least-squares slopes of the :data:`_TREND_COLS` fleet rates over equal
        sub-windows, the end-to-end change of the queued prefill tokens, and the
        recent prefill demand (served plus queue growth over the newest one or two).

        Per second (tokens/s per second for rates, queue units per second for the
        mean queues and the change); None when fewer than two sub-windows have data.
        """
        if ids.size == 0:
            return None
        # Sub-window of each ring entry, counted back from the newest bucket.
        age = np.where(in_window, bucket - ids, -1)
        per_sub = max(1, self._n_window // self.trend_subwindows)
        sub = np.where(age >= 0, age // per_sub, -1)
        n_sub = int(self._n_window // per_sub)
        centers: list[float] = []
        values: list[FloatArray] = []
        current_fraction = (now - bucket * self.bucket_s) / self.bucket_s
        for j in range(n_sub):
            mask = sub == j
            if not mask.any():
                continue
            duration = per_sub * self.bucket_s
            picked = sums[mask][:, _TREND_COLS].sum(axis=0)
            if j == 0:  # the newest bucket is only partly elapsed; the queues held till now
                duration -= (1.0 - current_fraction) * self.bucket_s
                picked = picked + partial[_TREND_COLS]
            if duration < 0.5 * self.bucket_s:
                continue  # too short to give a meaningful rate
            # The newest one ends now (partly elapsed); the others are whole.
            end = now - j * per_sub * self.bucket_s if j else now
            centers.append(end - 0.5 * duration)
            values.append(picked / duration)
        if len(centers) < 2:
            return None
        # End to end: from the oldest sub-window's mean queue to the queue now (the
        # mass balance arrivals = served + queue change needs the actual change,
        # which a slope through a queue that rose and fell understates).
        queue_col = _TREND_COLS.index(_QS_PREFILL_TOKENS)
        served_col = _TREND_COLS.index(_PREFILL_TOKENS)
        oldest_queue = float(values[-1][queue_col])
        change = (latest_prefill_queue - oldest_queue) / (now - centers[-1])
        # The same balance over the newest whole sub-window and the part since: served
        # there, plus the queue's growth from that sub-window's mean (at its centre) to
        # now. Not over the newest part alone: it can be a fraction of a second long,
        # and batching noise in the queue divided by it reads as a surge.
        recent_growth = (latest_prefill_queue - float(values[1][queue_col])) / (now - centers[1])
        recent_served = float(np.mean([v[served_col] for v in values[:2]]))
        recent_demand = max(recent_served + recent_growth, 0.0)
        t = np.asarray(centers)
        t = t - t.mean()
        v = np.asarray(values)  # (subs, cols)
        slopes = (t[:, None] * (v - v.mean(axis=0))).sum(axis=0) / float((t * t).sum())
        return np.asarray(slopes), change, recent_demand


_REALIZED_FIELDS = (
    "realized_itl_mean_ms",
    "realized_itl_tail_ms",
    "realized_ttft_mean_ms",
    "realized_ttft_tail_ms",
)


@dataclass(frozen=True)
class _Shapes:
    prompt_histogram: tuple[float, ...]
    prompt_bin_tokens: tuple[float, ...]
    arrival_dispersion: float
    replica_arrival_dispersion: float
    realized_itl_mean_ms: float
    realized_itl_tail_ms: float
    realized_ttft_mean_ms: float
    realized_ttft_tail_ms: float


@dataclass(frozen=True)
class _FinishedPrompts:
    """Prompts that finished prefill, by pass: the stream (index in the batch), how
    many, their full lengths' sum and population variance."""

    stream: npt.NDArray[np.int64]
    requests: FloatArray
    tokens: FloatArray
    variance: FloatArray


def _add_prompt_lengths(per_stream: FloatArray, finished: _FinishedPrompts) -> None:
    """Histogram the full prompt lengths of ``finished``, and sum their tokens per
    bin (the bin's mean length), into the row of ``per_stream`` of their stream;
    also their count and tokens (the mean prompt length).

    A pass reports the mean and variance of its requests' lengths, not each one:
    with several, half go one standard deviation either side of the mean (the
    same two moments), one alone is exact.
    """
    if finished.stream.size == 0:
        return
    n = finished.requests
    np.add.at(per_stream[:, _PROMPT_REQS_FINAL], finished.stream, n)
    np.add.at(per_stream[:, _PROMPT_TOKENS_FINAL], finished.stream, finished.tokens)
    mean = finished.tokens / n
    spread = np.where(n > 1, np.sqrt(np.maximum(finished.variance, 0.0)), 0.0)
    edges = np.asarray(PROMPT_BIN_EDGES)
    for sign in (-1.0, 1.0):
        length = np.maximum(mean + sign * spread, 1.0)
        idx = np.clip(np.searchsorted(edges, length, side="right") - 1, 0, len(edges) - 1)
        np.add.at(per_stream, (finished.stream, _HIST + idx), n / 2.0)
        np.add.at(per_stream, (finished.stream, _BIN_TOKENS + idx), length * n / 2.0)


def _dispersions(grid: FloatArray) -> tuple[float, float]:
    """Variance over mean of arrivals per bucket: the fleet's, and one replica's
    (0: too few to tell).

    Arrivals of a stream in a bucket = prompts that finished prefill there plus the
    growth of its prefill queue since the bucket before (mass balance); the queue
    holds across buckets without a message. The oldest bucket (no queue before it)
    and the newest (still filling) are left out.

    One replica's is pooled over streams: each stream's deviations from its own
    mean, over the buckets since its first message (a pod that joined mid-window
    had no arrivals before, and that is no burst). It shows what the router does
    to the fleet's arrivals: a random spread keeps a share of their clumping, a
    balancing router sends a clump's requests to different replicas.
    """
    queue = grid[:, :, _QUEUE_LAST].copy()
    seen = grid[:, :, _QUEUE_SEEN] > 0.0
    for j in range(1, queue.shape[1]):
        queue[:, j] = np.where(seen[:, j], queue[:, j], queue[:, j - 1])
    arrivals = (grid[:, 1:, _PREFILL_FINISHED] + np.diff(queue, axis=1))[:, :-1]
    fleet = arrivals.sum(axis=0)
    if fleet.size < 3 or fleet.sum() < _MIN_ARRIVALS_FOR_DISPERSION:
        return 0.0, 0.0
    mean = float(fleet.mean())
    fleet_dispersion = float(fleet.var(ddof=1) / mean) if mean > 0.0 else 0.0
    # A stream's buckets from the first with a message before it (its queue known).
    active = np.cumsum(seen[:, :-2], axis=1) > 0
    counts = active.sum(axis=1)
    pooled = counts >= 3
    if not pooled.any():
        return fleet_dispersion, 0.0
    a = np.where(active, arrivals, 0.0)[pooled]
    n = counts[pooled].astype(float)
    means = a.sum(axis=1) / n
    squares = (np.where(active[pooled], a - means[:, None], 0.0) ** 2).sum()
    total_mean = float(a.sum() / n.sum())
    if total_mean <= 0.0:
        return fleet_dispersion, 0.0
    replica_dispersion = float(squares / (n - 1.0).sum()) / total_mean
    return fleet_dispersion, replica_dispersion


def _cell_passes(grid: FloatArray, totals: FloatArray) -> CellPasses:
    """What a request decoding within one (stream, second) cell meets there: its
    passes, those that carry prefill, and the mean time a decode took on a pass
    without and with prefill. A cell where decodes met only one kind takes the
    other's mean over the window (and, with none there either, the kind it has)."""
    at_prefill = grid[:, :, _DECODE_AT_PREFILL]
    wall_at_prefill = grid[:, :, _DECODE_WALL_AT_PREFILL_S]
    without = grid[:, :, _DECODE_TOKENS] - at_prefill
    wall_without = grid[:, :, _DECODE_WALL_S] - wall_at_prefill
    mean_without = _ratio(
        totals[_DECODE_WALL_S] - totals[_DECODE_WALL_AT_PREFILL_S],
        totals[_DECODE_TOKENS] - totals[_DECODE_AT_PREFILL],
    )
    mean_with = _ratio(totals[_DECODE_WALL_AT_PREFILL_S], totals[_DECODE_AT_PREFILL])
    window_without = mean_without if mean_without is not None else (mean_with or 0.0)
    window_with = mean_with if mean_with is not None else window_without
    decode = np.divide(
        wall_without, without, out=np.full_like(without, window_without), where=without > 1e-12
    )
    prefill = np.divide(
        wall_at_prefill,
        at_prefill,
        out=np.full_like(at_prefill, window_with),
        where=at_prefill > 1e-12,
    )
    return CellPasses(
        grid[:, :, _PASSES],
        grid[:, :, _PREFILL_PASSES],
        decode,
        prefill,
        grid[:, :, _PREFILL_FINISHED],
    )


def _cell_latency(seconds: FloatArray, count: FloatArray, quantile: float) -> tuple[float, float]:
    """Mean and ``quantile`` (count-weighted over cells) of ``seconds / count``, in ms."""
    has = count > 0.0
    if not has.any():
        return 0.0, 0.0
    weight = count[has]
    tail = weighted_quantile(seconds[has] / weight, weight, quantile)
    return float(seconds[has].sum() / weight.sum()) * 1e3, tail * 1e3


def _prefill_pass_decode_deficit(totals: FloatArray) -> float | None:
    """Mean decode batch of all passes less that of prefill-bearing ones (None: too
    few prefill passes to tell)."""
    if totals[_PREFILL_PASSES] < _MIN_PREFILL_PASSES_FOR_DEFICIT:
        return None
    at_prefill = totals[_DECODE_AT_PREFILL] / totals[_PREFILL_PASSES]
    return float(totals[_DECODE_TOKENS] / totals[_PASSES] - at_prefill)


def _ratio(num: float, den: float) -> float | None:
    """``num / den``, or None when there is nothing to divide by."""
    return float(num / den) if den > 0 else None
