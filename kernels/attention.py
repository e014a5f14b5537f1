"""Public entry points of GNA attention: layout in, layout out, with the permutation fused around the kernel.

- `gna_attention(q, k, v, window, ...)`: `[B, *shape, heads, head_dim]` in and out.
- `gna_attention_permuted(q, k, v, problem, q_tile, kv_tile, ...)`: tensors already permuted
  (kernels/permute.py), q with `q_tile`, k and v with `kv_tile`; output in q's permuted order.
- `gna_tile_counts(...)`: runs the kernel with its debug counters on and returns, per Q tile, the KV tiles
  visited and the KV tiles run without the window mask.

On CPU tensors (without TRITON_INTERPRET=1) `gna_attention` runs `reference_attention` and warns once.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Optional, Union

import numpy as np
import torch
import triton

from natsim import Problem
from natsim.window import group_length, window_bounds

from .backend import interpreting, use_triton
from .checks import (
    BoolOrBools,
    IntOrInts,
    check_kernel_inputs,
    check_qkv,
    kernel_tiles,
    problem_of,
)
from .gna import LOG2E, gna_forward_kernel
from .layout import TileLayout, as_3d
from .permute import permute, unpermute
from .reference import reference_attention

_warned_cpu = False


SHARED_MEMORY_BUDGET = 227 * 1024  # bytes: what one H100 thread block may use


@functools.lru_cache(maxsize=256)
def needs_mask(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...]) -> bool:
    """Whether any KV tile the kernel visits can be partial (window mask) or reach into group padding.

    The kernel's visited tiles per Q tile are a box, one KV tile range per dimension, and a tile is full when
    it is full along every dimension, so checking every dimension on its own is exact: this mirrors the
    kernel's `_dim_setup` and its `full` test for each dilation group length and Q tile along the dimension.
    False for dense attention and block-sparse configurations; the kernel then compiles no mask code.
    """
    for L, w, s, d, c, tq, tk in zip(problem.shape, problem.window, problem.stride, problem.dilation,
                                     problem.causal, q_tile, kv_tile):
        for length in {group_length(L, d, g) for g in range(d)}:
            if length % tk:
                return True  # the last KV tile of the group holds padding keys
            for first in range(0, length, tq):
                last = min(first + tq, length) - 1
                start_first, end_first = window_bounds(first, length, w, s, c)
                start_last, end_last = window_bounds(last, length, w, s, c)
                for tile in range(int(start_first) // tk, (int(end_last) + tk - 1) // tk):
                    if not (start_last <= tile * tk and end_first >= tile * tk + tk):
                        return True
    return False


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need Hopper or newer (or the interpreter) and 16-byte aligned bases and strides."""
    if not interpreting() and torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    size = tensors[0].element_size()
    return all(t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def _ensure_allocator() -> None:
    """In-kernel tensor descriptors need a scratch allocator; install a torch one unless the caller has one."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # pragma: no cover - layout of triton's internals changed
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_torch_allocator)


def _torch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


def launch_config(
    block_m: int, block_n: int, head_dim: int, masked: bool = True, tma: bool = False, specialize: bool = True
) -> dict:
    """Launch options for a tile of `block_m` queries, `block_n` keys and `head_dim` (see kernels/gna.py).

    A 128x128 tile without masks, with tensor descriptors, runs warp-specialized: `num_warps=4` asks for one
    consumer warpgroup per 64 query rows (Triton's Hopper pass makes two of them and adds a producer
    warpgroup for the K/V copies, 12 warps in all) and two K/V stages fill shared memory. Otherwise 8 warps
    (4 for smaller tiles) and three pipeline stages when they fit in shared memory (measured faster than two
    at 128x128x128 on the H100, benchmarks/results/gna-tune-*.json).

    `specialize=False` keeps the single-partition loop: the launcher asks for it when the kernel writes the
    LSE or debug counts. Under Triton 3.6's Hopper warp specialization the LSE came out wrong (off by more
    than 1e-2 against float64 at HunyuanVideo 16x8x8) while the output was right (H100, 2026-11-22).
    """
    q_bytes, kv_bytes = 2 * block_m * head_dim, 2 * 2 * block_n * head_dim
    large = block_m * head_dim >= 128 * 128
    if specialize and tma and not masked and large and block_m == 128 and block_n == 128:
        return dict(num_warps=4, num_stages=2, MASKED=False, USE_TMA=True, WARP_SPECIALIZE=True)
    stages = 3 if q_bytes + 3 * kv_bytes <= SHARED_MEMORY_BUDGET else 2
    return dict(num_warps=8 if large else 4, num_stages=stages, MASKED=masked, USE_TMA=tma, WARP_SPECIALIZE=False)


def _run_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    q_tile: tuple[int, ...],
    kv_tile: tuple[int, ...],
    scale: float,
    return_lse: bool,
    debug: bool,
    config: Union[tuple[int, int], dict, None],
    options: Optional[dict] = None,
):
    q_layout = TileLayout(problem.shape, q_tile, problem.dilation).to_3d()
    kv_layout = TileLayout(problem.shape, kv_tile, problem.dilation).to_3d()
    batch, heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
    for name, t, layout in (("q", q, q_layout), ("k", k, kv_layout), ("v", v, kv_layout)):
        if t.dim() != 4 or t.shape[1] != layout.num_tokens or t.shape[2] != heads or t.shape[3] != head_dim:
            raise ValueError(
                f"{name} must be permuted to [batch, {layout.num_tokens}, {heads}, {head_dim}] for "
                f"{problem} with tile {layout.tile[-problem.ndim:]}, got {name}.shape={tuple(t.shape)}."
            )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty((batch, q.shape[1], heads), dtype=torch.float32, device=q.device) if return_lse else out
    counts = torch.zeros((q_layout.num_tiles, 2), dtype=torch.int32, device=q.device) if debug else out
    masked = needs_mask(problem, q_tile, kv_tile)
    launch = launch_config(q_layout.tile_tokens, kv_layout.tile_tokens, head_dim, masked, _tma_ok(q, k, v, out),
                           specialize=not (return_lse or debug))
    if isinstance(config, dict):
        options = {**config, **(options or {})}
    elif config is not None:
        launch.update(num_warps=config[0], num_stages=config[1], WARP_SPECIALIZE=False)
    launch.update(options or {})
    if masked and not launch["MASKED"]:
        raise ValueError(f"{problem} with tiles {q_tile} / {kv_tile} visits partial or padded KV tiles: "
                         "the kernel needs MASKED=True.")
    if launch["USE_TMA"]:
        _ensure_allocator()
    head_major = launch.pop("HEAD_MAJOR", False)
    grid = (batch * heads, q_layout.num_tiles) if head_major else (q_layout.num_tiles, batch * heads)
    gna_forward_kernel[grid](
        q, k, v, out, lse, counts,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, scale * LOG2E,
        *q_layout.shape, *as_3d(problem.window), *as_3d(problem.stride), *q_layout.dilation,
        *q_layout.tiles_per_group, *kv_layout.tiles_per_group,
        *as_3d(problem.causal, False),
        *q_layout.tile, *kv_layout.tile,
        HEAD_DIM=head_dim, WRITE_LSE=return_lse, DEBUG=debug, HEAD_MAJOR=head_major,
        **launch,
    )
    return out, (lse if return_lse else None), (counts if debug else None)


def gna_attention_permuted(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    q_tile: Optional[IntOrInts] = None,
    kv_tile: Optional[IntOrInts] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    config: Union[tuple[int, int], dict, None] = None,
):
    """GNA on permuted `[B, tokens, heads, head_dim]` tensors; output (and `[B, tokens, heads]` LSE) permuted.

    `config=(num_warps, num_stages)` overrides the launch configuration (for tuning; no warp specialization);
    a dict overrides any of `launch_config`'s options (`num_warps`, `num_stages`, `USE_TMA`, `WARP_SPECIALIZE`,
    `MASKED`, which may only be forced on) and `HEAD_MAJOR` (grid over (batch * heads, Q tiles)).
    """
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a natsim.Problem, got {type(problem).__name__}.")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            "q, k and v must share dtype and device, got "
            f"dtypes ({q.dtype}, {k.dtype}, {v.dtype}), devices ({q.device}, {k.device}, {v.device})."
        )
    if not use_triton(q):
        raise ValueError(
            f"gna_attention_permuted runs the Triton kernel only: it needs CUDA tensors (or "
            f"TRITON_INTERPRET=1), got q.device={q.device}."
        )
    check_kernel_inputs(q)
    q_dims, kv_dims = kernel_tiles(problem, q_tile, kv_tile)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse, _ = _run_kernel(q, k, v, problem, q_dims, kv_dims, scale, return_lse, False, config)
    return (out, lse) if return_lse else out


def gna_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    scale: Optional[float] = None,
    q_tile: Optional[IntOrInts] = None,
    kv_tile: Optional[IntOrInts] = None,
    return_lse: bool = False,
):
    """Generalized Neighborhood Attention, forward, on `[B, *shape, heads, head_dim]` tensors (1 to 3 dims).

    Scalars broadcast over dimensions. `q_tile` / `kv_tile` are per-dimension tile shapes (defaults:
    128 / 128 tokens). Returns the output in q's layout, and with `return_lse` also the natural-log
    log-sum-exp `[B, *shape, heads]` in float32. Runs permute -> Triton kernel -> unpermute.
    """
    global _warned_cpu
    shape = check_qkv(q, k, v)
    problem = problem_of(shape, window, stride, dilation, causal)
    if not use_triton(q):
        if not _warned_cpu:
            warnings.warn(
                "gna_attention got CPU tensors: running the torch reference (exact but slow); "
                "use CUDA tensors for the Triton kernel.",
                stacklevel=2,
            )
            _warned_cpu = True
        return reference_attention(q, k, v, window, stride, dilation, causal, scale, return_lse)
    check_kernel_inputs(q)
    q_dims, kv_dims = kernel_tiles(problem, q_tile, kv_tile)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qp = permute(q, q_dims, problem.dilation)
    kp = permute(k, kv_dims, problem.dilation)
    vp = permute(v, kv_dims, problem.dilation)
    out, lse, _ = _run_kernel(qp, kp, vp, problem, q_dims, kv_dims, scale, return_lse, False, None)
    out = unpermute(out, shape, q_dims, problem.dilation)
    if not return_lse:
        return out
    lse = unpermute(lse[..., None], shape, q_dims, problem.dilation)[..., 0]
    return out, lse


def gna_tile_counts(
    shape: IntOrInts,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    q_tile: Optional[IntOrInts] = None,
    kv_tile: Optional[IntOrInts] = None,
    head_dim: int = 32,
    device: str = "cuda",
    dtype: torch.dtype = torch.float16,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the kernel with its debug counters on (random inputs, batch 1, one head).

    Returns `(visited, unmasked)`, one entry per Q tile in permuted order: the KV tiles the kernel visited
    and the KV tiles it ran without the window mask. Compare with `natsim.simulate(..., per_q_tile=True)`.
    """
    problem = Problem(shape, window, stride, dilation, causal)
    q_dims, kv_dims = kernel_tiles(problem, q_tile, kv_tile)
    q_tokens = TileLayout(problem.shape, q_dims, problem.dilation).num_tokens
    kv_tokens = TileLayout(problem.shape, kv_dims, problem.dilation).num_tokens
    q = torch.randn((1, q_tokens, 1, head_dim), device=device, dtype=dtype)
    k = torch.randn((1, kv_tokens, 1, head_dim), device=device, dtype=dtype)
    v = torch.randn((1, kv_tokens, 1, head_dim), device=device, dtype=dtype)
    check_kernel_inputs(q)
    _, _, counts = _run_kernel(q, k, v, problem, q_dims, kv_dims, head_dim**-0.5, False, True, None)
    counts = counts.cpu().numpy().astype(np.int64)
    return counts[:, 0], counts[:, 1]
