"""Whole-model tile order (integrations/diffusers/order.py) on tiny random models: a model kept in its plan's tile
order from its first block to its last computes what it computes on row-major tokens, eager, compiled (regional
and whole) and in its gradients; `tile_order` picks the order where it runs on FlashAttention-4, and is refused
with sentences where it cannot be kept."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

import diffusers_models  # noqa: E402
from natsim.integrations import diffusers as nd  # noqa: E402

ORDERED = ("WanTransformer3DModel", "HunyuanVideoTransformer3DModel", "CogVideoXTransformer3DModel",
           "LTXVideoTransformer3DModel")
# every test attends through the torch reference (the reference_path fixture): the order's hooks and operator are
# what is tested here, Triton's interpreter runs the kernels in tests/test_diffusers.py
pytestmark = pytest.mark.usefixtures("reference_path")
LAYOUT = (2, 8, 16)
WINDOW = (2, 5, 5)  # a sparse window whose plan's tile (2, 8, 4) moves tokens: an order error changes the output


def with_rotary(name: str, inputs: dict) -> dict:
    """CogVideoX's rotary tables come from its pipeline: random ones here (cos, sin: `[tokens, head_dim]`)."""
    if name == "CogVideoXTransformer3DModel":
        g = torch.Generator().manual_seed(2)
        inputs["image_rotary_emb"] = tuple(torch.randn(math.prod(LAYOUT), 32, generator=g) for _ in range(2))
    return inputs


def run(name: str, tile_order, compile_mode=None, inputs=None, **options):
    model = diffusers_models.build(name).float()
    applied = nd.apply(model, window=WINDOW, tile_order=tile_order, dtype=torch.bfloat16, **options)
    inputs = inputs or with_rotary(name, diffusers_models.inputs(name, LAYOUT, batch=2))
    call = model
    if compile_mode == "blocks":
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    elif compile_mode == "whole":
        with torch.no_grad():
            model(**inputs)  # the layout's decision, made outside the graph
        call = torch.compile(model, fullgraph=True, backend="eager")  # AOTAutograd: the "blocks" case
    with torch.no_grad():
        out = call(**inputs)[0]
    return out, applied


@pytest.mark.parametrize("name", ORDERED)
def test_a_model_kept_in_tile_order_computes_what_it_computes_in_row_major_order(name):
    row_major, _ = run(name, False)
    ordered, applied = run(name, True)
    order = next(iter(applied.order.decided.values()))
    tokens = torch.arange(math.prod(LAYOUT))[None]
    assert order is not None and order.shape == LAYOUT and not torch.equal(order.to_order(tokens), tokens)
    assert torch.allclose(ordered, row_major, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, compile_mode", [("WanTransformer3DModel", "whole"),
                                                ("HunyuanVideoTransformer3DModel", "blocks")])
def test_the_tile_order_compiles_without_graph_breaks(name, compile_mode):
    torch._dynamo.reset()
    row_major, _ = run(name, False)
    ordered, applied = run(name, True, compile_mode)
    assert next(iter(applied.order.decided.values())) is not None
    assert torch.allclose(ordered, row_major, rtol=1e-4, atol=1e-4)


def test_training_in_tile_order_gives_the_row_major_gradients():
    name = "WanTransformer3DModel"
    inputs = diffusers_models.inputs(name, LAYOUT)
    grads = []
    for tile_order in (False, True):
        model = diffusers_models.build(name).float()
        nd.apply(model, window=WINDOW, tile_order=tile_order, dtype=torch.bfloat16, training=True)
        model(**inputs)[0].square().mean().backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)


def test_by_default_the_order_is_kept_only_where_the_plan_runs_on_flashattention4():
    _, applied = run("WanTransformer3DModel", None)  # the CPU: the torch reference, no FlashAttention-4
    assert list(applied.order.decided.values()) == [None]


def test_remove_takes_the_order_away():
    name = "WanTransformer3DModel"
    inputs = diffusers_models.inputs(name, LAYOUT)
    model = diffusers_models.build(name).float()
    with torch.no_grad():
        own = model(**inputs)[0]
    nd.apply(model, window=WINDOW, tile_order=True)
    with torch.no_grad():
        model(**inputs)
    nd.remove(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], own)


def test_what_cannot_keep_a_tile_order_is_refused_with_sentences():
    flux = diffusers_models.build("FluxTransformer2DModel")
    with pytest.raises(ValueError, match="tile_order=True cannot keep this model in tile order: natsim knows where "
                                         "the video tokens enter and leave the blocks of WanTransformer3DModel"):
        nd.apply(flux, 0.5, tile_order=True)
    wan = diffusers_models.build("WanTransformer3DModel")
    with pytest.raises(ValueError, match="content-adaptive masks attend in token orders of their own"):
        nd.apply(wan, masks=nd.Masks(steps=4), tile_order=True)
    with pytest.raises(ValueError, match="tile_order must be None"):
        nd.apply(wan, 0.5, tile_order="yes")
    nd.apply(flux, 0.5)  # the default keeps it row-major, unasked
