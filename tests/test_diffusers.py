"""natsim.integrations.diffusers on tiny random models of every supported class (Triton's interpreter on CPU):
the routing against a brute-force mask, each model against its own attention, remove, and compile."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import natsim
from bruteforce import attention_mask

pytest.importorskip("diffusers")

import diffusers_models  # noqa: E402
from natsim.integrations import diffusers as nd  # noqa: E402
from natsim.integrations.diffusers.attention import Router  # noqa: E402
from natsim.planner import AutoPlan  # noqa: E402

MODELS = ("WanTransformer3DModel", "HunyuanVideoTransformer3DModel", "CogVideoXTransformer3DModel",
          "LTXVideoTransformer3DModel", "FluxTransformer2DModel")  # the others: tests/test_diffusers_models.py
LAYOUTS = {name: ((8, 8) if name == "FluxTransformer2DModel" else (2, 4, 8)) for name in MODELS}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# -- the routing itself, against a brute-force mask ------------------------------------------------------------


def joint_reference(q, k, v, problem, text: int, text_first: bool, keep) -> torch.Tensor:
    """float64 attention under the documented joint mask: video queries attend their GNA window of video keys
    and every kept text key; text queries attend every kept key."""
    video = problem.num_tokens
    window = torch.from_numpy(attention_mask(problem))
    allowed = torch.ones(video + text, video + text, dtype=torch.bool)
    v_idx = slice(text, None) if text_first else slice(0, video)
    allowed[v_idx, v_idx] = window
    allowed = allowed[None].repeat(q.shape[0], 1, 1) & keep[:, None, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v.double())


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(4, 4, 4), (8, 8), (2, 4, 8)]), st.integers(1, 7), st.booleans(), st.booleans(),
       st.integers(0, 2**16), st.sampled_from(["bool", -float("inf"), -10000.0, "lowest"]))
def test_joint_attention_matches_a_brute_force_mask(layout, text, text_first, masked, seed, kind):
    """Text padding masked by a boolean key mask or an additive one in each of diffusers' conventions (-inf,
    -10000, the dtype's lowest value)."""
    gen = torch.Generator().manual_seed(seed)
    window = tuple(max(1, n // 2) + (n % 2) for n in layout)
    problem = natsim.Problem(layout, window)
    router = Router(AutoPlan(0.0, window=window), text_first)
    router.set_layout(layout, joint=text)
    tokens = problem.num_tokens + text
    q, k, v = (torch.randn(2, tokens, 2, 32, generator=gen).half() for _ in range(3))
    keep = torch.ones(2, tokens, dtype=torch.bool)
    mask = None
    if masked:  # the second prompt is padded: its last text key is masked
        keep[1, text - 1 if text_first else tokens - 1] = False
        mask = keep[:, None, None, :]
        if kind != "bool":
            masked_value = torch.finfo(q.dtype).min if kind == "lowest" else kind
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, masked_value)
    out = router.attend(q, k, v, mask, None)
    assert relative_error(out, joint_reference(q, k, v, problem, text, text_first, keep)) < 5e-3


def test_joint_attention_refuses_a_bias_and_masked_video_keys():
    """An additive mask with values other than 0 and masked (a bias), or one that masks video keys, which GNA
    attends by its window, fails on the device (here the CPU, at once) with a sentence, never a silent miss."""
    router = Router(AutoPlan(0.0, window=(4, 4)), text_first=True)
    router.set_layout((4, 4), joint=3)
    q = torch.randn(1, 19, 2, 32).half()
    bias = torch.zeros(1, 1, 1, 19, dtype=q.dtype)
    bias[..., 0] = -5.0
    with pytest.raises(RuntimeError, match="holds other values, a bias natsim's kernels cannot add"):
        router.attend(q, q, q, bias, None)
    keep = torch.ones(1, 1, 1, 19, dtype=torch.bool)
    keep[..., 10] = False  # a video key (the three text tokens come first)
    with pytest.raises(RuntimeError, match="this mask masks video keys"):
        router.attend(q, q, q, keep, None)


def test_calls_natsim_does_not_serve_go_to_the_model():
    router = Router(AutoPlan(0.5), text_first=False)
    q = torch.randn(1, 64, 2, 32).half()
    assert router.attend(q, q, q, None, None) is None  # no layout told yet: not inside a forward
    router.set_layout((4, 4, 4), joint=6)
    assert router.attend(q, torch.randn(1, 6, 2, 32).half(), torch.randn(1, 6, 2, 32).half(), None, None) is None
    with pytest.raises(ValueError, match=r"key mask of shape \[batch, 1, 1, tokens\]"):
        router.attend(torch.randn(1, 70, 2, 32).half(), torch.randn(1, 70, 2, 32).half(),
                      torch.randn(1, 70, 2, 32).half(), torch.ones(1, 2, 70, 70, dtype=torch.bool), None)


@pytest.mark.parametrize("tokens, joint", [(32, 0), (63, 6), (64, 0), (65, 0), (67, 6), (71, 6)])
def test_a_token_count_the_layout_does_not_explain_is_refused(tokens, joint):
    """A routed self-attention call holds the layout's tokens and at most the call's joint tokens beside them
    (fewer: a text-dropping class such as Mochi); any other count means the layout is not the latent's (a wrong
    `layout=`, a layout function that forgot the patch size), and is refused rather than windowed over the wrong
    grid or handed to the model's own attention in silence."""
    router = Router(AutoPlan(0.5), text_first=False)
    router.set_layout((4, 4, 4), joint=joint)
    q = torch.randn(1, tokens, 2, 32).half()
    served = 64 <= tokens <= 64 + joint
    if served:
        assert router.attend(q, q, q, None, None).shape == q.shape
    else:
        with pytest.raises(ValueError, match=rf"holds {tokens} tokens, but the token layout \(4, 4, 4\) holds 64 and "
                                             rf"the call's other tokens number at most {joint}"):
            router.attend(q, q, q, None, None)


# -- every supported model --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_a_window_over_the_whole_layout_reproduces_the_models_attention(name):
    model = diffusers_models.build(name)
    inputs = diffusers_models.inputs(name, LAYOUTS[name], batch=2)  # a classifier-free guidance batch
    with torch.no_grad():
        own = model(**inputs)[0]
    applied = nd.apply(model, window=LAYOUTS[name], dtype=torch.float16)
    with torch.no_grad():
        routed = model(**inputs)[0]
    assert list(applied.plans) == [(LAYOUTS[name], 2, 32, torch.float16, "cpu")]
    assert relative_error(routed, own) < 1e-3

    nd.remove(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], own)


