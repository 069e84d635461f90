"""Online cost model: how long a forward pass takes, from the composition of its batch.

``step_time = base + max(compute, memory)``, fitted online from the FPM stream of a
deployment, pooled over its pods and ranks. One module per job:

* :mod:`.features`: the feature and coefficient tables, the roofline, buckets, regimes;
* :mod:`.regression`: weighted normal equations per coverage bucket with forgetting,
  the NNLS solve;
* :mod:`.admission`: warm-up, plausibility, stream quarantine, the stall gate;
* :mod:`.misfit`: the buckets whose rejections are the model being wrong, not stalls;
* :mod:`.regime_residuals`: recent residuals per regime; a regime the fit is off in
  forgets fast;
* :mod:`.quality`: prequential quality (every pass predicted before it is learned);
* :mod:`.snapshot`: snapshot and restore;
* :mod:`.model`: :class:`CostModel`, which composes them.
"""

from stepscale_operator.cost_model.features import (
    COEFFICIENT_NAMES,
    COEFFICIENTS,
    FEATURE_NAMES,
    FEATURES,
    KNEE_TOKENS,
    N_COEFFICIENTS,
    N_FEATURES,
    REGIMES,
    Coefficient,
    Feature,
    bucket_ids,
    compute_side,
    feature_matrix,
    regime_ids,
    regressor_matrix,
    roofline,
    sched_matrix,
)
from stepscale_operator.cost_model.model import CostModel
from stepscale_operator.cost_model.quality import ModelQuality
from stepscale_operator.cost_model.regression import nnls_normal
from stepscale_operator.cost_model.snapshot import SCHEMA, SCHEMA_V1

__all__ = [
    "COEFFICIENTS",
    "COEFFICIENT_NAMES",
    "FEATURES",
    "FEATURE_NAMES",
    "KNEE_TOKENS",
    "N_COEFFICIENTS",
    "N_FEATURES",
    "REGIMES",
    "SCHEMA",
    "SCHEMA_V1",
    "Coefficient",
    "CostModel",
    "Feature",
    "ModelQuality",
    "bucket_ids",
    "compute_side",
    "feature_matrix",
    "nnls_normal",
    "regime_ids",
    "regressor_matrix",
    "roofline",
    "sched_matrix",
]
