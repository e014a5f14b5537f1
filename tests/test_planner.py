"""natsim.planner on CPU: candidate windows, the 2% tie rule, plans as JSON, running a plan, bad arguments,
the tile catalog against the kernel's rules, the cost model's files and the calibration fit."""

from __future__ import annotations

import json
import math
from decimal import Decimal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from natsim import Problem, TileConfig, simulate, sweep
from natsim.dimension import dim_attended_pairs
from natsim.kernels import gna_attention, reference_attention
from natsim.kernels.common.checks import KERNEL_HEAD_DIMS
from natsim.kernels.common.headdim import head_split
from natsim.kernels.gna.checks import kernel_tiles
from natsim.kernels.gna.launch import permutes
from natsim.planner import (
    FEATURES,
    TILE_TOKENS,
    CostModel,
    Plan,
    best,
    cost_model_for,
    fastest_first,
    features_of,
    fit_coefficients,
    predicted_times,
    sweep_features,
    tile_catalog,
)
from natsim.planner.cost import describe_gpus, gpu_of, known_gpus, user_coefficients_dir
from natsim.planner.cost.calibrate import calibration_cases, case_features
from natsim.planner.cost.features import copies_rows_of
from natsim.planner.cost.files import gpu_file_name, own_host
from natsim.planner.search.gna import choose, stride_candidates
from natsim.planner.search.windows import ASPECT_LIMIT, DENSITY_SLACK, attended_pairs_stride1, candidate_windows

# Realistic magnitudes for an H100-class GPU (seconds per unit); used as a stand-in cost model and as the
# "true" coefficients that the calibration fit must recover.
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
TEST_GPU = CostModel("Test GPU", COEFFICIENTS)


def render(renderable) -> str:
    console = Console(record=True, width=140)
    console.print(renderable)
    return console.export_text()


# -- candidate windows -------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 7, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_closed_form_pairs_match_the_simulator(length, causal):
    windows = np.arange(1, length + 1)
    expected = [dim_attended_pairs(length, int(w), 1, 1, causal) for w in windows]
    assert attended_pairs_stride1(length, windows, causal).tolist() == expected


@pytest.mark.parametrize(
    "shape, target, causal",
    [
        ((30, 48, 80), 0.9, (False, False, False)),
        ((30, 48, 80), 0.56, (False, False, False)),
        ((16, 44, 80), 0.9, (True, False, False)),
        ((256, 256), 0.9, (False, False)),
        ((32768,), 0.9, (False,)),
    ],
)
def test_candidate_windows_meet_the_target_close_and_shaped_like_the_layout(shape, target, causal):
    found = candidate_windows(shape, target, causal, tile_catalog(shape))
    assert found.windows
    low, high = found.band
    assert low >= target - 1e-12 and high == pytest.approx(1 - (1 - DENSITY_SLACK) * (1 - low))
    for window, sparsity in zip(found.windows, found.sparsity):
        # every stride attends at most what stride 1 does, so stride 1 is the binding case
        exact = simulate(Problem(shape, window, causal=causal), TileConfig(16, 16)).sparsity
        assert exact == pytest.approx(sparsity, abs=1e-12)
        assert target - 1e-12 <= exact <= high + 1e-12
        coverage = [w / L for w, L in zip(window, shape)]
        assert max(coverage) / min(coverage) <= ASPECT_LIMIT * 1.1  # these layouts admit spreads below 1.1
    assert found.kv_alignment == tuple(sorted(found.kv_alignment, reverse=True))


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(4, 24), min_size=1, max_size=3).filter(lambda s: math.prod(s) >= 64),
    target=st.floats(0.0, 0.95),
    causal=st.booleans(),
)
def test_plans_meet_the_target_or_say_it_cannot_be_reached(shape, target, causal):
    try:
        plan = best(tuple(shape), target, causal=causal, head_dim=64)
    except ValueError as error:
        assert "cannot reach" in str(error) or "too small" in str(error)
        return
    assert plan.sparsity >= target - 1e-12
    assert plan.simulation.sparsity == simulate(plan.problem, plan.tiles).sparsity


@settings(max_examples=25, deadline=None)
@given(length=st.sampled_from([64, 80, 100, 125, 128, 160, 200, 250, 256, 400]), data=st.data())
def test_a_given_window_whose_sparsity_is_the_target_exactly_is_kept(length, data):
    """A 1-D window of w keys per query over L tokens has sparsity exactly 1 - w / L at stride 1 without causal
    masking; where that is a short decimal (L divides a power of ten) and a user gives it as the target, the
    window reaches it, as the search's own candidates do (float rounding put 1 - 7 / 100 under 0.93)."""
    window = data.draw(st.integers(1, length - 1), label="window")
    target = float(Decimal(1) - Decimal(window) / Decimal(length))
    plan = best((length,), target, window=(window,), head_dim=64)
    assert plan.problem.window == (window,)


