"""Training plans on CPU: the backward's features against the simulator and a brute-force mask, ranking by
forward + backward (a planted cost model whose backward changes the winner), the tile-work fallback, plans as
JSON, `natsim plan --training`, and `natsim calibrate`'s backward cases (fit, and tiny cases run in the
interpreter)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

import bruteforce as bf
from natsim import Problem, TileConfig, simulate, simulate_backward, sweep
from natsim.kernels.gna.backward import DEFAULT_VARIANT, backward_tiles
from natsim.kernels.gna.launch import dense_as_1d, needs_mask
from natsim.kernels.gna.layout import TileLayout
from natsim.planner import CostModel, Plan, best, predicted_times
from natsim.planner.cost import COEFFICIENTS_DIR
from natsim.planner.cost import calibrate as calibration
from natsim.planner.cost.backward_features import (
    BACKWARD_FEATURES,
    FORWARD_TILE_PRODUCTS,
    backward_features,
    backward_work,
)
from natsim.planner.search.gna import stride_candidates

FORWARD = {  # the forward's coefficients of an H100-like GPU (seconds per unit)
    "full_flops": 1 / 550e12, "masked_flops": 1 / 300e12, "narrow_q_flops": 1 / 4000e12,
    "narrow_kv_flops": 1 / 3000e12, "narrow_head_flops": 1 / 2000e12, "split_head_flops": 1 / 8000e12,
    "kv_tile_visits": 1e-9, "programs": 1e-8,
    "permute_bytes": 1 / 2.5e12, "launch": 2e-5,
}
BACKWARD = {
    "full_flops": 1 / 330e12, "masked_flops": 1 / 150e12, "pair_visits": 2e-9, "programs": 3e-8,
    "memory_bytes": 1 / 2.0e12, "launch": 6e-5,
}


def render(renderable) -> str:
    console = Console(record=True, width=160)
    console.print(renderable)
    return console.export_text()


# -- the backward's features -----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=bf.problems(max_tokens=400), head_dim=st.sampled_from([64, 128]))
def test_backward_work_counts_the_pairs_and_programs_of_the_backward_kernels(problem, head_dim):
    work = backward_work(problem, head_dim)
    kernel_problem = dense_as_1d(problem) or problem
    assert work.problem == kernel_problem
    assert (work.q_tile, work.kv_tile) == backward_tiles(kernel_problem, head_dim)
    tiles = TileConfig(work.q_tile, work.kv_tile)
    kv_major = simulate_backward(kernel_problem, tiles)
    assert (work.visited_pairs, work.full_pairs) == (kv_major.visited_tiles, kv_major.full_tiles)
    brute = bf.reference(kernel_problem, work.q_tile, work.kv_tile)
    assert (work.visited_pairs, work.full_pairs) == (int(brute.visited_matrix.sum()), int(brute.full_matrix.sum()))
    assert work.masked == needs_mask(kernel_problem, work.q_tile, work.kv_tile)
    # The dQ kernel runs on the mirrored tiles: KV-tile-shaped queries against Q-tile-shaped keys.
    mirrored = bf.reference(kernel_problem, work.kv_tile, work.q_tile)
    assert (work.dq_visited_pairs, work.dq_full_pairs) == (int(mirrored.visited_matrix.sum()),
                                                           int(mirrored.full_matrix.sum()))
    assert work.dq_masked == needs_mask(kernel_problem, work.kv_tile, work.q_tile)
    assert work.dq_programs == bf.multi_d_layout(kernel_problem, work.kv_tile)[2]
    assert work.dkdv_programs == bf.multi_d_layout(kernel_problem, work.kv_tile)[2]
    assert work.q_padded == TileLayout(kernel_problem.shape, work.q_tile, kernel_problem.dilation).num_tokens


@settings(max_examples=20, deadline=None)
@given(problem=bf.problems(max_tokens=300), heads=st.integers(1, 4), atomic=st.booleans())
def test_backward_features_are_the_work_in_their_units(problem, heads, atomic):
    head_dim, size = 64, 2
    work = backward_work(problem, head_dim)
    saved = dict(DEFAULT_VARIANT)
    DEFAULT_VARIANT["ATOMIC_DQ"] = atomic
    try:
        row = dict(zip(BACKWARD_FEATURES, backward_features(work, batch_heads=heads, head_dim=head_dim,
                                                            element_bytes=size)))
    finally:
        DEFAULT_VARIANT.clear()
        DEFAULT_VARIANT.update(saved)
    product = 2 * math.prod(work.q_tile) * math.prod(work.kv_tile) * head_dim * heads  # one tile product
    # The dK/dV kernel: q k^T, dO v^T, p^T dO, ds^T q per pair, and ds^T k with atomics for dQ.
    dkdv_masked = work.visited_pairs - work.full_pairs if work.masked else 0
    full = (work.visited_pairs - dkdv_masked) * (5 if atomic else 4) * product
    masked = dkdv_masked * (5 if atomic else 4) * product
    visits = work.visited_pairs
    if not atomic:  # the dQ kernel: q k^T, dO v^T, ds k per pair of its mirrored tiles
        dq_masked = work.dq_visited_pairs - work.dq_full_pairs if work.dq_masked else 0
        full += (work.dq_visited_pairs - dq_masked) * 3 * product
        masked += dq_masked * 3 * product
        visits += work.dq_visited_pairs
    assert work.masked or work.visited_pairs == work.full_pairs  # mask-free kernels: every visited pair is full
    assert row["full_flops"] == pytest.approx(full)
    assert row["masked_flops"] == pytest.approx(masked)
    assert row["pair_visits"] == visits * heads
    assert row["programs"] == (work.dkdv_programs + (0 if atomic else work.dq_programs)) * heads
    # Bytes outside the attention kernels (they read the caller's layout in place): the delta pass reads out and
    # dO and writes delta, the LSE is made head-major (read, written); with atomics dQ is an fp32 buffer, zeroed,
    # then read and written in the inputs' dtype.
    n = work.problem.num_tokens
    tensor_bytes = 2 * n * head_dim * size + (n * head_dim * (4 + 4) + n * head_dim * size if atomic else 0)
    stat_bytes = 3 * n * 4
    assert row["memory_bytes"] == pytest.approx((tensor_bytes + stat_bytes) * heads)
    assert row["launch"] == 1.0


def test_dense_attention_runs_its_backward_flattened_to_one_dimension():
    work = backward_work(Problem((8, 16, 16), (8, 16, 16)), 128)
    assert work.problem.shape == (2048,) and (work.q_tile, work.kv_tile) == ((64,), (128,))
    assert work.visited_pairs == work.full_pairs == 32 * 16 and not work.masked


# -- ranking by forward + backward ---------------------------------------------------------------------------

SHAPE, WINDOW = (16, 32, 32), (8, 16, 16)


def planted_model() -> CostModel:
    """Forward: a constant per call (every configuration ties, so the forward-only plan keeps stride 1).
    Backward: masked FLOPs only, so a training plan must avoid masked backward pairs."""
    forward = {name: 0.0 for name in FORWARD} | {"launch": 1e-3}
    backward = {name: 0.0 for name in BACKWARD} | {"masked_flops": 1e-12}
    return CostModel("Planted GPU", forward, backward_coefficients=backward)


def test_the_backward_changes_the_winner_when_training():
    model = planted_model()
    inference = best(SHAPE, 0.5, window=WINDOW, heads=2, cost_model=model)
    training = best(SHAPE, 0.5, window=WINDOW, heads=2, cost_model=model, training=True)
    assert inference.problem.stride == (1, 1, 1) and not inference.training
    assert training.training and training.calibrated and training.problem.stride != inference.problem.stride
    # The winner: the smallest stride product whose backward runs no masked pair (brute-force enumeration).
    clean = []
    for stride in stride_candidates(WINDOW):
        problem = Problem(SHAPE, WINDOW, stride)
        q_tile, kv_tile = backward_tiles(problem, 128)
        kv_major = simulate_backward(problem, TileConfig(q_tile, kv_tile))
        if kv_major.full_tiles == kv_major.visited_tiles or not needs_mask(problem, q_tile, kv_tile):
            clean.append(math.prod(stride))
    assert clean and math.prod(training.problem.stride) == min(clean)
    assert training.backward_score == 0.0 and training.score == pytest.approx(1e-3)
    assert inference.backward_score is None and inference.predicted_backward_time_s is None


def test_a_training_plan_adds_the_backward_time_to_the_forward_time_of_each_configuration():
    model = CostModel("Test GPU", FORWARD, backward_coefficients=BACKWARD)
    plan = best(SHAPE, 0.6, window=WINDOW, heads=4, cost_model=model, training=True)
    work = backward_work(plan.problem, 128)
    backward = float(backward_features(work, batch_heads=4, head_dim=128, element_bytes=2)
                     @ np.array([BACKWARD[name] for name in BACKWARD_FEATURES]))
    assert plan.predicted_backward_time_s == pytest.approx(backward, rel=1e-12)
    result = sweep(SHAPE, WINDOW, strides=[plan.problem.stride], tiles=[plan.tiles])
    forward = predicted_times(result, model, heads=4)[0]
    assert plan.predicted_forward_time_s == pytest.approx(forward, rel=1e-9)
    assert plan.predicted_time_s == pytest.approx(forward + backward, rel=1e-9)
    for candidate in plan.runners_up + plan.search.top:
        assert candidate.backward_score is not None and candidate.score > candidate.backward_score > 0
    assert plan.dense_backward_score > 0 and plan.predicted_speedup > 1
    assert any(name.startswith("backward_") for name in plan.breakdown)
    assert sum(plan.breakdown.values()) == pytest.approx(plan.score, rel=1e-9)
    text = " ".join(render(plan.explain()).split())
    assert "forward + backward" in text and "backward coefficients for the backward kernels" in text


@pytest.mark.parametrize("model", [None, CostModel("Forward-only GPU", FORWARD)])
def test_without_backward_coefficients_training_ranks_by_forward_and_backward_tile_work(model):
    plan = best(SHAPE, 0.6, window=WINDOW, cost_model=model, training=True)
    assert plan.training and not plan.calibrated and plan.predicted_time_s is None
    q_tile, kv_tile = backward_tiles(plan.problem, 128)
    kv_major = simulate_backward(plan.problem, TileConfig(q_tile, kv_tile))
    if DEFAULT_VARIANT.get("ATOMIC_DQ", False):  # five tile products per pair in the dK/dV kernel
        products = 5 * kv_major.visited_tiles
    else:  # four in the dK/dV kernel, three per pair of the dQ kernel's mirrored tiles
        products = 4 * kv_major.visited_tiles + 3 * simulate(plan.problem, TileConfig(kv_tile, q_tile)).visited_tiles
    backward = products * math.prod(q_tile) * math.prod(kv_tile)
    assert plan.backward_score == pytest.approx(backward / FORWARD_TILE_PRODUCTS)
    forward = plan.simulation.visited_tiles * plan.tiles.q_tokens * plan.tiles.kv_tokens
    assert plan.forward_score == pytest.approx(forward)
    text = " ".join(render(plan.explain()).split())
    assert "No backward coefficients" in text and "forward + backward" in text and "no time is predicted" in text


def test_training_must_be_a_bool():
    with pytest.raises(TypeError, match="training must be a bool"):
        best(SHAPE, 0.5, window=WINDOW, training="yes")


# -- plans as JSON ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [None, CostModel("Test GPU", FORWARD, backward_coefficients=BACKWARD)])
def test_training_plans_round_trip_through_json(model):
    plan = best(SHAPE, 0.6, window=WINDOW, heads=2, cost_model=model, training=True)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.training and again.backward_score == plan.backward_score
    assert again.runners_up[0].backward_score == plan.runners_up[0].backward_score
    record = json.loads(plan.to_json())
    assert record["training"] is True and record["dense_backward_score"] == plan.dense_backward_score
    assert (record["predicted_backward_time_s"] is None) == (model is None)


def test_plans_written_before_training_read_as_forward_plans_and_a_training_plan_needs_its_backward():
    record = json.loads(best(SHAPE, 0.6, window=WINDOW).to_json())
    for key in ("training", "backward_score", "dense_backward_score"):
        record.pop(key)
    plan = Plan.from_dict(record)
    assert not plan.training and plan.backward_score is None and plan.backward_tiles is None
    with pytest.raises(ValueError, match="a training plan .* must have a numeric 'backward_score'"):
        Plan.from_dict({**record, "training": True})


def test_cost_models_round_trip_their_backward_coefficients_and_reject_bad_ones(tmp_path):
    model = CostModel("Test GPU", FORWARD, backward_coefficients=BACKWARD)
    assert CostModel.load(model.save(tmp_path / "m.json")) == model
    shipped = CostModel.load(COEFFICIENTS_DIR / "nvidia-h100-80gb-hbm3.json")
    assert set(shipped.backward_coefficients) == set(BACKWARD_FEATURES)  # calibrated on the H100
    older = json.loads((COEFFICIENTS_DIR / "nvidia-h100-80gb-hbm3.json").read_text())
    del older["backward_coefficients"]  # a file written before the backward was calibrated
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert CostModel.load(tmp_path / "older.json").backward_coefficients is None
    with pytest.raises(ValueError, match="backward_coefficients must name exactly the features"):
        CostModel("Test GPU", FORWARD, backward_coefficients={**BACKWARD, "kv_tile_visits": 1.0})
    with pytest.raises(ValueError, match="Forward GPU has no backward coefficients"):
        CostModel("Forward GPU", FORWARD).predict_backward(np.ones(len(BACKWARD_FEATURES)))


# -- natsim plan --training ------------------------------------------------------------------------------------


def test_natsim_plan_training_ranks_by_forward_and_backward():
    from natsim.cli.main import app

    runner = CliRunner()
    args = ["plan", "--shape", "16x32x32", "--sparsity", "0.6", "--window", "8x16x16"]
    result = runner.invoke(app, args + ["--training", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["training"] is True and record["backward_score"] > 0
    assert record == json.loads(best(SHAPE, 0.6, window=WINDOW, training=True).to_json())
    plain = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    assert plain["training"] is False and plain["backward_score"] is None
    text = runner.invoke(app, args + ["--training"])
    assert text.exit_code == 0 and "forward + backward" in text.stdout


# -- natsim calibrate --kernels backward -----------------------------------------------------------------------


def fake_backward(monkeypatch, tmp_path, stored: bool = True):
    """Replace the GPU: backward times from BACKWARD on the cases' features; a stored model to extend."""
    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    truth = np.array([BACKWARD[name] for name in BACKWARD_FEATURES])
    timed = []

    def fake_time(case, dtype, device):
        timed.append(case)
        return float(calibration.backward_case_features([case], dtype)[0] @ truth)

    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_backward_case", fake_time)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if stored:
        CostModel("Fake GPU", FORWARD, {"cases": 7}).save(calibration.default_path("Fake GPU"))
    return timed


