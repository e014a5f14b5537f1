"""The dynamic-KV-tiling GNA kernel (kernels/gna_dynamic.py) on small problems, and how a call picks its mode.

Outputs against the float64 reference on both data paths (in place through descriptors, and permuted with
pointer gathers), the kernel's per-Q-tile counts against `natsim.simulate(..., kv_tiling="dynamic")`, its
mask switch against a brute-force walk of the boxes, and `kv_tiling` through the operator under
torch.compile. On this CPU machine the kernels run in Triton's interpreter (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import natsim
from natsim.kernels import gna_attention, gna_tile_counts, reference_attention
from natsim.kernels.gna import dispatch, launch
from natsim.kernels.gna.tiles import choose_tiles, relative_cost, tile_pairs
from natsim.window import group_length, window_bounds

from test_kernels import kernel_problems

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 5e-3  # float16
FAST = settings(max_examples=10, deadline=None)

EDGE_CASES = [
    # shape, window, stride, dilation, causal, q_tile, kv_tile
    ((40,), 8, 1, 1, False, (16,), (16,)),  # even window, 1-D in place
    ((37,), 7, 3, 2, True, (16,), (32,)),  # causal, dilation, padding
    ((9, 11), (4, 5), (2, 1), (2, 1), (False, True), (4, 4), (4, 8)),
    ((8, 12), (8, 4), (8, 4), 1, False, (4, 4), (4, 4)),  # stride = window
    ((5, 6, 7), (3, 4, 2), (1, 2, 2), (1, 1, 3), (True, False, False), (2, 4, 2), (4, 2, 2)),
    # box tiles straddle stored tiles (the dynamic kernel visits 72 tiles where the static one visits 90), even
    # windows, padding of Q and KV tiles (a 4x5x7 layout: 6x7x9 took six times as long in the interpreter)
    ((4, 5, 7), (2, 4, 5), 1, 1, False, (2, 2, 4), (2, 4, 2)),
    ((4, 5, 6), (4, 5, 6), 1, 1, False, (2, 2, 4), (2, 4, 2)),  # dense
]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _counts_equal_simulator(problem: natsim.Problem, q_tile, kv_tile) -> None:
    visited, full = gna_tile_counts(problem.shape, problem.window, problem.stride, problem.dilation,
                                    problem.causal, q_tile, kv_tile, device=DEVICE, kv_tiling="dynamic")
    sim = natsim.simulate(problem, natsim.TileConfig(q_tile, kv_tile, kv_tiling="dynamic"), per_q_tile=True)
    np.testing.assert_array_equal(visited, sim.per_q_tile_visited)
    np.testing.assert_array_equal(full, sim.per_q_tile_full)


@settings(max_examples=6, deadline=None)  # fewer than FAST: the edge cases below are counted every time too
@given(kernel_problems())
def test_dynamic_tile_counts_equal_simulator(case):
    _counts_equal_simulator(*case)


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_dynamic_tile_counts_equal_simulator_on_edge_cases(case):
    shape, window, stride, dilation, causal, q_tile, kv_tile = case
    _counts_equal_simulator(natsim.Problem(shape, window, stride, dilation, causal), q_tile, kv_tile)


def test_dynamic_mode_visits_fewer_tiles_where_the_simulator_says_so():
    """A case where dynamic tiling pays (boxes straddle the static grid): the kernel's own totals differ."""
    problem, tile = natsim.Problem((24,), 5), (16,)
    static, _ = gna_tile_counts((24,), 5, q_tile=tile, kv_tile=tile, device=DEVICE, kv_tiling="static")
    dynamic, _ = gna_tile_counts((24,), 5, q_tile=tile, kv_tile=tile, device=DEVICE, kv_tiling="dynamic")
    assert dynamic.sum() < static.sum()
    assert dynamic.sum() == natsim.simulate(problem, natsim.TileConfig(tile, tile, kv_tiling="dynamic")).visited_tiles


def _dilated(case) -> bool:
    dilation = case[3]
    return any(d > 1 for d in (dilation if isinstance(dilation, tuple) else (dilation,)))


# Each case on the in-place path where possible (descriptor loads at box corners) and on the forced permuted path
# (pointer gathers of box tiles). A dilated case permutes its tokens on either (takes_layout_path), so
# it runs once, as "gathered": its "in-place" run computed the very same thing again.
OUTPUT_CASES = [pytest.param(case, path, id=f"{path}-" + "x".join(map(str, case[0])))
                for case in EDGE_CASES for path in ("in-place", "gathered") if path == "gathered" or not _dilated(case)]


