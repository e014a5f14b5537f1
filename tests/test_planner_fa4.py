"""The planner choosing between natsim's Triton kernels and FlashAttention-4, on the CPU: synthetic cost models
with FlashAttention-4 coefficients (full blocks cheaper than natsim's, masked ones far dearer) and its availability
faked, the picks against an independent brute-force scoring of the same rows, picks of Triton-only models
unchanged, refusals, JSON, the reports' lines, plans running on their backend, mask plans and `natsim plan`."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import typer
from rich.console import Console
from typer.testing import CliRunner

from natsim import Problem, TileConfig, simulate
from natsim.cli import plan as plan_cli
from natsim.kernels.backends import fa4 as fa4_backend
from natsim.kernels.backends.triton import permutes
from natsim.kernels.fa4.lists import gna_lists
from natsim.planner import MaskPlan, Plan, best, best_mask, cost_model_for, features_of, or_pool, tile_catalog
from natsim.planner.cost.fa4_features import FA4_FEATURES
from natsim.planner.search.gna import stride_candidates

# natsim's H100 coefficients without FlashAttention-4's sets: a GPU calibrated for the Triton kernels only; without
# host times, so that the searches rank the kernels' predictions (tests/test_planner_host.py prices the host)
H100 = replace(cost_model_for("NVIDIA H100 80GB HBM3"), fa4_coefficients=None, fa4_backward_coefficients=None,
               gluon_fp8_coefficients=None, host_seconds=None)
FA4 = {"full_flops": 1.45e-15, "masked_flops": 1.9e-14, "narrow_head_flops": 4e-16, "tiles": 1e-10,
       "programs": 2e-8, "permute_bytes": 4.2e-13, "launch": 5e-5}
MODEL = replace(H100, fa4_coefficients=FA4, fa4_backward_coefficients={k: 2.5 * v for k, v in FA4.items()})
NOT_INSTALLED = "FlashAttention-4 is not installed (pip install 'natsim[fa4]')."
HUNYUAN = dict(heads=24, window=(18, 24, 24), cost_model=MODEL)


@pytest.fixture
def fa4_here(monkeypatch):
    """FlashAttention-4 installed and running on the device at hand."""
    monkeypatch.setattr(fa4_backend, "installed", lambda: None)
    monkeypatch.setattr(fa4_backend, "device_refusal", lambda device: None)


@pytest.fixture
def fa4_missing(monkeypatch):
    monkeypatch.setattr(fa4_backend, "installed", lambda: NOT_INSTALLED)


def render(renderable) -> str:
    console = Console(record=True, width=160)
    console.print(renderable)
    return " ".join(console.export_text().split())


# -- an independent scoring -----------------------------------------------------------------------------------


def fa4_runs(tiles: TileConfig, head_dim: int = 128, backward: bool = False) -> bool:
    """FlashAttention-4's rules on GNA tiles, restated: static KV tiling, query blocks of a multiple of 64 up to
    256 tokens, key blocks of a multiple of 16 up to 128, a KV tile that is the Q tile or a slab of it along its
    first dimension longer than 1; its backward wants key blocks of 128 and query blocks of a multiple of 64."""
    q_tile, kv_tile = tiles.q_tile, tiles.kv_tile
    q, kv = math.prod(q_tile), math.prod(kv_tile)
    differ = [i for i in range(len(q_tile)) if q_tile[i] != kv_tile[i]]
    nested = not differ or (len(differ) == 1 and q_tile[differ[0]] % kv_tile[differ[0]] == 0
                            and all(side == 1 for side in q_tile[:differ[0]]))
    runs = tiles.kv_tiling == "static" and q % 64 == 0 and q <= 256 and kv % 16 == 0 and kv <= 128 and nested
    return runs and (not backward or (kv == 128 and q % (128 if head_dim <= 64 else 64) == 0))


def fa4_seconds(problem: Problem, tiles: TileConfig, heads: int, head_dim: int = 128) -> float:
    """One FlashAttention-4 call's predicted seconds, its features counted the slow way: full blocks from the
    lists FlashAttention-4 reads (kernels/fa4/lists.py), q, k, v permuted in the Q tile's order."""
    full = int(gna_lists(problem, tiles.q_tile, tiles.kv_tile, torch.device("cpu")).forward[2].sum())
    visited = simulate(problem, tiles).visited_tiles
    q, kv = math.prod(tiles.q_tile), math.prod(tiles.kv_tile)
    block = 4.0 * q * kv * head_dim * heads
    tokens = problem.num_tokens
    padded = math.prod(-(-length // side) * side for length, side in zip(problem.shape, tiles.q_tile))
    row = [full * block, (visited - full) * block, (head_dim < 128) * visited * block, visited * heads,
           padded / 128 * heads, (3 * (tokens + padded) + 2 * tokens) * heads * head_dim * 2, 1.0]
    return float(np.dot(row, [FA4[name] for name in FA4_FEATURES]))


def triton_seconds(problem: Problem, tiles: TileConfig, heads: int, head_dim: int = 128) -> float:
    row = features_of(simulate(problem, tiles), batch_heads=heads, head_dim=head_dim, element_bytes=2,
                      permutation=permutes(Problem(problem.shape, 1)))
    return float(MODEL.predict(row))


def test_the_pick_is_the_tie_rule_over_a_brute_force_scoring_of_the_same_rows(fa4_here):
    shape, window, max_stride, heads = (8, 16, 24), (5, 9, 12), (2, 4, 4), 4
    plan = best(shape, 0.8, heads=heads, window=window, max_stride=max_stride, cost_model=MODEL)
    pairs = []  # (score, stride product, backend, stride, tiles)
    for stride in stride_candidates(window, max_stride):
        problem = Problem(shape, window, stride)
        for tiles in tile_catalog(shape, 128, MODEL.kv_tilings):
            pairs.append((triton_seconds(problem, tiles, heads), math.prod(stride), "triton", stride, tiles))
            if fa4_runs(tiles):
                pairs.append((fa4_seconds(problem, tiles, heads), math.prod(stride), "fa4", stride, tiles))
    fastest = min(score for score, *_ in pairs)
    tied = [pair for pair in pairs if pair[0] <= fastest * 1.02]
    product = min(pair[1] for pair in tied)
    score = min(pair[0] for pair in tied if pair[1] == product)
    winners = [(backend, stride, tiles) for s, p, backend, stride, tiles in tied if p == product and s == score]
    assert plan.score == pytest.approx(score, rel=1e-9)
    assert (plan.backend, plan.problem.stride, plan.tiles) in winners
    assert any(backend == "fa4" for _, _, backend, *_ in pairs)
    assert plan.search.scored == len(pairs)


# -- the picks ------------------------------------------------------------------------------------------------


def test_block_sparse_hunyuanvideo_plans_run_on_flashattention4_and_stride_1_on_triton(fa4_here):
    blocks = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    tiles = TileConfig((4, 8, 8), (2, 8, 8))
    assert fa4_seconds(blocks, tiles, 24) < triton_seconds(blocks, tiles, 24)  # the model, as measured
    plan = best((30, 48, 80), 0.9, **HUNYUAN)
    assert plan.backend == "fa4" and plan.simulation.block_sparse and plan.calibrated
    assert plan.kernel_arguments()["backend"] == "fa4" and plan.tiles.kv_tiling == "static"
    assert {c.backend for c in plan.search.best_by_backend} == {"triton", "fa4"} and plan.search.would_pick is None
    assert set(plan.breakdown) == set(FA4_FEATURES)
    neighborhood = best((30, 48, 80), 0.9, max_stride=1, **HUNYUAN)
    assert neighborhood.backend == "triton" and neighborhood.problem.stride == (1, 1, 1)
    fa4_best = next(c for c in neighborhood.search.best_by_backend if c.backend == "fa4")
    assert fa4_best.score > 2 * neighborhood.score  # its masked blocks


@pytest.mark.parametrize("shape, target", [((30, 48, 80), 0.9), ((256, 256), 0.9), ((32768,), 0.95)])
def test_triton_only_cost_models_pick_what_they_picked(fa4_here, monkeypatch, shape, target):
    before = best(shape, target, heads=24, cost_model=H100, backends=("triton",))
    assert before.backend == "triton" and before.search.best_by_backend[0].backend == "triton"
    again = best(shape, target, heads=24, cost_model=MODEL, backends=("triton",))
    unpriced = best(shape, target, heads=24, cost_model=H100)  # FlashAttention-4 runs, but has no coefficients
    monkeypatch.setattr(fa4_backend, "installed", lambda: NOT_INSTALLED)
    priced_elsewhere = best(shape, target, heads=24, cost_model=MODEL)
    for plan in (again, unpriced, priced_elsewhere):
        assert (plan.problem, plan.tiles, plan.backend, plan.score) == (before.problem, before.tiles, "triton",
                                                                       before.score)
        assert plan.runners_up == before.runners_up and plan.search.top == before.search.top


def test_training_ranks_flashattention4_with_its_backward_on_the_blocks_its_backward_runs(fa4_here):
    plan = best((16, 32, 48), 0.85, heads=8, cost_model=MODEL, training=True)
    fa4 = [c for c in (*plan.search.top, *plan.search.best_by_backend) if c.backend == "fa4"]
    assert fa4 and all(fa4_runs(TileConfig(c.q_tile, c.kv_tile), backward=True) for c in fa4)
    assert all(c.backward_score is not None and c.backward_score < c.score for c in fa4)
    on_fa4 = best((16, 32, 48), 0.85, heads=8, cost_model=MODEL, training=True, backends="fa4")
    assert on_fa4.backend == "fa4" and on_fa4.backward_tiles == (on_fa4.tiles.q_tile, on_fa4.tiles.kv_tile)
    assert {"backward_full_flops", "full_flops"} <= set(on_fa4.breakdown)
    assert on_fa4.predicted_backward_time_s == pytest.approx(on_fa4.score - on_fa4.predicted_forward_time_s)
    forward_only = replace(MODEL, fa4_backward_coefficients=None)
    plan = best((16, 32, 48), 0.85, heads=8, cost_model=forward_only, training=True)
    assert plan.backend == "triton" and [c.backend for c in plan.search.best_by_backend] == ["triton"]
    assert "no FlashAttention-4 backward coefficients" in render(plan.explain())


def test_flashattention4_is_left_out_where_it_has_no_place(fa4_here, monkeypatch):
    import natsim.distributed

    plans = [best((16, 32, 48), 0.85, heads=8, cost_model=MODEL, **options)
             for options in (dict(precision="fp8"), dict(world_size=2), dict(kv_tiling="dynamic"))]
    for plan in plans:
        single = getattr(plan, "plan", plan)
        assert single.backend == "triton" and single.search.backends == ("triton",)
        assert [c.backend for c in single.search.best_by_backend] == ["triton"] and not single.search.backend_notes
    calls = []
    monkeypatch.setattr(natsim.distributed, "gna_attention", lambda *args, **kwargs: calls.append(kwargs))
    q = torch.zeros(1, 8, 32, 48, 8, 8)
    plans[1](q, q, q)  # over two ranks: natsim.distributed, which runs the Triton kernels only
    assert calls and "backend" not in calls[0] and calls[0]["strategy"] == plans[1].strategy


# -- refusals -------------------------------------------------------------------------------------------------


def test_backends_asked_for_are_checked_with_sentences(fa4_here, monkeypatch):
    with pytest.raises(ValueError, match=r"backends must name one or more of \('triton', 'fa4', 'gluon'\).*'cuda'"):
        best((16, 32, 48), 0.85, backends=("cuda",))
    with pytest.raises(ValueError, match=r"backends must name one or more"):
        best((16, 32, 48), 0.85, backends=())
    with pytest.raises(TypeError, match=r"backends must be None, a backend's name or a sequence"):
        best((16, 32, 48), 0.85, backends=4)
    with pytest.raises(ValueError, match=r"has no FlashAttention-4 coefficients; run `natsim calibrate --kernels fa4`"):
        best((16, 32, 48), 0.85, cost_model=H100, backends="fa4")
    with pytest.raises(ValueError, match=r"there is no cost model for this machine.*cannot tell the backends apart"):
        best((16, 32, 48), 0.85, backends=("triton", "fa4"))
    with pytest.raises(ValueError, match=r"asks for FlashAttention-4, but it runs no FP8"):
        best((16, 32, 48), 0.85, cost_model=MODEL, backends=("fa4",), precision="fp8")
    with pytest.raises(ValueError, match=r"natsim.distributed runs natsim's Triton kernels"):
        best((16, 32, 48), 0.85, cost_model=MODEL, backends=("fa4",), world_size=2)
    with pytest.raises(ValueError, match=r"it runs static KV tiling only, so kv_tiling='dynamic'"):
        best((16, 32, 48), 0.85, cost_model=MODEL, backends=("fa4",), kv_tiling="dynamic")
    with pytest.raises(ValueError, match=r"no configuration of shape=\(8, 8\) runs on FlashAttention-4 at head_dim=128 "
                                         r"with its backward pass; .* got 64 x 64"):
        best((8, 8), 0.5, cost_model=MODEL, backends=("fa4",), training=True)  # 64-token tiles only
    monkeypatch.setattr(fa4_backend, "device_refusal", lambda device: f"no Hopper GPU at {device}.")
    with pytest.raises(ValueError, match=r"asks for FlashAttention-4, which does not run here: no Hopper GPU at cpu"):
        best((16, 32, 48), 0.85, cost_model=MODEL, backends=("fa4",))


def test_flashattention4_not_installed_is_refused_with_the_install_command(fa4_missing):
    with pytest.raises(ValueError, match=r"does not run here: FlashAttention-4 is not installed \(pip install "):
        best((16, 32, 48), 0.85, cost_model=MODEL, backends=("fa4",))


def test_flashattention4_needs_the_device_to_run_it():
    plan = best((16, 32, 48), 0.85, cost_model=MODEL)  # the real checks: no Hopper GPU here
    assert plan.backend == "triton" and plan.search.backends == ("triton",)
    assert [b for b, _ in plan.search.backend_notes] == ["fa4"]


# -- what a plan records and says -----------------------------------------------------------------------------


def test_a_flashattention4_plan_round_trips_through_json(fa4_here):
    plan = best((30, 48, 80), 0.9, **HUNYUAN)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.backend == "fa4" and again.search.best_by_backend == plan.search.best_by_backend
    assert json.loads(plan.to_json())["backend"] == "fa4"


def test_plans_written_before_backends_read_as_triton():
    record = best((16, 32, 48), 0.85).to_dict()
    del record["backend"]
    for key in ("backends", "best_by_backend", "would_pick", "backend_notes"):
        del record["search"][key]
    for candidate in (*record["runners_up"], *record["search"]["top"]):
        del candidate["backend"]
    plan = Plan.from_dict(record)
    assert plan.backend == "triton" and plan.search.backends == ("triton",) and plan.search.best_by_backend == ()
    assert all(c.backend == "triton" for c in plan.runners_up)
    record["backend"] = "cuda"
    with pytest.raises(ValueError, match=r"backend must be one of \('triton', 'fa4', 'gluon'\), got backend='cuda'"):
        Plan.from_dict(record)


def test_the_report_names_what_flashattention4_would_gain_and_how_to_get_it(fa4_missing):
    plan = best((30, 48, 80), 0.9, **HUNYUAN)
    assert plan.backend == "triton" and plan.search.would_pick.backend == "fa4"
    would = plan.search.would_pick
    text = render(plan.explain())
    assert (f"FlashAttention-4 would run this plan's best configuration (window 18x24x24, stride "
            f"{'x'.join(map(str, would.stride))}, tiles") in text
    assert f"in {would.score * 1e3:.4g} ms, {plan.score / would.score:.2f}x faster: {NOT_INSTALLED}" in text
    assert "the best plan of each backend priced" in text and "backend │ triton (natsim's Triton kernels)" in text
    again = Plan.from_json(plan.to_json())
    assert again.search.would_pick == would and dict(again.search.backend_notes) == {"fa4": NOT_INSTALLED}


def test_the_report_says_when_flashattention4_would_not_gain(fa4_missing):
    slow = replace(MODEL, fa4_coefficients={name: 10 * value for name, value in FA4.items()})
    plan = best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), cost_model=slow)
    assert plan.search.would_pick.backend == "triton"
    assert ("FlashAttention-4 would not make this plan faster, the cost model predicts; it does not run here: "
            + NOT_INSTALLED) in render(plan.explain())