def test_calibrating_the_backward_extends_the_stored_model_and_recovers_its_coefficients(monkeypatch, tmp_path):
    timed = fake_backward(monkeypatch, tmp_path)
    result = calibration.calibrate(kernels=("backward",))
    assert timed == calibration.backward_calibration_cases() and not result.cases
    assert result.model.coefficients == FORWARD and result.model.info["cases"] == 7
    for name in BACKWARD_FEATURES:
        assert result.model.backward_coefficients[name] == pytest.approx(BACKWARD[name], rel=1e-5), name
    assert result.model.info["backward_max_abs_relative_error"] < 1e-6
    assert result.model.info["extended"][-1]["kernels"] == ["backward"]


def test_calibrate_backward_leaves_host_bound_cases_out(monkeypatch, tmp_path):
    fake_backward(monkeypatch, tmp_path)
    cases = calibration.backward_calibration_cases()
    exact = dict(zip(cases, calibration.backward_case_features(cases, torch.bfloat16)
                     @ np.array([BACKWARD[name] for name in BACKWARD_FEATURES])))
    monkeypatch.setattr(calibration, "time_backward_case",
                        lambda case, dtype, device: 0.3 * calibration.HOST_BOUND_S if case == cases[2] else exact[case])
    result = calibration.calibrate(kernels=("backward",))
    assert list(np.nonzero(~result.backward_fitted)[0]) == [2]
    assert result.model.info["backward_host_bound_cases_left_out"] == 1


