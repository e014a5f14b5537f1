"""FlashAttention-4 as natsim's backend, on a Hopper GPU with flash-attn-4 installed: GNA (block-sparse and through
the GNA mask_mod) and block masks against float64 references, forward and backward, compiled with fullgraph and
replayed under CUDA graphs, under autocast, and natsim's own choice of backend. `pytest -m gpu tests/test_fa4_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import gna_attention, prepare_sparse, reference_attention, sparse_attention, sparse_reference
from natsim.kernels.backends.fa4 import HEAD_DIMS, device_refusal, tile_refusal
from natsim.kernels.fa4 import run as fa4_run
from natsim.kernels.fa4.lists import lists_from_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or device_refusal(torch.device("cuda")) is not None,
                       reason="FlashAttention-4 runs here only on a Hopper GPU with flash-attn-4 installed"),
]

# shape, window, stride, dilation, causal, q_tile, kv_tile
GEOMETRIES = [
    ((8, 16, 16), (4, 8, 8), (4, 8, 8), 1, False, (2, 8, 8), (2, 8, 8)),  # block-sparse: no mask
    ((6, 10, 12), (3, 5, 7), 1, 1, False, (2, 8, 8), (1, 8, 8)),  # neighborhood: partial tiles, padding
    ((5, 9, 14), (3, 4, 5), (2, 1, 3), (1, 2, 1), (True, False, False), (2, 4, 8), (1, 4, 8)),
    ((40, 36), (9, 12), (1, 4), 1, (False, True), (8, 16), (4, 16)),
    ((1000,), (301,), (1,), (1,), (True,), (128,), (64,)),
    ((12, 20), (12, 20), 1, 1, False, (8, 16), (8, 16)),  # dense, padded along dimension 1
]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def inputs(shape, heads, head_dim, dtype, seed, count=3, requires_grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, *shape, heads, head_dim, device="cuda", generator=gen, dtype=dtype)
            .requires_grad_(requires_grad) for _ in range(count)]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("head_dim, dtype", [(128, torch.bfloat16), (64, torch.float16), (96, torch.bfloat16)])
def test_gna_forward_matches_float64(geometry, head_dim, dtype):
    shape, window, stride, dilation, causal, q_tile, kv_tile = geometry
    q, k, v = inputs(shape, 3, head_dim, dtype, seed=head_dim)
    out, lse = gna_attention(q, k, v, window, stride, dilation, causal, q_tile=q_tile, kv_tile=kv_tile,
                             return_lse=True, backend="fa4")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), window, stride, dilation, causal,
                                       return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:-1]
    assert relative_error(out, ref) < (1e-2 if dtype == torch.bfloat16 else 5e-3)
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3


@pytest.mark.parametrize("geometry, head_dim", [
    (((8, 16, 16), (4, 8, 8), (4, 8, 8), 1, False, (2, 8, 8), (2, 8, 8)), 128),
    (((6, 16, 16), (3, 5, 7), 1, 1, False, (2, 8, 8), (2, 8, 8)), 128),
    (((6, 16, 16), (3, 5, 7), (1, 2, 1), 1, (True, False, False), (2, 8, 8), (2, 8, 8)), 64),
    (((1024,), (257,), (1,), (1,), (False,), (256,), (128,)), 128),
    (((1000,), (1000,), (1,), (1,), (False,), (128,), (128,)), 128),  # dense 1-D: FA4's plain dense call
    (((4, 10, 12), (4, 10, 12), 1, 1, False, (2, 8, 8), (2, 8, 8)), 64),  # dense 3-D, padded
])
def test_gna_gradients_match_float64(geometry, head_dim):
    shape, window, stride, dilation, causal, q_tile, kv_tile = geometry
    q, k, v = inputs(shape, 2, head_dim, torch.bfloat16, seed=7, requires_grad=True)
    grad = torch.randn_like(q)
    gna_attention(q, k, v, window, stride, dilation, causal, q_tile=q_tile, kv_tile=kv_tile,
                  backend="fa4").backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference_attention(*leaves, window, stride, dilation, causal).backward(grad.double())
    for ours, ref in zip((q, k, v), leaves):
        assert relative_error(ours.grad, ref.grad) < 1e-2


@pytest.mark.parametrize("density, q_block, kv_block", [(0.3, 128, 128), (0.5, 64, 64), (0.2, 128, 32)])
def test_block_masks_forward_and_backward_match_float64(density, q_block, kv_block):
    """Forward on every block size FlashAttention-4 runs; gradients where its backward runs the blocks (key blocks
    of 128 tokens at head_dim 128), which prepare_sparse(..., backward=True) refuses elsewhere."""
    n, heads = 2048 + 64, 4  # a partial last block
    backward = kv_block == 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    mask = torch.rand(1, heads, -(-n // q_block), -(-n // kv_block), device="cuda", generator=gen) < density
    q, k, v = (torch.randn(2, n, heads, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
               .requires_grad_(backward) for _ in range(3))
    work = prepare_sparse(mask, q_block, kv_block, n, backend="fa4", backward=backward)
    assert work.backend == "fa4"
    if not backward:
        with pytest.raises(ValueError, match="backward at head_dim=128 runs key blocks of 128 tokens"):
            prepare_sparse(mask, q_block, kv_block, n, backend="fa4", backward=True)
    out = sparse_attention(q, k, v, work)
    leaves = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ref = sparse_reference(*leaves, mask, q_block, kv_block)
    attended = ref.detach().abs().sum(-1) > 0  # rows that attend nothing are 0 in both
    assert relative_error(out.detach()[attended], ref.detach()[attended]) < 1e-2
    if backward:
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad.double())
        for ours, theirs in zip((q, k, v), leaves):
            assert relative_error(ours.grad, theirs.grad) < 1e-2


@pytest.mark.parametrize("head_dim", [d for d in HEAD_DIMS if d <= 128])
def test_the_backward_is_right_at_every_head_dim_natsim_differentiates_through_it(head_dim):
    """natsim's rules against the library at every width its backward runs: where `tile_refusal` lets
    FlashAttention-4 differentiate 128 x 128 blocks (a partial last block included), its gradients match float64;
    where it refuses them for the dQ accumulator, the library's own dQ is still wrong and its dK and dV right (a
    release that fixes it fails this test, and the rule goes)."""
    n, heads, block = 1000, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    mask = torch.rand(1, heads, -(-n // block), -(-n // block), device="cuda", generator=gen) < 0.7
    q, k, v, grad = (torch.randn(1, n, heads, head_dim, device="cuda", generator=gen, dtype=torch.float16)
                     for _ in range(4))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = sparse_reference(*leaves, mask, block, block)
    want.backward(grad.double())
    refusal = tile_refusal(block, block, head_dim, backward=True)
    if refusal is None:
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sparse_attention(*ours, prepare_sparse(mask, block, block, n, backend="fa4"))
        out.backward(grad)
        grads = [t.grad for t in ours]
    else:
        assert "wrong dQ" in refusal, refusal
        lists = lists_from_blocks(mask, mask, block, block)
        out, lse = fa4_run.forward(q, k, v, head_dim ** -0.5, lists, None, True)
        grads = fa4_run.backward(q, k, v, out, grad, lse, None, head_dim ** -0.5, lists, None)
    assert relative_error(out.detach(), want.detach()) < 1e-2
    errors = [relative_error(ours, theirs.grad) for ours, theirs in zip(grads, leaves)]
    if refusal is None:
        assert max(errors) < 1e-2, errors
    else:
        assert errors[0] > 1e-2, f"FlashAttention-4's dQ is right at head_dim={head_dim} now: lift the refusal"
        assert max(errors[1:]) < 1e-2, errors


def test_compiled_fullgraph_and_cuda_graph_replay_without_recompiles():
    shape, window, stride = (8, 16, 16), (4, 8, 8), (1, 1, 1)
    q, k, v = inputs(shape, 4, 128, torch.bfloat16, seed=11)

    def attend(q, k, v):
        return gna_attention(q, k, v, window, stride, q_tile=(2, 8, 8), kv_tile=(2, 8, 8), backend="fa4") * 2

    eager = attend(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        graphed = compiled(q, k, v).clone()
    assert relative_error(graphed, eager) < 1e-3
    fresh = inputs(shape, 4, 128, torch.bfloat16, seed=12)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.compiler.cudagraph_mark_step_begin()
        again = compiled(*fresh).clone()
    assert relative_error(again, attend(*fresh)) < 1e-3


def test_a_prepared_mask_on_fa4_compiles_fullgraph_and_replays_under_cuda_graphs():
    n, heads = 4096, 4
    gen = torch.Generator(device="cuda").manual_seed(13)
    mask = torch.rand(1, heads, n // 128, n // 128, device="cuda", generator=gen) < 0.3
    work = prepare_sparse(mask, 128, 128, n, backend="fa4", backward=False)
    q, k, v = (torch.randn(1, n, heads, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))

    def attend(q, k, v):
        return sparse_attention(q, k, v, work) + 1

    eager = attend(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        graphed = compiled(q, k, v).clone()
    assert relative_error(graphed, eager) < 1e-3
    ref = sparse_reference(q.double(), k.double(), v.double(), mask, 128, 128) + 1
    assert relative_error(eager, ref) < 1e-2


def test_autocast_casts_float32_inputs():
    q, k, v = inputs((8, 16, 16), 2, 64, torch.float32, seed=5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = gna_attention(q, k, v, (4, 8, 8), (4, 8, 8), q_tile=(2, 8, 8), kv_tile=(2, 8, 8), backend="fa4")
    assert out.dtype == torch.bfloat16
    ref = reference_attention(q.double(), k.double(), v.double(), (4, 8, 8), (4, 8, 8))
    assert relative_error(out, ref) < 1e-2


def test_natsim_picks_fa4_for_block_sparse_calls_and_triton_for_partial_tiles():
    from natsim.kernels import chosen_backend

    q, k, v = inputs((8, 16, 16), 2, 128, torch.bfloat16, seed=9)
    assert chosen_backend(q, k, v, (4, 8, 8), (4, 8, 8), q_tile=(2, 8, 8), kv_tile=(2, 8, 8)) == "fa4"
    assert chosen_backend(q, k, v, (3, 5, 7), 1, q_tile=(2, 8, 8), kv_tile=(2, 8, 8)) == "triton"


def test_tokens_kept_in_tile_order_run_on_fa4_as_they_are_forward_backward_and_compiled():
    """A plan on FlashAttention-4 with tokens already in its Q tile's order (a model kept in tile order,
    integrations/diffusers/order.py) equals the row-major call permuted, forward and backward, eager and
    compiled."""
    from natsim.planner import AutoPlan

    shape, heads, head_dim = (8, 16, 32), 4, 128
    auto = AutoPlan(0.0, window=(4, 8, 8), max_stride=(4, 8, 8))
    order = auto.tile_order(shape, heads=heads, head_dim=head_dim, dtype=torch.bfloat16, device="cuda")
    if order is None:
        pytest.skip("the plan does not run on FlashAttention-4 here (no cost model prices it)")
    q, k, v, g = inputs(shape, heads, head_dim, torch.bfloat16, seed=21, count=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = auto(*leaves)
    want_grads = torch.autograd.grad(want, leaves, g)

    def ordered(t):
        return order.to_order(t.reshape(2, -1, heads, head_dim))

    ordered_leaves = [ordered(t).detach().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: auto(q, k, v, order=order), fullgraph=True)
    for run in (lambda q, k, v: auto(q, k, v, order=order), compiled):
        got = run(*ordered_leaves)
        assert relative_error(got, ordered(want)) < 1e-3
        for got_grad, want_grad in zip(torch.autograd.grad(got, ordered_leaves, ordered(g)), want_grads):
            assert relative_error(got_grad, ordered(want_grad)) < 1e-3
