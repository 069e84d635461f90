"""A cost-model snapshot seeded from user-given coefficients (pure).

``spec.autoscaling.costModel.initialCoefficients`` gives seconds per unit of each
coefficient of the roofline (``intercept``, ``decode_requests``, ``compute.tokens``,
``memory.intercept``, ...; see :mod:`stepscale_operator.cost_model`).
:func:`prior_snapshot` turns them into the coefficient-space sufficient statistics
of a small synthetic design (typical batch compositions, exactly on the given
formula, each on the side of the ``max`` that the formula puts it), in the format
:meth:`CostModel.from_dict` restores. The model then predicts with those
coefficients from the first moment, and real passes take over as they arrive; it
claims no samples, so it is not ``ready`` (and the planner does not trust it)
before ``minSamples`` real passes.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from stepscale_operator.cost_model import (
    COEFFICIENT_NAMES,
    COEFFICIENTS,
    SCHEMA,
    compute_side,
    regressor_matrix,
    roofline,
)

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

    ``coefficients`` maps coefficient names (``intercept``, ``compute.tokens``, ...)
    to seconds per unit; missing ones are 0.
    """
    coef = np.array([float(coefficients.get(name, 0.0)) for name in COEFFICIENT_NAMES])
    z = regressor_matrix(_design())
    y = roofline(z, coef)
    keep = y > 0
    z, y = z[keep], y[keep]
    # Each pass carries the regressors of the side of the max it is on (ties: compute).
    memory_rows = ~compute_side(z, coef)
    pieces = np.array([c.piece for c in COEFFICIENTS])
    z[np.ix_(memory_rows, pieces == "compute")] = 0.0
    z[np.ix_(~memory_rows, pieces == "memory")] = 0.0
    scales = np.array([c.scale for c in COEFFICIENTS])
    zs = z / scales
    w = 1.0 / np.maximum(y, 1e-9) ** 2  # relative error, as the model weighs samples
    gram = (zs * w[:, None]).T @ zs
    xty = zs.T @ (w * y)
    return {
        "schema": SCHEMA,
        "coefficients": [
            {"name": c.name, "unit": c.coef_unit, "feature_unit": c.unit, "value": float(v)}
            for c, v in zip(COEFFICIENTS, coef, strict=True)
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