def test_a_layout_shorter_than_every_tile_keeps_the_models_attention_or_is_refused():
    """16 latent tokens: one tile would be the whole sequence. By default the model's own attention runs it, with a
    warning saying why (and the tile order is not asked for it); with keep_own=False the planner's sentence."""
    model = diffusers_models.build("WanTransformer3DModel")
    inputs = diffusers_models.inputs("WanTransformer3DModel", (1, 4, 4))
    with torch.no_grad():
        own = model(**inputs)[0]
    applied = nd.apply(model, 0.9, dtype=torch.float16, tile_order=True)
    with pytest.warns(UserWarning, match=r"keeps the model's own attention on layout \(1, 4, 4\) \(16 tokens\)"):
        with torch.no_grad():
            assert torch.equal(model(**inputs)[0], own)
    assert not applied.plans
    nd.remove(model)
    nd.apply(model, 0.9, dtype=torch.float16, keep_own=False)
    with pytest.raises(ValueError, match=r"shape=\(1, 4, 4\) is too small for the planner's tiles"):
        with torch.no_grad():
            model(**inputs)
    nd.remove(model)


@pytest.mark.parametrize("name", MODELS)
def test_a_sparse_plan_changes_attention_and_is_made_once_per_layout(name, reference_path):
    """The plan and its cache, through the torch reference: the test above runs each model's attention through the
    kernel in the interpreter."""
    model = diffusers_models.build(name)
    inputs = diffusers_models.inputs(name, LAYOUTS[name], batch=2)
    with torch.no_grad():
        own = model(**inputs)[0]
    applied = nd.apply(model, 0.5, dtype=torch.float16)
    with torch.no_grad():
        first = model(**inputs)[0]
        second = model(**inputs)[0]
    plan = applied.plans[(LAYOUTS[name], 2, 32, torch.float16, "cpu")]
    assert plan.sparsity >= 0.5 and len(applied.plans) == 1
    assert torch.isfinite(first).all() and torch.equal(first, second)
    assert relative_error(first, own) > 1e-3  # the window is smaller than the layout: attention changed