def _check_output(problem: natsim.Problem, q_tile, kv_tile, seed: int, return_lse: bool = False,
                  heads: int = 2) -> None:
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, *problem.shape, heads, 32, device=DEVICE).half() for _ in range(3))
    args = (problem.window, problem.stride, problem.dilation, problem.causal)
    result = gna_attention(q, k, v, *args, q_tile=q_tile, kv_tile=kv_tile, return_lse=return_lse,
                           kv_tiling="dynamic")
    ref = reference_attention(q.double(), k.double(), v.double(), *args, return_lse=return_lse)
    if return_lse:
        (result, lse), (ref, ref_lse) = result, ref
        assert torch.allclose(lse.double(), ref_lse, atol=1e-2)
    assert torch.isfinite(result).all()
    assert rel_error(result, ref) < TOLERANCE


@pytest.mark.parametrize("case, path", OUTPUT_CASES)
def test_dynamic_output_and_lse_match_float64_reference(case, path, monkeypatch):
    shape, window, stride, dilation, causal, q_tile, kv_tile = case
    if path == "gathered":
        monkeypatch.setattr(dispatch, "takes_layout_path", lambda *args, **options: False)
    _check_output(natsim.Problem(shape, window, stride, dilation, causal), q_tile, kv_tile, 0, return_lse=True)


@settings(max_examples=6, deadline=None)  # not 8: EDGE_CASES above run the edges on both data paths every time
@given(kernel_problems(), st.integers(0, 2**16), st.booleans())
def test_dynamic_output_matches_reference_on_random_problems(case, seed, gathered):
    """One head (the interpreter's time grows with heads): every edge case above runs two."""
    problem, q_tile, kv_tile = case
    with pytest.MonkeyPatch.context() as patch:
        if gathered:
            patch.setattr(dispatch, "takes_layout_path", lambda *args, **options: False)
        _check_output(problem, q_tile, kv_tile, seed, heads=1)


def _box_needs_mask(problem: natsim.Problem, q_tile, kv_tile) -> bool:
    """Brute force: some box tile of some Q tile is not attended completely, or reaches past its group."""
    for L, w, s, d, c, tq, tk in zip(problem.shape, problem.window, problem.stride, problem.dilation,
                                     problem.causal, q_tile, kv_tile):
        for g in range(d):
            length = group_length(L, d, g)
            for first in range(0, length, tq):
                queries = range(first, min(first + tq, length))
                bounds = [window_bounds(x, length, w, s, c) for x in queries]
                origin, end = bounds[0][0], bounds[-1][1]
                for key in range(origin, end, tk):
                    if key + tk > length or any(not (lo <= key and key + tk <= hi) for lo, hi in bounds):
                        return True
    return False


@FAST
@given(kernel_problems())
def test_needs_mask_for_dynamic_tiles_equals_brute_force(case):
    problem, q_tile, kv_tile = case
    assert launch.needs_mask(problem, q_tile, kv_tile, "dynamic") == _box_needs_mask(problem, q_tile, kv_tile)


def test_unmasked_dynamic_kernel_runs_block_sparse_boxes():
    """Stride = window with tiles dividing it: every box tile full, so the kernel compiles no mask code."""
    problem, tile = natsim.Problem((8, 16), (4, 8), (4, 8)), (4, 8)
    assert not launch.needs_mask(problem, tile, tile, "dynamic")
    _check_output(problem, tile, tile, 3)


# ---------------------------------------------------------------------------------------------------------
# Choosing the mode


def test_choose_tiles_takes_the_least_predicted_work_over_both_modes():
    problem = natsim.Problem((30, 48, 80), (18, 24, 24))
    q_tile, kv_tile, mode = choose_tiles(problem, 128, ("static", "dynamic"))
    best = min(relative_cost(problem, q, kv, 128, m) for q, kv in tile_pairs(problem.shape, 128)
               for m in ("static", "dynamic"))
    assert relative_cost(problem, q_tile, kv_tile, 128, mode) == best
    assert mode == "dynamic"  # the simulator: fewer visited tiles at stride 1x1x1 for the winning shapes
    assert choose_tiles(problem, 128, ("static",))[2] == "static"


