"""Whether a rise in demand between two load estimates is more than sampling noise.

A load estimate's rates are counts over a window: ``n`` prompts in ``window_s``
seconds, each of its own length. Arrivals as a Poisson count give the request
rate a variance of ``rate / window_s``; the prompt tokens a second are a compound
count, variance ``rate * E[L^2] / window_s`` with ``E[L^2]`` the prompt lengths'
second moment (from the estimate's prompt-length histogram). With heavy-tailed
prompts a window of a few dozen holds a handful of the tail, and its token rate
swings by half from one window to the next at a steady arrival rate (long
context, about one prompt a second of lognormal lengths: the need read 3, then
14, then 10 within a minute while the request rate fell).

:func:`demand_rise_z` is how many standard errors the later estimate's demand
lies above the earlier one's, on the request rate and on the prompt tokens (the
larger), and :func:`demand_ratio` by what factor (the larger, again);
:func:`arrivals_rise_z` the request rate's alone, which a burst's onset is judged
on (:mod:`~stepscale_operator.burst_floor`). Longer
outputs at the same arrivals are not tested: their noise would need the output
lengths' spread, and a need that rises with them is still followed, only not
remembered as a burst. Pure arithmetic, no state.
"""

from __future__ import annotations

import math

from stepscale_operator.load_types import LoadEstimate, bin_tokens_or_centres


def prompt_second_moment(load: LoadEstimate) -> float | None:
    """E[L^2] of the prompt lengths, from the histogram (each bin at its mean length);
    None when the histogram is not measured."""
    histogram = load.prompt_histogram
    if not histogram or sum(histogram) <= 0.0:
        return None
    tokens = bin_tokens_or_centres(histogram, load.prompt_bin_tokens)
    squares = sum(t * t / c for c, t in zip(histogram, tokens, strict=True) if c > 0.0)
    return squares / sum(histogram)


def _prompt_tokens_per_s(load: LoadEstimate) -> float:
    """Prompt tokens arriving per second, computed or read from the prefix cache."""
    return load.prefill_tokens_per_s + load.prefill_cached_tokens_per_s


def _z(later: float, earlier: float, variance_later: float, variance_earlier: float) -> float:
    spread = math.sqrt(max(variance_later + variance_earlier, 0.0))
    if spread <= 0.0:
        return math.inf if later > earlier else 0.0
    return (later - earlier) / spread


def demand_rise_z(earlier: LoadEstimate, later: LoadEstimate) -> float:
    """Standard errors by which ``later``'s demand exceeds ``earlier``'s (the larger of
    the request rate's and the prompt tokens'); inf where the noise cannot be told
    (no window, no requests counted), so an unmeasurable rise is taken as real."""
    requests = arrivals_rise_z(earlier, later)
    m2_0, m2_1 = prompt_second_moment(earlier), prompt_second_moment(later)
    if m2_0 is None or m2_1 is None or math.isinf(requests):
        return requests  # inf: no window or no requests counted
    window = min(earlier.window_s, later.window_s)
    r0, r1 = max(earlier.prefill_requests_per_s, 0.0), max(later.prefill_requests_per_s, 0.0)
    t0, t1 = _prompt_tokens_per_s(earlier), _prompt_tokens_per_s(later)
    tokens = _z(t1, t0, r1 * m2_1 / window, r0 * m2_0 / window)
    return max(requests, tokens)


def arrivals_rise_z(earlier: LoadEstimate, later: LoadEstimate) -> float:
    """Standard errors by which ``later``'s request rate exceeds ``earlier``'s (inf
    where the noise cannot be told)."""
    window = min(earlier.window_s, later.window_s)
    r0, r1 = max(earlier.prefill_requests_per_s, 0.0), max(later.prefill_requests_per_s, 0.0)
    if window <= 0.0 or r0 + r1 <= 0.0:
        return math.inf
    return _z(r1, r0, r1 / window, r0 / window)


def demand_ratio(earlier: LoadEstimate, later: LoadEstimate) -> float:
    """By what factor ``later``'s demand exceeds ``earlier``'s: the larger of the
    request rate's and the prompt tokens' (inf from none)."""

    def ratio(after: float, before: float) -> float:
        if before <= 0.0:
            return math.inf if after > 0.0 else 1.0
        return after / before

    tokens = ratio(_prompt_tokens_per_s(later), _prompt_tokens_per_s(earlier))
    return max(ratio(later.prefill_requests_per_s, earlier.prefill_requests_per_s), tokens)
