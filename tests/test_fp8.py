"""FP8 attention (kernels/common/fp8.py): the quantization rule against torch's own float8 conversion, the FP8
kernels (GNA and block-sparse, in the interpreter) against the torch reference that applies the same rule and
against float64 attention, inputs given already in float8 with their scales, the operators under torch.compile,
and the refusals.

The kernels round P against each row's running maximum and the reference against its final one (the rule
allows both), so kernel and reference agree bit for bit only where a row meets all its keys in one tile; with
several tiles they differ by P's rounding, well inside FP8's error against exact attention.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from natsim.kernels import (Fp8Scales, SparseMask, gna_attention, prepare_sparse, reference_attention,
                            sparse_attention)
from natsim.kernels.common import fp8
from natsim.kernels.common.fp8 import (E4M3, E4M3_MAX, cast_e4m3, check_fp8_call, column_statistics,
                                       key_major_positions, lse_with_mean, quantize, quantize_rows, quantized_weights,
                                       round_to_e4m3, fp8_q_tile)
from natsim.kernels.gna.permute import permute_reference, source_rows
from natsim.kernels.gna.reference import fp8_reference_attention
from natsim.kernels.sparse.reference import fp8_sparse_reference, sparse_reference

EXACT_VS_FP8 = 8e-2  # FP8 output against float64 attention, random Gaussian inputs (the bound: 6e-2 at size)
KERNEL_VS_RULE = 3e-2  # the kernels against the reference of the same rule (P's rounding order only)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- the quantization rule --------------------------------------------------------------------------------------


def test_quantize_keeps_each_value_within_e4m3_rounding_and_removes_k_mean():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 7, 3, 32, generator=generator) * torch.rand(2, 5, 7, 3, 1, generator=generator) * 9
               for _ in range(3))
    k = k + torch.randn(2, 1, 1, 3, 32, generator=generator) * 4  # a common component per head
    t = quantize(q, k, v)
    rows = 35
    assert t.q.dtype == t.k.dtype == t.v_t.dtype == E4M3
    assert t.q.shape == t.k.shape == (2, rows, 3, 32) and t.q_scale.shape == (2, rows, 3)
    assert t.v_t.shape == (2, 3, 32, 48) and not t.v_t[..., rows:].float().any()  # rows padded to 16, zeros
    mean = k.float().mean(dim=(1, 2))
    assert torch.allclose(t.k_mean, mean, atol=1e-5)
    q_d, k_d, v_d = t.dequantized()
    flat = lambda x: x.reshape(2, rows, 3, 32)  # noqa: E731
    # e4m3 keeps 3 mantissa bits: every value within half a step (2**-4 relative) of its original, or within
    # the smallest subnormal step of its row's scale.
    for got, want, scale in ((q_d, flat(q), t.q_scale[..., None]), (k_d, flat(k) - mean[:, None], t.k_scale[..., None]),
                             (v_d, flat(v), t.v_scale[:, None])):
        assert ((got - want).abs() <= want.abs() * 2**-4 + scale * 2**-10 + 1e-6).all()
    # Each row's (Q, K) or channel's (V) largest value lands on 448.
    assert torch.allclose(t.q.float().abs().amax(-1), torch.full((2, rows, 3), E4M3_MAX))
    assert torch.allclose(t.v_t[..., :rows].float().abs().amax(-1), torch.full((2, 3, 32), E4M3_MAX))


def test_the_quantization_kernel_equals_the_torch_rule_bit_for_bit(monkeypatch):
    """`quantize_rows` runs a Triton kernel on CUDA tensors and in the interpreter, torch elsewhere: the same
    bits (the interpreter's division and rounding are IEEE, as torch's)."""
    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 70, 3, 32, generator=generator, dtype=torch.float16) * 5 for _ in range(3))
    k_mean, v_scale = column_statistics(k, v)
    kernel = quantize_rows(q, k, v, k_mean, v_scale)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch_rule = quantize_rows(q, k, v, k_mean, v_scale)
    for name in ("q", "k", "v_t", "q_scale", "k_scale"):
        got, want = getattr(kernel, name), getattr(torch_rule, name)
        assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got,
                           want.view(torch.uint8) if want.dtype == E4M3 else want), name


@settings(max_examples=6, deadline=None)
@given(tokens=st.one_of(st.tuples(st.integers(1, 300)), st.tuples(*[st.integers(1, 24)] * 2),
                        st.tuples(*[st.integers(1, 10)] * 3)),
       head_dim=st.sampled_from([16, 24, 40, 72]),
       seed=st.integers(0, 2**16))
def test_one_pass_statistics_equal_torchs_reductions(tokens, head_dim, seed):
    """K's mean and V's channel scales from the Triton pass (chunks of rows that are not whole blocks, 1-D to 3-D
    tokens, widths that are not powers of two) against torch's reductions in float64; the scales exactly."""
    generator = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, *tokens, 3, head_dim, generator=generator).half() * 4 for _ in range(2))
    k_mean, v_scale = column_statistics(k, v)  # the interpreter: the Triton pass
    dims = tuple(range(1, k.dim() - 2))
    assert k_mean.dtype == v_scale.dtype == torch.float32 and k_mean.shape == v_scale.shape == (2, 3, head_dim)
    assert torch.allclose(k_mean.double(), k.double().mean(dims), rtol=1e-5, atol=1e-6)
    assert torch.equal(v_scale, v.float().abs().amax(dims) / E4M3_MAX)


