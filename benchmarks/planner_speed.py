"""Time the planner on the CPU: `best` per layout (cold, a new layout in a warm process, a repeated call) and
`best_mask` on a Wan 480p mask (2048 x 2048 blocks of 16 tokens, 12 heads) and a smaller one.

- cold: the first call in a fresh Python process, after `import natsim.planner` (the import is reported apart);
  the median of `--cold` processes.
- warm, new layout: the call in a process that has planned before (numba compiled, modules loaded), with the
  planner's caches emptied first, so that nothing of this layout is remembered; the median of `--repeats`.
- repeat: the same call again, its plan remembered (what a model's next layer of the same layout costs); `best`
  only, since every mask is new.

Masks are random with clusters, like a predictor's (seeded): blocks of 4 x 4 kept at the given density, plus
scattered blocks. `--mask-device cuda` holds the masks on the GPU (as a pipeline's predictor leaves them; the
mask planner copies them to the host once) and `--masks-only` times `best_mask` alone. Run it on another planner
(an older tree on PYTHONPATH) with `--label before` to compare.
Prints a table and writes JSON with the machine, the versions and the load average into the output folder
(default benchmarks/results/planner-speed-<date>[-label].json).

    .venv/bin/python benchmarks/planner_speed.py [OUT_DIR] [--repeats 5] [--cold 3] [--label NAME]
        [--masks-only] [--mask-device cuda]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import natsim
import natsim.planner
from natsim.planner import best, best_mask

LAYOUTS = [  # (shape, target sparsity)
    ((30, 48, 80), 0.9),
    ((30, 48, 80), 0.56),
    ((16, 44, 80), 0.9),
    ((21, 45, 80), 0.9),
    ((13, 30, 45), 0.9),
    ((256, 256), 0.9),
    ((32768,), 0.9),
]
DEVICES = (None, "h100")
HEADS = 24
MASKS = {  # name: (query blocks = KV blocks, heads, density of the 4 x 4 clusters)
    "Wan 480p, 2048 x 2048 blocks of 16": (2048, 12, 0.1),
    "1024 x 1024 blocks of 16": (1024, 12, 0.1),
}
BLOCK = 16


def clustered_mask(blocks: int, heads: int, density: float, seed: int = 0) -> torch.Tensor:
    """A boolean `[1, heads, blocks, blocks]` mask: 4 x 4 clusters kept at `density`, plus scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    clusters = torch.rand(1, heads, -(-blocks // 4), -(-blocks // 4), generator=g) < density
    mask = clusters.repeat_interleave(4, 2).repeat_interleave(4, 3)[:, :, :blocks, :blocks].clone()
    return mask | (torch.rand(1, heads, blocks, blocks, generator=g) < density / 4)


def forget() -> None:
    """Empty every cache the planner and the simulator keep across calls (those this code base has)."""
    from natsim import dimension

    modules = [dimension, sys.modules.get("natsim.planner.search.gna"), sys.modules.get("natsim.planner.search.mask"),
               sys.modules.get("natsim.planner.cost.backward_features"), sys.modules.get("natsim.kernels.gna.backward"),
               sys.modules.get("natsim.kernels.gna.tiles"), sys.modules.get("natsim.partition")]
    for module in filter(None, modules):
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
    gc.collect()


def seconds(call, repeats: int, before=None) -> float:
    """The median seconds of `repeats` calls of `call` (each after `before()`, untimed)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


COLD = """
import json, time
start = time.perf_counter()
import torch
import natsim.planner as planner
imported = time.perf_counter()
{setup}
start_call = time.perf_counter()
{call}
print(json.dumps({{"import_s": imported - start, "call_s": time.perf_counter() - start_call}}))
"""


def cold(setup: str, call: str, processes: int) -> tuple[float, float]:
    """Median (import seconds, first-call seconds) over `processes` fresh interpreters (run outside the
    repository, so that PYTHONPATH decides which natsim they import)."""
    runs = []
    with tempfile.TemporaryDirectory() as where:
        for _ in range(processes):
            output = subprocess.run([sys.executable, "-c", COLD.format(setup=setup, call=call)], cwd=where,
                                    capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(output.strip().splitlines()[-1]))
    return (statistics.median(r["import_s"] for r in runs), statistics.median(r["call_s"] for r in runs))


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(natsim.__file__).resolve().parent,
                            capture_output=True, text=True).stdout.strip()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "torch": torch.__version__,
        "natsim": str(Path(natsim.__file__).resolve().parent.parent),
        "commit": commit or None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="benchmarks/results", help="folder for the JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per warm case (median kept)")
    parser.add_argument("--cold", type=int, default=3, help="fresh processes per cold case (median kept)")
    parser.add_argument("--label", default="", help="appended to the file name (e.g. before)")
    parser.add_argument("--masks-only", action="store_true", help="time best_mask only")
    parser.add_argument("--mask-device", default="cpu", help="where the masks live: cpu or cuda")
    args = parser.parse_args()

    load_before = os.getloadavg()
    best((12, 20, 24), 0.8, heads=HEADS, device="h100")  # load modules and numba's compiled functions
    best_mask(clustered_mask(64, 2, 0.1), BLOCK, BLOCK, 64 * BLOCK, device="h100")
    records = []
    for shape, target in [] if args.masks_only else LAYOUTS:
        for device in DEVICES:
            call = functools.partial(best, shape, target, heads=HEADS, device=device)
            record = {"function": "best", "case": f"{'x'.join(map(str, shape))} at {target}", "device": device,
                      "warm_new_layout_s": seconds(call, args.repeats, forget)}
            record["repeat_s"] = seconds(call, max(args.repeats, 10))
            record["import_s"], record["cold_s"] = cold(
                "", f"planner.best({shape!r}, {target!r}, heads={HEADS}, device={device!r})", args.cold)
            plan = call()
            record["pick"] = {"window": plan.problem.window, "stride": plan.problem.stride, "q_tile": plan.tiles.q_tile,
                              "kv_tile": plan.tiles.kv_tile, "kv_tiling": plan.tiles.kv_tiling, "score": plan.score}
            records.append(record)
            print(record, flush=True)
    for name, (blocks, heads, density) in MASKS.items():
        mask = clustered_mask(blocks, heads, density).to(args.mask_device)
        for device in DEVICES:
            call = functools.partial(best_mask, mask, BLOCK, BLOCK, blocks * BLOCK, device=device)
            record = {"function": "best_mask", "case": name, "device": device, "heads": heads,
                      "mask_device": args.mask_device, "mask_density": float(mask.float().mean()),
                      "warm_new_layout_s": seconds(call, args.repeats)}
            setup = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
                     f"from planner_speed import clustered_mask\n"
                     f"mask = clustered_mask({blocks}, {heads}, {density}).to({args.mask_device!r})\n"
                     "torch.cuda.synchronize() if mask.is_cuda else None")
            record["import_s"], record["cold_s"] = cold(
                setup, f"planner.best_mask(mask, {BLOCK}, {BLOCK}, {blocks * BLOCK}, device={device!r})", args.cold)
            plan = call()
            record["pick"] = {"q_block": plan.q_block, "kv_block": plan.kv_block, "merge": plan.merge,
                              "score": plan.score}
            records.append(record)
            print(record, flush=True)

    where = f"masks on {args.mask_device}"
    table = Table(title=f"planner speed on {os.cpu_count()} CPU cores, {where} (median seconds)", title_justify="left")
    for column in ("function", "case", "device", "cold (import apart)", "warm, new layout", "repeat", "pick"):
        table.add_column(column, justify="left" if column in ("function", "case", "pick") else "right")
    for r in records:
        pick = r["pick"]
        text = (f"{pick['q_block']}x{pick['kv_block']} {pick['merge']}" if r["function"] == "best_mask" else
                f"w {'x'.join(map(str, pick['window']))} s {'x'.join(map(str, pick['stride']))} "
                f"{pick['kv_tiling']}")
        table.add_row(r["function"], r["case"], str(r["device"]), f"{r['cold_s']:.3f} ({r['import_s']:.2f})",
                      f"{r['warm_new_layout_s']:.3f}", f"{r['repeat_s']:.4f}" if "repeat_s" in r else "", text)
    Console(width=160).print(table)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = out_dir / f"planner-speed-{date}{'-' + args.label if args.label else ''}.json"
    document = {"benchmark": f"natsim.planner speed (CPU planning, {where})", "date": date, "label": args.label,
                "repeats": args.repeats, "cold_processes": args.cold, "heads": HEADS, "machine": machine(),
                "load_average_before_after": [list(load_before), list(os.getloadavg())], "records": records}
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
