"""GNA as real models call it: the registered operator under torch.compile, gradients on the reference path,
autocast, the in-place (layout) and permuted data paths, and the default tiles.

On this CPU machine the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
tests that need the torch reference path turn the interpreter off for the call (`use_triton` reads it per call).
"""

from __future__ import annotations

import math
import sys

import numpy as np

import pytest
import torch

import natsim
from natsim import planner
from natsim.kernels import gna_attention, reference_attention
from natsim.kernels.gna import dispatch, launch
from natsim.kernels.gna.tiles import default_tiles, tile_pairs
from natsim.planner.cost import COEFFICIENTS_DIR, CostModel, features_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGS = dict(window=(3, 4, 2), stride=(1, 2, 2), causal=(True, False, False))
SHAPE = (4, 6, 5)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def qkv(shape=SHAPE, heads=2, head_dim=32, dtype=torch.float16, **kwargs):
    return [torch.randn(1, *shape, heads, head_dim, device=DEVICE, **kwargs).to(dtype) for _ in range(3)]


# ---------------------------------------------------------------------------------------------------------
# Gradients on the reference path (the Triton backward: tests/test_backward.py)


def test_kernel_path_runs_under_no_grad_and_inference_mode():
    q, k, v = (t.requires_grad_() for t in qkv())
    ref = reference_attention(*(t.detach().double() for t in (q, k, v)), **ARGS)
    with torch.no_grad():
        assert rel_error(gna_attention(q, k, v, **ARGS), ref) < 5e-3
    with torch.inference_mode():
        assert rel_error(gna_attention(q.detach(), k.detach(), v.detach(), **ARGS), ref) < 5e-3


