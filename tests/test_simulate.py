"""simulate() against the brute-force reference of tests/bruteforce.py (written from gna-semantics.md)."""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bruteforce as bf  # noqa: E402

from natsim import Problem, SimResult, TileConfig, simulate  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FLOAT_FIGURES = ("sparsity", "flop_speedup", "tile_speedup", "tile_speedup_mean")
INT_FIGURES = ("visited_tiles", "full_tiles", "max_kv_tiles", "dense_tiles")


def assert_matches(problem: Problem, tiles: TileConfig) -> bf.Reference:
    """Every figure and the per-Q-tile counts of simulate() equal the brute force, exactly."""
    ref = bf.reference(problem, tiles.q_tile, tiles.kv_tile, tiles.tiling, tiles.kv_tiling)
    res = simulate(problem, tiles, per_q_tile=True)
    where = f"{problem!r}, {tiles!r}"
    for name in INT_FIGURES:
        got, want = getattr(res, name), getattr(ref, name)
        assert got == want, f"{name}: got {got}, brute force {want} for {where}"
    for name in FLOAT_FIGURES:
        got, want = getattr(res, name), getattr(ref, name)
        assert math.isclose(got, float(want), rel_tol=1e-12, abs_tol=1e-12), (
            f"{name}: got {got!r}, brute force {want} = {float(want)!r} for {where}"
        )
    assert bool(res.block_sparse) == ref.block_sparse, f"block_sparse for {where}"
    assert isinstance(res.block_sparse, (bool, np.bool_))
    assert res.attended_pairs == ref.attended_pairs, where
    assert res.num_q_tiles == ref.num_q_tiles and res.num_kv_tiles == ref.num_kv_tiles, where
    got_v = np.asarray(res.per_q_tile_visited)
    got_f = np.asarray(res.per_q_tile_full)
    assert got_v.shape == ref.per_q_tile_visited.shape, (
        f"per_q_tile_visited has {got_v.shape}, brute force {ref.per_q_tile_visited.shape} for {where}"
    )
    assert np.array_equal(got_v, ref.per_q_tile_visited), (
        f"per_q_tile_visited: got {got_v.tolist()}, brute force {ref.per_q_tile_visited.tolist()} for {where}"
    )
    assert np.array_equal(got_f, ref.per_q_tile_full), (
        f"per_q_tile_full: got {got_f.tolist()}, brute force {ref.per_q_tile_full.tolist()} for {where}"
    )
    # without per_q_tile the figures are the same
    plain = simulate(problem, tiles)
    for name in INT_FIGURES + FLOAT_FIGURES + ("block_sparse",):
        assert getattr(plain, name) == getattr(res, name), name
    return ref


# ----------------------------------------------------------------------------------------------------------
# Property tests

# 150 random problems a run, not 400: the strategies draw the special sizes, windows, strides and tiles most of the
# time, and EDGE_CASES below run the named edge cases in all three tilings every time.


@settings(max_examples=60, **SETTINGS)
@given(st.data())
def test_multi_d_static_matches_bruteforce(data):
    problem = data.draw(bf.problems())
    tiles = data.draw(bf.multi_tiles(problem, "static"))
    assert_matches(problem, tiles)


@settings(max_examples=60, **SETTINGS)
@given(st.data())
def test_multi_d_dynamic_matches_bruteforce(data):
    problem = data.draw(bf.problems())
    tiles = data.draw(bf.multi_tiles(problem, "dynamic"))
    assert_matches(problem, tiles)


@settings(max_examples=75, **SETTINGS)
@given(st.data())
def test_1d_tiling_matches_bruteforce(data):
    problem = data.draw(bf.problems())
    tiles = data.draw(bf.one_d_tiles(problem))
    assert_matches(problem, tiles)


