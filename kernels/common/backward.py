"""What the GNA and the sparse backward passes share: the softmax backward's row term, the per-pair gradient
steps of their dK/dV and dQ kernels, and launch options.

Both passes start from `delta = rowsum(dO * O) - dLSE` per query (a gradient flowing into the LSE output enters
here, since d lse / d score = p), written head-major (`[B, heads, tokens]`, as their attention kernels read it
and the LSE).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import LaunchOptions

DELTA_ROWS = 64


@triton.jit
def delta_kernel(O, DO, DLSE, DELTA, rows, tokens, heads, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_DLSE: tl.constexpr):
    """`delta = sum_d O * DO - DLSE` per row of `[B, tokens, heads, HEAD_DIM]` (`rows` of them, contiguous),
    written head-major (`[B, heads, tokens]`, as the attention kernels read it)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    inside = r < rows
    offsets = r.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    o = tl.load(O + offsets, mask=inside[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offsets, mask=inside[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + r, mask=inside, other=0.0)
    row = r // heads  # b * tokens + token
    head_major = ((row // tokens) * heads + r % heads).to(tl.int64) * tokens + row % tokens
    tl.store(DELTA + head_major, delta, mask=inside)


@triton.jit
def dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, keep, MASKED: tl.constexpr):
    """One (KV tile, Q tile) pair's contribution to the KV tile's dK (unscaled) and dV, and `ds^T` (`[keys,
    queries]`, for an atomic dQ): the probabilities recomputed from the natural-log LSE times log2(e) (`lse2`),
    `keep` (`[keys, queries]`) applied when MASKED."""
    qk = tl.dot(k, tl.trans(q))
    p = tl.math.exp2(qk * qk_scale - lse2[None, :])
    if MASKED:
        p = tl.where(keep, p, 0.0)
    dv = tl.dot(p.to(do.dtype), do, dv)
    dp = tl.dot(v, tl.trans(do))
    ds = (p * (dp - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds, q, dk)
    return dk, dv, ds



@triton.jit
def dq_step(dq, q, do, k, v, lse2, delta, qk_scale, keep, MASKED: tl.constexpr):
    """One (Q tile, KV tile) pair's contribution to the Q tile's dQ (unscaled); `keep` (`[queries, keys]`)
    applied when MASKED."""
    qk = tl.dot(q, tl.trans(k))
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASKED:
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


def softmax_delta(out: torch.Tensor, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor]) -> torch.Tensor:
    """`delta` `[B, heads, tokens]` (fp32) of contiguous `[B, tokens, heads, head_dim]` `out` and `grad_out`,
    with `grad_lse` `[B, tokens, heads]` (fp32, contiguous) or None."""
    batch, tokens, heads, head_dim = out.shape
    delta = torch.empty((batch, heads, tokens), dtype=torch.float32, device=out.device)
    rows = batch * tokens * heads
    delta_kernel[(triton.cdiv(rows, DELTA_ROWS),)](out, grad_out, delta if grad_lse is None else grad_lse, delta,
                                                 rows, tokens, heads, HEAD_DIM=head_dim, BLOCK=DELTA_ROWS,
                                                 HAS_DLSE=grad_lse is not None)
    return delta


def launch_options(block_m: int, block_n: int) -> LaunchOptions:
    """8 warps for tiles of 128 rows on either side, else 4; three pipeline stages (H100, bf16, head_dim 128: the
    GNA backward 3-21% faster than with two, benchmarks/results/backward-tma-*.json; the sparse backward sets its
    own, kernels/sparse/backward.py's STAGES). Every head_dim counts: at 4 warps the dK/dV kernel's two `[128 keys,
    head_dim]` fp32 accumulators and its `[128, 64]` score tiles spill 368 to 1940 bytes at head_dim 32, 64 and
    128 alike, at 8 warps 104-328 (sm_90, Triton 3.6; benchmarks/compile_backward.py --head-dim)."""
    return LaunchOptions(num_warps=8 if max(block_m, block_n) >= 128 else 4, num_stages=3)
