"""natsim.planner.AutoPlan: a plan per layout, made on first use, through the operator natsim::gna_resolved
(Triton's interpreter on CPU): eager and compiled calls against float64 references, gradients, no recompiles."""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import gna_resolved, reference_attention
from natsim.planner import AutoPlan, best


def relative_error(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def qkv(shape, heads=2, head_dim=32, seed=0, requires_grad=False, batch=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, *shape, heads, head_dim, generator=gen).half().requires_grad_(requires_grad)
            for _ in range(3)]


def reference(q, k, v, plan):
    return reference_attention(q.double(), k.double(), v.double(), plan.problem.window, plan.problem.stride,
                               plan.problem.dilation, plan.problem.causal)


def test_an_auto_plan_runs_the_plan_best_makes_for_each_layout():
    auto = AutoPlan(0.5)
    for shape in [(4, 4, 4), (8, 8), (4, 4, 4)]:
        q, k, v = qkv(shape)
        out = auto(q, k, v)
        plan = auto.plans[(shape, 2, 32, torch.float16, "cpu")]
        expected = best(shape, 0.5, heads=2, head_dim=32, dtype=torch.float16)
        assert plan.kernel_arguments() == expected.kernel_arguments()
        assert relative_error(out, reference(q, k, v, plan)) < 5e-3
    assert len(auto.plans) == 2


def test_compiled_calls_resolve_the_plan_when_the_operator_runs():
    torch._dynamo.reset()
    auto = AutoPlan(0.5)
    compiled = torch.compile(lambda q, k, v: auto(q, k, v, return_lse=True), fullgraph=True, backend="aot_eager")
    shapes = [(4, 4, 4), (2, 4, 8), (4, 2, 8)]  # one token count, three layouts: three plans
    for shape in shapes:
        q, k, v = qkv(shape, seed=sum(shape))
        out, lse = compiled(q, k, v)
        plan = auto.plans[(shape, 2, 32, torch.float16, "cpu")]
        assert relative_error(out, reference(q, k, v, plan)) < 5e-3 and lse.shape == q.shape[:-1]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for shape in shapes:
            compiled(*qkv(shape))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_flow_through_the_resolved_operator(compiled):
    """One batch (two heads): the backward kernels over several batches are tests/test_backward.py's, and a plan
    does not depend on the batch."""
    auto = AutoPlan(0.5)
    q, k, v = qkv((4, 4, 4), requires_grad=True, batch=1)
    grad = torch.randn_like(q)
    plan = auto.plan_for((4, 4, 4), heads=2, head_dim=32, dtype=torch.float16, device="cpu")
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(reference(*ref, plan), ref, grad.double())
    run = torch.compile(auto, fullgraph=True, backend="aot_eager") if compiled else auto
    got = torch.autograd.grad(run(q, k, v), (q, k, v), grad)
    assert all(relative_error(g, e) < 1e-2 for g, e in zip(got, expected))


def test_calls_without_gradients_take_the_operators_twin_without_autograd():
    """A compiled AutoPlan call that needs no gradient (under torch.no_grad, or on inputs that require none) is
    natsim::gna_resolved_inference, the same body without the Python autograd layer; one that may need it is
    natsim::gna_resolved. The same for tokens kept in a tile order. Outputs against the float64 reference."""
    from natsim.kernels import TileOrder

    torch._dynamo.reset()
    auto = AutoPlan(0.5)
    shape = (4, 4, 4)
    q, k, v = qkv(shape, batch=1)
    plan = auto.plan_for(shape, heads=2, head_dim=32, dtype=torch.float16, device="cpu")
    order = TileOrder(shape, plan.tiles.q_tile, plan.problem.dilation)
    seen = []  # each compilation's operators (a change of grad mode or requires_grad compiles again)

    def recording(gm, inputs):
        seen.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm

    plain = torch.compile(auto, fullgraph=True, backend=recording)
    ordered = torch.compile(lambda *x: auto(*x, order=order), fullgraph=True, backend=recording)
    in_order = [order.to_order(t.flatten(1, 3)) for t in (q, k, v)]
    with torch.no_grad():
        out = plain(q, k, v)
        out_ordered = order.from_order(ordered(*in_order)).unflatten(1, shape)
    def resolved(graph):
        return {target for target in graph if target.startswith("natsim.gna_resolved")}

    assert [resolved(graph) for graph in seen] == [{"natsim.gna_resolved_inference.default"},
                                                   {"natsim.gna_resolved_ordered_inference.default"}]
    for result in (out, out_ordered):
        assert relative_error(result, reference(q, k, v, plan)) < 5e-3
    plain(q, k, v)  # grad mode on, inputs without gradients
    assert resolved(seen[-1]) == {"natsim.gna_resolved_inference.default"}
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    plain(*leaves).float().sum().backward()
    assert resolved(seen[-1]) == {"natsim.gna_resolved.default"} and leaves[0].grad is not None
    torch.library.opcheck(torch.ops.natsim.gna_resolved_inference.default, (q, k, v, auto._resolver, None, True),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="natsim::gna_resolved_inference has no backward, .* call "
                                           "natsim::gna_resolved, or this operator under torch.no_grad"):
        torch.ops.natsim.gna_resolved_inference.default(*leaves, auto._resolver, None, False)
    with torch.no_grad():
        torch.ops.natsim.gna_resolved_inference.default(*leaves, auto._resolver, None, False)


def test_an_unknown_resolver_is_a_sentence():
    q = torch.randn(1, 4, 4, 4, 2, 32).half()
    with pytest.raises(ValueError, match="resolver must be an id from register_resolver"):
        gna_resolved(q, q, q, 10**6, None, False)


def test_a_library_probing_the_kernels_folder_leaves_natsims_operators_in_place():
    """With the repository's root on sys.path (`python -m pytest` there), transformers imports the folder
    `kernels` as a package of its own when it looks for the Hub's `kernels`: natsim's operators must stay the ones
    natsim.kernels registered, or a compiled AutoPlan no longer finds its plans (the fake of natsim::gna_resolved
    raised "resolver must be an id from register_resolver" on the GPU). The same fresh process checks that the
    planner (natsim.distributed under it) marks its compile-time constants without importing torch._dynamo
    (`constant_of_the_graph`: an import of 1.5-2 s that scripts which only plan, and `natsim plan`, would pay)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = f"""
import importlib, sys
sys.path.insert(0, {str(root)!r})
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from natsim.kernels import gna_resolved
from natsim.planner import AutoPlan
assert "torch._dynamo" not in sys.modules, "importing the planner imported torch._dynamo"
auto = AutoPlan(0.5)
importlib.import_module("kernels")  # what transformers' is_kernels_available() does
assert not [name for name in sys.modules if name.startswith("kernels.")], "the folder's modules ran again"
with FakeTensorMode():
    q = torch.empty(1, 4, 8, 2, 32, dtype=torch.float16)
    out, lse = gna_resolved(q, q, q, auto._resolver, None, False)
assert out.shape == q.shape
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
