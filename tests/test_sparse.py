"""Sparse attention under any block mask (kernels/sparse/: the kernel, its work and SparseMask).

On this CPU machine the Triton kernel runs in the interpreter (tests/conftest.py): tiny shapes, fp16 (bf16
products in the interpreter's tl.dot are wrong on Triton 3.9). The float64 reference below is written here
from the semantics alone (query i attends key j iff mask[b, h, i // q_block, j // kv_block]); it does not
call natsim's sparse_reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import natsim
from natsim.kernels import (
    SparseMask,
    prepare_sparse,
    sparse_attention,
    sparse_reference,
    sparse_tile_counts,
)

sys.path.insert(0, str(Path(__file__).parent))
import bruteforce  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = (16, 32, 64, 128)
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def dense_softmax(q, k, v, mask, q_block, kv_block):
    """float64 attention under the element mask expanded from `mask`, written from the semantics: output 0
    and LSE -inf for a query that attends nothing."""
    batch, n, heads, _ = q.shape
    q, k, v = (t.double().cpu() for t in (q, k, v))
    mask = mask.cpu().expand(batch, heads, -1, -1)
    element = mask.repeat_interleave(q_block, 2).repeat_interleave(kv_block, 3)[:, :, :n, :n]
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~element, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # -inf on empty rows
    probs = torch.where(element, torch.exp(scores - lse[..., None].clamp(min=-1e300)), 0.0)
    out = torch.einsum("bhnm,bmhd->bnhd", probs, v)
    return out, lse.transpose(1, 2)


def random_inputs(batch, n, heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, heads, head_dim, generator=generator).to(DEVICE, torch.float16) for _ in range(3)]


def random_mask(mask_batch, mask_heads, n, q_block, kv_block, density, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (mask_batch, mask_heads, -(-n // q_block), -(-n // kv_block))
    return (torch.rand(shape, generator=generator) < density).to(DEVICE)


def assert_matches(q, k, v, mask, q_block, kv_block, **kwargs):
    out, lse = sparse_attention(q, k, v, mask, q_block, kv_block, return_lse=True, **kwargs)
    ref_out, ref_lse = dense_softmax(q, k, v, mask, q_block, kv_block)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=2e-3, rtol=2e-3)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()) & (lse.cpu() < 0), empty)
    torch.testing.assert_close(lse.double().cpu()[~empty], ref_lse[~empty], atol=1e-4, rtol=1e-4)
    return out


# ---------------------------------------------------------------------------------------------------------
# Output and LSE against float64


@pytest.mark.parametrize("q_block", BLOCKS)
@pytest.mark.parametrize("kv_block", BLOCKS)
def test_every_block_pair_matches_float64(q_block, kv_block):
    n = 2 * max(q_block, kv_block) - 5  # not a multiple of either block
    merge = "xor" if q_block < 64 else None
    q, k, v = random_inputs(1, n, 2, 32, seed=q_block + kv_block)
    assert_matches(q, k, v, random_mask(1, 2, n, q_block, kv_block, 0.6, seed=q_block), q_block, kv_block,
                   merge=merge)


# 15 random problems a run, not 25: every block pair (above), the merges, schedules and empty rows (below) run
# every time.
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    q_block=st.sampled_from((8, 16, 32, 64)),
    kv_block=st.sampled_from((1, 8, 16, 32, 64)),
    n=st.integers(40, 200),
    density=st.sampled_from((0.0, 0.1, 0.5, 0.9, 1.0)),
    merge=st.sampled_from((None, "consecutive", "xor")),
    schedule=st.sampled_from(("grid", "lpt")),
    seed=st.integers(0, 1000),
)
def test_random_per_head_masks_match_float64(q_block, kv_block, n, density, merge, schedule, seed):
    q, k, v = random_inputs(2, n, 2, 32, seed=seed)
    mask = random_mask(2, 2, n, q_block, kv_block, density, seed=seed)  # a different mask per (batch, head)
    assert_matches(q, k, v, mask, q_block, kv_block, merge=merge, schedule=schedule)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_dims_64_and_128(head_dim):
    q, k, v = random_inputs(1, 70, 1, head_dim)
    assert_matches(q, k, v, random_mask(1, 1, 70, 16, 32, 0.5), 16, 32, merge="consecutive")


def test_merge_methods_give_the_same_output():
    q, k, v = random_inputs(1, 150, 2, 32, seed=3)
    mask = random_mask(1, 2, 150, 16, 16, 0.3, seed=3)
    outs = [sparse_attention(q, k, v, mask, 16, 16, merge=m) for m in (None, "consecutive", "xor")]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-3, rtol=1e-3)


def test_schedules_give_the_same_output():
    q, k, v = random_inputs(2, 120, 2, 32, seed=4)
    mask = random_mask(2, 1, 120, 16, 16, 0.4, seed=4)
    grid = sparse_attention(q, k, v, mask, 16, 16, merge="xor", schedule="grid")
    for programs in (None, 1, 3):
        lpt = sparse_attention(q, k, v, mask, 16, 16, merge="xor", schedule="lpt", programs=programs)
        assert torch.equal(lpt, grid)


def test_empty_rows_give_zeros_and_lse_minus_infinity():
    q, k, v = random_inputs(1, 90, 2, 32, seed=5)
    mask = random_mask(1, 2, 90, 16, 32, 0.7, seed=5)
    mask[0, 0, 1] = False  # one empty query block in head 0
    mask[0, 1] = False  # head 1 attends nothing
    out, lse = sparse_attention(q, k, v, mask, 16, 32, merge="xor", return_lse=True)
    assert torch.count_nonzero(out[0, 16:32, 0]) == 0 and torch.count_nonzero(out[0, :, 1]) == 0
    assert torch.isneginf(lse[0, 16:32, 0]).all() and torch.isneginf(lse[0, :, 1]).all()
    assert torch.isfinite(lse[0, :16, 0]).all() == bool(mask[0, 0, 0].any())
    assert_matches(q, k, v, mask, 16, 32, merge="xor")


def test_no_tokens_give_empty_outputs_and_a_q_without_batch_is_named(reference_path):
    """A sequence of no tokens gives empty outputs on the CPU path as on the kernels'; a q that lost its batch
    dimension is refused for its shape, not for the mask's."""
    empty = torch.randn(1, 0, 2, 16)
    out, lse = sparse_attention(empty, empty, empty, torch.ones(1, 2, 0, 0, dtype=torch.bool), 16, 16,
                                return_lse=True)
    assert out.shape == empty.shape and lse.shape == (1, 0, 2)
    q = torch.randn(100, 2, 16)
    with pytest.raises(ValueError, match=r"q must be \[batch, tokens, heads, head_dim\], got q.shape=\(100, 2, 16\)"):
        sparse_attention(q, q, q, torch.ones(1, 2, 7, 7, dtype=torch.bool), 16, 16)


