"""GPU names: the Hopper boards users report (H100 SXM, PCIe and NVL, H200 and H200 NVL, GH200), their aliases
for `device=` / `--device`, and what a named GPU without coefficients does (refused with how to calibrate it) until
its coefficient file is dropped in, shipped or calibrated, after which it plans with no code change."""

from __future__ import annotations

import pytest
import torch

from natsim.planner import CostModel, best, best_mask, cost_model_for, gpu_of
from natsim.planner.cost import files
from natsim.planner.cost.files import gpu_file_name, known_gpus, user_coefficients_dir
from natsim.planner.cost.gpus import KNOWN_GPUS, describe_gpus, names_a_gpu

H100 = "NVIDIA H100 80GB HBM3"

# (what a user types or torch reports, the GPU it means)
NAMES = [
    ("NVIDIA H100 80GB HBM3", H100),
    ("nvidia h100 80gb hbm3", H100),
    ("h100", H100),
    ("H100", H100),
    ("h100-sxm", H100),
    ("H100 SXM5", H100),
    ("h100 80gb", H100),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("h100-pcie", "NVIDIA H100 PCIe"),
    ("H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
    ("h100 nvl", "NVIDIA H100 NVL"),
    ("NVIDIA H200", "NVIDIA H200"),
    ("h200", "NVIDIA H200"),
    ("H200-SXM", "NVIDIA H200"),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
    ("h200-nvl", "NVIDIA H200 NVL"),
    ("NVIDIA GH200 480GB", "NVIDIA GH200 480GB"),
    ("gh200", "NVIDIA GH200 480GB"),
    ("GH200 480GB", "NVIDIA GH200 480GB"),
    ("NVIDIA GH200 144G HBM3e", "NVIDIA GH200 144G HBM3e"),
    ("gh200-144g", "NVIDIA GH200 144G HBM3e"),
]


@pytest.mark.parametrize("name, gpu", NAMES)
def test_reported_names_and_aliases_mean_one_board(name, gpu):
    assert names_a_gpu(name) and gpu_of(name) == gpu


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "cuda:0", "cuda"])
def test_torch_devices_are_not_gpu_names(device):
    assert not names_a_gpu(device)


def test_every_known_gpu_has_its_own_file_name_and_aliases_no_other_gpu_has():
    names = [gpu.name for gpu in KNOWN_GPUS]
    assert len({gpu_file_name(name) for name in names}) == len(names)
    aliases = [alias for gpu in KNOWN_GPUS for alias in gpu.aliases]
    assert len(set(aliases)) == len(aliases)
    assert gpu_file_name("NVIDIA H200") == "nvidia-h200.json" and gpu_file_name(H100) == "nvidia-h100-80gb-hbm3.json"
    assert describe_gpus(["NVIDIA H200", "NVIDIA GH200 480GB"]) == \
        "NVIDIA H200 (--device h200), NVIDIA GH200 480GB (--device gh200)"


@pytest.mark.parametrize("device", ["h100-nvl", "NVIDIA GH200 480GB", "gh200-144g"])
def test_a_named_gpu_without_coefficients_is_refused_with_how_to_calibrate_it(device):
    gpu = gpu_of(device)
    assert cost_model_for(gpu) is None
    with pytest.raises(ValueError) as refused:
        best((16, 24), 0.75, device=device)
    message = str(refused.value)
    assert message.startswith(f"device={device!r} names {gpu}, which has no cost-model coefficients here")
    assert "`natsim calibrate --kernels gna,sparse,backward` on that GPU" in message
    assert gpu_file_name(gpu) in message and message.endswith(".")
    with pytest.raises(ValueError, match="which has no cost-model coefficients here"):
        best_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool), 16, 16, 64, device=device)


def test_a_present_gpu_without_coefficients_falls_back_to_tile_work(monkeypatch):
    """device=None or a torch device means the GPU at hand: a model runs on any GPU, ranked by tile work."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    for device in (None, "cuda:0"):
        plan = best((16, 24), 0.75, device=device)
        assert plan.gpu == "NVIDIA H100 NVL" and plan.basis == "simulated tiles"


def h200_model() -> CostModel:
    """Coefficients for the H200, as `natsim calibrate` would write them there (the H100's values, for a test)."""
    h100 = cost_model_for(H100)
    return CostModel("NVIDIA H200", h100.coefficients, info=h100.info, sparse_coefficients=h100.sparse_coefficients,
                     backward_coefficients=h100.backward_coefficients)


def test_a_calibrated_file_in_the_user_folder_makes_a_named_gpu_plan():
    h200_model().save(user_coefficients_dir() / gpu_file_name("NVIDIA H200"))
    assert "NVIDIA H200" in known_gpus()
    plan = best((16, 24), 0.75, heads=4, device="h200")
    assert plan.gpu == "NVIDIA H200" and plan.calibrated
    assert best((16, 24), 0.75, heads=4, device="NVIDIA H200") is plan


def test_a_file_shipped_with_natsim_makes_a_named_gpu_plan(monkeypatch, tmp_path):
    shipped = tmp_path / "coefficients"
    shipped.mkdir()
    for gpu in known_gpus():
        cost_model_for(gpu).save(shipped / gpu_file_name(gpu))
    h200_model().save(shipped / gpu_file_name("NVIDIA H200"))
    monkeypatch.setattr(files, "COEFFICIENTS_DIR", shipped)  # natsim's own folder, as if the file shipped
    plan = best((16, 24), 0.75, heads=4, device="h200", training=True)
    assert plan.gpu == "NVIDIA H200" and plan.calibrated and plan.predicted_backward_time_s > 0
    assert best_mask(torch.ones(1, 2, 4, 4, dtype=torch.bool), 16, 16, 64, device="h200").calibrated


def test_a_device_and_a_cost_model_of_another_gpu_are_refused(tmp_path):
    path = h200_model().save(tmp_path / "h200.json")
    assert best((16, 24), 0.75, cost_model=str(path)).gpu == "NVIDIA H200"
    assert best((16, 24), 0.75, cost_model=path, device="h200").gpu == "NVIDIA H200"
    with pytest.raises(ValueError, match="device='h100' names NVIDIA H100 80GB HBM3, but cost_model was fitted on "
                                         "NVIDIA H200: pass one of them."):
        best((16, 24), 0.75, cost_model=path, device="h100")
