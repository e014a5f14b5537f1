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

from .devices import on_their_device
from .headdim import HeadSplit, chunked_dot, load_columns, next_power_of_two
from .launch import LaunchOptions, stages_that_fit

DELTA_ROWS = 64


@triton.jit
def delta_kernel(O, DO, DLSE, DELTA, rows, tokens, heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
    """`delta = sum_d O * DO - DLSE` per row of `[B, tokens, heads, HEAD_DIM]` (`rows` of them, contiguous),
    written head-major (`[B, heads, tokens]`, as the attention kernels read it); rows read `BLOCK_D` (head_dim's
    next power of two) columns, those past head_dim as zeros."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = r < rows
    o = load_columns(O, r.to(tl.int64) * HEAD_DIM, 0, BLOCK_D, HEAD_DIM, inside).to(tl.float32)
    do = load_columns(DO, r.to(tl.int64) * HEAD_DIM, 0, BLOCK_D, HEAD_DIM, inside).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + r, mask=inside, other=0.0)
    row = r // heads  # b * tokens + token
    head_major = ((row // tokens) * heads + r % heads).to(tl.int64) * tokens + row % tokens
    tl.store(DELTA + head_major, delta, mask=inside)


@triton.jit
def dkdv_step(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, q_a, q_b, do_a, do_b, lse2, delta, qk_scale, keep,
              MASKED: tl.constexpr, CHUNK_B: tl.constexpr):
    """One (KV tile, Q tile) pair's contribution to the KV tile's dK (unscaled) and dV, and `ds^T` (`[keys,
    queries]`, for an atomic dQ): the probabilities recomputed from the natural-log LSE times log2(e) (`lse2`),
    `keep` (`[keys, queries]`) applied when MASKED. Every `[rows, head_dim]` operand and gradient comes in
    head_dim's column chunks (kernels/common/headdim.py; the `_b` ones only where CHUNK_B is not 0)."""
    qk = chunked_dot(k_a, k_b, tl.trans(q_a), tl.trans(q_b), CHUNK_B)
    p = tl.math.exp2(qk * qk_scale - lse2[None, :])
    if MASKED:
        p = tl.where(keep, p, 0.0)
    dv_a = tl.dot(p.to(do_a.dtype), do_a, dv_a)
    if CHUNK_B > 0:
        dv_b = tl.dot(p.to(do_b.dtype), do_b, dv_b)
    dp = chunked_dot(v_a, v_b, tl.trans(do_a), tl.trans(do_b), CHUNK_B)
    ds = (p * (dp - delta[None, :])).to(q_a.dtype)
    dk_a = tl.dot(ds, q_a, dk_a)
    if CHUNK_B > 0:
        dk_b = tl.dot(ds, q_b, dk_b)
    return dk_a, dk_b, dv_a, dv_b, ds


@triton.jit
def dq_step(dq_a, dq_b, q_a, q_b, do_a, do_b, k_a, k_b, v_a, v_b, lse2, delta, qk_scale, keep,
            MASKED: tl.constexpr, CHUNK_B: tl.constexpr):
    """One (Q tile, KV tile) pair's contribution to the Q tile's dQ (unscaled), in head_dim's column chunks (as
    `dkdv_step`); `keep` (`[queries, keys]`) applied when MASKED."""
    qk = chunked_dot(q_a, q_b, tl.trans(k_a), tl.trans(k_b), CHUNK_B)
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASKED:
        p = tl.where(keep, p, 0.0)
    dp = chunked_dot(do_a, do_b, tl.trans(v_a), tl.trans(v_b), CHUNK_B)
    ds = (p * (dp - delta[:, None])).to(k_a.dtype)
    dq_a = tl.dot(ds, k_a, dq_a)
    if CHUNK_B > 0:
        dq_b = tl.dot(ds, k_b, dq_b)
    return dq_a, dq_b


@on_their_device
def softmax_delta(out: torch.Tensor, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor]) -> torch.Tensor:
    """`delta` `[B, heads, tokens]` (fp32) of contiguous `[B, tokens, heads, head_dim]` `out` and `grad_out`,
    with `grad_lse` `[B, tokens, heads]` (fp32, contiguous) or None."""
    batch, tokens, heads, head_dim = out.shape
    delta = torch.empty((batch, heads, tokens), dtype=torch.float32, device=out.device)
    rows = batch * tokens * heads
    delta_kernel[(triton.cdiv(rows, DELTA_ROWS),)](out, grad_out, delta if grad_lse is None else grad_lse, delta,
                                                 rows, tokens, heads, HEAD_DIM=head_dim,
                                                 BLOCK_D=next_power_of_two(head_dim), BLOCK=DELTA_ROWS,
                                                 HAS_DLSE=grad_lse is not None)
    return delta


def launch_options(block_m: int, block_n: int, split: HeadSplit) -> LaunchOptions:
    """8 warps for tiles of 128 rows on either side, or over 128 columns (`split.wide`, kernels/common/headdim.py),
    else 4; three pipeline stages (H100, bf16, head_dim 128: the GNA backward 3-21% faster than with two,
    benchmarks/results/backward-tma-*.json; the sparse backward sets its own, kernels/sparse/backward.py's STAGES)
    where the stepped tiles (two `[rows, width]` of the smaller side, 16-bit) fit in shared memory beside the
    program's own (two of the larger side), else fewer. Every head_dim counts: at 4 warps the dK/dV kernel's two
    `[128 keys, head_dim]` fp32 accumulators and its `[128, 64]` score tiles spill 368 to 1940 bytes at head_dim
    32, 64 and 128 alike, at 8 warps 104-328 (sm_90, Triton 3.6; benchmarks/compile_backward.py --head-dim). The
    options carry the chunks."""
    width = split.width
    stages = stages_that_fit(2 * 2 * max(block_m, block_n) * width, 2 * 2 * min(block_m, block_n) * width, 3)
    return LaunchOptions(num_warps=8 if max(block_m, block_n) >= 128 or split.wide else 4, num_stages=stages,
                         CHUNK_A=split.a, CHUNK_B=split.b)