def test_numpy_integers_are_accepted_where_ints_are():
    plan = best((8, 16, 16), 0.75, heads=np.int64(4), head_dim=np.int64(64), world_size=np.int32(2))
    assert (plan.world_size, plan.head_dim, plan.heads) == (2, 64, 4)
    assert all(type(v) is int for v in (plan.world_size, plan.head_dim, plan.heads))


def test_a_given_window_is_kept_and_max_stride_is_respected():
    plan = best((30, 48, 80), 0.9, window=(18, 24, 24), max_stride=(2, 8, 8))
    assert plan.problem.window == (18, 24, 24)
    assert all(s <= m for s, m in zip(plan.problem.stride, (2, 8, 8)))
    assert plan.search.window_given and plan.search.windows == ((18, 24, 24),)


def test_stride_candidates_are_powers_of_two_and_the_window():
    assert stride_candidates((18,)) == [(1,), (2,), (4,), (8,), (16,), (18,)]
    assert stride_candidates((8, 3), max_stride=(4, 8)) == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (4, 1), (4, 2), (4, 3)]


# -- the 2% tie rule ---------------------------------------------------------------------------------


def test_tie_rule_prefers_the_smallest_stride_product_within_two_percent():
    scores = np.array([1.000, 1.019, 1.025, 1.010])
    products = np.array([64, 8, 1, 8])
    assert choose(scores, products) == 3  # products 8 tie: the better score wins
    assert choose(np.array([1.000, 1.021]), np.array([64, 1])) == 0  # 2.1% is not a tie
    assert choose(np.array([1.0, 1.0]), np.array([4, 4])) == 0


def test_tie_rule_in_best_gives_up_a_faster_larger_stride():
    plan = best((96, 96), 0.0, window=(20, 20), heads=4, cost_model=TEST_GPU)
    fastest = plan.search.fastest
    assert math.prod(plan.problem.stride) < math.prod(fastest.stride)
    assert fastest.score < plan.score <= fastest.score * 1.02
    assert "within 2%" in render(plan.explain())


# -- cost model and predictions ----------------------------------------------------------------------


def test_plan_with_a_cost_model_predicts_what_the_model_says_for_its_own_features():
    plan = best((30, 48, 80), 0.9, heads=24, cost_model=TEST_GPU)
    assert plan.calibrated and plan.basis == "cost model" and plan.gpu == "Test GPU"
    row = features_of(plan.simulation, batch_heads=24, head_dim=128, element_bytes=2, permutation=False)
    assert plan.predicted_time_s == pytest.approx(float(TEST_GPU.predict(row)), rel=1e-12)
    assert sum(plan.breakdown.values()) == pytest.approx(plan.predicted_time_s, rel=1e-12)
    assert plan.predicted_speedup > 5
    assert all(c.score >= plan.search.fastest.score for c in plan.runners_up)
    text = render(plan.explain())
    assert "Ranked by the cost model fitted on Test GPU" in text and "runners-up" in text


def test_without_coefficients_the_plan_ranks_by_tiles_and_says_so():
    plan = best((30, 48, 80), 0.9, device="cpu")
    assert not plan.calibrated and plan.basis == "simulated tiles" and plan.predicted_time_s is None
    assert plan.simulation.block_sparse
    text = render(plan.explain())
    assert "No cost-model coefficients" in text and "ranked by simulated tile work alone" in text


def test_cost_model_files_round_trip_and_are_found_by_gpu_name(tmp_path):
    path = TEST_GPU.save(tmp_path / gpu_file_name("NVIDIA H100 80GB HBM3"))
    assert path.name == "nvidia-h100-80gb-hbm3.json"
    assert CostModel.load(path) == TEST_GPU
    assert cost_model_for("NVIDIA H100 80GB HBM3", tmp_path) == TEST_GPU
    assert cost_model_for("Some Other GPU", tmp_path) is None and cost_model_for(None, tmp_path) is None


H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"  # a GPU without coefficients, whatever coefficient files ship


@pytest.mark.parametrize("device", ["h100", "H100", H100, H100.lower(), "nvidia-h100-80gb-hbm3", "h100 80gb"])
def test_a_shipped_gpu_is_named_by_its_full_name_or_an_alias_without_that_gpu(device):
    assert gpu_of(device) == H100
    plan = best((30, 48, 80), 0.9, heads=24, device=device)
    assert plan.calibrated and plan.gpu == H100
    row = features_of(plan.simulation, batch_heads=24, head_dim=128, element_bytes=2, permutation=False)
    assert plan.predicted_time_s == pytest.approx(float(cost_model_for(H100).predict(row)), rel=1e-12)


