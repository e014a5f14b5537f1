"""The host's time per call in the planner (planner.cost.host): a cost model keeps it per backend, searches price
each call at max(host, kernel), so that on small layouts a backend with a slow host path (FlashAttention-4's CuTe
DSL call) loses to one whose kernel takes longer, while large layouts plan as before; its measurement refuses
machines without the backend, in a sentence."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from natsim.kernels.backends import fa4 as fa4_backend
from natsim.planner import best, best_mask, cost_model_for
from natsim.planner.cost.calibrate import check_kernels
from natsim.planner.cost.host import host_refusal, host_seconds
from natsim.planner.cost.model import CostModel

FA4 = {"full_flops": 1.45e-15, "masked_flops": 1.9e-14, "narrow_head_flops": 4e-16, "tiles": 1e-10,
       "programs": 2e-8, "permute_bytes": 4.2e-13, "launch": 5e-5}
MODEL = replace(cost_model_for("NVIDIA H100 80GB HBM3"), fa4_coefficients=FA4, fa4_backward_coefficients=None,
                gluon_fp8_coefficients=None, host_seconds=None)
HOSTED = replace(MODEL, host_seconds={"triton": 5e-5, "fa4": 2e-3})


@pytest.fixture
def fa4_here(monkeypatch):
    monkeypatch.setattr(fa4_backend, "installed", lambda: None)
    monkeypatch.setattr(fa4_backend, "device_refusal", lambda device: None)


def test_the_shipped_files_carry_the_host_times_of_natsims_call_and_of_sdpa():
    for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        model = cost_model_for(gpu)
        assert 0 < model.host("sdpa") < model.host("triton") < model.host("gluon"), model.host_seconds


def test_host_times_round_trip_and_are_checked(tmp_path):
    loaded = CostModel.load(HOSTED.save(tmp_path / "h100.json"))
    assert loaded.host("fa4") == 2e-3 and loaded.host("triton") == 5e-5 and loaded.host("gluon") == 0.0
    assert MODEL.host("fa4") == 0.0 and CostModel.from_dict(MODEL.to_dict()).host_seconds is None
    assert float(HOSTED.at_least_host(2e-4, "fa4")) == 2e-3 and float(HOSTED.at_least_host(3e-3, "fa4")) == 3e-3
    for bad in ({"cudnn": 1e-4}, {"fa4": -1.0}, {"fa4": float("nan")}):
        with pytest.raises(ValueError, match="host_seconds must map calls among"):
            replace(MODEL, host_seconds=bad)


def test_small_layouts_leave_a_backend_whose_host_is_slow_and_large_ones_do_not(fa4_here):
    small = dict(heads=2, window=(8, 32, 32))  # about 1 ms of kernel time on either backend
    without = best((16, 64, 64), 0.5, cost_model=MODEL, **small)
    with_host = best((16, 64, 64), 0.5, cost_model=HOSTED, **small)
    assert without.backend == "fa4", "the premise: FlashAttention-4's kernel is priced cheaper here"
    assert with_host.backend == "triton" and with_host.score >= 5e-5
    fa4_best = next(c for c in with_host.search.best_by_backend if c.backend == "fa4")
    assert fa4_best.score >= 2e-3  # priced at its host time at least
    large = dict(heads=24, window=(18, 24, 24))
    assert best((30, 48, 80), 0.9, cost_model=HOSTED, **large).backend == \
        best((30, 48, 80), 0.9, cost_model=MODEL, **large).backend == "fa4"


def test_mask_candidates_are_priced_at_their_host_time_at_least(fa4_here):
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(1, 2, 4, 4, generator=gen) < 0.5
    mask |= torch.eye(4, dtype=torch.bool)
    plan = best_mask(mask, 128, 128, 512, head_dim=64, cost_model=HOSTED)
    for c in plan.candidates:
        assert c.score >= HOSTED.host(c.backend)
    assert plan.backend == "triton" and plan.dense_score >= 5e-5


def test_measuring_host_times_needs_the_backend_and_a_gpu():
    cpu = torch.device("cpu")
    assert "CUDA GPU" in host_refusal("triton", cpu)
    assert "not a CUDA GPU" in host_refusal("gluon", cpu)
    with pytest.raises(ValueError, match=r"the host time of 'triton' cannot be measured here"):
        host_seconds("triton", torch.float16, cpu)
    assert check_kernels(["host", "gna"]) == ("gna", "host")