def test_apply_refuses_what_it_cannot_do():
    model = diffusers_models.build("WanTransformer3DModel")
    with pytest.raises(TypeError, match="natsim supports the diffusers transformers WanTransformer3DModel"):
        nd.apply(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="natsim is not applied to this transformer"):
        nd.remove(model)
    nd.apply(model, 0.5)
    with pytest.raises(ValueError, match="already applied to this transformer: call remove"):
        nd.apply(model, 0.5)
    with pytest.raises(ValueError, match="dtype must be None, torch.float16 or torch.bfloat16"):
        Router(AutoPlan(0.5), False, torch.float32)


def test_two_models_of_one_class_keep_their_own_attention():
    routed, plain = diffusers_models.build("WanTransformer3DModel"), diffusers_models.build("WanTransformer3DModel")
    inputs = diffusers_models.inputs("WanTransformer3DModel", (2, 4, 8))
    with torch.no_grad():
        before = plain(**inputs)[0]
    nd.apply(routed, 0.5, dtype=torch.float16)
    with torch.no_grad():
        routed(**inputs)
        assert torch.equal(plain(**inputs)[0], before)


# -- compile: once per latent size ------------------------------------------------------------------------------


def run_sizes(run, name, layouts, repeat: int = 1):
    for _ in range(repeat):
        for layout in layouts:
            with torch.no_grad():
                out = run(**diffusers_models.inputs(name, layout, batch=2))[0]
            assert torch.isfinite(out).all()


def test_compiled_blocks_compile_once_per_latent_size(reference_path):
    """Wan's blocks, compiled as diffusers compiles them (`compile_repeated_blocks`), compile once per
    latent size and plan each size apart. Dynamo's guards and graph breaks do not depend on the backend: "eager"
    (Dynamo's fake tensors through the operators, neither AOTAutograd nor code generation) keeps the test fast;
    the GPU benchmarks run Inductor. The compiled graphs' attention runs the torch reference (neither guards nor
    graphs depend on the path the operator takes when it runs): the next test runs Triton's interpreter inside
    compiled blocks. Whole models compiled (`torch.compile(model)`) are in each class's compile test
    (tests/test_diffusers_models.py)."""
    name = "WanTransformer3DModel"
    torch._dynamo.reset()
    model = diffusers_models.build(name, layers=1)
    applied = nd.apply(model, 0.5, dtype=torch.float16)
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    layouts = [(2, 4, 8), (2, 8, 4)]
    run_sizes(model, name, layouts)  # first call of each size: compile
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_sizes(model, name, layouts, repeat=2)
    assert sorted(key[0] for key in applied.plans) == sorted(layouts)
    assert math.prod(layouts[0]) == math.prod(layouts[1])  # same token count, other layout: planned apart
    assert all(plan.sparsity >= 0.5 for plan in applied.plans.values())


