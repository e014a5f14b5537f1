"""block_mask() against the brute-force reference of tests/bruteforce.py (written from gna-semantics.md)."""

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

from natsim import BlockMask, Problem, TileConfig, block_mask, simulate  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_layout(bm: BlockMask) -> None:
    """FlexAttention layout: counts per row, ascending distinct indices in range, partial and full disjoint."""
    for counts, indices in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        counts, indices = np.asarray(counts), np.asarray(indices)
        assert np.issubdtype(counts.dtype, np.integer) and np.issubdtype(indices.dtype, np.integer)
        assert counts.shape == (bm.num_q_tiles,)
        assert indices.ndim == 2 and indices.shape[0] == bm.num_q_tiles
        assert (counts >= 0).all() and (counts <= indices.shape[1]).all()
        for q in range(bm.num_q_tiles):
            row = indices[q, : counts[q]]
            assert (np.diff(row) > 0).all(), f"row {q} not strictly ascending: {row.tolist()}"
            assert ((row >= 0) & (row < bm.num_kv_tiles)).all()
    partial = np.zeros((bm.num_q_tiles, bm.num_kv_tiles), bool)
    for q in range(bm.num_q_tiles):
        partial[q, np.asarray(bm.kv_indices)[q, : bm.kv_num_blocks[q]]] = True
    full = bm.full_dense()
    assert not (partial & full).any(), "a KV tile is both partial and full"
    assert np.array_equal(partial | full, bm.to_dense())
    assert np.array_equal(bm.visited, np.asarray(bm.kv_num_blocks) + np.asarray(bm.full_kv_num_blocks))


def assert_block_mask_matches(problem: Problem, tiles: TileConfig) -> None:
    ref = bf.reference(problem, tiles.q_tile, tiles.kv_tile, tiles.tiling, "static")
    bm = block_mask(problem, tiles)
    where = f"{problem!r}, {tiles!r}"
    assert (bm.num_q_tiles, bm.num_kv_tiles) == ref.visited_matrix.shape, (
        f"grid {(bm.num_q_tiles, bm.num_kv_tiles)} vs brute force {ref.visited_matrix.shape} for {where}"
    )
    check_layout(bm)
    visited, full = bm.to_dense(), bm.full_dense()
    if not np.array_equal(visited, ref.visited_matrix):
        q, k = np.argwhere(visited != ref.visited_matrix)[0]
        raise AssertionError(f"visited differs at (Q {q}, KV {k}): got {visited[q, k]} for {where}")
    if not np.array_equal(full, ref.full_matrix):
        q, k = np.argwhere(full != ref.full_matrix)[0]
        raise AssertionError(f"full differs at (Q {q}, KV {k}): got {full[q, k]} for {where}")
    assert math.isclose(bm.density, ref.visited_matrix.sum() / ref.visited_matrix.size, rel_tol=1e-12)
    # and it tells the same story as simulate()
    res = simulate(problem, tiles, per_q_tile=True)
    assert np.array_equal(bm.visited, res.per_q_tile_visited)
    assert np.array_equal(np.asarray(bm.full_kv_num_blocks), res.per_q_tile_full)


# 150 random problems a run, not 300: the strategies draw the special sizes most of the time, and the edge cases
# below run every time.
@settings(max_examples=75, **SETTINGS)
@given(st.data())
def test_multi_d_block_mask_matches_bruteforce(data):
    problem = data.draw(bf.problems())
    tiles = data.draw(bf.multi_tiles(problem, "static"))
    assert_block_mask_matches(problem, tiles)


@settings(max_examples=75, **SETTINGS)
@given(st.data())
def test_1d_block_mask_matches_bruteforce(data):
    problem = data.draw(bf.problems())
    tiles = data.draw(bf.one_d_tiles(problem))
    assert_block_mask_matches(problem, tiles)


@pytest.mark.parametrize(
    "problem, tiles",
    [
        (Problem((13,), 6, 3, 2, False), TileConfig(2, 3)),
        (Problem((7, 9), (3, 4), (3, 2), (2, 1), (False, True)), TileConfig((2, 4), (3, 2))),
        (Problem((4, 5, 6), (2, 3, 3), (1, 3, 2), (2, 1, 2), (False, True, False)), TileConfig((2, 2, 3), (3, 4, 2))),
        (Problem((8, 8, 8), 4, 4), TileConfig(4, 4)),
        (Problem((8, 8, 8), 4, 4), TileConfig(5, 3, tiling="1d")),
        (Problem((5,), 2, 1, 2, True), TileConfig(8, 16)),
        (Problem((1,), 1), TileConfig(1, 1)),
    ],
)
def test_block_mask_edge_cases(problem, tiles):
    assert_block_mask_matches(problem, tiles)


def test_block_sparse_has_no_partial_tiles():
    bm = block_mask(Problem((8, 8, 8), 4, 4), TileConfig(4, 4))
    assert (np.asarray(bm.kv_num_blocks) == 0).all()
    assert (np.asarray(bm.full_kv_num_blocks) == 1).all()


def test_dynamic_kv_tiling_raises():
    with pytest.raises(ValueError, match="kv_tiling"):
        block_mask(Problem((8, 8), 3), TileConfig(4, 4, kv_tiling="dynamic"))


def test_from_dense_round_trip():
    rng = np.random.default_rng(0)
    mask = rng.random((7, 11)) < 0.4
    mask[3] = False
    bm = BlockMask.from_dense(mask)
    assert np.array_equal(bm.to_dense(), mask)
    assert not bm.full_dense().any()
    check_layout(bm)


@pytest.mark.parametrize("bad", [np.zeros((3, 3), int), np.zeros((2, 2, 2), bool)])
def test_from_dense_rejects_bad_masks(bad):
    with pytest.raises(ValueError, match="mask"):
        BlockMask.from_dense(bad)
