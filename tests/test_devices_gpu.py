"""natsim's entry points on tensors of a GPU that is not the current device (`cuda:1` while `cuda:0` is current,
as after `pipe.to("cuda:1")`): every output and gradient equals the same call's on `cuda:0`. Needs two GPUs:
`pytest -m gpu tests/test_devices_gpu.py` (tests/test_devices.py checks the guard on the CPU)."""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import gna_attention, permute, prepare_sparse, sparse_attention, unpermute

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

LAYOUT, WINDOW, STRIDE = (12, 16, 20), (5, 7, 9), (1, 2, 1)


def _gna(kv_tiling=None, precision=None, backend=None):
    def call(q, k, v):
        return gna_attention(q, k, v, WINDOW, STRIDE, kv_tiling=kv_tiling, precision=precision, backend=backend)
    return call, LAYOUT


def _sparse(prepared=False, precision=None):
    def call(q, k, v):
        generator = torch.Generator(q.device).manual_seed(1)
        mask = torch.rand(2, 4, 24, 24, device=q.device, generator=generator) < 0.4
        if prepared:
            return sparse_attention(q, k, v, prepare_sparse(mask, 128, 128, q.shape[1]), precision=precision)
        return sparse_attention(q, k, v, mask, 128, 128, precision=precision)
    return call, (3000,)


def _plan():
    from natsim import planner

    def call(q, k, v):
        return planner.best(LAYOUT, 0.8, head_dim=64, device=q.device)(q, k, v)
    return call, LAYOUT


def _permuted():
    def call(q, k, v):
        return unpermute(permute(q, (4, 4, 4)) * 2, LAYOUT, (4, 4, 4))
    return call, LAYOUT


CASES = {
    "gna": (_gna(), True), "gna-static": (_gna("static"), True), "gna-dynamic": (_gna("dynamic"), True),
    "gna-triton": (_gna(backend="triton"), True), "gna-fp8": (_gna(precision="fp8"), False),
    "mask": (_sparse(), True), "mask-prepared": (_sparse(True), True), "mask-fp8": (_sparse(precision="fp8"), False),
    "plan": (_plan(), True), "permute": (_permuted(), False),
}


def _run(case: str, device: str) -> list[torch.Tensor]:
    (call, tokens), gradients = CASES[case]
    generator = torch.Generator(device).manual_seed(0)
    q, k, v, grad = (torch.randn(2, *tokens, 4, 64, device=device, dtype=torch.bfloat16, generator=generator)
                     for _ in range(4))
    leaves = [t.requires_grad_(gradients) for t in (q, k, v)]
    out = call(*leaves)
    results = [out] + (list(torch.autograd.grad(out, leaves, grad)) if gradients else [])
    torch.cuda.synchronize(device)
    return [t.detach().float().cpu() for t in results]


@pytest.mark.parametrize("case", list(CASES))
def test_calls_on_a_gpu_that_is_not_current_equal_those_on_the_current_one(case):
    torch.cuda.set_device(0)
    here = _run(case, "cuda:0")
    there = _run(case, "cuda:1")
    assert torch.cuda.current_device() == 0  # the call gave the current device back
    for a, b in zip(there, here):
        assert torch.isfinite(a).all() and float((a - b).norm() / b.norm().clamp_min(1e-30)) < 1e-3
