"""FP8 attention on a CUDA GPU with FP8 tensor cores: `pytest -m gpu tests/test_fp8_gpu.py`.

The kernels' every data path at real sizes against the reference of the same quantization rule and against
float32 attention (GNA: permuted, 1-D in place, dense as 1-D; sparse: descriptor loads and gathered blocks,
merged), and the operators under torch.compile(fullgraph=True) and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import gna_attention, prepare_sparse, reference_attention, sparse_attention, sparse_reference
from natsim.kernels.gna.reference import fp8_reference_attention
from natsim.kernels.sparse.reference import fp8_sparse_reference

pytestmark = pytest.mark.gpu


def _error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _qkv(*shape, heads=2, head_dim=128, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, *shape, heads, head_dim, device="cuda", generator=generator) for _ in range(3))
    k = k + 2.0 * torch.randn(1, *(1,) * len(shape), heads, head_dim, device="cuda", generator=generator)
    return tuple(t.bfloat16() for t in (q, k, v))


GNA = [
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), 1, False, 128),  # HunyuanVideo, block-sparse
    ((21, 30, 52), (9, 12, 12), (1, 1, 1), 1, False, 128),  # Wan 480p, masked tiles
    ((13, 21, 35), (5, 8, 7), (2, 3, 1), (2, 1, 3), (True, False, False), 64),  # dilation, causal, padding
    ((8192,), 1024, 1, 1, True, 128),  # 1-D in place
    ((16, 16, 16), (16, 16, 16), 1, 1, False, 64),  # dense: runs as 1-D over the flattened layout
]


@pytest.mark.parametrize("shape, window, stride, dilation, causal, head_dim", GNA)
def test_gna_fp8_follows_the_rule_at_real_sizes(shape, window, stride, dilation, causal, head_dim):
    q, k, v = _qkv(*shape, head_dim=head_dim)
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q, k, v, *args, return_lse=True, precision="fp8")
    rule, rule_lse = fp8_reference_attention(q, k, v, *args, return_lse=True)
    exact = reference_attention(q.float(), k.float(), v.float(), *args)
    assert _error(out, rule) < 3e-2  # P rounded against running maxima (kernel) or final ones (rule)
    assert _error(out, exact) < 6e-2
    assert (lse - rule_lse).abs().max() < 2e-2


@pytest.mark.parametrize("n, q_block, kv_block, merge", [(8192, 128, 128, None), (8000, 64, 64, None),
                                                         (4096, 16, 16, "xor"), (4096, 64, 32, None)])
def test_sparse_fp8_follows_the_rule_at_real_sizes(n, q_block, kv_block, merge):
    q, k, v = _qkv(n, heads=4)
    generator = torch.Generator(device="cuda").manual_seed(1)
    mask = torch.rand(1, 4, -(-n // q_block), -(-n // kv_block), device="cuda", generator=generator) < 0.3
    out, lse = sparse_attention(q, k, v, mask, q_block, kv_block, merge=merge, return_lse=True, precision="fp8")
    rule, rule_lse = fp8_sparse_reference(q, k, v, mask, q_block, kv_block, return_lse=True)
    exact = sparse_reference(q.float(), k.float(), v.float(), mask, q_block, kv_block)
    assert _error(out, rule) < 3e-2 and _error(out, exact) < 6e-2
    finite = torch.isfinite(rule_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[finite] - rule_lse[finite]).abs().max() < 2e-2


def test_fp8_under_compile_and_cuda_graphs_equals_eager():
    q, k, v = _qkv(8, 16, 32, heads=4)
    flat = tuple(t.reshape(1, -1, 4, 128) for t in (q, k, v))
    mask = torch.rand(1, 4, 32, 32, device="cuda") < 0.5
    work = prepare_sparse(mask, 128, 128, flat[0].shape[1], backward=False)

    def both(q, k, v, fq, fk, fv):
        return (gna_attention(q, k, v, (5, 7, 9), precision="fp8"), sparse_attention(fq, fk, fv, work, precision="fp8"))

    eager = both(q, k, v, *flat)
    compiled = torch.compile(both, fullgraph=True)(q, k, v, *flat)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    both(q, k, v, *flat)  # warm: compiled kernels and cached calls before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = both(q, k, v, *flat)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
