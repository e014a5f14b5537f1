"""natsim's Gluon FP8 kernel's scores of a GNA search's rows: predicted seconds of each (window, stride, tiles) as
one of its calls, for the rows it runs, infinite elsewhere.

The kernel runs GNA on one tile of 128 tokens for queries and keys (static KV tiling; natsim.kernels.backends.gluon):
it visits the simulator's tiles, and masks inside those that are not full or hold padding keys. Features are
planner.cost.gluon_features', prices the cost model's Gluon FP8 coefficients. A model fitted before the kernel ran
partial tiles (its `masked_blocks` loads at 0: one of planner.cost.model's ADDED_FEATURES) would price a partial
tile like a whole one, so under it the scorer prices rows whose every visited block is whole only, as then.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from natsim import Problem, TileConfig
from natsim.kernels.backends.gluon import permutes_tokens

from ..backends import gluon_tiles_refusal
from ..cost.features import padded_tokens, unpermute_bytes
from ..cost.fa4_features import unpadded_full_blocks
from ..cost.gluon_features import gluon_feature_matrix
from ..cost.model import CostModel


class GluonScorer:
    """Scores a search's rows as Gluon FP8 calls of `batch_heads` heads (batch 1) under `cost_model`."""

    def __init__(self, shape: tuple[int, ...], causal: tuple[bool, ...], windows: Sequence[tuple[int, ...]],
                 catalog: Sequence[TileConfig], cost_model: CostModel, *, batch_heads: int, head_dim: int,
                 dtype: torch.dtype, element_bytes: int):
        self.problems = [Problem(shape, window, causal=causal) for window in windows]
        self.runs = np.array([_runs(tiles, head_dim, dtype) for tiles in catalog], bool)
        self.tiles = np.array([tiles.q_tile for tiles in catalog], np.int64)
        ones = (1,) * len(shape)
        self.padded = np.array([padded_tokens(shape, tiles.q_tile, ones) for tiles in catalog], np.int64)
        self.permutes = np.array([permutes_tokens(shape, tiles.q_tile) for tiles in catalog])
        self.tokens = math.prod(shape)
        self.cost_model = cost_model
        self.batch_heads, self.head_dim, self.element_bytes = batch_heads, head_dim, element_bytes

    def _members(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        """The rows the kernel runs (its tiles) that the model prices: with partial tiles where it was fitted on
        them (module docstring)."""
        members = np.nonzero(self.runs[rows["tile_index"]])[0]
        if self.cost_model.gluon_fp8_coefficients.get("masked_blocks", 0.0) > 0:
            return members
        return members[self._full(rows, members) == rows["visited_tiles"][members]]

    def _full(self, rows: dict[str, np.ndarray], members: np.ndarray) -> np.ndarray:
        """Per row of `members`, its visited blocks the kernel runs unmasked: full, without padding keys."""
        full = np.zeros(len(members), np.int64)
        windows = rows["window_index"][members]
        tiles = self.tiles[rows["tile_index"][members]]
        for w in np.unique(windows):
            part = np.nonzero(windows == w)[0]
            full[part] = unpadded_full_blocks(self.problems[int(w)], rows["stride"][members[part]], tiles[part],
                                              tiles[part])
        return full

    def features(self, rows: dict[str, np.ndarray], members: np.ndarray) -> np.ndarray:
        """GLUON_FEATURES rows of the search's rows `members` (rows the kernel runs)."""
        tiles = rows["tile_index"][members]
        padded = self.padded[tiles]
        moved = self.permutes[tiles] * unpermute_bytes(self.tokens, batch_heads=self.batch_heads,
                                                        head_dim=self.head_dim, element_bytes=self.element_bytes)
        visited = rows["visited_tiles"][members]
        return gluon_feature_matrix(visited_blocks=visited, q_padded=padded, batch_heads=self.batch_heads,
                                    head_dim=self.head_dim, element_bytes=self.element_bytes, permute_bytes=moved,
                                    masked_blocks=visited - self._full(rows, members), tokens=self.tokens)

    def scores(self, rows: dict[str, np.ndarray]) -> tuple[np.ndarray, None]:
        """(score, None) of every row: predicted seconds where the kernel runs the row, infinite elsewhere (it has
        no backward: FP8 plans are for inference)."""
        members = self._members(rows)
        total = np.full(len(rows["tile_index"]), np.inf)
        if len(members):
            total[members] = self.cost_model.predict_gluon(self.features(rows, members), "fp8")
        return total, None

    def breakdown(self, rows: dict[str, np.ndarray], row: int) -> dict[str, float]:
        """Predicted seconds of one row (one the kernel runs) per feature."""
        return self.cost_model.gluon_breakdown(self.features(rows, np.array([row]))[0], "fp8")


def _runs(tiles: TileConfig, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel runs GNA on these tiles: one 128-token tile for queries and keys, static KV tiling, at
    this head dim and dtype."""
    return (tiles.kv_tiling == "static" and tiles.q_tile == tiles.kv_tile
            and gluon_tiles_refusal(tiles.q_tokens, tiles.kv_tokens, head_dim, dtype) is None)
