"""natsim.planner.cost: how long a kernel call takes on a GPU, predicted before anything runs.
The features count what a call does (GNA forward and backward, the sparse kernel, FlashAttention-4's calls); a
per-GPU linear model, fitted by timing calibration cases (calibrate, fit) and stored as data (coefficients/),
prices them.
"""

from .backward_features import BACKWARD_FEATURES
from .fa4_features import FA4_FEATURES
from .features import FEATURES, feature_matrix, features_of, sweep_features
from .files import COEFFICIENTS_DIR, cost_model_for, known_gpus, user_coefficients_dir
from .fit import fit_coefficients
from .gpus import describe_gpus, gpu_of
from .model import CostModel
from .predict import predict_sparse_time
from .sparse_features import SPARSE_FEATURES, sparse_features

__all__ = [
    "CostModel",
    "cost_model_for",
    "gpu_of",
    "known_gpus",
    "describe_gpus",
    "user_coefficients_dir",
    "COEFFICIENTS_DIR",
    "FEATURES",
    "feature_matrix",
    "features_of",
    "sweep_features",
    "BACKWARD_FEATURES",
    "SPARSE_FEATURES",
    "FA4_FEATURES",
    "sparse_features",
    "predict_sparse_time",
    "fit_coefficients",
]
