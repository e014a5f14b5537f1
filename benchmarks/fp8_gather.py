"""The FP8 quantization reading a layout in the kernels' tile order, against permuting copies first, one run, one
JSON:

    python benchmarks/fp8_gather.py OUT_DIR [--rounds 7]

FP8 GNA quantizes q, k and v in the order the kernel reads them (its Q tile's, its KV tile's). The quantization
reads the layout's rows in that order itself (kernels/gna/permute.py `source_rows`, kernels/common/fp8.py
`quantize_rows(..., q_rows, kv_rows)`); before, three permuted bf16 copies were made first, then quantized. Per
layout (bf16 inputs, batch 1), median ms over interleaved rounds (benchmarks/timing.py) of both ways, K's mean and
V's scales given (the same for both), and their outputs compared bit for bit; beside them, the whole FP8 call as
it now runs on each kernel (quantization, kernel and the output's permutation back), and, for the small layout,
the host's time to enqueue one call (no synchronization; the GPU runs behind). Writes
OUT_DIR/fp8-gather-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved  # noqa: E402

from natsim.kernels import gna_attention  # noqa: E402
from natsim.kernels.common.fp8 import column_statistics, quantize_rows  # noqa: E402
from natsim.kernels.gna.permute import permute, source_rows  # noqa: E402

# (name, layout, heads, window, stride, Gluon's 128-token tile, the Triton FP8 kernel's Q and KV tiles)
CASES = (
    ("HunyuanVideo 720p, window 18x24x24, stride 16x8x8", (30, 48, 80), 24, (18, 24, 24), (16, 8, 8), (2, 8, 8),
     (1, 8, 8), (2, 8, 8)),
    ("Wan 720p, window 7x21x35", (21, 45, 80), 40, (7, 21, 35), (1, 1, 1), (2, 4, 16), (1, 4, 16), (2, 4, 16)),
    ("FLUX 64x64, window 21x21", (64, 64), 24, (21, 21), (1, 1), (8, 16), (4, 16), (8, 16)),
)
HEAD_DIM = 128
HOST_CALLS = 50


def quantization(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_tile: tuple[int, ...],
                 kv_tile: tuple[int, ...], gluon: bool) -> tuple[dict, bool]:
    """The two ways to quantize `[1, *layout, heads, 128]` q, k, v in tile order (the Gluon kernel's K scales and
    V order where `gluon`), as calls to time, and whether their float8 bits agree."""
    batch, heads = q.shape[0], q.shape[-2]
    shape, ones = tuple(q.shape[1:-2]), (1,) * (q.dim() - 3)
    k_mean, v_scale = column_statistics(k, v)
    flat = [x.reshape(batch, -1, heads, HEAD_DIM) for x in (q, k, v)]
    rows = dict(q_rows=source_rows(shape, q_tile, ones, q.device), kv_rows=source_rows(shape, kv_tile, ones, q.device))
    options = dict(k_block=128 if gluon else 1, v_key_major=gluon)
    calls = {
        "read in order": lambda: quantize_rows(*flat, k_mean, v_scale, **options, **rows),
        "permuted copies": lambda: quantize_rows(permute(q, q_tile), permute(k, kv_tile), permute(v, kv_tile),
                                                 k_mean, v_scale, **options),
    }
    results = {name: fn() for name, fn in calls.items()}
    same = all(torch.equal(getattr(results["read in order"], f).view(torch.uint8),
                           getattr(results["permuted copies"], f).view(torch.uint8)) for f in ("q", "k", "v_t"))
    return calls, same


def host_ms(fn) -> float:
    """Milliseconds the host takes to enqueue one call (`HOST_CALLS` back to back, no synchronization between)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = (time.perf_counter() - start) / HOST_CALLS * 1e3
    torch.cuda.synchronize()
    return elapsed


def measure(case: tuple, rounds: int) -> dict:
    name, layout, heads, window, stride, gluon_tile, q_tile, kv_tile = case
    q, k, v = (torch.randn(1, *layout, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    record = {"case": name, "layout": list(layout), "heads": heads, "window": list(window), "stride": list(stride)}
    timers, agree = {}, {}
    for kernel, tiles in (("gluon", (gluon_tile, gluon_tile)), ("triton", (q_tile, kv_tile))):
        calls, agree[kernel] = quantization(q, k, v, *tiles, gluon=kernel == "gluon")
        timers.update({(kernel, way): fn for way, fn in calls.items()})
    whole = {
        "gluon": lambda: gna_attention(q, k, v, window, stride, precision="fp8", backend="gluon", q_tile=gluon_tile,
                                       kv_tile=gluon_tile),
        "triton": lambda: gna_attention(q, k, v, window, stride, precision="fp8", backend="triton", q_tile=q_tile,
                                        kv_tile=kv_tile),
        "bf16": lambda: gna_attention(q, k, v, window, stride),
    }
    timers.update({(kernel, "whole call"): fn for kernel, fn in whole.items()})
    for fn in timers.values():
        fn()
    ms = interleaved(timers, rounds, 100.0, torch.cuda.synchronize)
    record["ms"] = {f"{kernel}: {way}": statistics.median(values) for (kernel, way), values in ms.items()}
    record["bits_agree"] = agree
    if q.numel() <= 1 << 24:
        record["host_enqueue_ms"] = {kernel: host_ms(fn) for kernel, fn in whole.items()}
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the JSON result")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is reported)")
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "head_dim": HEAD_DIM, "rounds": args.rounds, "records": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fp8-gather-{device.replace(' ', '_')}-{result['date']}.json"
    for case in CASES:
        record = measure(case, args.rounds)
        print(json.dumps(record), flush=True)
        result["records"].append(record)
        path.write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    print(f"{'case':52s} {'kernel':7s} {'read in order':>14s} {'copies':>8s} {'saved':>7s} {'whole call':>11s}")
    for record in result["records"]:
        for kernel in ("gluon", "triton"):
            ms = record["ms"]
            read, copies, call = (ms[f"{kernel}: {way}"] for way in ("read in order", "permuted copies", "whole call"))
            print(f"{record['case'][:52]:52s} {kernel:7s} {read:14.3f} {copies:8.3f} {copies - read:7.3f} {call:11.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