def test_the_report_says_when_the_backends_cannot_be_told_apart(fa4_here):
    text = render(best((16, 32, 48), 0.85).explain())
    assert ("FlashAttention-4 runs here, but there is no cost model for this machine (no CUDA GPU) (plans rank by tile "
            "work), which cannot tell the backends apart: plans run natsim's Triton kernels") in text
    text = render(best((16, 32, 48), 0.85, cost_model=H100).explain())
    assert "the cost model of NVIDIA H100 80GB HBM3 has no FlashAttention-4 coefficients" in text
    assert "`natsim calibrate --kernels fa4` on this GPU fits them" in text


def test_both_backends_priced_show_each_best_and_the_scores_count_pairs(fa4_here):
    text = render(best((30, 48, 80), 0.9, **HUNYUAN).explain())
    assert "(window, stride, tile, backend) configurations scored, on natsim's Triton kernels and FlashAttention-4" in text
    assert "backend │ fa4 (FlashAttention-4)" in text and "FlashAttention-4's calls were priced by its own" in text


def test_a_plan_runs_on_its_backend(fa4_here, monkeypatch):
    from natsim.planner.plans import plan as plan_module

    calls = []
    monkeypatch.setattr(plan_module, "gna_attention", lambda q, k, v, **kwargs: calls.append(kwargs) or q)
    plan = best((30, 48, 80), 0.9, **HUNYUAN)
    q = torch.zeros(1, 30, 48, 80, 1, 8)
    plan(q, q, q)
    assert calls[0]["backend"] == "fa4" and calls[0]["q_tile"] == plan.tiles.q_tile
    best((16, 32, 48), 0.85)(torch.zeros(1, 16, 32, 48, 1, 8), *(torch.zeros(1, 16, 32, 48, 1, 8),) * 2)
    assert calls[1]["backend"] == "triton"


