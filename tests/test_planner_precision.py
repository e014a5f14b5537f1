"""The planner and the cost model with `precision="fp8"`: FP8 coefficient sets (stored, loaded, fitted by
`natsim calibrate`), `best` / `best_mask` / `AutoPlan` / `natsim plan` / `natsim mask` ranking and running the
FP8 kernels, and the head_dim feature that older coefficient files lack.

Scores are checked against features recomputed here from the simulator (and from `prepare_sparse` for masks),
not against the planner's own intermediate values; FP8 runs against `gna_attention` / `sparse_attention` with
`precision="fp8"` (Triton's interpreter on the CPU).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from natsim import Problem, TileConfig, simulate
from natsim.cli.main import app
from natsim.kernels import gna_attention, prepare_sparse, sparse_attention
from natsim.kernels.sparse.work import default_blocks
from natsim.planner import (FEATURES, SPARSE_FEATURES, AutoPlan, CostModel, MaskPlan, Plan, best, best_mask,
                            sparse_features)
from natsim.planner.cost import calibrate as calibration
from natsim.planner.cost.features import feature_matrix, features_of, padded_tokens

GNA = {
    "full_flops": 1 / 550e12, "masked_flops": 1 / 300e12, "narrow_q_flops": 1 / 4000e12,
    "narrow_kv_flops": 1 / 3000e12, "narrow_head_flops": 1 / 2000e12, "split_head_flops": 1 / 8000e12,
    "kv_tile_visits": 1e-9, "programs": 1e-8,
    "permute_bytes": 1 / 2.5e12, "launch": 2e-5,
}
SPARSE = {
    "full_flops": 1 / 480e12, "masked_flops": 1 / 900e12, "gathered_flops": 1 / 1500e12,
    "narrow_flops": 1 / 200e12, "narrow_head_flops": 1 / 2500e12, "tiles": 1.5e-8, "programs": 2e-7,
    "launch": 3e-5,
}
# FP8's: faster per FLOP, a larger fixed cost (the quantization pass's launch), dearer bytes.
FP8_GNA = {**GNA, "full_flops": 1 / 900e12, "masked_flops": 1 / 500e12, "permute_bytes": 1 / 2e12, "launch": 3e-4}
FP8_SPARSE = {**SPARSE, "full_flops": 1 / 800e12, "masked_flops": 1 / 1200e12, "launch": 2e-4}
GPU = "Test GPU"


def model(**sets) -> CostModel:
    return CostModel(GPU, GNA, sparse_coefficients=SPARSE, **sets)


FP8_MODEL = model(fp8_coefficients=FP8_GNA, fp8_sparse_coefficients=FP8_SPARSE)


def vector(coefficients: dict, names) -> np.ndarray:
    return np.array([coefficients[name] for name in names])


# -- the cost model ---------------------------------------------------------------------------------------------


def test_fp8_sets_round_trip_and_price_with_their_own_coefficients():
    again = CostModel.from_dict(json.loads(json.dumps(FP8_MODEL.to_dict())))
    assert again == FP8_MODEL
    row = np.arange(1.0, len(FEATURES) + 1)
    assert FP8_MODEL.predict(row, "fp8") == pytest.approx(row @ vector(FP8_GNA, FEATURES))
    assert FP8_MODEL.predict(row) == pytest.approx(row @ vector(GNA, FEATURES))
    sparse_row = np.arange(1.0, len(SPARSE_FEATURES) + 1)
    assert FP8_MODEL.predict_sparse(sparse_row, "fp8") == pytest.approx(sparse_row @ vector(FP8_SPARSE, SPARSE_FEATURES))
    assert sum(FP8_MODEL.breakdown(row, "fp8").values()) == pytest.approx(FP8_MODEL.predict(row, "fp8"))


def test_a_model_without_fp8_coefficients_says_how_to_fit_them():
    with pytest.raises(ValueError, match=r"no FP8 GNA-kernel coefficients; run `natsim calibrate --kernels gna,gna-fp8`"):
        model().predict(np.ones(len(FEATURES)), "fp8")
    with pytest.raises(ValueError, match=r"--kernels gna,sparse-fp8"):
        model().predict_sparse(np.ones(len(SPARSE_FEATURES)), "fp8")
    with pytest.raises(ValueError, match=r"precision must be None \(the inputs' dtype\) or 'fp8', got precision='int8'"):
        FP8_MODEL.predict(np.ones(len(FEATURES)), "int8")


def test_files_written_before_the_head_dim_feature_load_it_at_zero():
    older = {name: value for name, value in GNA.items() if name != "narrow_head_flops"}
    loaded = CostModel(GPU, older, fp8_coefficients=older)
    assert loaded.coefficients["narrow_head_flops"] == 0.0 == loaded.fp8_coefficients["narrow_head_flops"]
    with pytest.raises(ValueError, match="coefficients must name exactly the features"):
        CostModel(GPU, {**GNA, "unknown": 1.0})
    with pytest.raises(ValueError, match="fp8_coefficients must name exactly the features"):
        CostModel(GPU, GNA, fp8_coefficients={"full_flops": 1.0})


# -- features ---------------------------------------------------------------------------------------------------


def test_narrow_head_flops_count_every_visited_tile_under_head_dim_128():
    result = simulate(Problem((8, 16, 16), (4, 8, 8), (1, 4, 4)), TileConfig((2, 4, 8), (2, 4, 8)))
    name = FEATURES.index("narrow_head_flops")
    flops = 4.0 * 64 * 64 * 64 * result.visited_tiles * 3
    assert features_of(result, batch_heads=3, head_dim=64, element_bytes=2)[name] == flops
    assert features_of(result, batch_heads=3, head_dim=128, element_bytes=2)[name] == 0.0


@pytest.mark.parametrize("permutation", [False, True])
def test_fp8_moves_one_read_per_element_one_byte_per_row_read_and_the_output_back(permutation):
    """FP8 makes no permuted copies: q, k, v are read once in bf16 (in tile order as they are quantized), written
    as one byte per element of the rows the kernel reads (padding included), and where the call permutes, the
    output goes back (read and written); every other feature is bf16's."""
    shape, q_tile, kv_tile = (6, 10, 12), (2, 4, 8), (2, 4, 4)
    result = simulate(Problem(shape, (3, 5, 7)), TileConfig(q_tile, kv_tile))
    call = dict(batch_heads=2, head_dim=32, element_bytes=2, permutation=permutation)
    fp8, plain = features_of(result, quantized=True, **call), features_of(result, **call)
    ones, moved = (1, 1, 1), FEATURES.index("permute_bytes")
    rows = padded_tokens(shape, q_tile, ones) + 2 * padded_tokens(shape, kv_tile, ones) if permutation else 3 * 720
    back = 2 * 720 * 2 if permutation else 0
    assert fp8[moved] == (3 * 720 * 2 + rows + back) * 2 * 32
    np.testing.assert_array_equal(np.delete(fp8, moved), np.delete(plain, moved))


