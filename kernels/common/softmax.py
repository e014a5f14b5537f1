"""The online-softmax step every attention kernel runs, in base 2 with fp32 accumulators.

Scores arrive raw; the softmax scale times log2(e) (`qk_scale`) is applied with one fused multiply-add per
score, and the running maximum `m_i` is kept in scaled units.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def softmax_step(acc, l_i, m_i, qk, v, qk_scale):
    """One online-softmax update with raw scores `qk` (scaled here) and values `v`; `m_i` is scaled."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new
