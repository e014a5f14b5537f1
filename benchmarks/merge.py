"""Time query-tile merging (natsim.merging) on 7,200 x 7,200 tile masks, both methods.

The masks are what FG-Attn-style kernels with 16-token query tiles see on a 30x48x80 video latent
(115,200 tokens): the GNA mask of window 18x24x24 under 1-D tiling of 16 tokens and under 2x2x4
multi-D tiles, plus a random mask at 70% block sparsity (the paper's microbenchmark). Times are the
best of `--repeats` calls of `merge` on a warm (compiled) numba cache and include bit-packing the input.
Prints a table and writes `merge.json` into the output folder.

    .venv/bin/python benchmarks/merge.py [OUT_DIR] [--group 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numba
import numpy as np

from natsim import BlockMask, Problem, TileConfig, block_mask
from natsim.merging import METHODS, merge

SHAPE, WINDOW = (30, 48, 80), (18, 24, 24)


def masks() -> dict[str, BlockMask | np.ndarray]:
    """The benchmark masks by name, each 7,200 Q tiles x 7,200 KV tiles."""
    problem = Problem(SHAPE, window=WINDOW)
    gna_1d = block_mask(problem, TileConfig(16, 16, tiling="1d"))
    gna_multi = block_mask(problem, TileConfig((2, 2, 4), (2, 2, 4)))
    random = np.random.default_rng(0).random((gna_1d.num_q_tiles, gna_1d.num_kv_tiles)) < 0.3
    return {
        "gna 30x48x80 w18x24x24, 1-D tiles of 16": gna_1d,
        "gna 30x48x80 w18x24x24, 2x2x4 tiles": gna_multi,
        "random, density 0.3": random,
    }


def best_time(mask: BlockMask | np.ndarray, group: int, method: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        merge(mask, group, method)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="benchmarks/results", help="folder for merge.json")
    parser.add_argument("--group", type=int, default=8, help="Q tiles per merged group (R)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case; the best is kept")
    args = parser.parse_args()

    # Compile (or load from numba's cache) every specialisation before timing.
    tiny = np.eye(4, dtype=bool)
    for method in METHODS:
        merge(tiny, 2, method)
        merge(block_mask(Problem(8, window=3), TileConfig(2, 2, tiling="1d")), 2, method)

    records = []
    header = f"{'mask':<40} {'method':<12} {'seconds':>8} {'density':>15} {'objective':>10} {'speedup':>14}"
    print(f"group = {args.group}; density before -> after; tile speedup worst / mean\n{header}")
    for name, mask in masks().items():
        for method in METHODS:
            seconds = best_time(mask, args.group, method, args.repeats)
            result = merge(mask, args.group, method).to_dict()
            records.append({"mask": name, "seconds": seconds, **result})
            print(
                f"{name:<40} {method:<12} {seconds:>8.3f} "
                f"{result['density_before']:>6.3f} -> {result['density_after']:.3f} "
                f"{result['objective']:>10} "
                f"{result['tile_speedup']:>6.2f} / {result['tile_speedup_mean']:<5.2f}"
            )

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "natsim.merging",
        "repeats": args.repeats,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "numba": numba.__version__,
            "numpy": np.__version__,
        },
        "records": records,
    }
    path = out_dir / "merge.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
