"""Token permutation between a heads-last token layout and multi-D tiles (see kernels/gna/layout.py).

`permute` maps `[B, *shape, heads, head_dim]` to `[B, tokens, heads, head_dim]` in the permuted order, with
zeros at padding positions; `unpermute` maps back and drops the padding. Both are a pure gather, so the round
trip is exact for every dtype. On CUDA tensors (or under TRITON_INTERPRET=1) Triton kernels do the copy;
`permute_reference` / `unpermute_reference` are the torch versions they are tested against.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from natsim.problem import IntOrInts, as_ints, as_shape

from ..common.backend import refuse_untracked, use_triton
from ..common.devices import on_their_device
from .layout import TileLayout

BLOCK_TOKENS = 16
BLOCK_CHANNELS = 512


@triton.jit
def _permuted_to_source(p, L0, L1, L2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                        N0, N1, N2, D0, D1, D2):
    """Row-major source token of permuted position(s) `p`, and whether it is a real token."""
    r = p % (T0 * T1 * T2)
    tile = p // (T0 * T1 * T2)
    t = tile % (N0 * N1 * N2)
    g = tile // (N0 * N1 * N2)
    x0 = ((t // (N1 * N2)) * T0 + r // (T1 * T2)) * D0 + g // (D1 * D2)
    x1 = (((t // N2) % N1) * T1 + (r // T2) % T1) * D1 + (g // D2) % D1
    x2 = ((t % N2) * T2 + r % T2) * D2 + g % D2
    real = (x0 < L0) & (x1 < L1) & (x2 < L2)
    return (x0 * L1 + x1) * L2 + x2, real


@triton.jit
def _source_to_permuted(n, L1, L2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                        N0, N1, N2, D0, D1, D2):
    """Permuted position of row-major source token(s) `n`."""
    x2 = n % L2
    x1 = (n // L2) % L1
    x0 = n // (L2 * L1)
    j0 = x0 // D0
    j1 = x1 // D1
    j2 = x2 // D2
    g = ((x0 % D0) * D1 + x1 % D1) * D2 + x2 % D2
    t = ((j0 // T0) * N1 + j1 // T1) * N2 + j2 // T2
    r = ((j0 % T0) * T1 + j1 % T1) * T2 + j2 % T2
    return (g * (N0 * N1 * N2) + t) * (T0 * T1 * T2) + r


@triton.jit
def _permute_kernel(X, Y, tokens_out, channels, stride_xb, stride_yb,
                    L0, L1, L2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                    N0, N1, N2, D0, D1, D2,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    p = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    src, real = _permuted_to_source(p, L0, L1, L2, T0, T1, T2, N0, N1, N2, D0, D1, D2)
    in_c = c < channels
    x = tl.load(X + b * stride_xb + src.to(tl.int64)[:, None] * channels + c[None, :],
                mask=real[:, None] & in_c[None, :], other=0.0)
    tl.store(Y + b * stride_yb + p.to(tl.int64)[:, None] * channels + c[None, :], x,
             mask=(p < tokens_out)[:, None] & in_c[None, :])


@triton.jit
def _unpermute_kernel(Y, X, tokens, channels, stride_yb, stride_xb,
                      L1, L2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                      N0, N1, N2, D0, D1, D2,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    p = _source_to_permuted(n, L1, L2, T0, T1, T2, N0, N1, N2, D0, D1, D2)
    mask = (n < tokens)[:, None] & (c < channels)[None, :]
    y = tl.load(Y + b * stride_yb + p.to(tl.int64)[:, None] * channels + c[None, :], mask=mask)
    tl.store(X + b * stride_xb + n.to(tl.int64)[:, None] * channels + c[None, :], y, mask=mask)


def _layout(shape: tuple[int, ...], tile: IntOrInts, dilation: IntOrInts) -> TileLayout:
    ndim = len(shape)
    return TileLayout(shape, as_ints(tile, ndim, "tile"), as_ints(dilation, ndim, "dilation"))


def _check_tokens(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}.")
    if not 4 <= x.dim() <= 6:
        raise ValueError(
            f"{name} must be [batch, *spatial, heads, head_dim] with 1 to 3 spatial dimensions, "
            f"got {name}.shape={tuple(x.shape)}."
        )


def _launch_args(layout: TileLayout) -> tuple:
    l3 = layout.to_3d()
    return (*l3.tile, *l3.tiles_per_group, *l3.dilation)


@on_their_device
def permute(x: torch.Tensor, tile: IntOrInts, dilation: IntOrInts = 1) -> torch.Tensor:
    """`[B, *shape, H, D]` -> `[B, tokens, H, D]` in multi-D tile order (zeros at padding positions)."""
    _check_tokens(x, "x")
    shape = tuple(x.shape[1:-2])
    layout = _layout(shape, tile, dilation)
    if not use_triton(x):
        return permute_reference(x, layout.tile, layout.dilation)
    refuse_untracked("permute", x)
    x = x.contiguous()
    batch, heads, head_dim = x.shape[0], x.shape[-2], x.shape[-1]
    channels = heads * head_dim
    y = torch.empty((batch, layout.num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    L = layout.to_3d().shape
    grid = (triton.cdiv(layout.num_tokens, BLOCK_TOKENS), triton.cdiv(channels, BLOCK_CHANNELS), batch)
    _permute_kernel[grid](
        x, y, layout.num_tokens, channels, x.stride(0), y.stride(0), *L, *_launch_args(layout),
        BLOCK_T=BLOCK_TOKENS, BLOCK_C=BLOCK_CHANNELS,
    )
    return y


@on_their_device
def unpermute(y: torch.Tensor, shape: IntOrInts, tile: IntOrInts, dilation: IntOrInts = 1) -> torch.Tensor:
    """`[B, tokens, H, D]` in multi-D tile order -> `[B, *shape, H, D]` (padding dropped)."""
    shape = as_shape(shape)
    layout = _layout(shape, tile, dilation)
    if not isinstance(y, torch.Tensor) or y.dim() != 4 or y.shape[1] != layout.num_tokens:
        raise ValueError(
            f"y must be [batch, {layout.num_tokens}, heads, head_dim] for shape={shape}, "
            f"tile={layout.tile}, dilation={layout.dilation}, got "
            f"y.shape={tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}."
        )
    if not use_triton(y):
        return unpermute_reference(y, shape, layout.tile, layout.dilation)
    refuse_untracked("unpermute", y)
    y = y.contiguous()
    batch, heads, head_dim = y.shape[0], y.shape[-2], y.shape[-1]
    channels = heads * head_dim
    tokens = math.prod(shape)
    x = torch.empty((batch, *shape, heads, head_dim), dtype=y.dtype, device=y.device)
    L = layout.to_3d().shape
    grid = (triton.cdiv(tokens, BLOCK_TOKENS), triton.cdiv(channels, BLOCK_CHANNELS), batch)
    _unpermute_kernel[grid](
        y, x, tokens, channels, y.stride(0), x.stride(0), L[1], L[2], *_launch_args(layout),
        BLOCK_T=BLOCK_TOKENS, BLOCK_C=BLOCK_CHANNELS,
    )
    return x


def _tiled_view_order(ndim: int) -> list[int]:
    """Axis order taking `[B, (t_i, r_i, g_i) per dim, C]` to `[B, g..., t..., r..., C]`."""
    groups = [1 + 3 * i + 2 for i in range(ndim)]
    tiles = [1 + 3 * i for i in range(ndim)]
    inside = [1 + 3 * i + 1 for i in range(ndim)]
    return [0, *groups, *tiles, *inside, 1 + 3 * ndim]


def permute_reference(x: torch.Tensor, tile: IntOrInts, dilation: IntOrInts = 1) -> torch.Tensor:
    """Torch version of `permute`: pad every dimension to `d * P`, then reshape and transpose.

    Coordinate `x = j * d + g` with in-group index `j = t * T + r`, so a padded dimension of length `d * P`
    viewed as `(P / T, T, d)` is indexed `(t, r, g)`.
    """
    _check_tokens(x, "x")
    shape = tuple(x.shape[1:-2])
    layout = _layout(shape, tile, dilation)
    batch, heads, head_dim = x.shape[0], x.shape[-2], x.shape[-1]
    flat = x.reshape(batch, *shape, heads * head_dim)
    padded_shape = [n * t * d for n, t, d in zip(layout.tiles_per_group, layout.tile, layout.dilation)]
    padded = flat.new_zeros((batch, *padded_shape, heads * head_dim))
    padded[(slice(None), *(slice(0, L) for L in shape))] = flat
    split = [batch]
    for n, t, d in zip(layout.tiles_per_group, layout.tile, layout.dilation):
        split += [n, t, d]
    tiled = padded.reshape(*split, heads * head_dim).permute(_tiled_view_order(len(shape)))
    return tiled.reshape(batch, layout.num_tokens, heads, head_dim)


@functools.lru_cache(maxsize=64)
def source_rows(shape: tuple[int, ...], tile: tuple[int, ...], dilation: tuple[int, ...],
                device: torch.device) -> torch.Tensor:
    """Where each position of the permuted order reads from: int32 `[tokens]` on `device`, the row-major index of
    the token `permute` puts there, -1 at padding. Kernels that gather as they go (the FP8 quantization,
    kernels/common/fp8.py) read a layout in the permuted order through it, with no permuted copy in between. Kept
    per geometry: every layer of a model shares it."""
    shape, tile, dilation = tuple(shape), tuple(tile), tuple(dilation)
    tokens = torch.arange(1, math.prod(shape) + 1, dtype=torch.int64).reshape(1, *shape, 1, 1)
    order = permute_reference(tokens, tile, dilation).reshape(-1) - 1
    return order.to(device=device, dtype=torch.int32)


def unpermute_reference(y: torch.Tensor, shape: IntOrInts, tile: IntOrInts, dilation: IntOrInts = 1) -> torch.Tensor:
    """Torch version of `unpermute`: the inverse reshape and transpose of `permute_reference`."""
    shape = as_shape(shape)
    layout = _layout(shape, tile, dilation)
    ndim = len(shape)
    batch, heads, head_dim = y.shape[0], y.shape[-2], y.shape[-1]
    grid = [*layout.dilation, *layout.tiles_per_group, *layout.tile]
    tiled = y.reshape(batch, *grid, heads * head_dim)
    inverse = [0] * (3 * ndim + 2)
    for position, axis in enumerate(_tiled_view_order(ndim)):
        inverse[axis] = position
    padded = tiled.permute(inverse).reshape(
        batch, *(n * t * d for n, t, d in zip(layout.tiles_per_group, layout.tile, layout.dilation)),
        heads * head_dim,
    )
    real = padded[(slice(None), *(slice(0, L) for L in shape))]
    return real.reshape(batch, *shape, heads, head_dim)