def test_compiled_blocks_share_one_graph_as_with_the_models_own_attention():
    """Dynamo guards on a processor's type: every routed processor of a class must share one routed class, or
    each of a model's blocks compiles its own graph (and 30 blocks exceed the recompile limit). Three blocks: a
    graph per block would count three (ten blocks ran ten blocks' attention twice in the interpreter for it)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = diffusers_models.build("WanTransformer3DModel", layers=3)
    inputs = diffusers_models.inputs("WanTransformer3DModel", (2, 4, 8))
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        model(**inputs)
    own = counters["stats"]["unique_graphs"] - before
    nd.apply(model, 0.5, dtype=torch.float16)
    with torch.no_grad():
        model(**inputs)
    assert counters["stats"]["unique_graphs"] - before - own == own == 1


def test_flux_under_a_whole_model_compile_asks_for_its_layout():
    torch._dynamo.reset()
    model = diffusers_models.build("FluxTransformer2DModel")
    nd.apply(model, 0.5, dtype=torch.float16)
    with pytest.raises(Exception, match=r"pass layout=\(height // 16, width // 16\) to apply\(\)"), torch.no_grad():
        torch.compile(model, fullgraph=True, backend="eager")(**diffusers_models.inputs("FluxTransformer2DModel",
                                                                                         (8, 8)))


# -- on a CUDA GPU: `pytest -m gpu tests/test_diffusers.py` ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("keys, masked", [(512, False), (37, True), (256, True)])
def test_gpu_text_attention_with_lse_matches_float64(keys, masked):
    from natsim.integrations.diffusers.dense import attention_with_lse

    gen = torch.Generator(device="cuda").manual_seed(keys)
    q = torch.randn(2, 3000, 4, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(2, keys, 4, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    keep = torch.rand(2, keys, device="cuda", generator=gen) > 0.3 if masked else None
    out, lse = attention_with_lse(q, k, v, keep, 128**-0.5)
    ref, ref_lse = attention_with_lse(q.cpu().double(), k.cpu().double(), v.cpu().double(),
                                      None if keep is None else keep.cpu(), 128**-0.5)
    assert relative_error(out.cpu(), ref) < 1e-2
    assert float((lse.cpu().double() - ref_lse).abs().max()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_gpu_models_match_their_own_attention_and_replay_under_cuda_graphs(name):
    torch._dynamo.reset()
    model = diffusers_models.build(name).cuda().to(torch.bfloat16)
    layout = LAYOUTS[name]
    inputs = {k: (v.cuda().to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in
                  ("img_ids", "txt_ids") else (v.cuda() if isinstance(v, torch.Tensor) else v))
              for k, v in diffusers_models.inputs(name, layout, batch=2).items()}
    with torch.no_grad():
        own = model(**inputs)[0]
        nd.apply(model, window=layout, keep_own=False)  # natsim's call on these tiny layouts, which it would leave
        eager = model(**inputs)[0]
        assert relative_error(eager, own) < 2e-2
        nd.remove(model)
        # A whole-model compile cannot read FLUX's img_ids: the layout given.
        nd.apply(model, 0.5, layout=layout, keep_own=False)
        sparse = model(**inputs)[0]
        run = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # warm-up, capture, replay
            torch.compiler.cudagraph_mark_step_begin()
            graphed = run(**inputs)[0].clone()
    assert relative_error(graphed, sparse) < 2e-2


# -- content-adaptive masks ---------------------------------------------------------------------------------------

EVERY_BLOCK = dict(dense_fraction=0.0, initial_budget=1.0, budget_decay=0.0, min_budget=1.0, min_speedup=0.0)


def with_timestep(name: str, layout, value: float, batch: int = 1) -> dict:
    inputs = diffusers_models.inputs(name, layout, batch=batch)
    inputs["timestep"] = torch.full_like(inputs["timestep"], value)
    return inputs


@pytest.mark.parametrize("name", ["WanTransformer3DModel", "HunyuanVideoTransformer3DModel",
                                  "CogVideoXTransformer3DModel"])
def test_masks_that_keep_every_block_reproduce_the_models_attention(name):
    """Predicted masks keeping every block: the sparse kernel on Hilbert-ordered tokens, back in row-major order,
    merged with the text part where there is one, must equal the model's dense attention."""
    model = diffusers_models.build(name)
    inputs = with_timestep(name, (2, 4, 8), 900.0, batch=2)
    with torch.no_grad():
        own = model(**inputs)[0]
    applied = nd.apply(model, masks=nd.Masks(steps=4, block=16, **EVERY_BLOCK), dtype=torch.float16)
    with torch.no_grad():
        routed = model(**inputs)[0]
    stats = applied.masked.stats
    assert stats.predictions == stats.calls == len(applied.originals) and stats.dense_calls == 0
    assert relative_error(routed, own) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["WanTransformer3DModel", "HunyuanVideoTransformer3DModel"])
