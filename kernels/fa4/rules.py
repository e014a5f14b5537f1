"""What FlashAttention-4 4.0.0b36's Hopper kernels run, as natsim calls them: block sizes per head dim, forward
and backward, and GNA's tiles in one token order (kernels/backends/fa4.py says how they were read, and holds the
capability tables built on them)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .library import unavailable
from .lists import nested_refusal

HEAD_DIMS = tuple(range(8, 257, 8))  # Hopper: 8 to 256, multiples of 8 for 16-bit inputs


def _forward_kv_tile(head_dim: int) -> int:
    return 128 if head_dim <= 192 else 80


def _backward_tiles(head_dim: int) -> Optional[tuple[int, int]]:
    """(query tile, key tile) of the Hopper backward with block sparsity; None where natsim's blocks fit none."""
    if head_dim <= 64:
        return 128, 128
    if head_dim <= 128:
        return 64, 128
    return None


def _dq_accumulator_mismatch(head_dim: int) -> bool:
    """Whether the Hopper backward's dQ comes back wrong at `head_dim`: for head dims up to 128 its kernel pads
    the head dim to a multiple of 16 while the interface lays out and reads back the dQ accumulator padded to a
    multiple of 32 (flash_attn/cute/flash_bwd_sm90.py's `tile_hdim` against interface.py's `head_dim_rounded`),
    so every width whose two paddings differ (8, 16, 40, 48, 72, 80, 104, 112) reads stale accumulator columns.
    dK and dV are right; tests/test_fa4_gpu.py holds the library to this on the GPU."""
    return head_dim <= 128 and -(-head_dim // 16) * 16 != -(-head_dim // 32) * 32


def tile_refusal(q_block: int, kv_block: int, head_dim: int, backward: bool = False) -> Optional[str]:
    """None when FlashAttention-4 runs query blocks of `q_block` tokens against key blocks of `kv_block` at
    `head_dim` (and with `backward`, differentiates them), else one sentence saying why not (module docstring)."""
    if head_dim not in HEAD_DIMS:
        return f"FlashAttention-4 runs head_dim 8 to 256 in steps of 8, got head_dim={head_dim}."
    if q_block % 64:
        return f"FlashAttention-4 runs query blocks of a multiple of 64 tokens, got {q_block}."
    kv_tile = _forward_kv_tile(head_dim)
    if kv_block % 16 or kv_block > kv_tile:
        return (f"FlashAttention-4 runs key blocks of a multiple of 16 tokens up to {kv_tile} at head_dim={head_dim}, "
                f"got {kv_block}.")
    if backward:
        tiles = _backward_tiles(head_dim)
        if tiles is None:
            return f"FlashAttention-4's block-sparse backward runs head_dim up to 128 here, got head_dim={head_dim}."
        if _dq_accumulator_mismatch(head_dim):
            return (f"FlashAttention-4's Hopper backward returns a wrong dQ at head_dim={head_dim} (its kernel pads "
                    f"the head dim to a multiple of 16, its dQ accumulator to a multiple of 32).")
        q_tile, kv_tile = tiles
        if kv_block != kv_tile or q_block % q_tile:
            return (f"FlashAttention-4's block-sparse backward at head_dim={head_dim} runs key blocks of {kv_tile} "
                    f"tokens and query blocks of a multiple of {q_tile}, got {q_block} x {kv_block}.")
    return None


def gna_tile_refusal(q_tile: tuple[int, ...], kv_tile: tuple[int, ...], head_dim: int,
                     backward: bool = False) -> Optional[str]:
    """None when FlashAttention-4 runs GNA with these Q and KV tile shapes at `head_dim` (and with `backward`,
    differentiates it), else one sentence saying why not."""
    return nested_refusal(tuple(q_tile), tuple(kv_tile)) or tile_refusal(
        math.prod(q_tile), math.prod(kv_tile), head_dim, backward)


def device_refusal(device: torch.device) -> Optional[str]:
    """None when FlashAttention-4 runs on `device` here (installed, in natsim's version, on a GPU it runs on)."""
    return unavailable(device)