# -- best ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, target", [((8, 12, 16), 0.7), ((24, 32), 0.8), ((2048,), 0.9)])
def test_an_fp8_plan_is_scored_by_fp8_coefficients_and_runs_what_fp8_runs(shape, target):
    plan = best(shape, target, heads=4, head_dim=64, cost_model=FP8_MODEL, precision="fp8")
    assert plan.precision == "fp8" and plan.calibrated and plan.kernel_arguments()["precision"] == "fp8"
    assert plan.tiles.kv_tiling == "static" and plan.tiles.kv_tokens >= 32
    assert all(c.kv_tiling == "static" and c.kv_tokens >= 32 for c in (TileConfig(c.q_tile, c.kv_tile)
                                                                          for c in plan.search.top))
    # The score from features recomputed here: FP8 permutes 2-D and 3-D layouts and always quantizes.
    row = features_of(simulate(plan.problem, plan.tiles), batch_heads=4, head_dim=64, element_bytes=2,
                      permutation=len(shape) > 1, quantized=True)
    assert plan.score == pytest.approx(row @ vector(FP8_GNA, FEATURES), rel=1e-12)
    n = int(np.prod(shape))
    dense_tiles = simulate(Problem((n,), (n,)), TileConfig((128,), (128,)))  # dense runs as 1-D, in place
    padded = -(-n // 128) * 128
    dense = feature_matrix(full_tiles=np.array([dense_tiles.full_tiles]),
                           visited_tiles=np.array([dense_tiles.visited_tiles]), q_tokens=np.array([128]),
                           kv_tokens=np.array([128]), q_padded=np.array([padded]), kv_padded=np.array([padded]),
                           tokens=n, batch_heads=4, head_dim=64, element_bytes=2, permutation=False, quantized=True)
    assert plan.dense_score == pytest.approx(float(dense[0] @ vector(FP8_GNA, FEATURES)), rel=1e-12)
    again = Plan.from_json(plan.to_json())
    assert again.precision == "fp8" and again.kernel_arguments() == plan.kernel_arguments()


def test_without_fp8_coefficients_an_fp8_plan_ranks_by_tile_work_and_says_how_to_fit_them():
    plan = best((8, 12, 16), 0.7, heads=4, cost_model=model(), precision="fp8")
    assert not plan.calibrated and plan.precision == "fp8" and plan.predicted_time_s is None
    text = " ".join(str(part) for part in plan.explain().renderables)
    assert "No FP8 coefficients" in text and "natsim calibrate --kernels gna,gna-fp8" in text


def test_fp8_and_bf16_plans_of_one_layout_are_kept_apart():
    fp8 = best((8, 12, 16), 0.7, heads=4, cost_model=FP8_MODEL, precision="fp8")
    plain = best((8, 12, 16), 0.7, heads=4, cost_model=FP8_MODEL)
    assert plain.precision is None and "precision" not in plain.kernel_arguments()
    assert fp8.score != plain.score


@pytest.mark.parametrize("options, match", [
    (dict(training=True), r"precision='fp8' is for inference"),
    (dict(kv_tiling="dynamic"), r"precision='fp8' runs static KV tiling only"),
    (dict(world_size=2), r"precision='fp8' plans one GPU"),
    (dict(precision="fp16"), r"precision must be None \(the inputs' dtype\), 'fp8' or 'auto'"),
])
def test_what_fp8_plans_cannot_be_is_refused_up_front(options, match):
    options = {"precision": "fp8", **options}
    with pytest.raises(ValueError, match=match):
        best((8, 12, 16), 0.7, heads=4, **options)


# -- running: AutoPlan and plans ---------------------------------------------------------------------------------


def qkv(shape, heads=2, head_dim=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, *shape, heads, head_dim, generator=generator).half() for _ in range(3)]


