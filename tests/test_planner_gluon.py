"""The planner pricing natsim's Gluon FP8 kernel, on the CPU: its features against the simulator counted the slow
way, which rows of a search it runs against a brute-force restatement of its rules, FP8 plans picking it where a
synthetic cost model makes it cheaper (and not where it is dearer, or not priced, or in bf16), refusals, JSON,
plans and mask plans running on its CPU path, and the calibration cases."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from natsim import Problem, TileConfig, simulate
from natsim.kernels import TileOrder
from natsim.kernels.backends import gluon as gluon_backend
from natsim.kernels.gluon.ops import fp8_block_attention
from natsim.kernels.gna.reference import reference_attention
from natsim.kernels.gluon.tile_mask import gna_block_lists
from natsim.planner import Plan, best, best_mask, cost_model_for, tile_catalog
from natsim.planner.backends import backend_choice
from natsim.planner.cost.gluon_calibrate import gluon_calibration_cases
from natsim.planner.cost.gluon_features import GLUON_FEATURES, dense_gluon_features, gna_gluon_features
from natsim.planner.cost.model import CostModel
from natsim.planner.search.gluon_scores import GluonScorer

H100 = replace(cost_model_for("NVIDIA H100 80GB HBM3"), host_seconds=None)  # kernels' predictions alone
TRITON_ONLY = replace(H100, gluon_fp8_coefficients=None)
# Cheaper per FLOP than the Triton FP8 kernel (whose full_flops coefficient is about 1e-15 s), dearer per call.
GLUON = {"flops": 6e-16, "narrow_head_flops": 2e-16, "blocks": 1e-10, "masked_blocks": 5e-11, "programs": 1e-8,
         "moved_bytes": 4e-13, "launch": 6e-5}
CHEAP = replace(H100, gluon_fp8_coefficients=GLUON)
DEAR = replace(H100, gluon_fp8_coefficients={name: 50 * value for name, value in GLUON.items()})
HUNYUAN = dict(heads=24, window=(18, 24, 24), precision="fp8")


@pytest.fixture
def hopper(monkeypatch):
    """The Gluon kernel runs on the device at hand."""
    monkeypatch.setattr(gluon_backend, "device_refusal", lambda device: None)


def gluon_runs(shape, tiles: TileConfig, problem: Problem, head_dim: int = 128) -> bool:
    """The kernel's rules restated: one tile of 128 tokens for queries and keys, static KV tiling; head_dim 64 or
    128 (partial tiles masked inside)."""
    return (tiles.kv_tiling == "static" and tiles.q_tile == tiles.kv_tile and math.prod(tiles.q_tile) == 128
            and head_dim in (64, 128))


def masked_blocks(problem: Problem, tile: tuple[int, ...]) -> int:
    """The blocks the kernel masks inside, as its own lists mark them."""
    lists, _ = gna_block_lists(problem, tile, torch.device("cpu"))
    return int(lists.mask(partial=True).sum())


@pytest.mark.parametrize("shape, window, stride, tile, head_dim", [
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), (2, 8, 8), 128),
    ((32768,), (2048,), (256,), (128,), 64),
    ((16, 32, 64), (16, 32, 64), (1, 1, 1), (2, 8, 8), 128),
])
def test_gna_features_count_blocks_bytes_and_flops_the_slow_way(shape, window, stride, tile, head_dim):
    problem = Problem(shape, window, stride)
    row = gna_gluon_features(problem, tile, batch_heads=24, head_dim=head_dim, element_bytes=2)
    features = dict(zip(GLUON_FEATURES, row))
    visited = simulate(problem, TileConfig(tile, tile)).visited_tiles
    tokens = math.prod(shape)  # every tile divides: nothing padded
    assert features["blocks"] == visited * 24
    assert features["flops"] == 4 * 128 * 128 * head_dim * visited * 24
    assert features["narrow_head_flops"] == (features["flops"] if head_dim < 128 else 0)
    assert features["programs"] == tokens / 128 * 24
    order = TileOrder(shape, tile, (1,) * len(shape))  # moved only where the order is not the layout's own
    index = torch.arange(tokens, dtype=torch.float32).reshape(1, tokens, 1, 1)
    moves = not torch.equal(order.to_order(index), index)
    assert moves == (len(shape) > 1)
    permuted = moves * 2 * tokens * 24 * head_dim * 2  # the output back (q, k, v are read in order as quantized)
    quantized = 3 * tokens * 24 * head_dim * (2 + 1)  # read bf16, write one byte
    assert features["moved_bytes"] == permuted + quantized and features["launch"] == 1
    dense = dict(zip(GLUON_FEATURES, dense_gluon_features(tokens, batch_heads=24, head_dim=head_dim,
                                                          element_bytes=2)))
    assert dense["blocks"] == (tokens // 128) ** 2 * 24 and dense["moved_bytes"] == quantized
    assert features["masked_blocks"] == 0 == masked_blocks(problem, tile)


@pytest.mark.parametrize("shape, window, stride, tile", [
    ((21, 45, 80), (10, 23, 32), (1, 8, 16), (2, 8, 8)),  # padding along 45, partial and whole tiles
    ((9, 20, 24), (4, 7, 9), (1, 1, 3), (2, 4, 16)),
    ((3000,), (700,), (100,), (128,)),
])
def test_masked_blocks_are_those_the_kernels_lists_mark_partial(shape, window, stride, tile):
    problem = Problem(shape, window, stride)
    features = dict(zip(GLUON_FEATURES, gna_gluon_features(problem, tile, batch_heads=3, head_dim=128,
                                                           element_bytes=2)))
    partial = masked_blocks(problem, tile)
    assert partial > 0 and features["masked_blocks"] == partial * 3
    assert features["blocks"] == simulate(problem, TileConfig(tile, tile)).visited_tiles * 3


def test_a_model_fitted_before_partial_tiles_prices_whole_tiles_only():
    """A model whose `masked_blocks` is 0 (a file fitted before the kernel ran partial tiles, such as the shipped
    H100 one) scores only rows whose every visited block is whole and holds no padding key, as before."""
    shape, window = (8, 16, 32), (4, 8, 16)
    catalog = [t for t in tile_catalog(shape, 128, ("static",))]
    unfitted = replace(H100, gluon_fp8_coefficients={**GLUON, "masked_blocks": 0.0})
    scorer = GluonScorer(shape, (False,) * 3, [window], catalog, unfitted, batch_heads=2, head_dim=128,
                         dtype=torch.bfloat16, element_bytes=2)
    problems = [Problem(shape, window, stride) for stride in ((1, 1, 1), (4, 8, 16))]
    rows = {name: [] for name in ("tile_index", "window_index", "stride", "visited_tiles")}
    for problem in problems:
        for index, tiles in enumerate(catalog):
            for name, value in zip(rows, (index, 0, problem.stride, simulate(problem, tiles).visited_tiles)):
                rows[name].append(value)
    scores, _ = scorer.scores({name: np.array(values) for name, values in rows.items()})
    expected = [gluon_runs(shape, tiles, problem) and masked_blocks(problem, tiles.q_tile) == 0
                for problem in problems for tiles in catalog]
    runs = [gluon_runs(shape, tiles, problem) for problem in problems for tiles in catalog]
    assert list(np.isfinite(scores)) == expected and any(expected) and runs != expected  # whole rows, not partial


@pytest.mark.parametrize("shape, window", [((30, 48, 80), (18, 24, 24)), ((64, 64), (32, 32)), ((4096,), (1024,))])
def test_the_scorer_prices_exactly_the_rows_the_kernel_runs(shape, window):
    catalog = [t for t in tile_catalog(shape, 128, ("static",))]
    problems = [Problem(shape, window, stride) for stride in ((1,) * len(shape), window,
                                                              tuple(max(1, w // 2) for w in window))]
    scorer = GluonScorer(shape, (False,) * len(shape), [window], catalog, CHEAP, batch_heads=2, head_dim=128,
                         dtype=torch.bfloat16, element_bytes=2)
    rows = {name: [] for name in ("tile_index", "window_index", "stride", "visited_tiles")}
    for problem in problems:
        for index, tiles in enumerate(catalog):
            rows["tile_index"].append(index)
            rows["window_index"].append(0)
            rows["stride"].append(problem.stride)
            rows["visited_tiles"].append(simulate(problem, tiles).visited_tiles)
    rows = {name: np.array(values) for name, values in rows.items()}
    scores, backward = scorer.scores(rows)
    expected = [gluon_runs(shape, tiles, problem) for problem in problems for tiles in catalog]
    assert backward is None and list(np.isfinite(scores)) == expected and any(expected)
    rows_run = np.nonzero(expected)[0]
    for row in [*rows_run[:3], *rows_run[-3:]]:
        problem, tiles = problems[row // len(catalog)], catalog[row % len(catalog)]
        alone = gna_gluon_features(problem, tiles.q_tile, batch_heads=2, head_dim=128, element_bytes=2)
        assert scores[row] == pytest.approx(float(CHEAP.predict_gluon(alone, "fp8")))


def test_fp8_plans_pick_gluon_where_it_is_cheaper_and_say_so(hopper):
    plan = best((30, 48, 80), 0.9, cost_model=CHEAP, **HUNYUAN)
    assert plan.backend == "gluon" and plan.search.backends == ("triton", "gluon")
    tiles = plan.tiles
    assert gluon_runs((30, 48, 80), tiles, plan.problem)
    assert set(plan.breakdown) == set(GLUON_FEATURES)
    assert plan.kernel_arguments()["backend"] == "gluon" and plan.kernel_arguments()["precision"] == "fp8"
    assert {c.backend for c in plan.search.best_by_backend} == {"triton", "gluon"}
    again = Plan.from_dict(plan.to_dict())
    assert again.backend == "gluon" and again.tiles == plan.tiles
    dear = best((30, 48, 80), 0.9, cost_model=DEAR, **HUNYUAN)
    assert dear.backend == "triton" and "gluon" in dear.search.backends
    bf16 = best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), cost_model=CHEAP)
    assert "gluon" not in bf16.search.backends and bf16.backend != "gluon"


def test_gluon_is_priced_but_not_picked_off_hopper_and_refused_when_asked(monkeypatch):
    monkeypatch.setattr(gluon_backend, "device_refusal", lambda device: "not a Hopper GPU.")
    plan = best((30, 48, 80), 0.9, cost_model=CHEAP, **HUNYUAN)
    assert plan.backend == "triton" and plan.search.would_pick.backend == "gluon"
    assert dict(plan.search.backend_notes)["gluon"] == "not a Hopper GPU."
    with pytest.raises(ValueError, match=r"asks for natsim's Gluon kernel, which does not run here: not a Hopper"):
        best((30, 48, 80), 0.9, cost_model=CHEAP, backends="gluon", **HUNYUAN)


def test_backend_choice_for_gluon_says_why_in_sentences(hopper):
    fp8 = dict(device=None, training=False, gpu="NVIDIA H100 80GB HBM3", excluded={"fa4": "FP8"}, fp8=True)
    assert backend_choice(None, model=CHEAP, **fp8).allowed == ("triton", "gluon")
    unpriced = backend_choice(None, model=TRITON_ONLY, **fp8)
    assert unpriced.allowed == ("triton",) and "has no Gluon FP8 coefficients" in dict(unpriced.notes)["gluon"]
    with pytest.raises(ValueError, match=r"calibrate --kernels gluon-fp8"):
        backend_choice(("gluon",), model=TRITON_ONLY, **fp8)
    with pytest.raises(ValueError, match=r"asks for natsim's Gluon kernel, but it runs GNA in precision='fp8' only "
                                         r"\(its 16-bit variant runs block masks: best_mask\)"):
        best((30, 48, 80), 0.9, heads=24, cost_model=CHEAP, backends=("triton", "gluon"))
    assert backend_choice(("gluon",), model=CHEAP, **fp8).allowed == ("gluon",)


def test_a_gluon_plan_runs_on_its_cpu_path_like_float64_attention(hopper):
    shape = (4, 16, 32)
    plan = best(shape, 0.5, heads=2, head_dim=64, window=(2, 8, 16), precision="fp8", cost_model=CHEAP)
    assert plan.backend == "gluon"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, *shape, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    out = plan(q, k, v)
    p = plan.problem
    reference = reference_attention(q.double(), k.double(), v.double(), p.window, p.stride)
    assert float((out.double() - reference).norm() / reference.norm()) < 6e-2


def test_fp8_mask_plans_price_gluon_at_128_blocks_and_run_it(hopper):
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(1, 2, 8, 8, generator=gen) < 0.4
    mask |= torch.eye(8, dtype=torch.bool)
    plan = best_mask(mask, 64, 64, 512, head_dim=64, precision="fp8", cost_model=CHEAP)
    gluon = [c for c in plan.candidates if c.backend == "gluon"]
    assert len(gluon) == 1 and (gluon[0].q_block, gluon[0].kv_block, gluon[0].merge) == (128, 128, "none")
    pooled = mask.reshape(1, 2, 4, 2, 4, 2).any(5).any(3)
    assert gluon[0].tiles == int(pooled.sum())
    on_gluon = best_mask(mask, 64, 64, 512, head_dim=64, precision="fp8", cost_model=CHEAP, backends="gluon")
    assert on_gluon.backend == "gluon" and (on_gluon.q_block, on_gluon.kv_block) == (128, 128)
    q, k, v = (torch.randn(1, 512, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    assert torch.equal(on_gluon(q, k, v), fp8_block_attention(q, k, v, pooled))
    bf16 = best_mask(mask, 64, 64, 512, head_dim=64, cost_model=CHEAP)
    assert all(c.backend != "gluon" for c in bf16.candidates)


def test_mask_plans_pick_gluon_when_cheapest(hopper):
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(1, 4, 64, 64, generator=gen) < 0.3
    plan = best_mask(mask, 128, 128, 8192, head_dim=128, precision="fp8", cost_model=CHEAP)
    assert plan.backend == "gluon" and set(plan.breakdown) == set(GLUON_FEATURES)
    assert best_mask(mask, 128, 128, 8192, head_dim=128, precision="fp8", cost_model=DEAR).backend == "triton"


def test_the_cost_model_keeps_and_names_its_gluon_set(tmp_path):
    path = CHEAP.save(tmp_path / "h100.json")
    loaded = CostModel.load(path)
    assert loaded.has("gluon-fp8") and loaded.gluon_fp8_coefficients == GLUON
    assert not TRITON_ONLY.has("gluon-fp8")
    with pytest.raises(ValueError, match=r"has no Gluon FP8 coefficients; run `natsim calibrate --kernels gna,gluon-fp8`"):
        TRITON_ONLY.predict_gluon(np.zeros(len(GLUON_FEATURES)), "fp8")


def test_every_calibration_case_runs_on_the_kernel_and_its_features_are_finite():
    cases = gluon_calibration_cases()
    assert len(cases) > 2 * len(GLUON_FEATURES)
    for case in cases:
        assert case.refusal() is None, case.describe()
        row = case.features(torch.bfloat16)
        assert row.shape == (len(GLUON_FEATURES),) and np.isfinite(row).all() and row[0] > 0
    heads = {case.head_dim for case in cases}
    assert heads == {64, 128}  # narrow_head_flops is separable from flops


# -- precision="auto" -------------------------------------------------------------------------------------------


def test_auto_precision_runs_fp8_only_where_it_is_predicted_faster_by_more_than_the_tolerance(hopper):
    from natsim.planner.plans.ranking import TIE_TOLERANCE

    cheap = best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), precision="auto", cost_model=CHEAP)
    bf16 = best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), cost_model=CHEAP)
    fp8 = best((30, 48, 80), 0.9, cost_model=CHEAP, **HUNYUAN)
    expected = fp8 if fp8.score < bf16.score * (1 - TIE_TOLERANCE) else bf16
    assert (cheap.precision, cheap.backend, cheap.score) == (expected.precision, expected.backend, expected.score)
    assert cheap.search.precisions == (("bf16", bf16.backend, bf16.score), ("fp8", fp8.backend, fp8.score))
    assert cheap.precision == "fp8" and cheap.backend == "gluon"  # this model makes the Gluon kernel cheap
    dear = best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), precision="auto", cost_model=DEAR)
    assert dear.precision is None and "keeps bf16" in dear.search.precision_note
    text = " ".join(str(line) for line in dear.explain().renderables)
    assert "precision='auto': bf16" in text and "fp8" in text
    again = Plan.from_dict(cheap.to_dict())
    assert again.search.precisions == cheap.search.precisions and again.precision == "fp8"


def test_auto_precision_keeps_bf16_where_fp8_cannot_be_compared_or_run():
    no_model = best((30, 48, 80), 0.9, heads=24, precision="auto")  # this machine has no GPU: tile work
    assert no_model.precision is None and "cannot be compared" in no_model.search.precision_note
    dynamic = best((30, 48, 80), 0.9, heads=24, precision="auto", kv_tiling="dynamic", cost_model=CHEAP)
    assert dynamic.precision is None and dynamic.search.precision_note.startswith("FP8 was not planned:")
    assert [p[0] for p in dynamic.search.precisions] == ["bf16"]
    narrow = best((30, 48, 80), 0.9, heads=24, head_dim=16, precision="auto", cost_model=CHEAP)  # no FP8 kernel
    assert narrow.precision is None and "supports head_dim 24 to 256" in narrow.search.precision_note
    for options in (dict(training=True), dict(world_size=2)):
        with pytest.raises(ValueError, match=r"precision='auto' chooses between bf16 and FP8 for inference"):
            best((30, 48, 80), 0.9, heads=24, precision="auto", cost_model=CHEAP, **options)


def test_an_autoplan_with_auto_precision_plans_each_layout_and_refuses_training(hopper):
    from natsim.planner import AutoPlan

    auto = AutoPlan(0.5, window=(2, 8, 16), precision="auto", cost_model=CHEAP)
    plan = auto.plan_for((4, 16, 32), heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu")
    assert plan.search.precisions and plan.precision in (None, "fp8")
    gen = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if plan.backend == "gluon" else torch.float16  # the interpreter computes bf16 wrongly
    q, k, v = (torch.randn(1, 4, 16, 32, 2, 64, generator=gen).to(dtype) for _ in range(3))
    p = plan.problem
    reference = reference_attention(q.double(), k.double(), v.double(), p.window, p.stride)
    assert float((auto(q, k, v).double() - reference).norm() / reference.norm()) < 6e-2
    with pytest.raises(ValueError, match=r"precision='auto' .* training must be False"):
        AutoPlan(0.5, precision="auto", training=True)


def test_an_unknown_precision_is_refused_naming_auto():
    from natsim.planner import AutoPlan

    for make in (lambda: best((30, 48, 80), 0.9, precision="bf8"), lambda: AutoPlan(0.9, precision="bf8")):
        with pytest.raises(ValueError, match=r"precision must be None \(the inputs' dtype\), 'fp8' or 'auto'"):
            make()
