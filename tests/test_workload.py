"""The synthetic video-attention workload (benchmarks/workload.py): shapes and seeding, the 3-D rotary
embedding against its defining property, normalised smooth fields, and attention that is local, has sharp and
soft heads, and gives its global tokens weight (small CPU layouts); benchmark scripts' small CPU runs, and the
kernel breakdown of benchmarks/timing.py; the SASS loop count of benchmarks/sass_gluon.py; headdim.py's copy into aligned rows."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    """A benchmark script as a module (its sibling imports, such as `timing`, resolve from benchmarks/)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


workload = load("workload")


def attention(w):
    q, k = w.q.double(), w.k.double()
    return torch.softmax(torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(q.shape[-1]), dim=-1)


def test_shapes_dtype_and_seeding():
    w = workload.video_qkv("small", head_dim=64, dtype=torch.float16, seed=3)
    n = math.prod(workload.LAYOUTS["small"])
    assert w.q.shape == w.k.shape == w.v.shape == (1, n, workload.HEADS["small"], 64)
    assert w.q.dtype == torch.float16 and torch.isfinite(w.q).all() and torch.isfinite(w.k).all()
    again = workload.video_qkv("small", head_dim=64, dtype=torch.float16, seed=3)
    other = workload.video_qkv("small", head_dim=64, dtype=torch.float16, seed=4)
    assert torch.equal(w.q, again.q) and torch.equal(w.k, again.k) and torch.equal(w.v, again.v)
    assert not torch.equal(w.q, other.q)
    assert w.global_tokens.numel() == 4 and w.temperature.shape == (2,)
    assert ((w.temperature >= 0.5) & (w.temperature <= 3.0)).all()
    with pytest.raises(ValueError, match="shape must be one of"):
        workload.video_qkv("4k")
    with pytest.raises(ValueError, match="head_dim must be even"):
        workload.video_qkv((2, 2, 2), 1, 5)


def test_rope_3d_scores_depend_on_the_offset_only_and_keep_norms():
    shape = (3, 4, 5)
    n = math.prod(shape)
    x = torch.randn(1, 1, 1, 24, dtype=torch.float64).expand(1, n, 1, 24)
    y = torch.randn(1, 1, 1, 24, dtype=torch.float64).expand(1, n, 1, 24)
    rx, ry = workload.rope_3d(x, shape), workload.rope_3d(y, shape)
    assert torch.allclose(rx.norm(dim=-1), x.norm(dim=-1))
    coords = torch.stack(torch.meshgrid(*(torch.arange(s) for s in shape), indexing="ij")).reshape(3, -1).T
    index = {tuple(c.tolist()): i for i, c in enumerate(coords)}
    score = lambda a, b: float(rx[0, index[a], 0] @ ry[0, index[b], 0])  # noqa: E731
    assert score((0, 0, 0), (1, 2, 3)) == pytest.approx(score((1, 1, 1), (2, 3, 4)), abs=1e-5)  # angles in float32
    assert score((2, 3, 4), (0, 0, 1)) == pytest.approx(score((2, 3, 3), (0, 0, 0)), abs=1e-5)  # angles in float32
    assert score((0, 0, 0), (1, 0, 0)) != pytest.approx(score((0, 0, 0), (0, 1, 0)), abs=1e-3)


def test_smooth_fields_are_normalised_and_smooth():
    g = torch.Generator().manual_seed(0)
    field = workload.smooth_field(8, (4, 10, 12), (1.0, 3.0, 3.0), g, "cpu").view(4, 10, 12, 8)
    assert torch.allclose(field.reshape(-1, 8).mean(0), torch.zeros(8), atol=1e-5)
    assert torch.allclose(field.reshape(-1, 8).std(0), torch.ones(8), atol=1e-5)
    near = (field[:, :, 1:] * field[:, :, :-1]).mean()  # correlation of width neighbours
    far = (field[:, :, 6:] * field[:, :, :-6]).mean()
    assert near > 0.8 and far < near - 0.3