def test_natsim_calibrate_kernels_backward_prints_and_writes_the_backward_fit(monkeypatch, tmp_path):
    from natsim.cli.main import app

    fake_backward(monkeypatch, tmp_path)
    path = tmp_path / "out.json"
    runner = CliRunner()
    result = runner.invoke(app, ["calibrate", "--kernels", "backward", "--output", str(path), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert len(record["backward_measurements"]) == len(calibration.backward_calibration_cases())
    assert {"bwd_q_tile", "bwd_kv_tile", "measured_s", "predicted_s"} <= set(record["backward_measurements"][0])
    assert CostModel.load(path).backward_coefficients.keys() == set(BACKWARD_FEATURES)
    text = runner.invoke(app, ["calibrate", "--kernels", "backward", "--output", str(path)])
    flat = " ".join(text.stdout.split())
    assert text.exit_code == 0 and "GNA backward on 10 cases" in flat and "coefficients kept" in flat


def test_the_backward_cases_run_the_backward_kernels_in_the_interpreter():
    """A tiny version of each kind of backward case (3-D masked, dilated, causal 1-D, dense) runs the call that
    `time_backward_case` times, with the backward's default tiles, and its gradients match float64 reference
    gradients."""
    from natsim.kernels.gna.reference import reference_gradients

    tiny = [Problem((4, 8, 16), (2, 4, 8)), Problem((4, 8, 16), (2, 4, 4), dilation=(1, 2, 2)),
            Problem((256,), (64,), causal=True), Problem((2, 8, 16), (2, 8, 16))]
    torch.manual_seed(0)
    for problem in tiny:
        case = calibration.BackwardCase(problem, heads=1, head_dim=32)
        inputs = calibration.backward_case_inputs(case, torch.float16, torch.device("cpu"))
        got = calibration.backward_case_call(case, inputs)()
        q, k, v, _, _, grad = inputs
        want = reference_gradients(q, k, v, grad, problem.window, problem.stride, problem.dilation, problem.causal,
                                   compute_dtype=torch.float64)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            error = float((g.double() - w).norm() / w.norm())
            assert error < 5e-3, (problem, name, error)
