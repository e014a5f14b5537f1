"""The examples run: plan-then-run on random tensors, and the diffusers processor against the model's own
dense attention (when diffusers is installed; without it the example says so and exits cleanly)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from natsim.planner import best

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_and_run_matches_the_reference():
    error = load("plan_and_run").main(shape=(4, 8, 8), sparsity=0.5, heads=2, head_dim=32)
    assert error < 5e-3


def test_diffusers_processor_reproduces_the_models_dense_attention():
    pytest.importorskip("diffusers")
    example = load("diffusers_processor")
    assert example.compare_dense(example.tiny_wan(), example.tiny_inputs()) < 1e-3


def test_diffusers_processor_runs_every_self_attention_through_a_sparse_plan():
    pytest.importorskip("diffusers")
    example = load("diffusers_processor")
    model, inputs = example.tiny_wan(), example.tiny_inputs()
    plan = best((4, 8, 8), 0.5, heads=2, head_dim=32, dtype=torch.float16)
    processors = example.use_gna(model, plan)
    with torch.no_grad():
        out = model(**inputs)[0]
    assert len(processors) == len(model.blocks) and all(p.calls == 1 for p in processors)
    assert out.shape == inputs["hidden_states"].shape and torch.isfinite(out).all()

    other = best((4, 4, 8), 0.5, heads=2, head_dim=32, dtype=torch.float16)
    example.use_gna(model, other)
    with pytest.raises(ValueError, match=f"layout of {math.prod((4, 4, 8))} tokens"), torch.no_grad():
        model(**inputs)


def test_diffusers_example_says_it_needs_diffusers_when_missing(monkeypatch, capsys):
    example = load("diffusers_processor")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    assert example.main() == 0
    assert "This example needs diffusers: pip install diffusers" in capsys.readouterr().err


# -- the mask processor (natsim.masks predictor + MaskPlan per layer) ---------------------------------------------


def all_true(block: int = 16):
    """A predictor keeping every block (what a predictor at its densest gives), recording the budgets asked."""
    budgets = []

    def predict(q, k, budget):
        budgets.append(budget)
        n = q.shape[1]
        return torch.ones(1, q.shape[2], -(-n // block), -(-n // block), dtype=torch.bool, device=q.device)

    predict.budgets = budgets
    return predict


@pytest.mark.parametrize("options", [{}, {"q_blocks": [16], "kv_blocks": [32], "merges": ["xor"]}])
def test_mask_processor_equals_dense_attention_when_the_mask_is_all_true(options):
    pytest.importorskip("diffusers")
    example = load("diffusers_processor")
    model, inputs = example.tiny_wan(), example.tiny_inputs()
    with torch.no_grad():
        own = model(**inputs)[0]
        processors = example.use_masks(model, (4, 8, 8), all_true(), plan_options=options, min_speedup=0.0)
        ours = model(**inputs)[0]
    assert all(p.calls == 1 and p.predictions == 1 and p.dense_calls == 0 for p in processors)
    plan = processors[0].plan
    if options:
        assert (plan.q_block, plan.kv_block, plan.merge) == (16, 32, "xor")
    assert float((ours - own).norm() / own.norm()) < 1e-3  # fp16 kernel (interpreter on CPU) vs fp32 model


def test_mask_processor_on_the_reference_path_is_exact(reference_path):
    pytest.importorskip("diffusers")
    example = load("diffusers_processor")
    model, inputs = example.tiny_wan(), example.tiny_inputs()
    with torch.no_grad():
        own = model(**inputs)[0]
        example.use_masks(model, (4, 8, 8), all_true(), dtype=torch.float32, order=None,
                          min_speedup=0.0)
        ours = model(**inputs)[0]
    assert float((ours - own).norm() / own.norm()) < 1e-5


class ScriptedCache:
    """A stand-in with MaskCache's call convention (`mask(key, step, predict)`): step 0 dense, a new prediction
    at steps 1 and 3 with budgets 0.5 and 0.25, the cached mask at step 2."""

    def __init__(self):
        self.masks = {}

    def mask(self, key, step, predict):
        if step == 0:
            return None
        if step in (1, 3):
            self.masks[key] = predict({1: 0.5, 3: 0.25}[step])
        return self.masks[key]


def test_mask_processor_follows_the_cache_dense_steps_refreshes_and_reuse():
    pytest.importorskip("diffusers")
    example = load("diffusers_processor")
    model, inputs = example.tiny_wan(), example.tiny_inputs()
    predictor = all_true()
    clock = example.StepClock()
    with torch.no_grad():
        own = model(**inputs)[0]
        processors = example.use_masks(model, (4, 8, 8), predictor, cache=ScriptedCache(), clock=clock,
                                       min_speedup=0.0)
        outs = []
        for step in range(4):
            clock.step = step
            outs.append(model(**inputs)[0])
    assert [p.dense_calls for p in processors] == [1, 1] and all(p.calls == 4 for p in processors)
    assert all(p.predictions == 2 for p in processors) and predictor.budgets == [0.5, 0.5, 0.25, 0.25]
    assert float((outs[0] - own).norm() / own.norm()) < 1e-5  # the dense step is the model's own attention
    assert all(float((o - own).norm() / own.norm()) < 1e-3 for o in outs[1:])
    plans = [p.plan for p in processors]
    assert all(p is not None and p.mask is None for p in plans)  # one plan per layer, made on its first mask


def test_mask_processor_leaves_tokens_in_place_on_dense_steps(monkeypatch):
    pytest.importorskip("diffusers")
    import natsim.masks

    example = load("diffusers_processor")
    model, inputs = example.tiny_wan(), example.tiny_inputs()
    reorders = []
    to_order = natsim.masks.to_order
    monkeypatch.setattr(natsim.masks, "to_order", lambda t, order: reorders.append(t.shape) or to_order(t, order))
    clock = example.StepClock()
    with torch.no_grad():
        example.use_masks(model, (4, 8, 8), all_true(), cache=ScriptedCache(), clock=clock, min_speedup=0.0)
        model(**inputs)  # step 0: dense
        assert reorders == []
        clock.step = 1
        model(**inputs)  # step 1: a prediction and the sparse kernel: q, k, v in, the output back, per layer
    assert len(reorders) == 4 * len(model.blocks)


def test_mask_processor_runs_dense_attention_when_its_plan_predicts_no_gain():
    pytest.importorskip("diffusers")
    example = load("diffusers_processor")
    model, inputs = example.tiny_wan(), example.tiny_inputs()
    with torch.no_grad():
        own = model(**inputs)[0]
        processors = example.use_masks(model, (4, 8, 8), all_true(), dtype=torch.float32, order=None)
        ours = model(**inputs)[0]
    # an all-True mask computes everything: no candidate beats dense attention, so the layers fall back
    assert all(p.plan.predicted_speedup <= 1.0 for p in processors)
    assert all(p.fallbacks == 1 and p.dense_calls == 1 and p.predictions == 1 for p in processors)
    assert float((ours - own).norm() / own.norm()) < 1e-6  # the model's own attention, exactly


def test_mask_processor_refuses_another_layout():
    pytest.importorskip("diffusers")
    example = load("diffusers_processor")
    model, inputs = example.tiny_wan(), example.tiny_inputs()
    example.use_masks(model, (4, 4, 8), all_true())
    with pytest.raises(ValueError, match=f"layout of {math.prod((4, 4, 8))} tokens"), torch.no_grad():
        model(**inputs)
