"""FP8 attention on a CUDA GPU with FP8 tensor cores: `pytest -m gpu tests/test_fp8_gpu.py`.

The kernels' every data path at real sizes against the reference of the same quantization rule and against
float32 attention (GNA: permuted, 1-D in place, dense as 1-D; sparse: descriptor loads and gathered blocks,
merged), inputs given already in float8 with their scales against attention of their dequantized values, and
the operators under torch.compile(fullgraph=True) and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import (Fp8Scales, gna_attention, prepare_sparse, reference_attention, sparse_attention,
                            sparse_reference)
from natsim.kernels.common.fp8 import E4M3, quantize
from natsim.kernels.gna.reference import fp8_reference_attention
from natsim.kernels.sparse.reference import fp8_sparse_reference

pytestmark = pytest.mark.gpu

# The LSE of FP8 scores against float32 attention of the same dequantized values: Hopper's FP8 matrix instructions
# accumulate with fewer mantissa bits than fp32, so scores of magnitude ~10 come out ~1e-4 relative off, and the
# LSE up to ~2e-3 absolute (measured on the H100: at most 1.6e-3 over these tests).
LSE_TOLERANCE = 5e-3


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


def _assert_compiled_and_captured_equal_eager(fn, *args):
    """`fn(*args)` under `torch.compile(fullgraph=True)` and replayed from a CUDA graph gives eager's bits."""
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    fn(*args)  # warm: compiled kernels and cached calls before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape, window, stride, dilation, causal, head_dim", GNA)
def test_gna_fp8_follows_the_rule_at_real_sizes(shape, window, stride, dilation, causal, head_dim):
    """natsim's Triton FP8 kernel against its rule (one K scale per token); the Gluon kernel, which shares K's
    scales over key blocks, against its own in tests/test_gluon_fp8_gpu.py."""
    q, k, v = _qkv(*shape, head_dim=head_dim)
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q, k, v, *args, return_lse=True, precision="fp8", backend="triton")
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
    out, lse = sparse_attention(q, k, v, mask, q_block, kv_block, merge=merge, return_lse=True, precision="fp8",
                                backend="triton")
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

    _assert_compiled_and_captured_equal_eager(both, q, k, v, *flat)


# -- inputs already in float8 -------------------------------------------------------------------------------------


def _to_float8(q, k, v):
    """The test's own quantization: q and k per token and head (`amax / 448`), v per channel over the tokens."""
    tokens = tuple(range(1, q.dim() - 2))
    q_scale, k_scale = (t.float().abs().amax(-1) / 448 for t in (q, k))
    v_scale = v.float().abs().amax(dim=tokens) / 448
    per_channel = v_scale.reshape(v_scale.shape[0], *(1,) * len(tokens), *v_scale.shape[1:])
    return ((q.float() / q_scale[..., None]).to(E4M3), (k.float() / k_scale[..., None]).to(E4M3),
            (v.float() / per_channel).to(E4M3)), Fp8Scales(q_scale, k_scale, v_scale)


def _dequantized(q8, k8, v8, scales):
    per_channel = scales.v_scale.reshape(scales.v_scale.shape[0], *(1,) * (v8.dim() - 3), *scales.v_scale.shape[1:])
    return q8.float() * scales.q_scale[..., None], k8.float() * scales.k_scale[..., None], v8.float() * per_channel


@pytest.mark.parametrize("shape, window, stride, dilation, causal", [
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), 1, False),  # HunyuanVideo, permuted
    ((13, 21, 35), (5, 8, 7), (2, 3, 1), (2, 1, 3), (True, False, False)),  # dilation, causal, padding
    ((8192,), 1024, 1, 1, True),  # 1-D in place
])
def test_gna_on_float8_inputs_is_attention_of_their_dequantized_values(shape, window, stride, dilation, causal):
    (q8, k8, v8), scales = _to_float8(*_qkv(*shape))
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q8, k8, v8, *args, return_lse=True, scales=scales)
    exact, exact_lse = reference_attention(*_dequantized(q8, k8, v8, scales), *args, return_lse=True)
    assert out.dtype == torch.bfloat16
    assert _error(out, exact) < 3e-2  # P's e4m3 rounding only
    assert (lse - exact_lse).abs().max() < LSE_TOLERANCE
    rule = fp8_reference_attention(q8, k8, v8, *args, scales=scales)
    assert _error(out, rule) < 3e-2


def test_float8_inputs_the_rule_would_produce_give_the_rules_attention_bit_for_bit():
    """The rule's own float8 tensors and scales, given: the same bits into the same kernel, the same output (the
    output does not depend on K's mean, which the softmax removes; only the LSE does)."""
    q, k, v = _qkv(13, 21, 35)
    t = quantize(q, k, v)
    as_tokens = lambda x: x.reshape(1, 13, 21, 35, *x.shape[2:])  # noqa: E731
    v8 = as_tokens(t.v_t[..., :13 * 21 * 35].permute(0, 3, 1, 2))
    scales = Fp8Scales(as_tokens(t.q_scale), as_tokens(t.k_scale), t.v_scale)
    got = gna_attention(as_tokens(t.q), as_tokens(t.k), v8, (5, 8, 7), scales=scales)
    assert torch.equal(got, gna_attention(q, k, v, (5, 8, 7), precision="fp8"))


