"""FlashAttention-4's block-sparse lists, built from natsim's own tile counts or a boolean block mask.

FlashAttention-4 (like FlexAttention) reads, per query block, the key blocks it visits in two lists: those that
need the element mask (`mask_block_cnt`, `mask_block_idx`) and those that do not (`full_block_cnt`,
`full_block_idx`), and for the backward the same split per key block over query blocks. `Fa4Lists` holds both
directions as int32 tensors `[B|1, H|1, rows, columns]` on the device: each row as wide as the other direction has
blocks, so that the tensors' shapes follow from the mask's shape alone and a compiled graph that takes prepared
lists as inputs is not recompiled for another mask of that shape.

A GNA plan's lists come from the simulator (`natsim.block_mask`: visited and full tiles), for q, k and v in one
token order, the Q tile's (kernels/gna/layout.py): its key blocks are the runs of KV-tile size in that order,
which are KV tiles when the KV tile is the Q tile or a slab of it along its outermost dimension longer than 1
(`nested_refusal`). One
change: a KV tile holding padding keys (a layout not divisible by the tile) goes to the masked list even where
the simulator calls it full, since FlashAttention-4 would attend its padding rows (zeros) in an unmasked block;
the GNA mask (kernels/fa4/gna_mask.py) excludes them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from natsim import Problem, TileConfig, block_mask

from ..gna.layout import TileLayout

# Lists as FlashAttention-4's BlockSparseTensorsTorch orders them: mask count, mask index, full count, full index.
Lists = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Fa4Lists:
    """Both directions of one block mask for FlashAttention-4: `forward` per query block (of `q_block` tokens)
    over key blocks (of `kv_block` tokens), `backward` per key block over query blocks; `masked` says whether
    any visited block needs the element mask."""

    q_block: int
    kv_block: int
    forward: Lists
    backward: Lists
    masked: bool

    @property
    def visited(self) -> int:
        """(query block, key block) pairs visited, over the mask's batch and heads (reads the device)."""
        return int(self.forward[0].sum()) + int(self.forward[2].sum())

    @property
    def num_q_blocks(self) -> int:
        return int(self.forward[0].shape[-1])

    @property
    def num_kv_blocks(self) -> int:
        return int(self.backward[0].shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        """The eight list tensors in a fixed order (how they cross an operator's schema)."""
        return [*self.forward, *self.backward]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], q_block: int, kv_block: int, masked: bool) -> "Fa4Lists":
        return cls(q_block, kv_block, tuple(tensors[:4]), tuple(tensors[4:]), masked)