def test_an_alias_names_one_board_whatever_files_exist_and_word_runs_must_pick_one_gpu():
    shipped = known_gpus()
    CostModel("NVIDIA H100 PCIe", COEFFICIENTS).save(user_coefficients_dir() / gpu_file_name("NVIDIA H100 PCIe"))
    assert known_gpus() == sorted([*shipped, "NVIDIA H100 PCIe"])
    assert describe_gpus([H100, "NVIDIA H100 PCIe"]) == f"{H100} (--device h100), NVIDIA H100 PCIe (--device h100-pcie)"
    assert gpu_of("h100-pcie") == gpu_of("H100 PCIe") == "NVIDIA H100 PCIe" and gpu_of("h100 80GB") == H100
    assert gpu_of("h100") == H100  # the SXM board, even beside a PCIe board's file
    with pytest.raises(ValueError, match=r"device='nvidia' matches more than one GPU: "):
        gpu_of("nvidia")
    with pytest.raises(ValueError, match=r"a known GPU \(NVIDIA H100 80GB HBM3 \(--device h100\), "):
        gpu_of("h10")  # a part of a word names nothing


def test_a_gpu_without_coefficients_does_not_borrow_another_gpus_and_the_report_names_them(monkeypatch):
    """On a GPU without coefficients (an A100) the plan ranks by tiles and says which GPUs it could use."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: A100)
    plan = best((30, 48, 80), 0.9, heads=24)
    assert plan.gpu == A100 and not plan.calibrated and plan.predicted_time_s is None
    text = " ".join(render(plan.explain()).split())
    assert f"No cost-model coefficients for {A100}: configurations were ranked by simulated tile work alone" in text
    assert f"Coefficients exist for {H100} (--device h100)" in text
    assert best((30, 48, 80), 0.9, heads=24, device="h100").calibrated


def test_on_an_uncalibrated_gpu_best_autoplan_and_explain_say_so_and_give_the_command(monkeypatch):
    """An A100 (no coefficients) met by `best`, by `AutoPlan` on a CUDA device and for training: each plan ranks
    by simulated tile work and its report says the GPU is uncalibrated, how it was ranked, and what to run."""
    from natsim.planner import AutoPlan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: A100)
    where = f"writes {gpu_file_name(A100)} to {user_coefficients_dir()}"
    shape = (8, 16, 24)
    auto = AutoPlan(0.8).plan_for(shape, heads=4, head_dim=128, dtype=torch.bfloat16, device="cuda:0")
    for plan, kernels in ((best(shape, 0.8, heads=4), "gna,sparse"), (auto, "gna,sparse"),
                          (best(shape, 0.8, heads=4, training=True), "gna,backward")):
        assert plan.gpu == A100 and not plan.calibrated and plan.predicted_time_s is None
        text = " ".join(render(plan.explain()).split())
        assert "ranked by simulated tile work" in text or "ranked for training by simulated tile work" in text
        assert f"{A100} is uncalibrated for this plan: run `natsim calibrate --kernels {kernels}` on it" in text
        assert where in text


def test_the_user_coefficient_folder_follows_natsim_data_dir_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert user_coefficients_dir() == tmp_path / "data" / "coefficients"
    monkeypatch.delenv("NATSIM_DATA_DIR")
    assert user_coefficients_dir() == tmp_path / "xdg" / "natsim" / "coefficients"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_coefficients_dir() == tmp_path / "home" / ".local" / "share" / "natsim" / "coefficients"


def test_the_planner_looks_in_the_user_folder_before_the_shipped_coefficients():
    from natsim.planner.cost import COEFFICIENTS_DIR

    shipped, stored = cost_model_for(H100), CostModel.load(COEFFICIENTS_DIR / gpu_file_name(H100))
    # the file's coefficients and its own host times (the others' lent where it has none: test_planner_host.py)
    assert shipped is not None and shipped.coefficients == stored.coefficients
    assert own_host(shipped) == (stored.host_seconds, stored.info)
    gpus = known_gpus()
    mine = CostModel(H100, COEFFICIENTS).save(user_coefficients_dir() / gpu_file_name(H100))
    found = cost_model_for(H100)
    assert found.coefficients == CostModel.load(mine).coefficients != shipped.coefficients
    assert known_gpus() == gpus and H100 in gpus
    plan = best((30, 48, 80), 0.9, heads=24, device="h100")
    row = features_of(plan.simulation, batch_heads=24, head_dim=128, element_bytes=2, permutation=False)
    assert plan.predicted_time_s == pytest.approx(float(CostModel.load(mine).predict(row)), rel=1e-12)


def test_features_of_prices_the_row_copy_as_sweeps_do():
    """At head_dim 72 bf16 rows start 16 bytes apart, and the dynamic kernel's 64-query launches copy q, k, v into
    aligned rows first: `features_of` (what calibration fits) counts that copy's bytes as `sweep_features` (what
    searches score) does, on those launches only."""
    tiles = [TileConfig((8, 8), (8, 8), kv_tiling="dynamic"), TileConfig((8, 16), (8, 16), kv_tiling="dynamic"),
             TileConfig((8, 8), (8, 8))]
    result = sweep((24, 40), (7, 9), tiles=tiles)
    copied = copies_rows_of(tiles, head_dim=72, element_bytes=2, permutation=False)
    assert copied.tolist() == [True, False, False]
    features = sweep_features(result, batch_heads=3, head_dim=72, element_bytes=2, permutation=False)
    moved = FEATURES.index("permute_bytes")
    for i in range(len(result)):
        row = features_of(result.result(i), batch_heads=3, head_dim=72, element_bytes=2, permutation=False)
        np.testing.assert_allclose(features[i], row, rtol=1e-12)
        assert (row[moved] > 0) == copied[result.tile_index[i]]


@pytest.mark.parametrize("head_dim", [40, 72, 96, 112, 128])
def test_split_head_flops_follow_the_launchs_head_split(head_dim):
    """`split_head_flops` counts a call's FLOPs where its launch runs head_dim in two chunks (`head_split`'s
    default: the static kernel splits 40, 72 and 96; the dynamic kernel's 128-query tiles pad them; 112 and
    powers of two never split), never in FP8 (which pads), and the sweep's rows agree with `features_of`."""
    tiles = [TileConfig((8, 16), (8, 16)), TileConfig((8, 16), (8, 16), kv_tiling="dynamic"),
             TileConfig((8, 8), (8, 8), kv_tiling="dynamic")]
    result = sweep((24, 40), (7, 9), tiles=tiles)
    split = FEATURES.index("split_head_flops")
    flops = FEATURES.index("full_flops"), FEATURES.index("masked_flops")
    features = sweep_features(result, batch_heads=3, head_dim=head_dim, element_bytes=2, permutation=False)
    for i in range(len(result)):
        tile = result.tiles[result.tile_index[i]]
        row = features_of(result.result(i), batch_heads=3, head_dim=head_dim, element_bytes=2, permutation=False)
        splits = head_split(head_dim, launch=(tile.kv_tiling, tile.q_tokens)).b > 0
        assert row[split] == pytest.approx(splits * row[list(flops)].sum(), rel=1e-12)
        np.testing.assert_allclose(features[i], row, rtol=1e-12)
        fp8 = features_of(result.result(i), batch_heads=3, head_dim=head_dim, element_bytes=2, quantized=True)
        assert fp8[split] == 0.0
    assert any(head_split(head_dim, launch=(t.kv_tiling, t.q_tokens)).b for t in tiles) == (head_dim in (40, 72, 96))


