"""FlashAttention-4's scores of a GNA search's rows: predicted seconds of each (window, stride, tiles) as one of its
calls, for the rows whose tiles it runs (`planner.backends.fa4_gna_refusal`), infinite elsewhere.

The rows are the simulator's (planner.search.gna's sweep): FlashAttention-4 visits the same tiles, and runs
unmasked those that are full and hold no padding key (planner.cost.fa4_features.unpadded_full_blocks, counted per
window on the rows that need it). Features are planner.cost.fa4_features', prices the cost model's
FlashAttention-4 coefficients (forward, and with training the backward over the same blocks).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from natsim import Problem, TileConfig

from ..backends import fa4_gna_refusal
from ..cost.fa4_features import fa4_feature_matrix, unpadded_full_blocks
from ..cost.features import padded_tokens, permutation_bytes
from ..cost.model import CostModel


class Fa4Scorer:
    """Scores a search's rows as FlashAttention-4 calls of `batch_heads` heads (batch 1) under `cost_model`."""

    def __init__(self, shape: tuple[int, ...], causal: tuple[bool, ...], windows: Sequence[tuple[int, ...]],
                 catalog: Sequence[TileConfig], cost_model: CostModel, *, batch_heads: int, head_dim: int,
                 dtype: torch.dtype, element_bytes: int, training: bool):
        self.problems = [Problem(shape, window, causal=causal) for window in windows]
        self.runs = np.array([fa4_gna_refusal(t, head_dim, dtype, training) is None for t in catalog])
        self.q_tiles = np.array([t.q_tile for t in catalog], np.int64)
        self.kv_tiles = np.array([t.kv_tile for t in catalog], np.int64)
        ones = (1,) * len(shape)
        self.q_padded = np.array([padded_tokens(shape, t.q_tile, ones) for t in catalog], np.int64)
        self.tokens = math.prod(shape)
        self.cost_model = cost_model
        self.batch_heads, self.head_dim, self.element_bytes = batch_heads, head_dim, element_bytes
        self.training = training


    def features(self, rows: dict[str, np.ndarray], members: np.ndarray) -> np.ndarray:
        """FA4_FEATURES rows of the search's rows `members` (whose tiles FlashAttention-4 runs)."""
        tiles = rows["tile_index"][members]
        full = np.zeros(len(members), np.int64)
        windows = rows["window_index"][members]
        for w in np.unique(windows):
            part = np.nonzero(windows == w)[0]
            full[part] = unpadded_full_blocks(self.problems[int(w)], rows["stride"][members[part]],
                                              self.q_tiles[tiles[part]], self.kv_tiles[tiles[part]])
        q_padded = self.q_padded[tiles]
        moved = permutation_bytes(self.tokens, q_padded, q_padded, batch_heads=self.batch_heads,
                                  head_dim=self.head_dim, element_bytes=self.element_bytes)  # q, k, v in one order
        return fa4_feature_matrix(
            full_blocks=full, visited_blocks=rows["visited_tiles"][members],
            q_block=self.q_tiles[tiles].prod(axis=1), kv_block=self.kv_tiles[tiles].prod(axis=1),
            q_padded=q_padded, batch_heads=self.batch_heads, head_dim=self.head_dim, permute_bytes=moved,
        )

    def scores(self, rows: dict[str, np.ndarray]) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(score, backward part or None) of every row: predicted seconds, forward + backward with training;
        infinite where FlashAttention-4 does not run the row's tiles."""
        members = np.nonzero(self.runs[rows["tile_index"]])[0]
        total = np.full(len(rows["tile_index"]), np.inf)
        backward = np.full(len(total), np.inf) if self.training else None
        if len(members):
            features = self.features(rows, members)
            total[members] = self.cost_model.predict_fa4(features)
            if backward is not None:
                backward[members] = self.cost_model.predict_fa4(features, backward=True)
                total[members] += backward[members]
        return total, backward

    def breakdown(self, rows: dict[str, np.ndarray], row: int) -> dict[str, float]:
        """Predicted seconds of one row per feature (the backward's as `backward_<feature>` with training)."""
        features = self.features(rows, np.array([row]))[0]
        parts = self.cost_model.fa4_breakdown(features)
        if self.training:
            parts.update({f"backward_{name}": seconds
                          for name, seconds in self.cost_model.fa4_breakdown(features, backward=True).items()})
        return parts
