"""The cost model's predictions against measurement at every head dim, on layouts calibration did not time:

    python benchmarks/predict_headdims.py OUT_DIR [--head-dims 40,72,88,96,112,128]

Per layout (Wan 720p 21x45x80 with 40 heads; HunyuanVideo 30x48x80 with 24 heads; both planned at 0.9 sparsity)
and head dim: natsim's plan on its Triton kernels (`best(..., backends=("triton",))`, this GPU's cost model), its
predicted time, and the plan's call measured (median of at least 20, bf16, random inputs). Writes
OUT_DIR/predict-headdims-<gpu>.json and prints the errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from natsim.planner import best
from natsim.planner.cost.timing import median_seconds

LAYOUTS = {"wan-720p": ((21, 45, 80), 40), "hunyuan-720p": ((30, 48, 80), 24)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--head-dims", default="40,72,88,96,112,128")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/predict_headdims.py times GPU calls: it needs a CUDA GPU.")
    device = torch.device("cuda")
    rows = []
    for name, (shape, heads) in LAYOUTS.items():
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            plan = best(shape, 0.9, heads=heads, head_dim=head_dim, backends=("triton",))
            q, k, v = (torch.randn(1, *shape, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
            measured = median_seconds(lambda: plan(q, k, v), device)
            row = dict(layout=name, shape=list(shape), heads=heads, head_dim=head_dim,
                       window=list(plan.problem.window), stride=list(plan.problem.stride),
                       q_tile=list(plan.tiles.q_tile), kv_tile=list(plan.tiles.kv_tile), kv_tiling=plan.tiles.kv_tiling,
                       predicted_ms=plan.predicted_time_s * 1e3, measured_ms=measured * 1e3,
                       error=plan.predicted_time_s / measured - 1)
            rows.append(row)
            print(f"{name:13s} head_dim {head_dim:3d}: {row['kv_tiling']:7s} {row['q_tile']} / {row['kv_tile']}, "
                  f"predicted {row['predicted_ms']:7.2f} ms, measured {row['measured_ms']:7.2f} ms, "
                  f"error {row['error']:+.1%}", flush=True)
            del q, k, v
    gpu = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"predict-headdims-{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps(dict(device=gpu, torch=torch.__version__, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
