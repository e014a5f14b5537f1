"""The planner pricing the Gluon kernel's 16-bit variant for block-mask plans, on the CPU: which searches rank it
(16-bit coefficients, inference only), its candidate's features and score restated by hand, mask plans picking it
where a synthetic cost model makes it cheaper and not where it is dearer, in training, or unpriced; plans running
on its CPU path like float64 attention and refusing gradients with a sentence; the calibration cases separating
the features; the coefficient set kept through JSON."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from natsim.kernels.backends import gluon as gluon_backend
from natsim.planner import MaskPlan, best_mask, cost_model_for
from natsim.planner.plans.mask import MERGES
from natsim.planner.backends import backend_choice
from natsim.planner.cost.calibrate import check_kernels
from natsim.planner.cost.fit import fit_coefficients
from natsim.planner.cost.gluon_calibrate import gluon_16bit_calibration_cases
from natsim.planner.cost.gluon_features import GLUON_FEATURES, mask_gluon_features
from natsim.planner.cost.host import host_refusal
from natsim.planner.cost.model import CostModel, host_call

H100 = replace(cost_model_for("NVIDIA H100 80GB HBM3"), host_seconds=None)  # kernels' predictions alone
# Cheaper per FLOP than natsim's sparse kernel, dearer per call; a cost for moved bytes too, which 16 bits do not
# move, so that a candidate counted as FP8's would be priced differently.
GLUON_16BIT = {"flops": 5e-16, "narrow_head_flops": 2e-16, "blocks": 1e-10, "masked_blocks": 0.0, "programs": 1e-8,
               "moved_bytes": 1e-12, "launch": 5e-5}
CHEAP = replace(H100, gluon_16bit_coefficients=GLUON_16BIT)
DEAR = replace(H100, gluon_16bit_coefficients={name: 50 * value for name, value in GLUON_16BIT.items()})
FP8_ONLY = replace(H100, gluon_fp8_coefficients=GLUON_16BIT, gluon_16bit_coefficients=None)


@pytest.fixture
def hopper(monkeypatch):
    """The Gluon kernel runs on the device at hand."""
    monkeypatch.setattr(gluon_backend, "device_refusal", lambda device: None)


def random_mask(seed: int, heads: int, blocks: int, density: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, heads, blocks, blocks, generator=gen) < density
    return mask | torch.eye(blocks, dtype=torch.bool)


def float64_under_pooled(q, k, v, pooled: torch.Tensor, block: int) -> torch.Tensor:
    """float64 attention with each query attending the keys of its `block` x `block` blocks."""
    n = q.shape[1]
    allowed = pooled.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :n]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v.double())


def test_only_the_variants_own_coefficients_price_it_in_16_bits(hopper):
    sixteen = dict(device=None, training=False, gpu="NVIDIA H100 80GB HBM3", fp8=False)
    assert backend_choice(None, model=FP8_ONLY, **sixteen).allowed == ("triton",)
    assert "has no Gluon 16-bit coefficients" in dict(backend_choice(None, model=FP8_ONLY, **sixteen).notes)["gluon"]
    with pytest.raises(ValueError, match=r"has no Gluon 16-bit coefficients; run `natsim calibrate --kernels "
                                         r"gluon-16bit`"):
        backend_choice(("gluon",), model=FP8_ONLY, **sixteen)
    assert backend_choice(None, model=CHEAP, **sixteen).allowed == ("triton", "gluon")
    no_fp8 = replace(CHEAP, gluon_fp8_coefficients=None)
    assert backend_choice(None, model=no_fp8, **{**sixteen, "fp8": True}).allowed == ("triton",)  # FP8's own set


def test_the_features_of_16_bits_are_fp8s_without_the_quantization():
    fp8 = mask_gluon_features(1000, seq_len=5000, batch_heads=6, head_dim=64, element_bytes=2)
    bits = mask_gluon_features(1000, seq_len=5000, batch_heads=6, head_dim=64, element_bytes=2, fp8=False)
    moved = GLUON_FEATURES.index("moved_bytes")
    assert fp8[moved] > 0 and bits[moved] == 0
    assert np.array_equal(np.delete(fp8, moved), np.delete(bits, moved))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), fine=st.sampled_from([32, 64, 128]), heads=st.sampled_from([1, 3]),
       density=st.sampled_from([0.05, 0.3, 0.8]), head_dim=st.sampled_from([64, 128]))
def test_the_candidate_counts_the_pooled_blocks_and_is_scored_by_the_16_bit_set(hopper, seed, fine, heads, density,
                                                                                head_dim):
    """The Gluon candidate (128 x 128, unmerged) visits the blocks of the mask pooled by hand, and its score is the
    16-bit coefficients on the features of those blocks; the plan picks it exactly when its score is best."""
    n = 1000 + seed % 700  # not a whole number of blocks
    blocks = -(-n // fine)
    mask = random_mask(seed, heads, blocks, density)
    plan = best_mask(mask, fine, fine, n, head_dim=head_dim, cost_model=CHEAP)
    (gluon,) = [c for c in plan.candidates if c.backend == "gluon"]
    factor = 128 // fine
    padded = torch.zeros(1, heads, -(-blocks // factor) * factor, -(-blocks // factor) * factor, dtype=torch.bool)
    padded[..., :blocks, :blocks] = mask
    pooled = padded.view(1, heads, -1, factor, padded.shape[-1] // factor, factor).any(5).any(3)
    assert (gluon.q_block, gluon.kv_block, gluon.merge) == (128, 128, "none") and gluon.tiles == int(pooled.sum())
    row = mask_gluon_features(int(pooled.sum()), seq_len=n, batch_heads=heads, head_dim=head_dim, element_bytes=2,
                              fp8=False)
    assert gluon.score == pytest.approx(float(row @ np.array([GLUON_16BIT[f] for f in GLUON_FEATURES])))
    # the rule of every mask plan: among candidates within the tie tolerance of the best score, the least host work
    # (no merge first, then coarser blocks, then natsim's Triton kernels)
    runnable = [c for c in plan.candidates if c.backend in plan.backends]  # FlashAttention-4: priced, not installed
    best = min(c.score for c in runnable)
    near = [c for c in runnable if c.score <= best * (1 + plan.tie_tolerance)]
    expected = min(near, key=lambda c: (MERGES.index(c.merge), -c.q_block * c.kv_block, c.backend != "triton"))
    assert plan.chosen == expected


def test_mask_plans_pick_it_when_cheapest_and_not_when_dearer_in_training_or_unpriced(hopper):
    mask = random_mask(2, 4, 64, 0.3)
    plan = best_mask(mask, 128, 128, 8192, cost_model=CHEAP)
    assert plan.backend == "gluon" and set(plan.breakdown) == set(GLUON_FEATURES) and not plan.training
    assert sum(plan.breakdown.values()) == pytest.approx(plan.score)  # the 16-bit coefficients, feature by feature
    assert best_mask(mask, 128, 128, 8192, cost_model=DEAR).backend == "triton"
    assert best_mask(mask, 128, 128, 8192, cost_model=FP8_ONLY).backend == "triton"
    training = best_mask(mask, 128, 128, 8192, cost_model=CHEAP, training=True)
    assert training.training and all(c.backend != "gluon" for c in training.candidates)
    with pytest.raises(ValueError, match=r"asks for natsim's Gluon kernel, but it has no backward pass, and "
                                         r"training=True plans for gradients"):
        best_mask(mask, 128, 128, 8192, cost_model=CHEAP, training=True, backends="gluon")
    with pytest.raises(ValueError, match=r"precision='fp8' is for inference .* training must be False"):
        best_mask(mask, 128, 128, 8192, cost_model=CHEAP, training=True, precision="fp8")
    with pytest.raises(TypeError, match=r"training must be a bool, got training='yes'"):
        best_mask(mask, 128, 128, 8192, cost_model=CHEAP, training="yes")
    with pytest.raises(ValueError, match=r"no candidate to score: natsim's Gluon kernel does not run this call: .*"
                                         r"head_dim=32"):
        best_mask(mask, 128, 128, 8192, cost_model=CHEAP, backends="gluon", head_dim=32)
    fine = random_mask(2, 4, 128, 0.3)  # 64-token blocks, kept at 64 only
    with pytest.raises(ValueError, match=r"runs 128 x 128 blocks unmerged only, which q_blocks=\(64,\), "
                                         r"kv_blocks=\(64,\) and merges leave out"):
        best_mask(fine, 64, 64, 8192, cost_model=CHEAP, backends="gluon", q_blocks=(64,), kv_blocks=(64,))


def test_training_plans_rank_flashattention_4_only_where_its_backward_is_priced_and_runs(hopper, monkeypatch):
    """In training, FlashAttention-4's candidates are exactly the blocks its backward runs (its rule restated by
    `fa4_mask_refusal(..., backward=True)`), and without its backward coefficients it is not ranked but noted."""
    from natsim.kernels.backends import fa4 as fa4_backend
    from natsim.planner.backends import fa4_mask_refusal

    monkeypatch.setattr(fa4_backend, "installed", lambda: None)
    monkeypatch.setattr(fa4_backend, "device_refusal", lambda device: None)
    assert CHEAP.has("fa4") and CHEAP.has("fa4-backward")
    mask = random_mask(7, 2, 64, 0.3)  # 16-token blocks over 1,024 tokens
    for head_dim in (64, 128):
        for training in (False, True):
            plan = best_mask(mask, 16, 16, 1024, head_dim=head_dim, cost_model=CHEAP, training=training)
            fa4 = {(c.q_block, c.kv_block) for c in plan.candidates if c.backend == "fa4"}
            expected = {(qb, kb) for qb in (16, 32, 64, 128) for kb in (16, 32, 64, 128)
                        if fa4_mask_refusal(qb, kb, head_dim, torch.bfloat16, backward=training) is None}
            assert fa4 == expected and fa4, (head_dim, training)
            assert ("gluon" in {c.backend for c in plan.candidates}) == (not training)
    unpriced = replace(CHEAP, fa4_backward_coefficients=None)
    plan = best_mask(mask, 16, 16, 1024, cost_model=unpriced, training=True)
    assert all(c.backend == "triton" for c in plan.candidates)
    assert "has no FlashAttention-4 backward coefficients" in dict(plan.backend_notes)["fa4"]
    assert any(c.backend == "fa4" for c in best_mask(mask, 16, 16, 1024, cost_model=unpriced).candidates)


def test_the_diffusers_masks_route_plans_for_training_when_it_trains(hopper):
    """`apply(..., masks=..., training=True)`'s attention plans each layout with training: never on the Gluon
    kernel, whatever its coefficients; in inference the same mask may go there."""
    from natsim.integrations.diffusers.masks import Masks, MaskedAttention

    mask = random_mask(8, 4, 64, 0.3)  # the predictor's 128-token blocks over 8,192 tokens
    q = torch.randn(1, 8192, 4, 128, dtype=torch.bfloat16)
    plans = {}
    for training in (False, True):
        attention = MaskedAttention(Masks(steps=4, block=128), training=training)
        attention.layout = (8, 32, 32)
        with pytest.MonkeyPatch.context() as patch:  # the stored H100 model, made cheap for the variant
            patch.setattr("natsim.integrations.diffusers.masks.best_mask",
                          lambda *args, **options: best_mask(*args, **options, cost_model=CHEAP))
            plans[training] = attention._plan(mask, q, torch.bfloat16)
    assert plans[False].backend == "gluon" and not plans[False].training
    assert plans[True].training and all(c.backend != "gluon" for c in plans[True].candidates)


def test_the_diffusers_masks_route_plans_on_the_backends_its_masks_name(hopper):
    """`Masks(backends=...)` narrows the route's plans (natsim's Triton kernels alone, say, against the same mask
    on the Gluon kernel); a name it does not know is refused with the planner's sentence when Masks is made."""
    from natsim.integrations.diffusers.masks import Masks, MaskedAttention

    mask = random_mask(9, 4, 64, 0.3)
    q = torch.randn(1, 8192, 4, 128, dtype=torch.bfloat16)
    picked = {}
    for backends in (None, "triton", ("triton", "gluon")):
        attention = MaskedAttention(Masks(steps=4, block=128, backends=backends))
        attention.layout = (8, 32, 32)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("natsim.integrations.diffusers.masks.best_mask",
                          lambda *args, **options: best_mask(*args, **options, cost_model=CHEAP))
            picked[backends] = attention._plan(mask, q, torch.bfloat16)
    assert picked[None].backend == picked["triton", "gluon"].backend == "gluon"
    assert picked["triton"].backend == "triton" and picked["triton"].backends == ("triton",)
    assert Masks(steps=4, backends="triton").backends == ("triton",)
    with pytest.raises(ValueError, match=r"backends must name one or more of \('triton', 'fa4', 'gluon'\)"):
        Masks(steps=4, backends=("cudnn",))


