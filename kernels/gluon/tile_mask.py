"""The Gluon FP8 kernel's inputs for GNA: its block lists (partial tiles marked) and the element mask inside the
partial tiles, in the form the kernel tests it (`TileMask`, kernels/gluon/forward.py).

The kernel sees q, k and v in the Q tile's token order (kernels/gna/layout.py), one 128-token tile per query block
and per key block. A key of a tile lies at the tile's first key's coordinate plus its in-tile coordinate, which
follows from its column alone (row-major inside the tile); a query attends it when, along every dimension, that
coordinate is inside the query's window. So the kernel reads, once per query row, the window `[lo, hi)` along each
dimension, and per key tile its first key's coordinate along each dimension; a score is kept when
`lo <= base + inner < hi` along every dimension. Dilation folds into the same test: coordinates are offset by
`group * SPAN`, so keys of another dilation group fall outside every window; padding keys (past their group's
length) lie past every window's end. The windows are kernels/fa4/gna_mask.py's (natsim/window.py's bounds).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from natsim import Problem

from ..fa4.gna_mask import Arithmetic, GnaMask, decode
from ..fa4.lists import gna_blocks
from .forward import BLOCK_N, BlockLists, TileMask

SPAN = 1 << 16  # coordinates of dilation group g lie in [g * SPAN, (g + 1) * SPAN): past any padded length
TORCH = Arithmetic(where=torch.where, const=lambda value: value)


@functools.lru_cache(maxsize=64)
def gna_tile_mask(problem: Problem, tile: tuple[int, ...], device: torch.device) -> TileMask:
    """The `TileMask` of `problem` on the 128-token `tile`, on `device`; kept per geometry, since every layer of a
    model shares it."""
    if math.prod(tile) != BLOCK_N:
        raise ValueError(f"the Gluon FP8 kernel's tiles hold {BLOCK_N} tokens, got tile={tuple(tile)}")
    gna = GnaMask(problem, tuple(tile))
    tokens = torch.arange(gna.layout.num_tokens, dtype=torch.int64)
    bounds = []
    for group, start, end in gna.windows(tokens, TORCH):
        bounds += [group * SPAN + start, group * SPAN + end]
    groups, coordinates = decode(gna.layout, tokens[::BLOCK_N], TORCH)
    bases = [g * SPAN + c for g, c in zip(groups, coordinates)]
    return TileMask(_int32(bounds, device), _int32(bases, device), tuple(tile))


def _int32(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack(rows).to(device=device, dtype=torch.int32).contiguous()


@functools.lru_cache(maxsize=64)
def gna_block_lists(problem: Problem, tile: tuple[int, ...], device: torch.device) -> tuple[BlockLists, bool]:
    """The kernel's lists of `problem` on the 128-token `tile` (queries and keys), on `device`, and whether any
    visited block is partial (an element masked, or a padding key): the simulator's visited and full tiles, each
    partial block marked with the dimensions it needs masked along (`partial_dims`)."""
    visited, full = gna_blocks(problem, tuple(tile), tuple(tile))
    partial = visited & ~full
    dims = partial_dims(gna_tile_mask(problem, tuple(tile), torch.device("cpu")))
    as_tensor = lambda a: torch.as_tensor(np.ascontiguousarray(a))[None, None].to(device)  # noqa: E731
    return BlockLists.from_blocks(as_tensor(visited), as_tensor(partial), as_tensor(dims)), bool(partial.any())


def partial_dims(mask: TileMask) -> np.ndarray:
    """Per (query block, key block), the bits of the dimensions (bit d: dimension d) along which some row's window
    does not hold every coordinate of the key tile: along the others the kernel's test is true for the whole
    block and it skips it. Padding rows count as rows, which can only add bits."""
    ndim, tokens = len(mask.tile), mask.bounds.shape[1]
    rows = mask.bounds.reshape(ndim, 2, tokens // BLOCK_N, BLOCK_N).long()
    latest_start, earliest_end = rows[:, 0].amax(-1), rows[:, 1].amin(-1)  # [ndim, query blocks]
    first = mask.bases.long()  # [ndim, key blocks]
    sides = torch.tensor(mask.tile)[:, None, None]
    whole = (latest_start[:, :, None] <= first[:, None, :]) & (earliest_end[:, :, None] >= first[:, None, :] + sides)
    return sum((~whole[d]).long() << d for d in range(ndim)).numpy()