def test_attention_is_local_has_sharp_and_soft_heads_and_global_tokens():
    w = workload.video_qkv((4, 8, 12), 4, 64, dtype=torch.float32, seed=1)
    p = attention(w)[0]  # [H, N, N]
    n = p.shape[-1]
    coords = torch.stack(torch.meshgrid(*(torch.arange(s) for s in w.shape), indexing="ij")).reshape(3, -1).T
    distance = (coords[:, None, :] - coords[None, :, :]).abs().max(-1).values
    near = (distance <= 2).double()
    local_mass = (p * near).sum(-1).mean(-1)  # per head
    uniform = near.sum(-1).mean() / n
    assert (local_mass > 2 * uniform).all()
    # sharper heads (larger temperature) concentrate more mass in their top 5% of keys
    top = p.sort(-1, descending=True).values[..., : n // 20].sum(-1).mean(-1)
    order = torch.argsort(w.temperature)
    assert top[order[-1]] > top[order[0]]
    per_global = p[..., w.global_tokens].mean()
    assert per_global > 5.0 / n


def test_masks_benchmark_small_run_gives_sane_numbers(reference_path, tmp_path, capsys):
    record = load("masks").main(["--small", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "masks_small.json").read_text()) == json.loads(json.dumps(record))
    assert {"device", "torch", "triton", "date"} <= set(record) and record["device"] == "cpu"
    (layout,) = record["layouts"]
    rows = layout["rows"]
    assert {r["predictor"] for r in rows} == {"topp", "sparge", "hierarchical", "gna_topp"}
    assert len(rows) == 4 * len(record["densities"])
    assert any(r["density"] == 1.0 for r in rows)
    for r in rows:
        assert 0.0 <= r["density"] <= 1.0 and 0.0 <= r["recall"] <= r["recall_run"] + 1e-9 <= 1.0 + 1e-6
        assert r["density"] <= r["density_run"] + 1e-12  # the plan pools: it never drops a block
        assert math.isfinite(r["error"]) and r["error"] >= 0.0
        assert r["kernel_ms"] > 0 and r["predictor_ms"] > 0 and r["sdpa_ms"] > 0
        assert r["speedup_end_to_end"] <= r["speedup_kernel"]
        if r["density"] == pytest.approx(1.0, abs=1e-12):  # everything kept: the exact mass, the dense output
            assert r["recall"] == pytest.approx(1.0, abs=1e-5) and r["error"] < 1e-5
        if r["target_density"] == 1.0:  # the knob at its top (topp drops only blocks of float32 probability 0)
            assert r["recall"] > 0.999 and r["density"] > 0.9
    for name in ("topp", "gna_topp"):
        mine = sorted((r for r in rows if r["predictor"] == name), key=lambda r: r["density"])
        assert all(a["recall"] <= b["recall"] + 1e-9 for a, b in zip(mine, mine[1:]))
    assert layout["sdpa_error"] < 1e-5  # SDPA (math, fp32) against the exact fp32 attention
    out = capsys.readouterr().out
    assert "kernel x" in out and "e2e x" in out


def test_diffusers_masks_benchmark_small_run(tmp_path, capsys):
    """benchmarks/diffusers_masks.py --small: one masked run per set of backends after the model's own run, each
    with its plans' backends named (on the CPU natsim's Triton kernels, whichever set)."""
    pytest.importorskip("diffusers")
    load("diffusers_masks").main(["--small", "--eager", "--steps", "4", "--out", str(tmp_path),
                                  "--backends", "all;triton"])
    records = json.loads(next(tmp_path.glob("diffusers-masks-wan-720p-cpu-*.json")).read_text())["records"]
    assert [record["backends"] for record in records] == ["all", ["triton"]]
    for record in records:
        assert len(record["own_step_ms"]) == len(record["masked_step_ms"]) == 4 and record["dense_steps"] == 1
        assert record["calls"] == 4 * 2 and record["dense_calls"] == 2  # two layers; step 0 is the dense warm-up
        assert math.isfinite(record["final_latent_relative_difference"])
        assert record["final_latent_relative_difference"] < 0.5
        assert record["plans"] and all(plan["backend"] == "triton" for plan in record["plans"])
    assert records[0]["own_step_ms"] == records[1]["own_step_ms"]  # one run of the model's own attention
    assert capsys.readouterr().out.count("first sparse step") == 2


def test_diffusers_fp8_benchmark_small_run(reference_path, tmp_path, capsys):
    """benchmarks/diffusers_fp8.py --small: three runs per case from one noise, FP8 close to bf16 but not equal
    (FP8 ran), the plans of the FP8 run made for FP8, the attention timed alone and its share of each step."""
    pytest.importorskip("diffusers")
    load("diffusers_fp8").main(["--small", "--steps", "2", "--cases", "wan-480p", "--out", str(tmp_path)])
    (record,) = json.loads(next(tmp_path.glob("diffusers-fp8-cpu-*.json")).read_text())["records"]
    assert set(record["step_ms"]) == {"own", "natsim_bf16", "natsim_fp8"}
    assert 0.0 < record["fp8_vs_bf16"]["relative_difference"] < 0.05 and record["fp8_vs_bf16"]["cosine"] > 0.99
    assert all(plan["precision"] == "fp8" for plan in record["natsim_fp8_plans"])
    assert all(plan["precision"] is None for plan in record["natsim_bf16_plans"])
    for key in ("attention_ms", "attention_share"):
        assert set(record[key]) == set(record["step_ms"]) and all(value > 0 for value in record[key].values())
    assert all(share <= 1.0 for share in record["attention_share"].values())
    assert "fp8 vs bf16" in capsys.readouterr().out


def test_training_benchmark_small_run(reference_path, tmp_path, capsys):
    """benchmarks/training.py --small: every row of every case is in the JSON, timed with finite numbers and
    checked against the float32 reference, or refused / unsupported with its reason (Flex has no backward on
    the CPU; a prepared mask may not run under autograd)."""
    training = load("training")
    record = training.main([str(tmp_path), "--small"])
    saved = json.loads(Path(record["path"]).read_text())
    assert {"device", "torch", "triton", "date"} <= set(saved) and saved["device"] == "cpu"
    rows = saved["rows"]
    masks = 2 * len(training.SPARSITIES) + 3  # random128, random64, gna, merged16, predicted
    fine = len(training.SPARSITIES) + 2  # masks of blocks under 128 tokens (random64, merged16, predicted)
    problems = 2  # --small's GNA layout has the random cases' N and joins their problem; the workload's
    # per mask flex, natsim, natsim-prepared; per fine mask flex-128; per problem sdpa; natsim-gna
    assert len(rows) == 3 * masks + fine + problems + 1
    assert {r["case"] for r in rows if r["kernel"] == "natsim"} == set(training.CASES)
    for r in rows:
        if r["kernel"] in ("natsim", "natsim-gna", "sdpa"):
            assert r["status"] == "ok", r
        if r["status"] != "ok":
            assert r["status"] in ("refused", "unsupported") and r["reason"], r
            continue
        assert set(r["ms"]) == set(training.PHASES)
        for phase in training.PHASES:
            assert math.isfinite(r["ms"][phase]) and r["ms"][phase] > 0
            assert len(r["rounds_ms"][phase]) == saved["rounds"]
            assert math.isfinite(r["tflops"][phase]) and r["tflops"][phase] > 0
        assert 0 < r["density"] <= 1 and math.isfinite(r["sdpa_step_over_step"])
        if r["kernel"] != "sdpa":
            assert r["grad_err_vs_fp32"] < training.GRAD_TOLERANCE and r["out_err_vs_fp32"] < training.OUT_TOLERANCE
    assert "ours/Flex" in capsys.readouterr().out


def test_training_benchmark_relates_natsim_to_flex(reference_path, tmp_path):
    """With a CPU stand-in for FlexAttention (SDPA under the BlockMask's element mask; Flex itself has no CPU
    backward), the Flex rows are timed and checked, and the natsim rows get ours / Flex ratios and their
    gradient error against Flex's."""
    training = load("training")

    def under_block_mask(q, k, v, block_mask):
        q_block, kv_block = block_mask.BLOCK_SIZE
        n = q.shape[1]
        allowed = block_mask.to_dense().bool().repeat_interleave(q_block, 2)[:, :, :n]
        allowed = allowed.repeat_interleave(kv_block, 3)[..., :n]
        out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                               attn_mask=allowed)
        return out.transpose(1, 2)

    class StandIn(training.Flex):
        def __init__(self, device):
            super().__init__(device)
            self.attend = under_block_mask

    training.Flex = StandIn
    rows = training.main([str(tmp_path), "--small", "--cases", "random64"])["rows"]
    assert [r["kernel"] for r in rows].count("flex") == len(training.SPARSITIES)
    for r in rows:
        if r["kernel"] == "flex":
            assert r["status"] == "ok" and r["grad_err_vs_fp32"] < training.GRAD_TOLERANCE
        if r["kernel"] == "natsim":
            assert r["grad_err_vs_flex"] < training.GRAD_TOLERANCE
            assert all(math.isfinite(r["ours_over_flex"][p]) for p in training.PHASES)


