"""Every diffusers class natsim routes, on tiny random models (GNA through the torch reference): with a window
over the whole layout each equals the model's own attention; with a sparse window each equals the model run
with its attention replaced by a brute-force masked softmax (tests/bruteforce.py's GNA mask over the latent's
tokens, the documented rule for the others); refusals; and the route for classes natsim does not know (register
a ModelSpec). tests/test_diffusers.py runs the first five classes through Triton's interpreter, compiled, and
with content-adaptive masks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from bruteforce import attention_mask

pytest.importorskip("diffusers")

import diffusers_models  # noqa: E402
from natsim.integrations import diffusers as nd  # noqa: E402


@dataclass(frozen=True)
class Case:
    """What docs/diffusers.md says of a class, written here apart from natsim's table: its layout in these
    tests, where text sits in its joint attention ("before", "after", or None for self-attention only), the
    attention modules natsim routes (path, and the layout dims they attend over, None for all), and a reference
    image's layout appended to the image tokens (edits), or for LTX-2 a keyframe's, appended to the video tokens."""

    name: str
    layout: tuple[int, ...]
    text: Optional[str]
    routed: tuple[tuple[str, Optional[tuple[int, ...]]], ...]
    reference: Optional[tuple[int, int]] = None

    @property
    def id(self) -> str:
        suffix = "" if not self.reference else "-keyframe" if self.name.startswith("LTX2") else "-edit"
        return self.name.replace("Transformer3DModel", "").replace("Transformer2DModel", "") + suffix


VIDEO, IMAGE = (2, 4, 8), (8, 8)
CASES = [
    Case("WanTransformer3DModel", VIDEO, None, (("blocks.attn1", None),)),
    Case("HunyuanVideoTransformer3DModel", VIDEO, "after",
         (("transformer_blocks.attn", None), ("single_transformer_blocks.attn", None))),
    Case("CogVideoXTransformer3DModel", VIDEO, "before", (("transformer_blocks.attn1", None),)),
    Case("LTXVideoTransformer3DModel", VIDEO, None, (("transformer_blocks.attn1", None),)),
    Case("ChronoEditTransformer3DModel", VIDEO, None, (("blocks.attn1", None),)),
    Case("SkyReelsV2Transformer3DModel", VIDEO, None, (("blocks.attn1", None),)),
    Case("WanVACETransformer3DModel", VIDEO, None, (("blocks.attn1", None), ("vace_blocks.attn1", None))),
    Case("WanAnimateTransformer3DModel", VIDEO, None, (("blocks.attn1", None),)),
    Case("HunyuanVideo15Transformer3DModel", VIDEO, "after", (("transformer_blocks.attn", None),)),
    Case("LTX2VideoTransformer3DModel", VIDEO, None, (("transformer_blocks.attn1", None),)),
    Case("LTX2VideoTransformer3DModel", VIDEO, "after", (("transformer_blocks.attn1", None),), reference=(4, 8)),
    Case("MochiTransformer3DModel", VIDEO, "after", (("transformer_blocks.attn1", None),)),
    Case("AllegroTransformer3DModel", VIDEO, None, (("transformer_blocks.attn1", None),)),
    Case("CosmosTransformer3DModel", VIDEO, None, (("transformer_blocks.attn1", None),)),
    Case("MotifVideoTransformer3DModel", VIDEO, "after",
         (("transformer_blocks.attn", None), ("single_transformer_blocks.attn", None))),
    Case("LatteTransformer3DModel", (40, 8, 8), None,
         (("transformer_blocks.attn1", (1, 2)), ("temporal_transformer_blocks.attn1", (0,)))),
    Case("Flux2Transformer2DModel", IMAGE, "before",
         (("transformer_blocks.attn", None), ("single_transformer_blocks.attn", None))),
    Case("Flux2Transformer2DModel", IMAGE, "before",
         (("transformer_blocks.attn", None), ("single_transformer_blocks.attn", None)), reference=(4, 4)),
    Case("FluxTransformer2DModel", IMAGE, "before",
         (("transformer_blocks.attn", None), ("single_transformer_blocks.attn", None))),
    Case("FluxTransformer2DModel", IMAGE, "before",
         (("transformer_blocks.attn", None), ("single_transformer_blocks.attn", None)), reference=(4, 4)),
    Case("QwenImageTransformer2DModel", IMAGE, "before", (("transformer_blocks.attn", None),)),
    Case("QwenImageTransformer2DModel", IMAGE, "before", (("transformer_blocks.attn", None),), reference=(4, 4)),
    Case("SD3Transformer2DModel", IMAGE, "after",
         (("transformer_blocks.attn", None), ("transformer_blocks.attn2", None))),
    Case("PixArtTransformer2DModel", IMAGE, None, (("transformer_blocks.attn1", None),)),
    Case("CogView4Transformer2DModel", IMAGE, "before", (("transformer_blocks.attn1", None),)),
]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def modules(model, path: str) -> list:
    blocks, attribute = path.split(".")
    return [getattr(block, attribute) for block in getattr(model, blocks) if getattr(block, attribute) is not None]


def sparse_window(layout: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(max(1, n // 2) for n in layout)


def brute_force_run(model, case: Case, plans: dict, inputs: dict, monkeypatch) -> torch.Tensor:
    """The model's output with every attention call of its routed modules replaced by a float64 softmax under the
    documented mask: a latent query attends the keys in its GNA window (`plans`' window, stride, dilation) and
    every other key, any other query every key; the model's own mask on top, as it gives it."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    active: list = []

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not active or query.shape[2] != key.shape[2]:
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        layout = active[-1]
        plan = next(plan for key_, plan in plans.items() if key_[0] == layout)
        tokens, video = query.shape[2], math.prod(layout)
        trailing = math.prod(case.reference) if case.reference else 0
        start = tokens - video - trailing if case.text == "before" else 0
        allowed = torch.ones(tokens, tokens, dtype=torch.bool)
        allowed[start:start + video, start:start + video] = torch.from_numpy(attention_mask(plan.problem))
        scores = torch.einsum("bhqd,bhkd->bhqk", query.double(), key.double()) * (scale or query.shape[-1] ** -0.5)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else (
                scores + attn_mask.double())
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num()  # rows with every key masked: zeros, as SDPA gives
        return torch.einsum("bhqk,bhkd->bhqd", probs, value.double()).to(query.dtype)

    def leave(*_):
        active.pop()

    handles = []
    for path, axes in case.routed:
        layout = case.layout if axes is None else tuple(case.layout[axis] for axis in axes)
        for module in modules(model, path):
            handles.append(module.register_forward_pre_hook(lambda *_, layout=layout: active.append(layout)))
            handles.append(module.register_forward_hook(leave))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention)
    try:
        with torch.no_grad():
            return model(**inputs)[0]
    finally:
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_each_class_matches_its_own_attention_and_a_brute_force_reference(case, reference_path, monkeypatch):
    model = diffusers_models.build(case.name, layers=1, frames=case.layout[0])
    inputs = diffusers_models.inputs(case.name, case.layout, batch=2, reference=case.reference)
    with torch.no_grad():
        own = model(**inputs)[0]
    expected = {module for path, _ in case.routed for module in modules(model, path)}

    applied = nd.apply(model, window=case.layout, dtype=torch.float16)  # a window over the whole layout
    assert set(applied.originals) == expected
    with torch.no_grad():
        assert relative_error(model(**inputs)[0], own) < 2e-4
    nd.remove(model)

    applied = nd.apply(model, window=sparse_window(case.layout), dtype=torch.float16)
    with torch.no_grad():
        routed = model(**inputs)[0]
    nd.remove(model)
    views = {case.layout if axes is None else tuple(case.layout[axis] for axis in axes) for _, axes in case.routed}
    assert {key[0] for key in applied.plans} == views
    reference = brute_force_run(model, case, applied.plans, inputs, monkeypatch)
    assert relative_error(routed, reference) < 2e-4
    assert relative_error(routed, own) > 2e-3  # the window is smaller than the layout: attention changed


