"""The GNA backward on a CUDA GPU at real sizes: `pytest -m gpu tests/test_backward_gpu.py`.

Gradients of `gna_attention` (the registered operator and its Triton backward) against the float32 chunked
reference on full video layouts (two heads, to keep the reference quick), the dK/dV kernel's tile counts
against `natsim.simulate_backward`, forward + backward under torch.compile, and `sparse_attention`'s gradients
against autograd through `sparse_reference` in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import natsim
from natsim.kernels import gna_attention
from natsim.kernels.gna.backward import DEFAULT_VARIANT, backward_tile_counts, backward_tiles
from natsim.kernels.gna.reference import reference_gradients

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}

REAL = [
    # shape, window, stride, dilation, causal, head_dim, dtype
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), 1, False, 128, torch.bfloat16),
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), 1, False, 128, torch.bfloat16),
    ((30, 48, 80), (30, 48, 80), 1, 1, False, 128, torch.bfloat16),
    ((256, 256), (80, 80), (16, 16), 1, False, 64, torch.bfloat16),
    ((8192,), 2048, 256, 1, True, 128, torch.float16),
    ((13, 21, 35), (5, 8, 7), (2, 3, 1), (2, 1, 3), (True, False, False), 64, torch.float16),
    ((12, 40, 40), (4, 9, 8), (4, 3, 8), (1, 2, 1), False, 32, torch.float16),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape, window, stride, dilation, causal, head_dim, dtype", REAL)
def test_gradients_match_the_float32_reference_on_full_layouts(shape, window, stride, dilation, causal, head_dim,
                                                               dtype):
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, *shape, 2, head_dim, device="cuda", dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = gna_attention(q, k, v, window, stride, dilation, causal)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = reference_gradients(q.detach(), k.detach(), v.detach(), g, window, stride, dilation, causal)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < TOLERANCE[dtype], (name, rel(a, b))


@pytest.mark.parametrize("shape, window, stride", [
    ((30, 48, 80), (18, 24, 24), (1, 1, 1)), ((30, 48, 80), (18, 24, 24), (1, 8, 8)),
    ((30, 48, 80), (18, 24, 24), (16, 8, 8)), ((256, 256), (80, 80), (16, 16)),
])
def test_dkdv_tile_counts_equal_the_simulator_at_real_sizes(shape, window, stride):
    problem = natsim.Problem(shape, window, stride)
    q_tile, kv_tile = backward_tiles(problem, 128)
    visited, full = backward_tile_counts(problem, q_tile, kv_tile)
    sim = natsim.simulate_backward(problem, natsim.TileConfig(q_tile, kv_tile))
    np.testing.assert_array_equal(visited, sim.per_kv_tile_visited)
    np.testing.assert_array_equal(full, sim.per_kv_tile_full)


def test_compiled_forward_and_backward_equal_eager():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, 20, 24, 3, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def loss(q, k, v):
        return gna_attention(q, k, v, (5, 7, 9), (1, 2, 3)).float().square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    # dK and dV are summed in a fixed order: bit-identical. dQ too, unless it is summed by fp32 atomics
    # (ATOMIC_DQ), whose order varies per run: then equal up to bf16 rounding of the same fp32 sum.
    torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=2 ** -7 if DEFAULT_VARIANT.get("ATOMIC_DQ") else 0,
                               atol=1e-5 if DEFAULT_VARIANT.get("ATOMIC_DQ") else 0)


def _replays_under_a_cuda_graph(step, refill, stream=None):
    """Capture `step` (returning gradients) in a CUDA graph on `stream` (default: a new side stream), refill the
    static tensors in `refill` with new values, replay, and compare with an eager `step` on the new values."""
    stream = torch.cuda.Stream() if stream is None else stream
    stream.wait_stream(torch.cuda.current_stream())  # warm-up (compiles, allocator) off the default stream
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    for t in refill:
        with torch.no_grad():
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        want = step()
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), captured, want):
        assert rel(a, b) < 1e-6, (name, rel(a, b))  # the same kernels on the same inputs


def test_gna_forward_and_backward_replay_under_a_cuda_graph():
    torch.manual_seed(1)
    shape = (6, 20, 24)
    q, k, v, grad = (torch.randn(1, *shape, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    _replays_under_a_cuda_graph(
        lambda: torch.autograd.grad(gna_attention(*leaves, (3, 7, 9), (1, 2, 3)), leaves, grad), [*leaves, grad])


def test_sparse_backward_replays_under_a_cuda_graph():
    """With the bare mask the forward prepares its work on the host, which a capture cannot hold: the forward runs
    eagerly first, on the capture stream (autograd runs a backward op on its forward's stream), and the backward
    alone (tile lists by torch ops, then the kernels) is captured."""
    from natsim.kernels import sparse_attention

    torch.manual_seed(2)
    mask = torch.rand(1, 2, 8, 8, device="cuda") < 0.5
    q, k, v, grad = (torch.randn(1, 1000, 2, 64, device="cuda", dtype=torch.float16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = sparse_attention(*leaves, mask, 128, 128)
    _replays_under_a_cuda_graph(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), [grad], stream)


def test_prepared_sparse_forward_and_backward_replay_under_a_cuda_graph():
    """A prepared mask (SparseWork) carries all host work: a whole training step's attention, forward and
    backward, is captured and replays on new inputs."""
    from natsim.kernels import prepare_sparse, sparse_attention

    torch.manual_seed(3)
    mask = torch.rand(1, 2, 16, 8, device="cuda") < 0.5
    work = prepare_sparse(mask, 64, 128, 1000, merge="consecutive")
    q, k, v, grad = (torch.randn(1, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    _replays_under_a_cuda_graph(lambda: torch.autograd.grad(sparse_attention(*leaves, work), leaves, grad),
                                [*leaves, grad])


@pytest.mark.parametrize("q_block, kv_block, merge, density", [
    (128, 128, None, 0.3), (64, 64, None, 0.5), (64, 16, "xor", 0.5), (16, 128, "consecutive", 0.7),
])
@pytest.mark.parametrize("backend", ["triton", "fa4"])
def test_prepared_mask_gradients_equal_the_boolean_masks_bit_for_bit(q_block, kv_block, merge, density, backend):
    """Work prepared once computes what the boolean mask computes on the same backend (a boolean mask runs on
    natsim's kernels unless backend='fa4' is named; prepared work on natsim's choice, FlashAttention-4 where it
    takes the blocks): bit for bit, but for FlashAttention-4's dQ, which it accumulates with atomics."""
    from natsim.kernels import prepare_sparse, sparse_attention
    from natsim.kernels.backends import fa4

    if backend == "fa4" and (fa4.device_refusal(torch.device("cuda")) is not None or merge is not None
                             or fa4.tile_refusal(q_block, kv_block, 128, backward=True) is not None):
        pytest.skip("FlashAttention-4 is not installed or does not run these blocks")
    torch.manual_seed(4)
    seq_len, heads = 12000, 2
    mask = torch.rand(1, heads, -(-seq_len // q_block), -(-seq_len // kv_block), device="cuda") < density
    q, k, v, g = (torch.randn(1, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def grads(*mask_args, **kwargs):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sparse_attention(*leaves, *mask_args, **kwargs)
        return (out,) + torch.autograd.grad(out, leaves, g)

    want = grads(mask, q_block, kv_block, merge=merge, backend=backend)
    got = grads(prepare_sparse(mask, q_block, kv_block, seq_len, merge=merge, backend=backend))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        if backend == "fa4" and name == "dq":  # FlashAttention-4 sums dQ with atomics: its order varies per run
            assert rel(a, b) < 1e-3, name
        else:
            assert torch.equal(a, b), name


def test_prepared_masks_run_one_compiled_graph_on_the_gpu():
    from natsim.kernels import prepare_sparse, sparse_attention

    torch._dynamo.reset()
    seq_len, heads = 4096, 2

    def loss(q, k, v, work):
        return sparse_attention(q, k, v, work).float().square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    for step, density in enumerate((0.2, 0.5, 0.9)):
        torch.manual_seed(step)
        mask = torch.rand(1, heads, 32, 32, device="cuda") < density
        work = prepare_sparse(mask, 128, 128, seq_len)
        leaves = [torch.randn(1, seq_len, heads, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
                  for _ in range(3)]
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            got = torch.autograd.grad(compiled(*leaves, work), leaves)
        want = torch.autograd.grad(loss(*leaves, work), leaves)
        for a, b in zip(got, want):
            assert rel(a, b) < 1e-3


@pytest.mark.parametrize("q_block, kv_block, merge, density", [
    (128, 128, None, 0.3), (64, 16, "xor", 0.5), (16, 128, "consecutive", 0.7),
])
def test_sparse_attention_gradients_match_the_float32_reference(q_block, kv_block, merge, density):
    from natsim.kernels import sparse_attention, sparse_reference

    torch.manual_seed(0)
    seq_len, heads = 16000, 2
    mask = torch.rand(1, heads, -(-seq_len // q_block), -(-seq_len // kv_block), device="cuda") < density
    q, k, v, g = (torch.randn(1, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(sparse_attention(*leaves, mask, q_block, kv_block, merge=merge), leaves, g)
    inputs = [t.float().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(sparse_reference(*inputs, mask, q_block, kv_block), inputs, g.float())
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < TOLERANCE[torch.bfloat16], (name, rel(a, b))


@pytest.mark.parametrize("options", [dict(ATOMIC_DQ=True), dict(ATOMIC_DQ=2), dict(ATOMIC_DQ=False, num_stages=2),
                                     dict(IN_TILE=True), dict(USE_TMA=False)])
@pytest.mark.parametrize("stride", [(1, 1, 1), (16, 8, 8)])
def test_tuning_variants_match_the_float32_reference(stride, options):
    from natsim.kernels.gna.backward import gna_backward
    from natsim.kernels.gna.dispatch import forward

    shape, window = (30, 48, 80), (18, 24, 24)
    problem = natsim.Problem(shape, window, stride)
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, *shape, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = forward(q, k, v, window, stride, 1, False, None, None, None, True)
    q_tile, kv_tile = backward_tiles(problem, 128)
    grads = gna_backward(q, k, v, out, lse, g, None, problem, 128**-0.5, q_tile, kv_tile, options=options)
    want = reference_gradients(q, k, v, g, window, stride)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert rel(got, ref) < TOLERANCE[torch.bfloat16], name


@pytest.mark.gpu
def test_gpu_checkpointed_training_step_recomputes_the_forward_in_autograds_thread():
    """Activation checkpointing recomputes the forward in autograd's device thread, where Triton's descriptor
    allocator (a per-thread context variable) is not installed unless the launcher installs it there too."""
    import threading

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 16, 16, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = checkpoint(lambda q, k, v: gna_attention(q, k, v, (5, 7, 7)), q, k, v, use_reentrant=False)
    out.float().square().mean().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))

    outcome = []

    def in_a_new_thread():
        try:
            outcome.append(bool(torch.isfinite(gna_attention(q.detach(), k.detach(), v.detach(), (5, 7, 7))).all()))
        except Exception as error:  # reported below: a thread's exception would not fail the test
            outcome.append(repr(error))

    thread = threading.Thread(target=in_a_new_thread)
    thread.start()
    thread.join()
    assert outcome == [True]