@pytest.mark.parametrize("dilation, causal", [(1, False), ((1, 2), (True, False))])
def test_sweep_times_are_the_cost_model_on_each_rows_features(dilation, causal):
    result = sweep((24, 40), (7, 9), dilation=dilation, causal=causal, tiles=tile_catalog((24, 40), 64))
    permutation = permutes(result.problem)  # only dilated calls permute their tokens
    features = sweep_features(result, batch_heads=3, head_dim=64, element_bytes=2, permutation=permutation)
    for i in range(0, len(result), 7):
        expected = features_of(result.result(i), batch_heads=3, head_dim=64, element_bytes=2,
                               permutation=permutation)
        np.testing.assert_allclose(features[i], expected, rtol=1e-12)
    seconds = predicted_times(result, TEST_GPU, heads=3, head_dim=64, dtype="fp16")
    np.testing.assert_allclose(seconds, TEST_GPU.predict(features), rtol=1e-12)
    everything = fastest_first(result, seconds, pruned=False)
    assert sorted(everything) == list(range(len(result))) and (np.diff(seconds[everything]) >= 0).all()
    pruned = fastest_first(result, seconds)
    products = result.stride_product
    for i in range(len(result)):
        beats_smaller = (seconds[i] < seconds[products < products[i]] * (1 - 1e-12)).all()
        assert (i in pruned) == beats_smaller
    with pytest.raises(ValueError, match="predicted times need multi-D tiles"):
        predicted_times(sweep((64,), (9,), tiles=[TileConfig(16, 16, tiling="1d")]), TEST_GPU)


@pytest.mark.parametrize(
    "coefficients, message",
    [
        ({**COEFFICIENTS, "launch": -1.0}, "non-negative"),
        ({k: v for k, v in COEFFICIENTS.items() if k != "launch"}, "exactly the features"),
    ],
)
def test_cost_model_rejects_bad_coefficients(coefficients, message):
    with pytest.raises(ValueError, match=message):
        CostModel("GPU", coefficients)


# -- plans as data and as code -----------------------------------------------------------------------


@pytest.mark.parametrize("cost_model", [None, TEST_GPU])
def test_plans_round_trip_through_json(cost_model):
    plan = best((16, 44, 80), 0.9, heads=8, causal=(True, False, False), cost_model=cost_model)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_dict() == plan.to_dict()
    assert json.loads(again.to_json())["figures"]["sparsity"] == plan.sparsity
    assert again.simulation == plan.simulation