@pytest.mark.parametrize("text_first", [True, False])
def test_the_router_attends_tokens_on_both_sides_of_the_layout_under_a_pairwise_mask(text_first, reference_path):
    """Text before the latent and reference tokens after it (or every other token after it), under a
    `keep[q] & keep[k]` mask with padding (HunyuanVideo 1.5's): against a float64 brute-force mask."""
    from natsim.integrations.diffusers.attention import Router
    from natsim.planner import AutoPlan

    layout, window, before, after = (4, 4, 4), (2, 3, 2), 3, 5
    if not text_first:
        before, after = 0, before + after
    router = Router(AutoPlan(0.0, window=window), text_first)
    router.set_layout(layout, trailing=after if text_first else 0, joint=before if text_first else after)
    video = math.prod(layout)
    tokens = before + video + after
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, tokens, 2, 32, generator=gen).half() for _ in range(3))
    keep = torch.ones(2, tokens, dtype=torch.bool)
    keep[1, [0 if text_first else tokens - 2, tokens - 1]] = False  # the second sample's padding, outside the layout
    mask = (keep[:, None, :, None] & keep[:, None, None, :])
    allowed = mask[:, 0].clone()
    gna = torch.from_numpy(attention_mask(router.auto.plan_for(layout, heads=2, head_dim=32, dtype=torch.float16,
                                                                   device="cpu").problem))
    allowed[:, before:before + video, before:before + video] &= gna
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 32**-0.5
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1).nan_to_num()
    reference = torch.einsum("bhqk,bkhd->bqhd", probs, v.double())
    assert relative_error(router.attend(q, k, v, mask, None), reference) < 2e-3