def test_the_calibration_cases_call_the_variant_in_16_bits(monkeypatch):
    """A 16-bit case's call names the Gluon kernel without FP8 (an FP8 case's, with it)."""
    import natsim.kernels as kernels
    from natsim.planner.cost.gluon_calibrate import GluonMaskCase

    seen = []
    monkeypatch.setattr(kernels, "sparse_attention", lambda q, k, v, work, **options: seen.append(options))
    for precision in (None, "fp8"):
        GluonMaskCase(512, 0.5, 64, heads=2, precision=precision).call(torch.bfloat16, torch.device("cpu"))()
    assert seen == [{"precision": None, "backend": "gluon"}, {"precision": "fp8", "backend": "gluon"}]


def test_the_report_names_the_16_bit_coefficients_and_json_keeps_training(hopper):
    from rich.console import Console

    mask = random_mask(3, 4, 64, 0.3)
    plan = best_mask(mask, 128, 128, 8192, cost_model=CHEAP)
    assert plan.backend == "gluon"
    console = Console(record=True, width=200)
    console.print(plan.explain())
    assert "Gluon 16-bit coefficients" in console.export_text()
    for made in (plan, best_mask(mask, 128, 128, 8192, cost_model=CHEAP, training=True)):
        again = MaskPlan.from_json(made.to_json())
        assert again == made and again.training == made.training
    record = plan.to_dict()
    with pytest.raises(ValueError, match=r"training must be true or false, got training='no'"):
        MaskPlan.from_dict({**record, "training": "no"})
    del record["training"]
    assert MaskPlan.from_dict(record).training is False  # plans written before training plans
    with pytest.raises(ValueError, match=r"training=true with backend='gluon'"):
        MaskPlan.from_dict({**record, "training": True})
    triton = best_mask(mask, 128, 128, 8192, cost_model=CHEAP, backends="triton").to_dict()
    with pytest.raises(ValueError, match=r"training=true with precision='fp8'"):
        MaskPlan.from_dict({**triton, "training": True, "precision": "fp8"})


