"""The Gluon kernel's 16-bit variant (kernels/gluon/forward.py on bf16 / fp16 operands) on a Hopper GPU:
against float32 attention under the same block mask (sequences that are not whole blocks, empty rows, both head
dims, both dtypes, the LSE), GNA's partial tiles through the tile mask against float32 GNA, compiled with fullgraph
and replayed in a CUDA graph, and `sparse_attention`'s choice of it. `pytest -m gpu tests/test_gluon_16bit_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from cuda_graphs import replayed_on_new_inputs
from natsim import Problem
from natsim.kernels import reference_attention, sparse_attention
from natsim.kernels.gluon.forward import BLOCK_N, launch_16bit
from natsim.kernels.gluon.ops import gluon_block_attention
from natsim.kernels.gluon.tile_mask import gna_block_lists, gna_tile_mask
from natsim.kernels.gna.permute import permute, unpermute
from natsim.kernels.sparse.reference import sparse_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the Gluon kernel runs on Hopper GPUs"),
]


def block_mask(batch, heads, rows, density, seed):
    blocks = -(-rows // BLOCK_N)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, heads, blocks, blocks, generator=gen) < density
    if blocks > 2:
        mask[0, 0, 1] = False  # a query block with no key block: zeros, LSE -inf
    return mask.cuda()


@pytest.mark.parametrize("rows", [256, 777])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("density", [1.0, 0.4])
def test_matches_float32_attention_under_the_blocks(rows, head_dim, dtype, density):
    gen = torch.Generator(device="cuda").manual_seed(rows + head_dim)
    q, k, v = (torch.randn(2, rows, 3, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    mask = block_mask(2, 3, rows, density, rows)
    out, lse = gluon_block_attention(q, k, v, None if density == 1.0 else mask, return_lse=True)
    reference_mask = torch.ones_like(mask) if density == 1.0 else mask
    ref, ref_lse = sparse_reference(q.float(), k.float(), v.float(), reference_mask, BLOCK_N, BLOCK_N,
                                    return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    # P rounds to the inputs' dtype before P V (bf16: 8 bits, about 2.2e-3 measured on an H200; fp16 2.7e-4)
    assert float((out.float() - ref).norm() / ref.norm()) < (5e-3 if dtype == torch.bfloat16 else 1e-3)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert float((lse[finite] - ref_lse[finite]).abs().max()) < 5e-3
    assert torch.equal(out[~finite], torch.zeros_like(out[~finite]))
    cpu = gluon_block_attention(q.cpu(), k.cpu(), v.cpu(), None if density == 1.0 else mask.cpu())
    assert float((out.cpu().float() - cpu.float()).norm() / cpu.float().norm()) < 5e-3  # the CPU path agrees


@pytest.mark.parametrize("shape, window, stride, dilation, causal, tile", [
    ((6, 10, 13), (3, 5, 7), (1, 2, 3), (2, 1, 1), (True, False, False), (4, 2, 16)),
    ((24, 33), (9, 12), (1, 1), (1, 2), (False, False), (32, 4)),
    ((8, 16, 32), (5, 11, 11), (1, 1, 1), (1, 1, 1), (False, False, False), (1, 8, 16)),
])
def test_gna_partial_tiles_through_the_tile_mask_match_float32_gna(shape, window, stride, dilation, causal, tile):
    """The kernel on tokens in a 128-token tile's order, its lists marking partial tiles and the tile mask masking
    them inside (padding, dilation groups and causal windows among them): float32 GNA on the layout."""
    problem = Problem(shape, window, stride, dilation, causal)
    gen = torch.Generator(device="cuda").manual_seed(len(shape))
    q, k, v = (torch.randn(1, *shape, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    lists, partial = gna_block_lists(problem, tile, q.device)
    assert partial
    mask = gna_tile_mask(problem, tile, q.device)
    ordered = (permute(t, tile, dilation) for t in (q, k, v))
    out, lse = launch_16bit(*ordered, lists, 128 ** -0.5, True, mask)
    out = unpermute(out, shape, tile, dilation)
    lse = unpermute(lse[..., None], shape, tile, dilation)[..., 0]
    ref, ref_lse = reference_attention(q.float(), k.float(), v.float(), window, stride, dilation, causal,
                                       return_lse=True)
    assert float((out.float() - ref).norm() / ref.norm()) < 5e-3
    assert float((lse - ref_lse).abs().max()) < 5e-3


def test_compiled_fullgraph_and_cuda_graph_replay():
    q, k, v = (torch.randn(1, 640, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = block_mask(1, 2, 640, 0.5, 3)
    eager = gluon_block_attention(q, k, v, mask)
    compiled = torch.compile(gluon_block_attention, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), eager, rtol=0, atol=0)
    replayed, fresh = replayed_on_new_inputs(lambda q, k, v: gluon_block_attention(q, k, v, mask), q, k, v)
    torch.testing.assert_close(replayed, fresh, rtol=0, atol=0)


def test_sparse_attention_takes_it_at_head_dim_128_without_gradients_only(monkeypatch):
    """A 16-bit call on 128 x 128 blocks naming no backend: the 16-bit variant at head_dim 128 without gradients
    (where it was measured faster than natsim's Triton kernel), bit for bit the direct call; natsim's Triton
    kernel with gradients, at head_dim 64, or when the call names it."""
    from natsim.kernels.sparse import api

    calls = []
    real = api.gluon_16bit_forward
    monkeypatch.setattr(api, "gluon_16bit_forward", lambda *a: calls.append(1) or real(*a))
    for head_dim in (128, 64):
        q, k, v = (torch.randn(2, 1024, 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = block_mask(2, 2, 1024, 0.5, 11)
        out = sparse_attention(q, k, v, mask, 128, 128)
        triton = sparse_attention(q, k, v, mask, 128, 128, backend="triton")
        assert len(calls) == (head_dim == 128)
        if head_dim == 128:
            assert torch.equal(out, gluon_block_attention(q, k, v, mask))
        assert float((out.float() - triton.float()).norm() / triton.float().norm()) < 5e-3
        calls.clear()
    q, k, v = (torch.randn(2, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q.requires_grad_()
    out = sparse_attention(q, k, v, mask, 128, 128)
    out.sum().backward()  # natsim's Triton kernels train
    assert not calls and q.grad is not None
    with pytest.raises(RuntimeError, match="no backward pass"):
        sparse_attention(q, k, v, mask, 128, 128, backend="gluon")



def test_a_batch_element_never_reads_the_next_ones_values():
    """Sequences that are not whole blocks, batch 2: the first element's last key block runs past its keys; the
    values past them must be zeros, not the next element's (here non-finite), which would turn P's zeros into
    NaN."""
    q, k, v = (torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v[1, :128] = float("nan")
    first = gluon_block_attention(q[:1], k[:1], v[:1])
    both = gluon_block_attention(q, k, v)
    assert torch.isfinite(both[0]).all()
    torch.testing.assert_close(both[:1], first, rtol=0, atol=0)


def test_sparse_attention_on_prepared_work_takes_it_compiled_and_under_cuda_graphs():
    """Work prepared at 128 x 128 blocks, head_dim 128, no gradients: `sparse_attention` takes the variant (its
    lists built from the work's mask on each call), equal to the direct call, compiled with fullgraph and captured
    in a CUDA graph replayed on new inputs."""
    from dataclasses import replace

    from natsim.kernels import prepare_sparse

    q, k, v = (torch.randn(1, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = block_mask(1, 2, 1000, 0.5, 5)
    # without FlashAttention-4's lists, which prepare_sparse adds where it is installed (and which it then runs)
    work = replace(prepare_sparse(mask, 128, 128, 1000, backward=False), fa4=None)
    eager = sparse_attention(q, k, v, work)
    assert torch.equal(eager, gluon_block_attention(q, k, v, mask))
    compiled = torch.compile(lambda q, k, v: sparse_attention(q, k, v, work), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager, rtol=0, atol=0)
    replayed, fresh = replayed_on_new_inputs(lambda q, k, v: sparse_attention(q, k, v, work), q, k, v)
    torch.testing.assert_close(replayed, fresh, rtol=0, atol=0)


def test_a_mask_plan_priced_for_the_variant_runs_it_eagerly_and_compiled_and_refuses_gradients():
    """A mask plan on the variant (picked by 16-bit coefficients that make it cheap, from 64-token blocks pooled
    to 128): its call on its prepared work and its compiled call equal the kernel on the pooled mask, and inputs
    that require grad are refused with the plan's sentence."""
    from dataclasses import replace

    from natsim.planner import best_mask, cost_model_for

    model = cost_model_for(torch.cuda.get_device_name())
    if model is None:
        pytest.skip("no stored cost model for this GPU")
    cheap = {"flops": 1e-16, "narrow_head_flops": 0.0, "blocks": 0.0, "masked_blocks": 0.0, "programs": 0.0,
             "moved_bytes": 0.0, "launch": 1e-6}
    mask = block_mask(1, 2, 1000, 0.3, 7).repeat_interleave(2, -1).repeat_interleave(2, -2)[..., :16, :16]
    # the kernels' predictions alone (at 1,000 tokens every call would take its host time), FlashAttention-4 left out
    plan = best_mask(mask, 64, 64, 1000, cost_model=replace(model, gluon_16bit_coefficients=cheap, host_seconds=None),
                     backends=("triton", "gluon"))
    assert plan.backend == "gluon" and (plan.q_block, plan.kv_block, plan.merge) == (128, 128, "none")
    q, k, v = (torch.randn(1, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = gluon_block_attention(q, k, v, plan.mask.cuda())
    assert torch.equal(plan(q, k, v), expected)
    compiled = torch.compile(lambda q, k, v: plan(q, k, v), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"has no backward pass, and an input requires grad"):
        plan(q.requires_grad_(True), k, v)