def test_natsim_chooses_static_on_the_gathered_path(monkeypatch):
    """Unasked, the permuted path (dilation) runs static tiles: the gather's cost is not calibrated."""
    chosen = []
    monkeypatch.setattr(dispatch, "_calls", {})
    make_call = dispatch.make_call
    monkeypatch.setattr(dispatch, "make_call",
                        lambda problem, shape, spec, **kw: chosen.append(spec.kv_tiling)
                        or make_call(problem, shape, spec, **kw))
    q, k, v = (torch.randn(1, 12, 10, 1, 32, device=DEVICE).half() for _ in range(3))
    gna_attention(q, k, v, (3, 4), dilation=(2, 1), q_tile=(4, 4))
    gna_attention(q, k, v, (3, 4), q_tile=(4, 4), kv_tiling="dynamic")
    assert chosen == ["static", "dynamic"]


@pytest.mark.parametrize("value", ["grid", 1, "Dynamic"])
def test_bad_kv_tiling_raises_a_sentence(value):
    q, k, v = (torch.randn(1, 8, 8, 1, 32, device=DEVICE).half() for _ in range(3))
    with pytest.raises(ValueError, match=r"kv_tiling must be one of .* got kv_tiling="):
        gna_attention(q, k, v, 3, kv_tiling=value)


def test_compiled_fullgraph_with_kv_tiling_equals_eager():
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 3, 4, 4, 2, 32, device=DEVICE).half() for _ in range(3))  # 3 runs: a small layout

    def model(q, k, v):
        return gna_attention(q * 2.0, k, v, (3, 4, 2), (1, 2, 2), q_tile=(2, 2, 4), kv_tiling="dynamic") + 1.0

    explanation = torch._dynamo.explain(model)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # Inductor: tests/test_ops.py
    assert torch.equal(compiled(q, k, v), model(q, k, v))


# ---------------------------------------------------------------------------------------------------------
# On a CUDA GPU at real sizes: `pytest -m gpu tests/test_gna_dynamic.py`

REAL = [
    # shape, window, stride, dilation, causal, q_tile, kv_tile, head_dim, dtype
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), 1, False, (2, 8, 4), (2, 8, 4), 128, torch.bfloat16),
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), 1, False, (2, 8, 8), (2, 8, 8), 128, torch.bfloat16),
    ((30, 48, 80), (18, 24, 24), (1, 8, 8), 1, False, (2, 8, 8), (2, 8, 8), 128, torch.bfloat16),
    ((256, 256), (80, 80), (1, 1), 1, False, (16, 8), (16, 8), 128, torch.bfloat16),
    ((16, 44, 80), (16, 24, 16), (1, 1, 1), 1, False, (2, 4, 16), (2, 4, 16), 128, torch.bfloat16),
    ((13, 21, 35), (5, 8, 7), (2, 3, 1), (2, 1, 3), (True, False, False), (2, 4, 16), (2, 4, 8), 64, torch.float16),
    ((5000,), 301, 7, 4, True, (64,), (64,), 64, torch.bfloat16),
]
GPU_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 1e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("gathered", [False, True], ids=["in-place", "gathered"])
@pytest.mark.parametrize("case", REAL, ids=lambda c: "x".join(map(str, c[0])) + "-s" + "x".join(
    map(str, c[2] if isinstance(c[2], tuple) else (c[2],))))
def test_gpu_dynamic_output_matches_float64_reference(case, gathered, monkeypatch):
    shape, window, stride, dilation, causal, q_tile, kv_tile, head_dim, dtype = case
    if gathered:
        monkeypatch.setattr(dispatch, "takes_layout_path", lambda *args, **options: False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, *shape, 2, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q, k, v, *args, q_tile=q_tile, kv_tile=kv_tile, return_lse=True, kv_tiling="dynamic")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args, return_lse=True)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < GPU_TOLERANCE[dtype]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2
    fast = gna_attention(q, k, v, *args, q_tile=q_tile, kv_tile=kv_tile, kv_tiling="dynamic")  # no LSE: other launch
    assert rel_error(fast, ref) < GPU_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("case", REAL, ids=lambda c: "x".join(map(str, c[0])))
def test_gpu_dynamic_tile_counts_equal_simulator(case):
    shape, window, stride, dilation, causal, q_tile, kv_tile = case[:7]
    _counts_equal_simulator(natsim.Problem(shape, window, stride, dilation, causal), q_tile, kv_tile)
