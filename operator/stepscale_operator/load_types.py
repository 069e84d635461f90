"""Plain data types shared by load estimation, the planner and the simulator.

Kept apart from the code that computes them so the planner depends on the shape
of a load estimate, not on how it was measured. The plausibility bounds on one
forward pass live here too: the cost model and the load estimator both apply them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import numpy.typing as npt

from stepscale_operator.early_prefills import EarlyPrefills
from stepscale_operator.pass_columns import (
    QUEUED_DECODE_KV,
    QUEUED_DECODE_REQS,
    QUEUED_PREFILL_REQS,
    QUEUED_PREFILL_TOKENS,
    SCHED_DECODE_KV,
    SCHED_DECODE_REQS,
    SCHED_PREFILL_KV,
    SCHED_PREFILL_REQS,
    SCHED_PREFILL_TOKENS,
)

LoadValue = float | int | bool | list[str] | list[float] | None

# Prompt-length histogram bins (tokens): bin ``i`` holds prompts in
# ``[PROMPT_BIN_EDGES[i], PROMPT_BIN_EDGES[i + 1])``, the last one everything above.
# Half powers of two from 16 to 512k: the tail of long-context traffic keeps its
# shape. The TTFT quantile falls on a bin's measured mean length (its prompt tokens
# over its count), which stays on the prompts it stands for where lengths pile up
# at a cap; geometric centres put the shared trace's p99 prompt (4,123 tokens, at
# the bottom of the 4,096-5,793 bin) at 4,938.
PROMPT_BIN_RATIO = 2.0**0.5  # upper over lower edge of a bin
PROMPT_BIN_EDGES: tuple[float, ...] = tuple(float(round(2 ** (k / 2))) for k in range(8, 40))


def prompt_bin_centers() -> tuple[float, ...]:
    """A representative prompt length of each histogram bin (geometric centre)."""
    edges = PROMPT_BIN_EDGES
    return tuple(
        (edges[i] * edges[i + 1]) ** 0.5 if i + 1 < len(edges) else edges[i] * PROMPT_BIN_RATIO**0.5
        for i in range(len(edges))
    )


# Output-length bins, in inter-token intervals (output tokens - 1): bin ``i`` holds
# outputs with ``OUTPUT_INTERVAL_BINS[i][0]..[1]`` intervals, inclusive; longer ones
# are the rest. Exact up to 3 (one prefill pass among them sets the ITL), then
# geometric: short outputs set the ITL tail, long ones average it out.
OUTPUT_INTERVAL_BINS: tuple[tuple[int, int], ...] = (
    (0, 0),
    (1, 1),
    (2, 2),
    (3, 3),
    *(
        (first, first + half - 1)
        for k in range(2, 7)
        for half in (2 ** (k - 1),)
        for first in (2**k, 2**k + half)
    ),
)


def prompt_histogram_of(lengths: npt.NDArray[np.float64]) -> tuple[float, ...]:
    """Counts of ``lengths`` in the :data:`PROMPT_BIN_EDGES` bins."""
    counts = np.bincount(_prompt_bins(lengths), minlength=len(PROMPT_BIN_EDGES))
    return tuple(float(c) for c in counts[: len(PROMPT_BIN_EDGES)])


def prompt_bin_tokens_of(lengths: npt.NDArray[np.float64]) -> tuple[float, ...]:
    """Tokens of ``lengths`` per :data:`PROMPT_BIN_EDGES` bin."""
    tokens = np.bincount(_prompt_bins(lengths), weights=lengths, minlength=len(PROMPT_BIN_EDGES))
    return tuple(float(t) for t in tokens[: len(PROMPT_BIN_EDGES)])


def bin_tokens_or_centres(
    histogram: tuple[float, ...], bin_tokens: tuple[float, ...]
) -> tuple[float, ...]:
    """Prompt tokens per bin: ``bin_tokens`` where measured (one per bin), else each
    bin's count at its geometric centre (an estimate from before they were measured,
    or a source that gives counts only)."""
    if len(bin_tokens) == len(histogram):
        return bin_tokens
    return tuple(c * h for c, h in zip(prompt_bin_centers(), histogram, strict=False))


def _prompt_bins(lengths: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    return np.clip(np.searchsorted(PROMPT_BIN_EDGES, lengths, side="right") - 1, 0, None)


@dataclass(frozen=True)
class LoadEstimate:
    """The load a deployment carried over the last ``window_s`` seconds, fleet-wide.

    Rates are sums over every fresh stream of the deployment. A stream that is
    stale or missing is counted in ``streams_missing`` and named in
    ``missing_streams``; its load is unknown, never zero, and ``complete`` is
    False so the planner will not scale down.

    The float fields hold 0.0 where nothing could be measured (so arithmetic in
    the planner stays simple); ``unavailable`` names those fields, and
    :meth:`to_dict` (what status and logs show) writes them as null.
    """

    window_s: float
    streams_total: int
    streams_missing: int
    prefill_tokens_per_s: float  # prompt tokens actually computed (cache hits excluded)
    prefill_cached_tokens_per_s: float  # prompt tokens served from the prefix cache
    prefill_requests_per_s: float  # prompts that finished prefill (approximate)
    decode_tokens_per_s: float  # generated tokens (one per decode request per pass)
    mean_prompt_tokens: float  # full prompt length of requests in prefill
    mean_decode_context_tokens: float  # KV context of a decode request, averaged
    prefix_cache_hit_fraction: float  # cached / (cached + computed) prompt tokens
    queued_prefill_requests: float  # latest value, summed over streams
    queued_prefill_tokens: float
    queued_decode_requests: float
    prefill_tokens_per_s_trend: float = 0.0  # d(rate)/dt, tokens/s per second
    decode_tokens_per_s_trend: float = 0.0
    busy_fraction: float = 0.0  # share of wall-clock time spent in forward passes
    # Queues averaged over the window (time-weighted), summed over streams.
    queued_prefill_requests_mean: float = 0.0
    queued_prefill_tokens_mean: float = 0.0
    queued_decode_requests_mean: float = 0.0
    queued_prefill_tokens_trend: float = 0.0  # d(mean queue)/dt, tokens per second
    queued_decode_requests_trend: float = 0.0  # requests per second
    # Queued prefill tokens now minus at the window's start, per second: with the
    # served rate, the arrivals (arrivals = served + this, over the same window).
    queued_prefill_tokens_change_per_s: float = 0.0
    # Prefill tokens/s arriving over the newest one to two trend sub-windows (served
    # plus the queue's growth there): sees a step in the arrivals within seconds, where
    # the window's mass balance still averages it with the load before. Noisier.
    prefill_demand_tokens_per_s_recent: float = 0.0
    # Shapes measured from the streams (what the latency model needs besides means):
    # prompts that finished prefill per :data:`PROMPT_BIN_EDGES` bin (empty: unknown)
    # and their prompt tokens per bin (each bin's mean length; empty: unknown),
    # and the index of dispersion (variance / mean) of the fleet's arrivals per second
    # (1 for Poisson arrivals; 0: unknown).
    prompt_histogram: tuple[float, ...] = ()
    prompt_bin_tokens: tuple[float, ...] = ()
    arrival_dispersion: float = 0.0
    # The same for one replica's arrivals, pooled over streams (0: unknown): what the
    # router leaves of the fleet's clumping at the current count of streams.
    replica_arrival_dispersion: float = 0.0
    # Decode requests fewer on a pass that carries prefill than on the mean pass (0:
    # none, or unknown): a router that sends prompts to the least busy replica spares
    # that many of a replica's decode requests the prefill's delay.
    prefill_pass_decode_deficit: float = 0.0
    # Share of finished requests per :data:`OUTPUT_INTERVAL_BINS` bin of output length
    # (empty: not measured yet), from when requests leave the decode batch against
    # when they finished prefill (see :mod:`~stepscale_operator.output_lengths`).
    output_interval_shares: tuple[float, ...] = ()
    # The prefill passes a request meets over its first passes, against passes at
    # large (None: too few prompts finished to tell; see
    # :mod:`~stepscale_operator.early_prefills`).
    early_prefills: EarlyPrefills | None = None
    # Realized latency over the window, from the passes themselves (0: unknown): the
    # mean inter-token latency (pass wall times weighted by decode requests), and the
    # mean TTFT (queue wait by Little's law plus time in prefill passes); each with
    # its tail, the planning quantile: ITL's over requests, each output-length class
    # over the cells it decodes in, or within one, over the passes it meets there
    # (:mod:`~stepscale_operator.request_itl_tail`); TTFT's over (stream, second)
    # cells, weighted by prompts.
    realized_itl_mean_ms: float = 0.0
    realized_itl_tail_ms: float = 0.0
    realized_ttft_mean_ms: float = 0.0
    realized_ttft_tail_ms: float = 0.0
    missing_streams: tuple[str, ...] = ()  # ``worker_id/dp_rank`` of stale or silent streams
    unavailable: frozenset[str] = field(default_factory=frozenset)  # fields with no data

    @property
    def complete(self) -> bool:
        """True when every known stream contributed fresh data."""
        return self.streams_total > 0 and self.streams_missing == 0

    def to_dict(self) -> dict[str, LoadValue]:
        """JSON-able form, for status and logs: values that cannot be computed are None."""
        d: dict[str, LoadValue] = {}
        for key, value in asdict(self).items():
            if key == "unavailable":
                continue
            if key in (
                "missing_streams",
                "prompt_histogram",
                "prompt_bin_tokens",
                "output_interval_shares",
            ):
                d[key] = list(value)
            elif key == "early_prefills":
                d[key] = None if value is None else [float(x) for x in value["lift"]]
            else:
                d[key] = None if key in self.unavailable else value
        d["complete"] = self.complete
        return d


# -- plausibility of one forward pass ----------------------------------------------


@dataclass(frozen=True)
class PassLimits:
    """Hard bounds on one forward pass of one engine rank, far beyond any real engine.

    A payload can be valid on the wire and still absurd (1e12 prompt tokens in
    10 ms). Such passes would dominate a least-squares fit and the load sums, so
    they are rejected as *implausible* and counted by reason, never learned.
    """

    max_wall_time_s: float = 600.0
    max_tokens: float = 1e7  # prefill tokens + decode requests computed in one pass
    max_requests: float = 1e6  # prefill or decode requests in one pass
    max_kv_tokens: float = 1e11  # KV tokens attended to in one pass (prefill or decode)
    max_tokens_per_s: float = 1e8  # tokens computed per second of the pass
    max_kv_tokens_per_s: float = 1e12  # KV tokens read per second of the pass
    max_queued_requests: float = 1e7
    max_queued_tokens: float = 1e12


PASS_LIMITS = PassLimits()
IMPLAUSIBLE_REASONS: tuple[str, ...] = ("", "size", "rate", "queue")
"""Reason of each code :func:`implausible_passes` returns (0: plausible)."""

_Q_REQS = [QUEUED_PREFILL_REQS, QUEUED_DECODE_REQS]
_Q_TOKENS = [QUEUED_PREFILL_TOKENS, QUEUED_DECODE_KV]


def implausible_passes(
    sched: npt.NDArray[np.float64],
    wall: npt.NDArray[np.float64],
    queued: npt.NDArray[np.float64] | None = None,
    limits: PassLimits = PASS_LIMITS,
) -> npt.NDArray[np.int8]:
    """Per row, 0 if plausible, else an index into :data:`IMPLAUSIBLE_REASONS`.

    ``sched``/``queued`` are (n, 7)/(n, 6) matrices in wire field order; heartbeats
    (``wall == 0``) are judged on their sizes and queue only.
    """
    tokens = sched[:, SCHED_PREFILL_TOKENS] + sched[:, SCHED_DECODE_REQS]
    kv = sched[:, SCHED_PREFILL_KV] + sched[:, SCHED_DECODE_KV]
    requests = np.maximum(sched[:, SCHED_PREFILL_REQS], sched[:, SCHED_DECODE_REQS])
    size = (
        (wall > limits.max_wall_time_s)
        | (tokens > limits.max_tokens)
        | (requests > limits.max_requests)
        | (kv > limits.max_kv_tokens)
    )
    is_pass = wall > 0.0
    safe_wall = np.where(is_pass, wall, 1.0)
    rate = is_pass & (
        (tokens / safe_wall > limits.max_tokens_per_s)
        | (kv / safe_wall > limits.max_kv_tokens_per_s)
    )
    code = np.where(size, 1, np.where(rate, 2, 0)).astype(np.int8)
    if queued is not None and queued.shape[0]:
        bad_queue = (queued[:, _Q_REQS].max(axis=1) > limits.max_queued_requests) | (
            queued[:, _Q_TOKENS].max(axis=1) > limits.max_queued_tokens
        )
        code[(code == 0) & bad_queue] = 3
    return code


BUDGET_FACTOR = 4.0
"""Default of :func:`over_budget`'s ``factor`` (the cost model and load estimator share it)."""
BUDGET_FLOOR = 65536.0
"""Default of :func:`over_budget`'s ``floor``, in tokens."""


def over_budget(
    used: npt.NDArray[np.float64],
    budget: npt.NDArray[np.float64],
    factor: float = BUDGET_FACTOR,
    floor: float = BUDGET_FLOOR,
) -> npt.NDArray[np.bool_]:
    """Rows computing more than ``factor`` times their stream's budget (at least ``floor``).

    The budget is the largest ``prefill tokens + decode requests`` a stream's
    accepted passes used; a real engine never exceeds its scheduler's token budget,
    so a pass far above everything its stream did before is not believed. The
    floor lets a young stream show its real budget (up to ``factor * floor``).
    """
    return used > factor * np.maximum(budget, floor)


def tally_implausible(
    counts: dict[str, int],
    code: npt.NDArray[np.int8],
    beyond_budget: npt.NDArray[np.bool_] | None = None,
) -> None:
    """Add rejected rows to ``counts`` by reason (``budget`` for rows beyond their budget)."""
    for c in np.unique(code[code > 0]):
        reason = IMPLAUSIBLE_REASONS[int(c)]
        counts[reason] = counts.get(reason, 0) + int(np.count_nonzero(code == c))
    if beyond_budget is not None and beyond_budget.any():
        counts["budget"] = counts.get("budget", 0) + int(np.count_nonzero(beyond_budget))
