"""Random problems on a CUDA GPU, features together: `pytest -m gpu tests/test_random_gpu.py`.

The other GPU tests run fixed layouts; these let hypothesis draw them: 1-3 dimensions up to a few thousand tokens,
window, stride, dilation and causal per dimension as the contract allows them (tests/bruteforce.py's edge-biased
draws), head dims 16-256, batch and heads, fp16 and bf16, static, dynamic or natsim's KV tiling, and the backend
natsim picks or one named (a named backend that cannot run the call must refuse it with the same sentence
`chosen_backend` gives). Outputs, log-sum-exps and gradients are compared with float64 attention under the
brute-force mask of tests/bruteforce.py, which shares no code with natsim; block masks likewise with the mask
expanded to elements, boolean and prepared alike; `precision="fp8"` on the same layouts and masks within FP8's
bound of float64 attention (and natsim's Triton FP8 kernel within its rule's); plans from `best` on drawn layouts
and sparsities run what they say, eagerly and compiled.
"""

from __future__ import annotations

import math
import pathlib
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bruteforce as bf  # noqa: E402

from natsim import Problem  # noqa: E402
from natsim.kernels import chosen_backend, gna_attention, prepare_sparse, sparse_attention  # noqa: E402
from natsim.kernels.backends import capabilities  # noqa: E402

pytestmark = pytest.mark.gpu

# Each draw compiles kernels for its geometry, head dim and dtype (seconds each): a failing draw is reported as
# drawn (no shrinking, which would compile a kernel per step), with hypothesis' blob to reproduce it.
NO_SHRINK = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
                 phases=(Phase.explicit, Phase.reuse, Phase.generate))
RANDOM = settings(max_examples=20, **NO_SHRINK)
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2.5e-2}  # relative, against float64
HEAD_DIMS = (16, 24, 32, 40, 64, 72, 88, 96, 112, 128, 160, 256)
GLUON_HEAD_DIMS = capabilities("gluon", "gna").head_dims  # drawn half the time in the FP8 GNA test
MAX_LEN = {1: 4096, 2: 64, 3: 24}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gradient_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """`rel` with a floor of 1e-2 per element under the norm, as tests/test_backward.py (the gradients of these
    Gaussian inputs are of order one): where every query attends one key (one token, windows of one) float64's dq
    and dk are exactly 0, and a kernel's rounding residue (`dO v - rowsum(dO o)`, about 1e-7 per element) must not
    count as an infinite error."""
    floor = 1e-2 * math.sqrt(b.numel())
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor))


