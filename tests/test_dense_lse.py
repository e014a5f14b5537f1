"""Dense attention with its LSE (integrations/diffusers/dense.py): the written-out backward, which takes the
LSE's gradient as well as the output's (the GPU path: its kernel's LSE is not differentiated by autograd), against
float64 autograd through plain torch ops, with masked keys, rows whose every key is masked, and chunks of queries
smaller than the sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim.integrations.diffusers import dense


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), queries=st.integers(1, 9), keys=st.integers(1, 7), heads=st.integers(1, 3),
       head_dim=st.sampled_from([4, 8]), masked=st.booleans(), chunk=st.sampled_from([1, 7, 1 << 25]),
       seed=st.integers(0, 2**16))
def test_the_backward_takes_the_lse_gradient(batch, queries, keys, heads, head_dim, masked, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, heads, head_dim, generator=gen, dtype=torch.float64)
               for n in (queries, keys, keys))
    keep = None
    if masked:
        keep = torch.rand(batch, keys, generator=gen) < 0.6
        keep[0] = False  # a batch whose every key is masked: output 0, LSE -inf, no gradient
    grad_out, grad_lse = torch.randn(batch, queries, heads, head_dim, generator=gen), torch.randn(batch, queries, heads,
                                                                                                  generator=gen)
    scale = head_dim**-0.5

    def gradients(fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*inputs, keep, scale)
        finite = torch.isfinite(lse)
        loss = (out * grad_out).sum() + torch.where(finite, lse * grad_lse, 0.0).sum()
        return torch.autograd.grad(loss, inputs, allow_unused=True), out.detach(), lse.detach()

    default, dense.CHUNK_SCORES = dense.CHUNK_SCORES, chunk
    try:
        (dq, dk, dv), out, lse = gradients(dense._DenseWithLse.apply)
    finally:
        dense.CHUNK_SCORES = default
    (rq, rk, rv), ref_out, ref_lse = gradients(dense._torch_attention_with_lse)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        want = torch.zeros_like(got) if want is None else want
        assert torch.allclose(got.double(), want, atol=1e-5), (got - want).abs().max()


@pytest.mark.gpu
def test_the_gpu_path_differentiates_the_lse():
    """The memory-efficient kernel's forward with the written-out backward against float64 autograd (bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for n in (300, 77, 77))
    keep = torch.rand(2, 77, device="cuda", generator=gen) < 0.7
    grad_out, grad_lse = torch.randn(2, 300, 4, 64, device="cuda", generator=gen), torch.randn(2, 300, 4, device="cuda",
                                                                                               generator=gen)
    results = []
    for fn, dtype in ((dense.attention_with_lse, torch.bfloat16), (dense._torch_attention_with_lse, torch.float64)):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*inputs, keep, 0.125)
        loss = (out.float() * grad_out).sum() + (lse.float() * grad_lse).sum()
        results.append(torch.autograd.grad(loss, inputs))
    for got, want in zip(*results):
        error = float((got.double() - want).norm() / want.norm())
        assert error < 2e-2, error
