"""Time natsim's sweeps and simulator on this machine; print a table and write JSON.

    python benchmarks/sweep.py [OUTPUT_DIR]      (default: benchmarks/results)

The issue's bar: a sweep of every stride of 30x48x80 / 18x24x24 with one tile configuration
(10,368 configurations) in under 2 s on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import natsim
from natsim import Problem, TileConfig, simulate, sweep
from natsim.dimension import dim_tiles


def median_seconds(fn, repeats: int = 5, fresh_cache: bool = True) -> float:
    times = []
    for _ in range(repeats):
        if fresh_cache:
            dim_tiles.cache_clear()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    shape, window = (30, 48, 80), (18, 24, 24)
    paper_tiles = TileConfig((4, 8, 8), (2, 8, 8))
    one_d = TileConfig(128, 128, tiling="1d")
    simulate(Problem((8, 8), 3), TileConfig(8, 8, tiling="1d"))  # compile the numba 1-D counter first

    cases = [
        ("sweep, every stride, 1 tile config (10,368 configs)",
         lambda: sweep(shape, window, tiles=[paper_tiles]), 10_368),
        ("sweep, every stride, default catalog",
         lambda: sweep(shape, window), None),
        ("simulate, multi-D, stride 1x1x1",
         lambda: simulate(Problem(shape, window, 1), paper_tiles), 1),
        ("simulate, 1-D tiling 128/128, stride 1x1x1",
         lambda: simulate(Problem(shape, window, 1), one_d), 1),
        ("block_mask, multi-D, stride 1x1x1",
         lambda: natsim.block_mask(Problem(shape, window, 1), paper_tiles), 1),
    ]
    rows = []
    for name, fn, configs in cases:
        seconds = median_seconds(fn, repeats=3 if "1-D" in name or "catalog" in name else 5)
        if configs is None:
            configs = len(sweep(shape, window))
        rows.append({"case": name, "median_s": seconds, "configurations": configs})

    record = {
        "benchmark": "sweep",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "natsim": natsim.__version__,
        "rows": rows,
    }
    path = out_dir / "sweep-cpu.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'case':58} {'median':>10} {'configs':>10}")
    for row in rows:
        print(f"{row['case']:58} {row['median_s']:9.3f}s {row['configurations']:>10,}")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
