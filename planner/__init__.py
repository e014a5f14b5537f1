"""natsim.planner: choose how to run attention before anything runs, and run it. `best` plans GNA for a layout
and a target sparsity, `best_mask` a predicted block mask, `best(..., world_size=P)` several GPUs; rooms:
cost (the per-GPU cost model), search (the searches), plans (runnable results); catalog (what the kernels run).
"""

from .catalog import TILE_TOKENS, tile_catalog
from .cost import (
    FA4_FEATURES,
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
from .plans import TIE_TOLERANCE, Candidate, MaskCandidate, MaskPlan, Plan, Verdict, or_pool
from .search import AutoPlan, best, best_mask, fastest_first, predicted_times

__all__ = [
    "best",
    "AutoPlan",
    "predicted_times",
    "fastest_first",
    "Plan",
    "Verdict",
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
    "FA4_FEATURES",
    "sparse_features",
    "predict_sparse_time",
    "best_mask",
    "MaskPlan",
    "MaskCandidate",
    "or_pool",
]
