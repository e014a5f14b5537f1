"""A denoising step of a Wan 1.3B-sized transformer on P GPUs under diffusers' Ulysses context parallelism, with
natsim's GNA and with the model's own (dense) attention, compiled, one JSON per launch:

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/diffusers_parallel.py --out DIR [--latent 21x90x160]
    torchrun --nproc_per_node 1 benchmarks/diffusers_parallel.py --out DIR      # the one-GPU baseline
    torchrun --nproc_per_node 2 benchmarks/diffusers_parallel.py --out /tmp/x --small   # CPUs (gloo), tiny

Wan 1.3B's published configuration with random weights (nothing is downloaded), bf16, batch 1, 512 text tokens,
at 720p (latent 21x90x160, token layout 21x45x80) by default. For each mode ("natsim": `apply(model,
sparsity=0.9)`, then `enable_parallelism`, each rank's heads attended in natsim.distributed's default groups;
"natsim-serial": the same with its heads in one group, the all-to-alls not overlapped; "natsim-groupsK": up to K
groups (`natsim.partition.MAX_DEFAULT_CHUNKS`, 3 by default); "dense": the model's own
attention, diffusers' Ulysses when P > 1) the model's blocks are compiled (`compile_repeated_blocks(
fullgraph=True)`) and the median of `--steps` synchronised steps after warm-up is taken (every rank times the
step; the slowest rank's median is recorded). natsim's step output under parallelism is held against the same
model's output on one GPU before anything is timed. "natsim" also times one attention call of its plan on one GPU
(`attention_ms`, what benchmarks/predict_parallel.py needs). "train": a training step (forward, a loss on the
output, backward) of the model with `--train-layers` blocks and `apply(..., training=True)`, eager and compiled;
under parallelism the parameter gradients summed over the ranks are held against one GPU's (largest relative
difference over the parameters).
`--profile`: one more compiled step per mode under the profiler, the GPU time of its kernels per kind (attention,
NCCL, natsim's head regrouping, matrix products, other), the time the GPU was busy and the part of it in which only
NCCL ran (the exposed transfers), and the heaviest kernels by name, beside the step's wall time.
Writes `diffusers-parallel-<device>-P<ranks>-<date>.json`; compare launches of different P run on the same
machine (the one-GPU launch on one of its GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from natsim.distributed.collectives import high_priority_transfers

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
GROUPS = "natsim-groups"  # a mode's prefix: natsim with up to K head groups a rank (natsim.partition.head_groups)
SMALL = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1)


def parse(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split("x"))


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--latent", type=parse, default=(21, 90, 160), help="latent frames x height x width")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    parser.add_argument("--modes", default="natsim,natsim-serial,dense",
                        help="comma-separated: natsim, natsim-serial, natsim-groupsK (up to K head groups), dense, "
                             "train")
    parser.add_argument("--train-layers", type=int, default=4, help="blocks of the model the train mode steps")
    parser.add_argument("--small", action="store_true", help="a tiny model on CPUs (gloo): a smoke test")
    parser.add_argument("--profile", action="store_true",
                        help="GPUs: one more compiled step under the profiler, its kernels' time per kind and the "
                             "time the GPU was busy (the JSON's kernels_ms), to see where a parallel step loses")
    parser.add_argument("--ulysses-anything", action="store_true",
                        help="ContextParallelConfig(ulysses_anything=True): heads the GPUs do not divide are padded "
                             "(Wan 1.3B's 12 heads on 8 GPUs)")
    return parser.parse_args(argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(config: dict, device: torch.device):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)  # the same weights on every rank
    with device:
        model = WanTransformer3DModel(**config)
    return model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()


def inputs(config: dict, latent: tuple[int, ...], device: torch.device) -> dict:
    generator = torch.Generator(device).manual_seed(1)  # the same inputs on every rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    randn = lambda *shape: torch.randn(shape, device=device, generator=generator, dtype=dtype)  # noqa: E731
    return dict(hidden_states=randn(1, config["in_channels"], *latent), timestep=torch.full((1,), 500.0, device=device),
                encoder_hidden_states=randn(1, 512 if device.type == "cuda" else 8, config["text_dim"]),
                return_dict=False)


def median_step_ms(model, args: dict, steps: int, device: torch.device) -> float:
    """This rank's median synchronised step after two warm-up steps (ranks start each step together)."""
    times = []
    with torch.no_grad():
        for index in range(steps + 2):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            model(**args)
            synchronize(device)
            if index >= 2:
                times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def slowest(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def kernels_ms(model, step_args: dict) -> dict:
    """One compiled step of this rank under the profiler: its wall time, its kernels' time per kind
    (timing.kernel_breakdown) and its heaviest kernels by name (timing.heaviest_kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from timing import heaviest_kernels, kernel_breakdown

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        start = time.perf_counter()
        model(**step_args)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(wall=wall, **kernel_breakdown(kernels), heaviest=heaviest_kernels(kernels))


def attention_ms(plan, config: dict, device: torch.device, steps: int) -> float:
    """One GPU's median time of one attention call of `plan` (every head of the model)."""
    generator = torch.Generator(device).manual_seed(2)
    q, k, v = (torch.randn(1, *plan.problem.shape, config["num_attention_heads"], config["attention_head_dim"],
                           device=device, dtype=torch.bfloat16, generator=generator) for _ in range(3))
    times = []
    for index in range(steps + 2):
        synchronize(device)
        start = time.perf_counter()
        plan(q, k, v)
        synchronize(device)
        if index >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def train_step_ms(model, args: dict, steps: int, device: torch.device) -> float:
    """This rank's median synchronised training step (forward, mean square of the output, backward)."""
    times = []
    for index in range(steps + 2):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        model(**args)[0].float().square().mean().backward()
        synchronize(device)
        model.zero_grad(set_to_none=True)
        if index >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cp_config(args: argparse.Namespace, world: int):
    """diffusers' Ulysses over the `world` ranks, with `ulysses_anything` where asked."""
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ulysses_degree=world, ulysses_anything=args.ulysses_anything)