def test_gpu_masks_keeping_every_block_reproduce_the_model_eager_compiled_and_in_training(name):
    """On a GPU (bf16 kernels under a float32 model): masks keeping every block, run without gradients (the
    masks route's operator without autograd, eager and with the blocks compiled by Inductor) and in a training
    pass (the operator with autograd), against the model's own attention: outputs and parameter gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch._dynamo.reset()
    model = diffusers_models.build(name).cuda()
    inputs = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
              for k, v in with_timestep(name, (2, 4, 8), 900.0, batch=2).items()}
    weight = torch.randn(inputs["hidden_states"].shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def gradients() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (model(**inputs)[0] * weight).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with torch.no_grad():
        own = model(**inputs)[0]
    own_gradients = gradients()
    applied = nd.apply(model, masks=nd.Masks(steps=4, block=16, **EVERY_BLOCK), training=True, dtype=torch.bfloat16)
    with torch.no_grad():
        routed = model(**inputs)[0]
    stats = applied.masked.stats
    assert stats.predictions == stats.calls == len(applied.originals) and stats.dense_calls == 0
    assert relative_error(routed, own) < 2e-2
    routed_gradients = gradients()
    assert len(routed_gradients) == len(own_gradients) > 1
    norm = max(float(g.norm()) for g in own_gradients)
    assert max(float((a - b).norm()) / max(float(b.norm()), 1e-3 * norm)
               for a, b in zip(routed_gradients, own_gradients)) < 5e-2
    model.compile_repeated_blocks(fullgraph=True)
    with torch.no_grad():
        compiled = model(**inputs)[0]
    assert relative_error(compiled, own) < 2e-2
    assert applied.masked.stats.dense_calls == 0


def test_masks_follow_the_cache_schedule_one_step_per_timestep():
    model = diffusers_models.build("WanTransformer3DModel")
    applied = nd.apply(model, masks=nd.Masks(steps=4, block=16, dense_fraction=0.25, interval=2), dtype=torch.float16)
    layers = len(applied.originals)
    with torch.no_grad():
        for step, timestep in enumerate([900.0, 700.0, 500.0, 300.0]):
            for _ in range(2):  # classifier-free guidance as two forward passes: one step
                model(**with_timestep("WanTransformer3DModel", (2, 4, 8), timestep))
            assert applied.masked.step == step
    stats = applied.masked.stats
    assert stats.calls == 4 * 2 * layers and stats.dense_calls == 2 * layers  # step 0: dense warm-up
    # Predicted at step 1 (the first sparse step), again at step 2 (a new interval), reused at step 3.
    assert sorted({(r.step, r.budget) for r in applied.masked.cache.refreshes}) == [(1, 0.3), (2, 0.2)]
    assert stats.predictions == 2 * layers and len(applied.plans) == 1


def test_masks_under_regional_compilation_never_recompile_across_steps():
    torch._dynamo.reset()
    model = diffusers_models.build("WanTransformer3DModel")
    nd.apply(model, masks=nd.Masks(steps=4, block=16, dense_fraction=0.25), dtype=torch.float16)
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    with torch.no_grad():
        model(**with_timestep("WanTransformer3DModel", (2, 4, 8), 900.0))  # compiles (a dense step)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for timestep in (700.0, 500.0, 300.0):  # sparse steps, masks predicted and reused
                assert torch.isfinite(model(**with_timestep("WanTransformer3DModel", (2, 4, 8), timestep))[0]).all()


def test_masks_refuse_what_they_cannot_do():
    model = diffusers_models.build("WanTransformer3DModel")
    with pytest.raises(ValueError, match="masks replaces GNA: pass masks=... or sparsity / window, not both"):
        nd.apply(model, 0.9, masks=nd.Masks(steps=4))
    with pytest.raises(TypeError, match="masks must be a natsim.integrations.diffusers.Masks"):
        nd.apply(model, masks={"steps": 4})
    torch._dynamo.reset()
    nd.apply(model, masks=nd.Masks(steps=4, block=16))
    with pytest.raises(Exception, match="compile its blocks instead"), torch.no_grad():
        torch.compile(model, fullgraph=True, backend="eager")(**with_timestep("WanTransformer3DModel", (2, 4, 8), 9.0))


def test_remove_releases_the_masks_state_and_leaves_the_models_processors_as_they_were():
    """After remove, the masks' registered attention (its masks and plans) is gone and its id refused, a new apply
    gets a fresh id, and the model's own processors carry nothing natsim set (no `_parallel_config` of their own
    where parallelism was never enabled, which a compiled block would guard on)."""
    from natsim.kernels import unregister_attention

    model = diffusers_models.build("WanTransformer3DModel")
    processors = [block.attn1.processor for block in model.blocks]
    before = [dict(vars(p)) for p in processors]
    applied = nd.apply(model, masks=nd.Masks(steps=4, block=16, **EVERY_BLOCK), dtype=torch.float16)
    with torch.no_grad():
        model(**with_timestep("WanTransformer3DModel", (2, 4, 8), 900.0))
    first = applied.masked.id
    nd.remove(model)
    assert [dict(vars(block.attn1.processor)) for block in model.blocks] == before
    with pytest.raises(ValueError, match=r"attention must be an id from register_attention"):
        unregister_attention(first)
    again = nd.apply(model, masks=nd.Masks(steps=4, block=16, **EVERY_BLOCK), dtype=torch.float16)
    assert again.masked.id != first
    nd.remove(model)


def test_masks_refuse_backends_that_cannot_run_them_when_applied():
    model = diffusers_models.build("WanTransformer3DModel")
    with pytest.raises(ValueError, match=r"names 'gluon', which has no backward pass: leave it out \(training=True"):
        nd.apply(model, masks=nd.Masks(steps=4, backends=("triton", "gluon")), training=True)
    with pytest.raises(ValueError, match=r"names 'fa4', which runs no FP8"):
        nd.apply(model, masks=nd.Masks(steps=4, backends="fa4"), precision="fp8")
    nd.apply(model, masks=nd.Masks(steps=4, backends=("triton", "gluon")))  # inference: the planner decides
    nd.remove(model)


def test_masks_leave_tokens_in_place_on_dense_steps(monkeypatch):
    from natsim.integrations.diffusers import masks as masks_module

    model = diffusers_models.build("WanTransformer3DModel")
    reorders = []
    to_order = masks_module.to_order
    monkeypatch.setattr(masks_module, "to_order", lambda t, order: reorders.append(t.shape) or to_order(t, order))
    nd.apply(model, masks=nd.Masks(steps=4, block=16, dense_fraction=0.25, min_speedup=0.0), dtype=torch.float16)
    with torch.no_grad():
        model(**with_timestep("WanTransformer3DModel", (2, 4, 8), 900.0))  # step 0: dense
        assert reorders == []
        model(**with_timestep("WanTransformer3DModel", (2, 4, 8), 700.0))  # step 1: q, k, v in, the output back
    assert len(reorders) == 4 * len(model.blocks)


def test_masks_run_dense_attention_when_the_plan_predicts_no_gain():
    """A mask keeping every block computes everything: no candidate beats dense attention, so every layer runs
    the model's own (dense) attention, with the default min_speedup."""
    model = diffusers_models.build("WanTransformer3DModel")
    inputs = with_timestep("WanTransformer3DModel", (4, 8, 8), 900.0)
    with torch.no_grad():
        own = model(**inputs)[0]
    every_block = {**EVERY_BLOCK, "min_speedup": 1.0}
    applied = nd.apply(model, masks=nd.Masks(steps=4, block=16, **every_block), dtype=torch.float16)
    with torch.no_grad():
        routed = model(**inputs)[0]
    plan = next(iter(applied.plans.values()))
    assert plan.predicted_speedup <= 1.0
    assert applied.masked.stats.dense_calls == applied.masked.stats.calls == len(model.blocks)
    assert relative_error(routed, own) < 1e-5
