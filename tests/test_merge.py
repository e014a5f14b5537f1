"""Query-tile merging (natsim.merging) against brute-force numpy and a slow pure-Python greedy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim import BlockMask, Problem, TileConfig, block_mask
from natsim.merging import MergeResult, merge

METHODS = ("consecutive", "xor")


@st.composite
def masks(draw, max_q: int = 40) -> np.ndarray:
    """Random boolean masks; narrow ones and ones built from a few rows are full of distance ties."""
    num_q = draw(st.integers(1, max_q))
    num_kv = draw(st.one_of(st.integers(1, 5), st.sampled_from([63, 64, 65, 130])))
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        prototypes = rng.random((draw(st.integers(1, 4)), num_kv)) < density
        return prototypes[rng.integers(0, len(prototypes), num_q)]
    return rng.random((num_q, num_kv)) < density


def xor_distance(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.count_nonzero(a != b))


def members(result: MergeResult) -> list[list[int]]:
    return [[int(i) for i in row if i >= 0] for row in result.groups]


def slow_greedy(mask: np.ndarray, group: int) -> list[list[int]]:
    """FG-Attn's greedy as written in the paper, with ties going to the lowest Q tile index."""
    left = list(range(len(mask)))
    groups = []
    while left:
        leader = left[0]
        nearest = sorted(left[1:], key=lambda j: (xor_distance(mask[leader], mask[j]), j))[: group - 1]
        chosen = sorted([leader, *nearest])
        groups.append(chosen)
        left = [i for i in left if i not in chosen]
    return groups


@settings(max_examples=75, deadline=None)
@given(mask=masks(), group=st.integers(1, 10), method=st.sampled_from(METHODS))
def test_every_q_tile_lands_in_exactly_one_group(mask, group, method):
    result = merge(mask, group, method)
    num_q = len(mask)
    assert result.num_groups == math.ceil(num_q / group)
    assert result.groups.shape == (result.num_groups, group)
    assert sorted(i for g in members(result) for i in g) == list(range(num_q))
    assert [len(g) for g in members(result)] == result.group_sizes.tolist()
    assert all(size == group for size in result.group_sizes[:-1])
    assert 1 <= result.group_sizes[-1] <= group
    assert all(g == sorted(g) for g in members(result))
    # -1 pads only the tail of the last row
    assert np.all(result.groups[:-1] >= 0)
    assert np.all(result.groups[-1, : result.group_sizes[-1]] >= 0)
    assert np.all(result.groups[-1, result.group_sizes[-1] :] == -1)
    if method == "consecutive":
        assert [i for g in members(result) for i in g] == list(range(num_q))


@settings(max_examples=75, deadline=None)
@given(mask=masks(), group=st.integers(1, 10), method=st.sampled_from(METHODS))
def test_unions_objective_and_figures_match_brute_force(mask, group, method):
    result = merge(mask, group, method)
    groups = members(result)
    unions = np.array([np.any(mask[g], axis=0) for g in groups])
    num_q, num_kv = mask.shape
    assert result.merged.num_q_tiles == len(groups)
    assert result.merged.num_kv_tiles == num_kv
    assert np.array_equal(result.merged.to_dense(), unions)
    assert not result.merged.full_dense().any()
    assert result.objective == sum(xor_distance(mask[i], mask[g[0]]) for g in groups for i in g)

    sizes = unions.sum(axis=1)
    work = sum(int(sizes[k]) * len(g) for k, g in enumerate(groups))
    assert result.num_q_tiles == num_q and result.num_kv_tiles == num_kv
    assert result.visited_before == mask.sum()
    assert result.visited_after == work
    assert result.density_before == pytest.approx(mask.sum() / (num_q * num_kv))
    assert result.density_after == pytest.approx(work / (num_q * num_kv))
    assert result.density_after >= result.density_before
    assert result.max_kv_tiles == sizes.max()
    if sizes.max() == 0:
        assert result.tile_speedup == math.inf and result.tile_speedup_mean == math.inf
    else:
        assert result.tile_speedup == pytest.approx(num_kv / sizes.max())
        assert result.tile_speedup_mean == pytest.approx(num_kv / sizes.mean())
    record = result.to_dict()
    assert record["method"] == method and record["group"] == group
    assert record["objective"] == result.objective


@settings(max_examples=200, deadline=None)
@given(mask=masks(max_q=25), group=st.integers(1, 7))
def test_xor_agrees_with_slow_greedy(mask, group):
    assert members(merge(mask, group, "xor")) == slow_greedy(mask, group)


@settings(max_examples=60, deadline=None)
@given(
    group=st.integers(2, 8),
    copies=st.lists(st.integers(1, 4), min_size=2, max_size=6),
    num_kv=st.sampled_from([8, 64, 100]),
    seed=st.integers(0, 2**32 - 1),
)
def test_xor_groups_identical_rows_when_each_prototype_fills_whole_groups(group, copies, num_kv, seed):
    """Prototype k appears copies[k] * group times, shuffled: the greedy always finds group - 1 exact
    copies of the leader, so its objective is 0 and merging costs no density at all."""
    rng = np.random.default_rng(seed)
    prototypes = rng.random((len(copies), num_kv)) < 0.3
    mask = np.repeat(prototypes, np.array(copies) * group, axis=0)[rng.permutation(sum(copies) * group)]
    xor, consecutive = merge(mask, group, "xor"), merge(mask, group, "consecutive")
    assert xor.objective == 0
    assert xor.visited_after == xor.visited_before
    assert xor.objective <= consecutive.objective
    assert xor.density_after <= consecutive.density_after