def test_reading_a_plan_from_text_that_is_not_one_is_a_clear_value_error():
    record = best((16, 44, 80), 0.9).to_dict()
    text = json.dumps(record, indent=2)
    cases = [
        ("not json", r"Plan.from_json expects a plan JSON document \(format 'natsim-plan/1', as written by "
                     r"Plan.to_json\), but parsing failed at line 1, column 1: Expecting value."),
        (text[: text.index('"basis"')], r"parsing failed at line \d+, column \d+"),
        ("[1, 2]", r"a plan must be a JSON object with format 'natsim-plan/1' .*got a value of type list."),
        (json.dumps({k: v for k, v in record.items() if k != "basis"}), "must have the key 'basis', which is missing."),
        (json.dumps({k: v for k, v in record.items() if k not in ("score", "search")}), "the keys 'score', 'search', which are missing."),
        (json.dumps({**record, "tiles": {"q_tile": [1, 8, 8]}}), "a plan's 'tiles' must have the key 'kv_tile', which is missing."),
        (json.dumps({**record, "search": {**record["search"], "top": [{"window": [1, 1, 1]}]}}), "a plan's 'search' must have the key 'stride'"),
    ]
    for text, message in cases:
        with pytest.raises(ValueError, match=message):
            Plan.from_json(text)


def test_a_plan_runs_gna_attention_with_exactly_its_settings():
    torch.manual_seed(0)
    plan = best((4, 8, 8), 0.5, heads=2, head_dim=32, dtype=torch.float16)
    q, k, v = (torch.randn((1, 4, 8, 8, 2, 32), dtype=torch.float16) for _ in range(3))
    p, t = plan.problem, plan.tiles
    expected = gna_attention(
        q, k, v, p.window, p.stride, p.dilation, p.causal, q_tile=t.q_tile, kv_tile=t.kv_tile, kv_tiling=t.kv_tiling
    )
    assert torch.equal(plan(q, k, v), expected)
    assert torch.equal(Plan.from_json(plan.to_json())(q, k, v), expected)
    reference = reference_attention(q.double(), k.double(), v.double(), p.window, p.stride, p.dilation, p.causal)
    assert float((expected.double() - reference).norm() / reference.norm()) < 5e-3
    with pytest.raises(ValueError, match="this plan is for token layout shape=\\(4, 8, 8\\)"):
        plan(q[:, :2], k[:, :2], v[:, :2])


