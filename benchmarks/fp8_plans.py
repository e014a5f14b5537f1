"""FP8 plans against bf16 plans on the planner's own terms, one run, one JSON:

    python benchmarks/fp8_plans.py --out DIR

Per layout (24 heads of 128 unless `--heads`/`--head-dim` say otherwise, bf16 inputs, batch 1): `best(shape,
0.9, ...)` in bf16 (every backend available here: natsim's Triton kernels, FlashAttention-4 where installed), in
FP8 (every FP8 backend: natsim's Triton FP8 kernel and, on Hopper where the cost model prices it, the Gluon FP8
kernel), in FP8 on each FP8 backend alone, and with `precision="auto"` (the precision the planner picks; its
record names it). Each plan's call is timed (median of `triton.testing.do_bench`, quantization and permutations included,
as the plan runs), beside its predicted seconds, and the FP8 plan's output is compared with the bf16 plan's
(relative L2). Writes `fp8-plans-<device>-<date>.json`; the table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton
import triton.testing
from rich.console import Console
from rich.table import Table

from natsim.planner import best

HEADS, HEAD_DIM = 24, 128
# (name, shape, window): the window fixed where a model fixes it, the planner's choice (None) elsewhere
LAYOUTS = (
    ("HunyuanVideo 720p", (30, 48, 80), (18, 24, 24)),
    ("HunyuanVideo 720p, window planned", (30, 48, 80), None),
    ("Wan 720p", (21, 45, 80), None),
    ("Wan 480p", (21, 30, 52), None),
    ("2-D 128x256", (128, 256), None),
)
RUNS = (("bf16", None, None), ("fp8", "fp8", None), ("fp8 triton", "fp8", "triton"), ("fp8 gluon", "fp8", "gluon"),
        ("auto", "auto", None))


def measure(shape, window, heads: int, head_dim: int) -> dict:
    q, k, v = (torch.randn(1, *shape, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    record, outputs = {"shape": list(shape), "window": None if window is None else list(window)}, {}
    for run, precision, backends in RUNS:
        try:
            plan = best(shape, 0.9, heads=heads, head_dim=head_dim, window=window, precision=precision,
                        backends=backends)
        except ValueError as error:
            record[run] = {"refused": str(error)}
            continue
        outputs[run] = plan(q, k, v)
        ms = triton.testing.do_bench(lambda: plan(q, k, v), warmup=50, rep=300, return_mode="median")
        record[run] = {"precision": plan.precision or "bf16", "backend": plan.backend, "window": list(plan.problem.window), "stride": list(plan.problem.stride),
                       "q_tile": list(plan.tiles.q_tile), "kv_tile": list(plan.tiles.kv_tile),
                       "predicted_ms": plan.predicted_time_s * 1e3 if plan.predicted_time_s else None,
                       "measured_ms": ms}
    for run in ("fp8", "fp8 triton", "fp8 gluon"):
        if run in outputs and record[run]["window"] == record["bf16"]["window"] \
                and record[run]["stride"] == record["bf16"]["stride"]:
            a, b = outputs[run].float(), outputs["bf16"].float()
            record[run]["relative_difference_to_bf16"] = float((a - b).norm() / b.norm())
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--heads", type=int, default=HEADS, help="attention heads (batch 1)")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="width of a head")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "heads": args.heads, "head_dim": args.head_dim, "records": []}
    path = args.out / f"fp8-plans-{device.replace(' ', '_')}-{result['date']}-hd{args.head_dim}.json"
    for name, shape, window in LAYOUTS:
        record = {"layout": name, **measure(shape, window, args.heads, args.head_dim)}
        print(json.dumps(record), flush=True)
        result["records"].append(record)
        path.write_text(json.dumps(result, indent=1))
    table = Table(title=f"plans at 0.9 sparsity on {device}, predicted / measured ms (written to {path})")
    table.add_column("layout")
    for run, _, _ in RUNS:
        table.add_column(run, justify="right")
    for record in result["records"]:
        cells = []
        for run, _, _ in RUNS:
            r = record[run]
            name = r.get("backend") if run != "auto" else f"{r.get('precision')} {r.get('backend')}"
            cells.append("refused" if "refused" in r else
                         f"{name}: {r['predicted_ms'] or float('nan'):.2f} / {r['measured_ms']:.2f}")
        table.add_row(record["layout"], *cells)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
