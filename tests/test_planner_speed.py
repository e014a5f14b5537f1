"""The planner's fast paths against simple references: `best` against a search that simulates and scores every
configuration one at a time (natsim.simulate, one feature row each) and applies the tie rule in plain Python;
`best_mask` against one that prepares every candidate as the kernel does (`prepare_sparse`, `sparse_features`,
`or_pool`); and the pieces both use (packed pooling, group counts, the dense reference's tiles)."""

from __future__ import annotations

from dataclasses import replace

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import natsim
from natsim import Problem, TileConfig, simulate
from natsim.dimension import dim_tiles, dim_totals_many
from natsim.kernels import prepare_sparse
from natsim.kernels.sparse.work import default_blocks
from natsim.merging import merged_counts, pack_rows
from natsim.planner import SPARSE_FEATURES, best, best_mask, cost_model_for, features_of, or_pool, tile_catalog
from natsim.planner.cost.predict import backward_score
from natsim.planner.cost.sparse_features import sparse_features
from natsim.planner.plans.mask import MERGES
from natsim.planner.search.gna import DENSE_TILE, _dense_tiles, kv_tilings_of, stride_candidates
from natsim.planner.search.mask import token_density
from natsim.planner.search.mask_work import PackedMask, halve_columns, halve_rows
from natsim.planner.search.windows import candidate_windows

H100 = "NVIDIA H100 80GB HBM3"
# The H100's stored model without its host times: these searches are checked on the kernels' predictions (a call's
# host floor is tests/test_planner_host.py's).
UNHOSTED = replace(cost_model_for(H100), host_seconds=None)


def reference_pick(shape, target, *, heads, head_dim, causal, cost_model, training):
    """The search of `best` written plainly: every (window, tile, stride) simulated alone, scored alone, and the
    tie rule over a list. Returns (window, stride, q_tile, kv_tile, kv_tiling, score)."""
    catalog = tile_catalog(shape, head_dim, kv_tilings_of(cost_model))
    rows = []
    for window in candidate_windows(shape, target, causal, catalog).windows:
        for tiles in catalog:
            for stride in stride_candidates(window):
                problem = Problem(shape, window, stride, causal=causal)
                result = simulate(problem, tiles)
                if cost_model is None:
                    score = float(result.visited_tiles * tiles.q_tokens * tiles.kv_tokens)
                else:
                    row = features_of(result, batch_heads=heads, head_dim=head_dim, element_bytes=2, permutation=False)
                    score = float(cost_model.predict(row))
                if training:
                    score += backward_score(problem, cost_model, batch_heads=heads, head_dim=head_dim, element_bytes=2)
                rows.append((window, stride, tiles.q_tile, tiles.kv_tile, tiles.kv_tiling, score))
    lowest = min(row[-1] for row in rows)
    tied = [row for row in rows if row[-1] <= lowest * 1.02]
    return min(tied, key=lambda row: (math.prod(row[1]), row[-1]))  # min keeps the first of equal keys


LAYOUTS = [  # (shape, target sparsity, causal): seeded draws of 1-D, 2-D and 3-D layouts, a few options each
    ((2000,), 0.6, True),
    ((17, 33), 0.85, (True, False)),
    ((4, 8, 12), 0.75, False),
    ((3, 6, 10), 0.6, (True, False, False)),
]


@pytest.mark.parametrize("shape, target, causal", LAYOUTS)
@pytest.mark.parametrize("device, training", [(None, False), ("h100", False), ("h100", True)])
def test_best_picks_what_a_plain_search_picks(shape, target, causal, device, training):
    model = UNHOSTED if device else None
    plan = best(shape, target, heads=4, head_dim=64, causal=causal, cost_model=model, training=training)
    causal = natsim.problem.as_bools(causal, len(shape), "causal")
    want = reference_pick(shape, target, heads=4, head_dim=64, causal=causal, cost_model=model, training=training)
    got = (plan.problem.window, plan.problem.stride, plan.tiles.q_tile, plan.tiles.kv_tile, plan.tiles.kv_tiling)
    assert got == want[:5]
    assert plan.score == pytest.approx(want[5], rel=1e-12)


@st.composite
def dimensions(draw):
    """One dimension (length, window, dilation, causal) and a few (stride, Q side, KV side, KV tiling) on it."""
    dilation = draw(st.integers(1, 3))
    window = draw(st.integers(1, 12))
    length = draw(st.integers(window * dilation, 60))
    combos = draw(st.lists(st.tuples(st.integers(1, window), st.sampled_from([1, 2, 3, 4, 8, 16]),
                                     st.sampled_from([1, 2, 4, 5, 8, 16]), st.booleans()), min_size=1, max_size=6))
    return length, window, dilation, draw(st.booleans()), combos