def test_sparse_mask_and_prepared_work_run_like_the_boolean_mask():
    q, k, v = random_inputs(1, 100, 2, 32, seed=6)
    mask = random_mask(1, 2, 100, 16, 32, 0.5, seed=6)
    want = sparse_attention(q, k, v, mask, 16, 32, merge="xor")
    sparse_mask = SparseMask.from_dense(mask, 16, 32, 100)
    assert torch.equal(sparse_attention(q, k, v, sparse_mask, merge="xor"), want)
    work = prepare_sparse(sparse_mask, merge="xor")
    assert work.merge_seconds >= 0 and work.prepare_seconds >= work.merge_seconds
    assert torch.equal(sparse_attention(q, k, v, work), want)


def test_reference_equals_float64_softmax():
    q, k, v = (t.double() for t in random_inputs(2, 77, 2, 16, seed=7))
    mask = random_mask(2, 1, 77, 8, 16, 0.4, seed=7)
    mask[1, 0, 2] = False
    out, lse = sparse_reference(q, k, v, mask, 8, 16, return_lse=True, chunk=20)
    ref_out, ref_lse = dense_softmax(q, k, v, mask, 8, 16)
    torch.testing.assert_close(out.cpu(), ref_out)
    torch.testing.assert_close(lse.cpu(), ref_lse)


# ---------------------------------------------------------------------------------------------------------
# The kernel's own counts against the simulator (natsim.merge)


