"""Every combination of the planner's options, through `best` and `natsim plan`: training x world_size x cost
model x kv_tiling x head_dim (96, split, and a power of two) x causal x dtype x precision, on small 1-D, 2-D and
3-D layouts, and on the layouts that failed over several ranks (30x48x80 on 2, 21x45x80 on 4, 13x30x45 on 3) with
the H100's coefficients and without.

Each combination either returns a plan whose fields say what was asked (one GPU or P ranks, training, the KV
tiling, causal, head_dim, dtype, the GPU and basis; tile counts, per rank too, the simulator's), or raises a
ValueError sentence up front. Which combinations are refused is decided here from the documented rules
(`refusals`), independently of the planner's code, so a rule that is dropped, or a refusal that appears, fails.
"""

from __future__ import annotations

import functools
import itertools
import json
import re

import pytest
import typer
from typer.testing import CliRunner

from natsim import simulate
from natsim.cli import plan as plan_cli
from natsim.partition import key_frames, rank_tiles
from natsim.planner import CostModel, best, cost_model_for
from natsim.planner.plans.parallel import ParallelPlan

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
HEADS = 4
TRAINING = (False, True)
WORLD_SIZES = (None, 1, 2, 3, 4)
COSTS = ("none", "h100", "h200", "file")
KV_TILINGS = (None, "static", "dynamic")
SPLIT_HEAD_DIM = 96  # computed as 64 + 32 columns, padded to 128 by FP8
CAUSAL = (False, True)
DTYPES = ("bf16", "fp16", "fp32")
PRECISIONS = (None, "fp8")

# Each small layout plans the split head dim and one of the power-of-two ones (32, 64 and 128 take the same tile
# catalog, TILE_TOKENS, and the same code, with other FLOP counts): every head dim meets every other option.
SMALL = [((384,), 0.8, 32), ((12, 16), 0.7, 64), ((4, 6, 8), 0.6, 128)]
SEVERAL_RANKS = [((30, 48, 80), 0.9, 2), ((21, 45, 80), 0.9, 4), ((13, 30, 45), 0.9, 3)]

# A calibration from before the dynamic kernel and the backward: forward coefficients, static KV tiling only.
FILE_GPU = "Older GPU"


@pytest.fixture
def coefficients_file(tmp_path):
    """The path of a coefficients file `natsim calibrate` could have written before dynamic KV tiling and the
    backward pass: the H100's forward coefficients under another GPU's name."""
    model = CostModel(FILE_GPU, cost_model_for(H100).coefficients, info={"kv_tilings": ["static"]})
    return str(model.save(tmp_path / "older-gpu.json"))


def cost_options(cost: str, path: str) -> dict:
    return {"none": {}, "h100": {"device": "h100"}, "h200": {"device": "h200"}, "file": {"cost_model": path}}[cost]


@functools.lru_cache(maxsize=None)
def stored_model(cost: str, path: str):
    """The cost model a cost option names, as stored: None for "none" (and for an H200 without coefficients)."""
    return {"none": lambda: None, "h100": lambda: cost_model_for(H100), "h200": lambda: cost_model_for(H200),
            "file": lambda: CostModel.load(path)}[cost]()


def ranking_model(cost: str, path: str, training: bool, precision=None):
    """The model that ranks: the stored one, unless training needs backward coefficients it lacks, or FP8 its FP8
    coefficients (tile work)."""
    model = stored_model(cost, path)
    if precision == "fp8":
        return model if model is not None and model.fp8_coefficients is not None else None
    return None if model is None or (training and model.backward_coefficients is None) else model


