"""FlashAttention-4's block-sparse lists, built from natsim's own tile counts or a boolean block mask.

FlashAttention-4 (like FlexAttention) reads, per query block, the key blocks it visits in two lists: those that
need the element mask (`mask_block_cnt`, `mask_block_idx`) and those that do not (`full_block_cnt`,
`full_block_idx`), and for the backward the same split per key block over query blocks. `Fa4Lists` holds both
directions as int32 tensors `[B|1, H|1, rows, width]` on the device, rows only as wide as the busiest row.

A GNA plan's lists come from the simulator (`natsim.block_mask`: visited and full tiles of tokens in tile order,
kernels/gna/layout.py), with one change: a KV tile holding padding keys (a layout not divisible by the tile)
goes to the masked list even where the simulator calls it full, since FlashAttention-4 would attend its padding
rows (zeros) in an unmasked block; the GNA mask (kernels/fa4/gna_mask.py) excludes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from natsim import Problem, TileConfig, block_mask
from natsim.dimension import ceil_div

# Lists as FlashAttention-4's BlockSparseTensorsTorch orders them: mask count, mask index, full count, full index.
Lists = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Fa4Lists:
    """Both directions of one block mask for FlashAttention-4: `forward` per query block (of `q_block` tokens)
    over key blocks (of `kv_block` tokens), `backward` per key block over query blocks; `masked` says whether
    any visited block needs the element mask. `visited` counts (query block, key block) pairs visited, per
    batch and head of the mask."""

    q_block: int
    kv_block: int
    forward: Lists
    backward: Lists
    masked: bool
    visited: int

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
    def from_tensors(cls, tensors: list[torch.Tensor], q_block: int, kv_block: int, masked: bool,
                     visited: int) -> "Fa4Lists":
        return cls(q_block, kv_block, tuple(tensors[:4]), tuple(tensors[4:]), masked, visited)


def _rows(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts `[..., rows]` and ascending indices `[..., rows, width]` of the True entries of each row of
    `blocks` (int32; entries past a row's count are any index and never read)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    # a stable sort of "not visited" puts each row's visited blocks first, in ascending order
    order = torch.sort((~blocks).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    # standard strides even where the width is 1 (FlashAttention-4 reads the last dimension as unit-stride)
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
    return Fa4Lists(q_block, kv_block, forward, backward, bool(partial.any()), int(visited.sum()))


def padded_kv_tiles(problem: Problem, kv_tile: tuple[int, ...]) -> np.ndarray:
    """Boolean per KV tile in tile order (dilation groups first): whether it holds padding keys."""
    per_dim = []
    for L, t, d in zip(problem.shape, kv_tile, problem.dilation):
        tiles = ceil_div(L, t * d)
        group_len = L // d + (np.arange(d)[:, None] < L % d)  # (groups, 1)
        per_dim.append((np.arange(tiles)[None, :] + 1) * t > group_len)  # (groups, tiles)
    n = problem.ndim
    padded = np.zeros([*problem.dilation, *(p.shape[1] for p in per_dim)], dtype=bool)
    for i, flags in enumerate(per_dim):
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = flags.shape
        padded = padded | flags.reshape(shape)
    return padded.reshape(-1)


@functools.lru_cache(maxsize=64)
def gna_lists(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...], device: torch.device) -> Fa4Lists:
    """FlashAttention-4's lists of a GNA problem with tokens in `q_tile` / `kv_tile` order (module docstring),
    on `device`; kept per geometry, since every layer of a model shares them."""
    mask = block_mask(problem, TileConfig(q_tile, kv_tile))
    visited, full = mask.to_dense(), mask.full_dense()
    full &= ~padded_kv_tiles(problem, kv_tile)[None, :]
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))[None, None].to(device)  # noqa: E731
    return lists_from_blocks(as_tensor(visited), as_tensor(full), int(np.prod(q_tile)), int(np.prod(kv_tile)))