@SETTINGS
@given(
    q_block=st.sampled_from((8, 16, 32)),
    kv_block=st.sampled_from((8, 16, 32)),
    n=st.integers(64, 260),
    density=st.floats(0.0, 1.0),
    method=st.sampled_from(("consecutive", "xor")),
    schedule=st.sampled_from(("grid", "lpt")),
    seed=st.integers(0, 1000),
)
def test_kernel_counts_equal_what_natsim_merge_predicts(q_block, kv_block, n, density, method, schedule, seed):
    mask = random_mask(1, 2, n, q_block, kv_block, density, seed=seed)
    sparse_mask = SparseMask.from_dense(mask, q_block, kv_block, n)
    counts = sparse_tile_counts(sparse_mask, merge=method, schedule=schedule, device=DEVICE)
    group = counts.members.shape[-1]
    for h in range(2):
        predicted = natsim.merge(sparse_mask.to_numpy()[0, h], group, method)
        np.testing.assert_array_equal(counts.members[0, h], predicted.groups)
        np.testing.assert_array_equal(counts.loaded[0, h], predicted.merged.visited)
        np.testing.assert_array_equal(counts.computed[0, h], predicted.merged.visited * predicted.group_sizes)
        assert counts.computed[0, h].sum() == predicted.visited_after


def test_unmerged_programs_hold_one_query_block_each():
    mask = random_mask(1, 1, 96, 32, 16, 0.5, seed=8)
    counts = sparse_tile_counts(mask, 32, 16, seq_len=96, device=DEVICE)
    assert counts.members.shape == (1, 1, 3, 1)
    np.testing.assert_array_equal(counts.loaded[0, 0], mask[0, 0].sum(-1).cpu().numpy())


# ---------------------------------------------------------------------------------------------------------
# SparseMask conversions


def test_dense_sparse_mask_and_flex_round_trip():
    mask = random_mask(2, 3, 100, 16, 32, 0.4, seed=9)
    mask[0, 0, 1] = False
    sparse_mask = SparseMask.from_dense(mask, 16, 32, 100)
    assert sparse_mask.kv_indices.shape[-1] == int(mask.sum(-1).max())  # sized by visited blocks
    assert torch.equal(sparse_mask.to_dense(), mask)
    assert np.array_equal(sparse_mask.to_numpy(), mask.cpu().numpy())
    flex = sparse_mask.to_flex()
    assert flex.BLOCK_SIZE == (16, 32) and tuple(flex.seq_lengths) == (100, 100)
    back = SparseMask.from_flex(flex)
    assert (back.q_block, back.kv_block, back.seq_len) == (16, 32, 100)
    assert torch.equal(back.to_dense(), mask)
    with_mod = sparse_mask.to_flex(mask_mod=lambda b, h, q, kv: q >= kv)
    assert torch.equal(SparseMask.from_flex(with_mod, allow_mask_mod=True).to_dense(), mask)
    with pytest.raises(ValueError, match="partial blocks with a mask_mod"):
        SparseMask.from_flex(with_mod)


def test_flex_block_mask_from_create_block_mask_converts():
    from torch.nn.attention.flex_attention import create_block_mask

    def band(b, h, q, kv):
        return (q - kv).abs() < 40

    flex = create_block_mask(band, None, None, 256, 256, device=DEVICE, BLOCK_SIZE=32)
    sparse_mask = SparseMask.from_flex(flex, allow_mask_mod=True)
    rows, cols = np.indices((8, 8))
    want = np.abs(rows - cols) <= 2  # 32-token blocks whose tokens come within 40 of each other
    assert np.array_equal(sparse_mask.to_numpy()[0, 0], want)


def test_natsim_block_mask_converts_to_the_brute_force_block_mask():
    problem = natsim.Problem((100,), (17,))
    block_mask = natsim.block_mask(problem, natsim.TileConfig(16, 32))
    sparse_mask = SparseMask.from_block_mask(block_mask, 16, 32, 100)
    element = bruteforce.attention_mask(problem)
    padded = np.zeros((112, 128), bool)
    padded[:100, :100] = element
    want = padded.reshape(7, 16, 4, 32).any(axis=(1, 3))
    assert np.array_equal(sparse_mask.to_numpy()[0, 0], want)