def test_reference_path_gradients_equal_autograd_through_the_reference(reference_path):
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.float64))
    out, lse = gna_attention(q, k, v, **ARGS, return_lse=True)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    ref_out, ref_lse = reference_attention(q, k, v, **ARGS, return_lse=True)
    want = torch.autograd.grad((ref_out, ref_lse), (q, k, v), (grad_out, grad_lse))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_reference_path_passes_gradcheck(reference_path):
    q, k, v = (t.requires_grad_() for t in qkv((3, 4), heads=1, head_dim=4, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda q, k, v: gna_attention(q, k, v, (2, 3), (1, 2)), (q, k, v))


# ---------------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): no graph break, same output as eager


def _model(q, k, v):
    out = gna_attention(q * 2.0, k, v, **ARGS)
    return out, out.float().sum(-1) + 1.0


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_compiled_fullgraph_equals_eager_without_graph_breaks(path, request):
    if path == "reference":
        request.getfixturevalue("reference_path")
    torch._dynamo.reset()
    q, k, v = qkv()
    explanation = torch._dynamo.explain(_model)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(_model, fullgraph=True)
    (out, total), (eager_out, eager_total) = compiled(q, k, v), _model(q, k, v)
    assert torch.equal(out, eager_out)  # the same kernel on the same inputs
    torch.testing.assert_close(total, eager_total)  # Inductor may sum in another order


def test_compiled_plan_equals_eager():
    torch._dynamo.reset()
    plan = planner.best((8, 16), 0.6, head_dim=32, dtype=torch.float16, device="cpu")
    q, k, v = qkv((8, 16))
    compiled = torch.compile(lambda q, k, v: plan(q, k, v), fullgraph=True, backend="aot_eager")  # Inductor: above
    torch.testing.assert_close(compiled(q, k, v), plan(q, k, v), rtol=0, atol=0)


def test_compiled_calls_whose_ints_change_between_calls_specialise_on_each_value(reference_path):
    """A compiled function given the window, stride, blocks or a plan as arguments: Dynamo makes an int that
    changed between calls symbolic when it recompiles, and natsim's geometry cannot be symbolic. Each value gets a
    graph of its own (guarded on it), and each output is the eager call's, bit for bit (the reference path)."""
    from natsim.kernels import sparse_attention

    torch._dynamo.reset()
    q, k, v = qkv(dtype=torch.float32)
    gna = torch.compile(lambda q, k, v, window, stride, dilation: gna_attention(q, k, v, window, stride, dilation),
                        fullgraph=True, backend="eager")
    for window, stride, dilation in (((3, 4, 2), 1, 1), ((2, 5, 3), (2, 2, 3), (2, 1, 1))):
        eager = gna_attention(q, k, v, window, stride, dilation)
        assert torch.equal(gna(q, k, v, window, stride, dilation), eager), (window, stride, dilation)
    flat = q.flatten(1, 3)
    sparse = torch.compile(lambda q, mask, q_block, kv_block: sparse_attention(q, q, q, mask, q_block, kv_block),
                           fullgraph=True, backend="eager")
    for q_block, kv_block in ((16, 16), (32, 8)):
        mask = torch.rand(1, 2, -(-flat.shape[1] // q_block), -(-flat.shape[1] // kv_block),
                          generator=torch.Generator().manual_seed(q_block + kv_block)) < 0.6
        eager = sparse_attention(flat, flat, flat, mask, q_block, kv_block)
        assert torch.equal(sparse(flat, mask, q_block, kv_block), eager), (q_block, kv_block)
    run = torch.compile(lambda plan, q: plan(q, q, q), fullgraph=True, backend="eager")
    for sparsity in (0.5, 0.8):
        plan = planner.best(SHAPE, sparsity, heads=2, head_dim=32, device="cpu")
        assert torch.equal(run(plan, q), plan(q, q, q)), sparsity


def test_the_cpu_path_refuses_what_the_kernels_refuse_and_runs_empty_batches(reference_path):
    """The torch reference (CPU tensors) runs any tiles (the backends' table) but refuses malformed ones as every
    backend does, refuses a head_dim of 0 with a sentence, and returns empty outputs for an empty batch or no
    heads, as the kernels do."""
    q, k, v = qkv(dtype=torch.float32)
    assert torch.equal(gna_attention(q, k, v, **ARGS, q_tile=(3, 3, 3)), gna_attention(q, k, v, **ARGS))
    for tile, message in (((4, 4), "one size per dimension"), ((0, 4, 4), "must be at least 1")):
        with pytest.raises(ValueError, match=message):
            gna_attention(q, k, v, **ARGS, q_tile=tile)
    with pytest.raises(ValueError, match="need a head_dim of at least 1"):
        gna_attention(*(t[..., :0] for t in (q, k, v)), **ARGS)
    for empty in (q[:0], q[..., :0, :]):
        out, lse = gna_attention(empty, empty, empty, **ARGS, return_lse=True)
        assert out.shape == empty.shape and lse.shape == empty.shape[:-1]


def test_compiled_call_reports_bad_arguments_as_sentences():
    torch._dynamo.reset()
    q, k, v = qkv()
    compiled = torch.compile(lambda q, k, v: gna_attention(q, k, v, window=(3, 4, 2), stride=(4, 1, 1)),
                             fullgraph=True)
    with pytest.raises(Exception, match="stride cannot be larger than window"):
        compiled(q, k, v)


def test_autocast_casts_float32_inputs_to_the_region_dtype():
    q, k, v = qkv(dtype=torch.float32)
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = gna_attention(q, k, v, **ARGS)
    assert out.dtype == torch.float16
    assert rel_error(out, reference_attention(q.double(), k.double(), v.double(), **ARGS)) < 5e-3


# ---------------------------------------------------------------------------------------------------------
# Data paths and repeated calls


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values starting 2 bytes past a 16-byte boundary (forces the permuted path)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


@pytest.mark.parametrize("shape, window, stride, tile", [
    ((3, 6, 5), (3, 4, 2), (1, 2, 2), (2, 4, 2)),   # padding in every dimension (5x6x7 took twice as long)
    ((6, 9), (4, 5), (2, 1), (4, 4)),  # padding in both dimensions (9x11: 9 Q tiles, not 6)
    ((40,), 8, 1, 16),
])
def test_layout_and_permuted_paths_compute_the_same_output(shape, window, stride, tile):
    q, k, v = qkv(shape)
    layout = gna_attention(q, k, v, window, stride, q_tile=tile, kv_tile=tile)
    permuted = gna_attention(*(_misaligned(t) for t in (q, k, v)), window, stride, q_tile=tile, kv_tile=tile)
    torch.testing.assert_close(layout, permuted, rtol=0, atol=2e-3)
    ref = reference_attention(q.double(), k.double(), v.double(), window, stride)
    assert rel_error(layout, ref) < 5e-3


def test_non_contiguous_inputs_read_in_place_match_the_reference():
    """q, k, v as slices of one fused qkv projection: strided heads, read where they are."""
    qkv_fused = torch.randn(1, *SHAPE, 3, 2, 32, device=DEVICE).half()
    q, k, v = qkv_fused.unbind(dim=-3)
    out = gna_attention(q, k, v, **ARGS)
    ref = reference_attention(q.double(), k.double(), v.double(), **ARGS)
    assert rel_error(out, ref) < 5e-3


def test_inputs_expanded_along_a_token_dimension_take_the_permuted_path():
    """A stride-0 token dimension (one frame's keys repeated over time) cannot be read through a descriptor."""
    q, _, _ = qkv()
    k, v = (torch.randn(1, 1, *SHAPE[1:], 2, 32, device=DEVICE).half().expand(1, *SHAPE, 2, 32) for _ in range(2))
    problem = natsim.Problem(SHAPE, ARGS["window"], ARGS["stride"], causal=ARGS["causal"])
    assert not launch.takes_layout_path(problem, q, k, v)
    out = gna_attention(q, k, v, **ARGS)
    assert rel_error(out, reference_attention(q.double(), k.double(), v.double(), **ARGS)) < 5e-3


def test_repeated_calls_use_the_new_tensors_and_one_cached_call():
    dispatch._calls.clear()
    first = qkv()
    second = qkv()
    out_first = gna_attention(*first, **ARGS)
    out_second = gna_attention(*second, **ARGS)
    assert len(dispatch._calls) == 1
    for out, inputs in ((out_first, first), (out_second, second)):
        assert rel_error(out, reference_attention(*(t.double() for t in inputs), **ARGS)) < 5e-3


def test_dense_attention_with_default_tiles_runs_over_the_flattened_sequence():
    shape = (3, 5, 7)  # 105 tokens: one padded 128-token tile instead of padding in every dimension
    q, k, v = qkv(shape)
    out, lse = gna_attention(q, k, v, shape, return_lse=True)
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), shape, return_lse=True)
    assert rel_error(out, ref) < 5e-3 and torch.allclose(lse.double(), ref_lse, atol=1e-2)
    assert launch.dense_as_1d(natsim.Problem(shape, shape)) == natsim.Problem((105,), (105,))
    assert launch.dense_as_1d(natsim.Problem(shape, shape, causal=(True, False, False))) is None


