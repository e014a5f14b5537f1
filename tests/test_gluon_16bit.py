"""The Gluon kernel's 16-bit variant on the CPU (kernels/gluon/ops.py, `gluon_block_attention` and its operator
`natsim::gluon_16bit_forward`): its CPU path against float64 attention under the expanded block mask, the
operator's contracts (fake tensors, compile), `sparse_attention(..., backend="gluon")` in 16 bits, and the
refusals. The kernel itself runs on Hopper only: tests/test_gluon_16bit_gpu.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from natsim.kernels import sparse_attention
from natsim.kernels.gluon.forward import BLOCK_N, BlockLists
from natsim.kernels.gluon.ops import gluon_16bit_forward, gluon_block_attention


def float64_under_blocks(q, k, v, blocks, scale):
    """Attention in float64 with each query attending the keys of its 128 x 128 blocks, written out element by
    element: the output and the natural-log LSE (0 and -inf for a query with no key)."""
    rows, n_kv = q.shape[1], k.shape[1]
    allowed = blocks.repeat_interleave(BLOCK_N, -2).repeat_interleave(BLOCK_N, -1)[..., :rows, :n_kv]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.where(allowed, torch.exp(scores - lse[..., None].clamp_min(-1e300)), 0.0)
    weights = torch.nan_to_num(weights)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v.double())
    return out, lse.transpose(1, 2)


@settings(max_examples=15, deadline=None)
@given(batch=st.sampled_from([1, 2]), heads=st.sampled_from([1, 3]), rows=st.integers(1, 400),
       head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       density=st.sampled_from([0.0, 0.3, 0.7, 1.0]), shared=st.booleans(), seed=st.integers(0, 2**16))
def test_the_cpu_path_is_float64_attention_under_the_blocks(batch, heads, rows, head_dim, dtype, density, shared,
                                                            seed):
    """Random sizes (sequences that are not whole blocks, one token), masks shared by heads or not, with empty
    query blocks (density 0 empties every one): the output within the dtype's rounding of float64 attention, the
    LSE -inf exactly where a query has no key."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, rows, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    blocks = -(-rows // BLOCK_N)
    mask = torch.rand(batch, 1 if shared else heads, blocks, blocks, generator=gen) < density
    scale = head_dim ** -0.5
    out, lse = gluon_block_attention(q, k, v, mask, return_lse=True)
    ref, ref_lse = float64_under_blocks(q, k, v, mask.expand(batch, heads, -1, -1), scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:-1]
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert float((out.double() - ref).abs().max()) <= tolerance * max(1.0, float(ref.abs().max()))
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert float((lse.double()[finite] - ref_lse[finite]).abs().max()) < 1e-4
    assert torch.equal(out[~finite], torch.zeros_like(out[~finite]))


def test_lists_and_masks_and_no_mask_agree():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 300, 2, 64, generator=gen, dtype=torch.float16) for _ in range(3))
    full = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    dense = gluon_block_attention(q, k, v)
    assert torch.equal(dense, gluon_block_attention(q, k, v, full))
    mask = torch.rand(1, 2, 3, 3, generator=gen) < 0.5
    lists = BlockLists.from_blocks(mask)
    assert torch.equal(gluon_block_attention(q, k, v, mask), gluon_block_attention(q, k, v, lists))


def test_the_operator_has_fake_tensors_and_compiles_fullgraph():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 200, 2, 64, generator=gen, dtype=torch.float16) for _ in range(3))
    lists = BlockLists.from_blocks(torch.rand(2, 2, 2, 2, generator=gen) < 0.6)
    for return_lse in (False, True):
        torch.library.opcheck(gluon_16bit_forward, (q, k, v, lists.counts, lists.indices, 0.1, return_lse),
                              test_utils=("test_schema", "test_faketensor"))
    # aot_eager: the graph capture is what is checked here (no Inductor code runs for a custom operator)
    compiled = torch.compile(gluon_block_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, lists), gluon_block_attention(q, k, v, lists), rtol=0, atol=0)