# -- what each class refuses, and classes natsim refuses -------------------------------------------------------


@pytest.mark.parametrize("name", ["SanaTransformer2DModel", "SanaVideoTransformer3DModel", "SanaWMTransformer3DModel"])
def test_linear_attention_classes_are_refused_by_name_with_the_reason(name):
    stand_in = type(name, (torch.nn.Module,), {})()
    with pytest.raises(TypeError, match=f"natsim does not route {name}: its attention over the latent is linear"):
        nd.apply(stand_in, 0.9)


def test_an_unknown_class_is_refused_with_the_route_for_it():
    with pytest.raises(TypeError, match=r"got Linear; route another class with .*register\(cls, ModelSpec"):
        nd.apply(torch.nn.Linear(2, 2), 0.9)


@pytest.mark.parametrize("name, extra, match", [
    ("AllegroTransformer3DModel", {"attention_mask": torch.ones(2, 2, 8, 16)}, "called with attention_mask"),
    ("PixArtTransformer2DModel", {"attention_mask": torch.ones(2, 64)}, "called with attention_mask"),
    ("CogView4Transformer2DModel", {"attention_mask": torch.ones(2, 6)}, "as 1 and 0, not as -inf"),
    ("LTX2VideoTransformer3DModel", {"video_self_attention_mask": torch.ones(2, 64, 64)},
     "called with video_self_attention_mask"),
    ("Flux2Transformer2DModel", {"kv_cache_mode": "extract", "num_ref_tokens": 16}, "called with kv_cache_mode"),
    ("LTX2VideoTransformer3DModel", {"num_frames": 3},  # more tokens in the layout than the latent holds
     r"hidden_states hold 64 tokens, fewer than the 96 of num_frames, height and width"),
])
def test_calls_natsim_cannot_run_are_refused_with_a_sentence(name, extra, match):
    model = diffusers_models.build(name, layers=1)
    nd.apply(model, 0.5, dtype=torch.float16)
    inputs = {**diffusers_models.inputs(name, IMAGE if name in diffusers_models.IMAGES else VIDEO, batch=2), **extra}
    with pytest.raises(ValueError, match=match), torch.no_grad():
        model(**inputs)


