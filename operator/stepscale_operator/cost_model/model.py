"""CostModel: the online cost model, composed of its parts.

A pass goes through, top to bottom (:meth:`CostModel._learn_rows`):

1. features (:mod:`.features`) and the prediction made before learning it;
2. admission (:mod:`.admission`): warm-up (the stream table's pass counts),
   plausibility, quarantine of a stream that disagrees with the others, the
   one-sided stall gate and Huber weights, but no rejection in a bucket the model
   is wrong in (:mod:`.misfit`);
3. the row as least squares on ``log(time)``, linearised at the prediction
   (:meth:`CostModel._working_rows`): unbiased for the median step time;
4. the regression (:mod:`.regression`): sufficient statistics per coverage bucket,
   forgetting (faster for a regime the fit is off in: :mod:`.regime_residuals`),
   the roofline NNLS solve;
5. prequential quality (:mod:`.quality`), per-regime and per-stream residuals;
6. the recent offsets (:mod:`.recent_offsets`): every prediction, the prequential
   one and the planner's, is scaled by how far the fit has been off lately for
   the machine and for the pass's regime (the planner's only beyond the 3%
   tolerance, :meth:`CostModel.predict_many`).

Snapshots and restores are :mod:`.snapshot`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.cost_model.admission import (
    Plausibility,
    ResidualGate,
    StreamLedger,
    StreamRecord,
)
from stepscale_operator.cost_model.features import (
    COEF_SCALES,
    COEFFICIENT_NAMES,
    COEFFICIENTS,
    P_ALL,
    REGIMES,
    SCALES,
    FloatArray,
    bucket_ids,
    bucket_label,
    feature_matrix,
    regime_ids,
    roofline,
    sched_matrix,
)
from stepscale_operator.cost_model.misfit import MisfitBuckets
from stepscale_operator.cost_model.quality import ModelQuality, PrequentialWindow
from stepscale_operator.cost_model.recent_offsets import RecentOffsets
from stepscale_operator.cost_model.regime_residuals import RegimeResiduals, regime_cells
from stepscale_operator.cost_model.regression import Regression
from stepscale_operator.cost_model.snapshot import restore, snapshot
from stepscale_operator.load_types import BUDGET_FACTOR, BUDGET_FLOOR
from stepscale_operator.pass_columns import (
    SCHED_DECODE_REQS,
    SCHED_FIELDS,
    SCHED_PREFILL_TOKENS,
)
from stepscale_operator.stream_state import StreamGroups, StreamKey, StreamTable


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
        unlearned_factor: float = 3.0,
        bucket_half_life: float = 2000.0,
        drift_k: float = 0.0,
        drift_floor: float = 0.03,
        drift_half_life_passes: float = 500.0,
        resolve_every: int = 16,
        resolve_every_ready: int = 4096,
        robust_every: int = 64,
        budget_factor: float = BUDGET_FACTOR,
        budget_floor: float = BUDGET_FLOOR,
        fast_factor: float = 10.0,
        quarantine_factor: float = 1.5,
        release_factor: float = 1.2,
        max_chunk: int = 4096,  # a whole subscriber batch learned against one solve
        max_streams: int = 4096,
        stream_half_life_passes: float = 200.0,
        ridge: float = 1e-7,
        regime_window: int = 100,
        regime_min_residuals: int = 50,
        offset_machine_window: int = 32,
        offset_max_factor: float = 1.2,
        offset_regime_window: int = 100,
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
        # ~100 buckets in use, 1/200 held more samples in the floors than the half-life
        # itself, and a changed engine was never followed.
        self.bucket_floor = (
            self.half_life_passes / 2000.0 if bucket_floor is None else float(bucket_floor)
        )
        self.resolve_every = max(1, int(resolve_every))
        self.resolve_every_ready = max(self.resolve_every, int(resolve_every_ready))
        self.max_chunk = max(1, int(max_chunk))
        self._clock = clock

        self.regression = Regression(
            self.half_life_passes,
            self.bucket_floor,
            bucket_half_life,
            drift_half_life_passes,
            ridge,
        )
        self.gate = ResidualGate(
            robust_window,
            robust_every,
            huber_k,
            reject_k,
            bucket_trust,
            drift_k,
            drift_floor,
            unlearned_factor=unlearned_factor,
        )
        self.misfit = MisfitBuckets(misfit_half_life)
        self.plausibility = Plausibility(budget_factor, budget_floor, fast_factor)
        self.ledger = StreamLedger(
            max_streams, stream_half_life_passes, quarantine_factor, release_factor
        )
        # Warm-up and restarts of a stream are the stream table's; this one is used
        # only when the caller does not hand its own table's pass counts in.
        self.streams = StreamTable(max_streams=max_streams)
        self._auto_counter = 0
        self.window = PrequentialWindow(quality_window)
        self.regime_residuals = RegimeResiduals(regime_window, regime_min_residuals)
        self.offsets = RecentOffsets(
            offset_machine_window,
            offset_regime_window,
            offset_max_factor,
        )

        self.samples = 0
        self.regime_samples = dict.fromkeys(REGIMES, 0)
        self.outliers_rejected = 0
        self.warmup_skipped = 0
        self.heartbeats_ignored = 0
        self.restarts_after_poisoning = 0
        self.updated_at: float | None = None

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
        pass_index: npt.NDArray[np.int64] | None = None,
    ) -> FloatArray:
        """Learn passes in order; returns each prequential prediction (NaN where none).

        ``scheds`` is a sequence of structs or an (n, 7) matrix in
        ScheduledRequestMetrics field order (what the ingest pipeline already has).
        ``pass_index`` (per row: passes of its stream since it last started, from
        :attr:`ObserveResult.pass_index`) is given by a caller that keeps the stream
        table itself; otherwise the model's own table counts them from ``counter_ids``.
        """
        sched = scheds if isinstance(scheds, np.ndarray) else sched_matrix(scheds)
        wall = np.asarray(wall_times_s, dtype=np.float64)
        n = wall.shape[0]
        if sched.shape != (n, len(SCHED_FIELDS)) or len(streams) != n:
            raise ValueError("scheds, wall_times_s and streams must have the same length")
        if counter_ids is not None and len(counter_ids) != n:
            raise ValueError("counter_ids must match the batch length")
        if pass_index is not None and len(pass_index) != n:
            raise ValueError("pass_index must match the batch length")
        groups = StreamGroups.of(streams)
        usable = self._warm_passes(wall, groups, counter_ids, pass_index)
        records = self.ledger.records(groups.keys)
        preds = np.full(n, np.nan)
        rows = np.flatnonzero(usable)
        start = 0
        while start < rows.shape[0]:
            chunk = rows[start : start + self._chunk_size()]
            start += chunk.shape[0]
            preds[chunk] = self._learn_rows(sched[chunk], wall[chunk], groups.index[chunk], records)
        return preds

    def notify_restart(self, stream: StreamKey) -> None:
        """The caller saw ``stream`` restart: its next passes are warm-up again."""
        self.streams.forget(stream)

    def forget_stream(self, stream: StreamKey) -> None:
        """Drop per-stream state (the pod is gone); learned coefficients stay."""
        self.streams.forget(stream)
        self.ledger.forget(stream)

    def _warm_passes(
        self,
        wall: FloatArray,
        groups: StreamGroups,
        counter_ids: Sequence[int] | npt.NDArray[np.int64] | None,
        pass_index: npt.NDArray[np.int64] | None,
    ) -> npt.NDArray[np.bool_]:
        """Rows that are passes past their stream's warm-up (heartbeats and warm-up counted)."""
        n = wall.shape[0]
        is_pass = np.isfinite(wall) & (wall > 0.0)
        if pass_index is None:
            if counter_ids is None:
                # No sequence numbers: one running count stands in (never a restart).
                counters = self._auto_counter + np.arange(n, dtype=np.int64)
                self._auto_counter += n
            else:
                counters = np.asarray(counter_ids, dtype=np.int64)
            seen = self.streams.observe_columns(groups, counters, wall, 0.0)
            pass_index = seen.pass_index
            is_pass &= seen.mask  # a duplicate is learned once
        usable = is_pass & (np.asarray(pass_index) > self.warmup_passes)
        self.heartbeats_ignored += int(np.count_nonzero(wall == 0.0))
        self.warmup_skipped += int(np.count_nonzero(is_pass)) - int(np.count_nonzero(usable))
        return usable

    def _chunk_size(self) -> int:
        # Early on, re-solve often so predictions (and robust weights) exist soon.
        if self.regression.coef is None or self.samples < self.min_samples:
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

    def _learn_rows(
        self,
        sched: FloatArray,
        y: FloatArray,
        slot: npt.NDArray[np.int64],
        records: list[StreamRecord],
    ) -> FloatArray:
        """Predict then learn a chunk of warm passes; returns the predictions."""
        reg, gate = self.regression, self.gate
        x = feature_matrix(sched) / SCALES
        ready = self.ready
        regressors = x @ P_ALL.T
        pred = roofline(regressors, reg.coef) if reg.coef is not None else np.full(y.shape, np.nan)
        have_pred = np.isfinite(pred) & (pred > 0)
        safe_pred = np.where(have_pred, pred, 1.0)
        rel = np.where(have_pred, (y - pred) / safe_pred, np.nan)
        log_res = np.where(have_pred, np.log(np.maximum(y, 1e-12) / safe_pred), np.nan)
        buckets = bucket_ids(sched)
        used = sched[:, SCHED_PREFILL_TOKENS] + sched[:, SCHED_DECODE_REQS]

        # Admission: plausible, from a stream in good standing, not a stall.
        bad_input = self.plausibility.implausible_input(
            sched, y, used, self.ledger.budgets(records, slot)
        )
        quarantined = np.array([r.quarantined for r in records], dtype=bool)[slot]
        if reg.coef is not None:
            # Once there is a fit to compare with, a stream is learned from only after
            # it has been judged (before that, everyone bootstraps the model).
            quarantined |= self.ledger.on_probation(records)[slot]
        fast = np.zeros(y.shape[0], dtype=bool)
        if self.samples >= self.min_samples and gate.active:
            # Before min_samples, a pass much faster than a rough early fit is
            # information, not an attack.
            fast = self.plausibility.implausibly_fast(
                log_res - gate.center, ~bad_input & ~quarantined
            )
        learn = ~bad_input & ~fast & ~quarantined
        weight = np.zeros(y.shape[0])
        misfit = np.zeros(y.shape[0], dtype=bool)
        if gate.active:
            # Robust from the first residual scale on, not only once ready: early
            # stalls would otherwise stay in the rarely visited (prefill) buckets.
            gated = buckets[learn]
            misfit[learn] = self.misfit.misfit(gated)
            weight[learn], rejected = gate.weights(
                rel[learn],
                log_res[learn],
                gated,
                self._uncovered(sched[learn]),
                reg.count,
                misfit[learn],
            )
            self.misfit.observe(gated, rejected, slot[learn], records)
        else:
            weight[learn] = 1.0
        accepted = weight > 0
        self.outliers_rejected += int(np.count_nonzero(learn & ~accepted))

        # The regression.
        reg.drifting = gate.drifting()
        # A regime the fit is off in (rare prefill passes, say) forgets fast on its own.
        reg.stale = self.regime_residuals.stale_buckets(gate.drift_floor)
        # A misfit pass enters at its own time: linearised at a prediction several
        # times too low, its target would be a fraction of the way there.
        linearise = have_pred & ~self._uncovered(sched) & ~misfit
        target, w = self._working_rows(weight, y, pred, linearise)
        reg.accumulate(x, target, w, accepted, buckets, reg.learning_side(x, regressors))
        self.ledger.raise_budgets(used, accepted, slot, records)

        # Bookkeeping: regimes, residual centre, prequential window, per-stream residuals.
        regimes = regime_ids(sched[accepted])
        for r, count in zip(*np.unique(regimes, return_counts=True), strict=True):
            self.regime_samples[REGIMES[int(r)]] += int(count)
        n_acc = int(np.count_nonzero(accepted))
        self.samples += n_acc
        # Surprisingly fast passes stay in the residual window: if the engine really
        # became that fast, the centre moves and they are learned. Absurd input and
        # quarantined streams do not.
        informative = have_pred & ~bad_input & ~quarantined
        # The prediction served (and scored) is the fit's scaled by the recent
        # offsets, taken against this fit over the passes before the batch. The
        # regression's own staleness judges the fit alone: it learns what it can.
        cells = regime_cells(sched)
        if reg.coef is not None:
            self.offsets.refresh(self._fit(reg.coef), reg.coef)
        offsets = self.offsets.current(cells)
        pred = pred * np.exp(offsets)
        if informative.any():
            gate.push(log_res[informative])
            self.regime_residuals.push(cells[informative], log_res[informative])
            self.offsets.add(sched[informative], y[informative], cells[informative])
        if ready:
            self.window.push(y[have_pred & learn], pred[have_pred & learn])
        self.ledger.tally(rel, log_res, have_pred & ~bad_input, learn, accepted, slot, records)
        for record in self.ledger.judge():
            if record.samples >= self.POISONED_SHARE * max(self.samples, 1):
                self._start_afresh(record)
                break

        reg.since_solve += n_acc
        if reg.coef is None or reg.since_solve >= self._resolve_period():
            reg.solve()
        self.updated_at = self._clock()
        return np.where(have_pred, pred, np.nan)

    # A stream that is quarantined after it contributed this share of what the model
    # learned has poisoned it (typically: a bad pod present from the start, sending
    # most of the passes): the model starts afresh from the streams in good standing.
    POISONED_SHARE = 0.2

    def _start_afresh(self, culprit: StreamRecord) -> None:
        """Drop the regression and the residual window; ``culprit`` stays quarantined,
        every other stream is in good standing (counters and streams stay)."""
        old = self.regression
        self.regression = Regression(
            old.half_life_passes,
            self.bucket_floor,
            old.bucket_half_life,
            old.drift_half_life_passes,
            old.ridge,
        )
        self.gate = self.gate.emptied()
        self.misfit = self.misfit.emptied()
        self.regime_residuals = self.regime_residuals.emptied()
        self.offsets = self.offsets.emptied()
        self.samples = 0
        self.regime_samples = dict.fromkeys(REGIMES, 0)
        for _, record in self.ledger.items():
            # Residuals about the dropped fit say nothing about the new one: the culprit
            # stays out until residuals about the new fit show it agrees.
            record.samples = 0
            record.n_eff = record.sum_rel = record.sum_abs_rel = record.sum_log = 0.0
            record.quarantined = record is culprit
        self.restarts_after_poisoning += 1

    def _working_rows(
        self,
        robust: FloatArray,
        y: FloatArray,
        pred: FloatArray,
        linearise: npt.NDArray[np.bool_],
    ) -> tuple[FloatArray, FloatArray]:
        """Target and least-squares weight of each row: least squares on ``log(y)``.

        Step-time noise is multiplicative and skewed (a pass is slowed far more often
        than sped up), so the fit's target is the *median* time, which least squares
        on ``log(y)`` estimates. The model is linear in ``y``, so each row enters
        linearised at the prediction ``mu`` made before it was learned (one
        Gauss-Newton step per pass, iterated as predictions improve): target
        ``mu * (1 + log(y / mu))``, weight ``1 / mu^2``. The weight comes from the
        model, not from the pass's own time: weighting by ``1 / y^2`` gave slow
        passes less say and fitted 3-13% low. Where there is no prediction yet, the
        regime has too few samples to trust one, or the pass is in a bucket the
        model is wrong in (:mod:`.misfit`), ``mu = y`` (plain relative least
        squares).
        """
        mu = np.where(linearise, pred, y)
        target = mu * (1.0 + np.log(np.maximum(y, 1e-12) / np.maximum(mu, 1e-12)))
        return target, robust / np.maximum(mu, 1e-9) ** 2

    def _uncovered(self, sched: FloatArray) -> npt.NDArray[np.bool_]:
        """Rows of a regime (prefill- or decode-bearing) the model has not covered yet."""
        need = self.min_regime_samples
        prefill = (sched[:, SCHED_PREFILL_TOKENS] > 0) & (self.prefill_bearing_samples < need)
        decode = (sched[:, SCHED_DECODE_REQS] > 0) & (self.decode_bearing_samples < need)
        return np.asarray(prefill | decode)

    # -- prediction ------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once enough passes were learned, prefill and decode ones both, to trust it.

        Counting passes alone is not enough: 200 decode-only passes leave the prefill
        coefficients untrained, and the planner predicts TTFT from them.
        """
        return (
            self.regression.coef is not None
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

    @property
    def roofline_active(self) -> bool:
        """The kept fit has both a compute and a memory side."""
        return self.regression.roofline_active

    @property
    def assign_iterations(self) -> int:
        """Alternations the last solve took."""
        return self.regression.assign_iterations

    @property
    def implausible_rejected(self) -> dict[str, int]:
        """Implausible passes by reason."""
        return self.plausibility.rejected

    def _current_coef(self) -> FloatArray | None:
        if self.regression.since_solve > 0:
            self.regression.solve()
        return self.regression.coef

    @staticmethod
    def _fit(coef: FloatArray) -> Callable[[FloatArray], FloatArray]:
        """The fit with these coefficients, as a function of an (n, 7) composition matrix."""
        return lambda sched: roofline((feature_matrix(sched) / SCALES) @ P_ALL.T, coef)

    def predict(self, sched: ScheduledRequestMetrics) -> float:
        """Predicted wall time (seconds) of a pass with this composition; NaN before any fit."""
        return float(self.predict_many(sched_matrix([sched]))[0])

    def predict_many(self, sched: FloatArray, recent_offsets: bool = True) -> FloatArray:
        """Predicted wall times for an (n, 7) composition matrix (hypothetical batches too):
        the fit, scaled by the current recent offsets of each row's regime (the fit
        alone, what :attr:`coefficients` say, with ``recent_offsets=False``).

        This is what the planner asks, so an offset within the model's tolerance
        (the gate's ``drift_floor``, 3%) is left out, as a replica calculator leaves
        a ratio within its tolerance: smaller ones are mostly the noise of a median
        of a few dozen passes, and decisions should not move with it (on the
        simulated fleets they stay within 1%, and applying them moved the shared
        trace's attainment from 99.54% to 99.35% by decision timing alone).
        """
        coef = self._current_coef()
        if coef is None:
            return np.full(sched.shape[0], np.nan)
        fit = self._fit(coef)(sched)
        if not recent_offsets:
            return fit
        offsets = self.recent_offsets().current(regime_cells(sched), self.gate.drift_floor)
        return np.asarray(fit * np.exp(offsets))

    def recent_offsets(self) -> RecentOffsets:
        """The recent offsets, taken against the current fit."""
        coef = self._current_coef()
        if coef is not None:
            self.offsets.refresh(self._fit(coef), coef)
        return self.offsets

    @property
    def coefficients(self) -> dict[str, float]:
        """Coefficients in SI units (seconds per regressor unit); NaN before any fit.

        Keys are :data:`COEFFICIENT_NAMES`: the base ``intercept``, ``prefill_requests``
        and ``decode_requests``, then ``compute.*`` and ``memory.*``.
        """
        coef = self._current_coef()
        if coef is None:
            return dict.fromkeys(COEFFICIENT_NAMES, math.nan)
        real = coef / COEF_SCALES
        return {name: float(v) for name, v in zip(COEFFICIENT_NAMES, real, strict=True)}

    @property
    def std_errors(self) -> dict[str, float]:
        """Standard errors of the coefficients in SI units (weighted least squares, given
        the kept fit's bucket sides); NaN for a coefficient whose regressor saw no data."""
        self._current_coef()
        real = self.regression.std_err / COEF_SCALES
        return {name: float(v) for name, v in zip(COEFFICIENT_NAMES, real, strict=True)}

    # -- quality and reporting -------------------------------------------------

    @property
    def quality(self) -> ModelQuality:
        """Prequential error over the rolling window, R^2, counts and standard errors."""
        e = self.window.errors()
        return ModelQuality(
            window=e.n,
            r2=e.r2,
            mape=e.mape,
            median_ape=e.median_ape,
            p90_ape=e.p90_ape,
            samples=self.samples,
            effective_samples=self.regression.effective_samples,
            prefill_only_samples=self.regime_samples["prefill_only"],
            decode_only_samples=self.regime_samples["decode_only"],
            mixed_samples=self.regime_samples["mixed"],
            buckets_covered=self.regression.buckets_covered,
            outliers_rejected=self.outliers_rejected,
            warmup_skipped=self.warmup_skipped,
            heartbeats_ignored=self.heartbeats_ignored,
            residual_scale=self.gate.scale,
            std_errors=self.std_errors,
            implausible_rejected=dict(self.plausibility.rejected),
            median_signed_error=e.median_signed_error,
            quarantined=self.ledger.quarantined(),
            recent_factors=self.recent_offsets().factors(),
            misfit={bucket_label(b): v for b, v in self.misfit.shares().items()},
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
        """Per-stream residual summary: bias and MAPE (recent, exponentially weighted),
        and whether the stream is quarantined from learning. (Warm-up is the stream
        table's: ``passes_since_restart``.)"""
        out: dict[StreamKey, dict[str, float | int]] = {}
        for key, r in self.ledger.items():
            n = r.n_eff
            out[key] = {
                "samples": r.samples,
                "outliers": r.outliers,
                "quarantined": int(r.quarantined),
                "mean_relative_residual": r.sum_rel / n if n else math.nan,
                "mape": r.sum_abs_rel / n if n else math.nan,
            }
        return out

    # -- persistence -----------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The constructor settings a snapshot keeps."""
        return {
            "half_life_passes": self.half_life_passes,
            "warmup_passes": self.warmup_passes,
            "min_samples": self.min_samples,
            "bucket_floor": self.bucket_floor,
            **(
                {"min_regime_samples": self._min_regime_setting}
                if self._min_regime_setting is not None
                else {}
            ),
        }

    def to_dict(self) -> dict[str, Any]:
        """Small JSON-able snapshot (see :mod:`.snapshot`)."""
        return snapshot(self)

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], warm_start_weight: float = 500.0, **overrides: Any
    ) -> CostModel:
        """Restore a model saved by :meth:`to_dict` (warm start).

        The saved statistics (in coefficient space, each bucket on the side it was
        fitted on) become one extra bucket worth at most ``warm_start_weight``
        passes, which fades out with the half-life: the restored coefficients hold
        until new passes arrive, then new passes (perhaps from a changed engine) take
        over within a few thousand. The outlier gate's centre and scale and the
        counters are restored too; the gate's window refills before its own median
        replaces them.

        Raises ValueError, naming the field, for a snapshot that is not one or is
        malformed (wrong shapes, non-finite or negative numbers), and for a snapshot
        of the linear model (schema v1: its statistics cannot be mapped onto the
        roofline's pieces; the caller starts afresh).
        """
        return restore(cls, d, warm_start_weight, **overrides)