# -- bad arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (((30, 48, 80), 1.2), {}, ValueError, r"sparsity must lie in \[0, 1\), got target_sparsity=1.2."),
        (((30, 48, 80), 1.0), {}, ValueError, r"sparsity must lie in \[0, 1\)"),
        (((30, 48, 80), -0.1), {}, ValueError, r"sparsity must lie in \[0, 1\)"),
        (((30, 48, 80), "0.9"), {}, TypeError, "target_sparsity must be a number"),
        (((8, 8), 0.99), {}, ValueError, r"shape=\(8, 8\) cannot reach target_sparsity=0.99"),
        (((64,), 0.99), {}, ValueError, "cannot reach target_sparsity=0.99"),
        (((3, 3), 0.5), {}, ValueError, "too small for the planner's tiles"),
        (((30, 48, 80), 0.9), {"dtype": "fp32"}, ValueError, r"dtype must be one of those the GNA kernel runs \(fp16, bf16\)"),
        (((30, 48, 80), 0.9), {"dtype": torch.float32}, ValueError, "dtype must be one of"),
        (((30, 48, 80), 0.9), {"dtype": 3}, TypeError, "dtype must be a torch.dtype or a name"),
        (((30, 48, 80), 0.9), {"head_dim": 20}, ValueError, r"head_dim must be one the GNA kernel runs \(16 to 256 in steps of 8\)"),
        (((30, 48, 80), 0.9), {"heads": 0}, ValueError, "heads must be a positive integer"),
        (((30, 48, 80), 0.9), {"head_dim": 16, "precision": "fp8"}, ValueError,
         r"the FP8 kernel \(precision='fp8'\) supports head_dim 24 to 256 in steps of 8, got head_dim=16"),
        (((30, 48, 80), 0.9), {"window": (30, 48, 80)}, ValueError, r"window=\(30, 48, 80\) has sparsity 0.000000"),
        (((30, 48, 80), 0.9), {"window": (18, 24)}, ValueError, "window must have one value per dimension"),
        (((30, 48, 80), 0.9), {"max_stride": 0}, ValueError, "max_stride must be at least 1"),
        (((30, 48, 80), 0.9), {"cost_model": {"launch": 1}}, TypeError, "cost_model must be a natsim.planner.CostModel"),
        (((0, 8), 0.5), {}, ValueError, "every dimension of shape must be at least 1"),
        (((30, 48, 80), 0.9), {"device": "tpu-ish"}, ValueError, "device must name a torch device"),
        (((30, 48, 80), 0.9), {"device": "NVIDIA H200 NVL"}, ValueError,
         r"device='NVIDIA H200 NVL' names NVIDIA H200 NVL, which has no cost-model coefficients here"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        best(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_a_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="names a CUDA device, but torch sees no CUDA GPU"):
        best((30, 48, 80), 0.9, device="cuda")


# -- the tile catalog --------------------------------------------------------------------------------


def test_tile_token_pairs_follow_the_catalog_rule_and_the_kernels_head_dims():
    assert set(TILE_TOKENS) <= set(KERNEL_HEAD_DIMS)
    for pairs in TILE_TOKENS.values():
        assert all(kv in (q, q // 2) for q, kv in pairs)


@pytest.mark.parametrize("shape", [(30, 48, 80), (16, 44, 80), (256, 256), (32768,), (8, 8)])
@pytest.mark.parametrize("head_dim", sorted(TILE_TOKENS))
def test_every_catalog_tile_is_one_the_kernel_accepts(shape, head_dim):
    catalog = tile_catalog(shape, head_dim)
    assert catalog and len(set(catalog)) == len(catalog)
    problem = Problem(shape, 1)
    for tiles in catalog:
        assert kernel_tiles(problem, tiles.q_tile, tiles.kv_tile) == (tiles.q_tile, tiles.kv_tile)
        assert (tiles.q_tokens, tiles.kv_tokens) in TILE_TOKENS[head_dim]


# -- calibration -------------------------------------------------------------------------------------


def synthetic_times(features: np.ndarray, coefficients: dict, noise: float, seed: int) -> np.ndarray:
    exact = features @ np.array([coefficients[name] for name in FEATURES])
    return exact * (1 + noise * np.random.default_rng(seed).standard_normal(len(exact)))


def test_calibration_fit_recovers_known_coefficients():
    features = case_features(calibration_cases(), torch.bfloat16)
    fitted = fit_coefficients(features, synthetic_times(features, COEFFICIENTS, 0.0, 0))
    for name in FEATURES:
        assert fitted[name] == pytest.approx(COEFFICIENTS[name], rel=1e-6), name


@pytest.mark.parametrize("seed", range(3))
def test_calibration_fit_is_stable_under_timing_noise(seed):
    features = case_features(calibration_cases(), torch.bfloat16)
    times = synthetic_times(features, COEFFICIENTS, 0.01, seed)
    fitted = fit_coefficients(features, times)
    for name in ("full_flops", "masked_flops", "permute_bytes"):
        assert fitted[name] == pytest.approx(COEFFICIENTS[name], rel=0.05), name
    for name in ("kv_tile_visits", "programs"):  # small shares of any case's time: looser
        assert fitted[name] == pytest.approx(COEFFICIENTS[name], rel=0.5), name
    # `launch` (20 us here) is under 2% of every case, within the noise: only the predictions say it is right.
    model = CostModel("fit", fitted)
    exact = synthetic_times(features, COEFFICIENTS, 0.0, 0)
    assert np.max(np.abs(model.predict(features) / exact - 1)) < 0.03


def test_calibration_fit_keeps_absent_costs_at_zero():
    truth = {**COEFFICIENTS, "programs": 0.0, "kv_tile_visits": 0.0}
    features = case_features(calibration_cases(), torch.bfloat16)
    fitted = fit_coefficients(features, synthetic_times(features, truth, 0.0, 0))
    assert all(value >= 0 for value in fitted.values())
    assert fitted["programs"] == pytest.approx(0.0, abs=1e-15) and fitted["kv_tile_visits"] == pytest.approx(0.0, abs=1e-15)
    assert fitted["full_flops"] == pytest.approx(truth["full_flops"], rel=1e-6)


@pytest.mark.parametrize(
    "features, times, message",
    [
        (np.ones((10, len(FEATURES) - 1)), np.ones(10), "features must be"),
        (np.ones((10, len(FEATURES))), np.ones(9), "one time per feature row"),
        (np.ones((10, len(FEATURES))), -np.ones(10), "positive and finite"),
        (np.ones((3, len(FEATURES))), np.ones(3), "at least as many measurements"),
    ],
)
def test_calibration_fit_rejects_bad_input(features, times, message):
    with pytest.raises(ValueError, match=message):
        fit_coefficients(features, times)


def test_calibration_cases_run_on_catalog_tiles():
    for case in calibration_cases():
        assert case.tiles in tile_catalog(case.problem.shape, case.head_dim, ("static", "dynamic"))


def test_calibrate_times_every_case_and_fits_them(monkeypatch):
    """The calibration flow with the GPU timing replaced by times from known coefficients."""
    from natsim.planner.cost import calibrate as calibration

    truth = np.array([COEFFICIENTS[name] for name in FEATURES])
    timed = []

    def fake_time(case, dtype, device):
        timed.append(case)
        return float(case_features([case], dtype)[0] @ truth)

    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", fake_time)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    progress = []
    result = calibration.calibrate(
        dtype="fp16", progress=lambda done, total: progress.append((done, total)), kernels=("gna",)
    )
    assert timed == calibration_cases() and progress[-1] == (len(timed), len(timed))
    assert result.model.gpu == "Fake GPU" and result.model.info["dtype"] == "fp16"
    for name in FEATURES:
        assert result.model.coefficients[name] == pytest.approx(COEFFICIENTS[name], rel=1e-6)
    assert result.model.info["max_abs_relative_error"] < 1e-9
    assert calibration.default_path("Fake GPU") == user_coefficients_dir() / "fake-gpu.json"


def test_recalibrating_gna_keeps_what_the_stored_model_has_of_other_kernels(monkeypatch, tmp_path):
    """Refitting the GNA kernel on a GPU with a stored model (the shipped H100 file, under a fake name) replaces
    its forward coefficients and keeps the sets it did not time (backward, FP8, FlashAttention-4, Gluon) and its
    host times, recording the calibration under "extended"."""
    from dataclasses import replace

    from natsim.planner.cost import calibrate as calibration
    from natsim.planner.cost.model import OPTIONAL_SETS

    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    stored = replace(cost_model_for(H100), gpu="Fake GPU")
    stored.save(calibration.default_path("Fake GPU"))
    truth = np.array([COEFFICIENTS[name] for name in FEATURES])
    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: float(case_features([case], dtype)[0] @ truth))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model = calibration.calibrate(kernels=("gna",)).model
    for name in FEATURES:
        assert model.coefficients[name] == pytest.approx(COEFFICIENTS[name], rel=1e-6), name
    assert model.info["max_abs_relative_error"] < 1e-9 and model.info["cases"] == len(calibration_cases())
    for name in OPTIONAL_SETS:
        assert getattr(model, name) == getattr(stored, name), name
    assert model.host_seconds == own_host(stored)[0] and model.info["extended"][-1]["kernels"] == ["gna"]
    assert model.info["sparse_cases"] == stored.info["sparse_cases"]


def test_calibrate_leaves_host_bound_cases_out_of_the_fit(monkeypatch):
    """Cases whose calls take the host's time (a floor, not GPU work plus overhead) must not bend the fit."""
    from natsim.planner.cost import calibrate as calibration

    truth = np.array([COEFFICIENTS[name] for name in FEATURES])
    cases = calibration_cases()
    exact = case_features(cases, torch.bfloat16) @ truth
    host_bound = set(range(0, len(cases), 5))  # every fifth case measures a host floor under HOST_BOUND_S
    floor = 0.4 * calibration.HOST_BOUND_S
    times = iter([floor if i in host_bound else t for i, t in enumerate(exact)])

    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: next(times))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    result = calibration.calibrate(kernels=("gna",))
    expected_fitted = np.array([i not in host_bound and t >= calibration.HOST_BOUND_S for i, t in enumerate(exact)])
    assert (result.fitted == expected_fitted).all() and (~result.fitted).any()
    assert result.model.info["cases"] == expected_fitted.sum()
    assert result.model.info["host_bound_cases_left_out"] == len(cases) - expected_fitted.sum()
    for name in FEATURES:
        assert result.model.coefficients[name] == pytest.approx(COEFFICIENTS[name], rel=1e-6), name


def test_calibrate_refuses_a_gpu_where_every_case_is_host_bound(monkeypatch):
    from natsim.planner.cost import calibrate as calibration

    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: 0.5 * calibration.HOST_BOUND_S)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match="not host-bound"):
        calibration.calibrate(kernels=("gna",))


