"""Public entry points of GNA attention: layout in, layout out, with the permutation fused around the kernel.

- `gna_attention(q, k, v, window, ...)`: `[B, *shape, heads, head_dim]` in and out.
- `gna_attention_permuted(q, k, v, problem, q_tile, kv_tile, ...)`: tensors already permuted
  (kernels/permute.py), q with `q_tile`, k and v with `kv_tile`; output in q's permuted order.
- `gna_tile_counts(...)`: runs the kernel with its debug counters on and returns, per Q tile, the KV tiles
  visited and the KV tiles run without the window mask.

On CPU tensors (without TRITON_INTERPRET=1) `gna_attention` runs `reference_attention` and warns once.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np
import torch

from natsim import Problem

from .backend import use_triton
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


def launch_config(block_m: int, block_n: int, head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) for a tile of `block_m` queries, `block_n` keys and `head_dim`.

    Three pipeline stages of K and V (16-bit) when they fit beside Q in shared memory, else two.
    """
    num_warps = 8 if block_m * head_dim >= 128 * 128 else 4
    q_bytes, kv_bytes = 2 * block_m * head_dim, 2 * 2 * block_n * head_dim
    num_stages = 3 if q_bytes + 3 * kv_bytes <= SHARED_MEMORY_BUDGET else 2
    return num_warps, num_stages


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
    config: Optional[tuple[int, int]],
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
    num_warps, num_stages = config or launch_config(q_layout.tile_tokens, kv_layout.tile_tokens, head_dim)
    grid = (q_layout.num_tiles, batch * heads)
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
        HEAD_DIM=head_dim, WRITE_LSE=return_lse, DEBUG=debug,
        num_warps=num_warps, num_stages=num_stages,
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
    config: Optional[tuple[int, int]] = None,
):
    """GNA on permuted `[B, tokens, heads, head_dim]` tensors; output (and `[B, tokens, heads]` LSE) permuted.

    `config=(num_warps, num_stages)` overrides the launch configuration (for tuning).
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
