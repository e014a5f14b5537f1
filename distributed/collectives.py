"""The process group and the collectives natsim.distributed moves tokens with: world size and rank, the frames
each rank holds, refusals, and exact-size `all_to_all_single` and batched point-to-point exchanges (PyTorch's
own collectives: NCCL on GPUs, gloo on CPUs)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from natsim.partition import check_split


def world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("natsim.distributed needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group, e.g. under torchrun).")
    return dist.get_world_size(group), dist.get_rank(group)


def frame_split(local_frames: int, device: torch.device, group=None) -> tuple[int, ...]:
    """Frames held by every rank of `group`, all-gathered from each rank's `local_frames` (one collective;
    `device` is where the collective's tensors live: the GPU for NCCL)."""
    size, _ = world(group)
    mine = torch.tensor([local_frames], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(sizes, mine, group=group)
    return tuple(int(s.item()) for s in sizes)


def resolve_split(q: torch.Tensor, split: Optional[Sequence[int]], group) -> tuple[int, ...]:
    size, rank = world(group)
    if split is None:
        split = frame_split(q.shape[1], q.device, group)
    else:
        if len(split) != size:
            raise ValueError(f"split must give the frames of each of the {size} ranks, got split={tuple(split)}.")
        split = check_split(split, sum(int(n) for n in split))
    if split[rank] != q.shape[1]:
        raise ValueError(f"rank {rank} holds {q.shape[1]} frames (q.shape[1]) but split gives it {split[rank]}, "
                         f"got split={tuple(split)}.")
    return tuple(split)


GRADIENT_REFUSAL = (
    "natsim.distributed moves tensors with torch.distributed collectives, which autograd does not track, and "
    "q, k or v requires grad: the gradients would silently stop here. Call it under torch.no_grad() (or "
    "torch.inference_mode()) for inference; for training, gather the sequence and call "
    "natsim.kernels.gna_attention / sparse_attention on one device."
)


def refuse_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise when autograd would want gradients of q, k or v (no distributed backward yet)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise RuntimeError(GRADIENT_REFUSAL)


def check_heads(heads: int, world_size: int) -> None:
    if heads % world_size:
        raise ValueError(f"the ulysses strategy shards heads over the {world_size} ranks: heads must be divisible "
                         f"by the world size, got heads={heads}, world_size={world_size}.")


def exchange(send: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]], group,
              packed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rank j gets `send[j]`; returns what every rank sent here: one flat buffer and its pieces shaped
    `recv_shapes[j]` (views, in rank order). One `all_to_all_single` with exact per-peer sizes (gloo's list
    all_to_all needs equal shapes; this takes any). `packed`: the send pieces already laid out one after the
    other in rank order in this contiguous tensor (no copy)."""
    sizes_out = [t.numel() for t in send]
    sizes_in = [math.prod(shape) for shape in recv_shapes]
    if packed is None:
        packed = send[0].new_empty(sum(sizes_out))
        for piece, t in zip(packed.split(sizes_out), send):
            piece.view(t.shape).copy_(t)
    received = send[0].new_empty(sum(sizes_in))
    dist.all_to_all_single(received, packed.reshape(-1), sizes_in, sizes_out, group=group)
    return received, [piece.view(shape) for piece, shape in zip(received.split(sizes_in), recv_shapes)]


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))


def send_receive(sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]],
                  group) -> None:
    """Point-to-point: every `(tensor, rank)` of `sends` to that rank of `group`, every one of `receives` filled
    from it, batched (`batch_isend_irecv`); each pair of ranks lists its messages in the same order."""
    ops = [dist.P2POp(dist.isend, t, global_rank(peer, group), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank(peer, group), group) for t, peer in receives]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def global_rank(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
