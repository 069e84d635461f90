"""What the slowest requests of a simulated run met while they decoded.

A request's ITL is the mean of its passes; what makes a short output slow is a
prefill on its replica between its first and last token. This counts, for the
requests above the run's p99 ITL and for a sample of short outputs, the prompts
whose prefill finished on their replica during their decode (their first token
after the request's, up to its last), how many of those arrived after the request
and within ``clump_s`` of it (its own clump: prompts that came with it, queued
while it waited and prefilled, and were prefilled right after it), and the
requests' median TTFT. ``bench_prediction.py`` prints it per run, so a model
error in the ITL tail shows its cause beside it.

Pure numpy over the run's per-request arrays; no simulator import.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SHORT_TOKENS = 11  # a short output: at most this many tokens (the chain's outputs)
CLUMP_S = 1.0  # a prompt this soon after a request came with it (the 1 s bucket)


def slow_request_anatomy(
    arrival_s: FloatArray,
    first_token_s: FloatArray,
    finish_s: FloatArray,
    replica: IntArray,
    output_tokens: IntArray,
    itl_ms: FloatArray,
    short_tokens: int = SHORT_TOKENS,
    clump_s: float = CLUMP_S,
    sample: int = 300,
    seed: int = 0,
) -> dict[str, float]:
    """For the requests above the p99 ITL (``slow_``) and a random sample of those
    with at most ``short_tokens`` output tokens (``short_``): the mean count of
    prompts prefilled on their replica during their decode (``..._prefills``), of
    them those that arrived within ``clump_s`` after the request
    (``..._clump_prefills``), and the median TTFT (``..._ttft_ms``); also
    ``itl_p99_ms``, ``slow_requests`` and ``slow_short_share``. Requests without an
    ITL (one token, unfinished) are left out; empty dict when none has one."""
    has = np.flatnonzero(np.isfinite(itl_ms) & (itl_ms > 0.0) & np.isfinite(first_token_s))
    if has.size == 0:
        return {}
    p99 = float(np.percentile(itl_ms[has], 99))
    slow = has[itl_ms[has] > p99]
    short = has[output_tokens[has] <= short_tokens]
    rng = np.random.default_rng(seed)
    picked = rng.choice(short, min(sample, short.size), replace=False) if short.size else short
    # Per replica, its requests ordered by first token: a decode's prefills are a range.
    done = np.isfinite(first_token_s)
    by_replica: dict[int, tuple[FloatArray, IntArray]] = {}
    for r in np.unique(replica[done]):
        ids = np.flatnonzero(done & (replica == r))
        ids = ids[np.argsort(first_token_s[ids], kind="stable")]
        by_replica[int(r)] = (first_token_s[ids], ids)

    def met(i: int) -> tuple[int, int]:
        starts, ids = by_replica[int(replica[i])]
        lo, hi = np.searchsorted(starts, [first_token_s[i], finish_s[i]], side="right")
        others = ids[lo:hi]
        lag = arrival_s[others] - arrival_s[i]
        return int(others.size), int(np.count_nonzero((lag > 0.0) & (lag <= clump_s)))

    out = {"itl_p99_ms": p99, "slow_requests": float(slow.size)}
    out["slow_short_share"] = (
        float(np.mean(output_tokens[slow] <= short_tokens)) if slow.size else float("nan")
    )
    for name, group in (("slow", slow), ("short", picked)):
        counts = np.array([met(int(i)) for i in group], dtype=np.float64).reshape(-1, 2)
        ttft = (first_token_s[group] - arrival_s[group]) * 1e3
        empty = group.size == 0
        out[f"{name}_prefills"] = float("nan") if empty else float(counts[:, 0].mean())
        out[f"{name}_clump_prefills"] = float("nan") if empty else float(counts[:, 1].mean())
        out[f"{name}_ttft_ms"] = float("nan") if empty else float(np.median(ttft))
    return out
