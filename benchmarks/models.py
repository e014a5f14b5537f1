"""GNA as real models call it, on the GPU, one run, one JSON:

    python benchmarks/models.py --out benchmarks/results

1. dense attention through `gna_attention(window=shape)` against SDPA cuDNN on real latent layouts, and GNA
   configurations on layouts the tiles do not divide, with the default tiles: speedup over cuDNN against the
   simulator's tile_speedup; the default tiles timed against the next best catalog tiles (by the H100 model);
2. HunyuanVideo 16x8x8: `gna_attention` end to end (it reads the layout in place: no permutation) and the
   kernel alone on permuted tokens, beside cuDNN dense;
3. host time per call: 200 back-to-back calls of small problems (wall clock) next to their GPU time, through
   the eager path and through the registered operator;
4. launch variants worth knowing about (warp specialisation of the masked kernel, three stages).
Times are medians of `triton.testing.do_bench` with at least 10 timed calls; outputs are checked against SDPA
(dense rows) or against the permuted path (GNA rows) before timing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from timing import bench, rel

import natsim
from natsim.kernels import gna_attention, gna_attention_permuted, permute
from natsim.kernels.gna.ops import gna_forward
from natsim.kernels.gna.tiles import default_tiles, tile_pairs
from natsim.planner.cost import COEFFICIENTS_DIR, CostModel, features_of

HEAD_DIM, DTYPE = 128, torch.bfloat16
H100 = CostModel.load(COEFFICIENTS_DIR / "nvidia-h100-80gb-hbm3.json")

# name, shape, heads, [(window, stride), ...]
LAYOUTS = [
    ("HunyuanVideo", (30, 48, 80), 24, [((18, 24, 24), (16, 8, 8)), ((18, 24, 24), (1, 8, 8)), ((18, 24, 24), (1, 1, 1))]),
    ("Cosmos", (16, 44, 80), 32, [((16, 24, 16), (1, 8, 16))]),
    ("Wan 2.1 720p", (21, 45, 80), 40, [((9, 21, 40), (1, 1, 1)), ((9, 21, 40), (3, 7, 8))]),
]
OVERHEAD_CASES = [((8, 16, 16), 4, 64, (3, 5, 5), (1, 1, 1)), ((32, 32), 8, 64, (9, 9), (1, 1)),
                  ((1024,), 2, 128, (128,), (1,)), ((64, 64), 16, 64, (13, 13), (2, 2)),
                  ((4, 16, 16), 8, 128, (3, 7, 7), (1, 1, 1))]


def qkv(shape, heads):
    return [torch.randn(1, *shape, heads, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(3)]


def sdpa_cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, heads = q.shape[0], q.shape[-2]
    qs, ks, vs = (t.reshape(b, -1, heads, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)


def predicted(problem, tiles, heads) -> float:
    result = natsim.simulate(problem, natsim.TileConfig(*tiles))
    return float(H100.predict(features_of(result, batch_heads=heads, head_dim=HEAD_DIM, element_bytes=2,
                                          permutation=False)))


def layouts_section(rows: list) -> None:
    for name, shape, heads, configs in LAYOUTS:
        q, k, v = qkv(shape, heads)
        n = math.prod(shape)
        dense_flops = 4.0 * n * n * HEAD_DIM * heads
        cudnn_ms = bench(lambda: sdpa_cudnn(q, k, v))
        ref = sdpa_cudnn(q, k, v).transpose(1, 2).reshape(q.shape)
        out = gna_attention(q, k, v, shape)
        row = {"layout": name, "shape": shape, "heads": heads, "window": shape, "stride": (1,) * len(shape),
               "cudnn_ms": cudnn_ms, "ours_ms": bench(lambda: gna_attention(q, k, v, shape)),
               "rel_diff_vs_cudnn": rel(out, ref)}
        row["ours_over_cudnn"] = row["ours_ms"] / cudnn_ms
        row["cudnn_tflops"] = dense_flops / cudnn_ms / 1e9
        print(json.dumps(row), flush=True)
        rows.append(row)
        for window, stride in configs:
            problem = natsim.Problem(shape, window, stride)
            tiles = default_tiles(problem, HEAD_DIM)
            sim = natsim.simulate(problem, natsim.TileConfig(*tiles))
            out = gna_attention(q, k, v, window, stride)
            check = gna_attention(*(t.clone() for t in (q, k, v)), window, stride, q_tile=tiles[0],
                                  kv_tile=tiles[1])
            row = {"layout": name, "shape": shape, "heads": heads, "window": window, "stride": stride,
                   "default_tiles": tiles, "tile_speedup": sim.tile_speedup, "flop_speedup": sim.flop_speedup,
                   "block_sparse": sim.block_sparse, "cudnn_ms": cudnn_ms,
                   "ours_ms": bench(lambda: gna_attention(q, k, v, window, stride)),
                   "rel_diff_vs_explicit_tiles": rel(out, check)}
            row["speedup_over_cudnn"] = cudnn_ms / row["ours_ms"]
            row["of_tile_speedup"] = row["speedup_over_cudnn"] / sim.tile_speedup
            row["of_flop_bound"] = row["speedup_over_cudnn"] / sim.flop_speedup
            # the default against the next best catalog tiles by the H100 model
            ranked = sorted(tile_pairs(shape, HEAD_DIM), key=lambda t: predicted(problem, t, heads))
            others = [t for t in ranked if t != tiles][:3]
            row["alternatives"] = [
                {"tiles": t, "predicted_ms": predicted(problem, t, heads) * 1e3,
                 "ms": bench(lambda: gna_attention(q, k, v, window, stride, q_tile=t[0], kv_tile=t[1]))}
                for t in others
            ]
            row["default_predicted_ms"] = predicted(problem, tiles, heads) * 1e3
            row["default_over_fastest"] = row["ours_ms"] / min([row["ours_ms"]] + [a["ms"] for a in row["alternatives"]])
            print(json.dumps(row), flush=True)
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()


def hunyuan_section(record: dict) -> None:
    shape, heads, window, stride, tile = (30, 48, 80), 24, (18, 24, 24), (16, 8, 8), (2, 8, 8)
    q, k, v = qkv(shape, heads)
    problem = natsim.Problem(shape, window, stride)
    qp, kp, vp = (permute(t, tile) for t in (q, k, v))
    layout = gna_attention(q, k, v, window, stride, q_tile=tile, kv_tile=tile)
    record["hunyuan_16x8x8"] = {
        "end_to_end_ms": bench(lambda: gna_attention(q, k, v, window, stride, q_tile=tile, kv_tile=tile)),
        "permuted_kernel_only_ms": bench(lambda: gna_attention_permuted(qp, kp, vp, problem, tile, tile)),
        "permute_round_trip_ms": bench(lambda: [permute(t, tile) for t in (q, k, v, q)]),
        "cudnn_dense_ms": bench(lambda: sdpa_cudnn(q, k, v)),
        "natten_documented_ms": 23.4,
        "layout_vs_permuted_rel_diff": rel(layout, gna_attention(
            *(t.clone() for t in (q, k, v)), window, stride, q_tile=tile, kv_tile=tile)),
    }
    variants = {
        "masked kernel forced, 8 warps, 3 stages": dict(MASKED=True, WARP_SPECIALIZE=False, num_warps=8, num_stages=3),
    }
    for label, options in variants.items():
        try:
            out = gna_attention_permuted(qp, kp, vp, problem, tile, tile, config=options)
            record["hunyuan_16x8x8"][label] = {
                "ms": bench(lambda: gna_attention_permuted(qp, kp, vp, problem, tile, tile, config=options)),
                "rel_diff": rel(out, gna_attention_permuted(qp, kp, vp, problem, tile, tile))}
        except Exception as error:  # recorded: a variant Triton cannot build is a finding, not a lost run
            record["hunyuan_16x8x8"][label] = {"error": f"{type(error).__name__}: {error}"[:400]}
    # warp specialisation of the masked two-loop kernel, on a masked problem (stride 1x8x8)
    masked = natsim.Problem(shape, window, (1, 8, 8))
    base = gna_attention_permuted(qp, kp, vp, masked, tile, tile)
    record["hunyuan_1x8x8_masked"] = {"default_ms": bench(lambda: gna_attention_permuted(qp, kp, vp, masked, tile, tile))}
    for label, options in {"warp-specialized masked, 4 warps, 2 stages": dict(WARP_SPECIALIZE=True, num_warps=4, num_stages=2)}.items():
        try:
            out = gna_attention_permuted(qp, kp, vp, masked, tile, tile, config=options)
            record["hunyuan_1x8x8_masked"][label] = {
                "ms": bench(lambda: gna_attention_permuted(qp, kp, vp, masked, tile, tile, config=options)),
                "rel_diff": rel(out, base)}
        except Exception as error:
            record["hunyuan_1x8x8_masked"][label] = {"error": f"{type(error).__name__}: {error}"[:400]}
    print(json.dumps(record["hunyuan_16x8x8"]), json.dumps(record["hunyuan_1x8x8_masked"]), flush=True)


def overhead_section(rows: list, calls: int = 200, rounds: int = 5) -> None:
    """Host time per call: `rounds` rounds of `calls` back-to-back calls per case and path, the cases
    interleaved round by round (a slow moment of the host shows as one slow round, not as one slow case);
    median and minimum over rounds. GPU time per call from a CUDA graph of one call."""
    cases = []
    for shape, heads, head_dim, window, stride in OVERHEAD_CASES:
        q, k, v = (torch.randn(1, *shape, heads, head_dim, device="cuda", dtype=DTYPE) for _ in range(3))
        ndim = len(shape)
        row = {"shape": shape, "heads": heads, "head_dim": head_dim, "window": window, "stride": stride}
        paths = {
            "eager": functools.partial(gna_attention, q, k, v, window, stride),
            "operator": functools.partial(gna_forward, q, k, v, list(window), list(stride), [1] * ndim,
                                          [False] * ndim, None, None, None, False),
        }
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        paths["eager"]()
        torch.cuda.synchronize()
        row["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        for fn in paths.values():
            for _ in range(20):
                fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paths["eager"]()
        row["gpu_us"] = bench(graph.replay, min_calls=200) * 1e3
        cases.append((row, paths))
    samples = {(i, label): [] for i in range(len(cases)) for label in ("eager", "operator")}
    for _ in range(rounds):
        for i, (row, paths) in enumerate(cases):
            for label, fn in paths.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[i, label].append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
    for i, (row, _) in enumerate(cases):
        for label in ("eager", "operator"):
            row[f"{label}_host_us"] = statistics.median(samples[i, label])
            row[f"{label}_host_us_min"] = min(samples[i, label])
            row[f"{label}_host_us_rounds"] = samples[i, label]
        print(json.dumps(row), flush=True)
        rows.append(row)


def environment() -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--sections", default="overhead,hunyuan,layouts")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {**environment(), "layouts": [], "overhead": []}
    sections = args.sections.split(",")
    try:
        if "overhead" in sections:
            overhead_section(record["overhead"])
        if "hunyuan" in sections:
            hunyuan_section(record)
        if "layouts" in sections:
            layouts_section(record["layouts"])
    finally:
        name = f"models-{record['device'].replace(' ', '_')}-{record['date']}.json"
        (args.out / name).write_text(json.dumps(record, indent=1, default=list))
    print("\n| layout | window | stride | tiles | cuDNN ms | ours ms | ours/cuDNN or speedup | of tile_speedup | default/fastest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in record["layouts"]:
        dims = lambda v: "x".join(map(str, v))  # noqa: E731
        if "speedup_over_cudnn" in r:
            print(f"| {r['layout']} | {dims(r['window'])} | {dims(r['stride'])} | {dims(r['default_tiles'][0])}/"
                  f"{dims(r['default_tiles'][1])} | {r['cudnn_ms']:.1f} | {r['ours_ms']:.2f} | "
                  f"{r['speedup_over_cudnn']:.2f}x (bound {r['tile_speedup']:.2f}) | {r['of_tile_speedup']:.2f} | "
                  f"{r['default_over_fastest']:.3f} |")
        else:
            print(f"| {r['layout']} | dense | - | 1-D 128 | {r['cudnn_ms']:.1f} | {r['ours_ms']:.1f} | "
                  f"{r['ours_over_cudnn']:.3f} | - | - |")
    for r in record["overhead"]:
        print(f"overhead {r['shape']}: eager host {r['eager_host_us']:.1f} us (min {r['eager_host_us_min']:.1f}), "
              f"operator host {r['operator_host_us']:.1f} us, GPU {r['gpu_us']:.1f} us, "
              f"first call {r['first_call_ms']:.0f} ms")
    print(json.dumps(record.get("hunyuan_16x8x8")))


if __name__ == "__main__":
    sys.exit(main())
