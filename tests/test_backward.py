"""The GNA backward pass: the Triton kernels (CPU interpreter) against float64 gradients of the reference, their
tile counts against `natsim.simulate_backward`, that against the brute-force mask, and the operator's autograd
(torch.compile, activation checkpointing, the LSE's gradient, a Plan).

The interpreter runs the kernels on tiny problems with 16- and 32-token tiles, one head, head_dim 16: slow
per tile, so few hypothesis examples.
"""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bruteforce as bf  # noqa: E402

import natsim  # noqa: E402
from natsim import Problem, TileConfig, simulate, simulate_backward  # noqa: E402
from natsim.kernels import gna_attention, reference_attention  # noqa: E402
from natsim.kernels.gna.ops import gna_forward  # noqa: E402
from natsim.kernels.gna.backward import backward_tile_counts, backward_tiles, gna_backward  # noqa: E402
from natsim.kernels.gna.reference import reference_gradients  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
SIMULATOR = settings(max_examples=75, deadline=None, suppress_health_check=list(HealthCheck))
TOLERANCE = {torch.float16: 1e-2, torch.float32: 1e-4}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, with a floor of 1e-2 per element under the norm (gradients here are of order
    one): with a one-key window the gradient of q is exactly zero and a rounding residue (about 1e-6 per element
    in float32, from `dO v - rowsum(dO o)`) must not count as an infinite error."""
    floor = 1e-2 * math.sqrt(want.numel())
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(floor)).item()


@st.composite
def kernel_problems(draw, max_tokens: int = 96):
    """A problem of at most `max_tokens` tokens in 1-D, 8x8 in 2-D and 4x4x4 in 3-D (stride, dilation, causal,
    even windows, stride = window all drawn) and backward tiles of 16 or 32 tokens the kernel can run (Q tile as
    large as the KV tile or half). 10x10 and 5x5x5 layouts cost the interpreter half as much again on average
    and up to twice as much at the tail; these still hold several tiles along a dimension, padded ones and
    partial windows."""
    ndim = draw(st.integers(1, 3))
    side = {1: max_tokens, 2: 8, 3: 4}[ndim]
    shape = tuple(draw(st.integers(2, side)) for _ in range(ndim))
    dims = []
    for L in shape:
        d = draw(st.integers(1, min(L, 2)))
        w = draw(st.integers(1, L // d))
        s = draw(st.sampled_from(sorted({1, w, max(1, w // 2)})))
        dims.append((w, s, d, draw(st.booleans())))
    w, s, d, c = zip(*dims)
    problem = Problem(shape, w, s, d, c)
    kv_exps = [0] * ndim
    for _ in range(draw(st.integers(4, 5))):
        kv_exps[draw(st.integers(0, ndim - 1))] += 1
    q_exps = list(kv_exps)
    if sum(q_exps) == 5 and draw(st.booleans()):
        q_exps[max(i for i in range(ndim) if q_exps[i])] -= 1
    return problem, tuple(2**e for e in q_exps), tuple(2**e for e in kv_exps)


def reference_grads(problem: Problem, q, k, v, grad_out, grad_lse=None):
    """float64 gradients of the reference (autograd through `reference_attention`), and its output and LSE."""
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*inputs, problem.window, problem.stride, problem.dilation, problem.causal,
                                   return_lse=True)
    outputs, grads = [out], [grad_out.double()]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.double())
    return torch.autograd.grad(outputs, inputs, grads), out.detach(), lse.detach()


def kernel_against_reference(problem: Problem, q_tile, kv_tile, dtype, with_lse_gradient=False, batch=1, heads=1):
    q, k, v, g = (torch.randn(batch, *problem.shape, heads, 16, device=DEVICE).to(dtype) for _ in range(4))
    grad_lse = torch.randn(batch, *problem.shape, heads, device=DEVICE) if with_lse_gradient else None
    want, out, lse = reference_grads(problem, q, k, v, g, grad_lse)
    got = gna_backward(q, k, v, out.to(dtype), lse.float(), g, grad_lse, problem, None, q_tile, kv_tile)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert rel_error(a, b) < TOLERANCE[dtype], f"{name}: {rel_error(a, b):.2e} for {problem}, {q_tile}/{kv_tile}"


# ---------------------------------------------------------------------------------------------------------
# The Triton kernels (interpreter) against float64 gradients


# 4 random problems a run, not 6: the edge cases, tuning variants and quarter Q tiles below run the borders,
# padding, dilation, causal masks, even windows, block-sparse and dense problems every time.
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(kernel_problems(), st.sampled_from([torch.float16, torch.float32]))
def test_backward_kernels_match_float64_reference_gradients(case, dtype):
    kernel_against_reference(*case, dtype)


# Batch 2 with 3 heads (unequal, so that mixing up the batch and head of a program shows) where the interpreter's
# work is small; the 2-D dilated and the 3-D case, with many tile pairs per (batch, head), run one batch of
# 2 heads (with batch 2 x 3 heads they took 7-9 s each).
@pytest.mark.parametrize("problem, q_tile, kv_tile, batch, heads", [
    (Problem((9, 8), (4, 4), (4, 4)), (4, 4), (4, 4), 2, 3),  # stride = window: blocked attention, block-sparse
    (Problem((8, 10), (4, 3), 1, (2, 1), (False, True)), (4, 4), (2, 8), 1, 2),  # even window, dilation, causal
    (Problem((40,), 40), (16,), (32,), 2, 3),  # dense: no mask code, padding keys and queries
    (Problem((3, 4, 5), (3, 2, 4), (1, 2, 3), 1, (True, False, False)), (2, 2, 4), (2, 2, 4), 1, 2),
])
def test_backward_kernel_edge_cases(problem, q_tile, kv_tile, batch, heads):
    kernel_against_reference(problem, q_tile, kv_tile, torch.float32, with_lse_gradient=True, batch=batch, heads=heads)


# ---------------------------------------------------------------------------------------------------------
# Tile counts: the dK/dV kernel's own decisions, the simulator, the brute-force mask


@KERNEL
@given(kernel_problems(max_tokens=200))
def test_dkdv_kernel_tile_counts_equal_the_simulator(case):
    problem, q_tile, kv_tile = case
    visited, full = backward_tile_counts(problem, q_tile, kv_tile, head_dim=16, device=DEVICE)
    sim = simulate_backward(problem, TileConfig(q_tile, kv_tile))
    np.testing.assert_array_equal(visited, sim.per_kv_tile_visited)
    np.testing.assert_array_equal(full, sim.per_kv_tile_full)


@SIMULATOR
@given(st.data())
def test_simulate_backward_equals_the_brute_force_mask(data):
    problem = data.draw(bf.problems(max_tokens=300))
    tiles = data.draw(bf.multi_tiles(problem, kv_tiling="static"))
    q_tile, kv_tile = tiles.dims(problem)
    mask = bf.attention_mask(problem)
    q_of, _, num_q = bf.multi_d_layout(problem, q_tile)
    kv_of, _, num_kv = bf.multi_d_layout(problem, kv_tile)
    visited, full = bf.static_counts(mask, q_of, num_q, kv_of, num_kv)
    sim = simulate_backward(problem, TileConfig(q_tile, kv_tile))
    np.testing.assert_array_equal(sim.per_kv_tile_visited, visited.sum(axis=0))
    np.testing.assert_array_equal(sim.per_kv_tile_full, full.sum(axis=0))
    forward = simulate(problem, TileConfig(q_tile, kv_tile))
    assert (sim.visited_tiles, sim.full_tiles) == (forward.visited_tiles, forward.full_tiles)
    assert sim.max_q_tiles == visited.sum(axis=0).max()
    assert sim.tile_speedup == pytest.approx(forward.num_q_tiles / visited.sum(axis=0).max())


def test_simulate_backward_refuses_what_the_backward_kernel_does_not_run():
    problem = Problem((16, 16), (5, 5))
    with pytest.raises(ValueError, match="static KV tiling"):
        simulate_backward(problem, TileConfig(4, 4, kv_tiling="dynamic"))
    with pytest.raises(ValueError, match="tiling='1d'"):
        simulate_backward(problem, TileConfig(16, 16, tiling="1d"))
    with pytest.raises(TypeError, match="natsim.Problem"):
        simulate_backward((16, 16), TileConfig(4, 4))


def test_backward_tiles_hold_128_keys_and_half_as_many_queries():
    problem = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    q_tile, kv_tile = backward_tiles(problem, 128)
    assert math.prod(kv_tile) == 128 and math.prod(q_tile) == 64
    assert sum(a != b for a, b in zip(q_tile, kv_tile)) == 1


@pytest.mark.parametrize("problem", [Problem((30, 48, 80), (18, 24, 24), (16, 8, 8)), Problem((64, 64), (9, 9)),
                                     Problem((4096,), (512,))])
def test_backward_tiles_with_two_q_halvings_hold_a_quarter_of_the_kv_box(problem):
    q_tile, kv_tile = backward_tiles(problem, 128, q_halvings=2)
    assert math.prod(kv_tile) == 128 and math.prod(q_tile) == 32
    assert all(kv % q == 0 for q, kv in zip(q_tile, kv_tile))  # each side halved zero, one or two times


@pytest.mark.parametrize("problem", [Problem((4, 8, 16), (3, 5, 6), (1, 2, 1)), Problem((4, 8, 16), (4, 8, 16))])
def test_backward_kernels_with_quarter_q_tiles_match_the_reference(problem):
    """The tiles of `q_halvings=2` (benchmarks/backward.py --tune), masked and mask-free, in the interpreter."""
    kernel_against_reference(problem, *backward_tiles(problem, 128, q_halvings=2), torch.float32)


# ---------------------------------------------------------------------------------------------------------
# The operator: autograd, torch.compile, checkpointing

ARGS = dict(window=(3, 4, 2), stride=(1, 2, 2), dilation=(1, 1, 2), causal=(True, False, False))
SHAPE = (4, 6, 5)


def leaves(dtype=torch.float16, shape=SHAPE, heads=2, head_dim=32):
    torch.manual_seed(0)
    return [torch.randn(1, *shape, heads, head_dim, device=DEVICE).to(dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("kv_tiling", [None, "static", "dynamic"])
def test_gna_attention_gradients_through_the_kernels_match_the_reference(kv_tiling):
    """The backward runs its own (static) tiles whatever KV tiling the forward used: the gradient is the
    attention's, not the tiling's."""
    q, k, v = leaves()
    out, lse = gna_attention(q, k, v, **ARGS, return_lse=True, kv_tiling=kv_tiling)
    assert out.grad_fn is not None
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    want, _, _ = reference_grads(Problem(SHAPE, **ARGS), q, k, v, grad_out, grad_lse)
    for a, b in zip(got, want):
        assert rel_error(a, b) < 1e-2


def test_operator_called_without_the_lse_recomputes_it_for_the_backward():
    q, k, v = leaves()
    out, lse = gna_forward(q, k, v, *([list(ARGS[name]) for name in ("window", "stride", "dilation", "causal")]),
                           None, None, None, False)
    assert lse.numel() == 0
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want, _, _ = reference_grads(Problem(SHAPE, **ARGS), q, k, v, grad_out)
    for a, b in zip(got, want):
        assert rel_error(a, b) < 1e-2


def _loss(q, k, v):
    return gna_attention(q, k, v, **ARGS).float().square().sum()


def test_compiled_forward_and_backward_equal_eager_without_graph_breaks():
    """Under aot_eager: the graph and its backward are the point here (Inductor compiles a backward through the
    operators in the sparse test below on CPU, and here on GPUs: tests/test_backward_gpu.py)."""
    q, k, v = leaves()
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(_loss(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_activation_checkpointing_recomputes_to_the_same_gradients():
    from torch.utils.checkpoint import checkpoint

    q, k, v = leaves()
    got = torch.autograd.grad(checkpoint(_loss, q, k, v, use_reentrant=False), (q, k, v))
    want = torch.autograd.grad(_loss(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_plan_is_differentiable():
    from natsim import planner

    plan = planner.best((8, 16), 0.5, head_dim=32, dtype=torch.float16, device="cpu")
    q, k, v = leaves(shape=(8, 16))
    got = torch.autograd.grad(plan(q, k, v).float().sum(), (q, k, v))
    want, _, _ = reference_grads(plan.problem, q, k, v, torch.ones(1, 8, 16, 2, 32, device=DEVICE))
    for a, b in zip(got, want):
        assert rel_error(a, b) < 1e-2


def test_reference_path_passes_gradcheck_with_dilation_and_causal(reference_path):
    q, k, v = (torch.randn(1, 4, 3, 1, 2, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: gna_attention(q, k, v, (2, 2), (1, 2), (2, 1), (True, False), return_lse=True), (q, k, v))


def test_chunked_reference_gradients_equal_autograd_through_the_reference():
    problem = Problem((5, 6, 7), (3, 4, 2), (1, 2, 2), (1, 1, 2), (True, False, False))
    q, k, v, g = (torch.randn(2, 5, 6, 7, 3, 8, dtype=torch.float64) for _ in range(4))
    want, _, _ = reference_grads(problem, q, k, v, g)
    got = reference_gradients(q, k, v, g, problem.window, problem.stride, problem.dilation, problem.causal,
                              compute_dtype=torch.float64)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# Unmasked kernels step over their tiles through rank-4 tensor descriptors (USE_TMA, on by default where
# `uses_descriptors` allows); a masked kernel keeps gathering. Problems: block-sparse 3-D (both kernels unmasked),
# dilation 2 with 2-D tiles (unmasked, each group its own descriptor), and a window whose dK/dV kernel is masked
# while the mirrored dQ kernel is not and has padding rows (read as zeros through the descriptor, clamped by
# the gathers). A descriptor's batch and head coordinates: two heads of one batch on the first problem, two batches
# of one head on the second, both on the third (each pair doubles the interpreter's work).
DESCRIPTOR_PROBLEMS = [
    (Problem((4, 8, 8), (2, 8, 8), (2, 4, 4)), (1, 4, 4), (2, 4, 4), 1, 2),
    (Problem((8, 16), (4, 8), (4, 8), (1, 2)), (2, 4), (4, 4), 2, 1),
    (Problem((6, 16), (6, 8), (1, 8)), (2, 8), (4, 8), 2, 2),
]


@pytest.mark.parametrize("problem, q_tile, kv_tile, batch, heads", DESCRIPTOR_PROBLEMS)
def test_descriptor_loads_give_the_gathers_gradients_bit_for_bit(problem, q_tile, kv_tile, batch, heads):
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(batch, *problem.shape, heads, 16) for _ in range(4))
    want, out, lse = reference_grads(problem, q, k, v, g)
    args = (q, k, v, out.float(), lse.float(), g, None, problem, 16**-0.5, q_tile, kv_tile)
    gathered = gna_backward(*args, options=dict(USE_TMA=False))
    described = gna_backward(*args)
    for name, a, b, ref in zip(("dq", "dk", "dv"), described, gathered, want):
        assert torch.equal(a, b), name
        assert rel_error(a, ref) < 1e-4, name


@pytest.mark.parametrize("seq_len, block", [(77, 16), (64, 32), (50, 8)])
def test_sparse_descriptor_loads_give_the_pointer_loads_gradients_bit_for_bit(seq_len, block):
    """The sparse kernels move every tile through tensor descriptors (their own tile too, and the stores);
    rows past N read as zeros and are dropped on store, as the masked pointer loads and stores do."""
    from natsim.kernels import sparse_reference
    from natsim.kernels.sparse.backward import sparse_backward

    generator = torch.Generator().manual_seed(seq_len)
    nb = -(-seq_len // block)
    mask = torch.rand(1, 2, nb, nb, generator=generator) < 0.5
    mask[..., 0] = True
    q, k, v, g = (torch.randn(2, seq_len, 2, 16, generator=generator).half() for _ in range(4))
    out, lse = sparse_reference(q.float(), k.float(), v.float(), mask, block, block, return_lse=True)
    args = (q, k, v, out.half(), lse, g, None, mask, block, block)
    pointers = sparse_backward(*args, options=dict(USE_TMA=False))
    for name, a, b in zip(("dq", "dk", "dv"), sparse_backward(*args), pointers):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------------
# Sparse attention's backward (kernels/sparse_backward.py) against sparse_reference's gradients


@st.composite
def sparse_problems(draw):
    """A random block mask (batch and heads of 1 broadcasting, empty rows) over N not a multiple of the blocks."""
    q_block = draw(st.sampled_from([8, 16, 32]))
    kv_block = draw(st.sampled_from([1, 4, 16, 32]))
    seq_len = draw(st.integers(9, 70))
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    mask_batch, mask_heads = draw(st.sampled_from([1, batch])), draw(st.sampled_from([1, heads]))
    density = draw(st.sampled_from([0.2, 0.6, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return q_block, kv_block, seq_len, batch, heads, mask_batch, mask_heads, density, seed


@KERNEL
@given(sparse_problems(), st.sampled_from([torch.float16, torch.float32]), st.booleans())
def test_sparse_backward_kernels_match_float64_reference_gradients(case, dtype, with_lse_gradient):
    from natsim.kernels import sparse_reference
    from natsim.kernels.sparse.backward import sparse_backward

    q_block, kv_block, seq_len, batch, heads, mask_batch, mask_heads, density, seed = case
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(mask_batch, mask_heads, -(-seq_len // q_block), -(-seq_len // kv_block),
                      generator=generator) < density
    mask[..., -1, :] = False  # a query block that attends nothing
    q, k, v, g = (torch.randn(batch, seq_len, heads, 16, generator=generator).to(dtype) for _ in range(4))
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = sparse_reference(*inputs, mask, q_block, kv_block, return_lse=True)
    grad_lse = torch.randn(lse.shape, generator=generator).masked_fill(lse.isinf(), 0.0) if with_lse_gradient else None
    want = torch.autograd.grad([out] + ([lse] if with_lse_gradient else []), inputs,
                               [g.double()] + ([grad_lse.double()] if with_lse_gradient else []))
    got = sparse_backward(q, k, v, out.detach().to(dtype), lse.detach().float(), g, grad_lse, mask, q_block, kv_block)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel_error(a, b) < TOLERANCE[dtype], f"{name}: {rel_error(a, b):.2e}"


def test_sparse_attention_is_differentiable_under_compile_and_merging():
    """Through AOTAutograd (backend "aot_eager": the graphs Inductor would lower, without the CPU's C++ code
    generation, which took most of this test; tests/test_ops.py runs Inductor on the operators)."""
    from natsim.kernels import sparse_attention, sparse_reference

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 60, 2, 32, device=DEVICE).half().requires_grad_() for _ in range(3))
    mask = torch.rand(1, 2, 4, 2) < 0.6
    mask[0, 0, 0] = True

    def loss(q, k, v):
        return sparse_attention(q, k, v, mask, 16, 32, merge="consecutive").float().square().sum()

    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v))
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(sparse_reference(*inputs, mask, 16, 32).square().sum(), inputs)
    for a, b in zip(got, want):
        assert rel_error(a, b) < 1e-2


TUNING_PROBLEMS = [
    (Problem((6, 10), (3, 4), (1, 2), 1, (True, False)), (2, 8), (4, 4)),  # masked pairs and full ones
    (Problem((4, 8, 8), (2, 8, 8), (2, 4, 4)), (1, 4, 4), (2, 4, 4)),  # block-sparse: eight full Q tiles per KV tile
    (Problem((6, 9), (3, 4), 1, (2, 2)), (2, 8), (2, 8)),  # dilation: padded tiles in every group, masked stores
]
# The switches act over DEFAULT_VARIANT (ATOMIC_DQ off, IN_TILE on). In the interpreter the launch options
# (num_stages, DQ_STAGES, num_warps) change nothing, so dict(ATOMIC_DQ=False), dict(IN_TILE=True) and the
# DQ_STAGES variant computed the very same thing, as did dict(ATOMIC_DQ=True) and dict(ATOMIC_DQ=True,
# IN_TILE=True): each runs once here, on every problem. IN_TILE acts only on unpadded tiles, so its other value
# (per-row coordinates) runs on the block-sparse problem, the one without padding.
TUNING_VARIANTS = [dict(ATOMIC_DQ=True, IN_TILE=True), dict(ATOMIC_DQ=False, IN_TILE=True, num_stages=3, DQ_STAGES=2)]
TUNING_CASES = [pytest.param(options, *case, id=f"problem{i}-options{j}")
                for j, options in enumerate(TUNING_VARIANTS) for i, case in enumerate(TUNING_PROBLEMS)]
TUNING_CASES.append(pytest.param(dict(IN_TILE=False), *TUNING_PROBLEMS[1], id="problem1-in-tile-off"))


@pytest.mark.parametrize("options, problem, q_tile, kv_tile", TUNING_CASES)
def test_tuning_variants_match_float64_reference_gradients(options, problem, q_tile, kv_tile):
    q, k, v, g = (torch.randn(1, *problem.shape, 2, 16) for _ in range(4))
    want, out, lse = reference_grads(problem, q, k, v, g)
    got = gna_backward(q, k, v, out.float(), lse.float(), g, None, problem, 16**-0.5, q_tile, kv_tile,
                       options=options)
    for name, a, ref in zip(("dq", "dk", "dv"), got, want):
        assert rel_error(a, ref) < 1e-4, name
