"""The interconnect model (natsim.partition.Link): its fit from measured moves, how strategies are priced with
it, and how a measured link reaches the planner (`best(..., world_size=P)` reads the file `natsim
calibrate-link` writes). calibrate_link itself runs in the gloo world of tests/test_diffusers_parallel.py."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim import Problem, TileConfig
from natsim.distributed.calibrate import fit_rate
from natsim.partition import (DEFAULT_LINK, Link, Rate, pipeline_seconds, strategy_cost, ulysses_layer_bytes,
                              ulysses_step_seconds)


@settings(max_examples=30, deadline=None)
@given(rate=st.floats(1e8, 1e12), latency=st.floats(0, 1e-3), sizes=st.lists(st.integers(1, 2**30), min_size=2,
                                                                              max_size=5, unique=True))
def test_the_fit_recovers_a_line_it_was_given(rate, latency, sizes):
    fitted = fit_rate([(b, latency + b / rate) for b in sizes])
    assert fitted.bytes_per_second == pytest.approx(rate, rel=1e-6)
    assert fitted.latency_seconds == pytest.approx(latency, rel=1e-6, abs=1e-12)


def test_the_fit_keeps_latency_non_negative_and_refuses_flat_times():
    fitted = fit_rate([(100, 0.5e-6), (200, 2.5e-6)])  # a line with a negative intercept: through the origin
    assert fitted.latency_seconds == 0 and fitted.bytes_per_second == pytest.approx((100**2 + 200**2) / 550e-6)
    with pytest.raises(ValueError, match="do not grow"):
        fit_rate([(100, 2e-6), (200, 1e-6)])
    assert fit_rate([(1000, 1e-6)]).bytes_per_second == pytest.approx(1e9)  # one size: a rate through the origin


def test_strategies_are_priced_at_their_moves_rate():
    """The halo exchange: its larger direction at the point-to-point rate, then the kernel. Ulysses (one group of
    heads): q, k and v in (rank 0 sends 3 x 16 half-frames, rank 1 receives as many), the kernel, the output
    back (8 frames' worth the larger way on both ranks), each move at the all-to-all rate."""
    problem, tiles = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8)), TileConfig((4, 8, 8), (2, 8, 8))
    link = Link(Rate(1e11, 1e-4), Rate(2e11, 3e-5), "by hand")
    options = dict(batch=1, heads=24, head_dim=128, element_bytes=2, tile_seconds=1e-6)
    priced = strategy_cost(problem, tiles, (16, 14), "halo", link=link, **options)
    for r in priced.ranks:
        moved = max(r.bytes_sent, r.bytes_received)
        wire = link.point_to_point.seconds(moved)
        assert r.seconds == pytest.approx(r.visited_tiles * 1e-6 + wire, rel=1e-12)
    frame = 48 * 80 * 24 * 128 * 2
    priced = strategy_cost(problem, tiles, (16, 14), "ulysses", link=link, chunks=1, **options)
    for r in priced.ranks:
        wire = link.all_to_all.seconds(24 * frame) + link.all_to_all.seconds(8 * frame)
        assert r.seconds == pytest.approx(r.visited_tiles * 1e-6 + wire, rel=1e-12)
    assert Link.from_dict(json.loads(json.dumps(link.to_dict()))) == link
    assert Rate(1e9, 1.0).seconds(0) == 0  # nothing to move, no latency
    with pytest.raises(ValueError, match="bytes_per_second > 0"):
        Rate(0.0)


def test_the_pipeline_by_hand():
    """Three groups, 1 s a group's transfer each way, 2 s its attention: arrivals at 1, 2, 3 s; attention 1-3,
    3-5, 5-7; returns (after the arrivals on the link) 3-4, 5-6, 7-8: 8 s against 12 in one piece. With little
    attention the link bounds it: the six transfers, 6 s. Groups of 1, 2 and 1 heads with 12 s of attention:
    arrivals at 0.75, 2.25, 3; attention 0.75-3.75, 3.75-9.75, 9.75-12.75; returns 3.75-4.5, 9.75-11.25,
    12.75-13.5: 13.5 s against 14 in three equal groups. Ulysses priced with groups is never slower than
    without, and training adds the mirrored pipeline."""
    rate = Rate(1.0)
    assert pipeline_seconds(6.0, rate, 3, 3, groups=3) == pytest.approx(8.0)
    assert pipeline_seconds(6.0, rate, 3, 3, groups=(2, 2, 2)) == pytest.approx(8.0)
    assert pipeline_seconds(6.0, rate, 3, 3, groups=1) == pytest.approx(12.0)
    assert pipeline_seconds(0.3, rate, 3, 3, groups=3) == pytest.approx(6.0)
    assert pipeline_seconds(12.0, rate, 3, 3, groups=(1, 2, 1)) == pytest.approx(13.5)
    assert pipeline_seconds(12.0, rate, 3, 3, groups=3) == pytest.approx(14.0)
    for groups in (0, (), (1, 0)):
        with pytest.raises(ValueError, match="groups must be a number >= 1 or head counts >= 1"):
            pipeline_seconds(1.0, rate, 1, 1, groups=groups)
    problem, tiles = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8)), TileConfig((4, 8, 8), (2, 8, 8))
    options = dict(batch=1, heads=24, head_dim=128, element_bytes=2, link=Link(Rate(1e11, 1e-5), Rate(1e11)))
    serial, grouped = (strategy_cost(problem, tiles, (15, 15), "ulysses", chunks=c, **options).seconds for c in (1, 3))
    assert grouped < serial
    trained = strategy_cost(problem, tiles, (15, 15), "ulysses", chunks=3, training=True, **options)
    assert trained.ranks[0].backward_bytes_sent == trained.ranks[0].bytes_received