# ---------------------------------------------------------------------------------------------------------
# Errors, gradients, torch.compile


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q, m: sparse_attention(q, q, q, m, 24, 16), "q_block must be a power of two between 8 and 128, got q_block=24."),
        (lambda q, m: sparse_attention(q, q, q, m, 16, 256), "kv_block must be a power of two between 1 and 128, got kv_block=256."),
        (lambda q, m: sparse_attention(q, q, q, m), "q_block and kv_block must be given"),
        (lambda q, m: sparse_attention(q, q, q, m, 16, 32), r"mask must be \[batch or 1, heads or 1"),
        (lambda q, m: sparse_attention(q, q, q, m.int(), 16, 16), "mask must be a boolean tensor"),
        (lambda q, m: sparse_attention(q, q, q, m, 16, 16, merge="best"), "merge must be None, 'consecutive' or 'xor'"),
        (lambda q, m: sparse_attention(q, q, q, m, 16, 16, schedule="fifo"), "schedule must be None, 'grid' or 'lpt'"),
        (lambda q, m: sparse_attention(q, q[:, :-1], q, m, 16, 16), "q, k and v must have the same shape"),
        (lambda q, m: sparse_attention(q.float(), q.float(), q.float(), m, 16, 16), "supports dtype float16"),
        (lambda q, m: sparse_attention(q, q, q, m[:, :1].expand(3, 1, -1, -1), 16, 16), "batch and heads must be 1 or q's"),
        (lambda q, m: SparseMask.from_dense(m, 16, 16, 0), "seq_len must be a positive int"),
        (lambda q, m: prepare_sparse(m, 16, 16, 64, block_m=8), "block_m must be 16, 32, 64 or 128 and at least q_block=16"),
    ],
)
def test_bad_inputs_raise_sentences(call, message):
    q = random_inputs(1, 64, 2, 32)[0]
    mask = random_mask(1, 2, 64, 16, 16, 0.5)
    with pytest.raises((ValueError, TypeError), match=message):
        call(q, mask)


def test_reference_path_gradients_equal_autograd_through_the_reference(reference_path):
    q, k, v = (t.double().requires_grad_() for t in random_inputs(1, 40, 2, 8))
    mask = random_mask(1, 2, 40, 8, 16, 0.5, seed=10)
    out, lse = sparse_attention(q, k, v, mask, 8, 16, return_lse=True)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse).nan_to_num(0.0)
    got = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    ref_out, ref_lse = sparse_reference(q, k, v, mask, 8, 16, return_lse=True)
    want = torch.autograd.grad((ref_out, ref_lse), (q, k, v), (grad_out, grad_lse))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert torch.isfinite(g).all()


def _model(q, k, v, mask):
    out = sparse_attention(q * 2.0, k, v, mask, 16, 32, merge="consecutive")
    return out, out.float().sum(-1) + 1.0


