"""Content-adaptive mask predictors side by side at matched density, one run, one JSON:

    python benchmarks/masks.py --out benchmarks/results [--layouts wan480p,hunyuan] [--densities 0.1,0.2,0.3]
    python benchmarks/masks.py --small            # CPU, seconds: the smoke test's run

Inputs: the synthetic video attention of benchmarks/workload.py (seeded; Wan 2.1 480p 21x30x52 with 12 heads,
HunyuanVideo 30x48x80 with 24 heads; head_dim 128, bf16), tokens in Hilbert-curve order
(`natsim.masks.hilbert_order`) so that a block of tokens is compact in the video.

Predictors (each looked up in natsim.masks when the run starts):
- `topp`: FG-Attn's mean-pooled top-p (knob p), at the fine block (16 tokens on Wan, 32 on HunyuanVideo);
- `sparge`: SpargeAttn's self-similarity + TopCdf (knob cdf), at the fine block; sim_threshold is the largest of
  0.6, 0.4, 0.2, 0, -1 at which the target density is reachable (dissimilar blocks are always computed, so a
  high threshold puts a floor under the density: 0.73 of the pairs at 0.6 on the Wan 480p workload);
- `hierarchical`: DFSAttn's sub-block scoring (knob keep, the kept share of KV blocks), 64-token blocks scored
  from 16-token sub-blocks (the fine block on HunyuanVideo);
- `gna_topp`: a GNA neighbourhood window (always kept) OR topp (knob p). The window's block mask in the
  Hilbert order is the bounding box of each query block's windows: a superset of the exact window.
For each predictor and target density (share of token pairs its mask attends) the knob is bisected until the
density matches; the mask is planned with `natsim.planner.best_mask` (granularity and merge, by the GPU's cost
model) and run with the plan.

Figures per row: achieved density; recall, the share of the exact attention mass (softmax in fp32 over all
keys) that the predicted mask keeps, and `recall_run`, that of the pooled mask the plan runs; relative error
of the output against exact dense attention (fp32); predictor time; the plan (blocks, merge) and its host
preparation time (`MaskPlan.prepared`: `prepare_sparse`, measured once; 0 on the CPU, whose reference path
prepares nothing); kernel time of the prepared plan; speedups over SDPA cuDNN
dense: kernel only, and end to end (predictor + preparation + kernel). Times are medians
(triton.testing.do_bench via timing.bench on the GPU; perf_counter medians on the CPU, where `sparse_attention`
runs its torch reference and SDPA its math kernel, so CPU times say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (workload, timing)

from workload import HEADS, LAYOUTS, video_qkv  # noqa: E402

import natsim  # noqa: E402
import natsim.masks  # noqa: E402
from natsim.planner import best_mask  # noqa: E402
from natsim.planner.search import token_density  # noqa: E402

PREDICTORS = ("topp", "sparge", "hierarchical", "gna_topp")
NEEDS = {"topp": "topp", "sparge": "sparge", "hierarchical": "hierarchical", "gna_topp": "topp"}
KNOBS = {"topp": "p", "sparge": "cdf", "hierarchical": "keep", "gna_topp": "p"}
FINE_BLOCK = {"small": 16, "wan480p": 16, "hunyuan": 32}
HIER_BLOCK, HIER_SUB_BLOCK = 64, 16
WINDOWS = {"small": (3, 3, 5), "wan480p": (3, 7, 9), "hunyuan": (3, 9, 13)}
BISECT_STEPS = 14
SPARGE_SIMS = (0.6, 0.4, 0.2, 0.0, -1.0)  # SpargeAttn's similarity threshold, highest first


def predictor_function(name: str) -> Callable:
    """The natsim.masks function a predictor needs, or a sentence saying it is missing."""
    function = getattr(natsim.masks, NEEDS[name], None)
    if function is None:
        raise SystemExit(
            f"natsim.masks has no {NEEDS[name]!r} (predictor {name!r}): it arrives with the predictors' change; "
            f"run with --predictors naming only those present ({', '.join(p for p in PREDICTORS if hasattr(natsim.masks, NEEDS[p]))})."
        )
    return function


# -- the exact attention, once per layout ----------------------------------------------------------------------


def exact_attention(q, k, v, fine: int, chunk: int = 2048):
    """(mass `[H, nQ, nKV]` float32: attention probability summed over each fine query block's rows and fine
    key block's columns, the exact fp32 output `[B, N, H, D]`), batch 1, one head and row chunk at a time."""
    _, n, heads, dim = q.shape
    nq = nkv = -(-n // fine)
    chunk = max(fine, chunk // fine * fine)
    mass = torch.zeros((heads, nq, nkv), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    scale = dim**-0.5
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # bf16 inputs are exact in TF32; accumulation stays fp32
    with torch.no_grad():
        for h in range(heads):
            kt = k[0, :, h].float().T
            vh = v[0, :, h].float()
            for first in range(0, n, chunk):
                rows = slice(first, min(first + chunk, n))
                p = torch.softmax((q[0, rows, h].float() @ kt) * scale, dim=-1)
                out[0, rows, h] = p @ vh
                padded = F.pad(p, (0, nkv * fine - n))
                per_block = padded.view(p.shape[0], nkv, fine).sum(-1)
                row_pad = -p.shape[0] % fine
                per_block = F.pad(per_block, (0, 0, 0, row_pad)).view(-1, fine, nkv).sum(1)
                mass[h, first // fine: first // fine + per_block.shape[0]] = per_block
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return mass, out


def recall(mass: torch.Tensor, mask: torch.Tensor, block_q: int, block_kv: int, fine: int, n: int) -> float:
    """Share of the exact attention mass kept by `mask` (blocks `block_q` x `block_kv`, multiples of `fine`)."""
    fq, fk = block_q // fine, block_kv // fine
    heads, nq, nkv = mass.shape
    rows, cols = -(-nq // fq), -(-nkv // fk)
    padded = F.pad(mass, (0, cols * fk - nkv, 0, rows * fq - nq))
    pooled = padded.view(heads, rows, fq, cols, fk).sum((2, 4))
    kept = (pooled * mask[0].expand(heads, -1, -1).to(pooled.dtype)).sum()
    return float(kept) / (heads * n)


# -- predictors with one knob ---------------------------------------------------------------------------------


def window_block_mask(shape, window, order: np.ndarray, block: int, device) -> torch.Tensor:
    """bool `[1, 1, nQ, nKV]`: query block i attends key block j when a key of j lies in the bounding box of
    the GNA windows (stride 1, non-causal) of i's queries, tokens in `order` (a superset of the exact mask)."""
    from natsim.window import window_bounds

    n = len(order)
    coords = np.stack(np.unravel_index(order, shape), axis=1)  # [N, 3] of the ordered tokens
    starts = np.stack([window_bounds(coords[:, d], shape[d], window[d], 1, False)[0] for d in range(3)], axis=1)
    nb = -(-n // block)
    pad = nb * block - n
    lo = np.pad(starts, ((0, pad), (0, 0)), mode="edge").reshape(nb, block, 3).min(1)
    hi = (np.pad(starts, ((0, pad), (0, 0)), mode="edge") + np.asarray(window)).reshape(nb, block, 3).max(1)
    keys = torch.from_numpy(np.pad(coords, ((0, pad), (0, 0)), mode="edge").reshape(nb, block, 3)).to(device)
    lo, hi = torch.from_numpy(lo).to(device), torch.from_numpy(hi).to(device)
    mask = torch.zeros((nb, nb), dtype=torch.bool, device=device)
    for first in range(0, nb, 256):  # [rows, nKV, block, 3] comparisons per chunk of query blocks
        l, h = lo[first:first + 256, None, None], hi[first:first + 256, None, None]
        inside = ((keys[None] >= l) & (keys[None] < h)).all(-1).any(-1)
        mask[first:first + 256] = inside
    return mask[None, None]


def sparge_threshold(function: Callable, q, k, fine: int, target: float) -> float:
    """The largest of SPARGE_SIMS whose sparsest mask (cdf 1e-4) is no denser than `target`: below it every
    block counts as dissimilar enough to be computed in full, and no cdf reaches the target."""
    n = q.shape[1]
    for threshold in SPARGE_SIMS:
        if token_density(function(q, k, fine, fine, cdf=1e-4, sim_threshold=threshold), fine, fine, n) <= target:
            return threshold
    return SPARGE_SIMS[-1]


def make_predictor(name: str, q, k, fine: int, window_mask: Optional[torch.Tensor], target: float):
    """(call(knob) -> mask, its block, knob range, fixed settings) of one predictor on q, k for a target
    density (only sparge's similarity threshold depends on it)."""
    function = predictor_function(name)
    if name == "topp":
        return (lambda x: function(q, k, fine, fine, x)), fine, (1e-4, 1.0), {}
    if name == "sparge":
        sim = sparge_threshold(function, q, k, fine, target)
        return ((lambda x: function(q, k, fine, fine, cdf=x, sim_threshold=sim)), fine, (1e-4, 1.0),
                {"sim_threshold": sim})
    if name == "hierarchical":
        return ((lambda x: function(q, k, HIER_BLOCK, HIER_BLOCK, keep=x, sub_block=HIER_SUB_BLOCK)), HIER_BLOCK,
                (1e-4, 1.0), {})
    return (lambda x: natsim.masks.union(function(q, k, fine, fine, x), window_mask)), fine, (1e-4, 1.0), {}


def match_density(call: Callable, block: int, n: int, target: float, bounds) -> tuple[float, torch.Tensor, float]:
    """The knob (bisected in `bounds`) whose mask's token density is closest to `target`; its mask and density.
    Densities grow with the knob; the top of the range is tried first (a target of 1 needs it exactly)."""
    lo, hi = bounds
    best = None
    for knob in (hi, lo):
        mask = call(knob)
        d = token_density(mask, block, block, n)
        if best is None or abs(d - target) < abs(best[2] - target):
            best = (knob, mask, d)
    for _ in range(BISECT_STEPS):
        if abs(best[2] - target) < 2e-3:
            break
        mid = 0.5 * (lo + hi)
        mask = call(mid)
        d = token_density(mask, block, block, n)
        if abs(d - target) < abs(best[2] - target):
            best = (mid, mask, d)
        lo, hi = (mid, hi) if d < target else (lo, mid)
    return best


# -- timing ---------------------------------------------------------------------------------------------------


def timer(device: torch.device) -> Callable[[Callable], float]:
    if device.type == "cuda":
        from timing import bench

        return bench

    def cpu_median(fn: Callable, reps: int = 3) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_median


def sdpa(q, k, v):
    args = [t.transpose(1, 2) for t in (q, k, v)]
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*args).transpose(1, 2)
    return F.scaled_dot_product_attention(*args).transpose(1, 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- one layout -----------------------------------------------------------------------------------------------


def run_layout(layout: str, heads: int, densities, predictors, device, dtype, plan_device, seed: int) -> dict:
    shape = LAYOUTS[layout]
    fine = FINE_BLOCK[layout]
    bench = timer(device)
    w = video_qkv(layout, heads, 128 if layout != "small" else 64, device=device, dtype=dtype, seed=seed)
    order = natsim.masks.hilbert_order(shape)
    q, k, v = (natsim.masks.to_order(t, order) for t in (w.q, w.k, w.v))
    n = q.shape[1]
    start = time.perf_counter()
    mass, exact = exact_attention(q, k, v, fine)
    exact_s = time.perf_counter() - start
    sdpa_ms = bench(lambda: sdpa(q, k, v))
    sdpa_error = rel(sdpa(q, k, v), exact)
    window = WINDOWS[layout]
    window_mask = window_block_mask(shape, window, order, fine, device) if "gna_topp" in predictors else None
    rows = []
    for name in predictors:
        for target in densities:
            call, block, bounds, settings = make_predictor(name, q, k, fine, window_mask, target)
            knob, mask, density = match_density(call, block, n, target, bounds)
            predictor_ms = bench(lambda: call(knob))
            plan = best_mask(mask, block, block, n, heads=heads, head_dim=q.shape[-1], dtype="bf16",
                             device=plan_device)
            prepare_ms = plan.prepared(device).prepare_seconds * 1e3 if device.type == "cuda" else 0.0
            out = plan(q, k, v)
            kernel_ms = bench(lambda: plan(q, k, v))
            row = {
                "predictor": name, "knob": KNOBS[name], "value": knob, "target_density": target,
                "settings": settings, "density": density, "block": block,
                "recall": recall(mass, mask, block, block, fine, n),
                "recall_run": recall(mass, plan.mask, plan.q_block, plan.kv_block, fine, n),
                "density_run": plan.chosen.density, "error": rel(out, exact),
                "plan": {"q_block": plan.q_block, "kv_block": plan.kv_block, "merge": plan.merge,
                         "basis": plan.basis, "predicted_ms": None if plan.predicted_time_s is None
                         else plan.predicted_time_s * 1e3, "predicted_speedup": plan.predicted_speedup},
                "predictor_ms": predictor_ms, "prepare_ms": prepare_ms,
                "kernel_ms": kernel_ms, "sdpa_ms": sdpa_ms, "speedup_kernel": sdpa_ms / kernel_ms,
                "speedup_end_to_end": sdpa_ms / (predictor_ms + prepare_ms + kernel_ms),
            }
            rows.append(row)
            print(f"  {layout} {name:12s} {KNOBS[name]}={knob:.4g} density {density:.3f} recall {row['recall']:.3f} "
                  f"error {row['error']:.3g} kernel {kernel_ms:.3g} ms", flush=True)
    return {"layout": layout, "shape": list(shape), "seq_len": n, "heads": heads, "head_dim": q.shape[-1],
            "dtype": str(dtype).replace("torch.", ""), "fine_block": fine, "window": list(window),
            "order": "hilbert", "sdpa_ms": sdpa_ms, "sdpa_error": sdpa_error, "exact_seconds": exact_s,
            "temperature": w.temperature.tolist(), "rows": rows}


def table(results: list[dict]) -> str:
    head = (f"{'layout':8s} {'predictor':12s} {'knob':>12s} {'density':>7s} {'recall':>6s} {'run':>6s} "
            f"{'error':>8s} {'pred ms':>8s} {'plan':>16s} {'prep ms':>8s} {'kernel ms':>9s} {'SDPA ms':>8s} "
            f"{'kernel x':>8s} {'e2e x':>6s}")
    lines = [head, "-" * len(head)]
    for result in results:
        for r in result["rows"]:
            p = r["plan"]
            lines.append(
                f"{result['layout']:8s} {r['predictor']:12s} {r['knob'] + '=' + format(r['value'], '.3g'):>12s} "
                f"{r['density']:7.3f} {r['recall']:6.3f} {r['recall_run']:6.3f} {r['error']:8.2e} "
                f"{r['predictor_ms']:8.3g} {str(p['q_block']) + 'x' + str(p['kv_block']) + ' ' + p['merge']:>16s} "
                f"{r['prepare_ms']:8.3g} {r['kernel_ms']:9.3g} {r['sdpa_ms']:8.3g} {r['speedup_kernel']:8.2f} "
                f"{r['speedup_end_to_end']:6.2f}"
            )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for masks.json (default: print only)")
    parser.add_argument("--small", action="store_true", help="the small layout on the CPU, in seconds")
    parser.add_argument("--layouts", default="wan480p,hunyuan", help=f"comma-separated, of {sorted(LAYOUTS)}")
    parser.add_argument("--heads", type=int, default=None, help="heads per layout (default: the model's)")
    parser.add_argument("--densities", default=None, help="target densities (default 0.1,0.2,0.3; --small 0.25,0.5,1)")
    parser.add_argument("--predictors", default=",".join(PREDICTORS), help=f"comma-separated, of {PREDICTORS}")
    parser.add_argument("--plan-device", default=None, help="GPU whose cost model plans (default: this GPU; h100 on a CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    predictors = [p.strip() for p in args.predictors.split(",") if p.strip()]
    unknown = [p for p in predictors if p not in PREDICTORS]
    if unknown:
        raise SystemExit(f"--predictors must name predictors of {PREDICTORS}, got {unknown}.")
    for name in predictors:
        predictor_function(name)
    if args.small:
        layouts, device, dtype = ["small"], torch.device("cpu"), torch.float32
        densities = [0.25, 0.5, 1.0]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/masks.py needs a CUDA GPU; use --small for the CPU run.")
        layouts, device, dtype = [s.strip() for s in args.layouts.split(",")], torch.device("cuda"), torch.bfloat16
        densities = [0.1, 0.2, 0.3]
    if args.densities:
        densities = [float(d) for d in args.densities.split(",")]
    plan_device = args.plan_device or (None if device.type == "cuda" else "h100")
    import triton

    record = {
        "benchmark": "masks",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "natsim": getattr(natsim, "__version__", None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "densities": densities, "predictors": predictors, "layouts": [],
    }
    for layout in layouts:
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts must name layouts of {sorted(LAYOUTS)}, got {layout!r}.")
        heads = args.heads if args.heads is not None else HEADS[layout]
        print(f"{layout}: {LAYOUTS[layout]} x {heads} heads", flush=True)
        record["layouts"].append(run_layout(layout, heads, densities, predictors, device, dtype, plan_device,
                                            args.seed))
        if args.out is not None:  # after every layout, so that a run cut short keeps what it measured
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / ("masks_small.json" if args.small else "masks.json")
            path.write_text(json.dumps(record, indent=2) + "\n")
            print(f"wrote {path}", flush=True)
    print(table(record["layouts"]))
    return record


if __name__ == "__main__":
    main()
