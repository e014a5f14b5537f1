"""How long the host takes to issue a compiled diffusers step, against the step itself, for the model's own
attention and natsim's route, over fresh compilations of one case, one run, one JSON:

    python benchmarks/step_issue.py --out DIR [--case sd3-1024] [--trials 4] [--steps 9]
    python benchmarks/step_issue.py --out /tmp/x --small      # CPU smoke test: a tiny model

A step is host-bound where issuing it (the wall time until the forward call returns, before synchronising)
takes as long as the step: then every microsecond the host spends per attention call is step time, and a host
slower in one compilation than in another moves the whole step. Per compilation (`--trials` of each, alternating:
own, natsim, own, ...): the median step and issue times of `--steps` steps with the garbage collector off, each
step's time, and the CUDA allocator's device allocations over the timed steps (none means the cache served
them). The case is one of benchmarks/diffusers_step.py's, natsim forced on it (`keep_own=False`). Writes
`diffusers-step-issue-<case>-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from diffusers_step import CASES, DEVICE, build, compile_step, fresh, inputs, run_header, small_case, synchronize
from natsim.integrations import diffusers as nd

WARMUP = 3


def timed_compilation(model, args: dict, steps: int) -> dict:
    """One fresh compilation of `model`: its steps' wall and issue times, and the allocator's device
    allocations while they ran."""
    fresh()
    with torch.no_grad():
        model(**args)  # natsim plans the layout on its first call, outside the compiled graph
        run = compile_step(model)
        for _ in range(WARMUP):
            run(**args)
        synchronize()
        gc.collect()
        gc.disable()
        try:
            allocations = torch.cuda.memory_stats().get("num_device_alloc", 0) if DEVICE == "cuda" else 0
            issue, total = [], []
            for _ in range(steps):
                start = time.perf_counter()
                run(**args)
                issued = time.perf_counter()
                synchronize()
                issue.append((issued - start) * 1e3)
                total.append((time.perf_counter() - start) * 1e3)
            if DEVICE == "cuda":
                allocations = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocations
        finally:
            gc.enable()
    return dict(step_ms=statistics.median(total), issue_ms=statistics.median(issue),
                steps_ms=[round(t, 3) for t in total], device_allocations=allocations)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--case", default="sd3-1024", help=f"one of {', '.join(CASES)}")
    parser.add_argument("--trials", type=int, default=4, help="fresh compilations of each configuration")
    parser.add_argument("--steps", type=int, default=9, help="timed steps per compilation (median)")
    parser.add_argument("--small", action="store_true", help="a tiny model on the CPU (a smoke test of the script)")
    args = parser.parse_args(argv)
    if args.case not in CASES:
        parser.error(f"unknown case {args.case!r}; known: {', '.join(CASES)}")
    if args.trials < 1 or args.steps < 1:
        parser.error("--trials and --steps must be at least 1")
    if DEVICE != "cuda" and not args.small:
        parser.error("the steps are timed on a CUDA GPU; pass --small for the CPU smoke test")
    cls_name, config, layout, text, options = small_case(args.case) if args.small else CASES[args.case]
    torch.manual_seed(0)
    model = build(cls_name, config)
    call = inputs(cls_name, config, layout, text)
    args.out.mkdir(parents=True, exist_ok=True)
    result, path = run_header(f"step-issue-{args.case}", args.out)
    for trial in range(args.trials):
        for label in ("own", "natsim"):
            if label == "natsim":
                nd.apply(model, **options, keep_own=False)
            record = dict(case=args.case, trial=trial, attention=label, **timed_compilation(model, call, args.steps))
            if label == "natsim":
                nd.remove(model)
            result["records"].append(record)
            path.write_text(json.dumps(result, indent=2))
            print(f"{label:7s} trial {trial}: step {record['step_ms']:7.2f} ms, issue {record['issue_ms']:7.2f} ms, "
                  f"device allocations {record['device_allocations']}", flush=True)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