def test_sparse_attention_naming_gluon_in_16_bits_runs_it():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 256, 2, 128, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(1, 2, 2, 2, generator=gen) < 0.5
    out, lse = sparse_attention(q, k, v, mask, 128, 128, backend="gluon", return_lse=True)
    expected, expected_lse = gluon_block_attention(q, k, v, mask, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


@pytest.mark.parametrize("change, message", [
    (dict(head_dim=96), "runs head_dim 64 or 128, got head_dim=96"),
    (dict(dtype=torch.float32), "16-bit variant runs bfloat16 or float16 inputs"),
])
def test_calls_it_does_not_run_are_refused_with_a_sentence(change, message):
    head_dim, dtype = change.get("head_dim", 64), change.get("dtype", torch.float16)
    q, k, v = (torch.randn(1, 128, 1, head_dim).to(dtype) for _ in range(3))
    with pytest.raises(ValueError, match=message):
        gluon_block_attention(q, k, v)
    with pytest.raises(ValueError, match="backend='gluon' cannot run this call"):
        sparse_attention(q, k, v, torch.ones(1, 1, 1, 1, dtype=torch.bool), 128, 128, backend="gluon")


def test_other_blocks_and_gradients_are_refused():
    q, k, v = (torch.randn(1, 256, 1, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="runs blocks of 128 x 128 tokens, got 64 x 128"):
        sparse_attention(q, k, v, torch.ones(1, 1, 4, 2, dtype=torch.bool), 64, 128, backend="gluon")
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="16-bit variant has no backward pass"):
        gluon_block_attention(q, k, v)
    with pytest.raises(RuntimeError, match="16-bit variant has no backward pass"):
        sparse_attention(q, k, v, torch.ones(1, 1, 2, 2, dtype=torch.bool), 128, 128, backend="gluon")
    with torch.no_grad():
        gluon_block_attention(q, k, v)  # without gradients it runs


def test_prepared_work_that_does_not_fit_q_is_refused_before_any_backend_runs():
    """Prepared work names its sequence length, batch, heads and device: a call that does not fit is refused with
    the same sentence whichever backend would run it."""
    from natsim.kernels import prepare_sparse

    work = prepare_sparse(torch.ones(1, 2, 2, 2, dtype=torch.bool), 128, 128, 256, backward=False)
    q, k, v = (torch.randn(1, 200, 2, 64, dtype=torch.float16) for _ in range(3))
    for backend in ("gluon", "triton", None):
        with pytest.raises(ValueError, match="q must have the mask's seq_len=256 tokens"):
            sparse_attention(q, k, v, work, backend=backend)
    q = torch.randn(1, 256, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="q, k and v must have the same shape"):
        sparse_attention(q, k, v, work, backend="gluon")


def test_cross_attention_scales_and_pv_skips_are_refused_with_a_sentence():
    q = torch.randn(1, 256, 2, 64, dtype=torch.float16)
    k, v = (torch.randn(1, 200, 2, 64, dtype=torch.float16) for _ in range(2))
    with pytest.raises(ValueError, match="attends a sequence to itself: q, k and v must hold as many tokens"):
        gluon_block_attention(q, k, v)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        gluon_block_attention(q, q, q, scale=-0.1)
    with pytest.raises(ValueError, match="pv_threshold runs on natsim's Triton kernel"):
        sparse_attention(q, q, q, torch.ones(1, 1, 2, 2, dtype=torch.bool), 128, 128, backend="gluon",
                         pv_threshold=-5.0)


def test_lists_of_one_batch_element_are_its_rows_of_the_mask():
    gen = torch.Generator().manual_seed(9)
    mask = torch.rand(3, 2, 4, 5, generator=gen) < 0.5
    lists = BlockLists.from_blocks(mask)
    for i in range(3):
        assert torch.equal(lists.of_batch(i).mask(), mask[i:i + 1])
    shared = BlockLists.from_blocks(mask[:1])
    assert shared.of_batch(2) is shared


def test_sparse_attention_takes_the_variant_where_it_was_measured_faster(monkeypatch):
    """The routing rule on fake CUDA tensors of a Hopper GPU (no GPU needed): a 16-bit call on 128 x 128 blocks
    naming no backend takes the variant at head_dim 128 without gradients on the default schedule, and nowhere
    else (head_dim 64, gradients, the LPT schedule, prepared work with FlashAttention-4's lists or naming Triton,
    another GPU); FP8 calls take the FP8 kernel at both head dims; a call naming it with gradients is refused."""
    from dataclasses import replace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from natsim.kernels import prepare_sparse
    from natsim.kernels.sparse import api
    from natsim.kernels.sparse.spec import SparseSpec

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    # the lists themselves (a sort, which fake CUDA tensors do not run) are tested above: here only the route
    monkeypatch.setattr(api.BlockLists, "from_blocks", classmethod(lambda cls, blocks: "lists"))
    work = prepare_sparse(torch.ones(1, 2, 4, 4, dtype=torch.bool), 128, 128, 512, backward=False)

    def routed(head_dim=128, tracked=False, schedule=None, precision=None, backend=None, prepared=None):
        spec = SparseSpec.of(q_block=128, kv_block=128, schedule=schedule, precision=precision)
        with FakeTensorMode(allow_non_fake_inputs=True):
            q = torch.empty(1, 512, 2, head_dim, dtype=torch.bfloat16, device="cuda")
            mask = torch.ones(1, 2, 4, 4, dtype=torch.bool, device="cuda") if prepared is None else prepared
            return api._gluon_blocks(q, mask, spec, None, backend, tracked) == "lists"

    assert routed()
    assert not routed(head_dim=64)
    assert not routed(tracked=True)
    assert not routed(schedule="lpt")
    assert routed(precision="fp8") and routed(head_dim=64, precision="fp8")
    assert routed(head_dim=64, backend="gluon")
    assert not routed(backend="triton")
    assert not routed(prepared=replace(work, fa4=object()))  # FlashAttention-4's lists: it runs them
    assert not routed(prepared=replace(work, requested="triton"))
    with pytest.raises(RuntimeError, match="16-bit variant has no backward pass"):
        routed(tracked=True, backend="gluon")
    capability[0] = (8, 9)  # Ada: no wgmma, no TMA as the kernel uses them
    assert not routed() and not routed(precision="fp8")
