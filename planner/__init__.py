"""natsim.planner: choose a GNA configuration for a token layout and a target sparsity, and run it.

`best(shape, target_sparsity, ...)` returns a `Plan`: window, stride and tiles chosen with the simulator and
a per-GPU cost model of natsim's kernels (planner.costmodel), a report (`plan.explain()`), JSON round-trips,
and `plan(q, k, v)` running `natsim.kernels.gna_attention` with exactly those settings.
`predict_sparse_time(work, ...)` predicts a sparse-kernel call from its prepared work, for ranking block sizes
and merges of a mask.
`best_mask(mask, ...)` chooses the granularity (OR-pooling) and query merging that run a predicted mask fastest
and returns a runnable `MaskPlan` (planner.maskplan).
"""

from .catalog import TILE_TOKENS, tile_catalog
from .costmodel import CostModel, cost_model_for, gpu_of
from .features import FEATURES, feature_matrix, features_of, sweep_features
from .fit import fit_coefficients
from .maskplan import MaskCandidate, MaskPlan, best_mask, or_pool
from .plan import Candidate, Plan
from .search import TIE_TOLERANCE, best, fastest_first, predicted_times
from .sparse_features import SPARSE_FEATURES, predict_sparse_time, sparse_features

__all__ = [
    "best",
    "predicted_times",
    "fastest_first",
    "Plan",
    "Candidate",
    "CostModel",
    "cost_model_for",
    "gpu_of",
    "tile_catalog",
    "TILE_TOKENS",
    "FEATURES",
    "feature_matrix",
    "features_of",
    "sweep_features",
    "fit_coefficients",
    "TIE_TOLERANCE",
    "SPARSE_FEATURES",
    "sparse_features",
    "predict_sparse_time",
    "best_mask",
    "MaskPlan",
    "MaskCandidate",
    "or_pool",
]
