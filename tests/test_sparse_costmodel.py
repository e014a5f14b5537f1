"""The sparse kernel's cost model on CPU: its features against hand counts, the calibration cases, the fit
recovering known coefficients from synthetic timings, the cost-model file with and without its sparse section,
and `natsim calibrate --kernels`."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from natsim.cli import calibrate as calibrate_cli
from natsim.kernels import prepare_sparse
from natsim.planner import FEATURES, SPARSE_FEATURES, CostModel, fit_coefficients, predict_sparse_time, sparse_features
from natsim.planner.cost import calibrate as calibration
from natsim.planner.cost.calibrate import (
    GNA_SEQ_LEN,
    HOST_BOUND_S,
    sparse_calibration_cases,
    sparse_case_features,
    sparse_case_mask,
)

GNA = {
    "full_flops": 1 / 550e12, "masked_flops": 1 / 300e12, "narrow_q_flops": 1 / 4000e12,
    "narrow_kv_flops": 1 / 3000e12, "narrow_head_flops": 1 / 2000e12, "split_head_flops": 1 / 8000e12,
    "kv_tile_visits": 1e-9, "programs": 1e-8, "permute_bytes": 1 / 2.5e12,
    "launch": 2e-5,
}
# "True" sparse coefficients of H100-like magnitude that the fit must recover.
SPARSE = {
    "full_flops": 1 / 480e12, "masked_flops": 1 / 900e12, "gathered_flops": 1 / 1500e12,
    "narrow_flops": 1 / 200e12, "narrow_head_flops": 1 / 2500e12, "tiles": 1.5e-8, "programs": 2e-7, "launch": 3e-5,
}
FEATURE = {name: i for i, name in enumerate(SPARSE_FEATURES)}


def row(**counts: float) -> np.ndarray:
    """A feature row from the named counts, 0 elsewhere, `launch` 1."""
    values = np.zeros(len(SPARSE_FEATURES))
    for name, value in {"launch": 1.0, **counts}.items():
        values[FEATURE[name]] = value
    return values


def work_of(mask: torch.Tensor, block: tuple[int, int], seq_len: int, merge=None, tile=(128, 128)):
    return prepare_sparse(mask, *block, seq_len, merge=merge, block_m=tile[0], block_n=tile[1], device="cpu")


# -- features against hand counts -----------------------------------------------------------------------------


def test_an_all_true_mask_runs_only_unmasked_descriptor_tiles():
    work = work_of(torch.ones((1, 1, 4, 4), dtype=torch.bool), (128, 128), 512)
    flops = 4.0 * 128 * 128 * 64
    # 4 programs per (batch, head), each 4 whole tiles; batch 2 x heads 3 repeat the broadcast mask's work.
    expected = row(full_flops=4 * 4 * 6 * flops, narrow_head_flops=4 * 4 * 6 * flops, tiles=4 * 4 * 6, programs=4 * 6)
    np.testing.assert_array_equal(sparse_features(work, 2, 3, 64), expected)


def test_the_last_partial_block_runs_masked():
    work = work_of(torch.ones((1, 1, 4, 4), dtype=torch.bool), (128, 128), 500)
    flops = 4.0 * 128 * 128 * 128
    np.testing.assert_array_equal(
        sparse_features(work, 1, 1, 128), row(full_flops=4 * 3 * flops, masked_flops=4 * flops, tiles=16, programs=4)
    )


def test_a_diagonal_mask_unmerged_runs_one_narrow_gathered_tile_per_block():
    mask = torch.eye(16, dtype=torch.bool)[None, None]
    work = work_of(mask, (16, 16), 256, tile=(16, 128))
    flops = 4.0 * 16 * 128 * 128
    # Each 16-query program lists its one block: a whole 8-block tile it cannot fill, so the masked loop.
    expected = row(masked_flops=16 * flops, gathered_flops=16 * flops, narrow_flops=16 * flops, tiles=16, programs=16)
    np.testing.assert_array_equal(sparse_features(work, 1, 1, 128), expected)


@pytest.mark.parametrize("merge", ["consecutive", "xor"])
def test_a_diagonal_mask_merged_runs_one_wide_masked_tile_per_group(merge):
    mask = torch.eye(16, dtype=torch.bool)[None, None]
    work = work_of(mask, (16, 16), 256, merge=merge)
    flops = 4.0 * 128 * 128 * 128
    # Two programs of 8 query blocks; each lists its members' 8 blocks, none attended by all: one masked tile.
    expected = row(masked_flops=2 * flops, gathered_flops=2 * flops, tiles=2, programs=2)
    np.testing.assert_array_equal(sparse_features(work, 1, 1, 128), expected)


def test_merging_a_block_diagonal_mask_makes_its_tiles_full():
    """Query blocks of one 128-token band attend the same 8 key blocks: merged, every program's tile is full."""
    mask = torch.block_diag(*[torch.ones(8, 8, dtype=torch.bool)] * 2)[None, None]
    merged = sparse_features(work_of(mask, (16, 16), 256, merge="consecutive"), 1, 1, 128)
    unmerged = sparse_features(work_of(mask, (16, 16), 256, tile=(16, 128)), 1, 1, 128)
    wide, narrow = 4.0 * 128 * 128 * 128, 4.0 * 16 * 128 * 128
    np.testing.assert_array_equal(merged, row(full_flops=2 * wide, gathered_flops=2 * wide, tiles=2, programs=2))
    np.testing.assert_array_equal(
        unmerged, row(full_flops=16 * narrow, gathered_flops=16 * narrow, narrow_flops=16 * narrow, tiles=16, programs=16)
    )