def test_skyreels_diffusion_forcing_is_refused_with_a_sentence():
    model = diffusers_models.build("SkyReelsV2Transformer3DModel", layers=1)
    nd.apply(model, 0.5, dtype=torch.float16)
    model._set_ar_attention(2)  # what its diffusion forcing pipelines do
    with pytest.raises(ValueError, match="num_frame_per_block=2 .diffusion forcing"), torch.no_grad():
        model(**diffusers_models.inputs("SkyReelsV2Transformer3DModel", VIDEO))


def test_split_attention_refuses_content_adaptive_masks():
    model = diffusers_models.build("LatteTransformer3DModel", frames=4)
    with pytest.raises(ValueError, match="this model splits its attention over the latent .* use GNA"):
        nd.apply(model, masks=nd.Masks(steps=4))
    assert not hasattr(model, "_natsim")


# -- what each class routes --------------------------------------------------------------------------------------


def test_a_split_attention_too_short_for_any_tile_keeps_the_models_attention(reference_path):
    """Latte at its native 16 frames (here 4): the temporal attention is one tile long and stays the model's."""
    model = diffusers_models.build("LatteTransformer3DModel", frames=4)
    applied = nd.apply(model, 0.5, dtype=torch.float16)
    with torch.no_grad():
        model(**diffusers_models.inputs("LatteTransformer3DModel", (4, 8, 8), batch=2))
    assert [key[0] for key in applied.plans] == [(8, 8)]


def test_motif_videos_decoder_blocks_keep_the_models_attention():
    """Its decoder's single-stream blocks attend over the decoder's and the encoder's latent tokens, no text."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.MotifVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_layers=1, num_single_layers=3, num_decoder_layers=1, patch_size=2,
        text_embed_dim=32, rope_axes_dim=(8, 12, 12), **diffusers_models.HEADS)
    applied = nd.apply(model, 0.5)
    singles = model.single_transformer_blocks
    assert set(applied.originals) == {model.transformer_blocks[0].attn, singles[0].attn, singles[1].attn}


def test_a_new_wan_derived_class_is_routed_as_its_family():
    import diffusers

    derived = type("MyWanTransformer3DModel", (diffusers.WanTransformer3DModel,), {})
    torch.manual_seed(0)
    model = derived(**{**diffusers_models.HEADS, "patch_size": (1, 2, 2), "in_channels": 4, "out_channels": 4,
                       "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "rope_max_seq_len": 32})
    applied = nd.apply(model, 0.5)
    assert set(applied.originals) == {block.attn1 for block in model.blocks}


# -- classes natsim does not know: register a ModelSpec -----------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self):
        from diffusers.models.attention_processor import Attention

        super().__init__()
        self.attn = Attention(query_dim=64, heads=2, dim_head=32)

    def forward(self, tokens):
        return tokens + self.attn(tokens)


class TinyDiT(torch.nn.Module):
    """A transformer natsim does not know: its text tokens, then its latent's patches, in one self-attention."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.latent_in, self.text_in = torch.nn.Linear(4, 64), torch.nn.Linear(32, 64)
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, latent, text, timestep=None):  # latent: [B, C, F, H, W], one token per position
        tokens = torch.cat([self.text_in(text), self.latent_in(latent.flatten(2).transpose(1, 2))], dim=1)
        for block in self.blocks:
            tokens = block(tokens)
        return (tokens[:, text.shape[1]:],)


def tiny_dit_inputs(layout: tuple[int, ...]) -> dict:
    generator = torch.Generator().manual_seed(1)
    return dict(latent=torch.randn(2, 4, *layout, generator=generator),
                text=torch.randn(2, diffusers_models.TEXT_TOKENS, 32, generator=generator))