def _rows(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts `[..., rows]` and ascending indices `[..., rows, columns]` of the True entries of each row of
    `blocks` (int32; entries past a row's count are any index and never read)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    # a stable sort of "not visited" puts each row's visited blocks first, in ascending order
    order = torch.sort((~blocks).to(torch.uint8), dim=-1, stable=True).indices
    # standard strides even where there is one column (FlashAttention-4 reads the last dimension as unit-stride)
    return counts, torch.empty(order.shape, dtype=torch.int32, device=order.device).copy_(order)


def lists_from_blocks(visited: torch.Tensor, full: torch.Tensor, q_block: int, kv_block: int) -> Fa4Lists:
    """`Fa4Lists` of boolean `[B|1, H|1, query blocks, key blocks]` masks of visited blocks and of full ones
    (`full` implies `visited`)."""
    if visited.shape != full.shape or visited.dim() != 4:
        raise ValueError(f"visited and full must be [B|1, H|1, query blocks, key blocks] of one shape, got "
                         f"{tuple(visited.shape)} and {tuple(full.shape)}.")
    partial = visited & ~full
    backward = (*_rows(partial.transpose(-1, -2)), *_rows(full.transpose(-1, -2)))
    forward = (*_rows(partial), *_rows(full))
    return Fa4Lists(q_block, kv_block, forward, backward, bool(partial.any()))


def nested_refusal(q_tile: tuple[int, ...], kv_tile: tuple[int, ...]) -> Optional[str]:
    """None when the KV tile's tokens form contiguous runs of the Q tile's row-major order, else why not:
    FlashAttention-4 reads q, k and v in one token order, the Q tile's, with key blocks of KV-tile size. Runs are
    contiguous when the KV tile is the Q tile, or a slab of it along one dimension (dividing the Q tile's side
    there) before which every side of the Q tile is 1 (4x8x8 in 2x8x8 slabs, 1x16x8 in 1x8x8 ones)."""
    differ = [i for i, (q, k) in enumerate(zip(q_tile, kv_tile)) if q != k]
    if (len(q_tile) != len(kv_tile) or len(differ) > 1
            or any(q_tile[i] % kv_tile[i] or any(side > 1 for side in q_tile[:i]) for i in differ)):
        return (f"FlashAttention-4 runs GNA on tokens in the Q tile's order, so the KV tile must be the Q tile or a "
                f"slab of it along its first dimension longer than 1, got q_tile={tuple(q_tile)}, "
                f"kv_tile={tuple(kv_tile)}.")
    return None


def _kv_blocks(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Every key block of the Q tile's order (runs of KV-tile size, in order): its KV tile's index in the
    simulator's numbering (-1 where that tile lies wholly in padding, outside the simulator's grid), and whether
    it holds padding keys."""
    n = problem.ndim
    q_grid = list(TileLayout(problem.shape, q_tile, problem.dilation).tiles_per_group)
    kv_grid = list(TileLayout(problem.shape, kv_tile, problem.dilation).tiles_per_group)
    ratio = [q // k for q, k in zip(q_tile, kv_tile)]
    slab = next((i for i in range(n) if ratio[i] > 1), 0)
    # block order: dilation groups, Q tiles, then the KV slabs inside a Q tile (kernels/gna/layout.py)
    index = np.indices([*problem.dilation, *q_grid, ratio[slab]]).reshape(2 * n + 1, -1)
    groups, tiles, part = index[:n], index[n:2 * n].copy(), index[2 * n]
    tiles[slab] = tiles[slab] * ratio[slab] + part  # KV tile coordinates
    lengths = [L // d + (g < L % d) for L, d, g in zip(problem.shape, problem.dilation, groups)]
    padded = np.zeros(index.shape[1], dtype=bool)
    inside = np.ones(index.shape[1], dtype=bool)
    for i in range(n):
        padded |= (tiles[i] + 1) * kv_tile[i] > lengths[i]
        inside &= tiles[i] < kv_grid[i]
    group = np.ravel_multi_index(tuple(groups), problem.dilation)
    linear = group * math.prod(kv_grid) + np.ravel_multi_index(tuple(np.minimum(tiles, np.array(kv_grid)[:, None] - 1)),
                                                              kv_grid)
    return np.where(inside, linear, -1), padded


def gna_blocks(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Boolean `[query blocks, key blocks]` arrays of the blocks visited and of those visited whole (no element
    masked, no padding key) of a GNA problem with q, k and v in `q_tile` order and key blocks of `kv_tile` size
    (`nested_refusal` must be None): the simulator's visited and full tiles, a key block holding padding keys
    never whole."""
    mask = block_mask(problem, TileConfig(q_tile, kv_tile))
    simulator_tile, padded = _kv_blocks(problem, q_tile, kv_tile)
    real = simulator_tile >= 0
    visited = np.zeros((mask.num_q_tiles, len(simulator_tile)), dtype=bool)
    full = np.zeros_like(visited)
    visited[:, real] = mask.to_dense()[:, simulator_tile[real]]
    full[:, real] = mask.full_dense()[:, simulator_tile[real]]
    full &= ~padded[None, :]
    return visited, full


@functools.lru_cache(maxsize=64)
def gna_lists(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...], device: torch.device) -> Fa4Lists:
    """FlashAttention-4's lists of a GNA problem with q, k and v in `q_tile` order and key blocks of `kv_tile`
    size (`nested_refusal` must be None), on `device`; kept per geometry, since every layer of a model shares
    them."""
    visited, full = gna_blocks(problem, q_tile, kv_tile)
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))[None, None].to(device)  # noqa: E731
    return lists_from_blocks(as_tensor(visited), as_tensor(full), math.prod(q_tile), math.prod(kv_tile))
