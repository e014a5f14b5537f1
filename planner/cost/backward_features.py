"""The cost model's features for the GNA backward pass, from the simulator's KV-major counts.

The backward (natsim.kernels.gna.backward, through `natsim::gna_backward`) runs on tiles of its own,
`backward_tiles(problem, head_dim)`, whatever tiles the forward ran: dense attention as 1-D over the flattened
layout (`dense_as_1d`), as the forward does. It reads and writes the caller's layout in place: the delta pass,
the dK/dV kernel (one program per KV tile over the Q tiles that visit it), and the dQ kernel on the mirrored
tiles (one program per 128-query tile over 64-key tiles, as the forward), or, with ATOMIC_DQ, dQ by atomics
in the dK/dV kernel. One row per call, one column per feature (batch and heads multiply everything but
`launch`):

| feature | unit | what it counts |
|---|---|---|
| `full_flops` | FLOP | 2 * T_Q * T_KV * head_dim per tile product of full (Q tile, KV tile) pairs: the dK/dV kernel's four products per pair (five with ATOMIC_DQ), the dQ kernel's three per pair of its mirrored tiles |
| `masked_flops` | FLOP | the same for pairs that run under the element mask (only where a kernel compiles it: `needs_mask`) |
| `pair_visits` | pair | iterations of the kernels' loops: the dK/dV kernel's visited pairs (`natsim.simulate_backward`'s) plus the dQ kernel's (`natsim.simulate` on the mirrored tiles) |
| `programs` | program | programs launched (padding tiles included): the dK/dV kernel's KV tiles (loading K and V, storing dK and dV) and the dQ kernel's Q tiles (none with ATOMIC_DQ) |
| `memory_bytes` | byte | outside the attention kernels: the delta pass (out and dO read, delta written), the LSE made head-major, and with ATOMIC_DQ the fp32 dQ zeroed and converted |
| `launch` | call | 1: launches and host overhead per call |

`backward_tile_work` is the same call in the planner's unit without a cost model: forward-equivalent token
pairs, each backward pair counting its tile products over the forward kernel's 2 (QK^T and PV).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from natsim import Problem, TileConfig, simulate
from natsim.kernels.backends.triton import (DEFAULT_VARIANT, DKDV_PRODUCTS, DQ_PRODUCTS, backward_tiles, dense_as_1d,
                                           needs_mask)

from .features import padded_tokens

BACKWARD_FEATURES = ("full_flops", "masked_flops", "pair_visits", "programs", "memory_bytes", "launch")
FORWARD_TILE_PRODUCTS = 2  # QK^T and PV per visited pair in the forward kernel
LSE_BYTES = 4  # fp32 statistics: the LSE and delta per query
DQ_ACCUMULATOR_BYTES = 4  # ATOMIC_DQ sums dQ in fp32


@dataclass(frozen=True)
class BackwardWork:
    """What the backward runs for one problem (batch 1, one head): its tiles, whether its kernels compile the
    mask, the simulated pair counts of the dK/dV kernel (KV-major, on the backward's tiles) and of the dQ
    kernel (Q-major, on the mirrored tiles), programs launched and the padded lengths of its tiles."""

    problem: Problem  # as the kernels see it: dense attention flattened to 1-D
    q_tile: tuple[int, ...]
    kv_tile: tuple[int, ...]
    masked: bool
    visited_pairs: int
    full_pairs: int
    q_padded: int
    kv_padded: int
    dq_masked: bool  # the dQ kernel's mask switch on its mirrored tiles
    dq_visited_pairs: int
    dq_full_pairs: int

    @property
    def q_tokens(self) -> int:
        return math.prod(self.q_tile)

    @property
    def kv_tokens(self) -> int:
        return math.prod(self.kv_tile)

    @property
    def dkdv_programs(self) -> int:
        return self.kv_padded // self.kv_tokens

    @property
    def dq_programs(self) -> int:
        """The dQ kernel's programs: its Q tiles are the KV tile's shape (the mirrored tiles)."""
        return self.kv_padded // self.kv_tokens


@functools.lru_cache(maxsize=16384)
def backward_work(problem: Problem, head_dim: int) -> BackwardWork:
    """The backward's work for `problem` at `head_dim`, as `natsim::gna_backward` runs it (default tiles).

    The dK/dV kernel's pair totals are `natsim.simulate_backward`'s (the KV-major view holds the same pairs as
    the Q-major one, and the tests hold them equal), taken from the vectorised `natsim.simulate`: the KV-major
    loop takes seconds on a dense 1-D layout of 100k tokens, and the cost model needs totals only. Kept per
    (problem, head_dim): choosing the backward's tiles simulates every candidate pair, and a training search
    asks for the same thousand (window, stride) problems on every call for a layout.
    """
    kernel_problem = dense_as_1d(problem) or problem
    return _backward_work(kernel_problem, *backward_tiles(kernel_problem, head_dim))


@functools.lru_cache(maxsize=4096)
def _backward_work(kernel_problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...]) -> BackwardWork:
    counts = simulate(kernel_problem, TileConfig(q_tile, kv_tile))
    mirrored = simulate(kernel_problem, TileConfig(kv_tile, q_tile))
    return BackwardWork(
        problem=kernel_problem,
        q_tile=q_tile,
        kv_tile=kv_tile,
        masked=needs_mask(kernel_problem, q_tile, kv_tile),
        visited_pairs=counts.visited_tiles,
        full_pairs=counts.full_tiles,
        q_padded=padded_tokens(kernel_problem.shape, q_tile, kernel_problem.dilation),
        kv_padded=padded_tokens(kernel_problem.shape, kv_tile, kernel_problem.dilation),
        dq_masked=needs_mask(kernel_problem, kv_tile, q_tile),
        dq_visited_pairs=mirrored.visited_tiles,
        dq_full_pairs=mirrored.full_tiles,
    )


def kernel_pairs(work: BackwardWork, atomic_dq: Optional[bool] = None) -> list[tuple[int, int, bool, int]]:
    """`(visited, full, masked, tile products)` per backward kernel that runs (the default variant's, read now,
    unless told): the dK/dV kernel, and the dQ kernel on the mirrored tiles unless dQ is summed by atomics."""
    atomic = bool(DEFAULT_VARIANT.get("ATOMIC_DQ", False)) if atomic_dq is None else atomic_dq
    kernels = [(work.visited_pairs, work.full_pairs, work.masked, DKDV_PRODUCTS + int(atomic))]  # + ds^T k
    if not atomic:
        kernels.append((work.dq_visited_pairs, work.dq_full_pairs, work.dq_masked, DQ_PRODUCTS))
    return kernels


def backward_features(work: BackwardWork, *, batch_heads: int, head_dim: int, element_bytes: int) -> np.ndarray:
    """The feature row (BACKWARD_FEATURES order) of one backward call of `work` on `batch_heads` heads."""
    atomic = bool(DEFAULT_VARIANT.get("ATOMIC_DQ", False))
    product_flops = 2.0 * work.q_tokens * work.kv_tokens * head_dim * batch_heads
    full_flops = masked_flops = visits = 0.0
    for visited, full, masked, products in kernel_pairs(work, atomic):
        full = full if masked else visited
        full_flops += full * products * product_flops
        masked_flops += (visited - full) * products * product_flops
        visits += visited
    tokens = work.problem.num_tokens
    row = head_dim * element_bytes
    moved = 2 * tokens * row + 3 * tokens * LSE_BYTES  # delta pass (out, dO in; delta out), LSE head-major
    if atomic:  # dq in fp32: zeroed, then read and written in q's dtype
        moved += tokens * head_dim * 2 * DQ_ACCUMULATOR_BYTES + tokens * row
    return np.array([
        full_flops,
        masked_flops,
        float(visits * batch_heads),
        float((work.dkdv_programs + (0 if atomic else work.dq_programs)) * batch_heads),
        float(moved * batch_heads),
        1.0,
    ])


def backward_tile_work(work: BackwardWork) -> float:
    """The backward in forward-equivalent token pairs (one head): each kernel's visited pairs' Q x KV tokens,
    times its tile products over the forward's (the planner's score without a cost model, added to the
    forward's)."""
    products = sum(visited * count for visited, _, _, count in kernel_pairs(work))
    return products * work.q_tokens * work.kv_tokens / FORWARD_TILE_PRODUCTS
