"""benchmarks/refit_gna.py: a calibration's measurements refitted with this version's features, on the CPU."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from natsim.planner import FEATURES, cost_model_for
from natsim.planner.cost.calibrate import calibration_cases, case_features
from natsim.planner.cost.model import CostModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import refit_gna  # noqa: E402

TRUTH = {"full_flops": 1 / 550e12, "masked_flops": 1 / 300e12, "narrow_q_flops": 1 / 4000e12,
         "narrow_kv_flops": 1 / 3000e12, "narrow_head_flops": 1 / 2000e12, "split_head_flops": 1 / 8000e12,
         "kv_tile_visits": 1e-9, "programs": 1e-8, "permute_bytes": 1 / 2.5e12, "launch": 2e-5}


def test_refit_recovers_the_coefficients_and_keeps_the_base_models_other_sets(tmp_path):
    cases = calibration_cases()
    seconds = case_features(cases, torch.bfloat16) @ np.array([TRUTH[name] for name in FEATURES])
    measurements = [dict(shape=list(c.problem.shape), window=list(c.problem.window), stride=list(c.problem.stride),
                         dilation=list(c.problem.dilation), causal=list(c.problem.causal), q_tile=list(c.tiles.q_tile),
                         kv_tile=list(c.tiles.kv_tile), tiling=c.tiles.tiling, kv_tiling=c.tiles.kv_tiling,
                         heads=c.heads, head_dim=c.head_dim, measured_s=float(s)) for c, s in zip(cases, seconds)]
    base = replace(cost_model_for("NVIDIA H100 80GB HBM3"), gpu="Fake GPU")
    base.save(tmp_path / "base.json")
    record = {"model": {"gpu": "Fake GPU", "info": {"date": "2026-11-28"}}, "measurements": measurements}
    (tmp_path / "calibration.json").write_text(json.dumps(record))
    refit_gna.main([str(tmp_path / "calibration.json"), "--base", str(tmp_path / "base.json"),
                    "--output", str(tmp_path / "out.json")])
    model = CostModel.load(tmp_path / "out.json")
    for name in FEATURES:
        assert model.coefficients[name] == pytest.approx(TRUTH[name], rel=1e-6), name
    assert model.info["max_abs_relative_error"] < 1e-9 and model.info["cases"] == len(cases)
    assert model.backward_coefficients == base.backward_coefficients and model.fa4_coefficients == base.fa4_coefficients
    assert model.info["extended"][-1]["kernels"] == ["gna"] and "2026-11-28" in model.info["extended"][-1]["refit"]
    record["model"]["gpu"] = "Other GPU"
    (tmp_path / "calibration.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="the measurements are of Other GPU, the base model of Fake GPU"):
        refit_gna.main([str(tmp_path / "calibration.json"), "--base", str(tmp_path / "base.json"),
                        "--output", str(tmp_path / "out.json")])


def test_check_predicts_the_measured_configurations_under_both_models(capsys):
    """`--check`'s rows: each configuration's error is its prediction (the cost model on the simulator's features
    of that configuration) over the measured time, under the base model and the refit one."""
    base = cost_model_for("NVIDIA H100 80GB HBM3")
    refit = replace(base, coefficients={name: 2 * value for name, value in base.coefficients.items()})
    case = next(c for c in calibration_cases()  # predict_headdims.py's rows carry no dilation or causal flags
                if c.problem.dilation == (1,) * c.problem.ndim and not any(c.problem.causal))
    seconds = float(base.predict(case_features([case], torch.bfloat16))[0])
    row = dict(layout="a layout", shape=list(case.problem.shape), window=list(case.problem.window),
               stride=list(case.problem.stride), q_tile=list(case.tiles.q_tile), kv_tile=list(case.tiles.kv_tile),
               kv_tiling=case.tiles.kv_tiling, heads=case.heads, head_dim=case.head_dim, measured_ms=seconds * 1e3)
    refit_gna.check([row], base, refit, torch.bfloat16)
    printed = capsys.readouterr().out
    assert "+0.0% base, +100.0% refit" in printed and "out of sample, refit: median |error| 100.0%" in printed