@pytest.fixture
def registered():
    """TinyDiT registered for the test, forgotten after it."""
    specs = []

    def register(cls_or_name, spec):
        nd.register(cls_or_name, spec)
        specs.append(cls_or_name)

    yield register
    for cls_or_name in specs:
        nd.unregister(cls_or_name)


def test_a_registered_class_runs_natsims_attention_under_its_text_rule(registered, reference_path, monkeypatch):
    registered(TinyDiT, nd.ModelSpec("blocks.attn", lambda call: tuple(call.required("latent").shape[2:]), "before",
                                      joint=("text",)))
    layout = (2, 4, 8)
    model, inputs = TinyDiT(), tiny_dit_inputs(layout)
    with torch.no_grad():
        own = model(**inputs)[0]
    applied = nd.apply(model, window=(1, 2, 4), dtype=torch.float16)
    with torch.no_grad():
        routed = model(**inputs)[0]
    nd.remove(model)
    case = Case("TinyDiT", layout, "before", (("blocks.attn", None),))
    reference = brute_force_run(model, case, applied.plans, inputs, monkeypatch)
    assert relative_error(routed, reference) < 2e-4 and relative_error(routed, own) > 2e-3


def test_a_registered_class_compiles_whole_without_graph_breaks_or_recompiles(registered, reference_path):
    """Its layout function runs in the forward pre-hook, inside the graph of a whole-model compile (Dynamo's
    guards do not depend on the backend: "eager" keeps the test short)."""
    registered("TinyDiT", nd.ModelSpec("blocks.attn", lambda call: tuple(call.required("latent").shape[2:]), "before",
                                      joint=("text",)))
    torch._dynamo.reset()
    model, inputs = TinyDiT(), tiny_dit_inputs((2, 4, 8))
    applied = nd.apply(model, 0.5, dtype=torch.float16)
    run = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        eager = model(**inputs)[0]
        run(**inputs)  # compiles
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert torch.equal(run(**inputs)[0], eager)
    assert [key[0] for key in applied.plans] == [(2, 4, 8)]


def test_a_registered_spec_without_a_layout_takes_applys(registered):
    registered("TinyDiT", nd.ModelSpec("blocks.attn", text="before", joint=("text",)))
    model = TinyDiT()
    nd.apply(model, 0.5, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"has no layout function: pass the token layout to apply\(\)"):
        model(**tiny_dit_inputs((2, 4, 8)))
    nd.remove(model)
    applied = nd.apply(model, 0.5, dtype=torch.float16, layout=(2, 4, 8))
    with torch.no_grad():
        model(**tiny_dit_inputs((2, 4, 8)))
    assert [key[0] for key in applied.plans] == [(2, 4, 8)]


@pytest.mark.parametrize("layout", [(2, 4, 7), (2, 8, 8), (1, 4, 8)])
def test_a_layout_that_is_not_the_latents_is_refused_at_the_first_call(registered, reference_path, layout):
    """apply(layout=...) is taken as given, but a call natsim serves whose token count it does not explain (too
    few layout tokens: the rest would be taken for text; too many: natsim would never run) raises instead of
    running. A layout whose calls the model keeps (too short for a tile, (1, 4, 8) here, as diffusers' LTX long
    multi-prompt pipeline's (1, 1, 1)) runs the model's own attention, whatever its count."""
    registered("TinyDiT", nd.ModelSpec("blocks.attn", text="before", joint=("text",)))
    model, inputs = TinyDiT(), tiny_dit_inputs((2, 4, 8))
    with torch.no_grad():
        own = model(**inputs)[0]
    nd.apply(model, 0.5, dtype=torch.float16, layout=layout, keep_own=False)
    with torch.no_grad(), pytest.raises(ValueError, match=r"the layout is not this call's latent"):
        model(**inputs)
    nd.remove(model)
    nd.apply(model, 0.5, dtype=torch.float16, layout=layout)
    with torch.no_grad():
        if layout == (1, 4, 8):
            with pytest.warns(UserWarning, match="shorter than every tile"):
                assert torch.equal(model(**inputs)[0], own)
        else:
            with pytest.raises(ValueError, match=r"the layout is not this call's latent"):
                model(**inputs)


