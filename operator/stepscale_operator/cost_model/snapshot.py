"""Snapshot and restore: the model as a small JSON document, and back (a warm start).

A snapshot (schema ``stepscale.cost_model/v2``) holds the coefficients with their
units, the formula, quality and counters, and the kept fit's pooled sufficient
statistics in coefficient space (9x9 + 9 + 2 numbers) with the outlier gate's
centre and scale. Restored, those statistics become one prior bucket worth at most
``warm_start_weight`` passes that fades out with the half-life. A v1 (linear)
snapshot is refused with a ValueError and the operator starts afresh.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from stepscale_operator.cost_model.features import (
    COEF_SCALES,
    COEFFICIENT_NAMES,
    COEFFICIENTS,
    N_COEFFICIENTS,
    FloatArray,
)
from stepscale_operator.cost_model.quality import finite_or_none
from stepscale_operator.cost_model.regime_residuals import CELLS

if TYPE_CHECKING:
    from stepscale_operator.cost_model.model import CostModel

SCHEMA = "stepscale.cost_model/v2"
SCHEMA_V1 = "stepscale.cost_model/v1"  # the linear model's snapshots: refused


def snapshot(model: CostModel) -> dict[str, Any]:
    """Small JSON-able snapshot: coefficients with units, quality, formula, fit state."""
    coef = model.coefficients  # solves first if samples arrived since the last solve
    se = model.std_errors
    reg, gate = model.regression, model.gate
    return {
        "schema": SCHEMA,
        "coefficients": [
            {
                "name": c.name,
                "unit": c.coef_unit,
                "feature_unit": c.unit,
                "value": finite_or_none(coef[c.name]),
                "std_error": finite_or_none(se[c.name]),
            }
            for c in COEFFICIENTS
        ],
        "formula": model.formula(),
        "ready": model.ready,
        "quality": model.quality.to_dict(),
        "samples": model.samples,
        "regime_samples": dict(model.regime_samples),
        "updated_at": model.updated_at,
        "config": model.config(),
        # The kept fit's pooled sufficient statistics in coefficient space (internal,
        # scaled basis; every bucket on the side it was fitted on): 9x9 + 9 + 2
        # numbers, and the outlier gate's centre and scale (so a restored model
        # keeps rejecting stalls from its first pass).
        "state": {
            "scales": [c.scale for c in COEFFICIENTS],
            "gram": reg.pooled_gram.tolist(),
            "xty": reg.pooled_xty.tolist(),
            "yty": float(reg.yty.sum()),
            "n_eff": reg.effective_samples,
            "residual_center": gate.center,
            "residual_scale": finite_or_none(gate.scale),
            "residual_count": gate.length,
            # log offsets the predictions are scaled by now: machine, then per regime cell
            "recent_offsets": model.recent_offsets().state(),
        },
    }


def restore(
    model_cls: type[CostModel], d: Any, warm_start_weight: float, **overrides: Any
) -> CostModel:
    """See :meth:`CostModel.from_dict`."""
    snap = SnapshotReader(d)
    snap.check_features()
    model = model_cls(**{**snap.config(), **overrides})
    state = snap.mapping("state")
    p = N_COEFFICIENTS
    scales = snap.vector(state, "state.scales", p)
    if (scales <= 0).any():
        raise ValueError("cost model snapshot: state.scales must be positive")
    # Re-express in the current scaling should it ever change.
    ratio = scales / COEF_SCALES
    gram = snap.matrix(state, "state.gram", (p, p)) * np.outer(ratio, ratio)
    if (np.diag(gram) < 0).any():
        raise ValueError("cost model snapshot: state.gram has a negative diagonal")
    xty = snap.vector(state, "state.xty", p) * ratio
    yty = snap.number(state, "state.yty", minimum=0.0)
    n_eff = snap.number(state, "state.n_eff", minimum=0.0)
    shrink = min(1.0, warm_start_weight / n_eff) if n_eff > 0 else 0.0
    model.regression.set_prior(gram * shrink, xty * shrink, yty * shrink, n_eff * shrink)
    if state.get("residual_scale") is not None:
        # Else saved before any residual (or by an older version): learn afresh.
        model.gate.restore(
            snap.number(state, "state.residual_center"),
            snap.number(state, "state.residual_scale", minimum=1e-12),
            int(snap.number(state, "state.residual_count", minimum=0.0, default=0.0)),
        )
    if state.get("recent_offsets") is not None:  # else saved by an older version: zeros
        offsets = snap.vector(state, "state.recent_offsets", 1 + len(CELLS))
        model.offsets.restore(float(offsets[0]), offsets[1:])
    _restore_counters(model, snap)
    if n_eff * shrink > 0:
        model.regression.solve()
    return model


def _restore_counters(model: CostModel, snap: SnapshotReader) -> None:
    model.samples = snap.count(snap.raw, "samples")
    regimes = snap.mapping("regime_samples", optional=True)
    for regime in model.regime_samples.keys() & regimes.keys():
        model.regime_samples[regime] = snap.count(regimes, f"regime_samples.{regime}")
    quality = snap.mapping("quality", optional=True)
    model.outliers_rejected = snap.count(quality, "quality.outliers_rejected")
    model.warmup_skipped = snap.count(quality, "quality.warmup_skipped")
    model.heartbeats_ignored = snap.count(quality, "quality.heartbeats_ignored")
    implausible = quality.get("implausible_rejected") or {}
    if not isinstance(implausible, dict):
        raise ValueError("cost model snapshot: quality.implausible_rejected must be a mapping")
    model.plausibility.rejected = {
        str(k): snap.count(implausible, f"quality.implausible_rejected.{k}") for k in implausible
    }
    updated = snap.raw.get("updated_at")
    model.updated_at = snap.number(snap.raw, "updated_at") if updated is not None else None


_CONFIG_KEYS = frozenset(
    {"half_life_passes", "warmup_passes", "min_samples", "min_regime_samples", "bucket_floor"}
)


class SnapshotReader:
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