def refusals(shape, path, *, training, world_size, cost, kv_tiling, head_dim, dtype, precision=None) -> list[str]:
    """The documented reasons (regular expressions of their sentences) to refuse a combination; none: it plans.

    - the kernels run head_dim 16 to 256 in steps of 8 and bf16 / fp16 only;
    - a GPU named by device= must have coefficients (an H200 has none until calibrated);
    - a fixed kv_tiling needs the ranking cost model to be calibrated on it (the file covers static only);
      without a model (none, or training without backward coefficients) tile work ranks both modes;
    - several ranks: at most one per frame (ulysses runs any plan, padding heads the ranks do not divide, so
      nothing else is refused);
    - FP8: inference only (no training), static KV tiling only, one GPU (no world_size).
    """
    reasons = []
    if head_dim not in range(16, 257, 8):
        reasons.append(r"head_dim must be one the GNA kernel runs \(16 to 256 in steps of 8\), got head_dim=")
    if dtype not in ("bf16", "fp16"):
        reasons.append(r"dtype must be one of those the GNA kernel runs \(fp16, bf16\)")
    if cost == "h200" and stored_model(cost, path) is None:
        reasons.append(r"device='h200' names NVIDIA H200, which has no cost-model coefficients here.*natsim calibrate")
    if precision == "fp8":
        if training:
            reasons.append(r"precision='fp8' is for inference \(its kernels have no backward pass\)")
        if kv_tiling == "dynamic":
            reasons.append(r"precision='fp8' runs static KV tiling only, got kv_tiling='dynamic'")
        if world_size is not None:
            reasons.append(r"precision='fp8' plans one GPU: natsim.distributed runs bfloat16 / float16 only")
    model = ranking_model(cost, path, training, precision) if cost != "h200" or stored_model(cost, path) else None
    if precision is None and kv_tiling is not None and model is not None and kv_tiling not in model.kv_tilings:
        reasons.append(rf"kv_tiling='{kv_tiling}' needs coefficients calibrated on that kernel")
    if world_size is not None:
        if world_size > shape[0]:
            reasons.append(rf"world_size cannot exceed the {shape[0]} frames of dimension 0")
    return reasons


def expected_ranking(cost: str, path: str, training: bool, precision=None) -> tuple[str, str, tuple[str, ...]]:
    """(gpu, basis, KV tiling modes the search may pick) of a combination that plans, on this machine (no GPU)."""
    gpu = {"none": None, "h100": H100, "h200": H200, "file": FILE_GPU}[cost]
    model = ranking_model(cost, path, training, precision)
    if precision == "fp8":
        return gpu, "simulated tiles" if model is None else "cost model", ("static",)
    if model is None:
        return gpu, "simulated tiles", ("static", "dynamic")
    return gpu, "cost model", tuple(model.kv_tilings)


