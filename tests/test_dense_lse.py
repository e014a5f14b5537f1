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


def test_the_flash_kernel_takes_unmasked_calls_of_known_counts():
    """The GPU forward's choice: flash without a key mask over at least one key; the memory-efficient kernel under a
    mask, over no key, for queries the caller says are data-dependent, or where torch.compile sees a
    data-dependent count of keys (text with its padding dropped)."""
    k = torch.zeros(1, 3, 2, 8)
    assert dense._takes_flash(k, None, True)
    assert not dense._takes_flash(k, torch.ones(1, 3, dtype=torch.bool), True)
    assert not dense._takes_flash(k[:, :0], None, True)
    assert not dense._takes_flash(k, None, False)
    seen = []

    def kept_keys(x, keep):
        keys = x[:, keep.nonzero()[:, 0]]  # a data-dependent count of keys
        seen.append(dense._takes_flash(keys, None, True))
        return keys.sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(kept_keys, fullgraph=True, backend="eager")(torch.zeros(1, 6, 2, 8),
                                                                  torch.tensor([True, False] * 3))
    assert seen == [False]


@pytest.mark.gpu
def test_the_gpu_path_differentiates_the_lse():
    """The GPU kernels' forward (flash without a key mask, memory-efficient with one) with the written-out backward
    against float64 autograd (bf16): outputs, LSEs and gradients, at key counts that are and are not multiples of
    16 and head dims that are not powers of two."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    for keys, head_dim, masked in ((77, 64, True), (77, 64, False), (333, 72, False), (64, 96, True), (1, 128, False)):
        q, k, v = (torch.randn(2, n, 4, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for n in (300, keys, keys))
        keep = torch.rand(2, keys, device="cuda", generator=gen) < 0.7 if masked else None
        grad_out = torch.randn(2, 300, 4, head_dim, device="cuda", generator=gen)
        grad_lse = torch.randn(2, 300, 4, device="cuda", generator=gen)
        results = []
        for fn, dtype in ((dense.attention_with_lse, torch.bfloat16), (dense._torch_attention_with_lse, torch.float64)):
            inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            out, lse = fn(*inputs, keep, head_dim**-0.5)
            loss = (out.float() * grad_out).sum() + (torch.where(torch.isinf(lse), 0.0, lse).float() * grad_lse).sum()
            results.append((out.detach(), lse.detach(), *torch.autograd.grad(loss, inputs)))
        case = f"keys={keys}, head_dim={head_dim}, masked={masked}"
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
            assert got.shape == want.shape, (case, name, got.shape, want.shape)
            error = float((got.double() - want).norm() / want.norm().clamp_min(1e-12))
            assert error < 2e-2, (case, name, error)
