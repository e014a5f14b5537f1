"""Where natsim keeps a model's own attention: the compiled step of diffusers models with their own attention,
with `natsim.integrations.diffusers.apply` as a user calls it (the verdict per layout: natsim's call or the
model's, planner/plans/verdict.py), and with natsim's route forced on every layout (`keep_own=False`), one run,
one JSON:

    python benchmarks/keep_own.py --out DIR [--cases sd3-1024,pixart-sigma-1024,wan-480p] [--steps 5] [--repeats 3]
                                  [--mode reduce-overhead]
    python benchmarks/keep_own.py --out /tmp/x --small      # CPU smoke test: tiny models

The models and their inputs are benchmarks/diffusers_step.py's cases (random weights, bf16, batch 1, its layer
counts), compiled as there (repeated blocks, or the whole model). The rule is right on a case when the default
step is within noise of the faster of the other two. Medians of `--steps` timed steps after warm-up. The table
prints each step, the verdict (`serves`: natsim's call; `keeps`: the model's) with its priced seconds, and the
default's time over the faster of the other two. `--repeats R` runs the three configurations of each case R times
in turn (own, default, forced, own, ...), which shows how far two timings of one configuration differ in one
process: the margin a verdict can be checked at. `--mode reduce-overhead` compiles every configuration with CUDA
graphs, which take the host's issue out of the step. Writes `diffusers-keep-own-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Optional

import torch

from diffusers_step import CASES, DEVICE, build, compiled_step_ms, fresh, inputs, run_header, small_case
from natsim.integrations import diffusers as nd

DEFAULT_CASES = ("sd3-1024", "pixart-sigma-1024", "cogview4-1024", "qwenimage-1024", "wan-480p")


def run_case(name: str, steps: int, small: bool, repeat: int = 0, mode: Optional[str] = None) -> dict:
    cls_name, config, layout, text, options = small_case(name) if small else CASES[name]
    torch.manual_seed(0)
    model = build(cls_name, config)
    args = inputs(cls_name, config, layout, text)
    record = dict(case=name, repeat=repeat, model=cls_name, layout=list(layout), text_tokens=text, mode=mode)
    record["own_ms"], own_out, _ = compiled_step_ms(model, args, steps, mode)
    for label, keep_own in (("default", True), ("served", False)):
        fresh()
        applied = nd.apply(model, **options, keep_own=keep_own)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with torch.no_grad():
                model(**args)  # the layout's verdict, made outside the compiled graph (its first call)
        record[f"{label}_ms"], out, record[f"{label}_graph_break"] = compiled_step_ms(model, args, steps, mode)
        record[f"{label}_relative_difference"] = float((out.float() - own_out.float()).norm() / own_out.float().norm())
        if keep_own:
            verdicts = list(applied.verdicts.values())
            record["verdicts"] = [dict(layout=list(v.layout), serves=v.serves, natsim_s=v.natsim_s, own_s=v.own_s)
                                  for v in verdicts]
            record["warnings"] = [str(w.message) for w in said if "own attention" in str(w.message)]
        nd.remove(model)
        fresh()
    record["default_over_best"] = record["default_ms"] / min(record["own_ms"], record["served_ms"])
    return record


def print_table(records: list) -> None:
    print(f"\n{'case':20s} {'own ms':>8s} {'default ms':>10s} {'served ms':>10s} {'verdict':>8s} "
          f"{'natsim s':>10s} {'own s':>10s} {'default/best':>12s}")
    for r in records:
        v = r["verdicts"][0] if r["verdicts"] else dict(serves=True, natsim_s=None, own_s=None)
        priced = (f"{v['natsim_s'] * 1e3:10.3f} {v['own_s'] * 1e3:10.3f}" if v["natsim_s"] is not None
                  else f"{'-':>10s} {'-':>10s}")
        print(f"{r['case']:20s} {r['own_ms']:8.2f} {r['default_ms']:10.2f} {r['served_ms']:10.2f} "
              f"{'serves' if v['serves'] else 'keeps':>8s} {priced} {r['default_over_best']:12.3f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, from {', '.join(CASES)} (default: {','.join(DEFAULT_CASES)})")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    parser.add_argument("--repeats", type=int, default=1, help="times each case's three configurations run in turn")
    parser.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                        help="torch.compile's mode for every configuration (reduce-overhead: CUDA graphs)")
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU (a smoke test of the script)")
    args = parser.parse_args(argv)
    mode = None if args.mode == "default" else args.mode
    names = args.cases.split(",")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if DEVICE != "cuda" and not args.small:
        parser.error("the steps are timed on a CUDA GPU; pass --small for the CPU smoke test")
    args.out.mkdir(parents=True, exist_ok=True)
    result, path = run_header("keep-own", args.out)
    for name in names:
        for repeat in range(args.repeats):
            print(f"{name} ({repeat + 1} of {args.repeats}) ...", flush=True)
            result["records"].append(run_case(name, args.steps, args.small, repeat, mode))
            path.write_text(json.dumps(result, indent=2))
    print_table(result["records"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