def test_one_pass_statistics_span_several_chunks(monkeypatch):
    """Rows over several of the kernel's chunks (made small here) and a last chunk that is not whole."""
    monkeypatch.setattr(fp8, "STATISTICS_ROWS", 64)
    monkeypatch.setattr(fp8, "STATISTICS_BLOCK", 16)
    generator = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 200, 2, 24, generator=generator).half() for _ in range(2))
    k_mean, v_scale = column_statistics(k, v)
    assert torch.allclose(k_mean.double(), k.double().mean(1), rtol=1e-5, atol=1e-6)
    assert torch.equal(v_scale, v.float().abs().amax(1) / E4M3_MAX)


@pytest.mark.parametrize("head_dim, q_rows, k_rows", [(32, 70, 70), (40, 70, 45), (40, 33, 70)])
def test_quantization_takes_q_dot_mean_in_its_read_of_q(head_dim, q_rows, k_rows, monkeypatch):
    """`q . mean(k)` per row of q from the quantization kernel (the interpreter) and from torch, against float64;
    and the LSE it completes equals `lse_with_mean`'s. q and k may have different row counts (their tiles pad
    them differently in the GNA kernels' order)."""
    generator = torch.Generator().manual_seed(head_dim + q_rows)
    q, k, v = (torch.randn(2, rows, 3, head_dim, generator=generator, dtype=torch.float16) * 3 + 1
               for rows in (q_rows, k_rows, k_rows))
    k_mean, v_scale = column_statistics(k, v)
    want = (q.double() * k_mean.double()[:, None]).sum(-1)
    kernel = quantize_rows(q, k, v, k_mean, v_scale, q_dot_mean=True)
    assert quantize_rows(q, k, v, k_mean, v_scale).q_dot_mean is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch_rule = quantize_rows(q, k, v, k_mean, v_scale, q_dot_mean=True)
    for dots in (kernel.q_dot_mean, torch_rule.q_dot_mean):
        assert dots.shape == (2, q_rows, 3) and torch.allclose(dots.double(), want, rtol=1e-5, atol=1e-4)
    lse = torch.randn(2, q_rows, 3)
    assert torch.allclose(lse + 0.125 * kernel.q_dot_mean, lse_with_mean(lse, q, k_mean, 0.125), atol=1e-4)


@st.composite
def permuted_orders(draw):
    """A 1-3-D layout with Q and KV tiles and a dilation per dimension (padding, uneven groups)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    tiles = [tuple(draw(st.integers(1, 4)) for _ in range(ndim)) for _ in range(2)]
    dilation = tuple(draw(st.integers(1, min(3, n))) for n in shape)
    return shape, *tiles, dilation


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=permuted_orders(), head_dim=st.sampled_from([16, 40, 64]), k_block=st.sampled_from([1, 4]),
       key_major=st.booleans(), seed=st.integers(0, 2**16))
def test_quantizing_in_the_permuted_order_is_quantizing_the_permuted_copies(order, head_dim, k_block, key_major,
                                                                            seed, monkeypatch):
    """`quantize_rows` with `q_rows` / `kv_rows` reads the layout in the permuted order as it quantizes (no
    permuted copy): the bits of quantizing `permute_reference`'s copies, padding rows zeros of scale 1, in the
    interpreter (the GPU's kernel) and on the torch path."""
    shape, q_tile, kv_tile, dilation = order
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, *shape, 2, head_dim, generator=generator, dtype=torch.float16) * 4 for _ in range(3))
    k_mean, v_scale = column_statistics(k, v)
    flat = [x.reshape(1, -1, 2, head_dim) for x in (q, k, v)]
    copies = [permute_reference(q, q_tile, dilation), permute_reference(k, kv_tile, dilation),
              permute_reference(v, kv_tile, dilation)]
    rows = dict(q_rows=source_rows(shape, q_tile, dilation, torch.device("cpu")),
                kv_rows=source_rows(shape, kv_tile, dilation, torch.device("cpu")))
    options = dict(k_block=k_block, v_key_major=key_major, q_dot_mean=True)
    for interpreter in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpreter)
        read = quantize_rows(*flat, k_mean, v_scale, **options, **rows)
        copied = quantize_rows(*copies, k_mean, v_scale, **options)
        for name in ("q", "k", "v_t", "q_scale", "k_scale", "q_dot_mean"):
            got, want = getattr(read, name), getattr(copied, name)
            assert got.shape == want.shape, name
            assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got,
                               want.view(torch.uint8) if want.dtype == E4M3 else want), (name, interpreter)
        padding = rows["q_rows"] < 0
        assert not read.q[:, padding].float().any() and bool((read.q_scale[:, padding] == 1).all())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 300), head_dim=st.sampled_from([16, 32, 40]), seed=st.integers(0, 2**16))