def test_an_fp8_auto_plan_runs_the_fp8_kernel_eager_and_compiled():
    torch._dynamo.reset()
    auto = AutoPlan(0.5, precision="fp8")
    q, k, v = qkv((4, 4, 8))
    out = auto(q, k, v)
    plan = auto.plans[((4, 4, 8), 2, 32, torch.float16, "cpu")]
    assert plan.precision == "fp8"
    expected = gna_attention(q, k, v, **plan.kernel_arguments())
    plain = gna_attention(q, k, v, **{**plan.kernel_arguments(), "precision": None})
    assert torch.equal(out, expected) and not torch.equal(out, plain)  # FP8 ran, not the bf16 path
    compiled = torch.compile(lambda q, k, v: auto(q, k, v), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), expected)


def test_an_fp8_auto_plan_refuses_training_and_gradients():
    with pytest.raises(ValueError, match=r"precision='fp8' is for inference"):
        AutoPlan(0.5, precision="fp8", training=True)
    q, k, v = (t.requires_grad_() for t in qkv((4, 4, 8)))
    with pytest.raises(RuntimeError, match=r"AutoPlan with precision='fp8' is for inference"):
        AutoPlan(0.5, precision="fp8")(q, k, v)


# -- best_mask ---------------------------------------------------------------------------------------------------