# -- mask plans -----------------------------------------------------------------------------------------------


def random_mask(sparsity: float, blocks: int = 256, heads: int = 24) -> torch.Tensor:
    return torch.rand((1, heads, blocks, blocks), generator=torch.Generator().manual_seed(1)) >= sparsity


N = 256 * 128  # the masks' tokens at 128-token blocks


def test_a_mask_plan_prices_flashattention4_on_the_pooled_blocks_and_picks_it(fa4_here):
    mask = random_mask(0.7)
    plan = best_mask(mask, 128, 128, N, cost_model=MODEL)
    assert plan.backend == "fa4" and plan.merge == "none" and plan.backends == ("triton", "fa4")
    fa4 = [c for c in plan.candidates if c.backend == "fa4"]
    assert fa4 and all(c.merge == "none" and fa4_backend.tile_refusal(c.q_block, c.kv_block, 128) is None for c in fa4)
    for c in fa4:  # every visited block full, nothing permuted
        visited = int(or_pool(mask, c.q_block // 128, c.kv_block // 128).sum())
        row = [visited * 4.0 * c.q_block * c.kv_block * 128, 0, 0, visited, -(-N // c.q_block) * c.q_block / 128 * 24,
               0, 1]
        assert c.score == pytest.approx(float(np.dot(row, [FA4[name] for name in FA4_FEATURES])))
        assert c.tiles == visited
    assert set(plan.breakdown) == set(FA4_FEATURES)
    again = MaskPlan.from_json(plan.to_json())
    assert again == plan and again.chosen.backend == "fa4"


def test_a_mask_plan_without_flashattention4_here_says_what_it_would_gain(fa4_missing):
    plan = best_mask(random_mask(0.7), 128, 128, N, cost_model=MODEL)
    assert plan.backend == "triton" and plan.would_pick.backend == "fa4"
    text = render(plan.explain())
    assert "FlashAttention-4 would run this plan's best configuration (128 x 128 blocks, merge none)" in text
    assert NOT_INSTALLED in text and "fa4 (not here)" in text and "Best on fa4 (FlashAttention-4)" in text
    assert MaskPlan.from_json(plan.to_json()) == plan
    record = plan.to_dict()
    for key in ("backend", "backends", "would_pick", "backend_notes"):
        del record[key]
    record["candidates"] = [{k: v for k, v in c.items() if k != "backend"} for c in record["candidates"]
                            if c["backend"] == "triton"]
    older = MaskPlan.from_dict(record)
    assert older.backend == "triton" and older.backends == ("triton",) and older.would_pick is None


def test_mask_plans_of_triton_only_models_are_unchanged(fa4_here):
    mask = random_mask(0.8, blocks=64, heads=4)

    def kept(plan):  # what a plan chose, and its candidates but for the host's merge seconds
        return [replace(c, merge_s=0.0) for c in (plan.chosen, *plan.candidates)]

    before = best_mask(mask, 64, 64, 64 * 64, cost_model=H100, backends=("triton",))
    for plan in (best_mask(mask, 64, 64, 64 * 64, cost_model=H100),
                 best_mask(mask, 64, 64, 64 * 64, cost_model=MODEL, backends="triton")):
        assert kept(plan) == kept(before)


def test_mask_plans_refuse_flashattention4_where_it_has_no_place(fa4_here):
    with pytest.raises(ValueError, match=r"but it runs unmerged blocks only, and merges=\('xor',\)"):
        best_mask(random_mask(0.7), 128, 128, N, cost_model=MODEL, merges=("xor",), backends="fa4")
    with pytest.raises(ValueError, match=r"but it runs no FP8"):
        best_mask(random_mask(0.7), 128, 128, N, cost_model=MODEL, precision="fp8", backends="fa4")
    with pytest.raises(ValueError, match=r"FlashAttention-4 runs none of q_blocks=\(16, 32\) x kv_blocks=\(16,\) at "
                                         r"head_dim=128 \(for the first: .*runs Q tiles of 64 or 128 tokens, got 16"):
        best_mask(random_mask(0.7, blocks=512, heads=1), 16, 16, 512 * 16, cost_model=MODEL, backends="fa4",
                  q_blocks=(16, 32), kv_blocks=(16,))


def test_a_mask_plan_runs_on_its_backend(fa4_here, monkeypatch):
    from natsim.planner.plans import mask as mask_module

    calls = []
    monkeypatch.setattr(mask_module, "sparse_attention", lambda q, k, v, *args, **kwargs: calls.append(kwargs) or q)
    monkeypatch.setattr(mask_module, "prepare_sparse", lambda *args, **kwargs: calls.append(kwargs))
    mask = random_mask(0.7)
    plan = best_mask(mask, 128, 128, N, cost_model=MODEL)
    q = torch.zeros(1, N, 24, 8)
    plan(q, q, q)  # its own mask: the work prepared once (where a call runs eagerly), then the call
    plan(q, q, q, mask=mask)
    assert plan.backend == "fa4" and calls and all(call["backend"] == "fa4" for call in calls)


# -- natsim plan ----------------------------------------------------------------------------------------------

app = typer.Typer()


@app.callback()
def _natsim() -> None:
    """natsim (test app)."""


plan_cli.register(app)
runner = CliRunner()


def test_natsim_plan_takes_backends_and_shows_them(fa4_here, tmp_path):
    path = MODEL.save(tmp_path / "model.json")
    common = ["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--heads", "24", "--window", "18x24x24",
              "--coefficients", str(path)]
    result = runner.invoke(app, [*common, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["backend"] == "fa4"
    result = runner.invoke(app, [*common, "--backend", "triton", "--json"])
    assert json.loads(result.output)["backend"] == "triton"
    result = runner.invoke(app, [*common, "--backend", "triton,fa4", "--backend", "fa4"])
    assert result.exit_code == 0 and "fa4 (FlashAttention-4)" in result.output
    result = runner.invoke(app, [*common, "--backend", "cuda"])
    assert result.exit_code == 2 and "backends must name one or more of ('triton', 'fa4', 'gluon')" in result.output
    result = runner.invoke(app, [*common, "--backend", "triton,"])
    assert result.exit_code == 2 and "--backend takes backend names" in result.output
