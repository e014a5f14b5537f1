"""GNA in FP8 on the Gluon kernel where the plan's tiles are partial, beside the other FP8 and bf16 routes, one
run, one JSON:

    python benchmarks/fp8_gluon_partial.py OUT_DIR [--rounds 7]

Rows (bf16 inputs, batch 1, head_dim 128): the GNA configurations the planner picks at 0.9 sparsity on an H200
for Wan 2.1's 720p latent (21x45x80, 40 heads) and HunyuanVideo's (30x48x80, 24 heads), and a window-only
neighbourhood on each; none of them block-sparse on any 128-token tile. Per row, median ms over interleaved
rounds (benchmarks/timing.py) of: the Gluon FP8 kernel on each of natsim's 128-token tiles of the layout that
visits the fewest blocks (permutation into tile order and quantization included), the Triton FP8 kernel on
natsim's default tiles, and bf16: the planner's plan (whatever backend it names: FlashAttention-4 where installed
and priced faster) for its rows, natsim's default call for the others. Accuracy: each output against the bf16
one, and the Gluon output against float32 attention on a slice of heads. Writes
OUT_DIR/fp8-gluon-partial-<gpu>-<date><tag>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved, rel  # noqa: E402

from natsim import Problem, TileConfig, simulate  # noqa: E402
from natsim.kernels import gna_attention, reference_attention  # noqa: E402
from natsim.kernels.gna.tiles import tile_pairs  # noqa: E402
from natsim.planner import best  # noqa: E402

HEAD_DIM = 128
CASES = [  # name, layout, heads, window or None (the planner's pick at 0.9), stride
    ("wan 720p, planner's 0.9", (21, 45, 80), 40, None, None),
    ("wan 720p, window 7x21x35", (21, 45, 80), 40, (7, 21, 35), (1, 1, 1)),
    ("hunyuan 720p, planner's 0.9", (30, 48, 80), 24, None, None),
    ("hunyuan 720p, window 18x24x24", (30, 48, 80), 24, (18, 24, 24), (1, 1, 1)),
]


def gluon_tile(problem: Problem) -> tuple[int, ...]:
    """natsim's 128-token tile of the layout that visits the fewest blocks."""
    tiles = [q for q, kv in tile_pairs(problem.shape, HEAD_DIM) if q == kv and math.prod(q) == 128]
    return min(tiles, key=lambda t: simulate(problem, TileConfig(t, t)).visited_tiles)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, head_dim=HEAD_DIM,
                  date=datetime.date.today().isoformat(), rows=[])
    for name, layout, heads, window, stride in CASES:
        if window is None:
            plan = best(layout, 0.9, heads=heads, head_dim=HEAD_DIM, dtype="bf16")
            window, stride = plan.problem.window, plan.problem.stride
            bf16 = plan
        else:
            bf16 = None  # natsim's own choice of backend and tiles for the call
        problem = Problem(layout, window, stride)
        tile = gluon_tile(problem)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, *layout, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        bf16_key = f"bf16 ({'plan, ' + bf16.backend if bf16 else 'natsim default'})"
        calls = {
            "gluon fp8": lambda: gna_attention(q, k, v, window, stride, q_tile=tile, kv_tile=tile, precision="fp8",
                                               backend="gluon"),
            "triton fp8": lambda: gna_attention(q, k, v, window, stride, precision="fp8", backend="triton"),
            bf16_key: (lambda: bf16(q, k, v)) if bf16 else (lambda: gna_attention(q, k, v, window, stride)),
        }
        outputs = {key: fn() for key, fn in calls.items()}
        rounds = interleaved(calls, args.rounds, 200.0, torch.cuda.synchronize)
        ms = {key: statistics.median(values) for key, values in rounds.items()}
        reference_key = bf16_key
        few = slice(0, 2)
        exact = reference_attention(*(t[..., few, :].float() for t in (q, k, v)), window, stride)
        gluon = outputs["gluon fp8"]
        visited = simulate(problem, TileConfig(tile, tile))
        row = dict(case=name, layout=list(layout), heads=heads, window=list(window), stride=list(stride),
                   gluon_tile=list(tile), gluon_visited=visited.visited_tiles, gluon_full=visited.full_tiles,
                   bf16_plan=bf16 and dict(backend=bf16.backend, q_tile=list(bf16.tiles.q_tile),
                                           kv_tile=list(bf16.tiles.kv_tile), kv_tiling=bf16.tiles.kv_tiling),
                   ms=ms, over_bf16={key: ms[reference_key] / t for key, t in ms.items()},
                   against_bf16={key: rel(out, outputs[reference_key]) for key, out in outputs.items()},
                   gluon_against_float32=rel(gluon[..., few, :], exact))
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, outputs, gluon, exact
        torch.cuda.empty_cache()
    path = args.out / f"fp8-gluon-partial-{device.replace(' ', '_')}-{result['date']}{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    for row in result["rows"]:
        cells = "  ".join(f"{key} {t:.2f} ms ({row['over_bf16'][key]:.2f}x)" for key, t in row["ms"].items())
        print(f"{row['case']:32s} {cells}")


if __name__ == "__main__":
    main()
