"""natsim.planner: choose a GNA configuration for a token layout and a target sparsity, and run it.

`best(shape, target_sparsity, ...)` returns a `Plan`: window, stride and tiles chosen with the simulator and
a per-GPU cost model of natsim's kernels (planner.cost), a report (`plan.explain()`), JSON round-trips,
and `plan(q, k, v)` running `natsim.kernels.gna_attention` with exactly those settings.
`predict_sparse_time(work, ...)` predicts a sparse-kernel call from its prepared work, for ranking block sizes
and merges of a mask.
`best_mask(mask, ...)` chooses the granularity (OR-pooling) and query merging that run a predicted mask fastest
and returns a runnable `MaskPlan`.

Rooms: planner.cost (features, cost model, calibration), planner.search (the searches: GNA, masks, several
GPUs; windows), planner.plans (what a search returns, its report and JSON); planner.catalog, shared by all
three, says which dtypes, head dims and tiles the kernels run.
"""

from .catalog import TILE_TOKENS, tile_catalog
from .cost import (
    FEATURES,
    SPARSE_FEATURES,
    CostModel,
    cost_model_for,
    feature_matrix,
    features_of,
    fit_coefficients,
    gpu_of,
    predict_sparse_time,
    sparse_features,
    sweep_features,
)
from .plans import TIE_TOLERANCE, Candidate, MaskCandidate, MaskPlan, Plan, or_pool
from .search import best, best_mask, fastest_first, predicted_times

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