def test_shipped_coefficient_files_load():
    """Every coefficients file natsim ships names exactly the current features (a format drift fails here)."""
    from natsim.planner.cost import COEFFICIENTS_DIR

    files = sorted(path for path in COEFFICIENTS_DIR.glob("*.json") if not path.name.startswith("link-"))
    assert files, "natsim ships at least the H100 coefficients"
    for path in files:
        model = CostModel.load(path)
        assert path.name == gpu_file_name(model.gpu)
        assert all(value >= 0 for value in model.coefficients.values())


def test_shipped_links_load_under_their_file_names():
    """The interconnect measurements natsim ships (link-<gpu>-x<P>.json) are Links of the GPUs they are named for,
    and the planner finds them by GPU and world size."""
    import json

    from natsim.partition import Link
    from natsim.planner.cost.files import link_file_name, link_for
    from natsim.stored import LINKS_DIR

    for world in (2, 4):
        path = LINKS_DIR / link_file_name("NVIDIA H200", world)
        link = Link.from_dict(json.loads(path.read_text()))
        assert f"{world} x NVIDIA H200" in link.source and link.all_to_all.bytes_per_second > 1e11
        assert link_for("NVIDIA H200", world, LINKS_DIR) == link_for("NVIDIA H200", world) == link


# -- KV tiling modes ------------------------------------------------------------------------------------------

BOTH = ("static", "dynamic")


