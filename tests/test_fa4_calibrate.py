"""`natsim calibrate --kernels fa4,fa4-backward` on the CPU, its GPU faked: the cases FlashAttention-4 runs (and
those whose backward it runs) separate every feature, the fit recovers known coefficients and extends the stored
model, the timed calls go through natsim's entry points with backend="fa4", and a GPU where FlashAttention-4 does
not run is refused with its sentence."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from natsim import Problem
from natsim.kernels.backends import fa4 as fa4_backend
from natsim.planner import CostModel
from natsim.planner.cost import calibrate as calibration
from natsim.planner.cost import fa4_calibrate
from natsim.planner.cost.fa4_calibrate import (Fa4GnaCase, Fa4MaskCase, fa4_backward_calibration_cases,
                                               fa4_calibration_cases, fa4_case_features)
from natsim.planner.cost.fa4_features import FA4_FEATURES

FORWARD = {"full_flops": 1.4e-15, "masked_flops": 1.9e-14, "narrow_head_flops": 4e-16, "tiles": 2e-9,
           "programs": 2e-8, "permute_bytes": 4e-13, "launch": 5e-5}
BACKWARD = {name: 2.5 * value for name, value in FORWARD.items()}
GNA = {"full_flops": 1 / 550e12, "masked_flops": 1 / 300e12, "narrow_q_flops": 1 / 4000e12,
       "narrow_kv_flops": 1 / 3000e12, "narrow_head_flops": 1 / 2000e12, "split_head_flops": 1 / 8000e12,
       "kv_tile_visits": 1e-9, "programs": 1e-8,
       "permute_bytes": 1 / 2.5e12, "launch": 2e-5}


def known_time(coefficients: dict):
    truth = np.array([coefficients[name] for name in FA4_FEATURES])
    return lambda case, dtype, device: float(fa4_case_features([case], dtype)[0] @ truth)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU FlashAttention-4 runs on, timed by known coefficients, with a stored model to extend."""
    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fa4_backend, "device_refusal", lambda device: None)
    monkeypatch.setattr(calibration, "time_fa4_case", known_time(FORWARD))
    monkeypatch.setattr(calibration, "time_fa4_backward_case", known_time(BACKWARD))
    CostModel("Fake GPU", GNA, {"cases": 7}).save(calibration.default_path("Fake GPU"))


def test_every_case_runs_on_flashattention4_and_each_set_separates_every_feature():
    cases, backward = fa4_calibration_cases(), fa4_backward_calibration_cases()
    assert all(case.refusal(backward=False) is None for case in cases)
    assert backward and all(case.refusal(backward=True) is None for case in backward)
    assert {type(case) for case in backward} == {Fa4GnaCase, Fa4MaskCase}
    for chosen in (cases, backward):
        features = fa4_case_features(chosen, torch.bfloat16)
        assert np.linalg.matrix_rank(features / np.linalg.norm(features, axis=0)) == len(FA4_FEATURES)
        masked = features[:, FA4_FEATURES.index("masked_flops")]
        assert (masked > 0).any() and (masked == 0).any()  # masked and block-sparse calls alike


def test_calibrating_flashattention4_extends_the_stored_model_and_recovers_its_coefficients(fake_gpu):
    result = calibration.calibrate(kernels=("fa4", "fa4-backward"))
    model = result.model
    assert model.coefficients == GNA and model.info["cases"] == 7 and not result.cases
    for name in FA4_FEATURES:
        assert model.fa4_coefficients[name] == pytest.approx(FORWARD[name], rel=1e-5), name
        assert model.fa4_backward_coefficients[name] == pytest.approx(BACKWARD[name], rel=1e-5), name
    assert result.fa4.cases == tuple(fa4_calibration_cases()) and result.fa4.fitted.all()
    assert result.fa4_backward.cases == tuple(fa4_backward_calibration_cases())
    assert model.info["fa4_max_abs_relative_error"] < 1e-6 and model.info["fa4_backward_cases"] == len(
        fa4_backward_calibration_cases())
    assert model.info["extended"][-1]["kernels"] == ["fa4", "fa4-backward"]
    assert CostModel.load(model.save(calibration.default_path("Fake GPU"))).has("fa4-backward")


def test_a_gpu_flashattention4_does_not_run_on_is_refused_with_its_sentence(fake_gpu, monkeypatch):
    monkeypatch.setattr(fa4_backend, "device_refusal", lambda device: "FlashAttention-4 is not installed (pip).")
    with pytest.raises(ValueError, match=r"kernels=\('fa4',\) asks for FlashAttention-4, which does not run on Fake "
                                         r"GPU: FlashAttention-4 is not installed \(pip\)\."):
        calibration.calibrate(kernels=("fa4",))


def test_the_timed_calls_go_through_the_entry_points_on_flashattention4(monkeypatch):
    import natsim.kernels

    calls = []

    def gna_attention(q, k, v, window, stride, dilation, causal, **kwargs):
        calls.append(("gna", kwargs))
        return q * k + v

    def sparse_attention(q, k, v, *args, **kwargs):
        calls.append(("sparse", kwargs))
        return q * k + v

    def prepare_sparse(mask, q_block, kv_block, seq_len, **kwargs):
        calls.append(("prepare", kwargs))

    monkeypatch.setattr(natsim.kernels, "gna_attention", gna_attention)
    monkeypatch.setattr(natsim.kernels, "sparse_attention", sparse_attention)
    monkeypatch.setattr(natsim.kernels, "prepare_sparse", prepare_sparse)
    monkeypatch.setattr(fa4_calibrate, "median_seconds", lambda run, device, repeats: run() is not None and 1e-3)
    cpu = torch.device("cpu")
    gna = Fa4GnaCase(Problem((4, 8, 8), (3, 5, 5), (1, 2, 2)), (2, 4, 8), (1, 4, 8), 2, 8)
    mask = Fa4MaskCase(512, 128, 128, 0.5, 8, heads=2)
    for case in (gna, mask):
        assert fa4_calibrate.time_fa4_case(case, torch.float32, cpu) == 1e-3
        assert fa4_calibrate.time_fa4_backward_case(case, torch.float32, cpu) == 1e-3
    assert [kind for kind, _ in calls] == ["gna", "gna", "prepare", "sparse", "sparse"]
    assert all(kwargs["backend"] == "fa4" for _, kwargs in calls)
    assert calls[0][1]["q_tile"] == (2, 4, 8) and calls[0][1]["kv_tile"] == (1, 4, 8)


def test_natsim_calibrate_kernels_fa4_prints_and_writes_its_fit(fake_gpu, tmp_path):
    from natsim.cli.main import app

    path = tmp_path / "out.json"
    runner = CliRunner()
    result = runner.invoke(app, ["calibrate", "--kernels", "fa4,fa4-backward", "--output", str(path), "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)["fa4_measurements"]
    assert len(records["fa4"]) == len(fa4_calibration_cases())
    assert {record["kind"] for record in records["fa4-backward"]} == {"gna", "mask"}
    assert CostModel.load(path).fa4_coefficients.keys() == set(FA4_FEATURES)
    text = runner.invoke(app, ["calibrate", "--kernels", "fa4", "--output", str(path)])
    flat = " ".join(text.stdout.split())
    assert text.exit_code == 0 and "FlashAttention-4 calibration on Fake GPU" in flat
    assert f"FlashAttention-4 on {len(fa4_calibration_cases())} cases" in flat and "fa4 │ full_flops" in flat
    bad = runner.invoke(app, ["calibrate", "--kernels", "fa5"])
    assert bad.exit_code == 2 and "fa4, fa4-backward" in bad.output
