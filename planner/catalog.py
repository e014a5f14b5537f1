"""The tile catalog: which Q/KV tile shapes the planner may choose for a layout, head_dim and dtype.

What the GNA kernel can run (dtypes, head dims) is its backend's capability table
(`natsim.kernels.backends.capabilities("triton", "gna")`), and which tile shapes it runs *well* (boxes of 64 or
128 tokens with power-of-two sides, KV tiles equal to the Q tile or half of it) its tile catalog
(`natsim.kernels.backends.triton`: `TILE_TOKENS`, `tile_pairs`); both are read from there, not copied: the
kernel's own default tiles come from the same list. Each tile pair comes in the KV tiling modes asked for
(static first, so that a tie keeps the static kernel).
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

from natsim import TileConfig
from natsim.tiles import KV_TILINGS
from natsim.kernels.backends import capabilities
from natsim.kernels.backends.triton import TILE_TOKENS, tile_pairs
from natsim.kernels.backends.triton import catalog as tile_tokens

GNA_KERNEL = capabilities("triton", "gna")  # what the GNA kernel the planner plans for runs

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
    if resolved not in GNA_KERNEL.dtypes:
        names = ", ".join(DTYPE_NAMES[d] for d in GNA_KERNEL.dtypes)
        raise ValueError(f"dtype must be one of those the GNA kernel runs ({names}), got dtype={dtype!r}.")
    return resolved


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a kernel dtype ("bf16", "fp16"), as plans and coefficient files store it."""
    return DTYPE_NAMES[dtype]


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_head_dim(head_dim: object) -> int:
    """Check that the GNA kernel runs `head_dim` (its catalog has tiles for every width it runs)."""
    if not isinstance(head_dim, numbers.Integral) or isinstance(head_dim, bool):
        raise TypeError(f"head_dim must be an int, got head_dim={head_dim!r}.")
    head_dim = int(head_dim)
    widths = GNA_KERNEL.head_dims
    if head_dim not in widths:
        raise ValueError(f"head_dim must be one the GNA kernel runs ({min(widths)} to {max(widths)} in steps of "
                         f"{widths[1] - widths[0]}), got head_dim={head_dim}.")
    return head_dim


def tile_catalog(
    shape: Sequence[int], head_dim: int = 128, kv_tilings: Sequence[str] = ("static",)
) -> list[TileConfig]:
    """The multi-D tile configurations the planner scores for a token layout `shape` and `head_dim`, each
    tile pair in every KV tiling mode of `kv_tilings` ("static", "dynamic")."""
    head_dim = check_head_dim(head_dim)
    modes = [mode for mode in KV_TILINGS if mode in kv_tilings]
    if not modes or len(modes) != len(set(kv_tilings)):
        raise ValueError(f"kv_tilings must name one or both of {KV_TILINGS}, got kv_tilings={tuple(kv_tilings)!r}.")
    catalog = [TileConfig(q_shape, kv_shape, kv_tiling=mode)
               for q_shape, kv_shape in tile_pairs(shape, head_dim) for mode in modes]
    if not catalog:
        smallest = min(q for q, _ in tile_tokens(head_dim))
        raise ValueError(
            f"shape={tuple(shape)} is too small for the planner's tiles: the smallest holds {smallest} tokens, "
            "with no side longer than the next power of two of its dimension."
        )
    return catalog