def test_a_16_bit_gluon_plan_runs_like_float64_attention_and_refuses_gradients(hopper):
    mask = random_mask(4, 2, 16, 0.3)  # 64-token blocks over 1000 tokens, pooled to 128
    n = 1000
    plan = best_mask(mask, 64, 64, n, head_dim=64, cost_model=CHEAP, backends="gluon")
    assert plan.backend == "gluon" and (plan.q_block, plan.kv_block) == (128, 128)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    reference = float64_under_pooled(q, k, v, plan.mask, 128)
    for out in (plan(q, k, v), plan(q, k, v, mask=mask)):
        assert out.dtype == torch.bfloat16
        assert float((out.double() - reference).norm() / reference.norm()) < 1e-2
    q.requires_grad_(True)
    with pytest.raises(ValueError, match=r"in 16 bits, which has no backward pass, and an input requires grad: plan "
                                         r"for gradients \(best_mask\(\.\.\., training=True\)"):
        plan(q, k, v)
    with torch.no_grad():
        assert torch.equal(plan(q, k, v), plan(q.detach(), k, v))


def test_the_calibration_cases_run_on_the_variant_and_determine_its_predictions():
    """Every case runs on the 16-bit variant, and the cases' features determine what the fit predicts: synthetic
    times from known coefficients, fitted, predict other masks (sizes, densities, both head dims) as the known
    coefficients do. (The coefficients themselves are not unique: at head_dim 64 and 128, the only widths the
    kernel runs, `flops + narrow_head_flops` is proportional to `blocks`.)"""
    assert check_kernels(["gluon-16bit", "gna"]) == ("gna", "gluon-16bit")
    cases = gluon_16bit_calibration_cases()
    assert all(case.precision is None and case.refusal() is None for case in cases)
    assert {case.head_dim for case in cases} == {64, 128} and len({case.seq_len for case in cases}) >= 3
    matrix = np.stack([case.features(torch.bfloat16) for case in cases])
    assert np.isfinite(matrix).all() and not matrix[:, GLUON_FEATURES.index("moved_bytes")].any()
    truth = np.array([{**GLUON_16BIT, "narrow_head_flops": 1e-16}[name] for name in GLUON_FEATURES])
    fitted = fit_coefficients(matrix, matrix @ truth, GLUON_FEATURES)
    vector = np.array([fitted[name] for name in GLUON_FEATURES])
    others = np.stack([mask_gluon_features(visited, seq_len=n, batch_heads=heads, head_dim=head_dim,
                                           element_bytes=2, fp8=False)
                       for n, visited, heads, head_dim in ((5000, 300, 3, 64), (20000, 9000, 8, 128),
                                                           (70000, 2e5, 2, 128), (1000, 10, 1, 64))])
    assert np.allclose(others @ vector, others @ truth, rtol=1e-6)


