"""The cost model's features for the sparse kernel (natsim.kernels.sparse): what one call does, in countable
units, from its prepared work (`SparseWork`) and the call's batch, heads and head_dim, without running anything.

One row per call, one column per feature (batch and heads multiply everything but `launch`; a mask of batch or
heads 1 broadcasts, so its work items count once per batch element or head):

| feature | unit | what it counts |
|---|---|---|
| `full_flops` | FLOP | 4 * block_m * block_n * head_dim per tile of the unmasked loop (blocks every member attends) |
| `masked_flops` | FLOP | the same for tiles of the masked loop (their extra cost is the member-bit mask) |
| `gathered_flops` | FLOP | FLOPs of tiles packing several KV blocks (kv_block < block_n), read by pointer gathers instead of one tensor-descriptor copy: their extra cost |
| `narrow_flops` | FLOP | FLOPs of tiles with fewer than 128 queries (unmerged query blocks under 128: 4 warps, little reuse of each K/V tile): their extra cost |
| `narrow_head_flops` | FLOP | every tile's FLOPs when head_dim is under 128 (shorter matrix products): their extra cost |
| `tiles` | tile | KV tile iterations of both loops: the per-iteration overhead |
| `programs` | program | work items launched (one per group of query blocks and head): gathering Q, the epilogue, storing O |
| `launch` | call | 1: launch and host overhead per call |

Tiles are whole: a masked tile counts in full however few of its keys are real, since the kernel computes
all of them. The features are linear in the work, so predicted time is one dot product (planner.cost.model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from natsim.kernels import SparseWork

SPARSE_FEATURES = ("full_flops", "masked_flops", "gathered_flops", "narrow_flops", "narrow_head_flops", "tiles",
                   "programs", "launch")
WIDE_TILE = 128  # queries: programs with fewer pay `narrow_flops`
WIDE_HEAD = 128  # channels: smaller head dims pay `narrow_head_flops`


def sparse_features(work: "SparseWork", batch: int, heads: int, head_dim: int) -> np.ndarray:
    """The feature row (SPARSE_FEATURES order) of one call of `work` on `[batch, N, heads, head_dim]` tensors.

    Counts come from the work's own tensors (`offsets`, `full_tiles`), with torch ops wherever they live.
    """
    for name, value in (("batch", batch), ("heads", heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}.")
    if work.mask_batch not in (1, batch) or work.mask_heads not in (1, heads):
        raise ValueError(
            f"the work's mask batch and heads must be 1 or the call's ({batch}, {heads}), "
            f"got ({work.mask_batch}, {work.mask_heads})."
        )
    per_tile = work.block_n // work.kv_block
    lengths = (work.offsets[1:] - work.offsets[:-1]).to(torch.int64)
    full = work.full_tiles.to(torch.int64)
    masked = torch.div(lengths - full * per_tile + per_tile - 1, per_tile, rounding_mode="floor")
    full_tiles, masked_tiles = (int(t) for t in torch.stack([full.sum(), masked.sum()]).cpu())
    copies = (batch // work.mask_batch) * (heads // work.mask_heads)  # broadcast masks repeat their items
    return feature_row(full_tiles, masked_tiles, lengths.numel(), block_m=work.block_m, block_n=work.block_n,
                       kv_block=work.kv_block, copies=copies, head_dim=head_dim)


def feature_row(full_tiles: int, masked_tiles: int, items: int, *, block_m: int, block_n: int, kv_block: int,
                copies: int, head_dim: int) -> np.ndarray:
    """The feature row of a call whose work items (`items` of them, each run `copies` times: a mask of batch or
    heads 1 broadcasts) hold `full_tiles` unmasked and `masked_tiles` masked KV tiles in all; `sparse_features`
    counts these on a prepared work, the mask planner on packed rows (planner.search.mask_work)."""
    tile_flops = 4.0 * block_m * block_n * head_dim
    tiles = float(full_tiles + masked_tiles) * copies
    all_flops = tiles * tile_flops
    return np.array([
        full_tiles * copies * tile_flops,
        masked_tiles * copies * tile_flops,
        all_flops if kv_block < block_n else 0.0,
        all_flops if block_m < WIDE_TILE else 0.0,
        all_flops if head_dim < WIDE_HEAD else 0.0,
        tiles,
        float(items * copies),
        1.0,
    ])
