"""Plain data types shared by load estimation, the planner and the simulator.

Kept apart from the code that computes them so the planner depends on the shape
of a load estimate, not on how it was measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LoadEstimate:
    """The load a deployment carried over the last ``window_s`` seconds, fleet-wide.

    Rates are sums over every fresh stream of the deployment. A stream that is
    stale or missing is counted in ``streams_missing``; its load is unknown,
    never zero, and ``complete`` is False so the planner will not scale down.
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

    @property
    def complete(self) -> bool:
        """True when every known stream contributed fresh data."""
        return self.streams_total > 0 and self.streams_missing == 0

    def to_dict(self) -> dict[str, float | int | bool]:
        """JSON-able form, for status and logs."""
        d: dict[str, float | int | bool] = dict(asdict(self))
        d["complete"] = self.complete
        return d