def test_key_major_v_is_the_natural_v_with_keys_moved_within_blocks_of_128(rows, head_dim, seed, monkeypatch):
    """The Gluon kernel's V: each key's column moved within its block of 128 to where the kernel stores that
    key's P (a thread's scores `8 g + 2 q + e` to `32 q + 2 g + e`), rows padded to 128 with zeros; the
    interpreted kernel writes what torch writes, and `dequantized` gives back the natural order."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, rows, 2, head_dim, generator=generator) * 3 for _ in range(3))
    natural = quantize(q, k, v, k_block=1)
    key_major = quantize(q, k, v, k_block=1, v_key_major=True)
    padded = -(-rows // 128) * 128
    assert key_major.v_t.shape == (1, 2, head_dim, padded)
    positions = key_major_positions(rows, "cpu")
    for r in range(rows):  # the position, written out from the register layout
        j = r % 128
        g, quarter, e = j // 8, j // 2 % 4, j % 2
        assert int(positions[r]) == r - j + 32 * quarter + 2 * g + e
    assert len(set(positions.tolist())) == rows and int(positions.max()) < padded
    assert torch.equal(key_major.v_t[..., positions].view(torch.uint8), natural.v_t[..., :rows].view(torch.uint8))
    spare = torch.ones(padded, dtype=torch.bool)
    spare[positions] = False
    assert not key_major.v_t[..., spare].float().any()
    for got, want in zip(key_major.dequantized(), natural.dequantized()):
        assert torch.equal(got, want)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = quantize(q, k, v, k_block=1, v_key_major=True)
    assert torch.equal(interpreted.v_t.float(), key_major.v_t.float())  # values (the two may sign a zero apart)


def test_zero_rows_quantize_to_zero_with_scale_one():
    q = torch.zeros(1, 4, 2, 32)
    q[0, 1] = 1.0
    t = quantize(q, q, q)
    assert t.q_scale[0, 0].tolist() == [1.0, 1.0] and not t.q[0, 0].float().any()


@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, cast_e4m3(tl.load(X + offsets), True))


def test_the_interpreters_rounding_of_p_equals_torchs_float8_conversion():
    """`cast_e4m3` with EXACT_CAST (what the kernels run in the interpreter) rounds as torch does: nearest, ties
    to even, subnormals included, 448 saturating."""
    generator = torch.Generator().manual_seed(1)
    x = torch.cat([torch.rand(4000, generator=generator) * 448, torch.rand(2000, generator=generator) * 2**-5,
                   torch.exp2(torch.arange(-12, 9).float()), torch.tensor([0.0, 448.0, 2**-10, 3 * 2**-10])])
    x = torch.cat([x, torch.zeros(8192 - x.numel())])
    y = torch.empty(8192, dtype=E4M3)
    _cast_kernel[(1,)](x, y, N=8192)
    assert torch.equal(y.float(), x.to(E4M3).float())
    assert torch.equal(round_to_e4m3(x), x.to(E4M3).float())


def test_quantized_weights_are_e4m3_values_over_the_softmax_sum():
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(6, 50, generator=generator, dtype=torch.float64) * 3
    scores[0, 10:] = float("-inf")
    scores[1] = float("-inf")  # a row with no key
    weights = quantized_weights(scores)
    exact = torch.softmax(scores, -1).nan_to_num(0.0)
    assert not weights[1].any()
    finite = scores.isfinite()
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    numerators = weights * e.nan_to_num(0.0).sum(-1, keepdim=True) * E4M3_MAX
    assert torch.allclose(numerators[finite.any(-1)], numerators[finite.any(-1)].to(E4M3).double(), rtol=1e-12)
    assert ((weights - exact).abs() <= exact * 2**-4 + 2**-9 / E4M3_MAX).all()


def test_quantized_weights_over_the_rounded_sum_add_up_to_one():
    """The Gluon kernel's sum (its tensor cores add P up as rounded): each row's weights sum to 1, and they
    differ from the exact sum's by the rounding errors' mean only."""
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(5, 300, generator=generator, dtype=torch.float64) * 2
    scores[0, 40:] = float("-inf")
    scores[1] = float("-inf")
    rounded = quantized_weights(scores, "rounded")
    exact = quantized_weights(scores)
    assert not rounded[1].any()
    sums = rounded.sum(-1)
    torch.testing.assert_close(sums[[0, 2, 3, 4]], torch.ones(4, dtype=torch.float64), rtol=1e-12, atol=0)
    assert (rounded - exact).abs().max() <= 2e-2 * exact.abs().max()
    with pytest.raises(ValueError, match="p_sum is one of"):
        quantized_weights(scores, "fp32")


def test_lse_with_mean_restores_the_unsmoothed_scores_log_sum_exp():
    generator = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 9, 2, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    k = k + 3.0
    mean = k.mean(1)
    scale = 0.25
    smoothed = torch.logsumexp(torch.einsum("bqhd,bkhd->bhqk", q, k - mean[:, None]) * scale, -1).transpose(1, 2)
    direct = torch.logsumexp(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale, -1).transpose(1, 2)
    assert torch.allclose(lse_with_mean(smoothed, q, mean, scale), direct, atol=1e-12)


# -- the GNA kernel in the interpreter --------------------------------------------------------------------------


def _video_like(shape, heads, generator, dtype=torch.float16):
    """q, k, v with keys that share a large common component, as real models' do (what smoothing is for)."""
    q, k, v = (torch.randn(1, *shape, heads, 32, generator=generator) for _ in range(3))
    k = k + 2.0 * torch.randn(1, *(1,) * len(shape), heads, 32, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype)


