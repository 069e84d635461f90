"""A cost-model snapshot seeded from user-given coefficients (pure).

``spec.autoscaling.costModel.initialCoefficients`` gives seconds per unit of each
feature. :func:`prior_snapshot` turns them into the sufficient statistics of a
small synthetic design (typical batch compositions, exactly on the given
formula), in the format :meth:`CostModel.from_dict` restores. The model then
predicts with those coefficients from the first moment, and real passes take
over as they arrive; it claims no samples, so it is not ``ready`` (and the
planner does not trust it) before ``minSamples`` real passes.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from stepscale_operator.cost_model import FEATURE_NAMES, FEATURES, SCHEMA, feature_matrix

# (prefill requests, prefill tokens, prefill kv, decode requests, mean decode context)
_DESIGN_AXES = (
    (0, 1, 2),
    (0, 128, 512, 2048),
    (0, 1024),
    (0, 1, 16, 128),
    (256, 4096),
)


def _design() -> np.ndarray:
    rows = []
    for n_p, c, k, n_d, ctx in itertools.product(*_DESIGN_AXES):
        if (n_p == 0) != (c == 0) or (n_p == 0 and k > 0):
            continue
        rows.append([n_p, c, 0.0, k, n_d, n_d * ctx, 0.0])
    return np.array(rows, dtype=np.float64)


def prior_snapshot(
    coefficients: dict[str, float],
    *,
    half_life_passes: float,
    warmup_passes: int,
    min_samples: int,
) -> dict[str, Any]:
    """A :meth:`CostModel.to_dict`-shaped snapshot whose fit is ``coefficients``.

    ``coefficients`` maps feature names (``intercept``, ``prefill_tokens``, ...) to
    seconds per unit; missing ones are 0.
    """
    coef = np.array([float(coefficients.get(name, 0.0)) for name in FEATURE_NAMES])
    sched = _design()
    x = feature_matrix(sched)
    y = x @ coef
    keep = y > 0
    x, y = x[keep], y[keep]
    scales = np.array([f.scale for f in FEATURES])
    xs = x / scales
    w = 1.0 / np.maximum(y, 1e-9) ** 2  # relative error, as the model weighs samples
    gram = (xs * w[:, None]).T @ xs
    xty = xs.T @ (w * y)
    return {
        "schema": SCHEMA,
        "coefficients": [
            {"name": f.name, "unit": f.coef_unit, "feature_unit": f.unit, "value": float(v)}
            for f, v in zip(FEATURES, coef, strict=True)
        ],
        "samples": 0,
        "config": {
            "half_life_passes": half_life_passes,
            "warmup_passes": warmup_passes,
            "min_samples": min_samples,
        },
        "state": {
            "scales": scales.tolist(),
            "gram": gram.tolist(),
            "xty": xty.tolist(),
            "yty": float((w * y * y).sum()),
            "n_eff": float(len(y)),
        },
    }
