"""Training through content-adaptive masks: `natsim::attention_resolved`'s backward against the autograd of the
attention its registered callable decided on, and the gradients of a routed tiny model (eager, and with its blocks
compiled) against a float64 run of the same model whose attention applies the same masks as brute-force element
masks, built from the block mask each call decided (so independent of the kernels). Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import attention_resolved, register_attention
from natsim.kernels.common import handles, resolved

pytest.importorskip("diffusers")

import diffusers_models  # noqa: E402
from natsim.integrations import diffusers as nd  # noqa: E402
from natsim.integrations.diffusers import attention as attention_module  # noqa: E402
from natsim.integrations.diffusers import masks as masks_module  # noqa: E402

LAYOUT = (2, 4, 8)  # 64 video tokens: four 16-token mask blocks
# Two training passes: the first a dense warm-up step, the second a sparse step (at any predicted speedup) whose
# masks keep two of the four key blocks of each query block.
MASKS = nd.Masks(steps=2, block=16, sub_block=8, dense_fraction=0.5, initial_budget=0.5, min_budget=0.5,
                 merges=("none",), min_speedup=0.0)


def gradient_errors(grads: list, expected: list) -> list[float]:
    """Each gradient's error relative to its reference's norm, or to a millionth of the largest reference norm
    for a gradient that is zero up to rounding (a parameter the loss does not reach)."""
    floor = 1e-6 * max(float(b.norm()) for b in expected)
    return [float((a.double() - b).norm()) / max(float(b.norm()), floor) for a, b in zip(grads, expected)]


def masked_attention(q, k, v, allowed: torch.Tensor, scale: float):
    """Attention of `[B, N, heads, D]` under the element mask `allowed` `[B|1, heads|1, N, N]`: output and LSE."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(1, 2)


# -- the operator alone -------------------------------------------------------------------------------------------


