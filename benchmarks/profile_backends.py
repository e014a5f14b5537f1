"""Where the time of natsim's FlashAttention-4 calls goes, against FlashAttention-4 called directly: the GPU kernels
of each call under torch.profiler, one run, one JSON.

    python benchmarks/profile_backends.py OUT_DIR

Cases (bf16, head_dim 128, batch 1): dense attention over 32,768 tokens with 24 heads, and HunyuanVideo 30x48x80
(24 heads) at window 18x24x24, stride 16x8x8 on 4x8x8 / 2x8x8 tiles (block-sparse). Per case and timer (`natsim`:
`gna_attention` on the row-major layout, natsim's choice of backend; `fa4-direct`: FlashAttention-4's public function
on tensors already in tile order, with natsim's lists), after warm-up, `CALLS` calls are profiled; each kernel's
name, launches per call and CUDA microseconds per call are listed, with the call's total. Writes
`profile-backends-<device>-<date>.json` and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules

from backends import fa4_direct  # noqa: E402

import natsim  # noqa: E402
from natsim.kernels import gna_attention  # noqa: E402
from natsim.kernels.fa4.gna import Fa4Gna  # noqa: E402

CALLS = 10
WARMUP = 3


def kernels_of(fn) -> list[dict]:
    """The CUDA kernels `fn` launches, per call: name, launches and microseconds."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = event.cuda_time_total
        if device_us <= 0:
            continue
        rows.append(dict(kernel=event.key[:120], launches_per_call=event.count / CALLS, us_per_call=device_us / CALLS))
    return sorted(rows, key=lambda row: -row["us_per_call"])


def cases() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

    n = 32768
    dq, dk, dv = (randn(1, n, 24, 128) for _ in range(3))
    shape, window, stride, tiles = (30, 48, 80), (18, 24, 24), (16, 8, 8), ((4, 8, 8), (2, 8, 8))
    hq, hk, hv = (randn(1, *shape, 24, 128) for _ in range(3))
    geometry = Fa4Gna(natsim.Problem(shape, window, stride), *tiles)
    ordered = [geometry.to_order(t) for t in (hq, hk, hv)]
    lists = geometry.lists(hq.device)
    return {
        "dense-32768": {
            "natsim": lambda: gna_attention(dq, dk, dv, n),
            "fa4-direct": lambda: fa4_direct(dq, dk, dv, None),
        },
        "hunyuan-16x8x8": {
            "natsim": lambda: gna_attention(hq, hk, hv, window, stride, q_tile=tiles[0], kv_tile=tiles[1]),
            "fa4-direct": lambda: fa4_direct(*ordered, lists, geometry.mask_mod(lists)),
        },
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this profile needs a CUDA GPU (torch.cuda.is_available() is False).")
    import triton

    device = torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), calls=CALLS, cases={})
    for case, timers in cases().items():
        result["cases"][case] = {name: kernels_of(fn) for name, fn in timers.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile-backends-{device.replace(' ', '_')}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    for case, timers in result["cases"].items():
        for name, rows in timers.items():
            total = sum(row["us_per_call"] for row in rows)
            print(f"\n{case} / {name}: {total / 1e3:.3f} ms of kernels per call")
            for row in rows[:8]:
                print(f"  {row['us_per_call'] / 1e3:8.3f} ms  x{row['launches_per_call']:.0f}  {row['kernel']}")


if __name__ == "__main__":
    main()
