"""natsim.integrations.diffusers with `precision="fp8"`: a model's video self-attention through the FP8 kernels
(GNA plans and mask plans made for FP8), the rest in the model's dtype, on tiny models in Triton's interpreter.

FP8 must change the output by FP8's rounding and no more: against the same routing in fp16 the relative error is
small but not zero (zero would mean FP8 did not run), and each GNA call the plans make is checked against
`gna_attention(..., precision="fp8")` itself.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import diffusers_models  # noqa: E402
from natsim.integrations import diffusers as nd  # noqa: E402
from natsim.kernels import gna_attention  # noqa: E402

LAYOUT = (2, 4, 8)
EVERY_BLOCK = dict(dense_fraction=0.0, initial_budget=1.0, budget_decay=0.0, min_budget=1.0, min_speedup=0.0)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def routed_output(name: str, **options) -> tuple[torch.Tensor, nd.Applied]:
    model = diffusers_models.build(name)
    inputs = diffusers_models.inputs(name, LAYOUT)
    inputs["timestep"] = torch.full_like(inputs["timestep"], 900.0)
    applied = nd.apply(model, dtype=torch.float16, **options)
    with torch.no_grad():
        return model(**inputs)[0], applied


@pytest.mark.parametrize("name", ["WanTransformer3DModel", "HunyuanVideoTransformer3DModel"])
def test_fp8_gna_changes_a_models_output_by_fp8_rounding_only(name):
    fp16, _ = routed_output(name, sparsity=0.5)
    fp8, applied = routed_output(name, sparsity=0.5, precision="fp8")
    (plan,) = applied.plans.values()
    assert plan.precision == "fp8" and plan.kernel_arguments()["precision"] == "fp8"
    assert torch.isfinite(fp8).all()
    assert 0.0 < relative_error(fp8, fp16) < 0.1


def test_the_fp8_plan_runs_what_gna_attention_runs_in_fp8():
    _, applied = routed_output("WanTransformer3DModel", sparsity=0.5, precision="fp8")
    (plan,) = applied.plans.values()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, *LAYOUT, 2, 32, generator=generator).half() for _ in range(3))
    assert torch.equal(applied.router.auto(q, k, v), gna_attention(q, k, v, **plan.kernel_arguments()))


def test_fp8_masks_run_the_fp8_sparse_kernel():
    fp16, _ = routed_output("WanTransformer3DModel", masks=nd.Masks(steps=4, block=16, **EVERY_BLOCK))
    fp8, applied = routed_output("WanTransformer3DModel", masks=nd.Masks(steps=4, block=16, **EVERY_BLOCK),
                                 precision="fp8")
    assert all(plan.precision == "fp8" for plan in applied.plans.values()) and applied.plans
    assert applied.masked.stats.dense_calls == 0
    assert 0.0 < relative_error(fp8, fp16) < 0.1


def test_fp8_refuses_training_and_unknown_precisions():
    model = diffusers_models.build("WanTransformer3DModel")
    with pytest.raises(ValueError, match=r"precision='fp8' is for inference"):
        nd.apply(model, 0.5, training=True, precision="fp8")
    with pytest.raises(ValueError, match=r"precision must be None \(the inputs' dtype\), 'fp8' or 'auto' .* got "
                                         r"precision='int8'"):
        nd.apply(model, 0.5, precision="int8")
    with pytest.raises(ValueError, match=r"precision must be None"):
        nd.apply(model, masks=nd.Masks(steps=4, block=16), precision="int8")
    with pytest.raises(ValueError, match=r"masks=\.\.\. with precision='fp8' is for inference .* training must be "
                                         r"False"):
        nd.apply(model, masks=nd.Masks(steps=4, block=16), training=True, precision="fp8")
    assert not hasattr(model, "_natsim")  # refused before anything was routed


def test_remove_after_fp8_gives_the_model_its_own_attention_back():
    model = diffusers_models.build("WanTransformer3DModel")
    inputs = diffusers_models.inputs("WanTransformer3DModel", LAYOUT)
    with torch.no_grad():
        own = model(**inputs)[0]
        nd.apply(model, 0.5, dtype=torch.float16, precision="fp8")
        routed = model(**inputs)[0]
        nd.remove(model)
        restored = model(**inputs)[0]
    assert not torch.equal(routed, own) and torch.equal(restored, own)
    assert not hasattr(model, "_natsim")
