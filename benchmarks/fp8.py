"""FP8 attention on the GPU: accuracy against float32 attention and speed beside bf16 natsim and SDPA (cuDNN).

    python benchmarks/fp8.py OUT_DIR [--quick]

Accuracy (relative error ||o - o_ref|| / ||o_ref|| and cosine similarity against float32 attention with the
same mask, on a few heads so the reference stays quick): random Gaussian q, k, v, where attention is nearly
uniform and rounding does not average out, and benchmarks/workload.py's RoPE video workload at several layouts;
bf16 natsim on the same inputs for scale. Speed (median ms, interleaved rounds, one process): HunyuanVideo's GNA
configuration, dense attention through `gna_attention`, random 128x128 block masks at 70 % and 90 % sparsity
through `sparse_attention` with a prepared mask, each in bf16 and FP8, with SDPA cuDNN dense. Writes
OUT_DIR/fp8-<gpu>-<date>.json and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse import sdpa_cudnn  # noqa: E402
from timing import bench, interleaved, rel  # noqa: E402
from workload import video_qkv  # noqa: E402

from natsim.kernels import gna_attention, prepare_sparse, reference_attention, sparse_attention  # noqa: E402
from natsim.kernels.common.fp8 import quantize  # noqa: E402


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def gna_accuracy(name, q, k, v, window, stride) -> dict:
    exact = reference_attention(q.float(), k.float(), v.float(), window, stride)
    row = dict(case=name, tokens=math.prod(q.shape[1:-2]), heads=q.shape[-2])
    for label, precision in (("bf16", None), ("fp8", "fp8")):
        out = gna_attention(q, k, v, window, stride, precision=precision)
        row[f"{label}_rel_error"] = rel(out, exact)
        row[f"{label}_cosine"] = cosine(out, exact)
    return row


def accuracy(quick: bool) -> list[dict]:
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for n, head_dim in ((2048, 64), (2048, 128), (32768, 128)):
        q, k, v = (torch.randn(1, n, 2, head_dim, device="cuda", generator=generator).bfloat16() for _ in range(3))
        rows.append(gna_accuracy(f"gaussian dense N={n} d={head_dim}", q, k, v, n, 1))
    layouts = [((21, 30, 52), (9, 12, 12), (1, 1, 1)), ((30, 48, 80), (18, 24, 24), (16, 8, 8)),
               ((13, 30, 45), (13, 30, 45), (1, 1, 1)), ((16, 22, 40), (8, 11, 20), (4, 1, 1))]
    for shape, window, stride in layouts[:2] if quick else layouts:
        work = video_qkv(shape, heads=4, device="cuda", seed=1)
        q, k, v = (t.reshape(1, *shape, 4, t.shape[-1]) for t in (work.q, work.k, work.v))
        rows.append(gna_accuracy(f"video {'x'.join(map(str, shape))} w{'x'.join(map(str, window))} "
                                 f"s{'x'.join(map(str, stride))}", q, k, v, window, stride))
    return rows


def speed(quick: bool) -> list[dict]:
    rows, timers, labels = [], {}, {}
    heads = 24
    generator = torch.Generator(device="cuda").manual_seed(2)

    def qkv(*shape):
        return tuple(torch.randn(1, *shape, heads, 128, device="cuda", generator=generator).bfloat16()
                     for _ in range(3))

    hv = qkv(30, 48, 80)
    for precision in (None, "fp8"):
        timers[("hunyuan 16x8x8", precision)] = (
            lambda p=precision: gna_attention(*hv, (18, 24, 24), (16, 8, 8), precision=p))
    dense = qkv(16, 32, 64)
    for precision in (None, "fp8"):
        timers[("dense 16x32x64", precision)] = (
            lambda p=precision: gna_attention(*dense, (16, 32, 64), precision=p))
    flat = tuple(t.reshape(1, -1, heads, 128) for t in dense)
    timers[("dense 16x32x64", "sdpa-cudnn")] = lambda: sdpa_cudnn(*flat)
    n = flat[0].shape[1]
    for sparsity in (0.7, 0.9):
        mask = torch.rand(1, heads, n // 128, n // 128, device="cuda", generator=generator) >= sparsity
        work = prepare_sparse(mask, 128, 128, n, backward=False)
        for precision in (None, "fp8"):
            timers[(f"random 128x128 {sparsity:.0%}", precision)] = (
                lambda w=work, p=precision: sparse_attention(*flat, w, precision=p))
    for fn in timers.values():
        fn()
    torch.cuda.synchronize()
    times = interleaved(timers, rounds=3 if quick else 7, min_ms=100.0, sync=torch.cuda.synchronize)
    cases = dict.fromkeys(case for case, _ in timers)
    for case in cases:
        row = dict(case=case)
        for (c, precision), values in times.items():
            if c == case:
                row[{None: "bf16_ms", "fp8": "fp8_ms", "sdpa-cudnn": "sdpa_cudnn_ms"}[precision]] = \
                    sorted(values)[len(values) // 2]
        row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
        rows.append(row)
    return rows


def quantize_cost() -> float:
    """Median ms of quantizing HunyuanVideo's q, k, v (24 heads): the part of an FP8 call before the kernel."""
    q, k, v = (torch.randn(1, 30 * 48 * 80, 24, 128, device="cuda").bfloat16() for _ in range(3))
    return bench(lambda: quantize(q, k, v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true", help="fewer layouts and rounds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat())
    result["accuracy"] = accuracy(args.quick)
    for row in result["accuracy"]:
        print(f"{row['case']:<44} bf16 {row['bf16_rel_error']:.2e}  fp8 {row['fp8_rel_error']:.2e}  "
              f"cos {row['fp8_cosine']:.5f}", flush=True)
    result["speed"] = speed(args.quick)
    result["quantize_ms"] = quantize_cost()
    print(f"quantize q, k, v alone (HunyuanVideo, 24 heads): {result['quantize_ms']:.2f} ms", flush=True)
    for row in result["speed"]:
        sdpa_ms = f"  sdpa {row['sdpa_cudnn_ms']:.2f}" if "sdpa_cudnn_ms" in row else ""
        print(f"{row['case']:<24} bf16 {row['bf16_ms']:.2f} ms  fp8 {row['fp8_ms']:.2f} ms  "
              f"x{row['fp8_speedup']:.2f}{sdpa_ms}", flush=True)
    name = torch.cuda.get_device_name().replace(" ", "_")
    (args.out / f"fp8-{name}-{result['date']}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
