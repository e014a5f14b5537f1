"""The tile catalog: which Q/KV tile shapes the planner may choose for a layout, head_dim and dtype.

What the GNA kernel can run is decided by natsim.kernels (its dtypes, head dims and tile token counts are
imported from there, not copied). What it runs *well* is data kept here: the (Q tokens, KV tokens) pairs
worth scoring, per head_dim. Tile shapes are boxes with power-of-two sides (a kernel tile holds a
power-of-two number of tokens) no longer than the next power of two of their dimension, since a longer
side would hold only padding. A KV tile is either the Q tile's shape or, for half as many keys, the Q tile
halved along one dimension (NATTEN's 4x8x8 / 2x8x8 pattern).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from natsim import TileConfig
from natsim.kernels.checks import KERNEL_DTYPES, KERNEL_HEAD_DIMS

# (Q tokens, KV tokens) per tile that the planner scores, per head_dim; KV tokens equal the Q tokens or half. 64- and 128-token tiles keep the
# tensor cores busy at these head dims; 256-query tiles spill registers at head_dim 128.
TILE_TOKENS: dict[int, tuple[tuple[int, int], ...]] = {
    32: ((128, 128), (128, 64), (64, 64)),
    64: ((128, 128), (128, 64), (64, 64)),
    128: ((128, 128), (128, 64), (64, 64)),
}

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPE_ALIASES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
}


def as_dtype(dtype: object) -> torch.dtype:
    """Normalise a torch dtype or a name ("bf16", "float16", ...) to a dtype the GNA kernel runs."""
    if isinstance(dtype, str):
        resolved = DTYPE_ALIASES.get(dtype.lower())
    elif isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        raise TypeError(f"dtype must be a torch.dtype or a name like 'bf16', got dtype={dtype!r}.")
    if resolved not in KERNEL_DTYPES:
        names = ", ".join(DTYPE_NAMES[d] for d in KERNEL_DTYPES)
        raise ValueError(f"dtype must be one of those the GNA kernel runs ({names}), got dtype={dtype!r}.")
    return resolved


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a kernel dtype ("bf16", "fp16"), as plans and coefficient files store it."""
    return DTYPE_NAMES[dtype]


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_head_dim(head_dim: object) -> int:
    """Check that the GNA kernel runs `head_dim` and the catalog has tiles for it."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        raise TypeError(f"head_dim must be an int, got head_dim={head_dim!r}.")
    supported = tuple(d for d in KERNEL_HEAD_DIMS if d in TILE_TOKENS)
    if head_dim not in supported:
        raise ValueError(f"head_dim must be one of those the GNA kernel runs {supported}, got head_dim={head_dim}.")
    return head_dim


def _box_shapes(tokens: int, limits: Sequence[int]) -> list[tuple[int, ...]]:
    """Every box of `tokens` tokens with power-of-two sides within `limits`, in a fixed order."""
    exponent = tokens.bit_length() - 1
    shapes = []
    for parts in itertools.product(range(exponent + 1), repeat=len(limits)):
        if sum(parts) == exponent:
            shape = tuple(1 << p for p in parts)
            if all(side <= limit for side, limit in zip(shape, limits)):
                shapes.append(shape)
    return shapes


def _halves(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """`shape` halved along each dimension that has an even side."""
    return [shape[:i] + (side // 2,) + shape[i + 1 :] for i, side in enumerate(shape) if side > 1]


def tile_catalog(shape: Sequence[int], head_dim: int = 128) -> list[TileConfig]:
    """The multi-D tile configurations the planner scores for a token layout `shape` and `head_dim`."""
    head_dim = check_head_dim(head_dim)
    limits = [1 << (length - 1).bit_length() for length in shape]
    catalog: list[TileConfig] = []
    for q_tokens, kv_tokens in TILE_TOKENS[head_dim]:
        for q_shape in _box_shapes(q_tokens, limits):
            kv_shapes = [q_shape] if kv_tokens == q_tokens else _halves(q_shape)
            catalog.extend(TileConfig(q_shape, kv_shape) for kv_shape in kv_shapes)
    if not catalog:
        smallest = min(q for q, _ in TILE_TOKENS[head_dim])
        raise ValueError(
            f"shape={tuple(shape)} is too small for the planner's tiles: the smallest holds {smallest} tokens, "
            "with no side longer than the next power of two of its dimension."
        )
    return catalog