def test_xor_beats_consecutive_on_shuffled_prototypes():
    """Uneven prototype counts leave some mixed groups, yet far fewer than consecutive grouping makes."""
    rng = np.random.default_rng(7)
    prototypes = rng.random((12, 500)) < 0.2
    mask = prototypes[rng.integers(0, len(prototypes), 2000)]
    xor, consecutive = merge(mask, 8, "xor"), merge(mask, 8, "consecutive")
    assert xor.objective < consecutive.objective / 4
    assert xor.density_after < consecutive.density_after
    assert xor.tile_speedup_mean > consecutive.tile_speedup_mean


@pytest.mark.parametrize(
    "problem, tiles",
    [
        (Problem((12, 10), window=(5, 4), stride=(1, 2)), TileConfig((2, 2), (2, 2))),
        (Problem((9, 8, 6), window=(3, 4, 3), stride=(3, 1, 3)), TileConfig((1, 2, 3), (3, 2, 1))),
        (Problem((40, 6), window=(8, 6), stride=(4, 6), causal=(True, False)), TileConfig(8, 8, "1d")),
    ],
)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_block_mask_input_equals_dense_input(problem, tiles, method, group):
    mask = block_mask(problem, tiles)
    visited, full = mask.to_dense(), mask.full_dense()
    assert full.any()  # the cases exercise the full-tile split
    from_mask, from_dense = merge(mask, group, method), merge(visited, group, method)
    assert np.array_equal(from_mask.groups, from_dense.groups)
    assert np.array_equal(from_mask.merged.to_dense(), from_dense.merged.to_dense())
    assert from_mask.to_dict() == from_dense.to_dict()
    assert merge(BlockMask.from_dense(visited), group, method).to_dict() == from_dense.to_dict()
    # A KV tile is full for a group exactly when it is full for every member.
    every_full = np.array([np.all(full[g], axis=0) for g in members(from_mask)])
    assert np.array_equal(from_mask.merged.full_dense(), every_full)
    assert not (from_mask.merged.full_dense() & ~from_mask.merged.to_dense()).any()


def test_group_larger_than_the_mask_makes_one_group():
    mask = np.eye(5, dtype=bool)
    result = merge(mask, 8)
    assert result.groups.tolist() == [[0, 1, 2, 3, 4, -1, -1, -1]]
    assert result.objective == 8 and result.max_kv_tiles == 5


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"group": 0}, ValueError, "group must be a positive integer (Q tiles per merged group), got group=0."),
        ({"group": -3}, ValueError, "got group=-3."),
        ({"group": 2.0}, ValueError, "got group=2.0."),
        ({"group": True}, ValueError, "got group=True."),
        ({"group": "8"}, ValueError, "got group='8'."),
        ({"group": 2, "method": "XOR"}, ValueError, "method must be 'consecutive' or 'xor', got method='XOR'."),
        ({"group": 2, "mask": [[True]]}, TypeError, "mask must be a natsim.BlockMask or a 2-D boolean"),
        ({"group": 2, "mask": np.ones((2, 2, 2), bool)}, ValueError, "got ndim=3, dtype=bool."),
        ({"group": 2, "mask": np.ones((2, 2), int)}, ValueError, "got ndim=2, dtype=int64."),
        ({"group": 2, "mask": np.ones((0, 4), bool)}, ValueError, "got num_q_tiles=0, num_kv_tiles=4."),
        ({"group": 2, "mask": np.ones((3, 0), bool)}, ValueError, "got num_q_tiles=3, num_kv_tiles=0."),
    ],
)
def test_bad_arguments_raise_sentences(kwargs, error, message):
    kwargs = {"mask": np.ones((3, 4), bool), **kwargs}
    with pytest.raises(error) as info:
        merge(**kwargs)
    assert message in str(info.value)


def test_malformed_block_mask_is_rejected():
    good = BlockMask.from_dense(np.eye(3, dtype=bool))
    out_of_range = BlockMask(3, 3, good.kv_num_blocks, good.kv_indices + 2, *_no_full(3))
    with pytest.raises(ValueError, match=r"Q tile 1 lists a KV tile outside 0\.\.2"):
        merge(out_of_range, 2)
    too_many = BlockMask(3, 3, good.kv_num_blocks + 1, good.kv_indices, *_no_full(3))
    with pytest.raises(ValueError, match="Q tile 0 lists .* or more tiles than its index row holds"):
        merge(too_many, 2)
    wrong_rows = BlockMask(4, 3, good.kv_num_blocks, good.kv_indices, *_no_full(4))
    with pytest.raises(ValueError, match="must have one row per Q tile, got num_q_tiles=4"):
        merge(wrong_rows, 2)


def _no_full(num_q: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(num_q, np.int32), np.zeros((num_q, 1), np.int32)
