"""The mask planner (natsim.planner.best_mask, MaskPlan) and `natsim mask`: OR-pooling against a brute-force
pooling, candidate figures against natsim.merge, the chosen plan against the sparse reference of the pooled
mask (Triton interpreter, tiny shapes), JSON round trips, the CLI on saved .pt and .npz masks, bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

import natsim
import natsim.masks
from natsim.cli.main import app
from natsim.kernels import SparseMask, sparse_reference
from natsim.planner import MaskPlan, best_mask, cost_model_for, or_pool
from natsim.planner.search.mask import BLOCKS, token_density

runner = CliRunner()


def brute_pool(mask: np.ndarray, fq: int, fk: int) -> np.ndarray:
    """OR-pooling by loops: coarse (i, j) is True when any fine (a, b) with a // fq == i, b // fk == j is."""
    b, h, nq, nk = mask.shape
    out = np.zeros((b, h, -(-nq // fq), -(-nk // fk)), dtype=bool)
    for bi, hi, a, c in zip(*np.nonzero(mask)):
        out[bi, hi, a // fq, c // fk] = True
    return out


def token_mask(mask: np.ndarray, q_block: int, kv_block: int, n: int) -> np.ndarray:
    """The element mask `[B, H, N, N]` of a block mask."""
    rows, cols = np.arange(n) // q_block, np.arange(n) // kv_block
    return mask[:, :, rows][:, :, :, cols]


@st.composite
def masks(draw, max_blocks: int = 12):
    heads = draw(st.integers(1, 3))
    nq, nk = draw(st.integers(1, max_blocks)), draw(st.integers(1, max_blocks))
    density = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**31 - 1))
    return np.random.default_rng(seed).random((1, heads, nq, nk)) < density


@settings(max_examples=60, deadline=None)
@given(mask=masks(), fq=st.sampled_from([1, 2, 4, 8]), fk=st.sampled_from([1, 2, 4, 8]))
def test_or_pooling_is_the_brute_force_pooling_and_never_drops_a_kept_block(mask, fq, fk):
    pooled = or_pool(torch.from_numpy(mask), fq, fk).numpy()
    assert np.array_equal(pooled, brute_pool(mask, fq, fk))
    a, c = np.nonzero(mask[0, 0])
    assert pooled[0, 0, a // fq, c // fk].all()  # every kept fine block lies in a kept coarse block


@settings(max_examples=15, deadline=None)
@given(mask=masks(max_blocks=10), n_cut=st.integers(0, 15), fine=st.sampled_from([(16, 16), (16, 32), (32, 16)]))
def test_every_candidate_is_a_superset_with_exact_density_and_tiles_that_natsim_merge_predicts(mask, n_cut, fine):
    q_block, kv_block = fine
    nq, nk = mask.shape[2:]
    n = max(min(nq * q_block, nk * kv_block) - n_cut, 1)  # N need not be a multiple of a block
    nq, nk = -(-n // q_block), -(-n // kv_block)
    mask = mask[:, :, :nq, :nk]
    plan = best_mask(mask, q_block, kv_block, n, head_dim=64, dtype="fp16", keep_mask=False)
    fine_tokens = token_mask(mask, q_block, kv_block, n)
    for c in plan.candidates:
        coarse = brute_pool(mask, c.q_block // q_block, c.kv_block // kv_block)
        tokens = token_mask(coarse, c.q_block, c.kv_block, n)
        assert (tokens | ~fine_tokens).all()  # nothing the predictor kept is dropped
        assert c.density == pytest.approx(tokens.mean(), abs=1e-12)
        per_tile = c.block_n // c.kv_block
        expected = 0
        for h in range(mask.shape[1]):
            if c.merge == "none":
                expected += int(sum(-(-int(row.sum()) // per_tile) for row in coarse[0, h]))
            else:
                result = natsim.merge(coarse[0, h], c.block_m // c.q_block, c.merge)
                expected += int(sum(-(-int(u) // per_tile) for u in result.merged.visited))
        assert c.tiles == expected, c
        assert c.work == pytest.approx(c.tiles * c.block_m * c.block_n / (mask.shape[1] * n * n))
    own = [c for c in plan.candidates if (c.q_block, c.kv_block) == fine]
    assert len(own) == 3 and all(c.density == pytest.approx(fine_tokens.mean(), abs=1e-12) for c in own)
    assert token_density(torch.from_numpy(mask), q_block, kv_block, n) == pytest.approx(fine_tokens.mean())


def test_the_winner_is_the_best_score_or_a_tie_needing_less_host_work():
    rng = np.random.default_rng(3)
    mask = rng.random((1, 4, 40, 40)) < 0.15
    unhosted = replace(cost_model_for("NVIDIA H100 80GB HBM3"), host_seconds=None)  # the kernels' predictions alone
    plan = best_mask(mask, 16, 16, 640, cost_model=unhosted)
    scores = [c.score for c in plan.candidates]
    assert scores == sorted(scores) and plan.calibrated
    # the winner runs here: FlashAttention-4's candidates are priced (for what it would gain), not picked
    runnable = [c.score for c in plan.candidates if c.backend in plan.backends]
    assert plan.backend in plan.backends and plan.score <= runnable[0] * (1 + plan.tie_tolerance)
    assert plan.chosen.score == plan.score and plan.predicted_time_s == plan.score
    assert plan.predicted_speedup == pytest.approx(plan.dense_score / plan.score)
    assert sum(plan.breakdown.values()) == pytest.approx(plan.score)
    merges = {c.merge for c in plan.candidates}
    assert merges == {"none", "consecutive", "xor"}
    assert all(c.merge == "none" for c in plan.candidates if c.q_block == 128)
    assert {(c.q_block, c.kv_block) for c in plan.candidates} == {(q, k) for q in BLOCKS for k in BLOCKS}


@pytest.mark.parametrize("basis_device", [None, "h100"])
def test_plan_json_round_trip(basis_device):
    mask = np.random.default_rng(0).random((1, 2, 9, 9)) < 0.3
    plan = best_mask(mask, 16, 16, 140, heads=2, head_dim=32, dtype="fp16", device=basis_device)
    again = MaskPlan.from_json(plan.to_json())
    assert again == plan and again.mask is None and plan.mask is not None
    assert json.loads(again.to_json()) == json.loads(plan.to_json())
    assert again.basis == ("cost model" if basis_device else "simulated tiles")
    text = str(plan.explain().renderables[0])
    assert f"run at {plan.q_block} x {plan.kv_block} blocks, merge {plan.merge}" in text


def test_plan_json_errors_are_sentences():
    with pytest.raises(ValueError, match="parsing failed at line 1"):
        MaskPlan.from_json("{not json")
    with pytest.raises(ValueError, match="format 'natsim-mask-plan/1'"):
        MaskPlan.from_json(json.dumps({"format": "natsim-plan/1"}))
    plan = best_mask(np.ones((1, 1, 2, 2), bool), 16, 16, 32, head_dim=32)
    data = plan.to_dict()
    del data["candidates"]
    with pytest.raises(ValueError, match="'candidates'"):
        MaskPlan.from_dict(data)
    data = plan.to_dict()
    data["q_block"] = 8  # not a block that was scored
    with pytest.raises(ValueError, match="not among its candidates"):
        MaskPlan.from_dict(data)


@pytest.mark.parametrize("q_block, kv_block, merge", [(16, 16, "none"), (32, 64, "xor"), (16, 32, "consecutive")])
def test_the_plan_runs_the_pooled_mask_like_the_reference(q_block, kv_block, merge):
    torch.manual_seed(0)
    n, heads = 150, 2
    q, k, v = (torch.randn(1, n, heads, 32, dtype=torch.float16) for _ in range(3))
    fine = natsim.masks.topp(q, k, 16, 16, 0.6)
    plan = best_mask(fine, 16, 16, n, head_dim=32, dtype="fp16", q_blocks=[q_block], kv_blocks=[kv_block],
                     merges=[merge])
    assert (plan.q_block, plan.kv_block, plan.merge) == (q_block, kv_block, merge)
    pooled = torch.from_numpy(brute_pool(fine.numpy(), q_block // 16, kv_block // 16))
    assert torch.equal(plan.mask, pooled)
    expected = sparse_reference(q.double(), k.double(), v.double(), pooled, q_block, kv_block)
    out = plan(q, k, v)
    assert (out.double() - expected).norm() / expected.norm() < 5e-3
    work = plan.prepared("cpu")  # the host work of the plan's own mask is prepared once and kept
    assert plan.prepared(torch.device("cpu")) is work and (work.q_block, work.kv_block) == (q_block, kv_block)

    # A plan read back from JSON runs the next mask it is given, pooled the same way.
    other = natsim.masks.topp(q, k, 16, 16, 0.3)
    again = MaskPlan.from_json(plan.to_json())
    with pytest.raises(ValueError, match="holds no mask"):
        again(q, k, v)
    expected = sparse_reference(q.double(), k.double(), v.double(),
                                torch.from_numpy(brute_pool(other.numpy(), q_block // 16, kv_block // 16)),
                                q_block, kv_block)
    out = again(q, k, v, mask=SparseMask.from_dense(other, 16, 16, n))
    assert (out.double() - expected).norm() / expected.norm() < 5e-3
    assert torch.equal(again.with_mask(other).mask, again.pool(other))


def test_bad_input_is_refused_with_sentences():
    good = np.ones((1, 2, 4, 4), bool)
    cases = [
        (dict(mask=good.astype(np.int8), q_block=16, kv_block=16, seq_len=64), ValueError, "boolean array"),
        (dict(mask=[[True]], q_block=16, kv_block=16, seq_len=16), TypeError, "got a list"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=100), ValueError, r"\[\*, \*, 7, 7\]"),
        (dict(mask=good, q_block=16, kv_block=16), ValueError, "seq_len must be given"),
        (dict(mask=good, q_block=12, kv_block=16, seq_len=64), ValueError, "q_block must be a power of two"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, heads=3), ValueError, "heads must be 1 or the call's"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, head_dim=20), ValueError, "head_dim must be one"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, head_dim=16, precision="fp8"), ValueError,
         "the FP8 kernel .precision='fp8'. supports head_dim 24 to 256"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, dtype="fp32"), ValueError, "dtype must be one"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, merges=["zip"]), ValueError, "merges must be"),
        (dict(mask=good, q_block=32, kv_block=32, seq_len=128, q_blocks=[16]), ValueError, "q_blocks must be"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, q_blocks=[128], merges=["xor"]), ValueError,
         "no candidate"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, cost_model="h100"), ValueError,
         "cost_model='h100' names no file"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, cost_model=3), TypeError, "cost_model must be"),
        (dict(mask=good, q_block=16, kv_block=16, seq_len=64, device="h100-nvl"), ValueError,
         "names NVIDIA H100 NVL, which has no cost-model coefficients here"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            best_mask(**kwargs)
    sparse = SparseMask.from_dense(torch.ones(1, 1, 4, 4, dtype=torch.bool), 16, 16, 64)
    with pytest.raises(ValueError, match="q_block must match the SparseMask's q_block=16"):
        best_mask(sparse, 32)
    with pytest.raises(ValueError, match="q_factor must be a positive int"):
        or_pool(torch.ones(1, 1, 2, 2, dtype=torch.bool), 0, 1)


# -- the CLI --------------------------------------------------------------------------------------------------


def test_cli_scores_a_saved_pt_and_npz_mask(tmp_path):
    mask = np.random.default_rng(1).random((2, 12, 12)) < 0.25
    torch.save({"mask": torch.from_numpy(mask), "q_block": 16, "kv_block": 16, "seq_len": 190}, tmp_path / "m.pt")
    np.savez(tmp_path / "m.npz", mask=mask[None], q_block=16, kv_block=16, seq_len=190)
    expected = best_mask(mask[None], 16, 16, 190, device="h100")
    for name in ("m.pt", "m.npz"):
        result = runner.invoke(app, ["mask", str(tmp_path / name), "--device", "h100", "--json"])
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        measured = {"merge_s"}  # host time, measured anew
        assert [{k: v for k, v in c.items() if k not in measured} for c in record["candidates"]] == \
            [{k: v for k, v in c.to_dict().items() if k not in measured} for c in expected.candidates]
        assert (record["q_block"], record["kv_block"], record["merge"]) == \
            (expected.q_block, expected.kv_block, expected.merge)
    result = runner.invoke(app, ["mask", str(tmp_path / "m.npz"), "--device", "h100", "--merges", "none"])
    assert result.exit_code == 0, result.output
    assert "predicted ms" in result.stdout and "consecutive" not in result.stdout
    assert "chosen: " in result.stdout and "over dense" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert len(lines) == len(BLOCKS) ** 2
    training = runner.invoke(app, ["mask", str(tmp_path / "m.pt"), "--device", "h100", "--json", "--training"])
    assert training.exit_code == 0, training.output
    assert json.loads(training.stdout)["training"] is True and record["training"] is False


def test_cli_takes_a_bare_tensor_with_blocks_on_the_command_line(tmp_path):
    torch.save(torch.ones(4, 4, dtype=torch.bool), tmp_path / "full.pt")
    result = runner.invoke(app, ["mask", str(tmp_path / "full.pt"), "--q-block", "32", "--kv-block", "32", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["seq_len"] == 128 and record["basis"] == "simulated tiles"
    assert all(c["density"] == 1.0 for c in record["candidates"])


def test_cli_reads_one_unnamed_array_beside_its_sizes_and_writes_strict_json(tmp_path):
    """An .npz of one array and the three scalars (`np.savez(f, mask, q_block=..., ...)`) is a mask file; an empty
    mask's plan (no work, an infinite speedup in tile work) is still strict JSON."""
    np.savez(tmp_path / "one.npz", np.zeros((1, 1, 10, 10), bool), q_block=16, kv_block=16, seq_len=150)
    result = runner.invoke(app, ["mask", str(tmp_path / "one.npz"), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert record["seq_len"] == 150 and record["fine_q_block"] == 16 and record["predicted_speedup"] is None


@pytest.mark.parametrize("content, name, message", [
    (None, "missing.pt", "does not exist"),
    (b"not a zip", "broken.npz", "could not be read"),
    (b"x", "mask.txt", "must be a .pt (torch.save) or .npz"),
    ("float", "float.pt", "the mask must be a boolean tensor, got dtype torch.float32"),
    ("nokey", "nokey.npz", "with the key 'mask'"),
    ("5d", "5d.pt", "must be [nQ, nKV], [heads, nQ, nKV] or [batch, heads, nQ, nKV]"),
    ("rows", "rows.pt", "must be [batch or 1, heads or 1"),
    ("numpy", "numpy.pt", "could not be read: UnpicklingError: Weights only load failed."),  # torch's many lines
])
def test_cli_bad_files_are_one_red_line_and_exit_2(tmp_path, content, name, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "float":
        torch.save(torch.zeros(3, 3), path)
    elif content == "nokey":
        np.savez(path, a=np.ones((2, 2), bool), b=np.ones(2))
    elif content == "5d":
        torch.save(torch.ones(1, 1, 1, 2, 2, dtype=torch.bool), path)
    elif content == "rows":
        torch.save({"mask": torch.ones(3, 5, dtype=torch.bool), "q_block": 16, "kv_block": 16}, path)
    elif content == "numpy":
        torch.save({"mask": np.ones((2, 2), bool)}, path)
    result = runner.invoke(app, ["mask", str(path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert message in " ".join(result.stderr.split())


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["none", "consecutive", "xor"])
def test_gpu_plans_run_the_pooled_mask_like_the_reference(merge):
    torch.manual_seed(0)
    n, heads = 3000, 4
    q, k, v = (torch.randn(1, n, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fine = natsim.masks.topp(q, k, 16, 16, 0.7)
    assert best_mask(fine, 16, 16, n, device="h100").calibrated
    for q_block, kv_block in ((16, 16), (32, 128), (64, 32)):
        plan = best_mask(fine, 16, 16, n, q_blocks=[q_block], kv_blocks=[kv_block], merges=[merge])
        expected = sparse_reference(q, k, v, plan.mask, q_block, kv_block)
        for out in (plan(q, k, v), plan(q, k, v, mask=fine)):
            assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() < 1e-2