def check_plan(plan, shape, target, path, *, training, world_size, cost, kv_tiling, head_dim, causal, dtype,
               precision=None):
    """Every field of `plan` that an option decides, and its tile counts against natsim's simulator."""
    assert isinstance(plan, ParallelPlan) == (world_size is not None)
    again = type(plan).from_json(plan.to_json())
    assert again == plan and again.to_dict() == plan.to_dict()
    single = plan.plan if world_size is not None else plan
    gpu, basis, modes = expected_ranking(cost, path, training, precision)
    assert single.precision == precision and single.kernel_arguments().get("precision") == precision
    if precision == "fp8":  # what the FP8 kernel runs, and the report says why the modes were narrowed
        assert single.tiles.kv_tokens >= 32 and all(c.kv_tiling == "static" for c in single.search.top)
        assert (single.search.kv_tilings, single.search.kv_tiling_fixed) == (("static",), "precision")
    assert (single.gpu, single.basis) == (gpu, basis)
    assert (single.training, single.head_dim, single.dtype, single.heads) == (training, head_dim, dtype, HEADS)
    assert single.problem.shape == shape and single.problem.causal == (causal,) * len(shape)
    assert single.tiles.kv_tiling == (kv_tiling or single.tiles.kv_tiling) and single.tiles.kv_tiling in modes
    assert single.kernel_arguments()["kv_tiling"] == single.tiles.kv_tiling
    if precision == "fp8":
        pass
    elif kv_tiling is not None:  # the report says the mode was asked for
        assert (single.search.kv_tilings, single.search.kv_tiling_fixed) == ((kv_tiling,), "kv_tiling")
    elif single.search.kv_tiling_fixed is not None:  # narrowed only for the halo strategy over several ranks
        assert world_size is not None and single.search.kv_tiling_fixed == "halo"
        assert single.search.kv_tilings == ("static",)
    else:
        assert single.search.kv_tilings == modes
    assert single.sparsity >= target and (single.backward_score is not None) == training
    sim = simulate(single.problem, single.tiles)
    assert (single.simulation.visited_tiles, single.simulation.full_tiles) == (sim.visited_tiles, sim.full_tiles)
    assert single.search.top[0].tile_speedup == pytest.approx(simulate(
        single.problem.__class__(shape, single.search.top[0].window, single.search.top[0].stride, causal=causal),
        single.tiles.__class__(single.search.top[0].q_tile, single.search.top[0].kv_tile,
                               kv_tiling=single.search.top[0].kv_tiling)).tile_speedup)
    if world_size is None:
        return
    assert plan.world_size == world_size and len(plan.split) == world_size and sum(plan.split) == shape[0]
    assert min(plan.split) >= 1 and plan.strategy in plan.costs
    if plan.strategy == "halo" or "halo" in plan.costs:
        assert single.tiles.kv_tiling == "static"  # the halo strategy's frame ranges run static KV tiling
    assert "ulysses" in plan.costs  # any heads: padded to a multiple of the ranks
    starts = [sum(plan.split[:r]) for r in range(world_size)]
    for name, cost_of in plan.costs.items():
        for rank, start in zip(cost_of.ranks, starts):
            frames = (start, start + plan.split[rank.rank])
            if name == "ulysses":
                want = sim.visited_tiles * -(-HEADS // world_size)
            elif training:  # the halo strategy trains on a rank's gathered frames as a layout of their own
                need = key_frames(single.problem, *frames)
                problem = single.problem
                assert problem.stride[0] == 1 and not problem.causal[0]
                gathered = problem.__class__((need[1] - need[0], *problem.shape[1:]), problem.window, problem.stride,
                                             problem.dilation, problem.causal)
                want = simulate(gathered, single.tiles).visited_tiles * HEADS
            else:
                need = key_frames(single.problem, *frames)
                want = rank_tiles(single.problem, single.tiles, frames, need).visited * HEADS
            assert rank.frames == frames and rank.visited_tiles == want


def run_case(shape, target, path, *, training, world_size, cost, kv_tiling, head_dim, causal, dtype, precision=None):
    """Plan one combination and check it, or check that it is refused for one of its reasons."""
    options = dict(heads=HEADS, head_dim=head_dim, dtype=dtype, causal=causal, training=training,
                   world_size=world_size, kv_tiling=kv_tiling, precision=precision, **cost_options(cost, path))
    reasons = refusals(shape, path, training=training, world_size=world_size, cost=cost, kv_tiling=kv_tiling,
                       head_dim=head_dim, dtype=dtype, precision=precision)
    if reasons:
        with pytest.raises(ValueError) as refused:
            best(shape, target, **options)
        message = str(refused.value)
        assert any(re.search(reason, message) for reason in reasons), (options, message)
        assert "\n" not in message and message.endswith("."), message
        return
    plan = best(shape, target, **options)
    check_plan(plan, shape, target, path, training=training, world_size=world_size, cost=cost, kv_tiling=kv_tiling,
               head_dim=head_dim, causal=causal, dtype=dtype, precision=precision)


@pytest.mark.parametrize("shape, target, power_of_two", SMALL,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
@pytest.mark.parametrize("cost", COSTS)
def test_every_combination_plans_or_is_refused_up_front(shape, target, power_of_two, cost, coefficients_file):
    """The world sizes run innermost, one after the other for each combination of the other options: a
    combination's single-GPU search is the same for every world size, and the planner keeps its 64 latest
    searches. With the world size as a parameter each search ran five times, a test's combinations needing more
    searches than the 64 kept."""
    for training, kv_tiling, head_dim, causal, dtype, precision, world_size in itertools.product(
            TRAINING, KV_TILINGS, (power_of_two, SPLIT_HEAD_DIM), CAUSAL, DTYPES, PRECISIONS, WORLD_SIZES):
        run_case(shape, target, coefficients_file, training=training, world_size=world_size, cost=cost,
                 kv_tiling=kv_tiling, head_dim=head_dim, causal=causal, dtype=dtype, precision=precision)


@pytest.mark.parametrize("shape, target, ranks", SEVERAL_RANKS, ids=["30x48x80-2", "21x45x80-4", "13x30x45-3"])
@pytest.mark.parametrize("cost", ["h100", "none"])
def test_the_layouts_that_failed_over_several_ranks_plan(shape, target, ranks, cost):
    """Inference only: a training search of a layout this size takes seconds (training over ranks is the small
    layouts' matrix above, and tests/test_distributed.py prices one at 30x48x80)."""
    for world_size, kv_tiling, causal in itertools.product((None, ranks), KV_TILINGS, CAUSAL):
        run_case(shape, target, "", training=False, world_size=world_size, cost=cost, kv_tiling=kv_tiling,
                 head_dim=128, causal=causal, dtype="bf16")


def test_over_several_ranks_a_dynamic_pick_is_compared_with_the_best_static_configuration():
    single = best((30, 48, 80), 0.9, heads=HEADS, device="h100")
    assert single.tiles.kv_tiling == "dynamic"  # the pick that could not be priced per rank
    parallel = best((30, 48, 80), 0.9, heads=HEADS, device="h100", world_size=2)
    static = best((30, 48, 80), 0.9, heads=HEADS, device="h100", kv_tiling="static")
    configuration = (parallel.plan.problem, parallel.plan.tiles)
    assert configuration in ((single.problem, single.tiles), (static.problem, static.tiles))
    assert parallel.notes[-1].startswith("The single-GPU pick tiles KV dynamically, which only ulysses runs")
    assert any(note.startswith("halo cannot run") for note in parallel.notes)
    text = " ".join(str(part) for part in parallel.explain().renderables[1:-1])
    assert "Over 2 ranks" in text and "halo cannot run" in text
    # one head over 2 ranks: ulysses pads it with a zero head, so each rank attends a whole head; the static plan
    # under halo splits the work instead, and wins
    one_head = best((30, 48, 80), 0.9, device="h100", world_size=2)
    static = best((30, 48, 80), 0.9, device="h100", kv_tiling="static")
    assert one_head.strategy == "halo" and (one_head.problem, one_head.tiles) == (static.problem, static.tiles)
    assert one_head.plan.search.kv_tiling_fixed == "halo" and static.search.kv_tiling_fixed == "kv_tiling"
    assert one_head.notes[0].startswith("ulysses pads heads=1 with 1 zero head")
    assert one_head.notes[-1].endswith("so the plan runs it.")


# -- the same through `natsim plan` -------------------------------------------------------------------------

app = typer.Typer()


@app.callback()
def _natsim() -> None:
    """natsim (test app)."""


plan_cli.register(app)


@pytest.mark.parametrize("cost", COSTS)
def test_natsim_plan_takes_every_option_as_best_does(cost, coefficients_file):
    """The world sizes innermost, as above: the command and `best` share the planner's kept searches."""
    shape, target = (4, 6, 8), 0.6
    for training, kv_tiling, head_dim, dtype, precision, world_size in itertools.product(
            TRAINING, KV_TILINGS, (64, 96), ("fp16", "fp32"), PRECISIONS, (None, 2, 3)):
        args = ["plan", "--shape", "4x6x8", "--sparsity", str(target), "--heads", str(HEADS), "--head-dim",
                str(head_dim), "--dtype", dtype, "--causal", "1x0x0", "--json"]
        args += {"none": [], "h100": ["--device", "h100"], "h200": ["--device", "h200"],
                 "file": ["--coefficients", coefficients_file]}[cost]
        args += ["--training"] if training else []
        args += [] if world_size is None else ["--world-size", str(world_size)]
        args += [] if kv_tiling is None else ["--kv-tiling", kv_tiling]
        args += [] if precision is None else ["--precision", precision]
        result = CliRunner().invoke(app, args)
        try:
            plan = best(shape, target, heads=HEADS, head_dim=head_dim, dtype=dtype, causal=(True, False, False),
                        training=training, world_size=world_size, kv_tiling=kv_tiling, precision=precision,
                        **cost_options(cost, coefficients_file))
        except ValueError as refused:
            assert result.exit_code == 2 and str(refused) in " ".join(result.stderr.split()), args
            continue
        assert result.exit_code == 0, (args, result.output)
        assert json.loads(result.stdout) == json.loads(json.dumps(plan.to_dict())), args
