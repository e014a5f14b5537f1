"""A call's predicted time: a cost model applied to the call's features, in the unit the planner ranks by.

The feature modules count what a call does and the cost model holds seconds per unit; this module puts them
together for one call (the GNA backward pass, the sparse kernel), and for the backward without a cost model
falls back to its tile work (planner.cost.backward_features.backward_tile_work), as the planner does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from natsim import Problem

from .backward_features import backward_features, backward_tile_work, backward_work
from .model import CostModel
from .sparse_features import sparse_features

if TYPE_CHECKING:
    from natsim.kernels import SparseWork


def backward_score(problem: Problem, cost_model: Optional[CostModel], *, batch_heads: int, head_dim: int,
                   element_bytes: int) -> float:
    """One backward call of `problem` in the planner's unit: predicted seconds under `cost_model`'s backward
    coefficients, or without a cost model `backward_tile_work` (one head, as the forward's tile work)."""
    work = backward_work(problem, head_dim)
    if cost_model is None:
        return backward_tile_work(work)
    features = backward_features(work, batch_heads=batch_heads, head_dim=head_dim, element_bytes=element_bytes)
    return float(cost_model.predict_backward(features))


def backward_scores(problems: Sequence[Problem], cost_model: Optional[CostModel], **call) -> np.ndarray:
    """`backward_score` of each of `problems`: the backward runs its own tiles, so a search asks once per
    (window, stride) whatever the forward's tiles; `call` is batch_heads, head_dim, element_bytes."""
    return np.array([backward_score(problem, cost_model, **call) for problem in problems], np.float64)


def backward_breakdown(problem: Problem, cost_model: CostModel, **call) -> dict[str, float]:
    """Predicted seconds of one backward call of `problem` per feature, named `backward_<feature>` (beside the
    forward's in `Plan.breakdown`); `call` is batch_heads, head_dim, element_bytes."""
    work = backward_work(problem, call["head_dim"])
    row = backward_features(work, **call)
    return {f"backward_{name}": seconds for name, seconds in cost_model.backward_breakdown(row).items()}


def predict_sparse_time(work: "SparseWork", batch: int, heads: int, head_dim: int, cost_model: CostModel) -> float:
    """Predicted seconds of one sparse-kernel call of `work` on `[batch, N, heads, head_dim]` tensors under
    `cost_model`'s sparse coefficients: how a mask planner ranks block sizes and merges before running any."""
    return float(cost_model.predict_sparse(sparse_features(work, batch, heads, head_dim)))
