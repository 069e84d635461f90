"""Online cost model: how long a forward pass takes, from the composition of its batch.

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

Fitting. Weighted least squares, weights ``1/y^2`` (the observed time) so the fit
minimises *relative* error (step-time noise is multiplicative), non-negative
coefficients by an active-set NNLS on the normal equations. (Weights ``1/pred^2``
were tried first: they over-weight every pass the model under-predicts, stalls
and not-yet-learned regimes alike, which biased real CPU fits 20-30% high.)
Sufficient statistics of the raw features (Gram matrix, ``X'y``, ``y'y``,
counts) are kept per *coverage bucket* (regime x log-size of prefill tokens,
decode requests and decode context); every sample updates one bucket in O(d^2).
All buckets forget with the global sample clock (half-life ``half_life_passes``)
so the model follows a changed engine, but a bucket never decays below
``bucket_floor`` effective samples from time alone: a flood of decode-only
passes cannot wash out what the prefill buckets know. Within a bucket newer
passes also supersede older ones (``bucket_half_life``, in that bucket's own
passes).

The max, online. Given which side of the ``max`` each pass is on, the model is
linear in its coefficients: every coefficient's regressor is a fixed linear
combination of the raw features (a selection matrix ``P``: base and compute rows,
or base and memory rows). So statistics are kept on the raw features and mapped
exactly into coefficient space, ``G = sum_k P_k G_k P_k'`` and
``h = sum_k P_k h_k`` over *cells* ``k``, each on one side: two pooled sums, one
per side, then two 9x7 products. A cell is half a bucket: the passes learned while
the roofline put them on its compute side, and those it put on its memory side
(before it has a memory side: memory when it computes at most ``KNEE_TOKENS`` tokens).
Buckets are coarse (4x in prefill tokens and decode batch, 8x in context), and a
bucket of 64-255 decodes at 500-4,000 tokens of context straddles the knee; its two
cells do not (on the H100 passes of the unit tests, sides per bucket left 1.1% mean
error and up to 8% on steady batches; per cell 0.1% and 0.6%).

At each solve a cell is *assigned* to the side that is larger at its mean
composition (the first row of its Gram matrix over its weight: feature 0 is 1;
both sides are linear, so that is the sign of one dot product). A solve
alternates NNLS and reassignment (max-affine regression: as k-means alternates
means and clusters) until no cell changes side, at most ``MAX_ASSIGN_ITERATIONS``
times, starting from the previous solve's sides (a new cell: the side it was
learned on). The alternation can settle in a poorer local optimum, so the plain
``base + compute`` fit (every cell on the compute side: the linear model) is
solved too and the fit with the smaller weighted residual sum of squares is
kept; the roofline's own sides carry on to the next solve either way, and if it
collapses onto one side it starts again from the learned sides. Both NNLS are
warm-started on the previous solution's support (one 9x9 solve when it holds).

Robustness. On a shared CPU a pass can be stalled 10-30x by the scheduler, in
*runs* of up to a few hundred passes, so per-pass outlier tests on a short window
fail: a run fills the window, widens the scale, and the stalls get learned (that
was the old behaviour: ~2x predictions for thousands of passes). Here, residuals
are ``log(y/pred)``; their median and MAD over a long window (``robust_window``
passes, all residuals, rejected ones included) give a centre and a scale that a
run shorter than half the window cannot move much. A pass more than ``reject_k``
scales *slower* than the centre is rejected (stalls only ever slow a pass; a pass
faster than predicted is not an outlier, the fit is simply too high). Accepted
passes get Huber weights on their relative residual about the centre, which bounds
any pass's pull on the fit. A bucket with little data, or whose passes the gate
has been rejecting most of the time for long (``misfit_half_life``: that is the
model being wrong there, not stalls), gets a 3x wider gate, so an unlearned regime
is not mistaken for a stall. A persistently slower engine moves the centre; while
the centre is off by more than ``drift_k`` scales (and 5%) the model is *drifting*
and forgets at ``drift_half_life_passes`` without coverage floors, so it follows
the change in a few thousand passes whatever the half-life. The first
``warmup_passes`` passes of a new or restarted stream (cold caches, compilation)
are not samples; nor are heartbeats.

Plausibility. A payload can be valid and still absurd (1e12 prompt tokens in
10 ms); weighted by ``1/y^2`` such a pass would outweigh everything learned. So a
pass is *implausible*, counted by reason and never learned, when it breaks the hard
limits of :class:`~stepscale_operator.load_types.PassLimits` (``size``, ``rate``),
computes more than ``budget_factor`` times the largest pass its stream had before
(``budget``; at least ``budget_floor`` tokens), or, once the model has
``min_samples``, runs more than ``fast_factor`` times faster than predicted about the
centre (``fast``; those residuals still enter the robust window, so an engine that
really became that much faster moves the centre and is learned).

Cost per sample. Accumulating a sample is O(d^2). The robust centre and scale
(an O(window) median) are recomputed every ``robust_every`` residuals, and the
pooled solve (O(cells*d^2) per alternation, usually one or two, and a 9x9 NNLS) every
``resolve_every`` samples until the model holds ``min_samples``, then every
``samples/64`` up to ``resolve_every_ready`` (one subscriber batch), and on
demand when predictions or coefficients are asked for: amortised O(d^2) per sample
in steady state.

Standard errors come from the pooled coefficient-space system of the kept fit
(given its assignment); a coefficient whose regressor saw no data (the memory
side of a CPU engine) has none (NaN). Snapshots (:meth:`CostModel.to_dict`,
schema ``stepscale.cost_model/v2``) keep those pooled coefficient-space
statistics, which restore as one prior bucket; a v1 (linear) snapshot is refused
with a ValueError and the operator starts afresh.

Quality is measured prequentially: every pass is predicted before it is learned.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.load_types import (
    BUDGET_FACTOR,
    BUDGET_FLOOR,
    implausible_passes,
    over_budget,
    tally_implausible,
)
from stepscale_operator.pass_columns import (
    SCHED_DECODE_KV,
    SCHED_DECODE_REQS,
    SCHED_FIELDS,
    SCHED_PREFILL_KV,
    SCHED_PREFILL_REQS,
    SCHED_PREFILL_TOKENS,
    SCHED_PREFILL_VAR,
)
from stepscale_operator.stream_state import StreamGroups, StreamKey

FloatArray = npt.NDArray[np.float64]

SCHEMA = "stepscale.cost_model/v2"
SCHEMA_V1 = "stepscale.cost_model/v1"  # the linear model's snapshots: refused



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
_SCALES = np.array([f.scale for f in FEATURES])


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
_COEF_SCALES = np.array([c.scale for c in COEFFICIENTS])
_BASE = np.array([c.piece == "base" for c in COEFFICIENTS])
_COMPUTE = np.array([c.piece == "compute" for c in COEFFICIENTS])
_MEMORY = np.array([c.piece == "memory" for c in COEFFICIENTS])


def _regressor_map(scaled: bool) -> FloatArray:
    """(coefficients, raw features) matrix: regressor j = sum over its raw features."""
    m = np.zeros((N_COEFFICIENTS, N_FEATURES))
    for j, coef in enumerate(COEFFICIENTS):
        for name in coef.features:
            i = FEATURE_NAMES.index(name)
            m[j, i] = _SCALES[i] / coef.scale if scaled else 1.0
    return m


# Raw (unscaled) and internal (scaled) maps from raw features to regressors; P_k of a
# cell on the compute side keeps the base and compute rows, on the memory side the
# base and memory rows.
_REGRESSORS = _regressor_map(scaled=False)
_P_ALL = _regressor_map(scaled=True)
_P_COMPUTE = _P_ALL * (~_MEMORY)[:, None]
_P_MEMORY = _P_ALL * (~_COMPUTE)[:, None]
# Tokens computed (prefill + decode) from a scaled raw feature row.
_TOKENS_SCALED = np.array(
    [
        s if n in ("prefill_tokens", "decode_requests") else 0.0
        for n, s in zip(FEATURE_NAMES, _SCALES, strict=True)
    ]
)
KNEE_TOKENS = 256.0  # side of a pass before the roofline has a memory side
MAX_ASSIGN_ITERATIONS = 8
COMPUTE_SIDE, MEMORY_SIDE, UNASSIGNED = 0, 1, -1

REGIMES = ("prefill_only", "decode_only", "mixed", "empty")

# Coverage buckets: prefill-token bins x decode-request bins x decode-context bins.
_P_BINS, _D_BINS, _K_BINS = 9, 7, 6
N_BUCKETS = _P_BINS * _D_BINS * _K_BINS
_PRIOR_BUCKET = N_BUCKETS  # holds a warm-started model's statistics
# Cell 2k of bucket k holds passes learned on the compute side, 2k+1 on the memory side.
_LEARNED_SIDE = np.tile(np.array([COMPUTE_SIDE, MEMORY_SIDE], dtype=np.int8), N_BUCKETS)


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
    return feature_matrix(sched) @ _REGRESSORS.T


def roofline(regressors: FloatArray, coef: FloatArray) -> FloatArray:
    """``base + max(compute, memory)`` per row, for regressors and coefficients in one basis."""
    base = regressors[:, _BASE] @ coef[_BASE]
    compute = regressors[:, _COMPUTE] @ coef[_COMPUTE]
    memory = regressors[:, _MEMORY] @ coef[_MEMORY]
    out: FloatArray = base + np.maximum(compute, memory)
    return out


def compute_side(regressors: FloatArray, coef: FloatArray) -> npt.NDArray[np.bool_]:
    """Rows whose compute piece is at least their memory piece (ties go to compute)."""
    compute = regressors[:, _COMPUTE] @ coef[_COMPUTE]
    memory = regressors[:, _MEMORY] @ coef[_MEMORY]
    return np.asarray(compute >= memory)


def _log_bin(values: FloatArray, base_log2: float, n_bins: int) -> npt.NDArray[np.int64]:
    """0 for zero, else 1 + floor(log_base(value)), capped at ``n_bins - 1``."""
    safe = np.maximum(values, 1.0)
    bins = 1 + np.floor(np.log2(safe) / base_log2).astype(np.int64)
    return np.where(values > 0, np.minimum(bins, n_bins - 1), 0)


def bucket_ids(sched: FloatArray) -> npt.NDArray[np.int64]:
    """Coverage bucket of each row: log4 prefill tokens x log4 decode reqs x log8 context."""
    c = sched[:, SCHED_PREFILL_TOKENS]
    d = sched[:, SCHED_DECODE_REQS]
    mean_ctx = sched[:, SCHED_DECODE_KV] / np.maximum(d, 1.0)
    pb = _log_bin(c, 2.0, _P_BINS)
    db = _log_bin(d, 2.0, _D_BINS)
    kb = np.where(d > 0, _log_bin(mean_ctx, 3.0, _K_BINS), 0)
    return (pb * _D_BINS + db) * _K_BINS + kb


def regime_ids(sched: FloatArray) -> npt.NDArray[np.int64]:
    """Index into :data:`REGIMES` of each row."""
    has_p = sched[:, SCHED_PREFILL_TOKENS] > 0
    has_d = sched[:, SCHED_DECODE_REQS] > 0
    return np.where(has_p, np.where(has_d, 2, 0), np.where(has_d, 1, 3))


def nnls_normal(
    gram: FloatArray,
    rhs: FloatArray,
    max_iter: int = 100,
    support: npt.NDArray[np.bool_] | None = None,
) -> FloatArray:
    """Minimise ``x'Gx - 2x'h`` subject to ``x >= 0`` (Lawson-Hanson on normal equations).

    ``gram`` must be symmetric positive definite (callers add a small ridge).
    ``support`` (e.g. the previous solution's positive coefficients) is a warm start:
    the unconstrained solution on it, shrunk until positive, is the feasible start
    the iterations go on from, so a solve whose support did not change costs one
    linear solve instead of one per coefficient. The result is the same.
    """
    d = rhs.shape[0]
    x = np.zeros(d)
    passive = np.zeros(d, dtype=bool)
    if support is not None:
        trial = support.copy()
        while trial.any():
            idx = np.flatnonzero(trial)
            z = np.linalg.solve(gram[np.ix_(idx, idx)], rhs[idx])
            if (z > 0).all():
                x[idx] = z
                passive = trial
                break
            trial[idx[z <= 0]] = False
    tol = 1e-12 * max(float(np.abs(rhs).max(initial=0.0)), 1e-300)
    for _ in range(max_iter):
        grad = rhs - gram @ x
        candidates = np.where(~passive, grad, -np.inf)
        j = int(np.argmax(candidates))
        if passive.all() or candidates[j] <= tol:
            break
        passive[j] = True
        for _ in range(max_iter):
            z = np.zeros(d)
            idx = np.flatnonzero(passive)
            z[idx] = np.linalg.solve(gram[np.ix_(idx, idx)], rhs[idx])
            if (z[idx] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = float(np.min(x[bad] / (x[bad] - z[bad])))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


class _Pool:
    """Per-cell raw-feature statistics pooled into coefficient space, given cell sides.

    Cell ``k`` on the compute side contributes ``P_c G_k P_c'`` (its base and compute
    regressors), on the memory side ``P_m G_k P_m'``: one weighted sum of the cell
    Gram matrices per side, then two small products.
    """

    def __init__(self, grams: FloatArray, xtys: FloatArray, yty: float) -> None:
        n = grams.shape[0]
        self._grams = grams.reshape(n, -1)
        self._xtys = xtys
        self.yty = yty
        # Row 0 of a cell's Gram matrix is its weighted feature sum (feature 0 is 1):
        # its mean composition times its weight.
        self._first_rows = grams[:, 0, :]
        self.weight = grams[:, 0, 0]
        self._prior_gram = np.zeros((N_COEFFICIENTS, N_COEFFICIENTS))
        self._prior_xty = np.zeros(N_COEFFICIENTS)

    def add_prior(self, gram: FloatArray, xty: FloatArray) -> None:
        """Statistics already in coefficient space (a restored snapshot)."""
        self._prior_gram = gram
        self._prior_xty = xty

    def pooled(self, memory: npt.NDArray[np.bool_]) -> tuple[FloatArray, FloatArray]:
        """Coefficient-space Gram matrix and right-hand side with ``memory`` cells on
        the memory side and the others on the compute side."""
        wm = memory.astype(np.float64)
        wc = 1.0 - wm
        d = N_FEATURES
        gram_c = (wc @ self._grams).reshape(d, d)
        gram_m = (wm @ self._grams).reshape(d, d)
        gram = _P_COMPUTE @ gram_c @ _P_COMPUTE.T + _P_MEMORY @ gram_m @ _P_MEMORY.T
        xty = _P_COMPUTE @ (wc @ self._xtys) + _P_MEMORY @ (wm @ self._xtys)
        return gram + self._prior_gram, xty + self._prior_xty

    def memory_side(self, coef: FloatArray) -> npt.NDArray[np.bool_]:
        """Buckets whose memory piece exceeds their compute piece at their mean composition
        (both pieces are linear, so that is the sign of a weighted sum)."""
        direction = (coef * _COMPUTE) @ _P_ALL - (coef * _MEMORY) @ _P_ALL
        return np.asarray(self._first_rows @ direction < 0)

    def loss(self, coef: FloatArray, gram: FloatArray, xty: FloatArray) -> float:
        """Weighted residual sum of squares of ``coef`` on the pooled system."""
        return max(self.yty - 2.0 * float(coef @ xty) + float(coef @ gram @ coef), 0.0)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class ModelQuality:
    """How good the fit is; APE figures are prequential (predicted before learning)."""

    window: int  # predictions in the rolling window
    r2: float  # prequential R^2 over the window
    mape: float  # mean absolute percentage error, as a fraction (0.05 = 5%)
    median_ape: float
    p90_ape: float
    samples: int  # passes learned since creation (warm start included)
    effective_samples: float  # after forgetting
    prefill_only_samples: int
    decode_only_samples: int
    mixed_samples: int
    buckets_covered: int  # coverage buckets holding data
    outliers_rejected: int
    warmup_skipped: int
    heartbeats_ignored: int
    residual_scale: float  # robust (MAD) scale of log residuals, log(actual/predicted)
    std_errors: dict[str, float] = field(default_factory=dict)  # per coefficient, SI units
    implausible_rejected: dict[str, int] = field(default_factory=dict)  # by reason

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (NaN becomes None)."""
        d = asdict(self)
        for key, value in list(d.items()):
            if isinstance(value, float):
                d[key] = _finite_or_none(value)
        # A coefficient without a standard error (its regressor saw no data) is left out.
        d["std_errors"] = {k: v for k, v in self.std_errors.items() if math.isfinite(v)}
        d["implausible_rejected"] = dict(self.implausible_rejected)
        return d


