"""Context-parallel GNA: the video's frames sharded over the ranks of a torchrun job, each rank gets its frames.

    torchrun --nproc-per-node 2 examples/distributed.py            # CPUs (gloo) or GPUs (NCCL), as available

Every rank makes the same random q, k, v (one seed) and keeps its frames, plans the configuration for
`world_size` ranks (strategy and frame split included), runs it, and checks its output frames against the
single-process reference on the whole layout.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from natsim.kernels import reference_attention
from natsim.planner import best


def main(shape=(8, 8, 16), sparsity=0.6, heads=4, head_dim=32) -> float:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)

    plan = best(shape, sparsity, heads=heads, head_dim=head_dim, world_size=world)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, *shape, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    first = sum(plan.split[:rank])
    frames = slice(first, first + plan.split[rank])  # this rank's frames along the first dimension

    out = plan(q[:, frames], k[:, frames], v[:, frames])  # [1, frames of this rank, 8, 16, heads, head_dim]

    p = plan.problem
    expected = reference_attention(q.double(), k.double(), v.double(), p.window, p.stride, p.dilation,
                                   p.causal)[:, frames]
    error = float((out.double() - expected).norm() / expected.norm())
    print(f"rank {rank}/{world}: frames {frames.start}-{frames.stop} of {shape[0]}, strategy {plan.strategy}, "
          f"window {p.window}, stride {p.stride}; relative error against the reference {error:.1e}")
    dist.destroy_process_group()
    return error


if __name__ == "__main__":
    main()
