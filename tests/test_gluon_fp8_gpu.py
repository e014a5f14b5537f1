"""The Gluon FP8 kernel (kernels/gluon/forward.py) on a Hopper GPU: against float32 attention under the same
block mask and against the FP8 rule's reference (the operator's CPU path, K's scales shared by key blocks), dense
and block-sparse, sequences that are not whole blocks, empty rows, both head dims, the LSE; compiled with
fullgraph and replayed in a CUDA graph. `pytest -m gpu tests/test_gluon_fp8_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from cuda_graphs import replayed_on_new_inputs
from natsim.kernels.gluon.forward import BLOCK_N
from natsim.kernels.gluon.ops import fp8_block_attention
from natsim.kernels.sparse.reference import sparse_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the Gluon FP8 kernel runs on Hopper GPUs"),
]


def block_mask(batch, heads, rows, density, seed):
    blocks = -(-rows // BLOCK_N)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, heads, blocks, blocks, generator=gen) < density
    mask |= torch.eye(blocks, dtype=torch.bool)
    if blocks > 2:
        mask[0, 0, 1] = False  # a query block with no key block: zeros, LSE -inf
    return mask


@pytest.mark.parametrize("rows", [256, 777, 1000])
@pytest.mark.parametrize("head_dim, dtype", [(128, torch.bfloat16), (64, torch.float16)])
@pytest.mark.parametrize("density", [1.0, 0.4])
def test_matches_float32_attention_and_the_rule(rows, head_dim, dtype, density):
    gen = torch.Generator(device="cuda").manual_seed(rows + head_dim)
    q, k, v = (torch.randn(2, rows, 3, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    mask = None if density == 1.0 else block_mask(2, 3, rows, density, rows).cuda()
    out, lse = fp8_block_attention(q, k, v, mask, return_lse=True)
    full = torch.ones(1, 1, -(-rows // BLOCK_N), -(-rows // BLOCK_N), dtype=torch.bool, device="cuda")
    ref, ref_lse = sparse_reference(q.float(), k.float(), v.float(), full if mask is None else mask, BLOCK_N,
                                    BLOCK_N, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    error = float((out.float() - ref).norm() / ref.norm())
    cosine = float(torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), 0))
    assert error < 6e-2 and cosine > 0.998
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert float((lse[finite] - ref_lse[finite]).abs().max()) < 5e-2
    rule, rule_lse = fp8_block_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                                         return_lse=True)
    # The rule rounds P against each row's final maximum; the kernel against a reference maximum that trails the
    # running one by up to 2 ** RESCALE_SLACK at head_dim 128 (lazy rescaling), which moves P's rounding points:
    # 3.2e-2 measured on 777 rows (H100), against 5.2e-2 for both from float32 attention
    assert float((out.cpu().float() - rule.float()).norm() / rule.float().norm()) < 4e-2
    # Hopper's FP8 products accumulate with fewer than fp32's bits: the LSE differs from the rule's fp32 one by
    # about 1e-2 (0.010 to 0.014 measured, H100)
    lse_difference = float((lse.cpu()[finite.cpu()] - rule_lse[finite.cpu()]).abs().max())
    assert lse_difference < 2.5e-2, lse_difference


def test_compiled_fullgraph_and_cuda_graph_replay():
    q, k, v = (torch.randn(1, 640, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = block_mask(1, 2, 640, 0.5, 3).cuda()
    eager = fp8_block_attention(q, k, v, mask)
    compiled = torch.compile(fp8_block_attention, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), eager, rtol=0, atol=0)
    static = [t.clone() for t in (q, k, v)]
    fp8_block_attention(*static, mask)  # compile and warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_block_attention(*static, mask)
    for t, new in zip(static, (torch.randn_like(q) for _ in range(3))):
        t.copy_(new)
    graph.replay()
    torch.testing.assert_close(replayed, fp8_block_attention(*static, mask), rtol=0, atol=0)


def test_sparse_attention_in_fp8_runs_the_gluon_kernel_unless_told_otherwise():
    from natsim.kernels import prepare_sparse, sparse_attention

    q, k, v = (torch.randn(2, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = block_mask(2, 2, 1024, 0.5, 11).cuda()
    gluon = fp8_block_attention(q, k, v, mask)
    assert torch.equal(sparse_attention(q, k, v, mask, 128, 128, precision="fp8"), gluon)
    work = prepare_sparse(mask, 128, 128, 1024, backward=False)
    assert torch.equal(sparse_attention(q, k, v, work, precision="fp8"), gluon)
    triton_fp8 = sparse_attention(q, k, v, mask, 128, 128, precision="fp8", backend="triton")
    assert not torch.equal(triton_fp8, gluon)  # per-key scales and another kernel: the Triton FP8 path ran
    ref = sparse_reference(q.float(), k.float(), v.float(), mask, 128, 128)
    for out in (gluon, triton_fp8):
        assert float((out.float() - ref).norm() / ref.norm()) < 6e-2


@pytest.mark.parametrize("shape, window, stride", [((8, 16, 32), (4, 8, 8), (4, 8, 8)), ((4096,), (4096,), (1,))])
def test_gna_in_fp8_on_whole_tiles_runs_the_gluon_kernel(shape, window, stride):
    from natsim.kernels import chosen_backend, gna_attention, reference_attention

    q, k, v = (torch.randn(1, *shape, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert chosen_backend(q, k, v, window, stride, precision="fp8") == "gluon"
    out, lse = gna_attention(q, k, v, window, stride, precision="fp8", return_lse=True)
    ref, ref_lse = reference_attention(q.float(), k.float(), v.float(), window, stride, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert float((out.float() - ref).norm() / ref.norm()) < 6e-2
    assert float((lse - ref_lse).abs().max()) < 5e-2
    compiled = torch.compile(lambda q, k, v: gna_attention(q, k, v, window, stride, precision="fp8"), fullgraph=True,
                             dynamic=False)
    torch.testing.assert_close(compiled(q, k, v), out, rtol=0, atol=0)


@pytest.mark.parametrize("heads, backend", [(64, "gluon"), (1, "triton")])
def test_gna_in_fp8_on_partial_tiles_takes_the_gluon_kernel_where_they_pay(heads, backend):
    """An FP8 call left to natsim on partial tiles: the Gluon kernel where the call visits enough blocks (64 heads
    of a 16x32x32 layout, window 5x11x11: 2,400 blocks a head), bit for bit the call naming it; the Triton FP8
    kernel on one head; both within FP8's error of float32 attention."""
    from natsim.kernels import chosen_backend, gna_attention, reference_attention

    shape, window = (16, 32, 32), (5, 11, 11)
    q, k, v = (torch.randn(1, *shape, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert chosen_backend(q, k, v, window, precision="fp8") == backend
    out = gna_attention(q, k, v, window, precision="fp8")
    named = gna_attention(q, k, v, window, precision="fp8", backend=backend)
    assert torch.equal(out, named)
    few = slice(0, 1)
    ref = reference_attention(*(t[..., few, :].float() for t in (q, k, v)), window)
    assert float((out[..., few, :].float() - ref).norm() / ref.norm()) < 6e-2


@pytest.mark.parametrize("shape, window, stride, tile", [((8, 16, 32), (4, 8, 16), (4, 8, 16), (1, 8, 16)),
                                                         ((2048,), (1024,), (256,), (128,))])
def test_gna_naming_gluon_on_the_gpu_equals_its_cpu_rule_and_runs_in_tile_order(shape, window, stride, tile):
    from natsim.kernels import TileOrder, gna_attention
    from natsim.kernels.gna.ordered import run_ordered
    from natsim.kernels.gna.spec import GnaSpec

    gen = torch.Generator(device="cuda").manual_seed(len(shape))
    q, k, v = (torch.randn(1, *shape, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    call = dict(q_tile=tile, kv_tile=tile, precision="fp8", backend="gluon")
    out, lse = gna_attention(q, k, v, window, stride, return_lse=True, **call)
    rule, rule_lse = gna_attention(q.cpu(), k.cpu(), v.cpu(), window, stride, return_lse=True, **call)
    # The rule rounds P against each row's final maximum; the kernel against a reference maximum that trails the
    # running one by up to 2 ** RESCALE_SLACK at head_dim 128 (lazy rescaling), which moves P's rounding points:
    # 3.2e-2 measured on 777 rows (H100), against 5.2e-2 for both from float32 attention
    assert float((out.cpu().float() - rule.float()).norm() / rule.float().norm()) < 4e-2
    assert float((lse.cpu() - rule_lse).abs().max()) < 2.5e-2
    order = TileOrder(shape, tile, (1,) * len(shape))
    ordered = [order.to_order(t.reshape(1, -1, 2, 64)) for t in (q, k, v)]
    spec = GnaSpec.of(len(shape), window, stride, q_tile=tile, kv_tile=tile, precision="fp8", backend="gluon")
    in_order, _ = run_ordered(*ordered, order, spec)
    torch.testing.assert_close(order.from_order(in_order).reshape(q.shape), out, rtol=0, atol=0)


def test_an_fp8_plan_priced_for_gluon_runs_on_it():
    from dataclasses import replace

    from natsim.kernels import reference_attention
    from natsim.planner import best, cost_model_for

    model = cost_model_for(torch.cuda.get_device_name())
    gluon = model.gluon_fp8_coefficients or {"flops": 6e-16, "narrow_head_flops": 2e-16, "blocks": 1e-10,
                                             "programs": 1e-8, "moved_bytes": 4e-13, "launch": 6e-5}
    plan = best((8, 32, 64), 0.8, heads=4, window=(4, 16, 16), precision="fp8",
                cost_model=replace(model, gluon_fp8_coefficients=gluon), backends="gluon")
    assert plan.backend == "gluon"
    q, k, v = (torch.randn(1, 8, 32, 64, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    p = plan.problem
    ref = reference_attention(q.float(), k.float(), v.float(), p.window, p.stride)
    assert float((plan(q, k, v).float() - ref).norm() / ref.norm()) < 6e-2


PARTIAL_CASES = [  # (shape, window, stride, dilation, causal, tile): every case visits partial tiles
    ((3, 21, 40), (3, 9, 15), (1, 1, 1), (1, 1, 1), (False, False, False), (1, 8, 16)),  # padding along 21
    ((9, 20, 24), (4, 7, 9), (1, 2, 3), (2, 1, 1), (True, False, False), (2, 4, 16)),  # dilation, causal, stride
    ((40, 50), (16, 21), (4, 5), (1, 2), (False, False), (8, 16)),  # even window, dilation in 2-D
    ((3000,), (700,), (100,), (1,), (True,), (128,)),  # 1-D causal
]


@pytest.mark.parametrize("shape, window, stride, dilation, causal, tile", PARTIAL_CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gna_on_partial_tiles_equals_the_rule_and_float32_attention(shape, window, stride, dilation, causal, tile,
                                                                    head_dim):
    from natsim import Problem, TileConfig, simulate
    from natsim.kernels import gna_attention, reference_attention

    problem = Problem(shape, window, stride, dilation, causal)
    counts = simulate(problem, TileConfig(tile, tile))
    assert counts.visited_tiles > counts.full_tiles  # partial tiles are visited
    gen = torch.Generator(device="cuda").manual_seed(head_dim + len(shape))
    q, k, v = (torch.randn(1, *shape, 2, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    args = dict(window=window, stride=stride, dilation=dilation, causal=causal)
    call = dict(q_tile=tile, kv_tile=tile, precision="fp8", backend="gluon", return_lse=True)
    out, lse = gna_attention(q, k, v, **args, **call)
    ref, ref_lse = reference_attention(q.float(), k.float(), v.float(), **args, return_lse=True)
    error = float((out.float() - ref).norm() / ref.norm())
    cosine = float(torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), 0))
    assert error < 6e-2 and cosine > 0.998, (error, cosine)
    assert float((lse - ref_lse).abs().max()) < 0.2  # tests/test_fp8.py's bound for the rule's LSE
    rule, rule_lse = gna_attention(q.cpu(), k.cpu(), v.cpu(), **args, **call)
    # the kernel against its rule, as for whole tiles above (lazy rescaling moves P's rounding points); the LSE's
    # largest difference on rows with few keys (the causal 1-D case's first rows): 2.7e-2 measured (H200)
    assert float((out.cpu().float() - rule.float()).norm() / rule.float().norm()) < 4e-2
    assert float((lse.cpu() - rule_lse).abs().max()) < 3.5e-2


def test_partial_tiles_compile_with_fullgraph_and_replay_in_a_cuda_graph():
    from natsim.kernels import gna_attention

    shape, window, tile = (6, 20, 24), (3, 7, 9), (2, 4, 16)

    def attend(q, k, v):
        return gna_attention(q, k, v, window, q_tile=tile, kv_tile=tile, precision="fp8", backend="gluon")

    q, k, v = (torch.randn(1, *shape, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager = attend(q, k, v)
    torch.testing.assert_close(torch.compile(attend, fullgraph=True)(q, k, v), eager, rtol=0, atol=0)
    replayed, fresh = replayed_on_new_inputs(attend, q, k, v)
    torch.testing.assert_close(replayed, fresh, rtol=0, atol=0)
