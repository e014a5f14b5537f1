"""How tokens move for each context-parallel strategy.

Each rank of a process group holds a slab of frames of the token layout, `[B, T_r, *rest, heads, head_dim]`
with rank r holding frames `[t_r, t_{r+1})` of dimension 0 (uneven slabs allowed; the split is all-gathered
from the group or given), and gets back its frames of the output. Everything moves through PyTorch's own
collectives (NCCL on GPUs, gloo on CPUs): `all_to_all_single` and batched point-to-point with exact per-peer
sizes, nothing home-made.

- `"ulysses"` (DeepSpeed-Ulysses): all-to-all from frame-sharded to head-sharded full sequences, the
  single-GPU kernel on `heads / P` heads of the whole layout, all-to-all back. Heads must divide by P.
- `"halo"`: every rank keeps its heads and receives point-to-point (`batch_isend_irecv`), from the ranks that
  hold them, the key/value frames its queries' windows reach (natsim.partition.key_frames: GNA window bounds
  with stride, dilation and causal), then runs the kernel on its queries against that frame range
  (`gna_attention(..., frame_offsets=...)`: global window bounds). Under dilation along dimension 0 the
  frames received are the hull over the rank's dilation groups (exact, a few extra frames may travel).
- `"auto"`: the strategy whose slowest rank is predicted fastest by natsim.partition (per-rank tile work of
  the kernel's tiles, bytes moved, default rates); `natsim.planner.best(..., world_size=P)` ranks with a
  GPU's calibrated cost model instead.

`sparse_attention` shards heads the same way (Ulysses): head-parallel attention composes with any per-head
block mask, so each rank runs its heads of the mask over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from natsim import Problem
from natsim.partition import key_frames, offsets

from .collectives import exchange, overlap, send_receive


def ulysses(attend, q, k, v, split: tuple[int, ...], group) -> torch.Tensor:
    """All-to-all to head-sharded full sequences, `attend`, all-to-all back (tokens along dimension 1).

    With batch 1 the frames received from the ranks, in rank order, are the whole sequence as they land, and
    the output's frames for the ranks, in rank order, are the output itself: no copies but the head slices."""
    size, rank = len(split), dist.get_rank(group)
    batch, rest, h, head_dim = q.shape[0], q.shape[2:-2], q.shape[-2] // size, q.shape[-1]
    shapes = [(batch, n, *rest, h, head_dim) for n in split]
    whole = []
    for x in (q, k, v):
        received, parts = exchange([x[..., j * h:(j + 1) * h, :] for j in range(size)], shapes, group)
        whole.append(received.view(1, sum(split), *rest, h, head_dim) if batch == 1 else torch.cat(parts, dim=1))
    out = attend(*whole)  # [B, L, ..., h, D]
    t = offsets(split)
    send = [out.narrow(1, t[j], split[j]) for j in range(size)]
    packed = out if batch == 1 and out.is_contiguous() else None
    _, parts = exchange(send, [(batch, split[rank], *rest, h, head_dim)] * size, group, packed=packed)
    return torch.cat(parts, dim=-2)


def halo(kernel, problem: Problem, q, k, v, split: tuple[int, ...], rank: int, group) -> torch.Tensor:
    """Receive exactly the key/value frames this rank's queries reach, run the kernel on that frame range.

    The frames land in one `[2, B, frames, ...]` buffer (k, v): halo frames straight from the peers (for batch
    1 a frame range is contiguous; otherwise through a staging copy), this rank's own frames copied in while
    they travel."""
    t = offsets(split)
    own = (t[rank], t[rank + 1])
    need = [key_frames(problem, t[j], t[j + 1]) for j in range(len(split))]
    first, last = need[rank]
    keys = k.new_empty((2, k.shape[0], last - first, *k.shape[2:])) if split[rank] else None
    sends, receives, staged = [], [], []
    for j in range(len(split)):
        if j == rank:
            continue
        give = overlap(need[j], own)
        if give[1] > give[0]:
            sends += [(x[:, give[0] - own[0]:give[1] - own[0]].contiguous(), j) for x in (k, v)]
        take = overlap(need[rank], (t[j], t[j + 1]))
        if take[1] > take[0] and keys is not None:
            for view in keys[:, :, take[0] - first:take[1] - first]:
                buffer = view if view.is_contiguous() else torch.empty_like(view)
                receives.append((buffer, j))
                staged.append((view, buffer))
    if keys is None:  # no frames here: only send
        send_receive(sends, receives, group)
        return q.new_empty(q.shape)
    mine = overlap(need[rank], own)
    keys[0, :, mine[0] - first:mine[1] - first] = k[:, mine[0] - own[0]:mine[1] - own[0]]
    keys[1, :, mine[0] - first:mine[1] - first] = v[:, mine[0] - own[0]:mine[1] - own[0]]
    send_receive(sends, receives, group)
    for view, buffer in staged:
        if buffer is not view:
            view.copy_(buffer)
    return kernel(q, keys[0], keys[1], frame_offsets=(own[0], first, problem.shape[0]))
