"""Prequential quality: every pass is predicted before it is learned, and scored.

The window keeps the last ``size`` (actual, predicted) pairs of passes the model
learned from (implausible ones left out) once it was ready; :class:`ModelQuality`
is what the status block and the planner read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from stepscale_operator.cost_model.features import FloatArray


def finite_or_none(value: float) -> float | None:
    """``value``, or None when it is NaN or infinite (JSON has no NaN)."""
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
    median_signed_error: float = math.nan  # median of (predicted - actual) / actual
    quarantined: dict[str, float] = field(default_factory=dict)  # stream -> its relative error
    # Factors every prediction is scaled by now: the machine's and each regime's
    # (:class:`~.recent_offsets.RecentOffsets`).
    recent_factors: dict[str, float] = field(default_factory=dict)
    # Kinds of pass (coverage buckets, in words) the fit is far off in, learned
    # without the stall gate meanwhile, each with its share of rejected passes.
    misfit: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (NaN becomes None)."""
        d = asdict(self)
        for key, value in list(d.items()):
            if isinstance(value, float):
                d[key] = finite_or_none(value)
        # A coefficient without a standard error (its regressor saw no data) is left out.
        d["std_errors"] = {k: v for k, v in self.std_errors.items() if math.isfinite(v)}
        d["implausible_rejected"] = dict(self.implausible_rejected)
        d["quarantined"] = {k: finite_or_none(v) for k, v in self.quarantined.items()}
        d["recent_factors"] = {k: finite_or_none(v) for k, v in self.recent_factors.items()}
        d["misfit"] = {k: finite_or_none(v) for k, v in self.misfit.items()}
        return d


@dataclass(frozen=True)
class WindowErrors:
    """Error figures of the prequential window (NaN when it is empty)."""

    n: int
    r2: float
    mape: float
    median_ape: float
    p90_ape: float
    median_signed_error: float


class PrequentialWindow:
    """Ring buffer of (actual, predicted) pairs and their error figures."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._y = np.zeros(self.size)
        self._p = np.zeros(self.size)
        self._len = 0
        self._pos = 0

    def push(self, y: FloatArray, pred: FloatArray) -> None:
        """Add pairs in arrival order (the oldest fall out)."""
        k = y.shape[0]
        if k == 0 or self.size == 0:
            return
        if k > self.size:
            y, pred = y[-self.size :], pred[-self.size :]
            k = self.size
        idx = (self._pos + np.arange(k)) % self.size
        self._y[idx] = y
        self._p[idx] = pred
        self._pos = int((self._pos + k) % self.size)
        self._len = min(self.size, self._len + k)

    def errors(self) -> WindowErrors:
        """MAPE, median and p90 APE, median signed error and R^2 over the window."""
        n = self._len
        if not n:
            return WindowErrors(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        y = self._y[:n]
        p = self._p[:n]
        signed = (p - y) / np.maximum(y, 1e-12)
        ape = np.abs(signed)
        ss_tot = float(((y - y.mean()) ** 2).sum())
        ss_res = float(((y - p) ** 2).sum())
        return WindowErrors(
            n=n,
            r2=1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan,
            mape=float(ape.mean()),
            median_ape=float(np.median(ape)),
            p90_ape=float(np.percentile(ape, 90)),
            median_signed_error=float(np.median(signed)),
        )
