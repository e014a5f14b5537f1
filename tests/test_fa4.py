"""What natsim computes for FlashAttention-4, on the CPU: the GNA element mask its `mask_mod` evaluates (the same
formula in numpy) and the block-sparse lists it reads, against brute-force masks; the tile rules and capability
tables; the sentences when FlashAttention-4 cannot run. The kernels themselves are checked on a GPU
(tests/test_fa4_gpu.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bruteforce import attention_mask, problems
from natsim import Problem
from natsim.kernels.backends import capabilities
from natsim.kernels.backends.fa4 import GNA, MASKS, gna_tile_refusal, tile_refusal
from natsim.kernels.fa4 import library
from natsim.kernels.fa4.gna_mask import GnaMask
from natsim.kernels.fa4.lists import gna_lists, lists_from_blocks, nested_refusal
from natsim.kernels.gna.permute import permute_reference


def source_tokens(problem: Problem, tile: tuple[int, ...]) -> np.ndarray:
    """Row-major token of every position in `tile` order (-1 at padding), by permuting token numbers."""
    numbers = torch.arange(1, problem.num_tokens + 1, dtype=torch.float64).reshape(1, *problem.shape, 1, 1)
    return permute_reference(numbers, tile, problem.dilation)[0, :, 0, 0].long().numpy() - 1


def dense_lists(counts: torch.Tensor, indices: torch.Tensor, columns: int) -> np.ndarray:
    """A `[rows, columns]` boolean array of the first `counts[r]` indices of each row."""
    counts, indices = counts.reshape(-1).numpy(), indices.reshape(len(counts.reshape(-1)), -1).numpy()
    dense = np.zeros((len(counts), columns), dtype=bool)
    for row, count in enumerate(counts):
        dense[row, indices[row, :count]] = True
    return dense


def small_tiles(problem: Problem):
    return st.tuples(*(st.sampled_from([1, 2, 4]) for _ in problem.shape))


@st.composite
def nested_tiles(draw, problem: Problem):
    """A Q tile and a KV tile that is the Q tile or a slab of it along its first dimension longer than 1."""
    q_tile = draw(small_tiles(problem))
    dim = next((i for i, side in enumerate(q_tile) if side > 1), 0)
    kv_side = draw(st.sampled_from([s for s in (1, 2, 4) if q_tile[dim] % s == 0]))
    return q_tile, q_tile[:dim] + (kv_side,) + q_tile[dim + 1:]


# -- the element mask -------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_gna_mask_in_tile_order_is_the_brute_force_mask(data):
    problem = data.draw(problems(max_tokens=300))
    tile = data.draw(small_tiles(problem))
    mask = GnaMask(problem, tile).dense()
    tokens = source_tokens(problem, tile)
    real = tokens >= 0
    assert mask.shape == (len(tokens), len(tokens))
    expected = attention_mask(problem)[np.ix_(tokens[real], tokens[real])]
    assert np.array_equal(mask[np.ix_(real, real)], expected)
    assert not mask[:, ~real].any()  # padding keys are never attended, by any row


def test_the_mask_broadcasts_like_numpy_and_takes_scalars():
    problem = Problem((9, 12), (3, 5), (2, 1), (1, 2), (False, True))
    mask = GnaMask(problem, (2, 4))
    dense = mask.dense()
    assert bool(mask.allowed(np.int64(5), np.int64(7))) == dense[5, 7]
    rows = np.arange(dense.shape[0])
    assert np.array_equal(mask.allowed(rows, np.int64(3)), dense[:, 3])


# -- the lists --------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_gna_lists_cover_every_attended_pair_and_run_unmasked_only_full_blocks(data):
    problem = data.draw(problems(max_tokens=300))
    q_tile, kv_tile = data.draw(nested_tiles(problem))
    lists = gna_lists(problem, q_tile, kv_tile, torch.device("cpu"))
    mask = GnaMask(problem, q_tile).dense()
    tq, tk = math.prod(q_tile), math.prod(kv_tile)
    nq, nk = mask.shape[0] // tq, mask.shape[1] // tk
    real_q = source_tokens(problem, q_tile) >= 0
    attended = np.where(real_q[:, None], mask, False).reshape(nq, tq, nk, tk).any(axis=(1, 3))
    whole = np.where(real_q[:, None], mask, True).reshape(nq, tq, nk, tk).all(axis=(1, 3))
    partial = dense_lists(*lists.forward[:2], nk)
    full = dense_lists(*lists.forward[2:], nk)
    assert not (partial & full).any()
    assert not (attended & ~(partial | full)).any()  # every attended pair of a real query is visited
    assert not (full & ~whole).any()  # an unmasked block holds only attended pairs (no padding key)
    assert np.array_equal(dense_lists(*lists.backward[:2], nq), partial.T)
    assert np.array_equal(dense_lists(*lists.backward[2:], nq), full.T)
    assert lists.masked == bool(partial.any()) and lists.visited == int(partial.sum() + full.sum())
    assert (lists.q_block, lists.kv_block) == (tq, tk)


def test_block_sparse_gna_needs_no_mask_and_matches_the_simulator():
    from natsim import TileConfig, simulate

    problem = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    lists = gna_lists(problem, (4, 8, 8), (2, 8, 8), torch.device("cpu"))
    result = simulate(problem, TileConfig((4, 8, 8), (2, 8, 8)))
    assert not lists.masked and lists.visited == result.visited_tiles == result.full_tiles == 38880


def test_full_tiles_holding_padding_keys_are_masked():
    problem = Problem((6, 10), (6, 10))  # dense, but 10 keys do not fill two tiles of 8 along dimension 1
    lists = gna_lists(problem, (2, 8), (2, 8), torch.device("cpu"))
    assert lists.masked
    assert np.array_equal(dense_lists(*lists.forward[2:], 6), np.tile([True, False], (6, 3)))
    assert np.array_equal(dense_lists(*lists.forward[:2], 6), np.tile([False, True], (6, 3)))


@pytest.mark.parametrize("q_tile, kv_tile, refused", [
    ((4, 8, 8), (2, 8, 8), False), ((4, 8, 8), (4, 8, 8), False), ((1, 16, 8), (1, 8, 8), False),
    ((1, 1, 8), (1, 1, 4), False), ((2, 16, 8), (2, 8, 8), True), ((4, 8, 8), (4, 8, 4), True),
    ((4, 8, 8), (2, 8, 4), True), ((4, 8, 8), (3, 8, 8), True), ((2, 8, 8), (4, 8, 8), True),
])
def test_kv_tiles_must_nest_in_the_q_tiles_order(q_tile, kv_tile, refused):
    refusal = nested_refusal(q_tile, kv_tile)
    assert (refusal is not None) == refused
    assert refusal is None or "the KV tile must be the Q tile or a slab of it along its first dimension longer than 1" in refusal


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 9), st.integers(1, 9), st.floats(0.0, 1.0),
       st.integers(0, 2**16))
def test_lists_of_a_block_mask_list_its_blocks_in_order(batch, heads, rows, columns, density, seed):
    gen = torch.Generator().manual_seed(seed)
    visited = torch.rand(batch, heads, rows, columns, generator=gen) < density
    full = visited & (torch.rand(batch, heads, rows, columns, generator=gen) < 0.5)
    lists = lists_from_blocks(visited, full, 128, 64)
    for counts, indices in (lists.forward[:2], lists.forward[2:], lists.backward[:2], lists.backward[2:]):
        assert counts.dtype == indices.dtype == torch.int32
        assert indices.stride()[-1] == 1 and indices.is_contiguous()  # unit stride even at one column
    # shapes follow from the mask's shape alone (a compiled graph taking the lists is not recompiled per mask)
    assert [tuple(t.shape) for t in lists.tensors()] == [
        (batch, heads, rows), (batch, heads, rows, columns)] * 2 + [(batch, heads, columns), (batch, heads, columns, rows)] * 2
    for b in range(batch):
        for h in range(heads):
            rows_of = lambda pair: dense_lists(pair[0][b, h], pair[1][b, h], columns)  # noqa: E731
            assert np.array_equal(rows_of(lists.forward[:2]), (visited & ~full)[b, h].numpy())
            assert np.array_equal(rows_of(lists.forward[2:]), full[b, h].numpy())
            for counts, indices in (lists.forward[:2], lists.forward[2:]):
                for r in range(rows):
                    listed = indices[b, h, r, : counts[b, h, r]]
                    assert torch.equal(listed, listed.sort().values)  # ascending
    assert lists.visited == int(visited.sum())


def test_lists_refuse_masks_of_other_shapes():
    with pytest.raises(ValueError, match=r"visited and full must be \[B\|1, H\|1, query blocks, key blocks\]"):
        lists_from_blocks(torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool), 128, 128)


# -- what FlashAttention-4 runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("q_block, kv_block, head_dim, backward, refused", [
    (128, 128, 128, False, None),
    (256, 128, 128, True, None),
    (64, 64, 72, False, None),
    (192, 128, 64, False, None),
    (96, 128, 128, False, "query blocks of a multiple of 64 tokens, got 96"),
    (128, 256, 128, False, "key blocks of a multiple of 16 tokens up to 128 at head_dim=128, got 256"),
    (128, 128, 256, False, "up to 80 at head_dim=256, got 128"),
    (128, 64, 128, True, "backward at head_dim=128 runs key blocks of 128 tokens"),
    (64, 128, 32, True, "query blocks of a multiple of 128, got 64 x 128"),
    (128, 128, 160, True, "backward runs head_dim up to 128 here"),
    (128, 128, 100, False, "head_dim 8 to 256 in steps of 8, got head_dim=100"),
    (128, 128, 112, False, None),
    (128, 128, 112, True, "wrong dQ at head_dim=112"),
    (128, 128, 40, True, "wrong dQ at head_dim=40"),
    (128, 128, 16, True, "wrong dQ at head_dim=16"),
    (128, 128, 96, True, None),
    (128, 128, 88, True, None),
    (128, 128, 24, True, None),
])
def test_tile_rules(q_block, kv_block, head_dim, backward, refused):
    refusal = tile_refusal(q_block, kv_block, head_dim, backward)
    assert refusal is None if refused is None else refused in refusal


def test_gna_tiles_must_nest_and_fit_the_kernel():
    assert gna_tile_refusal((4, 8, 8), (2, 8, 8), 128, backward=True) is None
    assert "slab of it" in gna_tile_refusal((4, 8, 8), (4, 8, 4), 128)
    assert "key blocks of 128 tokens" in gna_tile_refusal((2, 8, 8), (1, 8, 8), 128, backward=True)


def test_the_tables_agree_with_the_tile_rules():
    assert capabilities("fa4", "gna") is GNA and capabilities("fa4", "masks") is MASKS
    for table in (GNA, MASKS):
        assert table.runs_on((9, 0)) and not table.runs_on((8, 0)) and not table.runs_on(None)
        assert not table.fp8 and not table.dynamic_kv_tiling and not table.in_place_layouts
        for q_block in table.q_blocks:
            for kv_block in table.kv_blocks:
                assert tile_refusal(q_block, kv_block, 128) is None
    assert GNA.refusal(head_dim=96) is None and "head_dim" in GNA.refusal(head_dim=4)


def test_unavailable_says_why_in_a_sentence():
    reason = library.unavailable(torch.device("cpu"))
    assert reason == "FlashAttention-4 runs on CUDA GPUs, got tensors on cpu."
    installed = library.installed()
    assert installed is None or installed.endswith(".") and "FlashAttention-4" in installed


def _dense(q, k, v, scale):
    """Attention over every key of `[B, N, H, D]` tensors, and its LSE `[B, N, H]`."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lse = scores.logsumexp(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v)
    return out, lse.transpose(1, 2)


