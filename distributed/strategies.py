"""How tokens move for each context-parallel strategy.

Each rank of a process group holds a slab of frames of the token layout, `[B, T_r, *rest, heads, head_dim]`
with rank r holding frames `[t_r, t_{r+1})` of dimension 0 (uneven slabs allowed; the split is all-gathered
from the group or given), and gets back its frames of the output. Everything moves through PyTorch's own
collectives (NCCL on GPUs, gloo on CPUs): `all_to_all_single` and batched point-to-point with exact per-peer
sizes, nothing home-made.

- `"ulysses"` (DeepSpeed-Ulysses): all-to-all from frame-sharded to head-sharded full sequences, the
  single-GPU kernel on `ceil(heads / P)` heads of the whole layout, all-to-all back (where P does not divide the
  heads they are padded with zero heads, not placed back; under a block mask they take the last head's mask).
  It runs in groups of heads, transfers overlapped with attention (pipeline.py).
- `"halo"`: every rank keeps its heads and receives point-to-point (`batch_isend_irecv`), from the ranks that
  hold them, the key/value frames its queries' windows reach (natsim.partition.key_frames: GNA window bounds
  with stride, dilation and causal), then runs the kernel on its queries against that frame range
  (`gna_attention(..., frame_offsets=...)`: global window bounds). Under dilation along dimension 0 the
  frames received are the hull over the rank's dilation groups (exact, a few extra frames may travel). Where
  gradients are needed on the GPU kernels, which have no backward on frame ranges, it runs the gathered frames
  as a layout of their own (`trains_on_gathered_frames` says where that is exact).
- `"auto"`: the strategy whose slowest rank is predicted fastest by natsim.partition (per-rank tile work of
  the kernel's tiles, bytes moved, default rates); `natsim.planner.best(..., world_size=P)` ranks with a
  GPU's calibrated cost model instead.

`sparse_attention` shards heads the same way (Ulysses): head-parallel attention composes with any per-head
block mask, so each rank runs its heads of the mask over the whole sequence. This module holds the halo exchange's
routes and call; Ulysses is pipeline.py.
"""

from __future__ import annotations

import functools

import torch

from natsim import Problem
from natsim.kernels import constant_of_the_graph
from natsim.partition import key_frames, offsets

from .collectives import HaloRoutes, overlap
from .ops import gather_halo


def halo_routes(problem: Problem, split: tuple[int, ...], rank: int) -> HaloRoutes:
    """The frames `rank` gathers (the key frames its queries reach) and those it sends to and receives from each
    peer (natsim.partition.key_frames: GNA window bounds with stride, dilation and causal)."""
    t = offsets(split)
    own = (t[rank], t[rank + 1])
    need = [key_frames(problem, t[j], t[j + 1]) for j in range(len(split))]
    sends, receives = [], []
    for j in range(len(split)):
        if j == rank:
            continue
        give, take = overlap(need[j], own), overlap(need[rank], (t[j], t[j + 1]))
        if give[1] > give[0]:
            sends.append((j, *give))
        if take[1] > take[0]:
            receives.append((j, *take))
    return HaloRoutes(own, need[rank], tuple(sends), tuple(receives))


@functools.lru_cache(maxsize=256)
@constant_of_the_graph
def _routes(frames: tuple[int, int, int, int, bool], split: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """`halo_routes` along dimension 0 of length, window, stride, dilation and causal `frames`, as plain ints
    (`HaloRoutes.as_ints`), kept per distinct call: host arithmetic that torch.compile runs while tracing (a
    constant of the graph) instead of tracing its numpy."""
    return tuple(halo_routes(Problem(frames[:1], *frames[1:]), split, rank).as_ints())


def trains_on_gathered_frames(problem: Problem) -> bool:
    """Whether GNA of `problem` on a rank's gathered frames taken as a layout of their own gives its queries the
    windows they have in the whole layout: with stride 1, dilation 1 and no causal window along dimension 0. A
    query's window starts at its frame less a constant, clamped to the layout; the gathered frames hold every
    frame its window reaches, and they start at frame 0 (end at the last frame) exactly where the window is
    clamped there, so the clamps agree. A stride or dilation along dimension 0 groups frames by their index
    in the whole layout, and a causal window may reach fewer frames than it is long, which the gathered frames'
    layout would not take."""
    return problem.stride[0] == 1 and problem.dilation[0] == 1 and not problem.causal[0]


def halo(kernel, problem: Problem, q, k, v, split: tuple[int, ...], rank: int, group,
         on_gathered_frames: bool = False) -> torch.Tensor:
    """Gather exactly the key/value frames this rank's queries reach, run the kernel on that frame range.
    Differentiable when the kernel on frame ranges is: the backward returns the halo frames' gradients to the
    ranks that hold them (ops.py). `on_gathered_frames` (where `trains_on_gathered_frames`): the kernel runs
    the gathered frames as a layout of their own instead, the rank's queries in place and zeros on the other
    frames' rows, whose outputs are dropped; it costs those rows' work, and trains wherever the single-GPU call
    does (GNA on frame ranges has no backward kernel)."""
    routes = HaloRoutes.from_ints(_routes((problem.shape[0], problem.window[0], problem.stride[0],
                                           problem.dilation[0], problem.causal[0]), split, rank))
    keys, values = gather_halo(k, v, routes, group)
    if not split[rank]:  # no queries here: an empty output, tied to q, k and v for autograd as any rank's is
        return q + (keys.sum() + values.sum())
    if on_gathered_frames:
        (own, own_end), (first, last) = routes.own, routes.keys
        rows = [q.new_zeros((q.shape[0], own - first, *q.shape[2:])), q,
                q.new_zeros((q.shape[0], last - own_end, *q.shape[2:]))]
        return kernel(torch.cat(rows, dim=1), keys, values)[:, own - first:own_end - first]
    return kernel(q, keys, values, frame_offsets=(routes.own[0], routes.keys[0], problem.shape[0]))