def test_the_cost_model_keeps_and_names_its_16_bit_set(tmp_path):
    loaded = CostModel.load(CHEAP.save(tmp_path / "m.json"))
    assert loaded.has("gluon-16bit") and loaded.gluon_16bit_coefficients == GLUON_16BIT
    assert not FP8_ONLY.has("gluon-16bit") and FP8_ONLY.has("gluon-fp8")
    with pytest.raises(ValueError, match=r"has no Gluon 16-bit coefficients; run `natsim calibrate --kernels "
                                         r"gna,gluon-16bit`"):
        FP8_ONLY.predict_gluon(np.zeros(len(GLUON_FEATURES)), None)


def test_its_calls_are_floored_at_the_variants_own_host_time(hopper):
    """A 16-bit Gluon candidate takes at least the variant's host time ("gluon-16bit", measured on a mask call),
    not the FP8 route's ("gluon", which quantizes): on a tiny mask the first decides against natsim's Triton
    kernels, the second would not."""
    assert host_call("gluon", None) == "gluon-16bit" and host_call("gluon", "fp8") == "gluon"
    assert host_call("triton", None) == "triton"
    mask = random_mask(6, 2, 4, 0.5)
    quick = {**GLUON_16BIT, "launch": 1e-6}
    hosted = replace(CHEAP, gluon_16bit_coefficients=quick,
                     host_seconds={"triton": 5e-5, "gluon": 1e-2, "gluon-16bit": 3e-5})
    plan = best_mask(mask, 128, 128, 512, cost_model=hosted)
    (gluon,) = [c for c in plan.candidates if c.backend == "gluon"]
    row = mask_gluon_features(int(mask.sum()), seq_len=512, batch_heads=2, head_dim=128, element_bytes=2, fp8=False)
    kernel = float(row @ np.array([quick[f] for f in GLUON_FEATURES]))
    assert gluon.score == pytest.approx(max(kernel, 3e-5)) and plan.backend == "gluon"
    slow = replace(hosted, host_seconds={**hosted.host_seconds, "gluon-16bit": 1e-2})
    assert best_mask(mask, 128, 128, 512, cost_model=slow).backend == "triton"


def test_a_model_without_the_variants_host_time_floors_it_at_the_fp8_routes():
    """Without a "gluon-16bit" host time (a file calibrated before the variant, given by path) the variant takes the
    FP8 route's, an upper bound (that route issues the same launch and its quantization), never 0."""
    older = replace(CHEAP, host_seconds={"triton": 5e-5, "gluon": 8e-4})
    assert older.host("gluon-16bit") == 8e-4 and older.host("triton") == 5e-5
    assert replace(CHEAP, host_seconds={"gluon": 8e-4, "gluon-16bit": 4e-4}).host("gluon-16bit") == 4e-4
    assert replace(CHEAP, host_seconds=None).host("gluon-16bit") == 0.0


def test_its_host_time_is_measured_on_hopper_only():
    assert "natsim's Gluon kernel runs on Hopper GPUs" in host_refusal("gluon-16bit", torch.device("cpu"))