@pytest.mark.parametrize("merge", [None, "xor"])
def test_sparse_on_float8_inputs_is_attention_of_their_dequantized_values(merge):
    n = 8192
    (q8, k8, v8), scales = _to_float8(*_qkv(n, heads=4))
    generator = torch.Generator(device="cuda").manual_seed(2)
    mask = torch.rand(1, 4, n // 128, n // 128, device="cuda", generator=generator) < 0.3
    work = prepare_sparse(mask, 128, 128, n, merge=merge, backward=False)
    out, lse = sparse_attention(q8, k8, v8, work, return_lse=True, scales=scales, out_dtype=torch.float16)
    exact, exact_lse = sparse_reference(*_dequantized(q8, k8, v8, scales), mask, 128, 128, return_lse=True)
    assert out.dtype == torch.float16 and _error(out, exact) < 3e-2
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[finite] - exact_lse[finite]).abs().max() < LSE_TOLERANCE
    assert torch.equal(sparse_attention(q8, k8, v8, mask, 128, 128, merge=merge, scales=scales,
                                        out_dtype=torch.float16), out)


def test_float8_inputs_under_compile_and_cuda_graphs_equal_eager():
    (q8, k8, v8), scales = _to_float8(*_qkv(8, 16, 32, heads=4))
    flat = tuple(t.reshape(1, -1, 4, 128) for t in (q8, k8, v8))
    flat_scales = Fp8Scales(scales.q_scale.reshape(1, -1, 4), scales.k_scale.reshape(1, -1, 4), scales.v_scale)
    mask = torch.rand(1, 4, 32, 32, device="cuda") < 0.5
    work = prepare_sparse(mask, 128, 128, flat[0].shape[1], backward=False)

    def both(q8, k8, v8, fq, fk, fv):  # the sparse call with one scale for all of k, broadcast inside the graph
        return (gna_attention(q8, k8, v8, (5, 7, 9), scales=scales),
                sparse_attention(fq, fk, fv, work, scales=Fp8Scales(flat_scales.q_scale, flat_scales.k_scale.amax(),
                                                                    flat_scales.v_scale)))

    _assert_compiled_and_captured_equal_eager(both, q8, k8, v8, *flat)


def test_fp8_plans_run_on_the_gpu_eager_and_compiled():
    """The planner's FP8 plans on the GPU: an AutoPlan (through natsim::gna_resolved, eager and compiled) and a
    mask plan run what gna_attention / sparse_attention run with precision="fp8"."""
    from natsim.planner import AutoPlan, best_mask

    torch._dynamo.reset()
    q, k, v = _qkv(16, 24, 32)
    auto = AutoPlan(0.8, precision="fp8")
    out = auto(q, k, v)
    (plan,) = auto.plans.values()
    assert plan.precision == "fp8" and plan.tiles.kv_tokens >= 32
    expected = gna_attention(q, k, v, **plan.kernel_arguments())
    assert torch.equal(out, expected)
    assert torch.equal(torch.compile(lambda q, k, v: auto(q, k, v), fullgraph=True)(q, k, v), expected)
    assert _error(out, gna_attention(q, k, v, **{**plan.kernel_arguments(), "precision": None})) < 6e-2
    qs, ks, vs = _qkv(8192)
    mask = torch.rand(1, 2, 128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)) < 0.3
    mask_plan = best_mask(mask, 64, 64, 8192, precision="fp8")
    assert mask_plan.precision == "fp8"
    merge = None if mask_plan.merge == "none" else mask_plan.merge
    pooled = mask_plan.with_mask(mask)
    assert torch.equal(pooled(qs, ks, vs), sparse_attention(qs, ks, vs, pooled.mask, mask_plan.q_block,
                                                            mask_plan.kv_block, merge=merge, precision="fp8",
                                                            backend=mask_plan.backend))


@pytest.mark.parametrize("shape, q_tile, kv_tile, dilation", [
    ((30, 48, 80), (1, 8, 8), (2, 8, 8), (1, 1, 1)),  # HunyuanVideo, the Triton FP8 kernel's tiles
    ((21, 45, 80), (2, 4, 16), (2, 4, 16), (1, 1, 1)),  # Wan 720p, a Gluon tile, padding along 45
    ((13, 21, 35), (2, 4, 8), (2, 8, 8), (2, 1, 3)),  # dilation groups, padding
])
@pytest.mark.parametrize("gluon", [False, True])
def test_quantizing_in_tile_order_is_quantizing_permuted_copies_bit_for_bit(shape, q_tile, kv_tile, dilation, gluon):
    """The quantization kernel reading a layout in tile order (`source_rows`) writes the bits the same kernel
    writes from permuted copies, with K's scales per row (the Triton FP8 kernel) or per block of 128 and V
    key-major (the Gluon kernel)."""
    from natsim.kernels.common.fp8 import column_statistics, quantize_rows
    from natsim.kernels.gna.permute import permute, source_rows

    q, k, v = _qkv(*shape, heads=3)
    k_mean, v_scale = column_statistics(k, v)
    flat = [x.reshape(1, -1, 3, 128) for x in (q, k, v)]
    options = dict(k_block=128 if gluon else 1, v_key_major=gluon, q_dot_mean=True)
    read = quantize_rows(*flat, k_mean, v_scale, **options, q_rows=source_rows(shape, q_tile, dilation, q.device),
                         kv_rows=source_rows(shape, kv_tile, dilation, q.device))
    copied = quantize_rows(permute(q, q_tile, dilation), permute(k, kv_tile, dilation), permute(v, kv_tile, dilation),
                           k_mean, v_scale, **options)
    for name in ("q", "k", "v_t", "q_scale", "k_scale", "q_dot_mean"):
        got, want = getattr(read, name), getattr(copied, name)
        assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got,
                           want.view(torch.uint8) if want.dtype == E4M3 else want), name