def test_compiled_fullgraph_equals_eager_without_graph_breaks():
    torch._dynamo.reset()
    q, k, v = random_inputs(1, 100, 2, 32, seed=11)
    mask = random_mask(1, 2, 100, 16, 32, 0.5, seed=11)
    explanation = torch._dynamo.explain(_model)(q, k, v, mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    # Inductor compiles the sparse operator on CPU in tests/test_backward.py (forward and backward), GNA's in test_ops
    compiled = torch.compile(_model, fullgraph=True, backend="aot_eager")
    (out, total), (eager_out, eager_total) = compiled(q, k, v, mask), _model(q, k, v, mask)
    assert torch.equal(out, eager_out)
    torch.testing.assert_close(total, eager_total)


# ---------------------------------------------------------------------------------------------------------
# SpargeAttn's PV skip (pv_threshold): the kernel against the torch reference of the rule (kernels/pvskip.py),
# the reference against float64 attention when nothing is skipped, and the rule worked out by hand.
# Integer q and k with scale 1/4 make every score a multiple of 1/4 computed exactly (fp16 products, fp32
# sums), and the thresholds sit halfway between multiples: the skip decisions are the same in both.


def integer_inputs(batch, n, heads, head_dim, seed, boost=32):
    """q, k in {-1, 0, 1} (k's first `boost` keys tripled, so that later tiles often fall far below them) and
    random v, fp16 on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randint(-1, 2, (batch, n, heads, head_dim), generator=gen).float() for _ in range(2))
    k[:, :boost] *= 3
    v = torch.randn(batch, n, heads, head_dim, generator=gen)
    return [t.to(DEVICE, torch.float16) for t in (q, k, v)]


PV_THRESHOLDS = (-0.625, -1.625, -3.125)  # -(j + 1/2) / 4: never a difference of two scores


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    q_block=st.sampled_from((8, 16, 32)),
    kv_block=st.sampled_from((4, 16, 32)),
    n=st.integers(40, 130),
    density=st.sampled_from((0.4, 0.8, 1.0)),
    merge=st.sampled_from((None, "consecutive", "xor")),
    schedule=st.sampled_from(("grid", "lpt")),
    pv_threshold=st.sampled_from(PV_THRESHOLDS),
    seed=st.integers(0, 1000),
)
def test_pv_skip_kernel_equals_the_reference_of_its_rule(q_block, kv_block, n, density, merge, schedule,
                                                        pv_threshold, seed):
    from natsim.kernels.sparse.reference import sparse_pv_reference

    q, k, v = integer_inputs(1, n, 2, 32, seed)
    mask = random_mask(1, 2, n, q_block, kv_block, density, seed=seed)
    work = prepare_sparse(mask, q_block, kv_block, n, merge=merge)
    out, lse = sparse_attention(q, k, v, work, scale=0.25, return_lse=True, schedule=schedule,
                                pv_threshold=pv_threshold)
    ref_out, ref_lse, ref_skipped = sparse_pv_reference(work, q.float(), k.float(), v.float(), pv_threshold, 0.25)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    counts = sparse_tile_counts(mask, q_block, kv_block, seq_len=n, merge=merge, schedule=schedule, device=DEVICE,
                                pv_threshold=pv_threshold, inputs=(q, k, v), scale=0.25)
    np.testing.assert_array_equal(counts.pv_skipped.reshape(-1), ref_skipped.cpu().numpy())
    assert (counts.pv_skipped <= counts.computed).all()


def test_pv_skip_happens_and_stays_close_to_exact_attention():
    from natsim.kernels.sparse.reference import sparse_pv_reference

    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randint(-1, 2, (1, 128, 2, 32), generator=gen).float() for _ in range(2))
    q[..., :8] = 1  # every query leans towards the first 32 keys: later tiles score about 4 lower
    k[:, :32, :, :8] = 2
    q, k, v = (t.to(DEVICE, torch.float16) for t in (q, k, torch.randn(1, 128, 2, 32, generator=gen)))
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool, device=DEVICE)
    work = prepare_sparse(mask, 16, 16, 128, block_n=16)
    counts = sparse_tile_counts(mask, 16, 16, device=DEVICE, block_n=16, pv_threshold=-3.125, inputs=(q, k, v),
                                scale=0.25)
    assert counts.pv_skipped.sum() > 0.1 * counts.computed.sum()  # the rule fires on these inputs
    skipped = sparse_attention(q, k, v, work, scale=0.25, pv_threshold=-3.125).double().cpu()
    exact = sparse_pv_reference(work, q.double(), k.double(), v.double(), None, 0.25)[0].cpu()
    assert (skipped - exact).abs().sum() / exact.abs().sum() < 0.05  # SpargeAttn's L1 error budget


@pytest.mark.parametrize("merge", [None, "consecutive", "xor"])
def test_pv_reference_without_skips_is_float64_attention(merge):
    from natsim.kernels.sparse.reference import sparse_pv_reference

    q, k, v = (t.double() for t in random_inputs(2, 75, 2, 32, seed=8))
    mask = random_mask(2, 1, 75, 8, 16, 0.5, seed=8)
    mask[0, 0, 2] = False  # an empty query block
    work = prepare_sparse(mask, 8, 16, 75, merge=merge)
    ref_out, ref_lse = dense_softmax(q, k, v, mask, 8, 16)
    for threshold in (None, -1e9):
        out, lse, skipped = sparse_pv_reference(work, q, k, v, threshold)
        torch.testing.assert_close(out.cpu(), ref_out)
        torch.testing.assert_close(lse.cpu(), ref_lse)
        assert skipped.sum() == 0


def two_block_case():
    """One head, N = 32, two query and two key blocks of 16: every query scores 3 against key block 0 (ones
    in v) and 0 against key block 1 (tens in v); scale 1."""
    q = torch.zeros(1, 32, 1, 32)
    k = torch.zeros(1, 32, 1, 32)
    q[..., 0] = 1.0
    k[:, :16, :, 0] = 3.0
    v = torch.cat([torch.ones(1, 16, 1, 32), 10 * torch.ones(1, 16, 1, 32)], 1)
    return q, k, v


@pytest.mark.parametrize("pv_threshold, skipped", [(-2.0, True), (-4.0, False), (None, False)])
def test_pv_skip_rule_by_hand(pv_threshold, skipped):
    # Block 0 comes first (ascending list): running maximum 3. Block 1's maximum 0 is 3 below it: below
    # lambda = -2, so its P @ V is skipped while its exp(0 - 3) per key still counts in the sum; not below -4.
    q, k, v = (t.to(DEVICE, torch.float16) for t in two_block_case())
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE)
    work = prepare_sparse(mask, 16, 16, 32, block_n=16)  # one KV block per tile
    out, lse = sparse_attention(q, k, v, work, scale=1.0, return_lse=True, pv_threshold=pv_threshold)
    e3 = float(np.exp(3.0))
    expected = e3 / (e3 + 1) if skipped else (e3 + 10) / (e3 + 1)
    torch.testing.assert_close(out.float().cpu(), torch.full((1, 32, 1, 32), expected), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.cpu(), torch.full((1, 32, 1), float(np.log(16 * e3 + 16))), atol=1e-4,
                               rtol=1e-4)
    counts = sparse_tile_counts(mask, 16, 16, device=DEVICE, block_n=16, pv_threshold=pv_threshold,
                                inputs=(q, k, v), scale=1.0)
    assert counts.pv_skipped.tolist() == [[[1, 1] if skipped else [0, 0]]]


def test_pv_skip_on_the_reference_path(reference_path):
    q, k, v = two_block_case()
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    # On the CPU path the tiles are the GPU kernel's, 128 keys: both KV blocks of 16 share one tile, whose
    # maximum (3) never falls below the running one: nothing is skipped, as on the GPU.
    out = sparse_attention(q, k, v, mask, 16, 16, scale=1.0, pv_threshold=-2.0)
    e3 = float(np.exp(3.0))
    torch.testing.assert_close(out, torch.full((1, 32, 1, 32), (e3 + 10) / (e3 + 1)))
    # N = 256 in key blocks of 128 (one per tile): block 0 holds the 16 keys scoring 3 (ones in v) and 112
    # scoring 0 (tens); block 1, 128 keys scoring 0 (tens), falls 3 below: skipped, its exp(-3) per key
    # still summed.
    q2 = q[:, :1].expand(1, 256, 1, 32)
    k2 = torch.cat([k[:, :16], torch.zeros(1, 240, 1, 32)], 1)
    v2 = torch.cat([torch.ones(1, 16, 1, 32), torch.full((1, 240, 1, 32), 10.0)], 1)
    mask2 = torch.ones(1, 1, 16, 2, dtype=torch.bool)
    out = sparse_attention(q2, k2, v2, mask2, 16, 128, scale=1.0, pv_threshold=-2.0)
    torch.testing.assert_close(out, torch.full((1, 256, 1, 32), (16 * e3 + 1120) / (16 * e3 + 240)))
    exact = sparse_attention(q2, k2, v2, mask2, 16, 128, scale=1.0)
    torch.testing.assert_close(exact, torch.full((1, 256, 1, 32), (16 * e3 + 2400) / (16 * e3 + 240)))


def test_pv_skip_compiles_and_refuses_bad_thresholds():
    q, k, v = integer_inputs(1, 64, 1, 32, seed=9)
    mask = random_mask(1, 1, 64, 16, 16, 0.7, seed=9)
    for bad in (0, 0.5, float("nan"), float("-inf"), True, "x"):
        with pytest.raises(ValueError, match=r"pv_threshold must be None or a negative finite number"):
            sparse_attention(q, k, v, mask, 16, 16, pv_threshold=bad)
    with pytest.raises(ValueError, match=r"pv_threshold skips products by a data-dependent rule"):
        sparse_attention(q.float().requires_grad_(), k.float(), v.float(), mask, 16, 16, pv_threshold=-1.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: sparse_attention(q, k, v, mask, 16, 16, pv_threshold=-0.625),
                             fullgraph=True, backend="aot_eager")  # the operator under Inductor: above
    assert torch.equal(compiled(q, k, v), sparse_attention(q, k, v, mask, 16, 16, pv_threshold=-0.625))
