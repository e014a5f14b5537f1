"""Sweeps: bulk figures equal one-by-one simulation, pruning follows the paper's rule, the catalog."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim import Problem, TileConfig, default_tile_catalog, simulate, sweep
from natsim.sweep import all_strides

COUNTS = ("attended_pairs", "num_q_tiles", "num_kv_tiles", "visited_tiles", "full_tiles", "max_kv_tiles")


@st.composite
def sweep_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(2, 12)) for _ in range(ndim))
    window = tuple(draw(st.integers(1, L)) for L in shape)
    dilation = tuple(draw(st.integers(1, max(1, L // w))) for L, w in zip(shape, window))
    causal = tuple(draw(st.booleans()) for _ in range(ndim))
    tiles = []
    for _ in range(draw(st.integers(1, 2))):
        q = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
        kv = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
        tiles.append(TileConfig(q, kv, kv_tiling=draw(st.sampled_from(["static", "dynamic"]))))
    return shape, window, dilation, causal, tiles


@settings(max_examples=40, deadline=None)
@given(sweep_cases())
def test_every_row_equals_simulate(case):
    shape, window, dilation, causal, tiles = case
    result = sweep(shape, window, dilation=dilation, causal=causal, tiles=tiles)
    assert len(result) == math.prod(window) * len(tiles)
    for i in range(len(result)):
        problem = Problem(shape, window, tuple(result.stride[i]), dilation, causal)
        expected = simulate(problem, tiles[result.tile_index[i]])
        assert result.result(i) == expected


def test_one_d_tiling_rows_equal_simulate():
    tiles = [TileConfig(8, 4, tiling="1d")]
    result = sweep((6, 7), (3, 4), dilation=(1, 1), tiles=tiles)
    for i in range(len(result)):
        expected = simulate(Problem((6, 7), (3, 4), tuple(result.stride[i])), tiles[0])
        assert result.result(i) == expected


def test_pruned_view_matches_its_definition():
    tiles = [TileConfig((2, 4), (2, 4)), TileConfig((4, 4), (2, 2))]
    result = sweep((16, 20), (8, 9), tiles=tiles)
    speedups = [result.result(i).tile_speedup for i in range(len(result))]
    products = [int(np.prod(result.stride[i])) for i in range(len(result))]
    for i in range(len(result)):
        smaller = [speedups[j] for j in range(len(result)) if products[j] < products[i]]
        expected = all(speedups[i] > s + 1e-12 for s in smaller)
        assert bool(result.pruned[i]) == expected


def test_known_pruned_view_of_the_paper_layout():
    result = sweep((30, 48, 80), (18, 24, 24), tiles=[TileConfig((4, 8, 8), (2, 8, 8))])
    assert len(result) == 18 * 24 * 24 == 10_368
    best = result.best()
    assert tuple(best[0].problem.stride) == (16, 8, 8)
    assert best[0].block_sparse
    kept = {tuple(r.problem.stride) for r in best}
    assert {(1, 1, 1), (2, 1, 1), (1, 8, 8), (2, 8, 8), (16, 8, 8)} <= kept
    speedups = [r.tile_speedup for r in best]
    assert speedups == sorted(speedups, reverse=True)


def test_given_strides_are_validated_and_kept_in_order():
    result = sweep((8, 8), (4, 4), strides=[(1, 1), 2, (4, 1)], tiles=[TileConfig(2, 2)])
    assert result.stride.tolist() == [[1, 1], [2, 2], [4, 1]]
    with pytest.raises(ValueError, match="stride cannot be larger than window"):
        sweep((8, 8), (4, 4), strides=[(5, 1)], tiles=[TileConfig(2, 2)])
    with pytest.raises(ValueError, match="at least one stride"):
        sweep((8, 8), (4, 4), strides=[], tiles=[TileConfig(2, 2)])
    # a stride given twice (2 and (2, 2) alike) is one row; one stride not in a list is a sentence
    assert sweep((8, 8), (4, 4), strides=[2, (2, 2), 1], tiles=[TileConfig(2, 2)]).stride.tolist() == [[2, 2], [1, 1]]
    for bad in (2, "2x2"):
        with pytest.raises(TypeError, match="strides must be None, 'all' or a list of strides"):
            sweep((8, 8), (4, 4), strides=bad, tiles=[TileConfig(2, 2)])
    with pytest.raises(ValueError, match="q_tile must have one size per dimension"):
        sweep((8, 8), (4, 4), tiles=[TileConfig((2, 2, 2), (2, 2, 2))])


def test_all_strides_enumerates_the_window_box():
    problem = Problem((9, 10), (3, 4))
    rows = {tuple(r) for r in all_strides(problem)}
    assert rows == set(itertools.product(range(1, 4), range(1, 5)))


def test_default_catalog_shapes():
    catalog = default_tile_catalog((30, 48, 80))
    assert catalog and all(t.q_tile == t.kv_tile for t in catalog)
    assert {t.q_tokens for t in catalog} == {64, 128, 256}
    for t in catalog:
        assert all(side & (side - 1) == 0 for side in t.q_tile)  # powers of two
        assert all(side <= limit for side, limit in zip(t.q_tile, (32, 64, 128)))
    assert len(set(catalog)) == len(catalog)
    assert TileConfig((4, 8, 8), (4, 8, 8)) in catalog


def test_progress_reports_every_configuration():
    calls = []
    sweep((8, 8), (2, 3), tiles=[TileConfig(2, 2), TileConfig(4, 4)], progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (12, 12)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
