"""GNA's element mask on tokens in tile order, written once over an arithmetic namespace so that the same code
runs as numpy (CPU tests against the brute-force mask) and as CuTe DSL (FlashAttention-4's `mask_mod`, for the
tiles of a GNA plan that are partial).

FlashAttention-4 sees q, k and v in one token order, the Q tile's (kernels/gna/layout.py: dilation groups, then
tiles, then tokens inside a tile, row-major at every level); its key blocks are runs of KV-tile size in that
order (kernels/fa4/lists.py). A query row `q_idx` and a key column `kv_idx` are decoded into (dilation group,
in-group coordinate) per dimension, and the pair is attended exactly when both are in the same group and, along
every dimension, the key lies in the query's window: the window bounds of natsim/window.py (gna-semantics.md,
section 1), whose `np.minimum` / `np.clip` become `where` selections. Every layout constant is a Python int, so
the kernel compiles them in (divisions by powers of two become shifts). Padding keys (in-group coordinate past
the group's length) are never attended; padding queries attend their clamped window, and their rows are dropped
by the unpermutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from natsim import Problem

from ..gna.layout import TileLayout


@dataclass(frozen=True)
class Arithmetic:
    """The operations the mask needs beyond `+ - * // % < <= == &`: `where(cond, a, b)` and `const(int)`, which
    turns a Python int into the namespace's integer value (numpy: itself; CuTe: an Int32 SSA value)."""

    where: Callable[[Any, Any, Any], Any]
    const: Callable[[int], Any]


NUMPY = Arithmetic(where=np.where, const=lambda value: np.int64(value))


def decode(layout: TileLayout, p, ops: Arithmetic) -> tuple[list, list]:
    """Position(s) `p` of `layout`'s token order -> (per-dimension dilation group, per-dimension in-group
    coordinate), the inverse of kernels/gna/layout.py's numbering."""
    c = ops.const
    per_group = layout.tiles_per_group
    inner, tile = p % c(layout.tile_tokens), p // c(layout.tile_tokens)
    group, tile = tile // c(math.prod(per_group)), tile % c(math.prod(per_group))
    groups, coords = [], []
    for i in range(len(layout.shape)):
        t = (tile // c(math.prod(per_group[i + 1:]))) % c(per_group[i])
        r = (inner // c(math.prod(layout.tile[i + 1:]))) % c(layout.tile[i])
        groups.append((group // c(math.prod(layout.dilation[i + 1:]))) % c(layout.dilation[i]))
        coords.append(t * c(layout.tile[i]) + r)
    return groups, coords


def _group_length(length: int, dilation: int, group, ops: Arithmetic):
    """Length of dilation group `group` (natsim.window.group_length, for SSA values too)."""
    base, extra = length // dilation, length % dilation
    if extra == 0:
        return ops.const(base)
    return ops.where(group < ops.const(extra), ops.const(base + 1), ops.const(base))


def _window(i, length, window: int, stride: int, causal: bool, ops: Arithmetic):
    """natsim.window.window_bounds with `where` for minimum and maximum: `[start, end)` of coordinate(s) `i`."""
    c = ops.const

    def lesser(a, b):
        return ops.where(a < b, a, b)

    def greater(a, b):
        return ops.where(a < b, b, a)

    if causal:
        leader = lesser((i // c(stride)) * c(stride) + c(stride - 1), length - c(1))
        return greater(leader - c(window - 1), c(0)), lesser(i + c(1), length)
    leader = lesser((i // c(stride)) * c(stride) + c(stride // 2), length - c(1))
    start = lesser(greater(leader - c(window // 2), c(0)), length - c(window))
    return start, start + c(window)


@dataclass(frozen=True)
class GnaMask:
    """GNA's mask between the tokens of `problem` in `tile` order (queries and keys alike)."""

    problem: Problem
    tile: tuple[int, ...]

    @property
    def layout(self) -> TileLayout:
        """The token order both queries and keys are in."""
        return TileLayout(self.problem.shape, self.tile, self.problem.dilation)

    def windows(self, q_idx, ops: Arithmetic = NUMPY) -> list:
        """Per dimension, `(group, start, end)` of query row(s) `q_idx`: its dilation group and the in-group
        coordinates `[start, end)` of its window there. A key is attended when, along every dimension, it is of
        that group and its in-group coordinate is in that range."""
        p = self.problem
        q_groups, q_coords = decode(self.layout, q_idx, ops)
        windows = []
        for i in range(p.ndim):
            length = _group_length(p.shape[i], p.dilation[i], q_groups[i], ops)
            windows.append((q_groups[i], *_window(q_coords[i], length, p.window[i], p.stride[i], p.causal[i], ops)))
        return windows

    def allowed(self, q_idx, kv_idx, ops: Arithmetic = NUMPY):
        """Whether query row(s) `q_idx` attend key column(s) `kv_idx` (broadcasting like the namespace's
        arithmetic)."""
        k_groups, k_coords = decode(self.layout, kv_idx, ops)
        result = None
        for i, (group, start, end) in enumerate(self.windows(q_idx, ops)):
            inside = (start <= k_coords[i]) & (k_coords[i] < end)
            if self.problem.dilation[i] > 1:
                inside = inside & (group == k_groups[i])
            result = inside if result is None else result & inside
        return result

    def dense(self) -> np.ndarray:
        """The whole mask as a boolean `[tokens, tokens]` array in tile order (small problems: tests)."""
        positions = np.arange(self.layout.num_tokens)
        return self.allowed(positions[:, None], positions[None, :])
