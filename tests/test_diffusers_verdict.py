"""natsim's call against the model's own attention, per layout (`AutoPlan.verdict`, planner/plans/verdict.py):
each side priced as the host's time to issue its call plus the call's predicted time; where natsim's is not the
faster, the diffusers integration keeps the model's own attention there, says so once, and compiles as before.
CPU: the H100's stored cost model with host times set by each test (tiny models through the torch reference)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim.planner import AutoPlan, cost_model_for

pytest.importorskip("diffusers")

import diffusers_models  # noqa: E402
from natsim.integrations import diffusers as nd  # noqa: E402

H100 = cost_model_for("NVIDIA H100 80GB HBM3")
WAN = "WanTransformer3DModel"
SMALL, LARGE = (2, 16, 16), (2, 32, 32)
CALL = dict(heads=2, head_dim=32, dtype=torch.float16, device="cpu")  # the tiny Wan's attention


def hosted(natsim_s: float, own_s: float):
    """The H100's cost model with the host's time to issue natsim's Triton call and torch's SDPA."""
    return replace(H100, host_seconds={"triton": natsim_s, "sdpa": own_s})


@settings(max_examples=5, deadline=None)
@given(natsim_host=st.floats(0, 2e-4), own_host=st.floats(0, 2e-4), batch=st.integers(1, 4))
def test_a_verdict_weighs_each_sides_host_and_call(natsim_host, own_host, batch):
    auto = AutoPlan(0.5, cost_model=hosted(natsim_host, own_host))
    verdict = auto.verdict(LARGE, batch=batch, **CALL)
    plan = auto.plan_for(LARGE, **CALL)
    assert plan.backend == "triton" and plan.score >= natsim_host  # the call itself is priced at its host at least
    assert verdict.natsim_s == pytest.approx(natsim_host + batch * plan.score)
    assert verdict.own_s == pytest.approx(own_host + batch * plan.dense_score)
    assert verdict.serves == (verdict.natsim_s < verdict.own_s)
    assert ("natsim serves" if verdict.serves else "keeps the model's own attention") in verdict.explain()


def test_an_fp8_plan_is_weighed_against_the_models_unquantized_call():
    model = hosted(5e-5, 2e-5)
    fp8 = AutoPlan(0.9, cost_model=model, precision="fp8")
    verdict = fp8.verdict(LARGE, **CALL)
    plan = fp8.plan_for(LARGE, **CALL)
    unquantized = AutoPlan(0.9, cost_model=model).plan_for(LARGE, **CALL)
    assert plan.precision == "fp8" and unquantized.precision is None
    assert verdict.natsim_s == pytest.approx(5e-5 + plan.score)
    assert verdict.own_s == pytest.approx(2e-5 + unquantized.dense_score)
    assert unquantized.dense_score != plan.dense_score  # the premise: FP8's dense call is priced otherwise


def test_without_a_cost_model_natsim_serves_and_says_why():
    verdict = AutoPlan(0.5).verdict(LARGE, **CALL)
    assert verdict.serves and verdict.natsim_s is None and "natsim calibrate" in verdict.explain()


def _margins() -> tuple[float, float]:
    """What natsim's call saves against the dense call on SMALL and on LARGE, with no host time."""
    auto = AutoPlan(0.9, cost_model=hosted(0.0, 0.0))
    saved = []
    for layout in (SMALL, LARGE):
        verdict = auto.verdict(layout, **CALL)
        saved.append(verdict.own_s - verdict.natsim_s)
    return saved[0], saved[1]


def _run(model, layout):
    with torch.no_grad():
        return model(**diffusers_models.inputs(WAN, layout))[0]