def test_a_broadcast_mask_counts_like_the_same_mask_per_head():
    mask = torch.rand((1, 1, 8, 8), generator=torch.Generator().manual_seed(0)) < 0.5
    broadcast = sparse_features(work_of(mask, (32, 32), 256, merge="consecutive"), 2, 3, 64)
    per_head = sparse_features(work_of(mask.expand(2, 3, 8, 8).contiguous(), (32, 32), 256, merge="consecutive"), 2, 3, 64)
    np.testing.assert_array_equal(broadcast, per_head)


@pytest.mark.parametrize(
    "batch, heads, head_dim, message",
    [(1, 2, 64, "must be 1 or the call's"), (0, 3, 64, "batch must be a positive int"), (1, 3, 0, "head_dim must")],
)
def test_sparse_features_reject_calls_the_work_does_not_fit(batch, heads, head_dim, message):
    work = work_of(torch.ones((1, 3, 2, 2), dtype=torch.bool), (128, 128), 256)
    with pytest.raises(ValueError, match=message):
        sparse_features(work, batch, heads, head_dim)


# -- the calibration cases -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sparse_row(case) -> np.ndarray:
    return sparse_case_features([case])[0]


def sparse_rows(cases) -> np.ndarray:
    """`sparse_case_features`, each case's row prepared once per process: every calibration below prepares every
    case again for its fit (a few seconds each on a CPU), and the fake GPU times each case from its row."""
    return np.stack([_sparse_row(case) for case in cases])


@pytest.fixture(scope="module")
def case_matrix() -> np.ndarray:
    return sparse_rows(sparse_calibration_cases())