def test_the_catalog_holds_every_tile_pair_in_each_mode_asked_for_static_first():
    static = tile_catalog((30, 48, 80), 128)
    both = tile_catalog((30, 48, 80), 128, BOTH)
    assert all(t.kv_tiling == "static" for t in static)
    assert both[0::2] == static
    assert [(t.q_tile, t.kv_tile, t.kv_tiling) for t in both[1::2]] == [(t.q_tile, t.kv_tile, "dynamic") for t in static]
    with pytest.raises(ValueError, match=r"kv_tilings must name one or both of \('static', 'dynamic'\), got"):
        tile_catalog((30, 48, 80), 128, ("grid",))


def test_without_a_cost_model_both_modes_are_ranked_by_simulated_tile_work():
    """HunyuanVideo at stride 1: dynamic boxes need fewer tile pairs than any static grid (the simulator)."""
    plan = best((30, 48, 80), 0.9, window=(18, 24, 24), max_stride=1)
    assert plan.search.kv_tilings == BOTH and not plan.calibrated
    problem = Problem((30, 48, 80), (18, 24, 24))
    work = {(t.q_tile, t.kv_tile, t.kv_tiling): simulate(problem, t).visited_tiles * t.q_tokens * t.kv_tokens
            for t in tile_catalog((30, 48, 80), 128, BOTH)}
    assert plan.score == min(work.values())
    assert plan.tiles.kv_tiling == "dynamic"
    assert work[(plan.tiles.q_tile, plan.tiles.kv_tile, "dynamic")] < min(
        w for (q, kv, mode), w in work.items() if mode == "static")
    assert "KV tiling" in render(plan.explain()) and "dynamic (box per Q tile)" in render(plan.explain())


def test_a_cost_model_scores_only_the_modes_it_was_calibrated_on():
    static_only = best((30, 48, 80), 0.9, window=(18, 24, 24), max_stride=1, cost_model=TEST_GPU)
    assert static_only.search.kv_tilings == ("static",) and static_only.tiles.kv_tiling == "static"
    assert "static KV tiling only" in render(static_only.explain())
    both = CostModel("Test GPU", COEFFICIENTS, info={"kv_tilings": list(BOTH)})
    plan = best((30, 48, 80), 0.9, window=(18, 24, 24), max_stride=1, cost_model=both)
    assert plan.search.kv_tilings == BOTH
    features = features_of(simulate(plan.problem, plan.tiles), batch_heads=1, head_dim=128, element_bytes=2,
                           permutation=False)
    assert plan.score == pytest.approx(float(both.predict(features)))
    assert plan.score <= static_only.score


def test_plans_with_dynamic_tiles_round_trip_and_older_plans_read_as_static():
    plan = best((30, 48, 80), 0.9, window=(18, 24, 24), max_stride=1)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.tiles.kv_tiling == "dynamic"
    record = plan.to_dict()
    record["tiles"]["kv_tiling"] = "static"
    for candidate in record["runners_up"] + record["search"]["top"]:
        del candidate["kv_tiling"]
    del record["search"]["kv_tilings"]
    old = Plan.from_dict(record)
    assert old.search.kv_tilings == ("static",) and all(c.kv_tiling == "static" for c in old.search.top)


def test_a_dynamic_plan_runs_the_dynamic_kernel():
    torch.manual_seed(1)
    plan = best((6, 8, 8), 0.5, window=(3, 5, 5), max_stride=1, head_dim=32, dtype=torch.float16)
    plan = Plan.from_dict({**plan.to_dict(), "tiles": {**plan.tiles.to_dict(), "kv_tiling": "dynamic"}})
    q, k, v = (torch.randn((1, 6, 8, 8, 2, 32), dtype=torch.float16) for _ in range(3))
    p, t = plan.problem, plan.tiles
    expected = gna_attention(q, k, v, p.window, p.stride, q_tile=t.q_tile, kv_tile=t.kv_tile, kv_tiling="dynamic")
    assert torch.equal(plan(q, k, v), expected)
    reference = reference_attention(q.double(), k.double(), v.double(), p.window, p.stride)
    assert float((expected.double() - reference).norm() / reference.norm()) < 5e-3


def test_calibration_marks_the_dynamic_mode_once_its_cases_are_fitted(monkeypatch):
    from natsim.planner.cost import calibrate as calibration

    truth = np.array([COEFFICIENTS[name] for name in FEATURES])
    cases = calibration_cases()
    assert any(c.tiles.kv_tiling == "dynamic" for c in cases)
    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: float(case_features([case], dtype)[0] @ truth))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model = calibration.calibrate(kernels=("gna",)).model
    assert model.kv_tilings == BOTH
    assert model.info["dynamic_cases"] == sum(c.tiles.kv_tiling == "dynamic" for c in cases)
    assert model.info["dynamic_max_abs_relative_error"] < 1e-9
    # a GPU where every dynamic case is host-bound has no fitted dynamic case: static only
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: (
        0.5 * calibration.HOST_BOUND_S if case.tiles.kv_tiling == "dynamic" else float(case_features([case], dtype)[0] @ truth)))
    assert calibration.calibrate(kernels=("gna",)).model.kv_tilings == ("static",)