@pytest.mark.parametrize("loss_on", ["lse", "out", "both"])
def test_the_block_mask_operators_gradients_take_whichever_output_the_loss_reads(monkeypatch, loss_on):
    """natsim's autograd around FlashAttention-4's block-mask calls (the library runs on GPUs only:
    tests/test_fa4_gpu.py), with the library's forward and backward stood in for by float64 attention over every
    key: a loss on the LSE alone (no gradient for the output), on the output alone, or on both differentiates as
    float64 autograd does."""
    from natsim.kernels.fa4 import ops, run

    def forward(q, k, v, scale, lists, mask, return_lse):
        out, lse = _dense(q, k, v, scale)
        return out, (lse if return_lse else None)

    def backward(q, k, v, out, grad_out, lse, grad_lse, scale, lists, mask):
        # the gradients written out (an operator's implementation runs below autograd): with P the softmax,
        # dS = P * (dO v^T - rowsum(dO * out) + dlse)
        probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale, -1)
        shift = (grad_out * out).sum(-1).transpose(1, 2)[..., None]
        if grad_lse is not None:
            shift = shift - grad_lse.transpose(1, 2)[..., None]
        grad_scores = probs * (torch.einsum("bqhd,bkhd->bhqk", grad_out, v) - shift)
        return (torch.einsum("bhqk,bkhd->bqhd", grad_scores, k) * scale,
                torch.einsum("bhqk,bqhd->bkhd", grad_scores, q) * scale,
                torch.einsum("bhqk,bqhd->bkhd", probs, grad_out))

    monkeypatch.setattr(run, "forward", forward)
    monkeypatch.setattr(run, "backward", backward)
    lists = lists_from_blocks(torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.ones(1, 1, 1, 1, dtype=torch.bool),
                              128, 128)
    tensors, sizes = ops.lists_schema(lists)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 8, dtype=torch.float64, generator=generator) for _ in range(3))
    weights = torch.randn(1, 24, 2, 8, dtype=torch.float64, generator=generator)

    def loss(out, lse):
        return {"lse": lse.sum(), "out": (out * weights).sum(), "both": lse.sum() + (out * weights).sum()}[loss_on]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(loss(*ops.fa4_blocks(*leaves, tensors, sizes, None, True)), leaves)
    flat = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(loss(*_dense(*flat, 8**-0.5)), flat, allow_unused=True)  # the LSE: no dv
    for a, b in zip(got, (torch.zeros_like(t) if g is None else g for t, g in zip(flat, want))):
        assert torch.allclose(a, b, atol=1e-12), (a - b).abs().max()


def test_the_block_mask_operator_has_fake_shapes_for_compiled_graphs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from natsim.kernels.fa4.ops import fa4_blocks, lists_schema

    lists = lists_from_blocks(torch.ones(1, 2, 4, 4, dtype=torch.bool), torch.ones(1, 2, 4, 4, dtype=torch.bool),
                              128, 128)
    tensors, sizes = lists_schema(lists)
    assert sizes == [128, 128, 0]  # ints a compiled graph guards on: none that varies with the mask
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 512, 2, 64, dtype=torch.bfloat16)
        out, lse = fa4_blocks(q, q, q, tensors, sizes, None, True)
        assert out.shape == q.shape and lse.shape == (2, 512, 2) and lse.dtype == torch.float32
        out, lse = fa4_blocks(q, q, q, tensors, sizes, 0.1, False)
        assert lse.numel() == 0
