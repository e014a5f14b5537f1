"""The Gluon FP8 kernel against an earlier version of it, and across its rescale slacks, kernel alone, one run:

    git show REV:kernels/gluon/forward.py > /tmp/gluon_forward_before.py
    python benchmarks/fp8_gluon_ab.py OUT_DIR --before /tmp/gluon_forward_before.py [--slacks 0,1,2,3] [--tag T]

The earlier file is loaded as a module beside natsim's kernel (its relative imports resolve inside
natsim.kernels.gluon), so both run on the same quantized tensors in one process. Rows (24 heads, bf16 inputs,
batch 1): dense attention over 32,768 tokens at head_dim 128 and 64, random 128 x 128 block masks at 70 % and 90 %
sparsity, HunyuanVideo's GNA mask in tile order (benchmarks/fp8_gluon.py's cases). Timers: "before", the current
kernel at each slack of `--slacks` (`RESCALE_SLACK`, at head dims that rescale lazily; elsewhere every slack runs
the same code), and FlashAttention-4 bf16 where installed. Median ms over interleaved rounds
(benchmarks/timing.py), each timer's ratio to "before", and per kernel the output's relative error and cosine
against float32 attention on two heads and the LSE's largest difference from float32's (K's mean put back).
Writes OUT_DIR/fp8-gluon-ab<tag>-<gpu>-<date>.json and prints one line per case.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gluon import fa4_installed, hunyuan_blocks, random_blocks  # noqa: E402
from timing import interleaved, rel  # noqa: E402

from natsim.kernels import prepare_sparse, sparse_attention, sparse_reference  # noqa: E402
from natsim.kernels.common.fp8 import quantize  # noqa: E402
from natsim.kernels.gluon import forward as current  # noqa: E402

CASES = [("dense 32k", 32768, None, 128), ("dense 32k d64", 32768, None, 64), ("random 70%", 32768, 0.7, 128),
         ("random 90%", 32768, 0.9, 128), ("hunyuan 16x8x8", 30 * 48 * 80, "hunyuan", 128)]
HEADS = 24


def load_before(path: Path):
    """The earlier kernel file as a module of natsim.kernels.gluon."""
    spec = importlib.util.spec_from_file_location("natsim.kernels.gluon.forward_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def at_slack(slack: float, launch):
    """`launch` run by the current kernel with `RESCALE_SLACK` set to `slack` (a compile-time argument)."""
    def run(*args):
        current.RESCALE_SLACK = slack
        return launch(*args)
    return run


def accuracy(launch, q, k, v, blocks, lists_of) -> dict:
    """`launch`'s output and LSE on two heads against float32 attention."""
    q2, k2, v2 = (t[:, :, :2].contiguous() for t in (q, k, v))
    mask = blocks[:, :2] if blocks.shape[1] > 1 else blocks
    ref, ref_lse = sparse_reference(q2.float(), k2.float(), v2.float(), mask, 128, 128, return_lse=True)
    scale = q.shape[-1] ** -0.5
    out, lse = launch(quantize(q2, k2, v2, k_block=128, v_key_major=True), lists_of(mask), scale, q.dtype, True)
    shift = (q2.float() * k2.float().mean(1, keepdim=True)).sum(-1) * scale  # the kernel's K has its mean removed
    cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    return dict(relative_error=rel(out, ref), cosine=cosine,
                lse_max_difference=(lse.float() - (ref_lse.float() - shift)).abs().max().item())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--before", type=Path, required=True, help="an earlier kernels/gluon/forward.py")
    parser.add_argument("--slacks", default=str(current.RESCALE_SLACK), help="rescale slacks to time, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tag", default="", help="appended to the file name")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_gluon_ab.py times a Hopper kernel: it needs a CUDA GPU.")
    before = load_before(args.before)
    slacks = [float(s) for s in args.slacks.split(",")]
    rows = []
    for name, tokens, kind, head_dim in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, tokens, HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        if kind is None:
            blocks = torch.ones(1, 1, tokens // 128, tokens // 128, dtype=torch.bool, device="cuda")
        else:
            blocks = hunyuan_blocks() if kind == "hunyuan" else random_blocks(tokens, kind, seed=1)
        lists_of = (lambda m: None) if kind is None else current.BlockLists.from_blocks
        x, lists, scale = quantize(q, k, v, k_block=128, v_key_major=True), lists_of(blocks), head_dim ** -0.5
        kernels = {"before": before.launch, **{f"slack {s:g}": at_slack(s, current.launch) for s in slacks}}
        timers = {key: (lambda launch=launch: launch(x, lists, scale, q.dtype, False)) for key, launch in kernels.items()}
        if fa4_installed() and head_dim == 128:
            if kind is None:
                from flash_attn.cute.interface import flash_attn_func
                timers["fa4 bf16"] = lambda: flash_attn_func(q, k, v)
            else:
                work = prepare_sparse(blocks, 128, 128, tokens, backend="fa4", backward=False)
                timers["fa4 bf16"] = lambda: sparse_attention(q, k, v, work)
        for fn in timers.values():
            fn()
        checks = {key: accuracy(launch, q, k, v, blocks, lists_of) for key, launch in kernels.items()}
        rounds = interleaved(timers, args.rounds, 200.0, torch.cuda.synchronize)
        ms = {key: statistics.median(values) for key, values in rounds.items()}
        row = dict(case=name, head_dim=head_dim, ms=ms, rounds=rounds, accuracy=checks,
                   over_before={key: ms["before"] / t for key, t in ms.items()})
        rows.append(row)
        print(name, " ".join(f"{key} {t:.2f} ms ({row['over_before'][key]:.3f}x)" for key, t in ms.items()), flush=True)
        del q, k, v, x
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fp8-gluon-ab{args.tag}-{device.replace(' ', '_')}-{date}.json"
    path.write_text(json.dumps(dict(device=device, torch=torch.__version__, triton=triton.__version__, date=date,
                                    before=str(args.before), rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