def run_training(args: argparse.Namespace, config: dict, device: torch.device, world: int) -> dict:
    """The train mode (module docstring)."""
    from natsim.integrations import diffusers as nd

    config = dict(config, num_layers=args.train_layers)
    model = build(config, device).train()
    step_args = inputs(config, args.latent, device)
    nd.apply(model, sparsity=args.sparsity, training=True)
    record = dict(mode="train", ranks=world, layers=args.train_layers)
    if world > 1:
        model(**step_args)[0].float().square().mean().backward()
        one_gpu = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model.enable_parallelism(config=cp_config(args, world))
        model(**step_args)[0].float().square().mean().backward()
        worst = 0.0
        for name, p in model.named_parameters():
            if name in one_gpu:
                summed = p.grad.float()
                dist.all_reduce(summed)
                worst = max(worst, float((summed - one_gpu[name]).norm() / one_gpu[name].norm().clamp_min(1e-30)))
        record["max_relative_gradient_difference_to_one_gpu"] = worst
        model.zero_grad(set_to_none=True)
        del one_gpu
    record["eager_train_step_ms"] = slowest(train_step_ms(model, step_args, args.steps, device), device)
    model.compile_repeated_blocks(fullgraph=True)
    try:
        record["compiled_train_step_ms"] = slowest(train_step_ms(model, step_args, args.steps, device), device)
    except Exception as error:  # recorded, not hidden: the table says the compiled step failed and why
        record["compiled_train_step_error"] = f"{type(error).__name__}: {str(error)[:500]}"
    del model
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def run_mode(mode: str, args: argparse.Namespace, config: dict, device: torch.device, world: int) -> dict:
    from natsim import partition

    if mode == "train":
        return run_training(args, config, device, world)
    grouping = partition.MAX_DEFAULT_CHUNKS
    # read when a call is traced: "natsim-serial" one group, "natsim-groupsK" up to K groups
    chunks = 1 if mode == "natsim-serial" else int(mode[len(GROUPS):]) if mode.startswith(GROUPS) else grouping
    partition.MAX_DEFAULT_CHUNKS = chunks
    try:
        return _run_step(mode, args, config, device, world)
    finally:
        partition.MAX_DEFAULT_CHUNKS = grouping


