"""Mask plans per set of backends: does `best_mask` pick the fastest way to run a block mask, and how close is
its prediction?

For each case (a block mask at its fine blocks over N tokens, bf16, batch 1, inference), `natsim.planner.best_mask`
plans once per set of backends a user may have: natsim's Triton kernels alone ("triton"), with natsim's Gluon
kernel ("triton+gluon": Hopper without FlashAttention-4), every backend that runs here ("all": FlashAttention-4
where it is installed), and each backend alone (the best that backend does, by the cost model). Every distinct
plan is then run as the diffusers integration runs it, `plan(q, k, v)` on its own prepared work, checked against
natsim's Triton kernel on the same pooled mask (relative error under 1e-2), and the plans are timed together in
interleaved rounds (benchmarks/timing.interleaved; medians). Per case and set the table gives the pick, its
predicted and measured time, and the pick over the fastest plan timed among that set's backends (1.00: the
pick was the fastest of what the set could run).

    python benchmarks/mask_backends.py OUT_DIR [--cases random-128-0.7,clustered-16] [--rounds 7] [--tag=-x]

Writes OUT_DIR/mask-backends-<gpu>-<date><tag>.json with the device, versions, the cost model's GPU and every
plan's candidates.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (backends, timing)

from backends import clustered, random_mask  # noqa: E402
from timing import interleaved, rel, write_json  # noqa: E402

from natsim.kernels import sparse_attention  # noqa: E402
from natsim.kernels.backends import fa4 as fa4_backend  # noqa: E402
from natsim.planner import best_mask  # noqa: E402

HEADS = 24
CHECK_TOLERANCE = 1e-2
SETS = {"triton": ("triton",), "triton+gluon": ("triton", "gluon"), "all": None,
        "gluon alone": ("gluon",), "fa4 alone": ("fa4",)}


# name: (mask maker, fine block, N, head_dim)
CASES: dict[str, tuple[Callable[[], torch.Tensor], int, int, int]] = {
    "random-128-0.7": (lambda: random_mask(32768, HEADS, 0.7, seed=0), 128, 32768, 128),
    "random-128-0.9": (lambda: random_mask(32768, HEADS, 0.9, seed=0), 128, 32768, 128),
    "random-128-0.5-16k": (lambda: random_mask(16384, HEADS, 0.5, seed=0), 128, 16384, 128),
    "random-64-0.85": (lambda: random_mask(32768, HEADS, 0.85, block=64, seed=0), 64, 32768, 128),
    "random-128-0.7-d64": (lambda: random_mask(32768, HEADS, 0.7, seed=0), 128, 32768, 64),
    "clustered-16": (lambda: clustered(32768, HEADS), 16, 32768, 128),
}


def plans_of(mask: torch.Tensor, block: int, n: int, head_dim: int) -> tuple[dict, dict]:
    """(set name -> plan or the refusal's sentence, plan key -> plan): every set's plan, and the distinct ones."""
    by_set, distinct = {}, {}
    for name, backends in SETS.items():
        try:
            plan = best_mask(mask, block, block, n, heads=HEADS, head_dim=head_dim, dtype="bf16", backends=backends)
        except ValueError as refusal:  # a backend that does not run here, or is not priced: recorded
            by_set[name] = str(refusal)
            continue
        key = (plan.q_block, plan.kv_block, plan.merge, plan.backend)
        by_set[name] = distinct.setdefault(key, plan)
    return by_set, distinct


def label(key: tuple) -> str:
    q_block, kv_block, merge, backend = key
    return f"{q_block}x{kv_block} {merge} {backend}"


def run_case(name: str, rounds: int) -> dict:
    make, block, n, head_dim = CASES[name]
    mask = make()
    by_set, distinct = plans_of(mask, block, n, head_dim)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, n, HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    timers, errors = {}, {}
    for key, plan in distinct.items():
        call = (lambda plan=plan: plan(q, k, v))
        reference = sparse_attention(q, k, v, plan.mask, plan.q_block, plan.kv_block, backend="triton")
        errors[key] = rel(call(), reference)
        if errors[key] < CHECK_TOLERANCE:
            timers[key] = call
    ms = {key: statistics.median(times) for key, times in
          interleaved(timers, rounds, 200.0, torch.cuda.synchronize).items()}
    sets = {}
    for set_name, plan in by_set.items():
        if isinstance(plan, str):
            sets[set_name] = {"refused": plan}
            continue
        key = (plan.q_block, plan.kv_block, plan.merge, plan.backend)
        allowed = set(plan.backends)
        within = {other: t for other, t in ms.items() if other[3] in allowed}
        fastest = min(within, key=within.get) if within else None
        sets[set_name] = {
            "pick": label(key), "predicted_ms": plan.score * 1e3 if plan.calibrated else None,
            "measured_ms": ms.get(key), "fastest": None if fastest is None else label(fastest),
            "pick_over_fastest": None if key not in ms or fastest is None else within[fastest] / ms[key],
            "would_pick": None if plan.would_pick is None else plan.would_pick.backend,
            "candidates": [c.to_dict() for c in plan.candidates[:8]],
        }
    return {"case": name, "tokens": n, "fine_block": block, "head_dim": head_dim, "heads": HEADS,
            "density": float(mask.float().mean()), "plans_ms": {label(key): t for key, t in ms.items()},
            "relative_errors": {label(key): e for key, e in errors.items()}, "sets": sets}


def print_table(rows: list[dict]) -> None:
    print("| case | backends | pick | predicted ms | measured ms | error | fastest of the set | pick / fastest |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        for set_name, s in row["sets"].items():
            if "refused" in s:
                print(f"| {row['case']} | {set_name} | refused: {s['refused'][:80]} | | | | | |")
                continue
            predicted, measured = s["predicted_ms"], s["measured_ms"]
            error = "" if predicted is None or measured is None else f"{predicted / measured - 1:+.1%}"
            ratio = "" if s["pick_over_fastest"] is None else f"{s['pick_over_fastest']:.3f}"
            print(f"| {row['case']} | {set_name} | {s['pick']} | {predicted or 0:.3f} | {measured or 0:.3f} | {error} | "
                  f"{s['fastest']} | {ratio} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    device = torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "fa4_installed": fa4_backend.installed() is None,
              "rows": []}
    for name in names:
        row = run_case(name, args.rounds)
        result["rows"].append(row)
        print(json.dumps({key: row[key] for key in ("case", "plans_ms", "relative_errors")}), flush=True)
        torch.cuda.empty_cache()
    write_json(args.out, f"mask-backends-{device}-{result['date']}{args.tag}", result)
    print_table(result["rows"])


if __name__ == "__main__":
    main()