def test_best_prices_bytes_with_the_link_measured_here(monkeypatch, tmp_path):
    from natsim.planner import best
    from natsim.planner.cost.files import link_file_name

    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    arguments = dict(heads=24, window=(18, 24, 24), device="h100", world_size=2)
    default = best((30, 48, 80), 0.9, **arguments)
    assert default.link == DEFAULT_LINK and "(default)" in default.link.describe()
    slow = Link(Rate(1e9, 1e-3), Rate(2e9, 1e-3), "2 x NVIDIA H100 80GB HBM3, natsim calibrate-link")
    (tmp_path / "coefficients").mkdir()
    (tmp_path / "coefficients" / link_file_name("NVIDIA H100 80GB HBM3", 2)).write_text(json.dumps(slow.to_dict()))
    measured = best((30, 48, 80), 0.9, **arguments)
    assert measured.link == slow and measured.to_dict()["link"] == slow.to_dict()
    assert measured.seconds > default.seconds  # a link 150x slower costs more
    chosen = measured.costs[measured.strategy]
    assert all(chosen.seconds <= other.seconds for other in measured.costs.values())


def test_the_command_outside_torchrun_says_how_to_launch_it(monkeypatch):
    from typer.testing import CliRunner

    from natsim.cli.main import app

    monkeypatch.delenv("RANK", raising=False)
    result = CliRunner().invoke(app, ["calibrate-link"])
    assert result.exit_code != 0 and "launch it under torchrun" in result.output