@settings(max_examples=75, **SETTINGS)
@given(st.data())
def test_bruteforce_agrees_with_section2_formulas(data):
    """Self-check of the reference: its mask scan equals the closed forms of gna-semantics.md section 2."""
    problem = data.draw(bf.problems(max_tokens=300))
    tiles = data.draw(bf.multi_tiles(problem))
    ref = bf.reference(problem, tiles.q_tile, tiles.kv_tile, "multi", tiles.kv_tiling)
    formula = bf.formula_counts(problem, tiles.q_tile, tiles.kv_tile, tiles.kv_tiling)
    assert np.array_equal(ref.per_q_tile_visited, formula)


@settings(max_examples=60, **SETTINGS)
@given(st.data())
def test_bruteforce_window_properties(data):
    """Self-check of the reference's window: w keys non-causal, causal ends at the query, monotone."""
    L = data.draw(st.integers(1, 60))
    w = data.draw(st.integers(1, L))
    s = data.draw(st.integers(1, w))
    causal = data.draw(st.booleans())
    windows = [bf.window_1d(i, L, w, s, causal) for i in range(L)]
    for i, (start, end) in enumerate(windows):
        assert 0 <= start < end <= L
        if causal:
            assert end == i + 1 and start <= i
        else:
            assert end - start == w
    for (a0, b0), (a1, b1) in zip(windows, windows[1:]):
        assert a0 <= a1 and b0 <= b1 and a1 <= b0  # monotone, and consecutive windows overlap or touch


# ----------------------------------------------------------------------------------------------------------
# Named edge cases (always run, whatever hypothesis draws)

EDGE_CASES = [
    # (shape, window, stride, dilation, causal, q_tile, kv_tile)
    ((10,), 10, 1, 1, False, 4, 4),  # window = length: full self attention
    ((10,), 10, 10, 1, True, 3, 4),  # window = length, causal
    ((12,), 4, 4, 1, False, 4, 4),  # stride = window: blocked attention, aligned tiles
    ((12,), 4, 4, 1, False, 3, 5),  # stride = window, uneven tiles
    ((13,), 8, 1, 1, False, 4, 2),  # even window
    ((13,), 6, 3, 2, False, 2, 3),  # dilation with uneven groups
    ((5,), 2, 1, 2, True, 8, 16),  # tiles larger than the dimension
    ((7, 9), (3, 4), (3, 2), (2, 1), (False, True), (2, 4), (3, 2)),
    ((8, 8), 8, 8, 1, False, 8, 8),  # one tile, full attention
    ((6, 10), (2, 5), (2, 5), (3, 2), (True, False), (1, 3), (2, 2)),
    ((4, 5, 6), (2, 3, 4), (1, 3, 2), (2, 1, 1), (False, True, False), (2, 2, 3), (3, 4, 2)),
    ((8, 8, 8), (4, 4, 4), (4, 4, 4), 1, False, (4, 4, 4), (4, 4, 4)),  # block-sparse
    ((8, 8, 8), (8, 3, 2), (1, 3, 2), (1, 2, 4), (True, False, True), (16, 3, 1), (5, 1, 2)),
    ((1,), 1, 1, 1, False, 1, 1),
    ((1, 1, 1), 1, 1, 1, True, 2, 3),
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: "-".join(map(str, c[:2])))
@pytest.mark.parametrize("mode", [("multi", "static"), ("multi", "dynamic"), ("1d", "static")])
def test_edge_cases(case, mode):
    shape, window, stride, dilation, causal, q_tile, kv_tile = case
    problem = Problem(shape, window, stride, dilation, causal)
    tiling, kv_tiling = mode
    if tiling == "1d":
        q_tile, kv_tile = math.prod(np.atleast_1d(q_tile)), math.prod(np.atleast_1d(kv_tile))
    assert_matches(problem, TileConfig(q_tile, kv_tile, tiling=tiling, kv_tiling=kv_tiling))


