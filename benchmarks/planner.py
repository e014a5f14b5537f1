"""The planner, measured: how long `best` takes on the CPU, and (with --gpu) how good its picks are.

    python benchmarks/planner.py benchmarks/results          # CPU: planning time
    python benchmarks/planner.py benchmarks/results --gpu    # also: time the top candidates on the GPU

CPU (target: under 1 s for 3-D layouts up to 30x48x80): per case, a cold call (simulator caches cleared
first, as in a fresh process after import) and the median of warm calls, with the plan's choice.
Writes planner.json.

GPU (how good the picks are): per case (HunyuanVideo-like 30x48x80 and 16x44x80 at sparsity 0.56 and 0.9,
FLUX-like 256x256 at 0.9; 24 heads, head_dim 128, bf16), the plan's pick and its top-20 scored
candidates are timed with `gna_attention` (permutation included) in interleaved rounds; reported:
whether the pick is within 5% of the fastest measured, and the median |predicted - measured| / measured
when the GPU has a cost model. Writes planner_gpu.json. Prints a table last.

    python benchmarks/planner.py DIR --gpu --random 8 --seed 0

times instead N layouts drawn at random (seeded, `random_cases`: 1-D to 3-D, 2,048 to 120,000 tokens, 12 to 48
heads, head_dim 64 or 128): the pick and the top five of each, the pick's prediction error, the median and
largest over the five, and the pick over the fastest measured. Writes planner_gpu_random_seed<S>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np
import rich.console
import torch
from rich.table import Table

import natsim
from natsim.dimension import dim_attended_pairs, dim_tiles
from natsim.planner import Candidate, best
from natsim.planner.cost.calibrate import Case, time_case

CASES = (
    ((30, 48, 80), 0.9),
    ((30, 48, 80), 0.56),
    ((16, 44, 80), 0.9),
    ((16, 44, 80), 0.56),
    ((32, 32, 32), 0.9),
    ((256, 256), 0.9),
    ((32768,), 0.9),
)
WARM_CALLS = 5
GPU_CASES = (((30, 48, 80), 0.56), ((30, 48, 80), 0.9), ((16, 44, 80), 0.56), ((16, 44, 80), 0.9), ((256, 256), 0.9))
GPU_HEADS, GPU_HEAD_DIM = 24, 128
ROUNDS, GPU_REPEATS = 3, 10


def fmt(values) -> str:
    return "x".join(str(v) for v in values)


def measure(shape, sparsity) -> dict:
    dim_tiles.cache_clear()
    dim_attended_pairs.cache_clear()
    start = time.perf_counter()
    plan = best(shape, sparsity, heads=24, device="cpu")
    cold = time.perf_counter() - start
    warm = []
    for _ in range(WARM_CALLS):
        start = time.perf_counter()
        again = best(shape, sparsity, heads=24, device="cpu")
        warm.append(time.perf_counter() - start)
    assert again == plan, "best() must be deterministic"
    assert plan.sparsity >= sparsity
    return {
        "shape": list(shape),
        "target_sparsity": sparsity,
        "cold_s": cold,
        "warm_median_s": statistics.median(warm),
        "configurations_scored": plan.search.scored,
        "window": list(plan.problem.window),
        "stride": list(plan.problem.stride),
        "q_tile": list(plan.tiles.q_tile),
        "kv_tile": list(plan.tiles.kv_tile),
        "kv_tiling": plan.tiles.kv_tiling,
        "sparsity": plan.sparsity,
        "tile_speedup": plan.tile_speedup,
        "block_sparse": plan.simulation.block_sparse,
        "basis": plan.basis,
    }


def random_cases(count: int, seed: int) -> list[tuple]:
    """`count` problems drawn (seeded) from a wide range, none of them a named model's layout: 3-D video layouts
    (60%), 2-D images (25%) and 1-D sequences (15%) of 2,048 to 120,000 tokens, 12 to 48 heads, head_dim 64 or
    128, target sparsity 0.5 to 0.95. Each is `(shape, sparsity, heads, head_dim)`."""
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        rank = int(rng.choice([3, 2, 1], p=[0.6, 0.25, 0.15]))
        if rank == 3:
            shape = (int(rng.integers(4, 33)), int(rng.integers(12, 65)), int(rng.integers(16, 97)))
        elif rank == 2:
            shape = (int(rng.integers(32, 257)), int(rng.integers(32, 257)))
        else:
            shape = (int(rng.integers(2048, 65537)),)
        if not 2048 <= int(np.prod(shape)) <= 120_000:
            continue
        cases.append((shape, float(rng.choice([0.5, 0.75, 0.9, 0.95])), int(rng.choice([12, 16, 24, 32, 48])),
                      int(rng.choice([64, 128]))))
    return cases


def _settings(c: Candidate) -> tuple:
    """What a candidate runs: its configuration and the backend that runs it."""
    return c.window, c.stride, c.q_tile, c.kv_tile, c.kv_tiling, c.backend


def measure_gpu(shape, sparsity, heads: int = GPU_HEADS, head_dim: int = GPU_HEAD_DIM,
                top: Optional[int] = None) -> dict:
    """Time the plan's top candidates (all it keeps, or the first `top`) and its pick on the current CUDA device.

    Every candidate is timed once per round (ROUNDS rounds, each in another order, each timing the median
    of at least GPU_REPEATS calls) and keeps the median of its rounds: drift of the clocks over the run then
    falls on all candidates alike instead of on whichever came last.
    """
    plan = best(shape, sparsity, heads=heads, head_dim=head_dim, dtype=torch.bfloat16)
    device = torch.device("cuda", torch.cuda.current_device())
    pick = (plan.problem.window, plan.problem.stride, plan.tiles.q_tile, plan.tiles.kv_tile, plan.tiles.kv_tiling,
            plan.backend)
    timed = list(plan.search.top)[:top]
    if all(_settings(c) != pick for c in timed):
        timed.append(Candidate(*pick[:4], plan.score, plan.sparsity, plan.tile_speedup, plan.simulation.block_sparse,
                               pick[4], backend=pick[5]))
    cases = [
        Case(natsim.Problem(shape, c.window, c.stride), natsim.TileConfig(c.q_tile, c.kv_tile, kv_tiling=c.kv_tiling),
             heads, head_dim)
        for c in timed
    ]
    rounds: list[list[float]] = [[] for _ in cases]
    for r in range(ROUNDS):
        shift = r * len(cases) // ROUNDS  # each round starts at another candidate
        for i in [*range(shift, len(cases)), *range(shift)]:
            rounds[i].append(time_case(cases[i], torch.bfloat16, device, min_repeats=GPU_REPEATS,
                                       backend=timed[i].backend))
    candidates = [
        {**c.to_dict(), "measured_s": statistics.median(times), "rounds_s": times} for c, times in zip(timed, rounds)
    ]
    chosen = next(c for c, t in zip(candidates, timed) if _settings(t) == pick)
    fastest = min(c["measured_s"] for c in candidates)
    errors = [abs(c["score"] - c["measured_s"]) / c["measured_s"] for c in candidates] if plan.calibrated else []
    return {
        "shape": list(shape),
        "target_sparsity": sparsity,
        "heads": heads,
        "head_dim": head_dim,
        "basis": plan.basis,
        "gpu": plan.gpu,
        "pick_backend": plan.backend,
        "pick_predicted_s": chosen["score"] if plan.calibrated else None,
        "pick_prediction_error": (chosen["score"] - chosen["measured_s"]) / chosen["measured_s"]
        if plan.calibrated else None,
        "max_abs_prediction_error": max(errors) if errors else None,
        "pick_over_fastest": chosen["measured_s"] / fastest,
        "pick_within_3_percent": chosen["measured_s"] <= 1.03 * fastest,
        "pick_measured_s": chosen["measured_s"],
        "fastest_measured_s": fastest,
        "pick_within_5_percent": chosen["measured_s"] <= 1.05 * fastest,
        "median_abs_prediction_error": statistics.median(errors) if errors else None,
        "candidates": candidates,
    }


def gpu_table(rows) -> Table:
    table = Table(title=f"planner picks timed on {torch.cuda.get_device_name()} ({rows[0]['basis']})")
    for name in ("shape", "sparsity", "heads x dim", "backend", "pick ms", "fastest ms", "pick / fastest", "pick pred err",
                 "median / max |pred err|"):
        table.add_column(name, justify="right")
    for r in rows:
        error, largest, own = (r["median_abs_prediction_error"], r["max_abs_prediction_error"],
                               r["pick_prediction_error"])
        table.add_row(
            fmt(r["shape"]),
            f"{r['target_sparsity']:g}",
            f"{r['heads']} x {r['head_dim']}",
            r["pick_backend"],
            f"{r['pick_measured_s'] * 1e3:.2f}",
            f"{r['fastest_measured_s'] * 1e3:.2f}",
            f"{r['pick_over_fastest']:.3f}",
            "-" if own is None else f"{own:+.1%}",
            "-" if error is None else f"{error:.1%} / {largest:.1%}",
        )
    return table


def machine() -> dict:
    return {
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "natsim": natsim.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for planner.json (and planner_gpu.json)")
    parser.add_argument("--gpu", action="store_true", help="also time the top candidates on the CUDA GPU")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="with --gpu: time the top five and the pick of N random layouts (random_cases) instead "
                             "of the named ones")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random's layouts")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA GPU (torch.cuda.is_available() is False).")
    args.out.mkdir(parents=True, exist_ok=True)
    best((8, 8), 0.5, device="cpu")  # first use: numpy and the package's own imports
    rows = [measure(shape, sparsity) for shape, sparsity in CASES]
    record = {"benchmark": "planner.best on CPU", "date": datetime.date.today().isoformat(), "machine": machine(), "results": rows}
    (args.out / "planner.json").write_text(json.dumps(record, indent=2) + "\n")
    console = rich.console.Console(width=150)
    if args.gpu:
        gpu_rows = []
        gpu_record = {
            "benchmark": "planner picks timed on the GPU",
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "triton": __import__("triton").__version__,
            "rounds": ROUNDS,
            "min_repeats_per_round": GPU_REPEATS,
            "results": gpu_rows,
        }
        cases = ([(shape, sparsity, GPU_HEADS, GPU_HEAD_DIM) for shape, sparsity in GPU_CASES] if not args.random
                 else random_cases(args.random, args.seed))
        name = "planner_gpu.json" if not args.random else f"planner_gpu_random_seed{args.seed}.json"
        gpu_record.update(seed=args.seed if args.random else None)
        for shape, sparsity, heads, head_dim in cases:  # written after every case: a cut-off run keeps its rows
            gpu_rows.append(measure_gpu(shape, sparsity, heads, head_dim, top=5 if args.random else None))
            (args.out / name).write_text(json.dumps(gpu_record, indent=2) + "\n")
            console.print(f"timed {fmt(shape)} at sparsity {sparsity:g}, {heads} heads x {head_dim}")

    table = Table(title=f"natsim.planner.best on {os.cpu_count()} CPUs (written to {args.out / 'planner.json'})")
    for name in ("shape", "sparsity", "cold s", "warm s", "scored", "window", "stride", "Q / KV tile", "tile speedup"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            fmt(r["shape"]),
            f"{r['target_sparsity']:g} -> {r['sparsity']:.4f}",
            f"{r['cold_s']:.3f}",
            f"{r['warm_median_s']:.3f}",
            f"{r['configurations_scored']:,}",
            fmt(r["window"]),
            fmt(r["stride"]),
            f"{fmt(r['q_tile'])} / {fmt(r['kv_tile'])}",
            f"{r['tile_speedup']:.2f}x" + (" (block-sparse)" if r["block_sparse"] else ""),
        )
    console.print(table)
    if args.gpu:
        console.print(gpu_table(gpu_rows))


if __name__ == "__main__":
    main()