GNA_CASES = [
    # shape, window, stride, dilation, causal, q_tile, kv_tile: borders, even windows, stride = window,
    # dilation, causal, padding (sizes not multiples of the tiles), 1-D/2-D/3-D
    ((4, 5, 7), (3, 4, 5), (1, 2, 1), 1, False, (2, 2, 4), (2, 2, 4)),
    ((8, 4, 6), (4, 4, 3), (4, 1, 3), (2, 1, 1), (True, False, False), (2, 2, 4), (1, 4, 4)),
    ((9, 13), (4, 6), (2, 3), (1, 2), (False, True), (4, 4), (4, 4)),
    ((37,), (10,), (1,), (1,), (True,), (16,), (16,)),
]


@pytest.mark.parametrize("shape, window, stride, dilation, causal, q_tile, kv_tile", GNA_CASES)
def test_gna_fp8_kernel_follows_the_rule_and_stays_near_exact_attention(shape, window, stride, dilation, causal,
                                                                        q_tile, kv_tile):
    generator = torch.Generator().manual_seed(sum(shape))
    q, k, v = _video_like(shape, 1, generator)
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q, k, v, *args, q_tile=q_tile, kv_tile=kv_tile, return_lse=True, precision="fp8")
    rule, rule_lse = fp8_reference_attention(q, k, v, *args, return_lse=True)
    exact, exact_lse = reference_attention(q.double(), k.double(), v.double(), *args, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert _error(out, rule) < KERNEL_VS_RULE
    assert _error(out, exact) < EXACT_VS_FP8
    assert (lse - rule_lse).abs().max() < 2e-2
    assert (lse.double() - exact_lse).abs().max() < 0.2


def test_gna_fp8_kernel_equals_the_rule_where_every_row_meets_its_keys_in_one_tile():
    generator = torch.Generator().manual_seed(4)
    q, k, v = _video_like((48,), 2, generator)
    out = gna_attention(q, k, v, 48, q_tile=16, kv_tile=64, precision="fp8")
    assert _error(out, fp8_reference_attention(q, k, v, 48)) < 1e-3


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@example(data=None)
def test_gna_fp8_on_random_problems(data):
    if data is None:  # the explicit example: a window as large as the layout (dense)
        shape, window, stride, causal = (4, 6), (4, 6), (1, 1), (False, False)
    else:
        ndim = data.draw(st.integers(1, 3))
        shape = tuple(data.draw(st.integers(3, 7)) for _ in range(ndim))
        window = tuple(data.draw(st.integers(2, s)) for s in shape)
        stride = tuple(data.draw(st.integers(1, w)) for w in window)
        causal = tuple(data.draw(st.booleans()) for _ in range(ndim))
    generator = torch.Generator().manual_seed(hash((shape, window)) % 1000)
    q, k, v = _video_like(shape, 1, generator)
    tile = {1: (16,), 2: (4, 4), 3: (2, 2, 4)}[len(shape)]
    out = gna_attention(q, k, v, window, stride, 1, causal, q_tile=tile, kv_tile=tile, precision="fp8")
    exact = reference_attention(q.double(), k.double(), v.double(), window, stride, 1, causal)
    assert _error(out, fp8_reference_attention(q, k, v, window, stride, 1, causal)) < KERNEL_VS_RULE
    assert _error(out, exact) < EXACT_VS_FP8


# -- the sparse kernel in the interpreter -----------------------------------------------------------------------


@pytest.mark.parametrize("n, q_block, kv_block, merge", [(100, 16, 32, None), (128, 16, 16, "xor"),
                                                         (96, 32, 8, "consecutive")])
def test_sparse_fp8_kernel_follows_the_rule_on_random_masks(n, q_block, kv_block, merge):
    generator = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, n, 2, 32, generator=generator, dtype=torch.float16) for _ in range(3))
    k = k + 1.5
    mask = torch.rand(2, 2, -(-n // q_block), -(-n // kv_block), generator=generator) < 0.5
    mask[0, 0, 1] = False  # a query block that attends nothing: output 0, LSE -inf
    out, lse = sparse_attention(q, k, v, mask, q_block, kv_block, merge=merge, return_lse=True, precision="fp8")
    rule, rule_lse = fp8_sparse_reference(q, k, v, mask, q_block, kv_block, return_lse=True)
    exact, exact_lse = sparse_reference(q.double(), k.double(), v.double(), mask, q_block, kv_block, return_lse=True)
    assert _error(out, rule) < KERNEL_VS_RULE and _error(out, exact) < EXACT_VS_FP8
    assert torch.equal(torch.isfinite(lse), torch.isfinite(exact_lse))
    assert not out[0, q_block:2 * q_block, 0].float().any()
    finite = torch.isfinite(exact_lse)
    assert (lse[finite] - rule_lse[finite]).abs().max() < 2e-2
    # A prepared mask runs the same kernel with the same work: bit for bit.
    work = prepare_sparse(mask, q_block, kv_block, n, merge=merge, backward=False)
    assert torch.equal(sparse_attention(q, k, v, work, precision="fp8"), out)


def test_sparse_fp8_kernel_equals_the_rule_where_a_row_meets_its_keys_in_one_tile():
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 64, 2, 32, generator=generator, dtype=torch.float16) for _ in range(3))
    mask = torch.rand(1, 2, 4, 1, generator=generator) < 2  # every block attends the one 64-key block
    out = sparse_attention(q, k, v, mask, 16, 64, precision="fp8")
    assert _error(out, fp8_sparse_reference(q, k, v, mask, 16, 64)) < 1e-3