def test_full_attention_is_dense():
    problem = Problem((6, 10), window=(6, 10))
    res = simulate(problem, TileConfig((2, 4), (3, 4)))
    assert res.sparsity == 0 and res.flop_speedup == 1
    assert res.visited_tiles == res.dense_tiles and res.tile_speedup == 1 and res.tile_speedup_mean == 1
    assert res.block_sparse


def test_per_q_tile_numbering_groups_first():
    """Dilation groups first, then tiles row-major: checked on a case where the orders differ."""
    problem = Problem((8, 6), window=(2, 3), stride=(1, 1), dilation=(2, 1), causal=(True, False))
    tiles = TileConfig((2, 2), (2, 2))
    ref = assert_matches(problem, tiles)
    # group (0, 0) tiles come before group (1, 0) tiles: 2 x 3 tiles per group
    assert len(ref.per_q_tile_visited) == 2 * (2 * 3)


def test_per_q_tile_only_on_request():
    res = simulate(Problem(16, 4), TileConfig(4, 4))
    assert res.per_q_tile_visited is None and res.per_q_tile_full is None


def test_scalar_tiles_broadcast():
    problem = Problem((6, 7, 8), window=(3, 3, 5), stride=(1, 3, 2), dilation=(2, 1, 1))
    a = simulate(problem, TileConfig(4, 2), per_q_tile=True)
    b = simulate(problem, TileConfig((4, 4, 4), (2, 2, 2)), per_q_tile=True)
    for name in INT_FIGURES + FLOAT_FIGURES + ("block_sparse",):
        assert getattr(a, name) == getattr(b, name)
    assert np.array_equal(a.per_q_tile_visited, b.per_q_tile_visited)


def test_tile_dimension_mismatch_raises():
    with pytest.raises(ValueError, match="q_tile"):
        simulate(Problem((8, 8, 8), 3), TileConfig((2, 2), (2, 2)))


def test_simulate_type_checks():
    with pytest.raises(TypeError, match="problem"):
        simulate((8, 8), TileConfig(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tiles"):
        simulate(Problem(8, 2), (2, 2))  # type: ignore[arg-type]


def test_result_is_a_simresult():
    assert isinstance(simulate(Problem(8, 2), TileConfig(2, 2)), SimResult)


# ----------------------------------------------------------------------------------------------------------
# Known answers: gna-semantics.md section 4 (GNA paper, Figure 4)

KNOWN = {
    (1, 1, 1): 3.3,
    (2, 1, 1): 3.6,
    (1, 1, 8): 5.5,
    (2, 1, 8): 6.0,
    (1, 8, 8): 9.1,
    (2, 8, 8): 10.0,
    (16, 8, 8): 11.1,
}


@pytest.mark.parametrize("stride", list(KNOWN), ids=lambda s: "x".join(map(str, s)))
def test_known_answers(stride):
    problem = Problem((30, 48, 80), window=(18, 24, 24), stride=stride)
    res = simulate(problem, TileConfig((4, 8, 8), (2, 8, 8), tiling="multi", kv_tiling="static"))
    assert round(res.tile_speedup, 1) == KNOWN[stride]
    assert round(res.flop_speedup, 1) == 11.1
    # FLOP-wise: each query sees exactly 18 * 24 * 24 keys, so the speedup is exact
    assert math.isclose(res.flop_speedup, (30 * 48 * 80) / (18 * 24 * 24), rel_tol=1e-12)
    assert res.dense_tiles == (30 // 4 + 1) * (48 // 8) * (80 // 8) * (30 // 2) * (48 // 8) * (80 // 8)
    if stride == (16, 8, 8):
        assert res.block_sparse
        assert res.full_tiles == res.visited_tiles


def test_known_answers_are_ordered():
    """Larger strides never do worse in this table (a sanity check on the table itself)."""
    speedups = [
        simulate(Problem((30, 48, 80), (18, 24, 24), stride), TileConfig((4, 8, 8), (2, 8, 8))).tile_speedup
        for stride in KNOWN
    ]
    assert speedups == sorted(speedups)
