"""Triton's CPU interpreter and bfloat16: it loads, stores and multiplies bf16 wrongly (Triton 3.9), so natsim's
kernels refuse bf16 CPU tensors there with a sentence instead of answering wrongly; float16 still runs and
matches the float64 reference, and bf16 CPU tensors without the interpreter take the torch reference."""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import chosen_backend, gna_attention, sparse_attention
from natsim.kernels.gna.reference import reference_attention

REFUSAL = r"Triton's CPU interpreter \(TRITON_INTERPRET=1\) computes bfloat16 wrongly"


def test_the_interpreter_itself_still_stores_bfloat16_wrongly(monkeypatch):
    """The premise of the refusal: if a Triton release fixes it, this fails and the refusal can go."""
    import triton
    import triton.language as tl

    @triton.jit
    def double(X, Y, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(Y + offsets, tl.load(X + offsets) * 2)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.linspace(-2, 2, 16).to(torch.bfloat16)
    y = torch.empty_like(x)
    double[(1,)](x, y, 16)
    assert not torch.equal(y, x * 2)


@pytest.mark.parametrize("family", ["gna", "sparse"])
def test_bfloat16_is_refused_in_the_interpreter_and_float16_runs(family, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 16, 2, 32, generator=gen) for _ in range(3))

    def call(dtype):
        a, b, c = (t.to(dtype) for t in (q, k, v))
        if family == "gna":
            return gna_attention(a, b, c, (2, 4, 8))
        flat = [t.reshape(1, -1, 2, 32) for t in (a, b, c)]
        return sparse_attention(*flat, torch.ones(1, 1, 4, 4, dtype=torch.bool), 128, 128).reshape(q.shape)

    with pytest.raises(ValueError, match=REFUSAL):
        call(torch.bfloat16)
    reference = reference_attention(q.double(), k.double(), v.double(), (2, 4, 8) if family == "gna" else (4, 8, 16))
    out = call(torch.float16)
    assert float((out.double() - reference).norm() / reference.norm()) < 5e-3


def test_bfloat16_without_the_interpreter_takes_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 8, 16, 2, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    assert chosen_backend(q, k, v, (2, 4, 8)) == "reference"
    out = gna_attention(q, k, v, (2, 4, 8))
    reference = reference_attention(q.double(), k.double(), v.double(), (2, 4, 8))
    assert float((out.double() - reference).norm() / reference.norm()) < 1e-2
