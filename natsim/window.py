"""The GNA window along one dimension: the single Python definition (gna-semantics.md, section 1).

The Triton kernels carry one `@triton.jit` twin of `window_bounds`; both are tested against the same
brute-force mask.
"""

from __future__ import annotations

import numpy as np


def group_length(length: int, dilation: int, group: int) -> int:
    """Length of dilation group `group` (coordinates group, group + d, ...) of a dimension."""
    return length // dilation + (1 if group < length % dilation else 0)


def window_bounds(i, length: int, window: int, stride: int, causal: bool):
    """Keys `[start, end)` attended by in-group coordinate(s) `i` on a group of `length` tokens.

    Works on ints and on integer numpy arrays alike. `start` and `end` never decrease as `i` grows.
    """
    if causal:
        leader = np.minimum((i // stride) * stride + stride - 1, length - 1)
        start = np.maximum(leader - window + 1, 0)
        end = np.minimum(i + 1, length)
    else:
        left = window // 2
        leader = np.minimum((i // stride) * stride + stride // 2, length - 1)
        start = np.clip(leader - left, 0, length - window)
        end = start + window
    return start, end