@settings(max_examples=150, deadline=None)
@given(dimensions())
def test_the_sweeps_closed_form_totals_are_those_of_the_per_tile_flags(dimension):
    length, window, dilation, causal, combos = dimension
    got = dim_totals_many(length, window, dilation, causal, *(np.array(column) for column in zip(*combos)))
    for row, (stride, q_tile, kv_tile, dynamic) in zip(got, combos):
        tiles = dim_tiles(length, window, stride, dilation, causal, q_tile, kv_tile, dynamic)
        assert tuple(row) == (tiles.visited.sum(), tiles.full_flags.sum(), tiles.visited.max())


@pytest.mark.parametrize("tokens", [1, 100, 128, 129, 1000, 4097])
def test_the_dense_reference_counts_the_tiles_1d_tiling_counts(tokens):
    result = simulate(Problem((tokens,), (tokens,)), TileConfig(DENSE_TILE, DENSE_TILE, tiling="1d"))
    assert _dense_tiles(tokens) == (result.visited_tiles, result.full_tiles)


def test_a_repeated_search_returns_the_same_plan_and_a_changed_argument_another():
    first = best((12, 20, 24), 0.8, heads=2, device="h100")
    assert best((12, 20, 24), 0.8, heads=2, device="h100") is first
    assert best((12, 20, 24), 0.8, heads=3, device="h100").score != first.score
    assert best((12, 20, 24), 0.8, heads=2, device="h100", kv_tiling="static").tiles.kv_tiling == "static"


# -- the mask planner's counts ------------------------------------------------------------------------------


