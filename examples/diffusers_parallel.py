"""A diffusers video transformer on several GPUs (diffusers' Ulysses context parallelism) attending through
natsim's GNA: a few generation steps, then a few fine-tuning steps, on a randomly initialised Wan transformer
(nothing is downloaded).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 examples/diffusers_parallel.py            # Wan 1.3B-sized, 480p
    torchrun --nproc_per_node 2 examples/diffusers_parallel.py --device cpu --layers 1 --heads 2 --head-dim 32 \\
        --latent 2x8x16 --window 1x3x3 --text 8                                               # CPUs (gloo), tiny

natsim is applied, then parallelism enabled (either order works): each rank's blocks hold `1 / P` of the tokens,
and every self-attention runs natsim's GNA on the rank's `heads / P` heads over the whole layout. Generation is
an Euler sampler of the flow-matching ODE; fine-tuning regresses the velocity `x1 - x0` from `(1 - t) x0 + t x1`
on random latents, the parameters' gradients summed over the ranks (what DistributedDataParallel does, written
out here). Before either, the first step is run in one process on the same inputs and the relative difference
printed.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time

import torch
import torch.distributed as dist


def parse(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split("x"))


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--latent", type=parse, default=(21, 60, 104),
                        help="latent frames x height x width (21x60x104: 480p; tokens are 1x2x2 patches)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--text", type=int, default=512, help="text tokens")
    parser.add_argument("--window", type=parse, default=None, help="GNA window (default: planned at --sparsity)")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=4, help="generation steps")
    parser.add_argument("--train-steps", type=int, default=2)
    return parser.parse_args(argv)


def build(args: argparse.Namespace, device: torch.device):
    """A Wan transformer of the given size, the same random parameters on every rank."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(num_attention_heads=args.heads, attention_head_dim=args.head_dim,
                                  num_layers=args.layers, text_dim=64, freq_dim=64,
                                  ffn_dim=4 * args.heads * args.head_dim)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(device, dtype)


def velocity(model, x: torch.Tensor, t: float, text: torch.Tensor) -> torch.Tensor:
    timestep = torch.full((x.shape[0],), 1000.0 * t, device=x.device)
    return model(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]


def generate(model, noise: torch.Tensor, text: torch.Tensor, steps: int) -> torch.Tensor:
    """Euler steps of the flow-matching ODE from noise (t = 1) towards data (t = 0)."""
    x = noise
    times = torch.linspace(1.0, 0.0, steps + 1).tolist()
    with torch.no_grad():
        for t, t_next in zip(times[:-1], times[1:]):
            x = x + (t_next - t) * velocity(model, x, t, text)
    return x


def finetune(model, args: argparse.Namespace, text: torch.Tensor, shape: tuple[int, ...]) -> list[float]:
    """Flow-matching steps on random latents (the same on every rank: diffusers splits the tokens itself)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(text.device).manual_seed(3)
    losses = []
    model.train()
    for _ in range(args.train_steps):
        x0, x1 = (torch.randn(shape, device=text.device, generator=generator, dtype=text.dtype) for _ in range(2))
        t = float(torch.rand((), generator=generator, device=text.device))
        loss = (velocity(model, (1 - t) * x0 + t * x1, t, text) - (x1 - x0)).float().square().mean()
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)  # each rank's tokens contributed their part: the sum is the whole gradient
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def run(args: argparse.Namespace) -> float:
    """Generation and fine-tuning on an initialised process group; returns the first step's relative difference
    against one process."""
    from diffusers import ContextParallelConfig

    from natsim.integrations import diffusers as nd

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model = build(args, device).eval()
    options = dict(window=args.window) if args.window else dict(sparsity=args.sparsity)
    applied = nd.apply(model, training=args.train_steps > 0, **options)

    generator = torch.Generator(device).manual_seed(1)  # the same inputs on every rank
    dtype = next(model.parameters()).dtype
    shape = (1, 16, *args.latent)
    noise = torch.randn(shape, device=device, generator=generator, dtype=dtype)
    text = torch.randn(1, args.text, 64, device=device, generator=generator, dtype=dtype)
    with torch.no_grad():
        one_process = velocity(model, noise, 1.0, text)  # before parallelism: every token on this rank

    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    with torch.no_grad():
        first = velocity(model, noise, 1.0, text)
    difference = float((first.float() - one_process.float()).norm() / one_process.float().norm())
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    latents = generate(model, noise, text, args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    losses = finetune(model, args, text, shape)
    if rank == 0:
        plan = next(iter(applied.plans.values()))
        print(f"{world} ranks, layout {tuple(applied.router.layout)}, GNA window {plan.problem.window} stride "
              f"{plan.problem.stride} on {plan.backend}; first step against one process: relative difference "
              f"{difference:.1e}")
        print(f"{args.steps} generation steps in {seconds:.2f} s (latent std {latents.float().std():.3f}); "
              f"fine-tuning losses {', '.join(f'{loss:.3f}' for loss in losses)}")
    return difference


def main(argv=None) -> None:
    args = arguments(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.accelerator.device_count = lambda: 1  # diffusers 0.42.1 without a GPU: its mesh's device index
    # diffusers 0.42.1's context-parallel hooks warn through `Logger.warning_once`, which only transformers (imported
    # by every pipeline, not by a bare transformer) defines.
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