# -- operators, the CPU path, refusals ---------------------------------------------------------------------------


def test_fp8_calls_compile_with_fullgraph_and_equal_eager():
    generator = torch.Generator().manual_seed(6)
    q, k, v = _video_like((4, 4, 4), 1, generator)
    mask = torch.rand(1, 1, 4, 2, generator=generator) < 0.7
    flat = tuple(t.reshape(1, 64, 1, 32) for t in (q, k, v))

    def both(q, k, v, flat_q, flat_k, flat_v):
        return (gna_attention(q, k, v, 3, q_tile=(1, 4, 4), kv_tile=(1, 4, 4), precision="fp8"),
                sparse_attention(flat_q, flat_k, flat_v, mask, 16, 32, precision="fp8"))

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")  # Inductor: tests/test_fp8_gpu.py
    for got, want in zip(compiled(q, k, v, *flat), both(q, k, v, *flat)):
        assert torch.equal(got, want)


def test_cpu_tensors_run_the_reference_of_the_rule(reference_path):
    generator = torch.Generator().manual_seed(7)
    q, k, v = _video_like((5, 6), 2, generator)
    assert torch.equal(gna_attention(q, k, v, 3, precision="fp8"), fp8_reference_attention(q, k, v, 3))
    flat = tuple(t.reshape(1, 30, 2, 32) for t in (q, k, v))
    mask = torch.rand(1, 2, 2, 2, generator=generator) < 0.6
    assert torch.equal(sparse_attention(*flat, mask, 16, 16, precision="fp8"),
                       fp8_sparse_reference(*flat, mask, 16, 16))


def test_fp8_refuses_gradients_and_what_it_does_not_run():
    q = torch.randn(1, 8, 8, 1, 32, dtype=torch.float16, requires_grad=True)
    with pytest.raises(RuntimeError, match="for inference and has no backward pass.*Train in bfloat16"):
        gna_attention(q, q, q, 3, precision="fp8")
    with torch.no_grad():
        assert gna_attention(q, q, q, 3, q_tile=4, kv_tile=4, precision="fp8").shape == q.shape
    flat = torch.randn(1, 32, 1, 32, dtype=torch.float16)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="for inference"):
        sparse_attention(flat.requires_grad_(), flat, flat, mask, 16, 16, precision="fp8")
    flat = flat.detach()
    with pytest.raises(ValueError, match="precision must be None .* or 'fp8', got precision='fp16'"):
        gna_attention(flat, flat, flat, 3, precision="fp16")
    with pytest.raises(ValueError, match="does not run with the PV skip"):
        sparse_attention(flat, flat, flat, mask, 16, 16, precision="fp8", pv_threshold=-5.0)
    p = torch.randn(1, 8, 8, 1, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="static KV tiling only"):
        gna_attention(p, p, p, 3, kv_tiling="dynamic", precision="fp8")
    with pytest.raises(ValueError, match="frame_offsets"):
        gna_attention(p, p, p, 3, frame_offsets=(0, 0, 8), precision="fp8")


def test_fp8_error_on_gaussian_inputs_is_what_the_rule_predicts():
    """At 1,024 tokens (nearly uniform attention, where rounding does not average out) the rule's error against
    exact attention is the few per cent an FP8 format gives: under the issue's 6e-2, above bf16's."""
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 1024, 2, 64, generator=generator) for _ in range(3))
    dense = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    exact = sparse_reference(q.double(), k.double(), v.double(), dense, 128, 128)
    error = _error(fp8_sparse_reference(q, k, v, dense, 128, 128), exact)
    bf16 = _error(sparse_reference(*(t.bfloat16() for t in (q, k, v)), dense, 128, 128), exact)
    assert bf16 < error < 6e-2, (bf16, error)
    assert math.isfinite(error)


def test_fp8_halves_natsims_128_query_tiles_along_their_first_long_dimension():
    assert fp8_q_tile((2, 8, 8)) == (1, 8, 8)
    assert fp8_q_tile((1, 1, 128)) == (1, 1, 64)
    assert fp8_q_tile((128,)) == (64,)
    assert fp8_q_tile((4, 4, 4)) == (4, 4, 4)  # 64 queries already


