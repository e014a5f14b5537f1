"""Refit the GNA kernel's cost-model coefficients to measurements `natsim calibrate --json` printed, with the
features of this version of natsim, on the CPU:

    python benchmarks/refit_gna.py CALIBRATION.json --base planner/cost/coefficients/nvidia-h200.json \\
        --output planner/cost/coefficients/nvidia-h200.json

For a change of the features (a new one, a cost counted differently) after a GPU calibration: the measured
seconds per case stay what the GPU measured; each case's feature row is computed again (`case_features`), the
host-bound cases are left out as `natsim calibrate` leaves them, and the fit replaces the base model's GNA
coefficients and their error figures in its info, keeping its other sets and host times. The info records the
refit under "extended" (with the calibration's date). Prints the errors per head dim. `--check PREDICTIONS.json`
(what benchmarks/predict_headdims.py wrote: plans measured on layouts calibration did not time) prints each of its
measured configurations' error under the base model and under the refit one, out of sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from natsim import Problem, TileConfig
from natsim.planner.cost.calibrate import HOST_BOUND_S, Case, _error_info, _fit, case_features
from natsim.planner.cost.features import FEATURES
from natsim.planner.cost.model import CostModel


def measured_cases(measurements: list[dict]) -> tuple[list[Case], np.ndarray]:
    """The GNA cases of `natsim calibrate --json`'s "measurements" and their measured seconds."""
    cases = [Case(Problem(m["shape"], m["window"], m["stride"], m["dilation"], m["causal"]),
                  TileConfig(m["q_tile"], m["kv_tile"], m["tiling"], m["kv_tiling"]), m["heads"], m["head_dim"])
             for m in measurements]
    return cases, np.array([m["measured_s"] for m in measurements])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calibration", type=Path, help="what `natsim calibrate --kernels gna --json` printed")
    parser.add_argument("--base", type=Path, required=True, help="the cost model whose GNA coefficients to replace")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--check", type=Path, help="predict_headdims.py's JSON: its configurations predicted again")
    args = parser.parse_args(argv)
    record = json.loads(args.calibration.read_text())
    cases, seconds = measured_cases(record["measurements"])
    base = CostModel.load(args.base)
    if record["model"]["gpu"] != base.gpu:
        raise SystemExit(f"the measurements are of {record['model']['gpu']}, the base model of {base.gpu}.")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    features = case_features(cases, dtype)  # a GPU with tensor descriptors: what natsim calibrate ran on
    coefficients, errors, fitted = _fit(features, seconds, FEATURES, "GNA")
    info = dict(base.info)
    info.update(_error_info("", errors, fitted))
    dynamic = np.array([case.tiles.kv_tiling == "dynamic" for case in cases])
    info.update(_error_info("dynamic_", errors[dynamic], fitted[dynamic]))
    measured_on = record["model"]["info"].get("extended", [{}])[-1].get("date", record["model"]["info"].get("date"))
    earlier = info.get("extended", [])
    info["extended"] = [*([earlier] if isinstance(earlier, dict) else earlier),
                        {"date": datetime.date.today().isoformat(), "kernels": ["gna"],
                         "refit": f"measurements of {measured_on} ({args.calibration.name}), features of this version"}]
    model = replace(base, coefficients=coefficients, info=info)
    model.save(args.output)
    head_dims = np.array([case.head_dim for case in cases])
    print(f"GNA refit on {int(fitted.sum())} cases ({int((~fitted).sum())} host-bound left out, under "
          f"{HOST_BOUND_S * 1e3:g} ms): median |error| {np.median(np.abs(errors[fitted])):.1%}, "
          f"max {np.abs(errors[fitted]).max():.1%}; written to {args.output}")
    for head_dim in sorted(set(head_dims.tolist())):
        chosen = fitted & (head_dims == head_dim)
        if not chosen.any():
            print(f"  head_dim {head_dim:3d}: every case host-bound")
            continue
        print(f"  head_dim {head_dim:3d}: {int(chosen.sum()):2d} cases, median |error| "
              f"{np.median(np.abs(errors[chosen])):.1%}, max {np.abs(errors[chosen]).max():.1%}")
    print({name: f"{value:.4e}" for name, value in coefficients.items()})
    if args.check is not None:
        check(json.loads(args.check.read_text())["rows"], base, model, dtype)


def check(rows: list[dict], base: CostModel, refit: CostModel, dtype: torch.dtype) -> None:
    """Each measured configuration of `rows` (benchmarks/predict_headdims.py) predicted by both models."""
    cases = [Case(Problem(r["shape"], r["window"], r["stride"]), TileConfig(r["q_tile"], r["kv_tile"],
                                                                            kv_tiling=r["kv_tiling"]),
                  r["heads"], r["head_dim"]) for r in rows]
    features = case_features(cases, dtype)
    measured = np.array([r["measured_ms"] for r in rows]) * 1e-3
    errors = {name: model.predict(features) / measured - 1 for name, model in (("base", base), ("refit", refit))}
    for i, r in enumerate(rows):
        print(f"  {r['layout']:13s} head_dim {r['head_dim']:3d}: measured {r['measured_ms']:7.2f} ms, error "
              f"{errors['base'][i]:+.1%} base, {errors['refit'][i]:+.1%} refit")
    for name, e in errors.items():
        print(f"  out of sample, {name}: median |error| {np.median(np.abs(e)):.1%}, max {np.abs(e).max():.1%}")


if __name__ == "__main__":
    main()
