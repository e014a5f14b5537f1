"""Fine-tuning with GNA over natsim.distributed: a video's frames sharded over the ranks of a torchrun job.

    torchrun --nproc_per_node 2 examples/distributed_training.py --device cpu                # CPUs (gloo)
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 4 examples/distributed_training.py --device cuda \\
        --shape 30x48x80 --heads 24 --head-dim 128 --window 18x24x24 --stride 16x8x8         # GPUs (NCCL)

A small transformer block (its attention GNA through natsim.distributed, then an MLP) learns flow matching on
random latents: each step draws a batch of "videos" x1 and noise x0, a time t per sample, and regresses the
velocity x1 - x0 from (1 - t) x0 + t x1. Every rank holds its frames of every sample (the layout sharded along
its first dimension); attention reaches across ranks, its backward runs the adjoint collectives, and the
parameters' gradients are summed over the ranks (what DistributedDataParallel does, written out here).

Before training, one step's gradients are checked against the same step on one process (the whole sequence,
natsim.kernels.gna_attention): the relative error is printed.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import natsim.distributed as nd
from natsim.kernels import gna_attention
from natsim.partition import even_split


class Block(torch.nn.Module):
    """A transformer block over `[B, *layout, dim]` tokens: GNA with a time embedding, then an MLP.
    `attention` is `natsim.distributed.gna_attention` (this rank's frames) or `natsim.kernels.gna_attention`
    (the whole layout); both take the same GNA arguments."""

    def __init__(self, dim: int, heads: int, gna: dict):
        super().__init__()
        self.heads, self.gna = heads, gna
        self.time = torch.nn.Linear(1, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor, attention) -> torch.Tensor:
        x = x + self.time(t.view(-1, *[1] * (x.dim() - 1)))
        q, k, v = self.qkv(F.layer_norm(x, x.shape[-1:])).unflatten(-1, (3, self.heads, -1)).unbind(-3)
        x = x + self.out(attention(q, k, v, **self.gna).flatten(-2))
        return x + self.mlp(F.layer_norm(x, x.shape[-1:]))


def flow_matching_loss(model: Block, x0, x1, t, attention, tokens: int) -> torch.Tensor:
    """Squared error of the predicted velocity, summed over the tokens given and divided by `tokens` (all ranks'
    tokens: the ranks' losses add up to the mean over the whole batch)."""
    tt = t.view(-1, *[1] * (x0.dim() - 1))
    xt = (1 - tt) * x0 + tt * x1
    return (model(xt, t, attention) - (x1 - x0)).float().square().sum() / tokens


def check_against_one_process(model: Block, x0, x1, t, split, tokens: int, autocast: bool) -> float:
    """The largest relative error of the parameters' gradients (summed over the ranks) against one process
    running the same loss on the whole sequence, the frames gathered from the ranks; the gradients are left as
    they were."""
    whole = []
    for x in (x0, x1):  # all_gather takes equal sizes: each rank's frames padded to the most any rank holds
        padded = x.new_zeros((x.shape[0], max(split), *x.shape[2:]))
        padded[:, :x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in split]
        dist.all_gather(parts, padded)
        whole.append(torch.cat([part[:, :n] for part, n in zip(parts, split)], dim=1))
    sharded = [p.grad for p in model.parameters()]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = flow_matching_loss(model, *whole, t, gna_attention, tokens)
    expected = torch.autograd.grad(loss, list(model.parameters()))
    return max(float((g - e).norm() / e.norm()) for g, e in zip(sharded, expected))


def parse(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split("x"))


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=parse, default=(8, 6, 6), help="token layout, frames first (8x6x6)")
    parser.add_argument("--window", type=parse, default=(5, 3, 3))
    parser.add_argument("--stride", type=parse, default=(1, 1, 1))
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", choices=("auto", "ulysses", "halo"), default="auto")
    parser.add_argument("--compile", action="store_true", help="torch.compile the block (fullgraph)")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> float:
    """The training loop on an initialised process group; returns the first step's gradient check (relative
    error against one process)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    split = even_split(args.shape[0], world)
    frames = (split[rank], *args.shape[1:])  # this rank's part of the layout
    dim, tokens = args.heads * args.head_dim, args.batch * torch.Size(args.shape).numel()

    torch.manual_seed(0)  # the same parameters on every rank
    model = Block(dim, args.heads, dict(window=args.window, stride=args.stride)).to(device)
    if args.compile:
        model.compile(fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attention = functools.partial(nd.gna_attention, strategy=args.strategy, split=split)
    noise = torch.Generator(device).manual_seed(1 + rank)  # each rank draws its own frames ...
    shared = torch.Generator(device).manual_seed(0)  # ... and all ranks the same times
    error, losses = float("nan"), []
    for step in range(args.steps):
        x0, x1 = (torch.randn(args.batch, *frames, dim, device=device, generator=noise) for _ in range(2))
        t = torch.rand(args.batch, device=device, generator=shared)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = flow_matching_loss(model, x0, x1, t, attention, tokens)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the sum over ranks: the gradient of the whole batch's loss
        if step == 0:
            error = check_against_one_process(model, x0, x1, t, split, tokens, cuda)
            print(f"rank {rank}/{world}: frames {sum(split[:rank])}-{sum(split[:rank + 1])} of {args.shape[0]}; "
                  f"gradients against one process: relative error {error:.1e}")
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if (step + 1) % 5 == 0:
            recent = torch.stack(losses[-5:]).mean()
            dist.all_reduce(recent)  # the ranks' parts of the loss add up to the batch's
            if rank == 0:
                print(f"steps {step - 3}-{step + 1}: flow-matching loss {recent.item():.3f}")
    return error


def main(argv=None) -> None:
    args = arguments(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
