"""The GNA window along one dimension, as the one `@triton.jit` helper every kernel uses.

It mirrors `natsim.window.window_bounds` line for line (gna-semantics.md, section 1); both are tested
against the same brute-force mask. `i` may be a scalar or a tensor of non-negative in-group coordinates.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def window_bounds(i, length, window, stride, CAUSAL: tl.constexpr):
    """Keys `[start, end)` attended by in-group coordinate(s) `i` on a group of `length` tokens."""
    if CAUSAL:
        leader = tl.minimum((i // stride) * stride + stride - 1, length - 1)
        start = tl.maximum(leader - window + 1, 0)
        end = tl.minimum(i + 1, length)
    else:
        leader = tl.minimum((i // stride) * stride + stride // 2, length - 1)
        start = tl.minimum(tl.maximum(leader - window // 2, 0), length - window)
        end = start + window
    return start, end