def test_compiled_blocks_take_prompts_of_any_length_without_a_graph_each(registered, reference_path):
    """The token-count check reads the call's text count only eagerly: compiled blocks, which would guard on it,
    compile once per latent size and shape class, not once per prompt length."""
    from torch._dynamo.utils import counters

    registered("TinyDiT", nd.ModelSpec("blocks.attn", lambda call: tuple(call.required("latent").shape[2:]), "before",
                                       joint=("text",)))
    torch._dynamo.reset()
    counters.clear()
    model = TinyDiT()
    nd.apply(model, 0.5, dtype=torch.float16, keep_own=False)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True, backend="eager")
    inputs = tiny_dit_inputs((2, 4, 8))
    with torch.no_grad():
        for text in range(5, 11):
            model(inputs["latent"], torch.randn(2, text, 32))
    assert counters["stats"]["unique_graphs"] <= 2, counters["stats"]  # a static graph, then a dynamic one


def test_apply_and_remove_take_a_compiled_wrapper_as_its_model(registered, reference_path):
    """`torch.compile(model)` wraps the model in an OptimizedModule: apply and remove reach through it, so the spec
    is the model's class's (a positional call reads its arguments) and the compiled calls run natsim's attention,
    then, after remove, the model's own again."""
    registered("TinyDiT", nd.ModelSpec("blocks.attn", lambda call: tuple(call.required("latent").shape[2:]), "before",
                                       joint=("text",)))
    torch._dynamo.reset()
    model, inputs = TinyDiT(), tiny_dit_inputs((2, 4, 8))
    with torch.no_grad():
        own = model(**inputs)[0]
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        applied = nd.apply(compiled, 0.5, dtype=torch.float16, keep_own=False)
        routed = compiled(inputs["latent"], inputs["text"])[0]
        assert model._natsim is applied and [key[0] for key in applied.plans] == [(2, 4, 8)]
        assert not torch.allclose(routed, own, atol=1e-3)  # sparsity 0.5 changes what the latent attends
        assert torch.allclose(routed, model(**inputs)[0], atol=1e-6)  # the eager model, natsim applied
        nd.remove(compiled)
        assert torch.equal(compiled(inputs["latent"], inputs["text"])[0], own)


def test_specs_and_registrations_refuse_what_natsim_cannot_use():
    with pytest.raises(ValueError, match="text must be one of"):
        nd.ModelSpec("blocks.attn", text="middle")
    with pytest.raises(ValueError, match="must name attention modules"):
        nd.ModelSpec()
    with pytest.raises(TypeError, match="a fixed layout goes to apply"):
        nd.ModelSpec("blocks.attn", layout=(2, 4, 8))
    with pytest.raises(TypeError, match="spec must be a natsim.integrations.diffusers.ModelSpec"):
        nd.register("TinyDiT", {"attentions": "blocks.attn"})
    with pytest.raises(ValueError, match="'TinyDiT' is not registered"):
        nd.unregister("TinyDiT")
    for spec, match in [(nd.ModelSpec("blocks.attention"), r"does not name a module of TinyDiT's Block"),
                        (nd.ModelSpec("layers.attn"), "has no block list for the path 'layers.attn'"),
                        (nd.ModelSpec("blocks.attn.to_q"), "names a Linear")]:
        nd.register(TinyDiT, spec)
        try:
            with pytest.raises((TypeError, ValueError), match=match):
                nd.apply(TinyDiT(), 0.5)
        finally:
            nd.unregister(TinyDiT)


