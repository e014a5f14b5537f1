"""Argument checks at the kernels' public boundary, with NATTEN-style sentence errors.

GNA parameters are validated by building a `natsim.Problem`; tile shapes by `natsim.TileConfig`. What is
left here is about tensors: layout, matching q/k/v, and what the Triton kernel can run.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from natsim import Problem, TileConfig
from natsim.tiles import KV_TILINGS

IntOrInts = Union[int, Sequence[int]]
BoolOrBools = Union[bool, Sequence[bool]]

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (32, 64, 128)
MIN_TILE_TOKENS = 16
MAX_TILE_TOKENS = 256


def check_tensors(q: object, k: object, v: object) -> None:
    """q, k and v are torch tensors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """Check that q, k, v are `[B, *shape, heads, head_dim]` tensors that agree; return `shape`."""
    check_tensors(q, k, v)
    if not 4 <= q.dim() <= 6:
        raise ValueError(
            "q must be [batch, *spatial, heads, head_dim] with 1 to 3 spatial dimensions, "
            f"got q.shape={tuple(q.shape)}."
        )
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k and v must have the same shape, got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must have the same dtype, got q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            "q, k and v must be on the same device, got "
            f"q.device={q.device}, k.device={k.device}, v.device={v.device}."
        )
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k and v must be floating-point tensors, got dtype={q.dtype}.")
    return tuple(int(n) for n in q.shape[1:-2])


def problem_of(
    shape: tuple[int, ...],
    window: IntOrInts,
    stride: IntOrInts,
    dilation: IntOrInts,
    causal: BoolOrBools,
) -> Problem:
    """The validated GNA problem of a token layout (raises natsim's sentence errors)."""
    return Problem(shape, window, stride, dilation, causal)


def check_kernel_inputs(q: torch.Tensor) -> None:
    """Check what the Triton kernel supports: dtype and head_dim."""
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"the GNA kernel supports dtype float16 and bfloat16 (fp32 accumulation), got dtype={q.dtype}; "
            "use reference_attention for other dtypes."
        )
    head_dim = q.shape[-1]
    if head_dim not in KERNEL_HEAD_DIMS:
        raise ValueError(f"the GNA kernel supports head_dim in {KERNEL_HEAD_DIMS}, got head_dim={head_dim}.")


def check_kv_tiling(kv_tiling: object) -> None:
    """`kv_tiling` is "static", "dynamic" or None (natsim chooses)."""
    if kv_tiling is not None and kv_tiling not in KV_TILINGS:
        raise ValueError(f"kv_tiling must be one of {KV_TILINGS} or None (natsim chooses), "
                         f"got kv_tiling={kv_tiling!r}.")


def kernel_tiles(
    problem: Problem, q_tile: Optional[IntOrInts], kv_tile: Optional[IntOrInts]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-dimension (q_tile, kv_tile) for `problem`, checked against the kernel; one given alone is used
    for both (at least one must be given)."""
    config = TileConfig(kv_tile if q_tile is None else q_tile, q_tile if kv_tile is None else kv_tile)
    q_dims, kv_dims = config.dims(problem)
    for name, dims in (("q_tile", q_dims), ("kv_tile", kv_dims)):
        tokens = math.prod(dims)
        if tokens & (tokens - 1) or not MIN_TILE_TOKENS <= tokens <= MAX_TILE_TOKENS:
            raise ValueError(
                f"the GNA kernel needs tiles of a power-of-two number of tokens between {MIN_TILE_TOKENS} "
                f"and {MAX_TILE_TOKENS}, got {name}={dims} ({tokens} tokens)."
            )
    return q_dims, kv_dims
