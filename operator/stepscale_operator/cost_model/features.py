"""The feature table: what a forward pass is described by, and the roofline on it.

A forward pass is a *roofline*: a fixed host-side cost, a per-request cost, and
then the larger of the time the GPU needs to do the arithmetic and the time it
needs to move the bytes::

    step_time = base + max(compute, memory)
    base    = intercept + a1*prefill_requests + a2*decode_requests
    compute = c1*tokens + c2*prefill_attention + c3*decode_kv_tokens
    memory  = m0 + m1*kv_read_tokens + m2*prefill_tokens

with every coefficient ``>= 0``, fitted online from the FPM stream of a
deployment, pooled over its pods and ranks. Small batches are *memory-bound*:
every pass streams all the weights (``m0``, the ~5.6 ms floor of an 8B model on
an H100) plus the KV cache of every context token it attends over (``m1``) and
writes the KV of the new prompt tokens (``m2``). Big batches (a 2,048-token
prefill chunk, a few hundred decodes) are *compute-bound*: ``2*params`` FLOPs per
token computed (``c1``, prompt and decode tokens alike) plus attention over the
context (``c2`` for prompt tokens, ``c3`` for decode tokens). A linear model has
to average the two regimes and was 10-15% off on prefill-bearing passes and up to
57% off on steady mixed batches of simulated H100 passes; the roofline is 0.2% off
on average and under 2% on every one of those batches. On a CPU engine the memory
side never wins and the model is linear (``base + compute``).

Raw features (all per forward pass; what the statistics are kept on):

======================  =========  =========================================
name                    unit       meaning
======================  =========  =========================================
intercept               pass       1
prefill_tokens          token      prompt tokens computed (the chunk), ``C``
prefill_attention       token^2    causal attention work of those tokens
prefill_requests        request    requests computing prompt tokens
decode_requests         request    requests decoding one token each
decode_kv_tokens        token      context read by decode attention (sum of contexts)
prefill_kv_tokens       token      cached context of the prefill requests, ``K``
======================  =========  =========================================

Coefficients (what is fitted and reported; ``tokens = prefill_tokens +
decode_requests``, ``kv_read_tokens = decode_kv_tokens + prefill_kv_tokens``):

==============================  =========  ==========  =============================
name                            unit       coef unit   meaning
==============================  =========  ==========  =============================
intercept                       pass       s/pass      launch, scheduling, sampling
prefill_requests                request    s/request   host cost per prefill request
decode_requests                 request    s/request   host cost per decode request
compute.tokens                  token      s/token     GEMMs: 2*params FLOPs a token
compute.prefill_attention       token^2    s/token^2   attention FLOPs of prompt tokens
compute.decode_kv_tokens        token      s/token     attention FLOPs of decode tokens
memory.intercept                pass       s/pass      weights read once a pass
memory.kv_read_tokens           token      s/token     KV cache read
memory.kv_write_tokens          token      s/token     KV written for prompt tokens
==============================  =========  ==========  =============================

The base coefficients keep their linear-model names (they are added to every
pass, as before); the two sides of the ``max`` are prefixed by their piece.

Prefill attention from aggregates. Request ``i`` computes ``c_i`` new tokens on top
of ``k_i`` already in its KV cache; token ``j`` of the chunk attends to ``k_i + j``
keys, so its attention work is ``sum_j (k_i + j) ~= c_i*k_i + c_i^2/2``. The wire
only carries ``C = sum c_i``, ``K = sum k_i``, ``n`` and ``v`` (population
variance of the *full prompt* lengths), so we approximate

* ``sum c_i*k_i ~= C*K/n`` (no correlation between chunk size and cached part;
  exact for ``n == 1``, the usual chunked-prefill and long-prompt case);
* ``sum c_i^2 = n*Var(c) + C^2/n ~= n*v + C^2/n``, using the prompt-length
  variance for the chunk-size variance (exact when whole prompts are computed),
  then clamped to its possible range ``[C^2/n, C^2]`` because chunking makes
  chunks far more uniform than prompts.

``prefill_attention = C*K/n + clamp(n*v + C^2/n, C^2/n, C^2) / 2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.pass_columns import (
    SCHED_DECODE_KV,
    SCHED_DECODE_REQS,
    SCHED_FIELDS,
    SCHED_PREFILL_KV,
    SCHED_PREFILL_REQS,
    SCHED_PREFILL_TOKENS,
    SCHED_PREFILL_VAR,
)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Feature:
    """One raw regressor: its name, unit and internal scale."""

    name: str
    unit: str
    scale: float  # features are divided by this internally to condition the system


FEATURES: tuple[Feature, ...] = (
    Feature("intercept", "pass", 1.0),
    Feature("prefill_tokens", "token", 1e3),
    Feature("prefill_attention", "token^2", 1e6),
    Feature("prefill_requests", "request", 1.0),
    Feature("decode_requests", "request", 1e2),
    Feature("decode_kv_tokens", "token", 1e5),
    Feature("prefill_kv_tokens", "token", 1e5),
)
FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in FEATURES)
N_FEATURES = len(FEATURES)
SCALES = np.array([f.scale for f in FEATURES])


@dataclass(frozen=True)
class Coefficient:
    """One fitted coefficient: its piece, the raw features its regressor sums, units."""

    name: str
    piece: str  # "base", "compute" or "memory"
    features: tuple[str, ...]  # raw features summed into its regressor
    short: str  # name of the regressor in the formula
    unit: str  # regressor unit
    coef_unit: str
    scale: float  # regressor scale in the internal basis


COEFFICIENTS: tuple[Coefficient, ...] = (
    Coefficient("intercept", "base", ("intercept",), "1", "pass", "s/pass", 1.0),
    Coefficient(
        "prefill_requests",
        "base",
        ("prefill_requests",),
        "prefill_req",
        "request",
        "s/request",
        1.0,
    ),
    Coefficient(
        "decode_requests", "base", ("decode_requests",), "decode_req", "request", "s/request", 1e2
    ),
    Coefficient(
        "compute.tokens",
        "compute",
        ("prefill_tokens", "decode_requests"),
        "tokens",
        "token",
        "s/token",
        1e3,
    ),
    Coefficient(
        "compute.prefill_attention",
        "compute",
        ("prefill_attention",),
        "prefill_attn",
        "token^2",
        "s/token^2",
        1e6,
    ),
    Coefficient(
        "compute.decode_kv_tokens",
        "compute",
        ("decode_kv_tokens",),
        "decode_kv",
        "token",
        "s/token",
        1e5,
    ),
    Coefficient("memory.intercept", "memory", ("intercept",), "1", "pass", "s/pass", 1.0),
    Coefficient(
        "memory.kv_read_tokens",
        "memory",
        ("decode_kv_tokens", "prefill_kv_tokens"),
        "kv_read",
        "token",
        "s/token",
        1e5,
    ),
    Coefficient(
        "memory.kv_write_tokens",
        "memory",
        ("prefill_tokens",),
        "prefill_tok",
        "token",
        "s/token",
        1e3,
    ),
)
COEFFICIENT_NAMES: tuple[str, ...] = tuple(c.name for c in COEFFICIENTS)
N_COEFFICIENTS = len(COEFFICIENTS)
COEF_SCALES = np.array([c.scale for c in COEFFICIENTS])
BASE = np.array([c.piece == "base" for c in COEFFICIENTS])
COMPUTE = np.array([c.piece == "compute" for c in COEFFICIENTS])
MEMORY = np.array([c.piece == "memory" for c in COEFFICIENTS])


def _regressor_map(scaled: bool) -> FloatArray:
    """(coefficients, raw features) matrix: regressor j = sum over its raw features."""
    m = np.zeros((N_COEFFICIENTS, N_FEATURES))
    for j, coef in enumerate(COEFFICIENTS):
        for name in coef.features:
            i = FEATURE_NAMES.index(name)
            m[j, i] = SCALES[i] / coef.scale if scaled else 1.0
    return m


# Raw (unscaled) and internal (scaled) maps from raw features to regressors; P_k of a
# cell on the compute side keeps the base and compute rows, on the memory side the
# base and memory rows.
REGRESSORS = _regressor_map(scaled=False)
P_ALL = _regressor_map(scaled=True)
P_COMPUTE = P_ALL * (~MEMORY)[:, None]
P_MEMORY = P_ALL * (~COMPUTE)[:, None]
# Tokens computed (prefill + decode) from a scaled raw feature row.
TOKENS_SCALED = np.array(
    [
        s if n in ("prefill_tokens", "decode_requests") else 0.0
        for n, s in zip(FEATURE_NAMES, SCALES, strict=True)
    ]
)
KNEE_TOKENS = 256.0  # side of a pass before the roofline has a memory side
MAX_ASSIGN_ITERATIONS = 8
COMPUTE_SIDE, MEMORY_SIDE, UNASSIGNED = 0, 1, -1

REGIMES = ("prefill_only", "decode_only", "mixed", "empty")

# Coverage buckets: prefill-token bins x decode-request bins x context bins (the
# context a request attends over: a decode's, or a prefill chunk's cached prefix).
P_BINS, D_BINS, K_BINS = 9, 7, 6
N_BUCKETS = P_BINS * D_BINS * K_BINS
PRIOR_BUCKET = N_BUCKETS  # holds a warm-started model's statistics
# Cell 2k of bucket k holds passes learned on the compute side, 2k+1 on the memory side.
LEARNED_SIDE = np.tile(np.array([COMPUTE_SIDE, MEMORY_SIDE], dtype=np.int8), N_BUCKETS)


def sched_matrix(scheds: Sequence[ScheduledRequestMetrics]) -> FloatArray:
    """Batch compositions as an (n, 7) matrix in ScheduledRequestMetrics field order."""
    from msgspec.structs import astuple

    if not scheds:
        return np.zeros((0, len(SCHED_FIELDS)))
    return np.array([astuple(s) for s in scheds], dtype=np.float64)


def feature_matrix(sched: FloatArray) -> FloatArray:
    """Raw-unit features (n, 7) from an (n, 7) composition matrix; see the module docstring."""
    n_req = sched[:, SCHED_PREFILL_REQS]
    c = sched[:, SCHED_PREFILL_TOKENS]
    var = sched[:, SCHED_PREFILL_VAR]
    k = sched[:, SCHED_PREFILL_KV]
    safe_n = np.maximum(n_req, 1.0)
    c2 = c * c
    sum_c_sq = np.clip(safe_n * var + c2 / safe_n, c2 / safe_n, c2)
    attention = np.where(c > 0, c * k / safe_n + 0.5 * sum_c_sq, 0.0)
    x = np.empty((sched.shape[0], N_FEATURES))
    x[:, 0] = 1.0
    x[:, 1] = c
    x[:, 2] = attention
    x[:, 3] = n_req
    x[:, 4] = sched[:, SCHED_DECODE_REQS]
    x[:, 5] = sched[:, SCHED_DECODE_KV]
    x[:, 6] = np.where(c > 0, k, 0.0)
    return x


def regressor_matrix(sched: FloatArray) -> FloatArray:
    """Raw-unit regressors (n, 9) of every coefficient, in :data:`COEFFICIENTS` order."""
    return feature_matrix(sched) @ REGRESSORS.T


def roofline(regressors: FloatArray, coef: FloatArray) -> FloatArray:
    """``base + max(compute, memory)`` per row, for regressors and coefficients in one basis."""
    base = regressors[:, BASE] @ coef[BASE]
    compute = regressors[:, COMPUTE] @ coef[COMPUTE]
    memory = regressors[:, MEMORY] @ coef[MEMORY]
    out: FloatArray = base + np.maximum(compute, memory)
    return out


def compute_side(regressors: FloatArray, coef: FloatArray) -> npt.NDArray[np.bool_]:
    """Rows whose compute piece is at least their memory piece (ties go to compute)."""
    compute = regressors[:, COMPUTE] @ coef[COMPUTE]
    memory = regressors[:, MEMORY] @ coef[MEMORY]
    return np.asarray(compute >= memory)


def _log_bin(values: FloatArray, base_log2: float, n_bins: int) -> npt.NDArray[np.int64]:
    """0 for zero, else 1 + floor(log_base(value)), capped at ``n_bins - 1``."""
    safe = np.maximum(values, 1.0)
    bins = 1 + np.floor(np.log2(safe) / base_log2).astype(np.int64)
    return np.where(values > 0, np.minimum(bins, n_bins - 1), 0)


def bucket_ids(sched: FloatArray) -> npt.NDArray[np.int64]:
    """Coverage bucket of each row: log4 prefill tokens x log4 decode reqs x log8
    context, the larger of a decode request's mean context and a prefill request's
    mean cached prefix.

    The cached prefix counts because attention over it is a cost of its own: chunks
    over a 60k-token prefix, after 6,000 passes without one, fell in the buckets of
    the prompts before them, where the stall gate is narrow, and were rejected as
    stalls until they had pushed those buckets' rejection rate past half: 1,080 of
    them at 1.5x their extrapolation (``benchmarks/bench_new_pass_kind.py``). In a
    bucket of their own they are an unlearned regime, gated as one: 20.
    """
    c = sched[:, SCHED_PREFILL_TOKENS]
    d = sched[:, SCHED_DECODE_REQS]
    decode_ctx = np.where(d > 0, sched[:, SCHED_DECODE_KV] / np.maximum(d, 1.0), 0.0)
    prefill_ctx = np.where(
        c > 0, sched[:, SCHED_PREFILL_KV] / np.maximum(sched[:, SCHED_PREFILL_REQS], 1.0), 0.0
    )
    pb = _log_bin(c, 2.0, P_BINS)
    db = _log_bin(d, 2.0, D_BINS)
    kb = _log_bin(np.maximum(decode_ctx, prefill_ctx), 3.0, K_BINS)
    return (pb * D_BINS + db) * K_BINS + kb


def bucket_label(bucket: int) -> str:
    """What passes a coverage bucket holds, in words, e.g. ``prefill 256-1023 tokens,
    decode 0, context 4096+`` (what status shows for a bucket the model is wrong in)."""
    if bucket >= N_BUCKETS:
        return "warm-start prior"
    pb, rest = divmod(int(bucket), D_BINS * K_BINS)
    db, kb = divmod(rest, K_BINS)
    return (
        f"prefill {_bin_range(pb, 2.0, P_BINS)} tokens, decode {_bin_range(db, 2.0, D_BINS)},"
        f" context {_bin_range(kb, 3.0, K_BINS)}"
    )


def _bin_range(index: int, base_log2: float, n_bins: int) -> str:
    """The values :func:`_log_bin` puts in bin ``index``: ``0``, ``16-63``, ``4096+``."""
    if index == 0:
        return "0"
    lo = int(2.0 ** (base_log2 * (index - 1)))
    if index == n_bins - 1:
        return f"{lo}+"
    return f"{lo}-{int(2.0 ** (base_log2 * index)) - 1}"


def regime_ids(sched: FloatArray) -> npt.NDArray[np.int64]:
    """Index into :data:`REGIMES` of each row."""
    has_p = sched[:, SCHED_PREFILL_TOKENS] > 0
    has_d = sched[:, SCHED_DECODE_REQS] > 0
    return np.where(has_p, np.where(has_d, 2, 0), np.where(has_d, 1, 3))
