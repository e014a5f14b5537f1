"""FlashAttention-4's cost features on the CPU: its full blocks (the simulator's full tiles whose KV tile holds no
padding key) against the lists FlashAttention-4 would read (kernels/fa4/lists.py, built from the block mask) and
against the per-dimension flags, vectorised rows against one-by-one counts, the feature rows of GNA calls and
block masks, and the cost model's FlashAttention-4 coefficient sets (has, predict, breakdown, JSON, older files)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bruteforce import _mixed, dims_params, problems
from natsim import Problem, TileConfig, simulate
from natsim.dimension import dim_tiles, dim_unpadded_full_many
from natsim.kernels.fa4.lists import gna_lists
from natsim.planner import CostModel, cost_model_for
from natsim.planner.cost.fa4_features import (FA4_FEATURES, fa4_feature_matrix, gna_fa4_features, mask_fa4_features,
                                              unpadded_full_blocks)
from natsim.planner.cost.features import padded_tokens

FA4 = {"full_flops": 1.4e-15, "masked_flops": 1.9e-14, "narrow_head_flops": 4e-16, "tiles": 1e-9,
       "programs": 2e-8, "permute_bytes": 4e-13, "launch": 5e-5}


@st.composite
def nested_tiles(draw, problem: Problem):
    """A Q tile and a KV tile FlashAttention-4 reads in one token order: the Q tile, or a slab of it along its
    first dimension longer than 1."""
    q_tile = draw(st.tuples(*(st.sampled_from([1, 2, 4]) for _ in problem.shape)))
    dim = next((i for i, side in enumerate(q_tile) if side > 1), 0)
    kv_side = draw(st.sampled_from([s for s in (1, 2, 4) if q_tile[dim] % s == 0]))
    return q_tile, q_tile[:dim] + (kv_side,) + q_tile[dim + 1:]


# -- the full blocks ------------------------------------------------------------------------------------------


@settings(max_examples=75, deadline=None)
@given(st.data())
def test_unpadded_full_blocks_are_the_full_lists_flashattention4_reads(data):
    problem = data.draw(problems(max_tokens=300))
    q_tile, kv_tile = data.draw(nested_tiles(problem))
    lists = gna_lists(problem, q_tile, kv_tile, torch.device("cpu"))
    full = int(lists.forward[2].sum())  # the full blocks' counts, per query block
    got = unpadded_full_blocks(problem, np.array([problem.stride]), np.array([q_tile]), np.array([kv_tile]))
    assert got.tolist() == [full]
    assert lists.visited == simulate(problem, TileConfig(q_tile, kv_tile)).visited_tiles


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_per_dimension_count_is_the_full_flags_without_padded_kv_tiles(data):
    length = data.draw(_mixed([1, 2, 7, 8, 9, 16, 17, 40], 1, 48))
    window, stride, dilation, causal = data.draw(dims_params(length))
    q_tile, kv_tile = (data.draw(st.sampled_from([1, 2, 3, 4, 8, 16])) for _ in range(2))
    tiles = dim_tiles(length, window, stride, dilation, causal, q_tile, kv_tile, False)
    index = tiles.kv_first[..., None] + np.arange(tiles.full_flags.shape[-1])
    group_len = (length // dilation + (np.arange(dilation) < length % dilation))[:, None, None]
    expected = int((tiles.full_flags & ((index + 1) * kv_tile <= group_len)).sum())
    got = dim_unpadded_full_many(length, window, dilation, causal, np.array([stride]), np.array([q_tile]),
                                 np.array([kv_tile]))
    assert got.tolist() == [expected]


def test_rows_are_counted_as_one_by_one_whatever_their_order():
    problem = Problem((13, 20, 24), (7, 9, 12), causal=(True, False, False))
    rng = np.random.default_rng(0)
    strides = np.stack([rng.integers(1, w + 1, 40) for w in problem.window], axis=1)
    q_tiles = rng.choice([1, 2, 4, 8], size=(40, 3))
    kv_tiles = np.minimum(q_tiles, rng.choice([1, 2, 4], size=(40, 3)))
    together = unpadded_full_blocks(problem, strides, q_tiles, kv_tiles)
    alone = [unpadded_full_blocks(problem, strides[i:i + 1], q_tiles[i:i + 1], kv_tiles[i:i + 1])[0]
             for i in range(40)]
    assert together.tolist() == alone
    per_dim = [dim_unpadded_full_many(problem.shape[i], problem.window[i], 1, problem.causal[i], strides[:, i],
                                      q_tiles[:, i], kv_tiles[:, i]) for i in range(3)]
    assert together.tolist() == (per_dim[0] * per_dim[1] * per_dim[2]).tolist()


def test_full_tiles_that_hold_padding_keys_are_not_full_blocks():
    dense = Problem((6, 10), (6, 10))  # every tile full, but 10 keys do not fill two tiles of 8
    assert simulate(dense, TileConfig((2, 8), (2, 8))).full_tiles == 36  # 6 Q tiles x 6 KV tiles
    assert unpadded_full_blocks(dense, np.array([(1, 1)]), np.array([(2, 8)]), np.array([(2, 8)])).tolist() == [18]
    divisible = Problem((6, 16), (6, 16))
    assert unpadded_full_blocks(divisible, np.array([(1, 1)]), np.array([(2, 8)]), np.array([(2, 8)])).tolist() == [36]


# -- the feature rows -----------------------------------------------------------------------------------------


def test_a_gna_call_s_features():
    problem = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    q_tile, kv_tile, heads, head_dim = (4, 8, 8), (2, 8, 8), 24, 128
    row = dict(zip(FA4_FEATURES, gna_fa4_features(problem, q_tile, kv_tile, batch_heads=heads, head_dim=head_dim,
                                                    element_bytes=2)))
    sim = simulate(problem, TileConfig(q_tile, kv_tile))
    block = 4.0 * 256 * 128 * head_dim * heads
    assert sim.block_sparse and row["full_flops"] == sim.full_tiles * block and row["masked_flops"] == 0
    assert row["narrow_head_flops"] == 0 and row["tiles"] == sim.visited_tiles * heads and row["launch"] == 1
    tokens, padded = problem.num_tokens, padded_tokens(problem.shape, q_tile, (1, 1, 1))
    assert padded == 32 * 48 * 80 and row["programs"] == padded / 128 * heads
    assert row["permute_bytes"] == (3 * (tokens + padded) + 2 * tokens) * heads * head_dim * 2


def test_masked_blocks_and_narrow_heads():
    problem = Problem((16, 44, 80), (8, 20, 40), (1, 4, 8))  # 44 rows: the last KV tile of each column is padded
    row = dict(zip(FA4_FEATURES, gna_fa4_features(problem, (2, 8, 8), (2, 8, 8), batch_heads=1, head_dim=64,
                                                    element_bytes=2)))
    sim = simulate(problem, TileConfig((2, 8, 8), (2, 8, 8)))
    block = 4.0 * 128 * 128 * 64
    full = row["full_flops"] / block
    assert 0 < full < sim.full_tiles  # the simulator's full tiles, some of them padded
    assert row["masked_flops"] == (sim.visited_tiles - full) * block
    assert row["narrow_head_flops"] == sim.visited_tiles * block


def test_a_block_mask_s_features_count_every_visited_block_full_and_permute_nothing():
    row = dict(zip(FA4_FEATURES, mask_fa4_features(1000, q_block=64, kv_block=128, seq_len=1000, batch_heads=4,
                                                    head_dim=128)))
    assert row["full_flops"] == 1000 * 4.0 * 64 * 128 * 128 and row["masked_flops"] == 0
    assert row["tiles"] == 1000 and row["permute_bytes"] == 0 and row["launch"] == 1
    assert row["programs"] == 1024 / 128 * 4  # 16 query blocks of 64


def test_the_matrix_broadcasts_rows():
    matrix = fa4_feature_matrix(full_blocks=np.array([1, 2]), visited_blocks=np.array([3, 4]), q_block=128,
                                kv_block=64, q_padded=256, batch_heads=2, head_dim=32, permute_bytes=0.0)
    assert matrix.shape == (2, len(FA4_FEATURES))
    assert matrix[:, FA4_FEATURES.index("narrow_head_flops")].tolist() == [3 * 4.0 * 128 * 64 * 32 * 2,
                                                                           4 * 4.0 * 128 * 64 * 32 * 2]


# -- the cost model's sets ------------------------------------------------------------------------------------


def test_a_model_with_flashattention4_sets_predicts_them_and_round_trips():
    h100 = cost_model_for("NVIDIA H100 80GB HBM3")
    base = CostModel(h100.gpu, h100.coefficients)  # a GPU calibrated for natsim's kernels only
    assert not base.has("fa4") and not base.has("fa4-backward") and base.fa4_coefficients is None
    model = CostModel(base.gpu, base.coefficients, fa4_coefficients=FA4,
                      fa4_backward_coefficients={k: 2 * v for k, v in FA4.items()})
    assert model.has("fa4") and model.has("fa4-backward")
    row = np.arange(1, len(FA4_FEATURES) + 1, dtype=np.float64)
    forward = sum(FA4[name] * row[i] for i, name in enumerate(FA4_FEATURES))
    assert model.predict_fa4(row) == pytest.approx(forward)
    assert model.predict_fa4(np.stack([row, row]), backward=True) == pytest.approx([2 * forward] * 2)
    assert sum(model.fa4_breakdown(row).values()) == pytest.approx(forward)
    assert list(model.fa4_breakdown(row, backward=True)) == list(FA4_FEATURES)
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model and again.fa4_backward_coefficients == model.fa4_backward_coefficients


def test_files_without_flashattention4_sets_load_with_none_and_say_how_to_fit_them():
    h100 = cost_model_for("NVIDIA H100 80GB HBM3")
    model = CostModel(h100.gpu, h100.coefficients, sparse_coefficients=h100.sparse_coefficients,
                      backward_coefficients=h100.backward_coefficients)
    data = model.to_dict()
    assert "fa4_coefficients" not in data
    loaded = CostModel.from_dict(data)
    assert loaded.fa4_coefficients is None and loaded.fa4_backward_coefficients is None
    with pytest.raises(ValueError, match=r"no FlashAttention-4 coefficients; run `natsim calibrate --kernels gna,fa4`"):
        loaded.predict_fa4(np.zeros(len(FA4_FEATURES)))
    with pytest.raises(ValueError, match=r"no FlashAttention-4 backward coefficients"):
        CostModel(model.gpu, model.coefficients, fa4_coefficients=FA4).predict_fa4(np.zeros(7), backward=True)


def test_flashattention4_coefficients_must_name_its_features():
    with pytest.raises(ValueError, match=r"fa4_coefficients must name exactly the features"):
        CostModel("G", cost_model_for("NVIDIA H100 80GB HBM3").coefficients, fa4_coefficients={"full_flops": 1.0})
    with pytest.raises(ValueError, match=r"fa4_backward_coefficients must be finite and non-negative"):
        CostModel("G", cost_model_for("NVIDIA H100 80GB HBM3").coefficients,
                  fa4_backward_coefficients={**FA4, "launch": -1.0})


def test_block_flops_are_the_tokens_product():
    q, kv, d = 256, 128, 128
    row = fa4_feature_matrix(full_blocks=1, visited_blocks=1, q_block=q, kv_block=kv, q_padded=q, batch_heads=1,
                             head_dim=d, permute_bytes=0.0)
    assert row[FA4_FEATURES.index("full_flops")] == 4 * math.prod((q, kv, d))