@pytest.mark.parametrize("head_dim", [72, 96])
def test_a_model_at_a_released_head_dim_plans_and_reproduces_its_attention(head_dim, reference_path):
    """PixArt's and Latte's 72, Allegro's 96: the planner plans the width, and a window over the whole layout
    gives the model's own attention (a tiny Wan with heads of that width)."""
    import diffusers

    torch.manual_seed(0)
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=4,
                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=32)
    model = diffusers.WanTransformer3DModel(**config).eval()
    inputs = diffusers_models.inputs("WanTransformer3DModel", (2, 4, 8))
    with torch.no_grad():
        own = model(**inputs)[0]
    applied = nd.apply(model, window=(2, 4, 8), dtype=torch.bfloat16)
    with torch.no_grad():
        routed = model(**inputs)[0]
    assert [key[2] for key in applied.plans] == [head_dim]
    assert float((routed - own).norm() / own.norm()) < 2e-2  # bfloat16 kernels against the float32 model


# Classes whose tiny model has two identical blocks (tests/diffusers_models.py): one traces the class's route.
# Dynamo traces every block of a whole-model compile (CogVideoX: 2.7 -> 1.2 CPU-s) and looks a compiled block up
# again for each other block (LTX-Video). SD3 keeps its two: its first block is a dual-attention one, its last
# drops the text stream (context_pre_only).
ONE_BLOCK = {"CogVideoXTransformer3DModel": {"num_layers": 1}, "LTXVideoTransformer3DModel": {"num_layers": 1}}


@pytest.mark.parametrize("case", [case for case in CASES if case.reference is None], ids=lambda case: case.id)
def test_each_class_compiles_with_natsim_without_graph_breaks_or_recompiles(case, reference_path):
    """natsim adds no graph break: each class's repeated blocks (the whole model where it declares none) compile
    with fullgraph=True and natsim's sparse attention in them, and a second step recompiles nothing (Dynamo's
    guards and graph breaks do not depend on the backend: "eager" keeps the test short). Once per class: an edit's
    reference tokens, or LTX-2's keyframe, reach natsim's joint attention as more tokens beside the layout's, the
    code the class's own case traces (their outputs are checked eagerly above)."""
    torch._dynamo.reset()
    model = diffusers_models.build(case.name, layers=1, frames=case.layout[0], **ONE_BLOCK.get(case.name, {}))
    inputs = diffusers_models.inputs(case.name, case.layout, batch=2, reference=case.reference)
    nd.apply(model, window=sparse_window(case.layout), dtype=torch.float16)
    with torch.no_grad():
        eager = model(**inputs)[0]
        if model._repeated_blocks:
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
            run = model
        else:
            run = torch.compile(model, fullgraph=True, backend="eager")
        run(**inputs)  # compiles
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert torch.equal(run(**inputs)[0], eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_each_classs_verdict_counts_the_tokens_its_joint_attention_holds(case, reference_path):
    """The tokens beside the layout that the verdict prices (the spec's `joint` arguments and the trailing
    reference tokens) are those the routed joint attention calls hold beside the latent's, counted at the calls
    (the most of any call: Mochi attends each prompt without its padding); 0 for a class whose routed attention
    holds the latent alone."""
    model = diffusers_models.build(case.name, layers=1, frames=case.layout[0], **ONE_BLOCK.get(case.name, {}))
    inputs = diffusers_models.inputs(case.name, case.layout, batch=2, reference=case.reference)
    applied = nd.apply(model, window=sparse_window(case.layout), dtype=torch.float16)
    router, held = applied.router, []
    joint = router._joint

    def counting(q, k, v, video, key_mask, scale):
        held.append(q.shape[1] - video)
        return joint(q, k, v, video, key_mask, scale)

    router._joint = counting
    with torch.no_grad():
        model(**inputs)
    counted = {(key[1], verdict.text) for key, verdict in applied.verdicts.items()}  # Latte: its splits' verdicts
    assert counted == {(max(held, default=0),) * 2}, (counted, held)
    assert (case.text is not None) == (max(held, default=0) > 0)