@st.composite
def layouts(draw) -> Problem:
    """A GNA problem of up to about 4,096 tokens: lengths biased to tile borders and odd sizes."""
    ndim = draw(st.sampled_from([1, 2, 3]))
    shape = []
    for j in range(ndim):
        hi = min(MAX_LEN[ndim], max(1, 4096 // max(1, math.prod(shape)) // (8 ** (ndim - 1 - j))))
        shape.append(draw(bf._mixed([1, 7, 8, 9, 16, 17, 31, 64, 65, 127, 128, 129, hi], 1, hi)))
    w, s, d, c = (tuple(v) for v in zip(*(draw(bf.dims_params(L)) for L in shape)))
    return Problem(tuple(shape), w, s, d, c)


def _inputs(batch: int, tokens: tuple[int, ...], heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator("cuda").manual_seed(seed)
    return [torch.randn(batch, *tokens, heads, head_dim, device="cuda", dtype=dtype, generator=generator)
            for _ in range(4)]


def _masked_attention(q, k, v, mask: torch.Tensor):
    """float64 softmax attention of flattened `[B, N, H, D]` q, k, v where `mask` ([N, N] or [B|1, H|1, N, N])
    allows, and its `[B, N, H]` log-sum-exp; rows that attend nothing give 0 and LSE -inf (and zero gradients)."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = (torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True).detach().clamp_min(-1e300)
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", weights / total.clamp_min(1e-300), v)
    return out, (peak + torch.log(total)).squeeze(-1).transpose(1, 2)


def _chosen_or_refused_alike(q, k, v, args: dict):
    """The backend `gna_attention(q, k, v, **args)` runs on. Where `chosen_backend` refuses the call, the call itself
    must be refused with the same sentence, and the draw is then set aside (`assume`): each test's examples are
    problems that ran, however many refusals hypothesis met on the way."""
    try:
        chosen = chosen_backend(q, k, v, **args)
    except ValueError as refusal:
        event("refused")
        with pytest.raises(ValueError) as raised:
            gna_attention(q, k, v, **args)
        assert str(raised.value) == str(refusal)
        assume(False)
    event(f"ran on {chosen}")
    return chosen


@settings(max_examples=8, **NO_SHRINK)
@given(problem=layouts(), head_dim=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       batch=st.integers(1, 2), heads=st.integers(1, 3), backend=st.sampled_from([None, "triton", "fa4"]),
       kv_tiling=st.sampled_from([None, "static", "dynamic"]), gradients=st.booleans(), seed=st.integers(0, 2**16))
def test_gna_on_drawn_layouts_is_float64_attention_under_the_brute_force_mask(problem, head_dim, dtype, batch, heads,
                                                                             backend, kv_tiling, gradients, seed):
    args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal,
                kv_tiling=kv_tiling, backend=backend)
    q, k, v, grad = _inputs(batch, problem.shape, heads, head_dim, dtype, seed)
    chosen = _chosen_or_refused_alike(q, k, v, args)
    assert chosen in (("triton", "fa4") if backend is None else (backend,))
    leaves = [t.requires_grad_(gradients) for t in (q, k, v)]
    out, lse = gna_attention(*leaves, return_lse=True, **args)

    flat = [t.detach().double().flatten(1, -3).requires_grad_(gradients) for t in (q, k, v)]
    mask = torch.as_tensor(bf.attention_mask(problem), device="cuda")
    want, want_lse = _masked_attention(*flat, mask)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert rel(out.flatten(1, -3), want) < TOLERANCE[dtype], (chosen, rel(out.flatten(1, -3), want))
    assert (lse.flatten(1, -2).double() - want_lse).abs().max().item() < 2e-2, chosen
    if gradients:
        got = torch.autograd.grad(out, leaves, grad)
        expected = torch.autograd.grad(want, flat, grad.double().flatten(1, -3))
        for name, a, b in zip(("dq", "dk", "dv"), got, expected):
            error = gradient_rel(a.flatten(1, -3), b)
            assert error < 2 * TOLERANCE[dtype], (chosen, name, error)


@settings(max_examples=8, **NO_SHRINK)
@given(problem=layouts(), head_dim=st.one_of(st.sampled_from(GLUON_HEAD_DIMS), st.sampled_from(HEAD_DIMS)),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), heads=st.integers(1, 3),
       backend=st.sampled_from([None, "triton", "gluon"]),
       kv_tiling=st.sampled_from([None, "static", "dynamic"]), offset=st.sampled_from([0.0, 3.0]),
       seed=st.integers(0, 2**16))
def test_fp8_gna_on_drawn_layouts_is_within_its_bound_of_float64_attention(problem, head_dim, dtype, heads, backend,
                                                                          kv_tiling, offset, seed):
    """precision="fp8" on the same drawn layouts (inference): within 6e-2 of float64 attention on Gaussian inputs,
    keys offset by a shared vector or not (what K's mean removal is for); natsim's Triton kernel also within 3e-2
    of its rule's reference (kernels/gna/reference.py) and its LSE within 2e-2 of the rule's; a named backend that
    cannot run the call refuses it with `chosen_backend`'s sentence."""
    from natsim.kernels.gna.reference import fp8_reference_attention

    args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal,
                kv_tiling=kv_tiling, backend=backend, precision="fp8")
    q, k, v, _ = _inputs(1, problem.shape, heads, head_dim, dtype, seed)
    k = k + offset
    chosen = _chosen_or_refused_alike(q, k, v, args)
    assert chosen in (("triton", "gluon") if backend is None else (backend,))
    out, lse = gna_attention(q, k, v, return_lse=True, **args)
    mask = torch.as_tensor(bf.attention_mask(problem), device="cuda")
    want, want_lse = _masked_attention(*(t.flatten(1, -3) for t in (q, k, v)), mask)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == q.shape[:-1]
    assert rel(out.flatten(1, -3), want) < 6e-2, (chosen, rel(out.flatten(1, -3), want))
    assert torch.equal(torch.isfinite(lse.flatten(1, -2)), torch.isfinite(want_lse)), chosen
    if chosen == "triton":
        parameters = (problem.window, problem.stride, problem.dilation, problem.causal)
        rule, rule_lse = fp8_reference_attention(q, k, v, *parameters, return_lse=True)
        assert rel(out, rule) < 3e-2, rel(out, rule)
        finite = torch.isfinite(rule_lse)
        assert not finite.any() or (lse[finite] - rule_lse[finite]).abs().max().item() < 2e-2


@st.composite
def block_masks(draw):
    """(seq_len, q_block, kv_block, merge, mask): a random per-head block mask, some rows left empty."""
    q_block = draw(st.sampled_from([16, 32, 64, 128]))
    kv_block = draw(st.sampled_from([16, 32, 64, 128]))
    seq_len = draw(bf._mixed([q_block, 2 * q_block + 1, 1000, 4095, 4096], 1, 4096))
    merge = draw(st.sampled_from([None, "xor", "consecutive"]))
    density = draw(st.sampled_from([0.05, 0.3, 0.7, 1.0]))
    heads = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator("cuda").manual_seed(seed)
    shape = (1, heads, -(-seq_len // q_block), -(-seq_len // kv_block))
    mask = torch.rand(shape, device="cuda", generator=generator) < density
    return seq_len, q_block, kv_block, merge, mask


@RANDOM
@given(case=block_masks(), head_dim=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       backend=st.sampled_from([None, "triton", "fa4", "gluon"]), prepared=st.booleans(), gradients=st.booleans())
def test_block_masks_are_float64_attention_under_the_expanded_mask(case, head_dim, dtype, backend, prepared, gradients):
    seq_len, q_block, kv_block, merge, mask = case
    heads = mask.shape[1]
    q, k, v, grad = _inputs(1, (seq_len,), heads, head_dim, dtype, seq_len)
    leaves = [t.requires_grad_(gradients) for t in (q, k, v)]
    try:
        if prepared:
            work = prepare_sparse(mask, q_block, kv_block, seq_len, merge=merge, backend=backend)
            out, lse = sparse_attention(*leaves, work, return_lse=True)
        else:
            out, lse = sparse_attention(*leaves, mask, q_block, kv_block, merge=merge, backend=backend,
                                        return_lse=True)
        got = torch.autograd.grad(out, leaves, grad) if gradients else None
    except (ValueError, RuntimeError) as refusal:
        # only a named backend may refuse: FlashAttention-4 (blocks or merge it does not run), the Gluon kernel
        # (blocks or head dims it does not run, gradients, which its 16-bit variant has no backward for)
        by_fa4 = backend == "fa4" and isinstance(refusal, ValueError)
        by_gluon = backend == "gluon" and (str(refusal).startswith("backend='gluon' cannot run this call")
                                           or "no backward pass" in str(refusal))
        assert by_fa4 or by_gluon, str(refusal)
        event("refused")
        assume(False)
    event("ran on natsim's choice" if backend is None else f"ran on {backend}")
    rows = torch.arange(seq_len, device="cuda")
    elements = mask[:, :, rows[:, None] // q_block, rows[None, :] // kv_block]
    flat = [t.detach().double().requires_grad_(gradients) for t in (q, k, v)]
    want, want_lse = _masked_attention(*flat, elements)
    assert rel(out, want) < TOLERANCE[dtype], rel(out, want)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert not finite.any() or (lse.double()[finite] - want_lse[finite]).abs().max().item() < 2e-2
    if gradients:
        expected = torch.autograd.grad(want, flat, grad.double())
        for name, a, b in zip(("dq", "dk", "dv"), got, expected):
            assert gradient_rel(a, b) < 2 * TOLERANCE[dtype], (name, gradient_rel(a, b))


@RANDOM
@given(case=block_masks(), head_dim=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       backend=st.sampled_from([None, "triton", "gluon"]), prepared=st.booleans(), offset=st.sampled_from([0.0, 3.0]))
def test_fp8_block_masks_are_within_their_bound_of_float64_attention(case, head_dim, dtype, backend, prepared,
                                                                     offset):
    """precision="fp8" under the same drawn block masks (inference), boolean or prepared, on natsim's choice or a
    named kernel: within 6e-2 of float64 attention under the expanded mask, rows that attend nothing 0 with LSE
    -inf; natsim's Triton kernel also within 3e-2 of its rule's reference. Only a named kernel, or blocks, head
    dims or merges FP8 does not run, may be refused, with a sentence."""
    from natsim.kernels.common.fp8 import FP8_HEAD_DIMS
    from natsim.kernels.sparse.reference import fp8_sparse_reference

    seq_len, q_block, kv_block, merge, mask = case
    heads = mask.shape[1]
    q, k, v, _ = _inputs(1, (seq_len,), heads, head_dim, dtype, seq_len)
    k = k + offset
    try:
        if prepared:
            work = prepare_sparse(mask, q_block, kv_block, seq_len, merge=merge, backend=backend, backward=False)
            out, lse = sparse_attention(q, k, v, work, return_lse=True, precision="fp8")
        else:
            out, lse = sparse_attention(q, k, v, mask, q_block, kv_block, merge=merge, backend=backend,
                                        return_lse=True, precision="fp8")
    except ValueError as refusal:  # natsim's own choice refuses only the head dims FP8 does not run
        assert backend is not None or head_dim not in FP8_HEAD_DIMS, str(refusal)
        assert str(refusal).endswith(".") and len(str(refusal).split()) > 6, str(refusal)
        event("refused")
        assume(False)
    event("ran on natsim's choice" if backend is None else f"ran on {backend}")
    rows = torch.arange(seq_len, device="cuda")
    elements = mask[:, :, rows[:, None] // q_block, rows[None, :] // kv_block]
    want, want_lse = _masked_attention(q, k, v, elements)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel(out, want) < 6e-2, rel(out, want)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite) and not out[~finite].any()
    if backend == "triton":
        rule = fp8_sparse_reference(q, k, v, mask, q_block, kv_block)
        assert rel(out, rule) < 3e-2, rel(out, rule)


@settings(max_examples=6, **NO_SHRINK)
@given(problem=layouts(), sparsity=st.sampled_from([0.5, 0.75, 0.9, 0.97]), head_dim=st.sampled_from([64, 96, 128]),
       training=st.booleans())
def test_plans_for_drawn_layouts_run_what_they_say_eagerly_and_compiled(problem, sparsity, head_dim, training):
    from natsim.planner import best

    try:
        plan = best(problem.shape, sparsity, heads=2, head_dim=head_dim, training=training)
    except ValueError as refusal:  # a layout too small for the planner's tiles or the target: a sentence
        assert str(refusal).endswith(".") and len(str(refusal).split()) > 6, str(refusal)
        event("refused")
        assume(False)
    event(f"planned on {plan.backend}")
    planned = plan.problem
    q, k, v, grad = _inputs(1, planned.shape, 2, head_dim, torch.bfloat16, 0)
    leaves = [t.requires_grad_(training) for t in (q, k, v)]
    eager = plan(*leaves)
    compiled = torch.compile(lambda *x: plan(*x), fullgraph=True)(*leaves)
    mask = torch.as_tensor(bf.attention_mask(planned), device="cuda")
    want, _ = _masked_attention(*(t.detach().flatten(1, -3) for t in (q, k, v)), mask)
    assert 1.0 - mask.double().mean().item() >= sparsity - 1e-9
    assert rel(eager.flatten(1, -3), want) < TOLERANCE[torch.bfloat16]
    assert rel(compiled, eager) < 1e-2
    if training:
        got = torch.autograd.grad(eager, leaves, grad)
        assert all(torch.isfinite(g).all() for g in got)
