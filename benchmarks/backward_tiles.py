"""GNA backward under several tile choices for one problem: padded tiles against tiles that divide the layout.

    python benchmarks/backward_tiles.py --out DIR [--stride 1x1x1]

HunyuanVideo 30x48x80, 24 heads, head_dim 128, bf16, window 18x24x24. `backward_tiles` picks its tiles by the
forward's relative cost, which knows nothing of padding; in place, tiles that do not divide the layout clamp
each row's place (kernels/gna_backward.py, PADDED). This times `gna_backward` whole for the default tiles and
for 128-key boxes that divide the layout, side by side, with each choice's simulated pairs and its gradients'
largest relative difference from the default's. Prints a table, writes backward-tiles-<device>-<date>.json.
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
from timing import bench, rel

import natsim
from natsim.kernels.gna.backward import backward_tiles, gna_backward, padded
from natsim.kernels.gna.dispatch import forward

SHAPE, WINDOW, HEADS, HEAD_DIM = (30, 48, 80), (18, 24, 24), 24, 128
CANDIDATES = [((2, 8, 4), (2, 8, 8)), ((2, 4, 8), (2, 8, 8)), ((1, 8, 8), (2, 8, 8)), ((1, 4, 16), (2, 4, 16))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--stride", default="1x1x1", help="GNA stride, e.g. 1x1x1")
    args = parser.parse_args(argv)
    stride = tuple(int(x) for x in args.stride.split("x"))
    problem = natsim.Problem(SHAPE, WINDOW, stride)
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, *SHAPE, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = forward(q, k, v, WINDOW, stride, 1, False, None, None, None, True)
    default = backward_tiles(problem, HEAD_DIM)
    choices = [default] + [choice for choice in CANDIDATES if choice != default]
    reference = gna_backward(q, k, v, out, lse, g, None, problem)
    rows = []
    for q_tile, kv_tile in choices:
        sim = natsim.simulate_backward(problem, natsim.TileConfig(q_tile, kv_tile))
        call = lambda: gna_backward(q, k, v, out, lse, g, None, problem, None, q_tile, kv_tile)  # noqa: E731
        grads = call()
        row = {"q_tile": list(q_tile), "kv_tile": list(kv_tile), "padded": padded(problem, q_tile, kv_tile),
               "visited_pairs": sim.visited_tiles, "full_pairs": sim.full_tiles,
               "pair_tokens": sim.visited_tiles * math.prod(q_tile) * math.prod(kv_tile),
               "rel_diff_vs_default": max(rel(a, b) for a, b in zip(grads, reference)),
               "ms": [bench(call, min_calls=3, min_rep_ms=100.0) for _ in range(2)]}
        del grads
        print(json.dumps(row), flush=True)
        rows.append(row)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "stride": list(stride), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"backward-tiles-{record['device'].replace(' ', '_')}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=1))
    print("| Q tile / KV tile | padded | visited pairs (token pairs, M) | ms (two rounds) | rel diff |")
    print("|---|---|---|---|---|")
    for r in rows:
        tiles = f"{'x'.join(map(str, r['q_tile']))} / {'x'.join(map(str, r['kv_tile']))}"
        print(f"| {tiles} | {r['padded']} | {r['visited_pairs']} ({r['pair_tokens'] / 1e6:.0f}) | "
              f"{r['ms'][0]:.1f} / {r['ms'][1]:.1f} | {r['rel_diff_vs_default']:.1e} |")


if __name__ == "__main__":
    sys.exit(main())