def test_training_benchmark_reference_gradients():
    """The benchmark's chunked float32 reference (FlashAttention's backward written out) against autograd
    through natsim's sparse reference, in float64, on a mask with a query block that attends nothing."""
    training = load("training")
    from natsim.kernels import sparse_reference

    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 100, 2, 16, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.rand(1, 2, 7, 7, generator=g) < 0.4
    mask[0, 1, 3] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_reference(*leaves, mask, 16, 16)
    want = (out, *torch.autograd.grad(out, leaves, grad))
    got = training.block_reference(q, k, v, grad, mask, 16, chunk=24)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_predict_parallel_prices_the_measured_steps_with_the_shipped_links(tmp_path, capsys):
    """benchmarks/predict_parallel.py on the committed Wan 720p steps of 1, 2 and 4 H200s (natsim's transfers on
    their high-priority twin): it finds natsim's shipped links and predicts each measured step within 10%, and 8
    GPUs with the 12 heads padded to 16 (between 4 GPUs' and an eighth of one GPU's step). Without a measured link
    it stops with a sentence."""
    predict = load("predict_parallel")
    results = BENCHMARKS / "results"
    predict.main(["--out", str(tmp_path), "--results", str(results), "--tag=-twin"])
    rows = json.loads(next(tmp_path.glob("predict-parallel-*-twin.json")).read_text())["rows"]
    measured = {r["ranks"]: r for r in rows if r["measured_ms"] is not None}
    assert set(measured) == {1, 2, 4} and all(abs(r["error"]) < 0.1 for r in measured.values())
    assert all("calibrate_link" in measured[p]["link"] for p in (2, 4))
    (eight,) = [r for r in rows if r["ranks"] == 8]
    assert measured[1]["predicted_ms"] / 8 < eight["predicted_ms"] < measured[4]["predicted_ms"]
    with pytest.raises(SystemExit, match="no measured interconnect"):
        predict.main(["--out", str(tmp_path), "--results", str(results), "--tag=-twin", "--links", str(tmp_path)])


