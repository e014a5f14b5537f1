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
