"""The examples run: plan-then-run on random tensors against the reference, and natsim inside a diffusers
transformer (when diffusers is installed; without it the example says so and exits cleanly)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_and_run_matches_the_reference():
    error = load("plan_and_run").main(shape=(4, 8, 8), sparsity=0.5, heads=2, head_dim=32)
    assert error < 5e-3


def test_the_diffusers_example_plans_gna_and_runs_masks(capsys):
    pytest.importorskip("diffusers")
    assert load("diffusers_gna").main() == 0
    printed = capsys.readouterr().out
    assert "GNA on layout (4, 8, 8)" in printed
    assert "masks over 4 steps: 8 attention calls, 2 dense (warm-up), 6 masks predicted" in printed


def test_the_diffusers_example_says_it_needs_diffusers_when_missing(monkeypatch, capsys):
    example = load("diffusers_gna")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    assert example.main() == 0
    assert "This example needs diffusers: pip install diffusers" in capsys.readouterr().err