def test_the_operators_backward_is_the_autograd_of_the_decided_attention():
    """The registered callable decides a random element mask on each call; the operator's gradients (the
    output's and the LSE's) must be those of that very decision, never of a new one."""
    decisions = []

    def attention(q, k, v, scale, return_lse):
        allowed = torch.rand(q.shape[0], q.shape[2], q.shape[1], k.shape[1]) < 0.6
        allowed |= torch.eye(q.shape[1], dtype=torch.bool)  # no query without a key

        def decided(q, k, v):
            out, lse = masked_attention(q, k, v, allowed, scale)
            return out, (lse if return_lse else None)

        decisions.append(decided)
        return (*decided(q, k, v), decided)

    key = register_attention(attention)
    q, k, v = (torch.randn(2, 12, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out, grad_lse = torch.randn(2, 12, 2, 8, dtype=torch.float64), torch.randn(2, 12, 2, dtype=torch.float64)

    def gradients(run):
        out, lse = run(q, k, v)[:2]
        return torch.autograd.grad([out, lse], [q, k, v], [grad_out, grad_lse])

    compiled = torch.compile(lambda q, k, v: attention_resolved(q, k, v, key, 0.3, True), fullgraph=True,
                             backend="aot_eager")
    for run in (lambda q, k, v: attention_resolved(q, k, v, key, 0.3, True), compiled):
        torch._dynamo.reset()
        got = gradients(run)
        expected = gradients(decisions[-1])
        for a, b in zip(got, expected):
            assert torch.allclose(a, b)
    def kept() -> list:
        return [value for value in handles._held.values() if any(value is decided for decided in decisions)]

    assert not kept()  # every decision freed with its graph
    with torch.no_grad():
        attention_resolved(q, k, v, key, 0.3, False)
    assert not kept()  # and at once without one


def test_resolved_attention_takes_the_twin_without_autograd_where_no_gradient_is_needed():
    """`resolved_attention` compiled: natsim::attention_resolved_inference under torch.no_grad (its output that of
    the decided attention, no decision kept), natsim::attention_resolved where the inputs require grad."""
    from natsim.kernels import resolved_attention

    decisions, seen = [], []

    def attention(q, k, v, scale, return_lse):
        allowed = torch.rand(q.shape[0], q.shape[2], q.shape[1], k.shape[1]) < 0.6
        allowed |= torch.eye(q.shape[1], dtype=torch.bool)

        def decided(q, k, v):
            out, lse = masked_attention(q, k, v, allowed, scale)
            return out, (lse if return_lse else None)

        decisions.append(decided)
        return (*decided(q, k, v), decided)

    def recording(gm, inputs):
        seen.append({str(node.target) for node in gm.graph.nodes if str(node.target).startswith("natsim.")})
        return gm

    key = register_attention(attention)
    torch._dynamo.reset()
    run = torch.compile(lambda q, k, v: resolved_attention(q, k, v, key, 0.3, True), fullgraph=True,
                        backend=recording)
    q, k, v = (torch.randn(2, 12, 2, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        out, lse = run(q, k, v)
    assert seen[-1] == {"natsim.attention_resolved_inference.default"}
    expected = decisions[-1](q, k, v)
    assert torch.allclose(out, expected[0]) and torch.allclose(lse, expected[1])
    assert not [value for value in handles._held.values() if value is decisions[-1]]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    run(*leaves)[0].sum().backward()
    assert seen[-1] == {"natsim.attention_resolved.default"} and leaves[0].grad is not None
    with pytest.raises(RuntimeError, match="natsim::attention_resolved_inference has no backward, .* call "
                                           "natsim::attention_resolved"):
        torch.ops.natsim.attention_resolved_inference.default(*leaves, key, 0.3, True)


# -- a routed model against a float64 run under the same masks ------------------------------------------------


def recorded(masked: masks_module.MaskedAttention) -> list:
    """The attention each call of `masked` decides on, in call order (its registered callable wrapped)."""
    decisions = []

    def recording(q, k, v, scale, return_lse):
        out, lse, decided = masked(q, k, v, scale, return_lse)
        decisions.append(decided)
        return out, lse, decided

    resolved._attentions[masked.id] = recording
    return decisions


def element_mask(decided, tokens: int) -> torch.Tensor:
    """The element mask of a decision in row-major token order: every pair for a dense call; for a sparse call
    its plan's (pooled) block mask expanded to tokens in its order, then the order undone."""
    if isinstance(decided, masks_module._Dense):
        return torch.ones(1, 1, tokens, tokens, dtype=torch.bool)
    plan = decided.plan
    rows = torch.arange(tokens) // plan.q_block
    cols = torch.arange(tokens) // plan.kv_block
    in_order = plan.mask.cpu()[:, :, rows][:, :, :, cols]
    inverse = decided.inverse.cpu()
    return in_order[:, :, inverse][:, :, :, inverse]


def replaying(decisions: list, tokens: int):
    """`resolved_attention` for the float64 run: the routed run's decisions, call by call, as element masks."""
    calls = iter(decisions)

    def attend(q, k, v, attention, scale, return_lse):
        allowed = element_mask(next(calls), tokens)
        return masked_attention(q, k, v, allowed, q.shape[-1] ** -0.5 if scale is None else scale)

    return attend


def training_pass(model, inputs: dict, weight: torch.Tensor):
    """One forward and backward pass: the gradients of the parameters and of the latent."""
    inputs = {name: (t.requires_grad_() if name == "hidden_states" else t) for name, t in inputs.items()}
    out = model(**inputs)[0]
    (out * weight.to(out.dtype)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads + [inputs["hidden_states"].grad]


def cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {name: (t.detach().to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for name, t in inputs.items()}


@pytest.mark.parametrize("name, compiled", [("WanTransformer3DModel", True), ("HunyuanVideoTransformer3DModel", False)],
                         ids=["wan-compiled-blocks", "hunyuan-joint-eager"])
def test_gradients_through_masks_equal_a_float64_run_under_the_same_masks(name, compiled, monkeypatch):
    """A dense warm-up pass, then a sparse pass: the routed model's gradients (fp16 kernels) against float64
    attention under the element masks the routed calls decided (HunyuanVideo: joint attention merged by LSE)."""
    torch._dynamo.reset()
    tokens = LAYOUT[0] * LAYOUT[1] * LAYOUT[2]
    best_mask = masks_module.best_mask  # the plans at the predictor's blocks: pooled coarser, 64 tokens are one
    monkeypatch.setattr(masks_module, "best_mask", lambda *a, **o: best_mask(*a, q_blocks=(16,), kv_blocks=(16,), **o))
    model = diffusers_models.build(name, layers=1).float()
    applied = nd.apply(model, masks=MASKS, training=True, dtype=torch.float16)
    decisions = recorded(applied.masked)
    if compiled:
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    reference = diffusers_models.build(name, layers=1).double()
    nd.apply(reference, masks=MASKS, training=True)
    for sparse in (False, True):
        inputs = diffusers_models.inputs(name, LAYOUT, seed=2 + sparse)
        weight = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(0))
        decisions.clear()
        grads = training_pass(model, cast(inputs, torch.float32), weight)
        assert all(isinstance(d, masks_module._Sparse if sparse else masks_module._Dense) for d in decisions)
        if sparse:
            assert any(not bool(d.plan.mask.all()) for d in decisions)  # a mask that skips blocks
        with monkeypatch.context() as patch:
            patch.setattr(attention_module, "resolved_attention", replaying(list(decisions), tokens))
            expected = training_pass(reference, cast(inputs, torch.float64), weight)
        assert len(grads) == len(expected) > 1
        assert max(gradient_errors(grads, expected)) < 2e-2
