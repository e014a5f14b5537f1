"""The online-softmax step every attention kernel runs, in base 2 with fp32 accumulators.

Scores arrive raw; the softmax scale times log2(e) (`qk_scale`) is applied with one fused multiply-add per
score, and the running maximum `m_i` is kept in scaled units.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import P_OFFSET, cast_e4m3

LOG2E = 1.4426950408889634


@triton.jit
def softmax_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, CHUNK_B: tl.constexpr):
    """One online-softmax update with raw scores `qk` (scaled here) and values `v`, in head_dim's column chunks
    (kernels/common/headdim.py: `acc_b` and `v_b` only where CHUNK_B is not 0); `m_i` is scaled."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc_a = acc_a * alpha[:, None]
    acc_a = tl.dot(p.to(v_a.dtype), v_a, acc_a)
    if CHUNK_B > 0:
        acc_b = acc_b * alpha[:, None]
        acc_b = tl.dot(p.to(v_b.dtype), v_b, acc_b)
    return acc_a, acc_b, l_i, m_new


@triton.jit
def softmax_step_fp8(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, row_scale, EXACT_CAST: tl.constexpr,
                     CHUNK_B: tl.constexpr):
    """`softmax_step` for FP8 (kernels/common/fp8.py): `qk` already carries the keys' scales, `row_scale` is the
    softmax scale times log2(e) times each query's scale, and P goes to P @ V as e4m3 `448 * exp2(s - m)`
    (the offset joins the maximum; the sum counts the same unrounded values, so the 448 cancels in acc / l)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * row_scale)  # row scales are positive
    p = tl.math.exp2(qk * row_scale[:, None] - (m_new - P_OFFSET)[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p8 = cast_e4m3(p, EXACT_CAST)
    acc_a = acc_a * alpha[:, None]
    acc_a = tl.dot(p8, v_a, acc_a)
    if CHUNK_B > 0:
        acc_b = acc_b * alpha[:, None]
        acc_b = tl.dot(p8, v_b, acc_b)
    return acc_a, acc_b, l_i, m_new