@dataclass
class _StreamStats:
    last_counter: int | None = None
    passes: int = 0  # passes since the stream (re)started, heartbeats excluded
    samples: int = 0
    outliers: int = 0
    n_eff: float = 0.0
    sum_rel: float = 0.0  # exponentially weighted sums of relative residuals
    sum_abs_rel: float = 0.0
    last_clock: float = 0.0
    budget: float = 0.0  # largest prefill tokens + decode requests of a learned pass


class CostModel:
    """Online, robust, non-negative fit of forward-pass time from batch composition."""

    def __init__(
        self,
        half_life_passes: float = 20000.0,
        warmup_passes: int = 20,
        *,
        min_samples: int = 200,
        min_regime_samples: int | None = None,
        bucket_floor: float | None = None,
        quality_window: int = 2000,
        robust_window: int = 2000,
        huber_k: float = 1.0,
        reject_k: float = 3.0,
        bucket_trust: float = 20.0,
        misfit_half_life: float = 500.0,
        bucket_half_life: float = 2000.0,
        drift_k: float = 1.0,
        drift_half_life_passes: float = 500.0,
        resolve_every: int = 16,
        resolve_every_ready: int = 4096,
        robust_every: int = 64,
        budget_factor: float = BUDGET_FACTOR,
        budget_floor: float = BUDGET_FLOOR,
        fast_factor: float = 10.0,
        max_chunk: int = 4096,  # a whole subscriber batch learned against one solve
        max_streams: int = 4096,
        stream_half_life_passes: float = 200.0,
        ridge: float = 1e-7,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if half_life_passes <= 0:
            raise ValueError("half_life_passes must be positive")
        self.half_life_passes = float(half_life_passes)
        self.warmup_passes = int(warmup_passes)
        self.min_samples = int(min_samples)
        # Passes that must carry prefill (and, apart, decode) before predictions are
        # trusted: the planner predicts both TTFT and ITL from this one model.
        # Unless set, a tenth of min_samples (see the property).
        self._min_regime_setting = None if min_regime_samples is None else int(min_regime_samples)
        # Default floor: 1/2000 of the half-life (10 samples at the default), so that a
        # bucket keeps some knowledge forever but stale data never outweighs fresh: with
        # ~100 buckets in use, 1/200 (the old default) held more samples in the floors
        # than the half-life itself, and a changed engine was never followed.
        self.bucket_floor = (
            self.half_life_passes / 2000.0 if bucket_floor is None else float(bucket_floor)
        )
        self.quality_window = int(quality_window)
        self.robust_window = int(robust_window)
        self.huber_k = float(huber_k)
        self.reject_k = float(reject_k)
        self.bucket_trust = float(bucket_trust)
        self._misfit_decay = 2.0 ** (-1.0 / float(misfit_half_life))
        self.bucket_half_life = float(bucket_half_life)
        self._own_decay = 2.0 ** (-1.0 / self.bucket_half_life)
        self.drift_k = float(drift_k)
        self.drift_half_life_passes = float(drift_half_life_passes)
        self.resolve_every = max(1, int(resolve_every))
        self.resolve_every_ready = max(self.resolve_every, int(resolve_every_ready))
        self.robust_every = max(1, int(robust_every))
        self.budget_factor = float(budget_factor)
        self.budget_floor = float(budget_floor)
        self._log_fast = math.log(max(float(fast_factor), 1.0))
        self.max_chunk = max(1, int(max_chunk))
        self.max_streams = int(max_streams)
        self.stream_half_life_passes = float(stream_half_life_passes)
        self.ridge = float(ridge)
        self._clock = clock
        self._decay = 2.0 ** (-1.0 / self.half_life_passes)
        self._stream_decay = 2.0 ** (-1.0 / self.stream_half_life_passes)

        nb = N_BUCKETS + 1
        d = N_FEATURES
        # Raw-feature statistics per bucket, in two cells: the passes learned while the
        # roofline put them on its compute side, and on its memory side. Forgetting,
        # floors and counts are per bucket. The prior bucket's statistics are in
        # coefficient space (a snapshot's pooled ones), in _prior_gram and _prior_xty.
        self._gram = np.zeros((nb, 2, d, d))
        self._xty = np.zeros((nb, 2, d))
        self._yty = np.zeros(nb)
        self._count = np.zeros(nb)  # decayed sample counts (for degrees of freedom)
        p = N_COEFFICIENTS
        self._prior_gram = np.zeros((p, p))
        self._prior_xty = np.zeros(p)
        self._bucket_clock = np.zeros(nb)
        self._floor = np.full(nb, self.bucket_floor)
        self._floor[_PRIOR_BUCKET] = 0.0  # a warm start fades out completely
        # Per bucket, the exponentially weighted fraction of its passes the gate rejected.
        self._reject_rate = np.zeros(nb)
        self._sample_clock = 0.0
        self._drifting = False

        self._coef: FloatArray | None = None  # scaled coefficient basis
        self._std_err: FloatArray = np.full(p, np.nan)  # scaled coefficient basis
        self._since_solve = 0
        # The roofline candidate's side of each cell (carried from solve to solve) and
        # its last coefficients; the kept fit's pooled coefficient-space statistics.
        self._side = np.full(2 * N_BUCKETS, UNASSIGNED, dtype=np.int8)
        self._roof_coef: FloatArray | None = None
        self._lin_coef: FloatArray | None = None  # the linear candidate's (warm start)
        self.roofline_active = False  # the kept fit has both a compute and a memory side
        self.assign_iterations = 0  # alternations the last solve took
        self._pooled_gram = np.zeros((p, p))
        self._pooled_xty = np.zeros(p)

        self._q_y = np.zeros(self.quality_window)
        self._q_p = np.zeros(self.quality_window)
        self._q_len = 0
        self._q_pos = 0
        self._r_ring = np.zeros(self.robust_window)
        self._r_len = 0
        self._r_pos = 0
        self._r_since = 0  # residuals pushed since the centre and scale were computed
        # Residuals the window needs before its median replaces the centre and scale
        # (raised after a warm start so the restored ones hold for a while).
        self._r_min = 20
        self._residual_scale = math.nan
        self._residual_center = 0.0

        self.samples = 0
        self.regime_samples = dict.fromkeys(REGIMES, 0)
        self.outliers_rejected = 0
        self.warmup_skipped = 0
        self.heartbeats_ignored = 0
        self.implausible_rejected: dict[str, int] = {}
        self.updated_at: float | None = None
        # Least recently active first, so evicting the oldest stream is O(1).
        self._streams: OrderedDict[StreamKey, _StreamStats] = OrderedDict()

    # -- learning --------------------------------------------------------------

    def update(
        self,
        sched: ScheduledRequestMetrics,
        wall_time_s: float,
        stream: StreamKey = ("", 0),
        counter_id: int | None = None,
    ) -> float | None:
        """Learn one pass; return the prediction made before learning it.

        None when the pass is not a sample (heartbeat, warm-up of its stream,
        invalid time) or no fit exists yet. ``counter_id`` (the message sequence)
        lets the model see a stream restart (counter went back) and warm up again.
        """
        counters = None if counter_id is None else [counter_id]
        pred = self.update_batch([sched], [wall_time_s], [stream], counters)
        value = pred[0]
        return None if math.isnan(value) else float(value)

    def update_batch(
        self,
        scheds: Sequence[ScheduledRequestMetrics] | FloatArray,
        wall_times_s: Sequence[float] | FloatArray,
        streams: Sequence[StreamKey] | StreamGroups,
        counter_ids: Sequence[int] | npt.NDArray[np.int64] | None = None,
    ) -> FloatArray:
        """Learn passes in order; returns each prequential prediction (NaN where none).

        ``scheds`` is a sequence of structs or an (n, 7) matrix in
        ScheduledRequestMetrics field order (what the ingest pipeline already has).
        """
        sched = scheds if isinstance(scheds, np.ndarray) else sched_matrix(scheds)
        wall = np.asarray(wall_times_s, dtype=np.float64)
        n = wall.shape[0]
        if sched.shape != (n, len(SCHED_FIELDS)) or len(streams) != n:
            raise ValueError("scheds, wall_times_s and streams must have the same length")
        if counter_ids is not None and len(counter_ids) != n:
            raise ValueError("counter_ids must match the batch length")
        usable, stream_slot, slot_keys = self._track_streams(wall, streams, counter_ids)
        preds = np.full(n, np.nan)
        rows = np.flatnonzero(usable)
        start = 0
        while start < rows.shape[0]:
            chunk = rows[start : start + self._chunk_size()]
            start += chunk.shape[0]
            preds[chunk] = self._learn_rows(
                sched[chunk], wall[chunk], stream_slot[chunk], slot_keys
            )
        return preds

    def notify_restart(self, stream: StreamKey) -> None:
        """The caller saw ``stream`` restart: its next passes are warm-up again."""
        stats = self._streams.get(stream)
        if stats is not None:
            stats.passes = 0
            stats.last_counter = None

    def forget_stream(self, stream: StreamKey) -> None:
        """Drop per-stream state (the pod is gone); learned coefficients stay."""
        self._streams.pop(stream, None)

    def _chunk_size(self) -> int:
        # Early on, re-solve often so predictions (and robust weights) exist soon.
        if self._coef is None or self.samples < self.min_samples:
            return max(1, min(self.max_chunk, self.resolve_every))
        return self.max_chunk

    def _resolve_period(self) -> int:
        """Samples between solves: often while learning, then less as data accumulates.

        Growing with the samples (1/64 of them, up to ``resolve_every_ready``) keeps
        early predictions fresh and bounds the steady-state cost per sample.
        """
        if self.samples < self.min_samples:
            return self.resolve_every
        return min(self.resolve_every_ready, max(self.resolve_every, self.samples // 64))

    def _track_streams(
        self,
        wall: FloatArray,
        streams: Sequence[StreamKey] | StreamGroups,
        counter_ids: Sequence[int] | npt.NDArray[np.int64] | None,
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64], list[_StreamStats]]:
        """Per-stream warm-up and restart tracking, vectorised over the batch.

        Returns which rows are usable samples, each row's local stream slot and
        the stats object of every slot.
        """
        n = wall.shape[0]
        groups = StreamGroups.of(streams)
        slot = groups.index
        slot_stats: list[_StreamStats] = []
        for key in groups.keys:
            stats = self._streams.get(key)
            if stats is None:
                stats = self._new_stream(key)
            else:
                self._streams.move_to_end(key)
            slot_stats.append(stats)
        heartbeat = wall == 0.0
        is_pass = np.isfinite(wall) & (wall > 0.0)
        if counter_ids is None:
            counters = np.arange(n, dtype=np.int64)
            last = np.full(len(slot_stats), -1, dtype=np.int64)
        else:
            counters = np.asarray(counter_ids, dtype=np.int64)
            last = np.array(
                [-1 if s.last_counter is None else s.last_counter for s in slot_stats],
                dtype=np.int64,
            )
        prior = np.array([s.passes for s in slot_stats], dtype=np.int64)

        # Work in stream-major order; a segment starts at a stream's first row or a restart.
        order = np.argsort(slot, kind="stable")
        sl, cs, ps = slot[order], counters[order], is_pass[order]
        first = np.r_[True, sl[1:] != sl[:-1]]
        prev = np.where(first, last[sl], np.r_[-1, cs[:-1]])
        restart = (prev >= 0) & (cs < prev)
        seg_start = first | restart
        seg_idx = np.flatnonzero(seg_start)
        seg_of_row = np.cumsum(seg_start) - 1
        running = np.cumsum(ps)
        carried = np.where(restart[seg_idx], 0, prior[sl[seg_idx]])
        offset = running[seg_idx] - ps[seg_idx] - carried
        passes = running - offset[seg_of_row]
        usable_sorted = ps & (passes > self.warmup_passes)
        usable = np.empty(n, dtype=bool)
        usable[order] = usable_sorted

        last_row = np.r_[np.flatnonzero(first)[1:] - 1, n - 1] if n else np.zeros(0, np.int64)
        for row in last_row:
            stats = slot_stats[int(sl[row])]
            stats.passes = int(passes[row])
            if counter_ids is not None:
                stats.last_counter = int(cs[row])
        n_heartbeats = int(np.count_nonzero(heartbeat))
        self.heartbeats_ignored += n_heartbeats
        self.warmup_skipped += int(np.count_nonzero(is_pass)) - int(np.count_nonzero(usable))
        return usable, slot, slot_stats

    def _new_stream(self, key: StreamKey) -> _StreamStats:
        if len(self._streams) >= self.max_streams:
            self._streams.popitem(last=False)  # the least recently active stream
        stats = self._streams[key] = _StreamStats()
        return stats

    def _learn_rows(
        self,
        sched: FloatArray,
        y: FloatArray,
        slot: npt.NDArray[np.int64],
        slot_stats: list[_StreamStats],
    ) -> FloatArray:
        """Predict then learn a chunk of usable passes; returns the predictions."""
        x = feature_matrix(sched) / _SCALES
        ready = self.ready
        coef = self._coef
        regressors = x @ _P_ALL.T
        pred = roofline(regressors, coef) if coef is not None else np.full(y.shape[0], np.nan)
        have_pred = np.isfinite(pred) & (pred > 0)
        rel = np.where(have_pred, (y - pred) / np.where(have_pred, pred, 1.0), np.nan)

        buckets = bucket_ids(sched)
        safe_pred = np.where(have_pred, pred, 1.0)
        log_res = np.where(have_pred, np.log(np.maximum(y, 1e-12) / safe_pred), np.nan)
        used = sched[:, SCHED_PREFILL_TOKENS] + sched[:, SCHED_DECODE_REQS]
        bad_input = self._implausible_input(sched, y, used, slot, slot_stats)
        fast = self._implausibly_fast(log_res, ~bad_input)
        learn = ~bad_input & ~fast
        # Robust from the first residual scale on, not only once ready: early stalls
        # would otherwise stay in the rarely visited (prefill) buckets for good.
        weight = np.zeros(y.shape[0])
        if math.isfinite(self._residual_scale):
            weight[learn] = self._robust_weights(
                rel[learn], log_res[learn], buckets[learn], self._uncovered(sched[learn])
            )
        else:
            weight[learn] = 1.0
        accepted = weight > 0
        self.outliers_rejected += int(np.count_nonzero(learn & ~accepted))

        # Relative-error weighting by the *observed* time: weighting by the prediction
        # would up-weight exactly the passes the model under-predicts (stalls, regimes
        # not learned yet) and bias the fit high.
        w = weight / np.maximum(y, 1e-9) ** 2

        self._accumulate(x, y, w, accepted, buckets, self._learning_side(x, regressors))
        self._raise_budgets(used, accepted, slot, slot_stats)

        # Bookkeeping: regimes, residual scale, prequential window, per-stream residuals.
        regimes = regime_ids(sched[accepted])
        for r, count in zip(*np.unique(regimes, return_counts=True), strict=True):
            self.regime_samples[REGIMES[int(r)]] += int(count)
        n_acc = int(np.count_nonzero(accepted))
        self.samples += n_acc
        # Surprisingly fast passes stay in the robust window: if the engine really became
        # that fast, the centre moves and they are learned. Absurd input does not.
        informative = have_pred & ~bad_input
        if informative.any():
            self._push_residuals(log_res[informative])
        if ready:
            self._push_quality(y[have_pred & learn], pred[have_pred & learn])
        self._update_stream_residuals(rel, learn, accepted, slot, slot_stats)

        self._since_solve += n_acc
        if self._coef is None or self._since_solve >= self._resolve_period():
            self._solve()
        self.updated_at = self._clock()
        return np.where(have_pred, pred, np.nan)

    def _implausible_input(
        self,
        sched: FloatArray,
        y: FloatArray,
        used: FloatArray,
        slot: npt.NDArray[np.int64],
        slot_stats: list[_StreamStats],
    ) -> npt.NDArray[np.bool_]:
        """Rows beyond hard limits or far beyond their stream's token budget (counted)."""
        code = implausible_passes(sched, y)
        budgets = np.array([s.budget for s in slot_stats])[slot]
        beyond = (code == 0) & over_budget(used, budgets, self.budget_factor, self.budget_floor)
        tally_implausible(self.implausible_rejected, code, beyond)
        return (code > 0) | beyond

    def _implausibly_fast(
        self, log_res: FloatArray, eligible: npt.NDArray[np.bool_]
    ) -> npt.NDArray[np.bool_]:
        """``eligible`` rows more than ``fast_factor`` times faster than predicted (counted).

        Only with ``min_samples`` learned and a robust centre: before that a pass
        much faster than a rough early fit is information, not an attack.
        """
        if self.samples < self.min_samples or not math.isfinite(self._residual_scale):
            return np.zeros(log_res.shape[0], dtype=bool)
        excess = np.nan_to_num(log_res - self._residual_center, nan=0.0)
        fast = eligible & (excess < -self._log_fast)
        if fast.any():
            self.implausible_rejected["fast"] = self.implausible_rejected.get("fast", 0) + int(
                np.count_nonzero(fast)
            )
        return fast

    def _raise_budgets(
        self,
        used: FloatArray,
        accepted: npt.NDArray[np.bool_],
        slot: npt.NDArray[np.int64],
        slot_stats: list[_StreamStats],
    ) -> None:
        """Grow each stream's token budget to the largest pass it had accepted."""
        if not accepted.any():
            return
        largest = np.zeros(len(slot_stats))
        np.maximum.at(largest, slot[accepted], used[accepted])
        for j in np.flatnonzero(largest):
            stats = slot_stats[int(j)]
            stats.budget = max(stats.budget, float(largest[j]))

    def _accumulate(
        self,
        x: FloatArray,
        y: FloatArray,
        w: FloatArray,
        accepted: npt.NDArray[np.bool_],
        buckets: npt.NDArray[np.int64],
        memory_side: npt.NDArray[np.bool_],
    ) -> None:
        """Add accepted rows to their buckets' cells (by ``memory_side``), each O(d^2)."""
        if not accepted.any():
            return
        x, y, w, buckets = x[accepted], y[accepted], w[accepted], buckets[accepted]
        cells = 2 * buckets + memory_side[accepted]
        m = y.shape[0]
        step = self._clock_step()
        t_end = self._sample_clock + m * step
        # Sample j (0-based) arrives at clock t0+(j+1)*step; at t_end it has aged (m-1-j)*step.
        age_weight = self._decay ** (np.arange(m - 1, -1, -1, dtype=np.float64) * step)
        wa = w * age_weight
        present, n_new = np.unique(buckets, return_counts=True)
        self._decay_buckets(present, t_end)
        # Within a bucket, newer passes supersede older ones (half-life in the bucket's
        # own passes, no floor): the floor only protects a bucket from *time*, so a
        # rarely visited regime still replaces stale knowledge (engine warm-up, an
        # earlier machine state) as soon as it is visited again.
        self._scale_buckets(present, self._own_decay ** n_new.astype(np.float64))
        # Rows sorted by cell; each cell's X'WX is one small matrix product (a batch
        # touches tens of cells: 3-15x cheaper than summing per-row outer products).
        order = np.argsort(cells, kind="stable")
        c_sorted = cells[order]
        starts = np.flatnonzero(np.r_[True, c_sorted[1:] != c_sorted[:-1]])
        ends = np.r_[starts[1:], m]
        present_cells = c_sorted[starts]
        xs, ys, ws = x[order], y[order], wa[order]
        xw = xs * ws[:, None]
        d = N_FEATURES
        grams = [xw[a:b].T @ xs[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        self._gram.reshape(-1, d, d)[present_cells] += np.stack(grams)
        self._xty.reshape(-1, d)[present_cells] += np.add.reduceat(xw * ys[:, None], starts, axis=0)
        np.add.at(self._yty, present_cells // 2, np.add.reduceat(ws * ys * ys, starts))
        np.add.at(self._count, present_cells // 2, np.add.reduceat(age_weight[order], starts))
        self._sample_clock = t_end

    def _learning_side(self, x: FloatArray, regressors: FloatArray) -> npt.NDArray[np.bool_]:
        """Rows the roofline puts on its memory side now (``x``: scaled raw features,
        ``regressors``: ``x`` projected onto the regressors).

        It decides only which cell of its bucket a pass is learned into (the cell's
        side is re-decided at every solve), so a bucket that straddles the knee is
        split there. Before the roofline candidate has both sides: the memory side
        when the pass computes at most ``KNEE_TOKENS`` tokens.
        """
        coef = self._roof_coef
        if coef is not None and coef[_COMPUTE].any() and coef[_MEMORY].any():
            return ~compute_side(regressors, coef)
        return np.asarray(x @ _TOKENS_SCALED <= KNEE_TOKENS)

    def _clock_step(self) -> float:
        """How far one sample advances the forgetting clock: faster while the engine drifts.

        The long-window median of the log residuals is the model's bias on recent
        passes. Stall runs cannot move it far (it is a median over 2,000 passes); an
        engine that became slower or faster moves it for good. While it is off by
        more than ``drift_k`` residual scales (and 5%), the model forgets at the
        ``drift_half_life_passes`` rate and the coverage floors are suspended (what
        they hold is stale), so a changed engine is followed within a few thousand
        passes whatever ``half_life_passes`` is.
        """
        center, scale = self._residual_center, self._residual_scale
        self._drifting = (
            self._r_len >= self.robust_window // 2
            and math.isfinite(scale)
            and abs(center) > max(self.drift_k * scale, 0.05)
        )
        if self._drifting:
            return max(1.0, self.half_life_passes / self.drift_half_life_passes)
        return 1.0

    def _scale_buckets(self, buckets: npt.NDArray[np.int64], factor: FloatArray) -> None:
        """Multiply the statistics of ``buckets`` by ``factor`` (forgetting)."""
        self._gram[buckets] *= factor[:, None, None, None]
        self._xty[buckets] *= factor[:, None, None]
        self._yty[buckets] *= factor
        self._count[buckets] *= factor
        prior = buckets == _PRIOR_BUCKET
        if prior.any():
            self._prior_gram *= float(factor[prior][0])
            self._prior_xty *= float(factor[prior][0])

    def _decay_buckets(self, buckets: npt.NDArray[np.int64], t_now: float) -> None:
        """Bring buckets' statistics to clock ``t_now`` (lazy forgetting with a floor)."""
        age = t_now - self._bucket_clock[buckets]
        count = self._count[buckets]
        factor = self._decay**age
        # Never let time alone push a bucket below its floor of effective samples, unless
        # the engine is drifting: then what the floors hold is stale, not coverage.
        floor = self._floor[buckets] * (0.0 if self._drifting else 1.0)
        floor_factor = np.minimum(1.0, floor / np.maximum(count, 1e-300))
        factor = np.where(count > 0, np.maximum(factor, floor_factor), 1.0)
        self._scale_buckets(buckets, factor)
        self._bucket_clock[buckets] = t_now

    def _solve(self) -> None:
        """Fit ``base + max(compute, memory)`` with non-negativity; see the module docstring.

        Two candidates on the pooled statistics: the roofline (alternating NNLS and
        cell sides, from the previous solve's sides) and the linear ``base +
        compute`` fit; the one with the smaller weighted residual sum of squares is
        kept. O(cells*d^2) per alternation plus a 9x9 NNLS.
        """
        self._since_solve = 0
        self._decay_buckets(np.arange(N_BUCKETS + 1), self._sample_clock)
        n_eff = float(self._count.sum())
        if n_eff <= 0:
            return
        d = N_FEATURES
        pool = _Pool(
            self._gram[:N_BUCKETS].reshape(-1, d, d),
            self._xty[:N_BUCKETS].reshape(-1, d),
            float(self._yty.sum()),
        )
        pool.add_prior(self._prior_gram, self._prior_xty)
        has_data = pool.weight > 0

        # Roofline candidate: alternate until no cell with data changes side. A new
        # cell starts on the side its passes were learned on.
        side = self._side.copy()
        new = side == UNASSIGNED
        side[new] = _LEARNED_SIDE[new]
        memory = side == MEMORY_SIDE
        roof_gram, roof_xty = pool.pooled(memory)
        roof_coef = self._nnls(roof_gram, roof_xty, self._roof_coef)
        iterations = 1
        for _ in range(MAX_ASSIGN_ITERATIONS - 1):
            memory_now = pool.memory_side(roof_coef)
            if not (memory_now != memory)[has_data].any():
                break
            memory = memory_now
            roof_gram, roof_xty = pool.pooled(memory)
            roof_coef = self._nnls(roof_gram, roof_xty, roof_coef)
            iterations += 1
        # The predictor puts each pass on its larger side: score the cells that way.
        memory_final = pool.memory_side(roof_coef)
        if (memory_final != memory)[has_data].any():
            memory = memory_final
            roof_gram, roof_xty = pool.pooled(memory)
        roof_loss = pool.loss(roof_coef, roof_gram, roof_xty)
        self.assign_iterations = iterations
        self._roof_coef = roof_coef
        both_sides = bool(roof_coef[_COMPUTE].any() and roof_coef[_MEMORY].any())
        if both_sides:
            self._side = np.where(
                has_data, np.where(memory, MEMORY_SIDE, COMPUTE_SIDE), UNASSIGNED
            ).astype(np.int8)
        else:
            # Collapsed onto one side: start over from the learned sides next time, so
            # a knee that appears later (more data, a new regime) is still found.
            self._side[:] = UNASSIGNED

        # Linear candidate: every cell on the compute side.
        lin_gram, lin_xty = pool.pooled(np.zeros(2 * N_BUCKETS, dtype=bool))
        lin_coef = self._nnls(lin_gram, lin_xty, self._lin_coef)
        lin_loss = pool.loss(lin_coef, lin_gram, lin_xty)
        self._lin_coef = lin_coef

        if both_sides and roof_loss < lin_loss:
            coef, gram, xty, loss = roof_coef, roof_gram, roof_xty, roof_loss
        else:
            coef, gram, xty, loss = lin_coef, lin_gram, lin_xty, lin_loss
        self.roofline_active = bool(coef[_COMPUTE].any() and coef[_MEMORY].any())
        self._coef = coef
        self._pooled_gram, self._pooled_xty = gram, xty
        self._std_err = self._standard_errors(coef, gram, loss, n_eff)

    def _nnls(self, gram: FloatArray, xty: FloatArray, start: FloatArray | None) -> FloatArray:
        """NNLS with a tiny ridge (keeps unseen coefficients at zero and the system
        solvable), warm-started on the support of ``start``."""
        scale = max(float(np.trace(gram)) / N_COEFFICIENTS, 1e-12)
        ridged = gram + np.eye(N_COEFFICIENTS) * (self.ridge * scale)
        return nnls_normal(ridged, xty, support=None if start is None else start > 0)

    def _standard_errors(
        self, coef: FloatArray, gram: FloatArray, rss: float, n_eff: float
    ) -> FloatArray:
        """From the pooled system of the kept fit; NaN for a regressor that saw no data."""
        dof = max(n_eff - float(np.count_nonzero(coef)), 1.0)
        sigma2 = max(rss, 0.0) / dof
        seen = np.diag(gram) > 0
        se = np.full(N_COEFFICIENTS, np.nan)
        if not seen.any():
            return se
        sub = gram[np.ix_(seen, seen)]
        scale = max(float(np.trace(sub)) / N_COEFFICIENTS, 1e-12)
        try:
            cov = sigma2 * np.linalg.pinv(sub + np.eye(sub.shape[0]) * (self.ridge * scale))
            se[seen] = np.sqrt(np.maximum(np.diag(cov), 0.0))
        except np.linalg.LinAlgError:
            pass
        return se

    def _robust_weights(
        self,
        rel: FloatArray,
        log_res: FloatArray,
        buckets: npt.NDArray[np.int64],
        uncovered: npt.NDArray[np.bool_],
    ) -> FloatArray:
        """Huber weights about the residual centre; passes far on the slow side get 0.

        Stalls (the OS or a neighbour took the CPU) only ever make a pass slower, by
        up to 30x, and come in runs of hundreds of passes. So the gate is one-sided
        and its centre and scale are the median and MAD of a long window of *all*
        residuals: a stall run shorter than half the window cannot open it, while a
        persistently slower engine moves the median and is learned. A pass that is
        faster than predicted is never rejected (the fit is too high; let it learn).
        Buckets with little data, or that the gate keeps rejecting, get a wider gate,
        so a regime the model has not learned yet is not mistaken for a stall; passes
        of a regime with fewer than ``min_regime_samples`` learned (``uncovered``) are
        never gated: the model cannot know their cost yet (after a long decode-only
        stretch, a prefill pass can be 10x slower than predicted and still be right).
        """
        scale = self._residual_scale
        n = log_res.shape[0]
        if not math.isfinite(scale):
            return np.ones(n)
        r = np.nan_to_num(log_res, nan=0.0)
        excess = r - self._residual_center
        # Huber on the relative residual (what the weighted least squares sees, so a
        # pass's pull is bounded by the knee whatever its size), taken about the
        # centre: after an engine change every pass is off, and all must count fully.
        abs_rel = np.abs(np.expm1(excess))
        knee = self.huber_k * scale
        weight = np.minimum(1.0, knee / np.maximum(abs_rel, 1e-300))
        # A bucket is trusted once it holds data and the gate has not been rejecting
        # most of its passes for long: that is the model being wrong there, not stalls
        # (a stall run is a few hundred passes; the rejection rate has a longer memory).
        trusted = (self._count[buckets] >= self.bucket_trust) & (self._reject_rate[buckets] < 0.5)
        gate = self.reject_k * scale
        # Untrusted buckets get a wider gate (3x, in log units: e.g. 3x slower rather
        # than 1.35x): wide enough for an unlearned regime, not for a full stall.
        rejected = np.where(trusted, excess > gate, excess > 3.0 * gate) & ~uncovered
        weight[rejected] = 0.0
        self._track_reject_rate(buckets, rejected)
        return weight

    def _uncovered(self, sched: FloatArray) -> npt.NDArray[np.bool_]:
        """Rows of a regime (prefill- or decode-bearing) the model has not covered yet."""
        need = self.min_regime_samples
        prefill = (sched[:, SCHED_PREFILL_TOKENS] > 0) & (self.prefill_bearing_samples < need)
        decode = (sched[:, SCHED_DECODE_REQS] > 0) & (self.decode_bearing_samples < need)
        return np.asarray(prefill | decode)

    def _track_reject_rate(
        self, buckets: npt.NDArray[np.int64], rejected: npt.NDArray[np.bool_]
    ) -> None:
        """Per-bucket exponentially weighted rejection rate (chunk-level approximation).

        O(chunk), not O(buckets): only the buckets present are touched.
        """
        if buckets.shape[0] == 0:
            return
        hit, inverse, counts = np.unique(buckets, return_inverse=True, return_counts=True)
        n = counts.astype(np.float64)
        k = np.bincount(inverse, weights=rejected.astype(np.float64), minlength=hit.shape[0])
        keep = self._misfit_decay**n
        self._reject_rate[hit] = self._reject_rate[hit] * keep + (1.0 - keep) * k / n

    def _push_residuals(self, log_res: FloatArray) -> None:
        for chunk_start in range(0, log_res.shape[0], self.robust_window):
            part = log_res[chunk_start : chunk_start + self.robust_window]
            idx = (self._r_pos + np.arange(part.shape[0])) % self.robust_window
            self._r_ring[idx] = part
            self._r_pos = int((self._r_pos + part.shape[0]) % self.robust_window)
            self._r_len = min(self.robust_window, self._r_len + part.shape[0])
        self._r_since += log_res.shape[0]
        # The median is O(window): recompute it every robust_every residuals (sooner
        # while the window is short), so a sample costs O(window / robust_every).
        due = self._r_since >= min(self.robust_every, max(1, self._r_len // 4))
        if self._r_len >= self._r_min and (due or not math.isfinite(self._residual_scale)):
            self._update_robust_scale()

    def _update_robust_scale(self) -> None:
        """Median and MAD of the residual window: the gate's centre and scale."""
        self._r_since = 0
        ring = self._r_ring[: self._r_len]
        # Median and MAD about it over a long window: robust to stall runs, but a
        # persistently changed engine shifts the median and re-opens the gate.
        center = float(np.median(ring))
        mad = float(np.median(np.abs(ring - center)))
        self._residual_center = center
        # Floor at 1% so noise-free data does not turn every rounding error into an outlier.
        self._residual_scale = max(1.4826 * mad, 0.01)

    def _push_quality(self, y: FloatArray, pred: FloatArray) -> None:
        k = y.shape[0]
        if k == 0:
            return
        if k > self.quality_window:
            y, pred = y[-self.quality_window :], pred[-self.quality_window :]
            k = self.quality_window
        idx = (self._q_pos + np.arange(k)) % self.quality_window
        self._q_y[idx] = y
        self._q_p[idx] = pred
        self._q_pos = int((self._q_pos + k) % self.quality_window)
        self._q_len = min(self.quality_window, self._q_len + k)

    def _update_stream_residuals(
        self,
        rel: FloatArray,
        learn: npt.NDArray[np.bool_],
        accepted: npt.NDArray[np.bool_],
        slot: npt.NDArray[np.int64],
        slot_stats: list[_StreamStats],
    ) -> None:
        """Per-stream sample, outlier and residual tallies (implausible rows left out)."""
        n_slots = len(slot_stats)
        finite = np.isfinite(rel) & learn
        counts = np.bincount(slot[learn], minlength=n_slots)
        pred_counts = np.bincount(slot[finite], minlength=n_slots)
        sum_rel = np.bincount(slot[finite], weights=rel[finite], minlength=n_slots)
        sum_abs = np.bincount(slot[finite], weights=np.abs(rel[finite]), minlength=n_slots)
        outliers = np.bincount(slot[learn & ~accepted], minlength=n_slots)
        for s in np.flatnonzero(counts):
            stats = slot_stats[int(s)]
            stats.samples += int(counts[s] - outliers[s])
            stats.outliers += int(outliers[s])
            k = float(pred_counts[s])
            if k:
                # Batch-level approximation of a per-sample exponential average.
                keep = self._stream_decay**k
                stats.n_eff = stats.n_eff * keep + k
                stats.sum_rel = stats.sum_rel * keep + float(sum_rel[s])
                stats.sum_abs_rel = stats.sum_abs_rel * keep + float(sum_abs[s])
            stats.last_clock = self._sample_clock

    # -- prediction ------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once enough passes were learned, prefill and decode ones both, to trust it.

        Counting passes alone is not enough: 200 decode-only passes leave the prefill
        coefficients untrained, and the planner predicts TTFT from them.
        """
        return (
            self._coef is not None
            and self.samples >= self.min_samples
            and self.prefill_bearing_samples >= self.min_regime_samples
            and self.decode_bearing_samples >= self.min_regime_samples
        )

    @property
    def min_regime_samples(self) -> int:
        """Prefill-bearing (and, apart, decode-bearing) passes needed before ``ready``."""
        if self._min_regime_setting is not None:
            return self._min_regime_setting
        return max(1, self.min_samples // 10)

    @property
    def prefill_bearing_samples(self) -> int:
        """Learned passes that computed prompt tokens (prefill-only and mixed)."""
        return self.regime_samples["prefill_only"] + self.regime_samples["mixed"]

    @property
    def decode_bearing_samples(self) -> int:
        """Learned passes that decoded (decode-only and mixed)."""
        return self.regime_samples["decode_only"] + self.regime_samples["mixed"]

    def _current_coef(self) -> FloatArray | None:
        if self._since_solve > 0:
            self._solve()
        return self._coef

    def predict(self, sched: ScheduledRequestMetrics) -> float:
        """Predicted wall time (seconds) of a pass with this composition; NaN before any fit."""
        return float(self.predict_many(sched_matrix([sched]))[0])

    def predict_many(self, sched: FloatArray) -> FloatArray:
        """Predicted wall times for an (n, 7) composition matrix (hypothetical batches too)."""
        coef = self._current_coef()
        if coef is None:
            return np.full(sched.shape[0], np.nan)
        return roofline((feature_matrix(sched) / _SCALES) @ _P_ALL.T, coef)

    @property
    def coefficients(self) -> dict[str, float]:
        """Coefficients in SI units (seconds per regressor unit); NaN before any fit.

        Keys are :data:`COEFFICIENT_NAMES`: the base ``intercept``, ``prefill_requests``
        and ``decode_requests``, then ``compute.*`` and ``memory.*``.
        """
        coef = self._current_coef()
        if coef is None:
            return dict.fromkeys(COEFFICIENT_NAMES, math.nan)
        real = coef / _COEF_SCALES
        return {name: float(v) for name, v in zip(COEFFICIENT_NAMES, real, strict=True)}

    @property
    def std_errors(self) -> dict[str, float]:
        """Standard errors of the coefficients in SI units (weighted least squares, given
        the kept fit's bucket sides); NaN for a coefficient whose regressor saw no data."""
        self._current_coef()
        real = self._std_err / _COEF_SCALES
        return {name: float(v) for name, v in zip(COEFFICIENT_NAMES, real, strict=True)}

    # -- quality and reporting -------------------------------------------------

    @property
    def quality(self) -> ModelQuality:
        """Prequential error over the rolling window, R^2, counts and standard errors."""
        n = self._q_len
        y = self._q_y[:n]
        p = self._q_p[:n]
        if n:
            ape = np.abs(y - p) / np.maximum(y, 1e-12)
            mape = float(ape.mean())
            median_ape = float(np.median(ape))
            p90_ape = float(np.percentile(ape, 90))
            ss_tot = float(((y - y.mean()) ** 2).sum())
            ss_res = float(((y - p) ** 2).sum())
            r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan
        else:
            mape = median_ape = p90_ape = r2 = math.nan
        return ModelQuality(
            window=n,
            r2=r2,
            mape=mape,
            median_ape=median_ape,
            p90_ape=p90_ape,
            samples=self.samples,
            effective_samples=float(self._count.sum()),
            prefill_only_samples=self.regime_samples["prefill_only"],
            decode_only_samples=self.regime_samples["decode_only"],
            mixed_samples=self.regime_samples["mixed"],
            buckets_covered=int(np.count_nonzero(self._count[:N_BUCKETS] > 0)),
            outliers_rejected=self.outliers_rejected,
            warmup_skipped=self.warmup_skipped,
            heartbeats_ignored=self.heartbeats_ignored,
            residual_scale=self._residual_scale,
            std_errors=self.std_errors,
            implausible_rejected=dict(self.implausible_rejected),
        )

    def formula(self) -> str:
        """Human-readable fit in milliseconds, zero terms left out, e.g.
        ``step_ms = 1 + 0.01*decode_req + max(0.0325*tokens + ..., 5.64 + 4.6e-05*kv_read)``
        (``tokens = prefill_tok + decode_req``, ``kv_read = decode_kv + prefill_kv``);
        without a memory side it is linear: ``step_ms = 4.3 + 0.35*prefill_req + ...``."""
        coef = self.coefficients
        if not all(math.isfinite(v) for v in coef.values()):
            return "step_ms = (no fit yet)"

        def terms(piece: str, constant: bool = True) -> list[str]:
            out = []
            for c in COEFFICIENTS:
                ms = coef[c.name] * 1e3
                if c.piece != piece or ms <= 0 or (c.short == "1" and not constant):
                    continue
                out.append(f"{ms:.4g}" if c.short == "1" else f"{ms:.4g}*{c.short}")
            return out

        # The base intercept always shows (0 included), as the linear model's did.
        base = [f"{coef['intercept'] * 1e3:.4g}", *terms("base", constant=False)]
        compute, memory = terms("compute"), terms("memory")
        if compute and memory:
            sides = f"max({' + '.join(compute)}, {' + '.join(memory)})"
            return "step_ms = " + " + ".join([*base, sides])
        return "step_ms = " + " + ".join(base + compute + memory)

    def stream_residuals(self) -> dict[StreamKey, dict[str, float | int]]:
        """Per-stream residual summary: bias and MAPE (recent, exponentially weighted)."""
        out: dict[StreamKey, dict[str, float | int]] = {}
        for key, s in self._streams.items():
            n = s.n_eff
            out[key] = {
                "samples": s.samples,
                "outliers": s.outliers,
                "warming_up": int(s.passes <= self.warmup_passes),
                "mean_relative_residual": s.sum_rel / n if n else math.nan,
                "mape": s.sum_abs_rel / n if n else math.nan,
            }
        return out

    # -- persistence -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Small JSON-able snapshot: coefficients with units, quality, formula, fit state."""
        coef = self.coefficients  # solves first if samples arrived since the last solve
        se = self.std_errors
        return {
            "schema": SCHEMA,
            "coefficients": [
                {
                    "name": c.name,
                    "unit": c.coef_unit,
                    "feature_unit": c.unit,
                    "value": _finite_or_none(coef[c.name]),
                    "std_error": _finite_or_none(se[c.name]),
                }
                for c in COEFFICIENTS
            ],
            "formula": self.formula(),
            "ready": self.ready,
            "quality": self.quality.to_dict(),
            "samples": self.samples,
            "regime_samples": dict(self.regime_samples),
            "updated_at": self.updated_at,
            "config": {
                "half_life_passes": self.half_life_passes,
                "warmup_passes": self.warmup_passes,
                "min_samples": self.min_samples,
                "bucket_floor": self.bucket_floor,
                **(
                    {"min_regime_samples": self._min_regime_setting}
                    if self._min_regime_setting is not None
                    else {}
                ),
            },
            # The kept fit's pooled sufficient statistics in coefficient space (internal,
            # scaled basis; every bucket on the side it was fitted on): 9x9 + 9 + 2
            # numbers, and the outlier gate's centre and scale (so a restored model
            # keeps rejecting stalls from its first pass).
            "state": {
                "scales": [c.scale for c in COEFFICIENTS],
                "gram": self._pooled_gram.tolist(),
                "xty": self._pooled_xty.tolist(),
                "yty": float(self._yty.sum()),
                "n_eff": float(self._count.sum()),
                "residual_center": self._residual_center,
                "residual_scale": _finite_or_none(self._residual_scale),
                "residual_count": self._r_len,
            },
        }

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], warm_start_weight: float = 500.0, **overrides: Any
    ) -> CostModel:
        """Restore a model saved by :meth:`to_dict` (warm start).

        The saved statistics (in coefficient space, each bucket on the side it was
        fitted on) become one extra bucket worth at most
        ``warm_start_weight`` passes, which fades out with the half-life: the
        restored coefficients hold until new passes arrive, then new passes
        (perhaps from a changed engine) take over within a few thousand. The
        outlier gate's centre and scale and the counters are restored too; the
        gate's window refills before its own median replaces them.

        Raises ValueError, naming the field, for a snapshot that is not one or is
        malformed (wrong shapes, non-finite or negative numbers), and for a snapshot
        of the linear model (schema v1: its statistics cannot be mapped onto the
        roofline's pieces; the caller starts afresh).
        """
        snap = _Snapshot(d)
        snap.check_features()
        config = {**snap.config(), **overrides}
        model = cls(**config)
        state = snap.mapping("state")
        p = N_COEFFICIENTS
        scales = snap.vector(state, "state.scales", p)
        if (scales <= 0).any():
            raise ValueError("cost model snapshot: state.scales must be positive")
        # Re-express in the current scaling should it ever change.
        ratio = scales / _COEF_SCALES
        gram = snap.matrix(state, "state.gram", (p, p)) * np.outer(ratio, ratio)
        if (np.diag(gram) < 0).any():
            raise ValueError("cost model snapshot: state.gram has a negative diagonal")
        xty = snap.vector(state, "state.xty", p) * ratio
        yty = snap.number(state, "state.yty", minimum=0.0)
        n_eff = snap.number(state, "state.n_eff", minimum=0.0)
        shrink = min(1.0, warm_start_weight / n_eff) if n_eff > 0 else 0.0
        model._prior_gram = gram * shrink
        model._prior_xty = xty * shrink
        model._yty[_PRIOR_BUCKET] = yty * shrink
        model._count[_PRIOR_BUCKET] = n_eff * shrink
        model._restore_gate(snap, state)
        model._restore_counters(snap)
        if model._count[_PRIOR_BUCKET] > 0:
            model._solve()
        return model

    def _restore_gate(self, snap: _Snapshot, state: dict[str, Any]) -> None:
        """The outlier gate's centre and scale, held until the window refills."""
        if state.get("residual_scale") is None:
            return  # saved before any residual (or by an older version): learn afresh
        self._residual_center = snap.number(state, "state.residual_center")
        self._residual_scale = snap.number(state, "state.residual_scale", minimum=1e-12)
        count = int(snap.number(state, "state.residual_count", minimum=0.0, default=0.0))
        # Keep them until a quarter of the window (or what they came from) is new.
        self._r_min = max(20, min(self.robust_window // 4, count))

    def _restore_counters(self, snap: _Snapshot) -> None:
        self.samples = snap.count(snap.raw, "samples")
        regimes = snap.mapping("regime_samples", optional=True)
        for regime in self.regime_samples.keys() & regimes.keys():
            self.regime_samples[regime] = snap.count(regimes, f"regime_samples.{regime}")
        quality = snap.mapping("quality", optional=True)
        self.outliers_rejected = snap.count(quality, "quality.outliers_rejected")
        self.warmup_skipped = snap.count(quality, "quality.warmup_skipped")
        self.heartbeats_ignored = snap.count(quality, "quality.heartbeats_ignored")
        implausible = quality.get("implausible_rejected") or {}
        if not isinstance(implausible, dict):
            raise ValueError("cost model snapshot: quality.implausible_rejected must be a mapping")
        self.implausible_rejected = {
            str(k): snap.count(implausible, f"quality.implausible_rejected.{k}")
            for k in implausible
        }
        updated = snap.raw.get("updated_at")
        self.updated_at = snap.number(snap.raw, "updated_at") if updated is not None else None


_CONFIG_KEYS = frozenset(
    {"half_life_passes", "warmup_passes", "min_samples", "min_regime_samples", "bucket_floor"}
)


class _Snapshot:
    """Checked access to a :meth:`CostModel.to_dict` snapshot; errors name the field."""

    def __init__(self, raw: object) -> None:
        if not isinstance(raw, dict):
            raise ValueError("cost model snapshot must be a mapping")
        if raw.get("schema") == SCHEMA_V1:
            raise ValueError(
                f"cost model snapshot {SCHEMA_V1} is of the linear model, which this version "
                f"({SCHEMA}, roofline) cannot restore: start afresh"
            )
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"not a cost model snapshot: schema {raw.get('schema')!r}")
        self.raw: dict[str, Any] = raw

    def check_features(self) -> None:
        coefficients = self.raw.get("coefficients")
        if not isinstance(coefficients, list) or not all(isinstance(c, dict) for c in coefficients):
            raise ValueError("cost model snapshot: coefficients must be a list of mappings")
        names = [c.get("name") for c in coefficients]
        if names != list(COEFFICIENT_NAMES):
            raise ValueError(
                f"cost model snapshot: coefficients {names} do not match {list(COEFFICIENT_NAMES)}"
            )

    def config(self) -> dict[str, Any]:
        """The known constructor settings (unknown keys from newer versions are ignored)."""
        config = self.mapping("config", optional=True)
        out: dict[str, Any] = {}
        for key in _CONFIG_KEYS & config.keys():
            if config[key] is not None:
                out[key] = self.number(config, f"config.{key}", minimum=0.0)
        return out

    def mapping(self, key: str, optional: bool = False) -> dict[str, Any]:
        value = self.raw.get(key)
        if value is None and optional:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"cost model snapshot: {key} must be a mapping")
        return value

    @staticmethod
    def number(
        where: dict[str, Any], name: str, minimum: float | None = None, default: float | None = None
    ) -> float:
        """A finite number (at least ``minimum``); ``name``'s last part is the key."""
        value = where.get(name.rsplit(".", 1)[-1], default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"cost model snapshot: {name} must be a number, not {value!r}")
        f = float(value)
        if not math.isfinite(f) or (minimum is not None and f < minimum):
            raise ValueError(f"cost model snapshot: {name} = {value!r} is out of range")
        return f

    @staticmethod
    def count(where: dict[str, Any], name: str) -> int:
        """A non-negative whole number (absent or null: 0)."""
        value = where.get(name.rsplit(".", 1)[-1], 0)
        if value is None:
            return 0
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"cost model snapshot: {name} must be a count, not {value!r}")
        return int(value)

    @staticmethod
    def _array(where: dict[str, Any], name: str, shape: tuple[int, ...]) -> FloatArray:
        value = where.get(name.rsplit(".", 1)[-1])
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cost model snapshot: {name} is not numeric: {exc}") from None
        if arr.shape != shape:
            raise ValueError(f"cost model snapshot: {name} has shape {arr.shape}, not {shape}")
        if not np.isfinite(arr).all():
            raise ValueError(f"cost model snapshot: {name} holds non-finite numbers")
        return arr

    def vector(self, where: dict[str, Any], name: str, n: int) -> FloatArray:
        return self._array(where, name, (n,))

    def matrix(self, where: dict[str, Any], name: str, shape: tuple[int, int]) -> FloatArray:
        return self._array(where, name, shape)