def test_a_models_step_under_ulysses_by_hand():
    """Wan 1.3B at 720p on 4 GPUs: each rank holds 18,900 of 75,600 tokens x 1,536 bf16 values per tensor and sends
    three quarters of q, k and v in one all-to-all and of the output in another; the step is a quarter of one
    GPU's plus 30 layers of those two moves."""
    share = 18900 * 1536 * 2
    assert ulysses_layer_bytes(75600, 1536, 2, 4) == (3 * share * 3 // 4, share * 3 // 4)
    assert ulysses_layer_bytes(75601, 1536, 2, 4)[1] == 18901 * 1536 * 2 * 3 // 4  # the largest share
    assert ulysses_layer_bytes(75600, 1536, 2, 1) == (0, 0)
    link = Link(Rate(2.5e11, 2e-4), Rate(4e11), "by hand")
    layer = 2 * 2e-4 + (3 * share * 3 // 4 + share * 3 // 4) / 2.5e11
    assert ulysses_step_seconds(0.6, 30, 75600, 1536, 2, 4, link) == pytest.approx(0.15 + 30 * layer, rel=1e-12)
    assert ulysses_step_seconds(0.6, 30, 75600, 1536, 2, 1, link) == 0.6
    # Heads in three groups, 10 ms of attention a layer on one GPU (2.5 ms a rank, 0.83 ms a group, longer than
    # a group's transfers): only the first group's arrival and the last group's return are exposed.
    inbound, outbound = (2e-4 + b / 3 / 2.5e11 for b in ulysses_layer_bytes(75600, 1536, 2, 4))
    grouped = ulysses_step_seconds(0.6, 30, 75600, 1536, 2, 4, link, attention_seconds=0.01, groups=3)
    assert grouped == pytest.approx(0.15 + 30 * (inbound + outbound), rel=1e-9)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ulysses_step_seconds(0.6, 30, 75600, 1536, 2, 0, link)
    # 12 heads over 8 GPUs: padded to 16, 2 a rank (a sixth of the attention, not an eighth), and the moves carry
    # 16 heads' channels; outside attention an eighth of the step
    padded = ulysses_step_seconds(0.6, 30, 75600, 1536, 2, 8, link, attention_seconds=0.01, groups=2, heads=12)
    inbound, outbound = ulysses_layer_bytes(75600, 16 * 128, 2, 8)
    layer = pipeline_seconds(0.01 / 6, link.all_to_all, inbound, outbound, 2)
    assert padded == pytest.approx((0.6 - 30 * 0.01) / 8 + 30 * layer, rel=1e-12)
    assert ulysses_step_seconds(0.6, 30, 75600, 1536, 2, 4, link, 0.01, 3, heads=12) == grouped  # 4 divides 12


def test_auto_in_natsim_distributed_prices_bytes_with_the_link_given():
    """A 7-frame window over 30 frames split 20 / 10: the halo exchange moves a few frames where Ulysses moves
    every token, but leaves its first rank two thirds of the work. Over a slow link the bytes decide (halo),
    over a fast one the work does (Ulysses)."""
    from natsim.distributed import choose
    from natsim.distributed.gna import StrategyTiles

    problem, tiles = Problem((30, 48, 80), (7, 24, 24), (1, 8, 8)), TileConfig((4, 8, 8), (2, 8, 8))
    arguments = (problem, StrategyTiles(tiles, tiles), (20, 10), 1, 24, 128, 2, False)
    assert choose(*arguments, link=Link.uniform(1e9)) == "halo"
    assert choose(*arguments, link=Link.uniform(1e15)) == "ulysses"


def test_auto_without_a_link_prices_with_the_link_measured_for_the_gpus_at_hand(tmp_path, monkeypatch):
    """`gna_attention(..., strategy="auto")` without `link=`: the file `natsim calibrate-link` wrote for this GPU
    kind and world size (the user's first, natsim's shipped ones next), else the default rate. The case of the test
    above, whose pick the link decides, through "auto"'s own lookup (`gpu_index` stands for the tensors' GPU)."""
    import torch

    from natsim.distributed import gna
    from natsim.stored import LINKS_DIR, link_file_name, link_for

    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"Test GPU {index}")
    problem = Problem((30, 48, 80), (7, 24, 24), (1, 8, 8))
    parameters = (problem.window, problem.stride, problem.dilation, problem.causal)

    def auto(gpu_index: int) -> str:
        return gna._auto(problem.shape, parameters, ((4, 8, 8), (2, 8, 8), "static"), (20, 10), (1, 24, 128, 2), False,
                         ("halo", "ulysses"), None, None, gpu_index)

    assert link_for("Test GPU 0", 2) == link_for(None, 2) == DEFAULT_LINK and auto(0) == auto(-1)
    for rate, pick in ((1e9, "halo"), (1e15, "ulysses")):
        folder = tmp_path / "coefficients"
        folder.mkdir(exist_ok=True)
        (folder / link_file_name("Test GPU 0", 2)).write_text(json.dumps(Link.uniform(rate).to_dict()))
        assert auto(0) == pick and link_for("Test GPU 0", 2).all_to_all.bytes_per_second == rate
    assert auto(1) == auto(-1)  # another GPU kind: no file, the default rate
    shipped = link_for("NVIDIA H200", 4)
    assert shipped == Link.from_dict(json.loads((LINKS_DIR / link_file_name("NVIDIA H200", 4)).read_text()))
    assert shipped != DEFAULT_LINK


def test_the_cpus_link_is_read_where_no_gpu_is(tmp_path, monkeypatch):
    """`natsim calibrate-link` under gloo writes the CPUs' link (`link-cpu-x2.json`): the planner without a GPU and
    "auto" on CPU tensors price with it."""
    from natsim.distributed import gna
    from natsim.planner import best
    from natsim.stored import link_file_name

    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    (tmp_path / "coefficients").mkdir()
    cpus = Link(Rate(3e9, 1e-4), Rate(2e9, 2e-4), "2 x cpu, natsim calibrate-link")
    (tmp_path / "coefficients" / link_file_name("cpu", 2)).write_text(json.dumps(cpus.to_dict()))
    plan = best((8, 16, 16), 0.75, heads=4, world_size=2, device="cpu")
    assert plan.link == cpus
    problem = Problem((30, 48, 80), (7, 24, 24), (1, 8, 8))
    parameters = (problem.window, problem.stride, problem.dilation, problem.causal)
    monkeypatch.setattr(gna, "choose", lambda *arguments: next(a for a in arguments if isinstance(a, Link)))
    assert gna._auto(problem.shape, parameters, ((4, 8, 8), (2, 8, 8), "static"), (20, 10), (1, 24, 128, 2), False,
                     ("halo", "ulysses"), None, None, -1) == cpus


def test_files_that_are_not_objects_are_passed_over_or_refused_with_a_sentence(tmp_path, monkeypatch):
    """In the user's folder a JSON file that is not an object is no cost model (passed over: planning goes on) and
    no link (the plan over ranks that would price with it says which file and why)."""
    from natsim.planner import best
    from natsim.stored import link_file_name

    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path))
    (tmp_path / "coefficients").mkdir()
    (tmp_path / "coefficients" / link_file_name("NVIDIA H100 80GB HBM3", 2)).write_text("[1, 2]")
    assert best((4, 6, 8), 0.5, device="h100").calibrated
    with pytest.raises(ValueError, match="is not a readable interconnect calibration: a link must be a JSON object"):
        best((4, 6, 8), 0.5, device="h100", world_size=2)
    for rates in ((1e9, math.inf), (True, 0.0), (math.nan, 0.0)):
        with pytest.raises(ValueError, match="a Rate needs finite numbers"):
            Rate(*rates)