def _run_step(mode: str, args: argparse.Namespace, config: dict, device: torch.device, world: int) -> dict:
    from natsim import partition
    from natsim.integrations import diffusers as nd

    model = build(config, device)
    step_args = inputs(config, args.latent, device)
    record = dict(mode=mode, ranks=world)
    applied = None
    if mode.startswith("natsim"):
        applied = nd.apply(model, sparsity=args.sparsity)
        with torch.no_grad():
            one_gpu = model(**step_args)[0]
    if world > 1:
        model.enable_parallelism(config=cp_config(args, world))
    if mode.startswith("natsim"):
        with torch.no_grad():
            out = model(**step_args)[0]
        record["relative_difference_to_one_gpu"] = float((out.float() - one_gpu.float()).norm()
                                                         / one_gpu.float().norm())
        plan = next(iter(applied.plans.values()))
        record["plan"] = dict(window=list(plan.problem.window), stride=list(plan.problem.stride),
                              q_tile=list(plan.tiles.q_tile), kv_tile=list(plan.tiles.kv_tile),
                              kv_tiling=plan.tiles.kv_tiling, backend=plan.backend,
                              heads_per_rank=partition.heads_per_rank(config["num_attention_heads"], world),
                              groups=list(partition.head_groups(
                                  partition.heads_per_rank(config["num_attention_heads"], world))))
        if mode == "natsim":
            record["attention_ms"] = attention_ms(plan, config, device, args.steps)
    with torch.no_grad():  # diffusers' split hooks look their arguments up by signature on their first call, which
        model(**step_args)  # Dynamo cannot trace: an eager step first
    start = time.perf_counter()
    model.compile_repeated_blocks(fullgraph=True)
    with torch.no_grad():
        model(**step_args)
    synchronize(device)
    record["first_compiled_step_s"] = time.perf_counter() - start
    record["compiled_step_ms"] = slowest(median_step_ms(model, step_args, args.steps, device), device)
    if args.profile:
        record["kernels_ms"] = kernels_ms(model, step_args)
    del model
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def _warn_once() -> None:
    """diffusers 0.42.1's context-parallel hooks warn through `Logger.warning_once`, which only transformers
    (imported by every pipeline, not by a bare transformer) defines."""
    import functools
    import logging

    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)


def main(argv=None) -> None:
    args = arguments(argv)
    cuda = not args.small and torch.cuda.is_available()
    if args.profile and not cuda:
        raise SystemExit("--profile times GPU kernels: run it on GPUs, without --small.")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.accelerator.device_count = lambda: 1  # diffusers 0.42.1 without a GPU (examples/diffusers_parallel.py)
        device = torch.device("cpu")
        args.latent, args.steps = (2, 8, 16), 2
    _warn_once()
    dist.init_process_group("nccl" if cuda else "gloo")
    config = dict(WAN_1_3B if cuda else SMALL, num_layers=args.layers if cuda else 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        records = [run_mode(mode, args, config, device, world) for mode in args.modes.split(",")]
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank:
        return
    import diffusers
    import triton

    name = torch.cuda.get_device_name() if cuda else "cpu"
    result = dict(device=name, ranks=world, torch=torch.__version__, triton=triton.__version__,
                  diffusers=diffusers.__version__, date=str(datetime.date.today()), latent=args.latent,
                  layers=config["num_layers"], records=records, ulysses_anything=args.ulysses_anything,
                  high_priority_transfers=cuda and high_priority_transfers())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"diffusers-parallel-{name.replace(' ', '_')}-P{world}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print("| ranks | mode | compiled step ms | first step s | vs one GPU |\n|---|---|---|---|---|")
    for record in records:
        if record["mode"] == "train":
            print(f"| {world} | train ({record['layers']} blocks) | {record.get('compiled_train_step_ms', float('nan')):.1f} "
                  f"(eager {record['eager_train_step_ms']:.1f}) | - | gradients "
                  f"{record.get('max_relative_gradient_difference_to_one_gpu', float('nan')):.1e} |")
            continue
        print(f"| {world} | {record['mode']} | {record['compiled_step_ms']:.1f} | {record['first_compiled_step_s']:.1f} "
              f"| {record.get('relative_difference_to_one_gpu', float('nan')):.1e} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