# -- inputs already in float8, with their scales ------------------------------------------------------------------


def _to_float8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The test's own quantization, written apart from kernels/common/fp8.py: q and k per token and head
    (`amax / 448`), v per channel over the tokens; no K mean. Returns the float8 tensors and their scales."""
    tokens = tuple(range(1, q.dim() - 2))
    q_scale, k_scale = (t.float().abs().amax(-1) / E4M3_MAX for t in (q, k))
    v_scale = v.float().abs().amax(dim=tokens) / E4M3_MAX  # [B, heads, head_dim]
    q8 = (q.float() / q_scale[..., None]).to(E4M3)
    k8 = (k.float() / k_scale[..., None]).to(E4M3)
    v8 = (v.float() / _per_channel(v_scale, v)).to(E4M3)
    return (q8, k8, v8), Fp8Scales(q_scale, k_scale, v_scale)


def _per_channel(v_scale: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`[B, heads, head_dim]` channel scales viewed against `[B, *tokens, heads, head_dim]` values."""
    return v_scale.reshape(v_scale.shape[0], *(1,) * (v.dim() - 3), *v_scale.shape[1:])


def _dequantized(q8, k8, v8, scales: Fp8Scales):
    """The values a call on float8 inputs attends, in float64."""
    return (q8.double() * scales.q_scale.double()[..., None], k8.double() * scales.k_scale.double()[..., None],
            v8.double() * _per_channel(scales.v_scale.double(), v8))


P_ROUNDING = 3e-2  # FP8 attention of given float8 values against exact attention of the same values: P's e4m3


GIVEN_GNA_CASES = [
    # shape, window, stride, dilation, causal, tile, heads, out_dtype: 3-D permuted (padding, causal, stride),
    # 2-D permuted (dilation), 1-D read in place
    ((3, 4, 5), (2, 3, 3), (1, 2, 1), 1, (True, False, False), (1, 4, 4), 1, None),
    ((9, 6), (4, 3), (2, 1), (1, 2), False, (4, 4), 1, None),
    ((37,), 10, 1, 1, True, 16, 2, torch.float16),
]


@pytest.mark.parametrize("shape, window, stride, dilation, causal, tile, heads, out_dtype", GIVEN_GNA_CASES)
def test_gna_on_float8_inputs_is_attention_of_their_dequantized_values(shape, window, stride, dilation, causal,
                                                                       tile, heads, out_dtype):
    generator = torch.Generator().manual_seed(20 + len(shape))
    (q8, k8, v8), scales = _to_float8(*_video_like(shape, heads, generator, torch.float32))
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q8, k8, v8, *args, q_tile=tile, kv_tile=tile, return_lse=True, scales=scales,
                             out_dtype=out_dtype)
    exact, exact_lse = reference_attention(*_dequantized(q8, k8, v8, scales), *args, return_lse=True)
    assert out.dtype == (out_dtype or torch.bfloat16) and out.shape == q8.shape
    assert _error(out, exact) < P_ROUNDING
    # No mean is applied and the sum counts P unrounded: the LSE is the dequantized scores' own.
    assert (lse.double() - exact_lse).abs().max() < 1e-4
    rule = fp8_reference_attention(q8, k8, v8, *args, scales=scales, out_dtype=out_dtype)
    assert rule.dtype == out.dtype and _error(out, rule) < KERNEL_VS_RULE