# ---------------------------------------------------------------------------------------------------------
# Default tiles: as good as the planner's choice for the same window and stride


H100 = CostModel.load(COEFFICIENTS_DIR / "nvidia-h100-80gb-hbm3.json")


@pytest.mark.parametrize("shape, window, stride", [
    ((30, 48, 80), (18, 24, 24), (16, 8, 8)),
    ((30, 48, 80), (18, 24, 24), (1, 1, 1)),
    ((21, 45, 80), (9, 21, 40), (3, 7, 8)),
    ((16, 44, 80), (16, 24, 16), (1, 8, 16)),
    ((13, 60, 90), (7, 20, 30), (1, 4, 6)),
    ((256, 256), (80, 80), (16, 16)),
    ((90, 160), (32, 48), (1, 1)),
    ((32768,), (2048,), (256,)),
])
def test_default_tiles_are_within_5_percent_of_the_planners_best(shape, window, stride):
    """Predicted by the shipped H100 cost model: the default against every catalog tile for this problem."""
    problem = natsim.Problem(shape, window, stride)

    def predicted(q_tile, kv_tile):
        result = natsim.simulate(problem, natsim.TileConfig(q_tile, kv_tile))
        return float(H100.predict(features_of(result, batch_heads=24, head_dim=128, element_bytes=2,
                                              permutation=False)))

    best = min(predicted(q, kv) for q, kv in tile_pairs(shape, 128))
    assert predicted(*default_tiles(problem, 128)) <= 1.05 * best


def test_default_tiles_fall_back_on_layouts_smaller_than_any_catalog_tile():
    assert not tile_pairs((10,), 128)
    assert default_tiles(natsim.Problem((10,), 3), 128) == ((128,), (128,))
    q, k, v = qkv((10,))
    ref = reference_attention(q.double(), k.double(), v.double(), 3)
    assert rel_error(gna_attention(q, k, v, 3), ref) < 5e-3


def test_catalog_and_kernel_defaults_share_one_tile_list():
    shape = (21, 45, 80)
    pairs = {(t.q_tile, t.kv_tile) for t in planner.tile_catalog(shape, 128)}
    assert pairs == set(tile_pairs(shape, 128))
    assert default_tiles(natsim.Problem(shape, (9, 21, 40), (3, 7, 8)), 128) in pairs
    assert math.prod(default_tiles(natsim.Problem(shape, (9, 21, 40)), 128)[0]) in (64, 128)
    assert np.isfinite(H100.vector).all()


