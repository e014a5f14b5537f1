"""The `natsim` command through typer's runner: tables, JSON schema, exit codes on bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from natsim import Problem, TileConfig, simulate
from natsim.cli.main import app

RECORD_KEYS = {
    "shape", "window", "stride", "dilation", "causal", "q_tile", "kv_tile", "tiling", "kv_tiling",
    "sparsity", "flop_speedup", "visited_tiles", "full_tiles", "max_kv_tiles", "dense_tiles",
    "tile_speedup", "tile_speedup_mean", "block_sparse",
}

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_sim_json_has_every_figure_and_matches_the_simulator():
    result = invoke("sim", "--shape", "30x48x80", "--window", "18x24x24", "--stride", "16x8x8", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert set(record) == RECORD_KEYS
    expected = simulate(Problem((30, 48, 80), (18, 24, 24), (16, 8, 8)), TileConfig((4, 8, 8), (2, 8, 8)))
    assert record == json.loads(json.dumps(expected.to_dict()))
    assert record["stride"] == [16, 8, 8] and record["causal"] == [False, False, False]
    assert record["block_sparse"] is True and round(record["tile_speedup"], 1) == 11.1


def test_sim_table_shows_the_figures():
    result = invoke("sim", "--shape", "30x48x80", "--window", "18x24x24", "--stride", "2x8x8")
    assert result.exit_code == 0, result.output
    for name in ("sparsity", "flop_speedup", "tile_speedup", "visited_tiles", "block_sparse"):
        assert name in result.stdout
    assert "10.000x" in result.stdout


def test_sweep_json_is_the_pruned_view_best_first():
    result = invoke(
        "sweep", "--shape", "30x48x80", "--window", "18x24x24", "--q-tile", "4x8x8", "--kv-tile", "2x8x8", "--json"
    )
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert isinstance(records, list) and records
    assert all(set(r) == RECORD_KEYS for r in records)
    assert records[0]["stride"] == [16, 8, 8] and records[0]["block_sparse"]
    speedups = [r["tile_speedup"] for r in records]
    assert speedups == sorted(speedups, reverse=True)
    table = {tuple(r["stride"]): round(r["tile_speedup"], 1) for r in records}
    assert table[(1, 1, 1)] == 3.3 and table[(1, 8, 8)] == 9.1 and table[(2, 8, 8)] == 10.0


def test_sweep_all_and_given_strides():
    args = ["sweep", "--shape", "16x16", "--window", "8x8", "--q-tile", "4x4", "--kv-tile", "4x4", "--json"]
    everything = json.loads(invoke(*args, "--all").stdout)
    assert len(everything) == 64
    chosen = json.loads(invoke(*args, "--all", "--stride", "1x1", "--stride", "4x8").stdout)
    assert sorted(tuple(r["stride"]) for r in chosen) == [(1, 1), (4, 8)]


def test_sweep_table_marks_block_sparse_rows():
    result = invoke("sweep", "--shape", "30x48x80", "--window", "18x24x24", "--q-tile", "4x8x8", "--kv-tile", "2x8x8")
    assert result.exit_code == 0, result.output
    first_row = next(line for line in result.stdout.splitlines() if "16x8x8" in line)
    assert "yes" in first_row
    assert "10,368 configurations" in result.stdout


def test_one_d_tiling_and_dynamic_kv_options():
    one_d = invoke("sim", "--shape", "8x8", "--window", "3x3", "--tiling", "1d", "--q-tile", "16", "--kv-tile", "8", "--json")
    assert one_d.exit_code == 0, one_d.output
    assert json.loads(one_d.stdout)["tiling"] == "1d"
    dynamic = invoke("sim", "--shape", "8x8", "--window", "3x3", "--kv-tiling", "dynamic", "--q-tile", "4", "--json")
    assert dynamic.exit_code == 0, dynamic.output
    record = json.loads(dynamic.stdout)
    assert record["kv_tiling"] == "dynamic" and record["q_tile"] == record["kv_tile"] == [4, 4]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "speedups.png"
    result = invoke("sweep", "--shape", "16x16", "--window", "8x8", "--q-tile", "4x4", "--plot", str(path))
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def one_red_line(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert message in " ".join(result.stderr.split())


@pytest.mark.parametrize("shape", ["7", "3x5", "1x1x7"])
def test_a_layout_smaller_than_the_default_tiles_asks_for_tiles(shape):
    """Without --q-tile, a layout too small for every tile of the default catalog is one red line that says so and
    names the options; with tiles it sweeps."""
    one_red_line(invoke("sweep", "--shape", shape, "--window", "1"), "is too small for the default tile catalog")
    assert "--q-tile" in invoke("sweep", "--shape", shape, "--window", "1").stderr
    tile = "x".join("1" for _ in shape.split("x"))
    assert invoke("sweep", "--shape", shape, "--window", "1", "--q-tile", tile, "--kv-tile", tile).exit_code == 0


def test_plot_into_a_missing_folder_fails_before_sweeping(tmp_path):
    pytest.importorskip("matplotlib")
    args = ["sweep", "--shape", "16x16", "--window", "8x8", "--q-tile", "4x4", "--plot"]
    missing = tmp_path / "some" / "missing" / "dir" / "out.png"
    one_red_line(invoke(*args, str(missing)), f"--plot must name a file in an existing folder, got --plot {missing}: there is no folder {missing.parent}.")
    one_red_line(invoke(*args, str(tmp_path)), f"--plot takes the name of a PNG file, got --plot {tmp_path}, which is a folder.")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write into any folder")
def test_plot_into_a_read_only_folder_fails_before_sweeping(tmp_path):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    result = invoke("sweep", "--shape", "16x16", "--window", "8x8", "--q-tile", "4x4", "--plot", str(folder / "out.png"))
    one_red_line(result, "permission denied")


def test_plot_without_matplotlib_fails_before_sweeping(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = invoke("sweep", "--shape", "16x16", "--window", "8x8", "--q-tile", "4x4", "--plot", str(tmp_path / "out.png"))
    one_red_line(result, "--plot needs matplotlib; install it with pip install 'natsim[plot]'.")


def test_plot_that_cannot_be_saved_is_one_red_line(monkeypatch, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")

    def refuse(self, path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(plt.Figure, "savefig", refuse)
    path = tmp_path / "out.png"
    result = invoke("sweep", "--shape", "16x16", "--window", "8x8", "--q-tile", "4x4", "--plot", str(path), "--json")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"--plot {path} could not be written: Permission denied." in " ".join(result.stderr.split())


H100 = "NVIDIA H100 80GB HBM3"
SMALL = ["sweep", "--shape", "16x32", "--window", "8x12"]


def catalog_pairs(shape, head_dim=128):
    from natsim.planner import tile_catalog

    return {(t.q_tile, t.kv_tile) for t in tile_catalog(shape, head_dim)}


def test_sweep_kernel_tiles_tries_only_the_planners_catalog():
    records = json.loads(invoke(*SMALL, "--kernel-tiles", "--head-dim", "64", "--all", "--json").stdout)
    assert {(tuple(r["q_tile"]), tuple(r["kv_tile"])) for r in records} == catalog_pairs((16, 32), 64)
    assert all(set(r) == RECORD_KEYS for r in records)  # no cost model: no predicted times
    speedups = [r["tile_speedup"] for r in records]
    assert speedups == sorted(speedups, reverse=True)
    default = json.loads(invoke(*SMALL, "--all", "--json").stdout)
    assert any(math.prod(r["q_tile"]) == 256 for r in default)  # the simulator's catalog has 256-token tiles


def test_sweep_with_a_cost_model_predicts_each_row_and_ranks_by_time():
    from natsim.planner import cost_model_for, features_of

    model = cost_model_for(H100)
    args = [*SMALL, "--kernel-tiles", "--device", "h100", "--heads", "24", "--json"]
    everything = json.loads(invoke(*args, "--all").stdout)
    pruned = json.loads(invoke(*args).stdout)
    for records in (everything, pruned):
        times = [r["predicted_ms"] for r in records]
        assert times == sorted(times)
    for r in everything[:: max(1, len(everything) // 40)]:
        result = simulate(Problem(r["shape"], r["window"], r["stride"]), TileConfig(r["q_tile"], r["kv_tile"]))
        expected = float(model.predict(features_of(result, batch_heads=24, head_dim=128, element_bytes=2,
                                                   permutation=False))) * 1e3
        assert r["predicted_ms"] == pytest.approx(expected, rel=1e-12)
    # The pruned view by time: a row stays only if it beats every row with a smaller stride product.
    kept = {(tuple(r["stride"]), tuple(r["q_tile"]), tuple(r["kv_tile"])) for r in pruned}
    for r in everything:
        smaller = [o["predicted_ms"] for o in everything if math.prod(o["stride"]) < math.prod(r["stride"])]
        stays = all(r["predicted_ms"] < t * (1 - 1e-12) for t in smaller)
        assert ((tuple(r["stride"]), tuple(r["q_tile"]), tuple(r["kv_tile"])) in kept) == stays
    table = invoke(*SMALL, "--kernel-tiles", "--device", "h100", "--heads", "24")
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())
    assert "predicted ms" in text and f"pruned view by predicted time, fastest first as predicted for {H100} (24 heads" in text
    first = next(line for line in table.stdout.splitlines() if line.startswith("│"))
    assert f"{pruned[0]['predicted_ms']:.4g}" in first


def test_sweep_with_a_coefficients_file_predicts_with_it(tmp_path):
    from natsim.planner import CostModel

    coefficients = {"full_flops": 1e-15, "masked_flops": 2e-15, "narrow_q_flops": 0.0, "narrow_kv_flops": 0.0, "kv_tile_visits": 1e-9, "programs": 1e-8, "permute_bytes": 0.0, "launch": 0.0}
    path = CostModel("Test GPU", coefficients).save(tmp_path / "test-gpu.json")
    records = json.loads(invoke(*SMALL, "--q-tile", "8x8", "--coefficients", str(path), "--all", "--json").stdout)
    r = records[0]
    result = simulate(Problem(r["shape"], r["window"], r["stride"]), TileConfig(r["q_tile"], r["kv_tile"]))
    flops = 4 * 64 * 64 * 128 * (result.full_tiles + 2 * (result.visited_tiles - result.full_tiles)) * 1e-15
    assert r["predicted_ms"] == pytest.approx((flops + 1e-9 * result.visited_tiles + 1e-8 * result.num_q_tiles) * 1e3)


def test_sweep_with_a_device_without_coefficients_is_the_plain_table_and_a_note():
    result = invoke(*SMALL, "--q-tile", "8x8", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout == invoke(*SMALL, "--q-tile", "8x8").stdout
    assert f"no cost-model coefficients for --device cpu (no CUDA GPU), so no predicted times; coefficients exist for {H100} (--device h100)" in " ".join(result.stderr.split())


def test_plain_sweep_and_sim_and_every_help_do_not_import_torch():
    """Nor does the help of the commands that list the GPUs with coefficients (natsim.gpus reads the files)."""
    code = (
        "import sys; from typer.testing import CliRunner; from natsim.cli.main import app; "
        "r = CliRunner().invoke(app, ['sweep', '--shape', '16x32', '--window', '8x12', '--json']); assert r.exit_code == 0, r.output; "
        "r = CliRunner().invoke(app, ['sim', '--shape', '16x32', '--window', '8x12']); assert r.exit_code == 0, r.output; "
        "helps = [CliRunner().invoke(app, [command, '--help']) for command in ('sweep', 'plan', 'mask')]; "
        "assert all(r.exit_code == 0 and 'NVIDIA H200 (--device h200)' in ' '.join(r.output.split()) for r in helps); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_negative_limit_is_refused_not_read_as_all(tmp_path):
    import numpy as np

    np.savez(tmp_path / "mask.npz", mask=np.ones((1, 1, 4, 4), bool))
    for command in (["sweep", "--shape", "8x8", "--window", "3"], ["mask", str(tmp_path / "mask.npz")]):
        result = invoke(*command, "--limit", "-5")
        assert result.exit_code == 2 and "--limit" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["sim", "--shape", "30x48x80", "--window", "18x24"], "--window needs one value per dimension"),
        (["sim", "--shape", "30xAx80", "--window", "3"], "--shape takes integers"),
        (["sim", "--shape", "8x8", "--window", "3", "--stride", "4"], "stride cannot be larger than window"),
        (["sim", "--shape", "8x8", "--window", "9"], "window * dilation cannot be larger"),
        (["sim", "--shape", "8x8", "--window", "3", "--causal", "2"], "--causal takes 0/1"),
        (["sim", "--shape", "8x8", "--window", "3", "--tiling", "diagonal"], "tiling must be one of"),
        (["sim", "--shape", "8x8", "--window", "3", "--tiling", "1d", "--kv-tiling", "dynamic"], "dynamic KV tiling needs multi-D"),
        (["sweep", "--shape", "8x8", "--window", "3", "--stride", "all", "--stride", "1"], "cannot be combined"),
        (["sim", "--shape", "0x8", "--window", "1"], "at least 1"),
        (["sim", "--shape", "10x10", "--window", "3", "--q-tile", "1" + "0" * 23], "--q-tile takes sizes up to 16,777,216"),
        (["sim", "--shape", "9223372036854775807", "--window", "1"], "--shape takes sizes up to 16,777,216 per dimension"),
        ([*SMALL, "--kernel-tiles", "--q-tile", "8x8"], "--kernel-tiles chooses the tiles itself, so it takes no --q-tile or --kv-tile, got --q-tile 8x8."),
        ([*SMALL, "--kernel-tiles", "--tiling", "1d"], "--kernel-tiles needs --tiling multi"),
        ([*SMALL, "--kernel-tiles", "--head-dim", "20"], "head_dim must be one the GNA kernel runs (16 to 256 in steps of 8), got head_dim=20."),
        ([*SMALL, "--tiling", "1d", "--device", "h100"], "predicted times (--device, --coefficients) need --tiling multi"),
        ([*SMALL, "--q-tile", "3x8", "--device", "h100"], "the GNA kernel needs tiles of a power-of-two number of tokens"),
        ([*SMALL, "--kernel-tiles", "--device", "h100-nvl"], "device='h100-nvl' names NVIDIA H100 NVL, which has no cost-model coefficients here"),
        ([*SMALL, "--kernel-tiles", "--device", "tpu-v5"], "device must name a torch device like 'cuda:0' or 'cpu', a known GPU"),
        ([*SMALL, "--kernel-tiles", "--device", "h100", "--heads", "0"], "heads must be a positive integer"),
        ([*SMALL, "--coefficients", "/nonexistent.json"], "--coefficients /nonexistent.json is not a readable cost model"),
    ],
)
def test_bad_input_is_one_red_line_and_exit_code_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert message in " ".join(result.stderr.split())
    assert result.stdout == ""


@pytest.mark.parametrize("error", [OverflowError("Python int too large to convert to C long"),
                                   MemoryError("Unable to allocate 64.0 GiB")])
def test_sizes_too_large_to_count_here_are_one_red_line_too(error, capsys):
    """Sizes each within bounds can still overflow numpy's integers or this machine's memory together."""
    import typer

    from natsim.cli.common import reports_bad_input

    def command():
        raise error

    with pytest.raises(typer.Exit) as exited:
        reports_bad_input(command)()
    assert exited.value.exit_code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert message == f"error: the sizes given are too large to count on this machine ({type(error).__name__}: {error})."


def test_help_teaches_the_notation():
    result = invoke("sweep", "--help")
    assert result.exit_code == 0
    assert "30x48x80" in result.stdout and "--stride" in result.stdout
