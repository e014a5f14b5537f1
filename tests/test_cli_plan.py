"""`natsim plan` and `natsim calibrate` through typer's runner: report, JSON, end-to-end estimate, errors.

The commands are registered on an app of their own here (cli/plan.py and cli/calibrate.py expose
`register(app)`), so these tests do not depend on how cli/main.py wires them.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import typer
from typer.testing import CliRunner

from natsim import end_to_end_speedup
from natsim.cli import calibrate as calibrate_cli
from natsim.cli import plan as plan_cli
from natsim.planner import CostModel, Plan, best
from natsim.planner.cost import user_coefficients_dir

app = typer.Typer()


@app.callback()
def _natsim() -> None:
    """natsim (test app)."""


plan_cli.register(app)
calibrate_cli.register(app)
runner = CliRunner()

COEFFICIENTS = {
    "full_flops": 1 / 550e12,
    "masked_flops": 1 / 300e12,
    "narrow_q_flops": 1 / 4000e12,
    "narrow_kv_flops": 1 / 3000e12,
    "narrow_head_flops": 1 / 2000e12, "split_head_flops": 1 / 8000e12,
    "kv_tile_visits": 1e-9,
    "programs": 1e-8,
    "permute_bytes": 1 / 2.5e12,
    "launch": 2e-5,
}


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_plan_prints_the_report_and_says_when_there_is_no_cost_model():
    result = invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--heads", "24", "--device", "cpu")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    expected = best((30, 48, 80), 0.9, heads=24, device="cpu")
    assert "x".join(map(str, expected.problem.window)) in text
    assert "No cost-model coefficients" in text and "runners-up" in text


def test_plan_json_is_the_plan_and_loads_back():
    result = invoke("plan", "--shape", "16x44x80", "--sparsity", "0.56", "--causal", "1x0x0", "--head-dim", "64", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    plan = Plan.from_dict(record)
    assert plan == best((16, 44, 80), 0.56, causal=(True, False, False), head_dim=64)
    assert record["basis"] == "simulated tiles" and record["predicted_time_s"] is None
    assert "end_to_end" not in record


def test_plan_end_to_end_estimate_uses_the_plans_speedup():
    args = ["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--attention-share", "0.8", "--steps", "50", "--dense-steps", "15"]
    record = json.loads(invoke(*args, "--json").stdout)
    estimate = record["end_to_end"]
    assert estimate["speedup"] == pytest.approx(end_to_end_speedup(0.8, record["predicted_speedup"], 15, 50))
    assert estimate["attention_speedup_basis"] == "simulated tiles"
    table = invoke(*args)
    assert table.exit_code == 0 and "End-to-end estimate" in table.stdout


def test_plan_options_reach_the_planner():
    args = ["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--window", "18x24x24", "--max-stride", "2x8x8",
            "--dtype", "fp16", "--json"]
    record = json.loads(invoke(*args).stdout)
    assert record["problem"]["window"] == [18, 24, 24] and record["dtype"] == "fp16"
    assert all(s <= m for s, m in zip(record["problem"]["stride"], (2, 8, 8)))


def test_plan_with_a_coefficients_file_predicts_time(tmp_path):
    path = CostModel("Test GPU", COEFFICIENTS).save(tmp_path / "test-gpu.json")
    result = invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--heads", "24", "--coefficients", str(path))
    assert result.exit_code == 0, result.output
    assert "Ranked by the cost model fitted on Test GPU" in " ".join(result.stdout.split())
    record = json.loads(invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--coefficients", str(path), "--json").stdout)
    assert record["basis"] == "cost model" and record["predicted_time_s"] > 0


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("device", ["h100", H100, "nvidia h100 80GB HBM3"])
def test_plan_device_names_a_shipped_gpu_without_that_gpu(device):
    record = json.loads(invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--heads", "24", "--device", device, "--json").stdout)
    assert record["gpu"] == H100 and record["basis"] == "cost model" and record["predicted_time_s"] > 0
    assert Plan.from_dict(record) == best((30, 48, 80), 0.9, heads=24, device="h100")
    report = invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--device", device)
    assert report.exit_code == 0, report.output
    assert f"Ranked by the cost model fitted on {H100}" in " ".join(report.stdout.split())


def test_plan_on_a_gpu_without_coefficients_names_those_it_could_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    result = invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--heads", "24")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "No cost-model coefficients for NVIDIA A100-SXM4-80GB" in text
    assert f"Coefficients exist for {H100} (--device h100)" in text
    record = json.loads(invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--json").stdout)
    assert record["gpu"] == "NVIDIA A100-SXM4-80GB" and record["basis"] == "simulated tiles"


def test_plan_help_lists_the_gpus_from_the_coefficient_files():
    assert f"{H100} (--device h100)" in " ".join(invoke("plan", "--help").stdout.split())
    CostModel("Test GPU 7", COEFFICIENTS).save(user_coefficients_dir() / "test-gpu-7.json")
    listed = " ".join(invoke("plan", "--help").stdout.split())
    assert f"{H100} (--device h100)" in listed and "Test GPU 7 (--device 7)" in listed


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--shape", "30x48x80", "--sparsity", "1.2"], "sparsity must lie in [0, 1), got target_sparsity=1.2."),
        (["plan", "--shape", "8x8", "--sparsity", "0.99"], "cannot reach target_sparsity=0.99"),
        (["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--dtype", "fp32"], "dtype must be one of those the GNA kernel runs"),
        (["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--head-dim", "20"], "head_dim must be one the GNA kernel runs"),
        (["plan", "--shape", "30x48", "--sparsity", "0.9", "--window", "18x24x24"], "--window needs one value per dimension"),
        (["plan", "--shape", "30xAx80", "--sparsity", "0.9"], "--shape takes integers"),
        (["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--steps", "50"], "--dense-steps and --steps need --attention-share"),
        (["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--attention-share", "1.5"], "attention_share must lie in [0, 1]"),
        (["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--coefficients", "/nonexistent.json"], "is not a readable cost model"),
        (["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--device", "h100-nvl"],
         "device='h100-nvl' names NVIDIA H100 NVL, which has no cost-model coefficients here"),
        (["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--device", "tpu-v5"], "device must name a torch device"),
    ],
)
def test_bad_input_is_one_red_line_and_exit_code_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert message in " ".join(result.stderr.split())
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_calibrate_without_a_gpu_is_a_clear_error():
    result = invoke("calibrate")
    assert result.exit_code == 2
    assert "calibration times the Triton kernels on a CUDA GPU" in " ".join(result.stderr.split())
    assert result.stdout == ""


def test_plan_help_teaches_the_options():
    result = invoke("plan", "--help")
    assert result.exit_code == 0
    for option in ("--shape", "--sparsity", "--heads", "--head-dim", "--dtype", "--max-stride", "--attention-share", "--json"):
        assert option in result.stdout


def test_calibrate_writes_coefficients_that_plan_reads(monkeypatch, tmp_path):
    """`natsim calibrate` with the GPU timing replaced by times from known coefficients."""
    import numpy as np

    from natsim.planner import FEATURES
    from natsim.planner.cost import calibrate as calibration

    truth = np.array([COEFFICIENTS[name] for name in FEATURES])
    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: float(calibration.case_features([case], dtype)[0] @ truth))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    path = tmp_path / "fake.json"
    result = invoke("calibrate", "--output", str(path), "--kernels", "gna")
    assert result.exit_code == 0, result.output
    assert "written to" in result.stdout and "launch" in result.stdout
    model = CostModel.load(path)
    assert model.gpu == "Fake GPU"
    assert model.coefficients["full_flops"] == pytest.approx(COEFFICIENTS["full_flops"], rel=1e-6)
    record = json.loads(invoke("calibrate", "--output", str(path), "--json", "--kernels", "gna").stdout)
    assert record["model"]["gpu"] == "Fake GPU" and len(record["measurements"]) == len(calibration.calibration_cases())
    planned = json.loads(invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--coefficients", str(path), "--json").stdout)
    assert planned["gpu"] == "Fake GPU" and planned["basis"] == "cost model"


def test_calibrate_writes_to_the_user_data_folder_not_into_the_package(monkeypatch, tmp_path):
    import numpy as np

    from natsim.planner import FEATURES
    from natsim.planner.cost import calibrate as calibration
    from natsim.planner.cost import COEFFICIENTS_DIR

    truth = np.array([COEFFICIENTS[name] for name in FEATURES])
    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path / "natsim"))
    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: float(calibration.case_features([case], dtype)[0] @ truth))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    shipped = sorted(COEFFICIENTS_DIR.iterdir())
    result = invoke("calibrate", "--kernels", "gna")
    assert result.exit_code == 0, result.output
    path = tmp_path / "natsim" / "coefficients" / "fake-gpu.json"
    assert CostModel.load(path).gpu == "Fake GPU" and str(path) in "".join(result.stdout.split())
    assert sorted(COEFFICIENTS_DIR.iterdir()) == shipped
    planned = json.loads(invoke("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--device", "fake gpu", "--json").stdout)
    assert planned["gpu"] == "Fake GPU" and planned["basis"] == "cost model"
    assert "$NATSIM_DATA_DIR/coefficients" in " ".join(invoke("calibrate", "--help").stdout.split())


def test_plan_shows_and_records_the_kv_tiling_mode():
    """Stride 1 on HunyuanVideo: ranked by tile work, the dynamic mode wins; report and JSON both say so."""
    args = ("plan", "--shape", "30x48x80", "--sparsity", "0.9", "--window", "18x24x24", "--max-stride", "1",
            "--device", "cpu")
    expected = best((30, 48, 80), 0.9, window=(18, 24, 24), max_stride=1, device="cpu")
    report = invoke(*args)
    assert report.exit_code == 0, report.output
    text = " ".join(report.stdout.split())
    assert re.search(r"KV tiling\W+dynamic \(box per Q tile\)", text)
    record = json.loads(invoke(*args, "--json").stdout)
    assert record["tiles"]["kv_tiling"] == expected.tiles.kv_tiling == "dynamic"
    assert Plan.from_dict(record) == expected
