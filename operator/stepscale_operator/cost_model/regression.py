"""The regression: weighted normal equations per coverage bucket, forgetting, NNLS.

Fitting. Weighted least squares on rows the caller prepares (the cost model hands
in least squares on ``log(time)`` linearised at its prediction: target
``mu*(1 + log(y/mu))``, weight ``1/mu^2``; see
:meth:`~stepscale_operator.cost_model.model.CostModel._working_rows`), non-negative
coefficients by an active-set NNLS on the normal equations. (Weights ``1/y^2`` of
the observed time, used before, fitted 3-13% low on real recordings: a slow pass
weighed less for being slow. Weights ``1/pred^2`` on the raw time over-weighted
the passes the model under-predicts and fitted high; in log space a pass's pull
is bounded by its log residual.) Sufficient statistics of the raw features (Gram
matrix, ``X'y``, ``y'y``, counts) are kept per *coverage bucket* (regime x log-size
of prefill tokens, decode requests and decode context); every sample updates one bucket in O(d^2).
All buckets forget with the global sample clock (half-life ``half_life_passes``)
so the model follows a changed engine, but a bucket never decays below
``bucket_floor`` effective samples from time alone: a flood of decode-only
passes cannot wash out what the prefill buckets know. Within a bucket newer
passes also supersede older ones (``bucket_half_life``, in that bucket's own
passes). Buckets of a regime the fit is off in (``stale``, set by the caller from
:mod:`.regime_residuals`) forget at the drift half-life with their floors
suspended, as every bucket does while the whole model drifts.

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
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from stepscale_operator.cost_model.features import (
    COMPUTE,
    COMPUTE_SIDE,
    KNEE_TOKENS,
    LEARNED_SIDE,
    MAX_ASSIGN_ITERATIONS,
    MEMORY,
    MEMORY_SIDE,
    N_BUCKETS,
    N_COEFFICIENTS,
    N_FEATURES,
    P_ALL,
    P_COMPUTE,
    P_MEMORY,
    PRIOR_BUCKET,
    TOKENS_SCALED,
    UNASSIGNED,
    FloatArray,
    compute_side,
    roofline,
)


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


class CellPool:
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
        gram = P_COMPUTE @ gram_c @ P_COMPUTE.T + P_MEMORY @ gram_m @ P_MEMORY.T
        xty = P_COMPUTE @ (wc @ self._xtys) + P_MEMORY @ (wm @ self._xtys)
        return gram + self._prior_gram, xty + self._prior_xty

    def memory_side(self, coef: FloatArray) -> npt.NDArray[np.bool_]:
        """Buckets whose memory piece exceeds their compute piece at their mean composition
        (both pieces are linear, so that is the sign of a weighted sum)."""
        direction = (coef * COMPUTE) @ P_ALL - (coef * MEMORY) @ P_ALL
        return np.asarray(self._first_rows @ direction < 0)

    def loss(self, coef: FloatArray, gram: FloatArray, xty: FloatArray) -> float:
        """Weighted residual sum of squares of ``coef`` on the pooled system."""
        return max(self.yty - 2.0 * float(coef @ xty) + float(coef @ gram @ coef), 0.0)


class Regression:
    """Per-bucket sufficient statistics with forgetting, and the roofline NNLS solve.

    Works in the internal (scaled) bases of :mod:`.features`: rows are scaled raw
    features, coefficients are scaled. Knows nothing about streams, gates or
    quality: callers hand it accepted rows and their weights.
    """

    def __init__(
        self,
        half_life_passes: float,
        bucket_floor: float,
        bucket_half_life: float,
        drift_half_life_passes: float,
        ridge: float,
    ) -> None:
        self.half_life_passes = float(half_life_passes)
        self.drift_half_life_passes = float(drift_half_life_passes)
        self.bucket_half_life = float(bucket_half_life)
        self.ridge = float(ridge)
        self._decay = 2.0 ** (-1.0 / self.half_life_passes)
        self._own_decay = 2.0 ** (-1.0 / float(bucket_half_life))
        nb = N_BUCKETS + 1
        d = N_FEATURES
        # Raw-feature statistics per bucket, in two cells: the passes learned while the
        # roofline put them on its compute side, and on its memory side. Forgetting,
        # floors and counts are per bucket. The prior bucket's statistics are in
        # coefficient space (a snapshot's pooled ones), in prior_gram and prior_xty.
        self.gram = np.zeros((nb, 2, d, d))
        self.xty = np.zeros((nb, 2, d))
        self.yty = np.zeros(nb)
        self.count = np.zeros(nb)  # decayed sample counts (for degrees of freedom)
        p = N_COEFFICIENTS
        self.prior_gram = np.zeros((p, p))
        self.prior_xty = np.zeros(p)
        self._bucket_clock = np.zeros(nb)
        self._floor = np.full(nb, float(bucket_floor))
        self._floor[PRIOR_BUCKET] = 0.0  # a warm start fades out completely
        self.sample_clock = 0.0
        self.drifting = False  # set by the caller: forget fast, suspend the floors
        # Set by the caller too: buckets of a regime the fit is off in (the others are
        # not); they forget as fast, floors suspended, while the clock runs as usual.
        self.stale = np.zeros(nb, dtype=bool)

        self.coef: FloatArray | None = None  # scaled coefficient basis
        self.std_err: FloatArray = np.full(p, np.nan)  # scaled coefficient basis
        self.since_solve = 0
        # The roofline candidate's side of each cell (carried from solve to solve) and
        # its last coefficients; the kept fit's pooled coefficient-space statistics.
        self._side = np.full(2 * N_BUCKETS, UNASSIGNED, dtype=np.int8)
        self._roof_coef: FloatArray | None = None
        self._lin_coef: FloatArray | None = None  # the linear candidate's (warm start)
        self.roofline_active = False  # the kept fit has both a compute and a memory side
        self.assign_iterations = 0  # alternations the last solve took
        self.pooled_gram = np.zeros((p, p))
        self.pooled_xty = np.zeros(p)

    @property
    def effective_samples(self) -> float:
        """Decayed sample count over all buckets (the warm start's included)."""
        return float(self.count.sum())

    @property
    def buckets_covered(self) -> int:
        """Coverage buckets holding data."""
        return int(np.count_nonzero(self.count[:N_BUCKETS] > 0))

    def set_prior(self, gram: FloatArray, xty: FloatArray, yty: float, n_eff: float) -> None:
        """Coefficient-space statistics of a restored snapshot, as the prior bucket."""
        self.prior_gram = gram
        self.prior_xty = xty
        self.yty[PRIOR_BUCKET] = yty
        self.count[PRIOR_BUCKET] = n_eff

    def predict(self, x: FloatArray) -> FloatArray:
        """Roofline prediction of scaled feature rows; NaN before any fit."""
        if self.coef is None:
            return np.full(x.shape[0], np.nan)
        return roofline(x @ P_ALL.T, self.coef)

    def accumulate(
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
        # One sample advances the forgetting clock by one pass, faster while drifting.
        step = (
            max(1.0, self.half_life_passes / self.drift_half_life_passes) if self.drifting else 1.0
        )
        t_end = self.sample_clock + m * step
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
        self.gram.reshape(-1, d, d)[present_cells] += np.stack(grams)
        self.xty.reshape(-1, d)[present_cells] += np.add.reduceat(xw * ys[:, None], starts, axis=0)
        np.add.at(self.yty, present_cells // 2, np.add.reduceat(ws * ys * ys, starts))
        np.add.at(self.count, present_cells // 2, np.add.reduceat(age_weight[order], starts))
        self.sample_clock = t_end

    def learning_side(self, x: FloatArray, regressors: FloatArray) -> npt.NDArray[np.bool_]:
        """Rows the roofline puts on its memory side now (``x``: scaled raw features,
        ``regressors``: ``x`` projected onto the regressors).

        It decides only which cell of its bucket a pass is learned into (the cell's
        side is re-decided at every solve), so a bucket that straddles the knee is
        split there. Before the roofline candidate has both sides: the memory side
        when the pass computes at most ``KNEE_TOKENS`` tokens.
        """
        coef = self._roof_coef
        if coef is not None and coef[COMPUTE].any() and coef[MEMORY].any():
            return ~compute_side(regressors, coef)
        return np.asarray(x @ TOKENS_SCALED <= KNEE_TOKENS)

    def _scale_buckets(self, buckets: npt.NDArray[np.int64], factor: FloatArray) -> None:
        """Multiply the statistics of ``buckets`` by ``factor`` (forgetting)."""
        self.gram[buckets] *= factor[:, None, None, None]
        self.xty[buckets] *= factor[:, None, None]
        self.yty[buckets] *= factor
        self.count[buckets] *= factor
        prior = buckets == PRIOR_BUCKET
        if prior.any():
            self.prior_gram *= float(factor[prior][0])
            self.prior_xty *= float(factor[prior][0])

    def _decay_buckets(self, buckets: npt.NDArray[np.int64], t_now: float) -> None:
        """Bring buckets' statistics to clock ``t_now`` (lazy forgetting with a floor)."""
        age = t_now - self._bucket_clock[buckets]
        count = self.count[buckets]
        stale = self.stale[buckets] & (not self.drifting)  # drifting: the clock is fast already
        speed = max(1.0, self.half_life_passes / self.drift_half_life_passes)
        factor = self._decay ** (age * np.where(stale, speed, 1.0))
        # Never let time alone push a bucket below its floor of effective samples, unless
        # the engine is drifting (or its regime is stale): then what the floors hold is
        # stale, not coverage.
        floor = self._floor[buckets] * np.where(self.drifting | stale, 0.0, 1.0)
        floor_factor = np.minimum(1.0, floor / np.maximum(count, 1e-300))
        factor = np.where(count > 0, np.maximum(factor, floor_factor), 1.0)
        self._scale_buckets(buckets, factor)
        self._bucket_clock[buckets] = t_now

    def solve(self) -> None:
        """Fit ``base + max(compute, memory)`` with non-negativity; see the module docstring.

        Two candidates on the pooled statistics: the roofline (alternating NNLS and
        cell sides, from the previous solve's sides) and the linear ``base +
        compute`` fit; the roofline is kept when its smaller weighted residual sum
        of squares is worth its extra coefficients (Akaike's criterion).
        O(cells*d^2) per alternation plus a 9x9 NNLS.
        """
        self.since_solve = 0
        self._decay_buckets(np.arange(N_BUCKETS + 1), self.sample_clock)
        n_eff = float(self.count.sum())
        if n_eff <= 0:
            return
        d = N_FEATURES
        pool = CellPool(
            self.gram[:N_BUCKETS].reshape(-1, d, d),
            self.xty[:N_BUCKETS].reshape(-1, d),
            float(self.yty.sum()),
        )
        pool.add_prior(self.prior_gram, self.prior_xty)
        has_data = pool.weight > 0

        # Roofline candidate: alternate until no cell with data changes side. A new
        # cell starts on the side its passes were learned on.
        side = self._side.copy()
        new = side == UNASSIGNED
        side[new] = LEARNED_SIDE[new]
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
        both_sides = bool(roof_coef[COMPUTE].any() and roof_coef[MEMORY].any())
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

        # The roofline has the memory side's coefficients more than the linear fit: it
        # is kept only where it earns them (Akaike: n*log(RSS) + 2*parameters), not
        # for a sliver of noise it can fit with a memory side no pass needs.
        extra = float(np.count_nonzero(roof_coef[MEMORY]))
        earns = roof_loss > 0 and n_eff * math.log(max(lin_loss, 1e-300) / roof_loss) > 2 * extra
        if both_sides and (roof_loss <= 0 < lin_loss or earns):
            coef, gram, xty, loss = roof_coef, roof_gram, roof_xty, roof_loss
        else:
            coef, gram, xty, loss = lin_coef, lin_gram, lin_xty, lin_loss
        self.roofline_active = bool(coef[COMPUTE].any() and coef[MEMORY].any())
        self.coef = coef
        self.pooled_gram, self.pooled_xty = gram, xty
        self.std_err = self._standard_errors(coef, gram, loss, n_eff)

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