def test_sparse_cases_are_deterministic_and_have_their_masks_shape():
    for case in sparse_calibration_cases():
        mask = sparse_case_mask(case)
        assert torch.equal(mask, sparse_case_mask(case)), case
        assert mask.shape[2:] == (-(-case.seq_len // case.q_block), -(-case.seq_len // case.kv_block)), case
    assert any(case.seq_len == GNA_SEQ_LEN for case in sparse_calibration_cases())


def test_sparse_cases_separate_every_feature(case_matrix):
    cases = sparse_calibration_cases()
    assert 12 <= len(cases) <= 20 and {case.head_dim for case in cases} == {64, 128}
    assert {case.merge for case in cases} == {None, "consecutive", "xor"}
    assert np.linalg.matrix_rank(case_matrix / np.linalg.norm(case_matrix, axis=0)) == len(SPARSE_FEATURES)
    # GPU-bound: at 480 TFLOP/s every case would take longer than HOST_BOUND_S.
    assert (case_matrix[:, : FEATURE["gathered_flops"]].sum(1) / 480e12 > HOST_BOUND_S).all()


def test_sparse_fit_recovers_known_coefficients(case_matrix):
    truth = np.array([SPARSE[name] for name in SPARSE_FEATURES])
    fitted = fit_coefficients(case_matrix, case_matrix @ truth, SPARSE_FEATURES)
    for name in SPARSE_FEATURES:
        assert fitted[name] == pytest.approx(SPARSE[name], rel=1e-5), name


def test_fit_coefficients_names_the_sparse_features_in_its_errors():
    with pytest.raises(ValueError, match="gathered_flops"):
        fit_coefficients(np.ones((10, len(FEATURES))), np.ones(10), SPARSE_FEATURES)


def known_sparse_time(case) -> float:
    """The time of a sparse case under the known coefficients, from its features."""
    return float(_sparse_row(case) @ np.array([SPARSE[name] for name in SPARSE_FEATURES]))


def fake_timings(monkeypatch, sparse_time=None):
    """Replace the GPU: times from known coefficients (GNA from the simulator, sparse from the case features),
    and the sparse features from `sparse_rows`."""
    gna = np.array([GNA[name] for name in FEATURES])
    timed = []

    def time_sparse(case, dtype, device):
        timed.append(case)
        return known_sparse_time(case)

    monkeypatch.setattr(calibration, "gpu_of", lambda device: "Fake GPU")
    monkeypatch.setattr(calibration, "time_case", lambda case, dtype, device: float(calibration.case_features([case], dtype)[0] @ gna))
    monkeypatch.setattr(calibration, "time_sparse_case", sparse_time or time_sparse)
    monkeypatch.setattr(calibration, "sparse_case_features", sparse_rows)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return timed


def test_calibrate_times_the_sparse_cases_and_fits_them(monkeypatch):
    timed = fake_timings(monkeypatch)
    progress = []
    result = calibration.calibrate(progress=lambda done, total: progress.append((done, total)))
    total = len(calibration.calibration_cases()) + len(sparse_calibration_cases())
    assert timed == sparse_calibration_cases() and progress[-1] == (total, total) and len(progress) == total
    for name in SPARSE_FEATURES:
        assert result.model.sparse_coefficients[name] == pytest.approx(SPARSE[name], rel=1e-5), name
    for name in FEATURES:
        assert result.model.coefficients[name] == pytest.approx(GNA[name], rel=1e-6), name
    info = result.model.info
    assert info["sparse_cases"] == len(timed) and info["sparse_host_bound_cases_left_out"] == 0
    assert info["sparse_max_abs_relative_error"] < 1e-6 and info["sparse_median_abs_relative_error"] < 1e-6
    assert result.sparse_fitted.all() and np.abs(result.sparse_errors).max() < 1e-6
    np.testing.assert_allclose(result.model.predict_sparse(result.sparse_features), result.sparse_times, rtol=1e-6)


def test_calibrate_gna_only_times_no_sparse_case(monkeypatch):
    def refuse(case, dtype, device):
        raise AssertionError("a GNA-only calibration timed a sparse case")

    fake_timings(monkeypatch, refuse)
    result = calibration.calibrate(kernels=("gna",))
    assert result.model.sparse_coefficients is None and result.sparse_cases == ()
    assert "sparse_cases" not in result.model.info and "sparse_coefficients" not in result.model.to_dict()


def test_calibrate_leaves_host_bound_sparse_cases_out_of_the_fit(monkeypatch, case_matrix):
    cases = sparse_calibration_cases()
    exact = case_matrix @ np.array([SPARSE[name] for name in SPARSE_FEATURES])
    host_bound = {0, 7}
    times = dict(zip(cases, [0.4 * HOST_BOUND_S if i in host_bound else t for i, t in enumerate(exact)]))
    fake_timings(monkeypatch, lambda case, dtype, device: times[case])
    result = calibration.calibrate()
    assert [i for i, f in enumerate(result.sparse_fitted) if not f] == sorted(host_bound)
    assert result.model.info["sparse_host_bound_cases_left_out"] == len(host_bound)
    for name in SPARSE_FEATURES:
        assert result.model.sparse_coefficients[name] == pytest.approx(SPARSE[name], rel=1e-5), name


def test_calibrate_refuses_when_the_sparse_cases_are_host_bound(monkeypatch):
    fake_timings(monkeypatch, lambda case, dtype, device: 0.5 * HOST_BOUND_S)
    with pytest.raises(ValueError, match="sparse calibration cases kept this GPU busy"):
        calibration.calibrate()


@pytest.mark.parametrize("kernels", [("gna", "tiles"), ()])
def test_calibrate_refuses_unknown_or_no_kernels(kernels):
    with pytest.raises(ValueError, match="kernels must name one or more of"):
        calibration.calibrate(kernels=kernels)


def test_calibrate_without_gna_needs_a_stored_model_to_extend(monkeypatch, tmp_path):
    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    fake_timings(monkeypatch)
    with pytest.raises(ValueError, match="leaves out 'gna', which extends the stored cost model of Fake GPU"):
        calibration.calibrate(kernels=("sparse",))


# -- the cost-model file ---------------------------------------------------------------------------------------


def test_a_cost_model_round_trips_with_and_without_sparse_coefficients(tmp_path):
    for sparse in (SPARSE, None):
        model = CostModel("Test GPU", GNA, {"cases": 3}, sparse_coefficients=sparse)
        loaded = CostModel.load(model.save(tmp_path / "model.json"))
        assert loaded == model and loaded.sparse_coefficients == sparse
        assert ("sparse_coefficients" in json.loads((tmp_path / "model.json").read_text())) == (sparse is not None)


def test_a_file_without_a_sparse_section_loads_and_says_it_cannot_predict_sparse_calls(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "natsim-cost-model/1", "gpu": "Old GPU", "coefficients": GNA, "info": {}}))
    model = CostModel.load(path)
    assert model.sparse_coefficients is None and model.coefficients == GNA
    work = work_of(torch.ones((1, 1, 2, 2), dtype=torch.bool), (128, 128), 256)
    with pytest.raises(ValueError, match="Old GPU has no sparse-kernel coefficients"):
        predict_sparse_time(work, 1, 1, 64, model)


