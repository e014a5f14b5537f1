"""GNA in FP8 on the Gluon kernel where the plan's tiles are partial, beside the other FP8 and bf16 routes, one
run, one JSON:

    python benchmarks/fp8_gluon_partial.py OUT_DIR [--rounds 7] [--cases 0,3,9]

Rows (bf16 inputs, batch 1): the GNA configurations the planner picks at 0.9 sparsity on an H200 for Wan 2.1's
720p latent (21x45x80, 40 heads) and HunyuanVideo's (30x48x80, 24 heads), and window-only neighbourhoods on
each, at head_dim 128 and 64; a small window, a dilated one, a causal one, and smaller video and image layouts
(4,096 to 49,152 tokens); none of them block-sparse on any 128-token tile. Per row, median ms over interleaved
rounds (benchmarks/timing.py) of: the Gluon FP8 kernel on each of natsim's 128-token tiles of the layout that
visits the fewest blocks (permutation into tile order and quantization included), the Triton FP8 kernel on
natsim's default tiles, the FP8 call left to natsim (no backend named), and bf16: the planner's plan (whatever
backend it names: FlashAttention-4 where installed and priced faster) for its rows, natsim's default call for
the others. Beside the times, the two counts natsim's choice of FP8 kernel reads (kernels/gna/choice.py): the
Gluon tiles' visited blocks times heads, and their query-key pairs over the Triton tiles'. Accuracy: each output
against the bf16 one, and the Gluon output against float32 attention on a slice of heads. Writes
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
from natsim.kernels.gna.tiles import fp8_tiles, tile_pairs  # noqa: E402
from natsim.planner import best  # noqa: E402

CASES = [  # name, layout, heads, head_dim, window or None (the planner's pick at 0.9), stride, dilation, causal
    ("wan 720p, planner's 0.9", (21, 45, 80), 40, 128, None, None, None, None),
    ("wan 720p, window 7x21x35", (21, 45, 80), 40, 128, (7, 21, 35), (1, 1, 1), None, None),
    ("hunyuan 720p, planner's 0.9", (30, 48, 80), 24, 128, None, None, None, None),
    ("hunyuan 720p, window 18x24x24", (30, 48, 80), 24, 128, (18, 24, 24), (1, 1, 1), None, None),
    ("wan 720p, window 7x21x35, hd64", (21, 45, 80), 40, 64, (7, 21, 35), (1, 1, 1), None, None),
    ("hunyuan 720p, window 18x24x24, hd64", (30, 48, 80), 24, 64, (18, 24, 24), (1, 1, 1), None, None),
    ("hunyuan 720p, window 5x7x7", (30, 48, 80), 24, 128, (5, 7, 7), (1, 1, 1), None, None),
    ("hunyuan 720p, window 9x12x12, dilation 2", (30, 48, 80), 24, 128, (9, 12, 12), (1, 1, 1), (2, 2, 2), None),
    ("wan 720p, window 9x21x35, causal frames", (21, 45, 80), 40, 128, (9, 21, 35), (1, 1, 1), None,
     (True, False, False)),
    ("flux 1024px 64x64, window 21x21", (64, 64), 24, 128, (21, 21), (1, 1), None, None),
    ("video 8x32x32, window 5x11x11", (8, 32, 32), 24, 128, (5, 11, 11), (1, 1, 1), None, None),
    ("image 128x128, window 31x31", (128, 128), 24, 128, (31, 31), (1, 1), None, None),
    ("video 16x32x64, window 9x15x15", (16, 32, 64), 24, 128, (9, 15, 15), (1, 1, 1), None, None),
    ("video 16x48x64, window 9x21x21", (16, 48, 64), 24, 128, (9, 21, 21), (1, 1, 1), None, None),
]


def gluon_tile(problem: Problem, head_dim: int) -> tuple[int, ...]:
    """natsim's 128-token tile of the layout that visits the fewest blocks."""
    tiles = [q for q, kv in tile_pairs(problem.shape, head_dim) if q == kv and math.prod(q) == 128]
    return min(tiles, key=lambda t: simulate(problem, TileConfig(t, t)).visited_tiles)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tag", default="")
    parser.add_argument("--cases", help="comma-separated row numbers (from 0) to run; all by default")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), rows=[])
    chosen = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    for name, layout, heads, head_dim, window, stride, dilation, causal in chosen:
        if window is None:
            plan = best(layout, 0.9, heads=heads, head_dim=head_dim, dtype="bf16")
            window, stride, dilation, causal = (plan.problem.window, plan.problem.stride, plan.problem.dilation,
                                                plan.problem.causal)
            bf16 = plan
        else:
            bf16 = None  # natsim's own choice of backend and tiles for the call
        ones = (1,) * len(layout)
        dilation, causal = dilation or ones, causal or (False,) * len(layout)
        problem = Problem(layout, window, stride, dilation, causal)
        geometry = dict(window=window, stride=stride, dilation=dilation, causal=causal)
        tile = gluon_tile(problem, head_dim)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, *layout, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        bf16_key = f"bf16 ({'plan, ' + bf16.backend if bf16 else 'natsim default'})"
        calls = {
            "gluon fp8": lambda: gna_attention(q, k, v, q_tile=tile, kv_tile=tile, precision="fp8",
                                               backend="gluon", **geometry),
            "triton fp8": lambda: gna_attention(q, k, v, precision="fp8", backend="triton", **geometry),
            "fp8 (natsim default)": lambda: gna_attention(q, k, v, precision="fp8", **geometry),
            bf16_key: (lambda: bf16(q, k, v)) if bf16 else (lambda: gna_attention(q, k, v, **geometry)),
        }
        outputs = {key: fn() for key, fn in calls.items()}
        rounds = interleaved(calls, args.rounds, 200.0, torch.cuda.synchronize)
        ms = {key: statistics.median(values) for key, values in rounds.items()}
        reference_key = bf16_key
        few = slice(0, 2)
        exact = reference_attention(*(t[..., few, :].float() for t in (q, k, v)), **geometry)
        gluon = outputs["gluon fp8"]
        visited = simulate(problem, TileConfig(tile, tile))
        triton_q, triton_kv, _ = fp8_tiles(problem, head_dim)  # the Triton FP8 kernel's tiles
        default = simulate(problem, TileConfig(triton_q, triton_kv))
        row = dict(case=name, gluon_block_heads=visited.visited_tiles * heads, layout=list(layout), heads=heads,
                   head_dim=head_dim, window=list(window), stride=list(stride), dilation=list(dilation),
                   causal=list(causal), gluon_tile=list(tile), gluon_visited=visited.visited_tiles,
                   gluon_full=visited.full_tiles, triton_tiles=[list(triton_q), list(triton_kv)],
                   triton_visited=default.visited_tiles, triton_full=default.full_tiles,
                   pairs_over_triton=(visited.visited_tiles * 128 * 128
                                      / (default.visited_tiles * math.prod(triton_q) * math.prod(triton_kv))),
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