def test_an_fp8_mask_plan_is_scored_by_fp8_sparse_coefficients_and_runs_in_fp8():
    generator = torch.Generator().manual_seed(1)
    seq_len, block = 256, 16
    mask = torch.rand(1, 2, seq_len // block, seq_len // block, generator=generator) < 0.3
    plan = best_mask(mask, block, block, seq_len, head_dim=32, cost_model=FP8_MODEL, precision="fp8")
    assert plan.precision == "fp8" and plan.calibrated
    merge = None if plan.merge == "none" else plan.merge
    block_m, block_n = default_blocks(plan.q_block, plan.kv_block, merge, torch.device("cuda"))
    work = prepare_sparse(plan.mask, plan.q_block, plan.kv_block, seq_len, merge=merge, block_m=block_m,
                          block_n=block_n, device="cpu", backward=False)
    row = sparse_features(work, 1, 2, 32)
    assert plan.score == pytest.approx(float(row @ vector(FP8_SPARSE, SPARSE_FEATURES)), rel=1e-12)
    again = MaskPlan.from_json(plan.to_json())
    assert again.precision == "fp8"
    q, k, v = (torch.randn(1, seq_len, 2, 32, generator=generator).half() for _ in range(3))
    expected = sparse_attention(q, k, v, plan.mask, plan.q_block, plan.kv_block, merge=merge, precision="fp8")
    assert torch.equal(plan(q, k, v), expected)


# -- calibration and the command line ------------------------------------------------------------------------------


_SPARSE_CASE_FEATURES = calibration.sparse_case_features  # the real one, kept from the test's monkeypatch


@functools.lru_cache(maxsize=None)
def _sparse_row(case) -> np.ndarray:
    return _SPARSE_CASE_FEATURES([case])[0]


def sparse_rows(cases) -> np.ndarray:
    """`sparse_case_features`, each case's row prepared once per process (32K-token masks take a while on a CPU)."""
    return np.stack([_sparse_row(case) for case in cases])



@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU with FP8 tensor cores whose every call takes what the known coefficients say, and a stored model of
    it without FP8 coefficients to extend; yields the (kernel, precision) of each timed call."""
    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "gpu_of", lambda device: GPU)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model().save(calibration.default_path(GPU))
    seen = []

    def time_case(case, dtype, device, precision=None):
        seen.append(("gna", precision))
        features = calibration.case_features([case], dtype, True, precision)[0]
        return float(features @ vector(FP8_GNA if precision else GNA, FEATURES))

    def time_sparse_case(case, dtype, device, precision=None):
        seen.append(("sparse", precision))
        return float(_sparse_row(case) @ vector(FP8_SPARSE if precision else SPARSE, SPARSE_FEATURES))

    monkeypatch.setattr(calibration, "time_case", time_case)
    monkeypatch.setattr(calibration, "time_sparse_case", time_sparse_case)
    monkeypatch.setattr(calibration, "sparse_case_features", sparse_rows)
    return seen


def test_calibrating_the_fp8_kernels_extends_the_stored_model_with_their_coefficients(fake_gpu):
    seen = fake_gpu
    result = calibration.calibrate(kernels=("gna-fp8", "sparse-fp8"))
    assert set(seen) == {("gna", "fp8"), ("sparse", "fp8")}
    assert len(result.fp8.cases) == len(calibration.fp8_calibration_cases())
    assert all(case.tiles.kv_tiling == "static" for case in result.fp8.cases)
    for name in FEATURES:
        assert result.model.fp8_coefficients[name] == pytest.approx(FP8_GNA[name], rel=1e-5), name
    for name in SPARSE_FEATURES:
        assert result.model.fp8_sparse_coefficients[name] == pytest.approx(FP8_SPARSE[name], rel=1e-5), name
    assert result.model.coefficients == model().coefficients  # extended, not refitted
    assert result.model.info["gna_fp8_cases"] == len(result.fp8.cases)


def test_the_fp8_cases_separate_every_feature():
    """Every feature FP8 can have: it pads every head dim, so it never pays `split_head_flops`."""
    gna = calibration.case_features(calibration.fp8_calibration_cases(), torch.bfloat16, True, "fp8")
    split = FEATURES.index("split_head_flops")
    assert not gna[:, split].any()
    gna = np.delete(gna, split, axis=1)
    sparse = sparse_rows(calibration.fp8_sparse_calibration_cases())
    for matrix, count in ((gna, len(FEATURES) - 1), (sparse, len(SPARSE_FEATURES))):
        assert np.linalg.matrix_rank(matrix / np.linalg.norm(matrix, axis=0)) == count


def test_natsim_calibrate_prints_the_fp8_tables(fake_gpu):
    result = CliRunner().invoke(app, ["calibrate", "--kernels", "gna-fp8,sparse-fp8"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "FP8 GNA calibration on Test GPU" in text and "FP8 sparse kernel calibration on Test GPU" in text
    assert f"FP8 GNA on {len(calibration.fp8_calibration_cases())} cases" in text and "gna-fp8" in text


def test_fp8_calibration_needs_a_gpu_with_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Older GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"asks for FP8, which needs a GPU of compute capability 8.9 or newer"):
        calibration.calibrate(kernels=("gna", "gna-fp8"))


def test_natsim_plan_and_mask_take_precision(tmp_path):
    path = FP8_MODEL.save(tmp_path / "test-gpu.json")
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--shape", "8x12x16", "--sparsity", "0.7", "--heads", "4", "--coefficients",
                                 str(path), "--precision", "fp8", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    expected = best((8, 12, 16), 0.7, heads=4, cost_model=FP8_MODEL, precision="fp8")
    assert record["precision"] == "fp8" and record["score"] == pytest.approx(expected.score)
    mask_file = tmp_path / "mask.pt"
    torch.save(torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(0)) < 0.3, mask_file)
    result = runner.invoke(app, ["mask", str(mask_file), "--coefficients", str(path), "--precision", "fp8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["precision"] == "fp8"
    refused = runner.invoke(app, ["plan", "--shape", "8x12x16", "--sparsity", "0.7", "--precision", "int8"])
    assert refused.exit_code == 2 and "--precision takes fp8" in refused.stderr