def test_kernel_breakdown_sums_kinds_and_unites_overlaps():
    """Kinds by name (the first match wins), "busy" the union of the spans (an NCCL kernel inside an attention
    kernel adds nothing to it, a gap adds nothing at all) and "nccl_alone" the part of it only NCCL covers (an
    NCCL kernel past the attention's end, 1000 to 1300 us, and one alone in a gap, 3000 to 3100 us)."""
    timing = load("timing")
    kernels = [("gna_dynamic_kernel", 0.0, 1000.0), ("ncclDevKernel_SendRecv", 200.0, 400.0),
               ("ncclDevKernel_SendRecv", 900.0, 1300.0), ("_regroup_kernel", 1500.0, 1600.0),
               ("nvjet_hsh_256x128", 1600.0, 2600.0), ("triton_poi_fused", 2600.0, 2700.0),
               ("ncclDevKernel_AllGather", 3000.0, 3100.0)]
    got = timing.kernel_breakdown(kernels)
    assert got == pytest.approx({"nccl": 0.7, "regroup": 0.1, "attention": 1.0, "matmul": 1.0, "other": 0.1,
                                 "busy": 2.6, "nccl_alone": 0.4})
    assert timing.kernel_breakdown([]) == dict.fromkeys(
        ("nccl", "regroup", "attention", "matmul", "other", "busy", "nccl_alone"), 0.0)


def test_heaviest_kernels_sum_launches_per_name_heaviest_first():
    timing = load("timing")
    kernels = [("a", 0.0, 100.0), ("b", 0.0, 300.0), ("a", 500.0, 750.0), ("c", 0.0, 50.0)]
    assert timing.heaviest_kernels(kernels) == [("a", 2, 0.35), ("b", 1, 0.3), ("c", 1, 0.05)]
    assert timing.heaviest_kernels(kernels, count=1) == [("a", 2, 0.35)]


def test_sass_loops_are_the_key_block_loops_and_not_the_retry_spans():
    """benchmarks/sass_gluon.py counts the consumers' loops in the kernel's SASS: a branch back over a block's
    exponentials, and not the longer spans that out-of-line mbarrier retries make by branching back into it."""
    sass_gluon = load("sass_gluon")
    lines, address = [], 0

    def emit(text: str) -> None:
        nonlocal address
        lines.append(f"        /*{address:04x}*/                   {text} ;")
        address += 0x10

    emit("MOV R1, c[0x0][0x28]")
    start = address
    for i in range(40):
        emit(f"MUFU.EX2 R{i % 8}, R{i % 8}")
        emit(f"FFMA R{i % 8}, R1, R2, R3")
    emit("@!P1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR9+0x28170], RZ")
    emit(f"@P2 BRA 0x{start:x}")
    end = address - 0x10
    emit("EXIT")
    emit(f"BRA 0x{start + 0x40:x}")  # a retry stub branching back into the loop
    emit("MUFU.RCP R3, R3")
    (loop,) = sass_gluon.loops("\n".join(lines))
    assert loop[:2] == (start, end)
    assert loop[2]["MUFU.EX2"] == 40 and loop[2]["FFMA"] == 40 and loop[2]["SYNCS"] == 1 and loop[2]["BRA"] == 1