def test_a_layout_natsim_would_slow_keeps_the_models_attention_and_a_larger_one_does_not(reference_path):
    small_saved, large_saved = _margins()
    assert large_saved > small_saved > 0, "the premise: natsim saves more GPU time on the larger layout"
    model = diffusers_models.build(WAN, layers=1, frames=LARGE[0])
    own = {layout: _run(model, layout) for layout in (SMALL, LARGE)}
    cost_model = hosted((small_saved + large_saved) / 2, 0.0)  # more than SMALL saves, less than LARGE does

    applied = nd.apply(model, 0.9, dtype=torch.float16, cost_model=cost_model)
    with pytest.warns(UserWarning, match=r"keeps the model's own attention at layout 2x16x16"):
        kept = _run(model, SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once per layout: no second warning
        assert torch.equal(_run(model, SMALL), own[SMALL]) and torch.equal(kept, own[SMALL])
        served = _run(model, LARGE)
    assert not torch.equal(served, own[LARGE])
    assert {key[0]: v.serves for key, v in applied.verdicts.items()} == {SMALL: False, LARGE: True}
    nd.remove(model)

    nd.apply(model, 0.9, dtype=torch.float16, cost_model=cost_model, keep_own=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not torch.equal(_run(model, SMALL), own[SMALL])
        assert torch.equal(_run(model, LARGE), served)
    assert nd.remove(model) is None


def test_compiled_blocks_read_each_layouts_verdict_without_graph_breaks_or_recompiles(reference_path):
    small_saved, large_saved = _margins()
    model = diffusers_models.build(WAN, layers=1, frames=LARGE[0])
    own = {layout: _run(model, layout) for layout in (SMALL, LARGE)}
    nd.apply(model, 0.9, dtype=torch.float16, cost_model=hosted((small_saved + large_saved) / 2, 0.0))
    eager_large = _run(model, LARGE)
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layout in (SMALL, LARGE):
            _run(model, layout)  # compiles each layout once
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(_run(model, SMALL), own[SMALL])
        assert torch.equal(_run(model, LARGE), eager_large)
    torch._dynamo.reset()


def test_a_kept_layout_keeps_the_models_token_order_too(reference_path):
    """With the whole-model tile order forced on, a layout natsim serves moves the model's tokens into its plan's
    tile order; a kept one leaves them, and its output is the model's own exactly."""
    model = diffusers_models.build(WAN, layers=1, frames=SMALL[0])
    own = _run(model, SMALL)
    served = nd.apply(model, 0.9, dtype=torch.float16, cost_model=hosted(0.0, 1.0), tile_order=True)
    _run(model, SMALL)
    assert served.router.order is not None, "the premise: the plan's tile divides the layout"
    nd.remove(model)
    kept = nd.apply(model, 0.9, dtype=torch.float16, cost_model=hosted(1.0, 0.0), tile_order=True)
    with pytest.warns(UserWarning, match="keeps the model's own attention"):
        out = _run(model, SMALL)
    assert kept.router.order is None and torch.equal(out, own)


@settings(max_examples=10, deadline=None)
@given(text=st.integers(1, 600), natsim_host=st.floats(0, 2e-4), own_host=st.floats(0, 2e-4), batch=st.integers(1, 3))
def test_joint_tokens_price_the_models_longer_call_and_natsims_dense_part(text, natsim_host, own_host, batch):
    """By hand: the model's call over N + T tokens at the dense call's rate per query-key pair; natsim's plan
    plus its dense part (N x T and T x (N + T) pairs at that rate) and, on the host, two SDPA calls and a merge."""
    model = hosted(natsim_host, own_host)
    auto = AutoPlan(0.5, cost_model=model)
    plan = auto.plan_for(LARGE, **CALL)
    verdict = auto.verdict(LARGE, batch=batch, text=text, **CALL)
    latent = 2 * 32 * 32
    per_pair = plan.dense_score / latent**2
    assert verdict.own_s == pytest.approx(own_host + batch * per_pair * (latent + text) ** 2)
    dense_part = per_pair * (latent * text + text * (latent + text))
    assert verdict.natsim_s == pytest.approx(natsim_host + 2 * own_host + natsim_host + batch * (plan.score + dense_part))
    assert verdict.serves == (verdict.natsim_s < verdict.own_s) and verdict.text == text
    assert f"with {text} joint tokens beside it" in verdict.explain()
    alone = auto.verdict(LARGE, batch=batch, **CALL)
    assert alone.text == 0 and alone.own_s == pytest.approx(own_host + batch * plan.dense_score)
    with pytest.raises(ValueError, match="text must be a token count >= 0"):
        auto.verdict(LARGE, text=-1, **CALL)


@pytest.mark.parametrize("name, layout, reference, joined", [
    ("FluxTransformer2DModel", (8, 8), None, diffusers_models.TEXT_TOKENS),
    ("FluxTransformer2DModel", (8, 8), (4, 4), diffusers_models.TEXT_TOKENS + 16),  # Kontext's reference image too
    ("SD3Transformer2DModel", (8, 8), None, diffusers_models.TEXT_TOKENS),
    ("PixArtTransformer2DModel", (8, 8), None, 0),  # text in cross-attention: the routed attention is the image's
])
def test_a_joint_models_verdict_counts_the_tokens_joined_to_the_latent(name, layout, reference, joined,
                                                                        reference_path):
    """The router's verdict for a forward call is made with the tokens the spec's `joint` arguments and the
    trailing tokens bring to its joint attention, and kept per layout and count."""
    model = diffusers_models.build(name, layers=1)
    applied = nd.apply(model, 0.5, dtype=torch.float16, cost_model=hosted(0.0, 0.0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # whichever way it goes
        model(**diffusers_models.inputs(name, layout, reference=reference))
    (key, verdict), = applied.verdicts.items()
    assert key[:2] == (layout, joined) and verdict.text == joined
    assert verdict == applied.router.auto.verdict(layout, heads=key[2], head_dim=key[3], dtype=key[4],
                                                  device=key[5], text=joined)
    nd.remove(model)


def test_a_spec_names_its_joint_arguments_as_a_tuple():
    with pytest.raises(TypeError, match="joint must be a tuple of forward argument names"):
        nd.ModelSpec("blocks.attn", joint="encoder_hidden_states")