def test_sparse_on_float8_inputs_is_attention_of_their_dequantized_values():
    generator = torch.Generator().manual_seed(21)
    n, q_block, kv_block = 80, 16, 32
    (q8, k8, v8), scales = _to_float8(*(torch.randn(1, n, 2, 32, generator=generator) for _ in range(3)))
    mask = torch.rand(1, 2, -(-n // q_block), -(-n // kv_block), generator=generator) < 0.6
    mask[0, 1, 2] = False  # a query block that attends nothing: output 0, LSE -inf
    out, lse = sparse_attention(q8, k8, v8, mask, q_block, kv_block, return_lse=True, scales=scales)
    exact, exact_lse = sparse_reference(*_dequantized(q8, k8, v8, scales), mask, q_block, kv_block, return_lse=True)
    assert out.dtype == torch.bfloat16 and _error(out, exact) < P_ROUNDING
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[finite].double() - exact_lse[finite]).abs().max() < 1e-4
    assert not out[0, 2 * q_block:3 * q_block, 1].float().any()
    # Prepared work, its query blocks merged: the same attention (each row under its own block's mask row).
    work = prepare_sparse(mask, q_block, kv_block, n, merge="xor", backward=False)
    merged = sparse_attention(q8, k8, v8, work, scales=scales, out_dtype=torch.float16)
    assert merged.dtype == torch.float16 and _error(merged, exact) < P_ROUNDING


def _zero_mean_inputs(shape: tuple[int, ...], generator: torch.Generator):
    """fp16 q, k, v (Triton's interpreter computes bf16 wrongly) whose k has a mean over the tokens of exactly 0
    in float32 (multiples of 1/4, the second half of the tokens the first half negated: every partial sum is
    exact), so that the rule removes nothing."""
    q, v = (torch.randn(1, *shape, 1, 32, generator=generator).half() for _ in range(2))
    half = torch.randint(-16, 17, (1, math.prod(shape) // 2, 1, 32), generator=generator) / 4
    k = torch.cat([half, -half], dim=1).reshape(1, *shape, 1, 32).half()
    return q, k, v


def test_float8_inputs_that_the_rule_would_produce_give_the_rules_attention_bit_for_bit():
    """Given what `precision='fp8'` quantizes fp16 inputs to (K's mean exactly 0), the call on the float8 tensors
    runs the same kernel on the same bits: GNA (3-D, permuted) and sparse, output and LSE."""
    generator = torch.Generator().manual_seed(22)
    q, k, v = _zero_mean_inputs((2, 4, 4), generator)
    t = quantize(q, k, v)
    assert not t.k_mean.any()
    as_tokens = lambda x: x.reshape(1, 2, 4, 4, *x.shape[2:])  # noqa: E731
    given = (as_tokens(t.q), as_tokens(t.k), as_tokens(t.v_t[..., :32].permute(0, 3, 1, 2)))
    scales = Fp8Scales(as_tokens(t.q_scale), as_tokens(t.k_scale), t.v_scale)
    args = dict(window=(2, 3, 3), q_tile=(1, 4, 4), kv_tile=(1, 4, 4), return_lse=True)
    for got, want in zip(gna_attention(*given, scales=scales, out_dtype=q.dtype, **args),
                         gna_attention(q, k, v, precision="fp8", **args)):
        assert torch.equal(got, want)
    flat = tuple(x.reshape(1, 32, 1, 32) for x in given)
    flat_scales = Fp8Scales(t.q_scale, t.k_scale, t.v_scale)
    mask = torch.tensor([[[[True, False], [True, True]]]])
    got = sparse_attention(*flat, mask, 16, 16, return_lse=True, scales=flat_scales, out_dtype=q.dtype)
    want = sparse_attention(*(x.reshape(1, 32, 1, 32) for x in (q, k, v)), mask, 16, 16, return_lse=True,
                            precision="fp8")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_broadcast_scales_equal_the_same_scales_given_in_full():
    generator = torch.Generator().manual_seed(23)
    q8, k8, v8 = (torch.randn(2, 32, 2, 32, generator=generator).to(E4M3) for _ in range(3))
    per_tensor = torch.tensor(0.02)
    per_head = torch.tensor([0.01, 0.03])
    per_head_v = torch.tensor([[0.05], [0.2]])  # [heads, 1]: one scale per head for every channel
    _, full, _ = check_fp8_call(q8, k8, v8, None, Fp8Scales(per_tensor, per_head, per_head_v), None)
    assert full.q_scale.shape == full.k_scale.shape == (2, 32, 2) and full.v_scale.shape == (2, 2, 32)
    assert all(t.is_contiguous() for t in (full.q_scale, full.k_scale, full.v_scale))
    assert torch.equal(full.k_scale[1, 7], per_head) and torch.equal(full.v_scale[0, 1], torch.full((32,), 0.2))
    mask = torch.tensor([[[[True, False], [True, True]]]])
    broadcast = sparse_attention(q8, k8, v8, mask, 16, 16, scales=Fp8Scales(per_tensor, per_head, per_head_v))
    assert torch.equal(broadcast, sparse_attention(q8, k8, v8, mask, 16, 16, scales=full))


def test_float8_inputs_on_the_cpu_path_run_the_reference_of_their_dequantized_values(reference_path):
    generator = torch.Generator().manual_seed(24)
    (q8, k8, v8), scales = _to_float8(*_video_like((5, 6), 2, generator, torch.float32))
    out = gna_attention(q8, k8, v8, 3, scales=scales)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_reference_attention(q8, k8, v8, 3, scales=scales))
    assert _error(out, reference_attention(*_dequantized(q8, k8, v8, scales), 3)) < P_ROUNDING
    flat = tuple(x.reshape(1, 30, 2, 32) for x in (q8, k8, v8))
    flat_scales = Fp8Scales(scales.q_scale.reshape(1, 30, 2), scales.k_scale.reshape(1, 30, 2), scales.v_scale)
    mask = torch.rand(1, 2, 2, 2, generator=generator) < 0.6
    want = fp8_sparse_reference(*flat, mask, 16, 16, scales=flat_scales, out_dtype=torch.float16)
    for given_mask in (mask, SparseMask.from_dense(mask, 16, 16, 30), prepare_sparse(mask, 16, 16, 30)):
        args = (16, 16) if isinstance(given_mask, torch.Tensor) else ()
        assert torch.equal(sparse_attention(*flat, given_mask, *args, scales=flat_scales, out_dtype=torch.float16),
                           want)


def test_float8_calls_compile_with_fullgraph_and_equal_eager():
    """Through the operators: the scales built and broadcast inside the compiled function, GNA and prepared
    sparse work."""
    generator = torch.Generator().manual_seed(25)
    (q8, k8, v8), scales = _to_float8(*_video_like((2, 4, 4), 1, generator, torch.float32))
    flat = tuple(x.reshape(1, 32, 1, 32) for x in (q8, k8, v8))
    work = prepare_sparse(torch.tensor([[[[True, False], [True, True]]]]), 16, 16, 32, backward=False)

    def both(q8, k8, v8, q_scale, k_scale, v_scale, fq, fk, fv):
        given = Fp8Scales(q_scale, k_scale, v_scale)
        per_tensor = Fp8Scales(q_scale.amax(), k_scale.amax(), v_scale)
        return (gna_attention(q8, k8, v8, (2, 3, 3), q_tile=(1, 4, 4), kv_tile=(1, 4, 4), scales=given),
                sparse_attention(fq, fk, fv, work, scales=per_tensor, out_dtype=torch.float16))

    inputs = (q8, k8, v8, scales.q_scale, scales.k_scale, scales.v_scale, *flat)
    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*inputs), both(*inputs)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_float8_inputs_refuse_what_they_cannot_run_with_sentences():
    q8 = torch.randn(1, 32, 2, 32).to(E4M3)
    row = torch.full((1, 32, 2), 0.01)
    scales = Fp8Scales(row, row, torch.full((1, 2, 32), 0.01))
    bf16 = torch.randn(1, 32, 2, 32).bfloat16()
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="q, k and v in float8 need their scales: .*got scales=None"):
        gna_attention(q8, q8, q8, 3)
    with pytest.raises(ValueError, match="need their scales"):
        sparse_attention(q8, q8, q8, mask, 16, 16, precision="fp8")
    with pytest.raises(ValueError, match="scales are for q, k and v given in float8 e4m3, got q.dtype=torch.bfloat16"):
        gna_attention(bf16, bf16, bf16, 3, precision="fp8", scales=scales)
    with pytest.raises(ValueError, match="out_dtype is for q, k and v given in float8"):
        sparse_attention(bf16, bf16, bf16, mask, 16, 16, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16 or torch.float16, "
                                         "got out_dtype=torch.float32"):
        gna_attention(q8, q8, q8, 3, scales=scales, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="q, k and v must have the same dtype, got q.dtype=torch.float8_e4m3fn, "
                                         "k.dtype=torch.bfloat16"):
        gna_attention(q8, bf16, q8, 3, scales=scales)
    e5m2 = q8.float().to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="float8 inputs must be torch.float8_e4m3fn .*got dtype=torch.float8_e5m2"):
        sparse_attention(e5m2, e5m2, e5m2, mask, 16, 16, scales=scales)
    with pytest.raises(TypeError, match="q_scale must be a float32 torch.Tensor, got q_scale.dtype=torch.float16"):
        Fp8Scales(row.half(), row, row)
    with pytest.raises(TypeError, match="v_scale must be a float32 torch.Tensor, got float"):
        Fp8Scales(row, row, 0.01)
    with pytest.raises(TypeError, match="scales must be a natsim.kernels.Fp8Scales, got tuple"):
        gna_attention(q8, q8, q8, 3, scales=(row, row, row))
    with pytest.raises(ValueError, match=r"k_scale must broadcast to \[batch, \*tokens, heads\] = \(1, 32, 2\) .*"
                                         r"got k_scale.shape=\(1, 16, 2\)"):
        gna_attention(q8, q8, q8, 3, scales=Fp8Scales(row, row[:, :16], scales.v_scale))
    with pytest.raises(ValueError, match=r"v_scale must broadcast to \[batch, heads, head_dim\] = \(1, 2, 32\)"):
        sparse_attention(q8, q8, q8, mask, 16, 16, scales=Fp8Scales(row, row, torch.ones(2)))  # [heads], not [heads, 1]
    with pytest.raises(ValueError, match="q_scale must be on q's device, got q_scale.device=meta"):
        gna_attention(q8, q8, q8, 3, scales=Fp8Scales(torch.ones((), device="meta"), row, scales.v_scale))
    with pytest.raises(RuntimeError, match="for inference and has no backward pass"):
        gna_attention(q8, q8, q8, 3, scales=Fp8Scales(row.clone().requires_grad_(), row, scales.v_scale))
    with pytest.raises(RuntimeError, match="for inference and has no backward pass"):
        sparse_attention(q8.clone().requires_grad_(), q8, q8, mask, 16, 16, scales=scales)
    grid = q8.reshape(1, 4, 8, 2, 32)
    grid_scales = Fp8Scales(row.reshape(1, 4, 8, 2), row.reshape(1, 4, 8, 2), scales.v_scale)
    with pytest.raises(ValueError, match="static KV tiling only"):
        gna_attention(grid, grid, grid, 3, kv_tiling="dynamic", scales=grid_scales)
    with pytest.raises(ValueError, match="does not run with the PV skip"):
        sparse_attention(q8, q8, q8, mask, 16, 16, scales=scales, pv_threshold=-5.0)
    # The registered operators take the scales as tensors and check them alike (their fake implementations too).
    with pytest.raises(ValueError, match="need their scales"):
        torch.ops.natsim.gna_forward(q8, q8, q8, [3], [1], [1], [False], None, None, None, False)