def test_the_shipped_h100_file_still_loads():
    from natsim.planner.cost import COEFFICIENTS_DIR

    assert CostModel.load(COEFFICIENTS_DIR / "nvidia-h100-80gb-hbm3.json").gpu == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    "sparse, message",
    [
        ({**SPARSE, "permute_bytes": 1.0}, "sparse_coefficients must name exactly the features"),
        ({k: v for k, v in SPARSE.items() if k != "tiles"}, "sparse_coefficients must name exactly the features"),
        ({**SPARSE, "tiles": -1.0}, "sparse_coefficients must be finite and non-negative"),
    ],
)
def test_a_cost_model_rejects_bad_sparse_coefficients(sparse, message):
    with pytest.raises(ValueError, match=message):
        CostModel("Test GPU", GNA, sparse_coefficients=sparse)


def test_predict_sparse_time_is_the_dot_product_of_features_and_coefficients():
    model = CostModel("Test GPU", GNA, sparse_coefficients=SPARSE)
    mask = torch.rand((1, 2, 16, 16), generator=torch.Generator().manual_seed(1)) < 0.3
    work = work_of(mask, (16, 16), 256, merge="xor")
    features = sparse_features(work, 1, 2, 128)
    expected = sum(features[i] * SPARSE[name] for i, name in enumerate(SPARSE_FEATURES))
    assert predict_sparse_time(work, 1, 2, 128, model) == pytest.approx(expected, rel=1e-12)
    unmerged = work_of(mask, (16, 16), 256, tile=(16, 128))
    assert predict_sparse_time(unmerged, 1, 2, 128, model) != pytest.approx(expected)


# -- natsim calibrate --kernels ----------------------------------------------------------------------------------

app = typer.Typer()


@app.callback()
def _natsim() -> None:
    """natsim (test app)."""


calibrate_cli.register(app)
runner = CliRunner()


@pytest.mark.parametrize("kernels", ["gna,flash", ""])
def test_calibrate_kernels_errors_are_one_red_line(kernels):
    result = runner.invoke(app, ["calibrate", "--kernels", kernels])
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kernels takes one or more of gna, sparse, backward" in lines[0], result.stderr


def test_calibrate_json_prints_the_sparse_measurements(monkeypatch, tmp_path):
    fake_timings(monkeypatch)
    path = tmp_path / "fake.json"
    result = runner.invoke(app, ["calibrate", "--output", str(path), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    measured = record["sparse_measurements"]
    assert len(measured) == len(sparse_calibration_cases())
    assert {"pattern", "q_block", "kv_block", "merge", "block_m", "block_n", "measured_s", "predicted_s"} <= set(measured[0])
    assert record["model"]["sparse_coefficients"].keys() == set(SPARSE_FEATURES)
    assert CostModel.load(path).sparse_coefficients["tiles"] == pytest.approx(SPARSE["tiles"], rel=1e-5)
    text = runner.invoke(app, ["calibrate", "--output", str(path), "--kernels", "gna"])
    assert text.exit_code == 0, text.output
    assert CostModel.load(path).sparse_coefficients is None and "sparse kernel" not in text.stdout
    table = runner.invoke(app, ["calibrate", "--output", str(path)])
    assert f"sparse kernel on {len(measured)} cases" in " ".join(table.stdout.split())