# ---------------------------------------------------------------------------------------------------------
# Entry points that launch Triton directly refuse what they would get silently wrong


def test_direct_entry_points_refuse_inputs_that_require_grad():
    from natsim.kernels import gna_attention_permuted, permute, unpermute

    q, k, v = qkv((8, 16))
    problem, tile = natsim.Problem((8, 16), (3, 5)), (4, 8)
    qp, kp, vp = (permute(t, tile) for t in (q, k, v))
    with pytest.raises(RuntimeError, match="gna_attention_permuted launches a Triton kernel with no backward"):
        gna_attention_permuted(qp.requires_grad_(), kp, vp, problem, tile, tile)
    with pytest.raises(RuntimeError, match="permute launches a Triton kernel with no backward"):
        permute(q.clone().requires_grad_(), tile)
    with pytest.raises(RuntimeError, match="unpermute launches a Triton kernel with no backward"):
        unpermute(kp.clone().requires_grad_(), (8, 16), tile)
    with torch.no_grad():
        assert torch.equal(unpermute(permute(q.requires_grad_(), tile), (8, 16), tile), q)


def test_constant_of_the_graph_marks_a_function_as_torch_compiler_does(monkeypatch):
    """Where torch._dynamo is not imported yet, `constant_of_the_graph` sets the mark itself: it must be the one
    torch.compiler.assume_constant_result sets (a torch that marks otherwise fails here)."""
    from natsim.kernels import constant_of_the_graph

    def ours():
        return 1

    def torchs():
        return 1

    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    assert constant_of_the_graph(ours) is ours and "torch._dynamo" not in sys.modules
    monkeypatch.undo()
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) != {}


def test_direct_entry_points_refuse_torch_compile():
    from natsim.kernels import gna_attention_permuted, permute

    torch._dynamo.reset()
    q, k, v = qkv((8, 16))
    problem, tile = natsim.Problem((8, 16), (3, 5)), (4, 8)
    qp, kp, vp = (permute(t, tile) for t in (q, k, v))
    compiled = torch.compile(lambda q, k, v: gna_attention_permuted(q, k, v, problem, tile, tile), fullgraph=True)
    with pytest.raises(Exception, match="not a registered operator"):
        compiled(qp, kp, vp)


def test_fake_outputs_have_the_real_outputs_strides_for_transposed_inputs():
    """Compiled graphs check that each operator's output strides are those its fake implementation said: a
    transposed (non-contiguous) q must not give the fake a copy of its strides."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, 32, generator=gen).half().permute(0, 2, 3, 1, 4) for _ in range(3))
    assert not q.is_contiguous()
    torch.library.opcheck(torch.ops.natsim.gna_forward.default,
                          (q, k, v, [3, 3], [1, 1], [1, 1], [False, False], None, None, None, True),
                          test_utils="test_faketensor")


@pytest.mark.parametrize("interpret", [False, True])
def test_a_loss_on_natsims_gradients_is_refused_with_a_sentence(request, monkeypatch, interpret):
    """create_graph=True through GNA, a block mask or a plan (a gradient penalty) would need a second derivative
    the backward does not have: refused with natsim's sentence on the CPU path and in the interpreter alike (the
    CPU path's recomputed gradients had silently come back without a graph)."""
    from natsim.kernels import sparse_attention

    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        request.getfixturevalue("reference_path")
    dtype = torch.float16 if interpret else torch.float64
    q, k, v = (torch.randn(1, 64, 2, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    plan = planner.best((4, 4, 4), 0.5, window=(3, 3, 3), head_dim=16, dtype=torch.float16, training=True)
    cube = [t.detach().half().reshape(1, 4, 4, 4, 2, 16).requires_grad_() for t in (q, k, v)]  # a plan's dtype
    calls = [((q, k, v), lambda *x: gna_attention(*x, 5)), ((q, k, v), lambda *x: sparse_attention(*x, mask, 16, 16)),
             (cube, lambda *x: plan(*x))]
    for inputs, call in calls:
        out = call(*inputs)
        with pytest.raises(RuntimeError, match="natsim's attention has no second derivative"):
            torch.autograd.grad(out.float().square().sum(), inputs[0], create_graph=True)
        grad, = torch.autograd.grad(call(*inputs).float().square().sum(), inputs[0])  # first order: as ever
        assert torch.isfinite(grad).all()
