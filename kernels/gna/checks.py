"""Argument checks at GNA's public boundary, with NATTEN-style sentence errors.

GNA parameters are validated by building a `natsim.Problem`; tile shapes by `natsim.TileConfig`. What is
left here is about tensors (layout, matching q/k/v, what the kernel can run), KV tiling modes, and frame
ranges (`frame_offsets`, natsim.distributed's halo exchange).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from natsim import Problem, TileConfig
from natsim.partition import key_frames
from natsim.problem import BoolOrBools, IntOrInts
from natsim.tiles import KV_TILINGS

from ..common.checks import (KERNEL_DTYPES, KERNEL_HEAD_DIMS, check_head_dim, check_interpretable, check_matching,
                             check_tensors)
from ..common.fp8 import E4M3
from ..common.headdim import head_dim_refusal

MIN_TILE_TOKENS = 16
MAX_TILE_TOKENS = 256


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
    check_head_dim(q)
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


def check_kernel_inputs(q: torch.Tensor, float8: bool = False) -> None:
    """Check what the Triton kernel supports: dtype (float8 e4m3 too where the call was given `float8` inputs
    with their scales, kernels/common/fp8.py) and head_dim."""
    if q.dtype not in KERNEL_DTYPES and not (float8 and q.dtype == E4M3):
        raise ValueError(
            f"the GNA kernel supports dtype float16 and bfloat16 (fp32 accumulation), got dtype={q.dtype}; "
            "use reference_attention for other dtypes."
        )
    check_interpretable(q)
    refusal = head_dim_refusal(q.shape[-1], "GNA kernel", KERNEL_HEAD_DIMS)
    if refusal is not None:
        raise ValueError(refusal)


def check_kv_tiling(kv_tiling: object) -> None:
    """`kv_tiling` is "static", "dynamic" or None (natsim chooses)."""
    if kv_tiling is not None and kv_tiling not in KV_TILINGS:
        raise ValueError(f"kv_tiling must be one of {KV_TILINGS} or None (natsim chooses), "
                         f"got kv_tiling={kv_tiling!r}.")


def given_tiles(
    problem: Problem, q_tile: Optional[IntOrInts], kv_tile: Optional[IntOrInts]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-dimension (q_tile, kv_tile) for `problem`: one size of at least 1 per dimension (what any backend needs
    of tiles it is given; the torch reference runs any such tiles); one given alone is used for both."""
    return TileConfig(kv_tile if q_tile is None else q_tile, q_tile if kv_tile is None else kv_tile).dims(problem)


def kernel_tiles(
    problem: Problem, q_tile: Optional[IntOrInts], kv_tile: Optional[IntOrInts]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-dimension (q_tile, kv_tile) for `problem`, checked against the kernel; one given alone is used
    for both (at least one must be given)."""
    q_dims, kv_dims = given_tiles(problem, q_tile, kv_tile)
    for name, dims in (("q_tile", q_dims), ("kv_tile", kv_dims)):
        tokens = math.prod(dims)
        if tokens & (tokens - 1) or not MIN_TILE_TOKENS <= tokens <= MAX_TILE_TOKENS:
            raise ValueError(
                f"the GNA kernel needs tiles of a power-of-two number of tokens between {MIN_TILE_TOKENS} "
                f"and {MAX_TILE_TOKENS}, got {name}={dims} ({tokens} tokens)."
            )
    return q_dims, kv_dims


def check_frame_offsets(frame_offsets: object) -> tuple[int, int, int]:
    """`frame_offsets=(q0, k0, L0)`: three non-negative ints (query offset, key offset, frames of dimension 0)."""
    if not isinstance(frame_offsets, (tuple, list)) or len(frame_offsets) != 3 or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in frame_offsets):
        raise ValueError("frame_offsets must be three non-negative ints (query offset, key offset, frames of "
                         f"dimension 0), got frame_offsets={frame_offsets!r}.")
    q0, k0, frames = (int(x) for x in frame_offsets)
    return q0, k0, frames


def check_frames(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame_offsets: tuple[int, int, int],
                 window: IntOrInts, stride: IntOrInts, dilation: IntOrInts,
                 causal: BoolOrBools) -> tuple[Problem, tuple[int, int, int, int]]:
    """Check a frame-range call against its tensors: q holds frames `[q0, q0 + Tq)` of dimension 0 of a layout of
    `L0` frames and k, v frames `[k0, k0 + Tk)`, which must hold every frame the queries' windows reach
    (`frame_offsets=(q0, k0, L0)`, already checked by `check_frame_offsets`). Returns the global problem and
    `(q0, q1, k0, k1)`."""
    q0, k0, frames = frame_offsets
    if k.shape != v.shape or k.shape[:1] + k.shape[2:] != q.shape[:1] + q.shape[2:]:
        raise ValueError("k and v must have the same shape, and q's but along dimension 0 of the layout, got "
                         f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}.")
    check_qkv(q, q, q)  # q's own layout and dtype rules
    check_matching(q, k, v)
    # Sizes as ints: under torch.compile they arrive symbolic (a rank's slab changes with the split), and the
    # window bounds below are counted, and cached, on values.
    q_frames, k_frames, rest = int(q.shape[1]), int(k.shape[1]), tuple(int(n) for n in q.shape[2:-2])
    q1, k1 = q0 + q_frames, k0 + k_frames
    if q_frames < 1 or k_frames < 1 or q1 > frames or k1 > frames:
        raise ValueError(f"q's frames [{q0}, {q1}) and k's frames [{k0}, {k1}) must be non-empty and lie within "
                         f"the {frames} frames of dimension 0, got frame_offsets={(q0, k0, frames)}.")
    problem = problem_of((frames, *rest), window, stride, dilation, causal)
    need = key_frames(problem, q0, q1)
    if need[0] < k0 or need[1] > k1:
        raise ValueError(f"k and v must hold every frame that q's frames [{q0}, {q1}) attend, [{need[0]}, "
                         f"{need[1]}), got frames [{k0}, {k1}).")
    return problem, (q0, q1, k0, k1)