def random_mask(seed: int, batch: int, heads: int, num_q: int, num_kv: int, density: float) -> torch.Tensor:
    """A block mask with clusters (4 x 4 blocks) and scattered blocks, like a predictor's."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(batch, heads, num_q // 4 + 1, num_kv // 4 + 1, generator=g) < density
    mask = base.repeat_interleave(4, 2).repeat_interleave(4, 3)[:, :, :num_q, :num_kv].clone()
    return mask | (torch.rand(batch, heads, num_q, num_kv, generator=g) < density / 3)


@pytest.mark.parametrize("rows, columns", [(1, 1), (3, 63), (5, 64), (7, 65), (9, 130), (2, 200)])
@pytest.mark.parametrize("factor", [2, 4, 8])
def test_pooling_packed_rows_is_or_pooling(rows, columns, factor):
    mask = torch.rand(2, 1, rows, columns, generator=torch.Generator().manual_seed(rows * columns)) < 0.3
    bits = pack_rows(mask.numpy())
    pooled_columns, pooled_rows = bits, bits
    for _ in range(factor.bit_length() - 1):
        pooled_columns, pooled_rows = halve_columns(pooled_columns), halve_rows(pooled_rows)
    want_columns = or_pool(mask, 1, factor).numpy()
    want_rows = or_pool(mask, factor, 1).numpy()
    assert np.array_equal(pooled_columns[..., :pack_rows(want_columns).shape[-1]], pack_rows(want_columns))
    assert not pooled_columns[..., pack_rows(want_columns).shape[-1]:].any()
    assert np.array_equal(pooled_rows, pack_rows(want_rows))


@pytest.mark.parametrize("method", ["consecutive", "xor"])
@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_merged_counts_are_natsim_merges_unions_and_full_intersections(method, group):
    rng = np.random.default_rng(group)
    masks = rng.random((3, 21, 70)) < 0.4
    full = masks & (rng.random((3, 21, 70)) < 0.7)
    visited, intersections = merged_counts(pack_rows(masks), pack_rows(full), group, method)
    for m in range(3):
        result = natsim.merge(masks[m], group, method)
        rows = [r[r >= 0] for r in result.groups]
        assert np.array_equal(visited[m], [masks[m][r].any(axis=0).sum() for r in rows])
        assert np.array_equal(intersections[m], [full[m][r].all(axis=0).sum() for r in rows])


@pytest.mark.parametrize("cores", [1, 3, 16])
def test_counts_on_threads_equal_one_pass_over_each_stack(monkeypatch, cores):
    from natsim import merging

    rng = np.random.default_rng(cores)
    requests = []
    for masks, rows, columns, group, method in [(7, 40, 150, 4, "xor"), (1, 33, 70, 2, "consecutive"),
                                                (3, 16, 64, 8, "xor"), (0, 8, 64, 2, "xor")]:
        bits = pack_rows(rng.random((masks, rows, columns)) < 0.3)
        requests.append((bits, bits & pack_rows(rng.random((masks, rows, columns)) < 0.6), group, method))
    monkeypatch.setattr(merging.os, "cpu_count", lambda: cores)
    results = merging.merged_counts_many(requests)
    assert len(results) == len(requests)
    for (bits, full, group, method), (visited, intersections, seconds) in zip(requests, results):
        expected = merging._merged_counts(bits, full, group, method == "xor")
        assert np.array_equal(visited, expected[0]) and np.array_equal(intersections, expected[1]) and seconds >= 0
    bits, full, group, method = requests[0]
    assert all(np.array_equal(a, b) for a, b in zip(merged_counts(bits, full, group, method), results[0][:2]))


@pytest.mark.parametrize("seed, batch, heads, seq_len, fine", [
    (0, 1, 3, 2000, (16, 16)),
    (1, 2, 2, 1500, (16, 32)),
    (2, 1, 2, 777, (8, 16)),
    (3, 1, 1, 4100, (32, 16)),
    (4, 2, 1, 1000, (16, 16)),
])
def test_every_candidates_counts_are_those_of_the_kernels_own_preparation(seed, batch, heads, seq_len, fine):
    q_block, kv_block = fine
    dense = random_mask(seed, batch, heads, -(-seq_len // q_block), -(-seq_len // kv_block), 0.15)
    packed = PackedMask(dense, q_block, kv_block, seq_len)
    call_heads = heads if heads > 1 else 4  # a mask of one head broadcasts over the call's
    gpu = torch.device("cuda")  # the program tiles the planner scores: the GPU's
    for qb in (q_block, 32, 64, 128):
        for kb in (kv_block, 32, 64, 128):
            if qb < q_block or kb < kv_block:
                continue
            coarse = or_pool(dense, qb // q_block, kb // kv_block)
            assert torch.equal(packed.mask(qb, kb), coarse)
            assert packed.density(qb, kb) == token_density(coarse, qb, kb, seq_len)
            for merge in MERGES:
                kernel_merge = None if merge == "none" else merge
                block_m, block_n = default_blocks(qb, kb, kernel_merge, gpu)
                work = prepare_sparse(coarse, qb, kb, seq_len, merge=kernel_merge, block_m=block_m, block_n=block_n)
                group = block_m // qb
                method = "xor" if merge == "xor" and group > 1 else "consecutive"
                row, _ = packed.features(qb, kb, group, method, block_m=block_m, block_n=block_n, batch=batch,
                                         heads=call_heads, head_dim=64)
                assert np.array_equal(row, sparse_features(work, batch, call_heads, 64)), (qb, kb, merge)


def reference_mask_pick(dense, q_block, kv_block, seq_len, heads, cost_model):
    """`best_mask`'s choice written plainly: every candidate prepared by the kernel's own code, scored, sorted,
    and the tie rule (less host work within 2%). Returns (q_block, kv_block, merge, score)."""
    gpu = torch.device("cuda")
    scored = []
    for qb in (16, 32, 64, 128):
        for kb in (16, 32, 64, 128):
            for merge in MERGES:
                if merge != "none" and qb >= 128:
                    continue
                kernel_merge = None if merge == "none" else merge
                block_m, block_n = default_blocks(qb, kb, kernel_merge, gpu)
                coarse = or_pool(dense, qb // q_block, kb // kv_block)
                work = prepare_sparse(coarse, qb, kb, seq_len, merge=kernel_merge, block_m=block_m, block_n=block_n)
                row = sparse_features(work, 1, heads, 128)
                score = float(cost_model.predict_sparse(row)) if cost_model else float(row[SPARSE_FEATURES.index("tiles")] * block_m * block_n)
                scored.append((score, MERGES.index(merge), -qb * kb, qb, kb, merge))
    scored.sort()
    tied = [c for c in scored if c[0] <= scored[0][0] * 1.02]
    winner = min(tied, key=lambda c: (c[1], c[2]))
    return winner[3], winner[4], winner[5], winner[0]


@pytest.mark.parametrize("seed, density", [(0, 0.05), (1, 0.15), (2, 0.4)])
@pytest.mark.parametrize("device", [None, "h100"])
def test_best_mask_picks_what_preparing_every_candidate_picks(seed, density, device):
    dense = random_mask(seed, 1, 4, 128, 128, density)
    model = UNHOSTED if device else None
    plan = best_mask(dense, 16, 16, 2048, cost_model=model)
    want = reference_mask_pick(dense, 16, 16, 2048, 4, model)
    assert (plan.q_block, plan.kv_block, plan.merge) == want[:3]
    assert plan.score == want[3]
