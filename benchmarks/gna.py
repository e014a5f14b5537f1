"""GNA forward on the GPU: our Triton kernel vs SDPA (cuDNN, flash) and FlexAttention, one run, one JSON.

    python benchmarks/gna.py --out benchmarks/results            # the benchmark table
    python benchmarks/gna.py --out DIR --tune                    # launch-configuration sweep of our kernel
    python benchmarks/gna.py --out DIR --kv-tiling               # static against dynamic KV tiling

Every case runs on permuted tokens (the permutation is timed separately, beside a plain copy of the same
bytes). FlexAttention gets the identical mask and tile layout: its BlockMask is built from
`natsim.block_mask(...)` (partial and full tiles) plus a mask_mod that decodes permuted positions, and its
output is compared with ours. Times are medians of `triton.testing.do_bench`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

import natsim
from natsim.kernels import gna_attention_permuted, permute, unpermute
from natsim.kernels.gna.layout import TileLayout

HEADS, HEAD_DIM, DTYPE = 24, 128, torch.bfloat16

# family, shape, window, strides, tile (Q = KV)
FAMILIES = [
    ("hunyuan", (30, 48, 80), (18, 24, 24), [(1, 1, 1), (1, 8, 8), (16, 8, 8)], (2, 8, 8)),
    ("flux", (256, 256), (80, 80), [(1, 1), (16, 16)], (16, 8)),
    ("1d", (32768,), (2048,), [(1,), (256,)], (128,)),
]


def bench(fn) -> float:
    """Median milliseconds."""
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def qkv(shape, heads=HEADS, head_dim=HEAD_DIM):
    torch.manual_seed(0)
    return [torch.randn(1, *shape, heads, head_dim, device="cuda", dtype=DTYPE) for _ in range(3)]


def flex_mask_mod(problem: natsim.Problem, tile: tuple[int, ...]):
    """The GNA element mask on permuted positions (same tile for Q and KV), for FlexAttention."""
    layout = TileLayout(problem.shape, tile, problem.dilation)
    tokens, tiles = layout.tile_tokens, layout.tiles_per_group
    n = problem.ndim

    def decode(index):
        inside, tile_id = index % tokens, index // tokens
        t_lin, group = tile_id % math.prod(tiles), tile_id // math.prod(tiles)
        coords, groups = [], []
        for i in range(n):
            inner = math.prod(tile[i + 1:])
            outer = math.prod(tiles[i + 1:])
            dil = math.prod(problem.dilation[i + 1:])
            r = (inside // inner) % tile[i]
            t = (t_lin // outer) % tiles[i]
            groups.append((group // dil) % problem.dilation[i])
            coords.append(t * tile[i] + r)
        return coords, groups

    def mask_mod(b, h, q_idx, kv_idx):
        qc, qg = decode(q_idx)
        kc, kg = decode(kv_idx)
        keep = q_idx >= 0
        for i in range(n):
            L, w, s, d, c = (problem.shape[i], problem.window[i], problem.stride[i], problem.dilation[i],
                             problem.causal[i])
            length = L // d + (qg[i] < L % d).to(torch.int64)
            if c:
                leader = torch.minimum((qc[i] // s) * s + s - 1, length - 1)
                start = torch.clamp(leader - w + 1, min=0)
                end = torch.minimum(qc[i] + 1, length)
            else:
                leader = torch.minimum((qc[i] // s) * s + s // 2, length - 1)
                start = torch.minimum(torch.clamp(leader - w // 2, min=0), length - w)
                end = start + w
            keep = keep & (kg[i] == qg[i]) & (kc[i] >= start) & (kc[i] < end)
        return keep

    return mask_mod


def flex_block_mask(problem: natsim.Problem, tile: tuple[int, ...], tokens: int):
    from torch.nn.attention.flex_attention import BlockMask

    bm = natsim.block_mask(problem, natsim.TileConfig(tile, tile))

    def padded(counts, indices):
        wide = torch.zeros((bm.num_q_tiles, bm.num_kv_tiles), dtype=torch.int32)
        wide[:, : indices.shape[1]] = torch.as_tensor(indices)
        return torch.as_tensor(counts)[None, None].cuda(), wide[None, None].cuda()

    kv_num, kv_idx = padded(bm.kv_num_blocks, bm.kv_indices)
    full_num, full_idx = padded(bm.full_kv_num_blocks, bm.full_kv_indices)
    block = math.prod(tile)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=flex_mask_mod(problem, tile), seq_lengths=(tokens, tokens))


def run_case(family, shape, window, stride, tile, with_flex, dense_ms):
    problem = natsim.Problem(shape, window, stride)
    sim = natsim.simulate(problem, natsim.TileConfig(tile, tile))
    q, k, v = qkv(shape)
    qp, kp, vp = (permute(t, tile) for t in (q, k, v))
    row = {"family": family, "shape": list(shape), "window": list(window), "stride": list(stride),
           "tile": list(tile), "heads": HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
           "tile_speedup": sim.tile_speedup, "flop_speedup": sim.flop_speedup,
           "block_sparse": sim.block_sparse}
    out = gna_attention_permuted(qp, kp, vp, problem, tile, tile)
    row["ours_ms"] = bench(lambda: gna_attention_permuted(qp, kp, vp, problem, tile, tile))
    useful = 4.0 * sim.attended_pairs * HEAD_DIM * HEADS
    row["useful_tflops"] = useful / row["ours_ms"] / 1e9
    row["dense_equiv_tflops"] = 4.0 * problem.num_tokens**2 * HEAD_DIM * HEADS / row["ours_ms"] / 1e9

    def round_trip():
        for t, tl_ in ((q, tile), (k, tile), (v, tile)):
            permute(t, tl_)
        unpermute(out, shape, tile)

    row["permute_ms"] = bench(round_trip)
    row["copy_same_bytes_ms"] = bench(lambda: [t.clone() for t in (q, k, v, q)])
    if dense_ms is not None:
        row["realised_speedup"] = dense_ms / row["ours_ms"]
    if with_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            t0 = time.time()
            block_mask = flex_block_mask(problem, tile, qp.shape[1])
            torch._dynamo.config.recompile_limit = 64  # one compile per case; past the limit flex runs eagerly
            flex = torch.compile(flex_attention, dynamic=False)
            fq, fk, fv = (t.transpose(1, 2).contiguous() for t in (qp, kp, vp))
            fo = flex(fq, fk, fv, block_mask=block_mask)
            row["flex_setup_s"] = time.time() - t0
            ref = fo.transpose(1, 2).float()
            row["flex_vs_ours_rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
            row["flex_ms"] = bench(lambda: flex(fq, fk, fv, block_mask=block_mask))
        except Exception as error:  # recorded, so one failing baseline does not lose the run
            row["flex_error"] = f"{type(error).__name__}: {error}"[:300]
    return row


def sdpa_rows(family, shape):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.reshape(1, -1, HEADS, HEAD_DIM).transpose(1, 2) for t in qkv(shape))
    rows = {}
    for name, backend in (("sdpa_cudnn_ms", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash_ms", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                rows[name] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        except Exception as error:
            rows[name.replace("_ms", "_error")] = f"{type(error).__name__}: {error}"[:300]
    return rows


TUNE_VARIANTS = [
    ("default", {}),
    ("descriptors, 8 warps, 3 stages", dict(USE_TMA=True, WARP_SPECIALIZE=False, num_warps=8, num_stages=3)),
    ("descriptors, 8 warps, 2 stages", dict(USE_TMA=True, WARP_SPECIALIZE=False, num_warps=8, num_stages=2)),
    ("descriptors, warp-specialized, 4+4+4 warps, 2 stages",
     dict(USE_TMA=True, WARP_SPECIALIZE=True, num_warps=4, num_stages=2)),
    ("pointer loads, 8 warps, 3 stages", dict(USE_TMA=False, WARP_SPECIALIZE=False, num_warps=8, num_stages=3)),
]


def tune(out_dir: Path) -> None:
    """Sweep launch options of our kernel on HunyuanVideo (tile 2x8x8) and print/save the times.

    Each variant's output is compared with the default's; variants whose options equal the default's, and
    warp specialization on masked problems (Triton does not specialize a loop with the mask in it, and 4 warps
    alone spill), are skipped.
    """
    from dataclasses import asdict, replace

    from natsim.kernels.common.headdim import head_split
    from natsim.kernels.common.launch import launch_config
    from natsim.kernels.gna.launch import needs_mask

    results = []
    shape, window, tile = (30, 48, 80), (18, 24, 24), (2, 8, 8)
    q, k, v = (permute(t, tile) for t in qkv(shape))
    for stride, win in [((1, 1, 1), shape), ((1, 1, 1), window), ((1, 8, 8), window), ((16, 8, 8), window)]:
        problem = natsim.Problem(shape, win, stride)
        masked = needs_mask(problem, tile, tile)
        default = launch_config(128, 128, head_split(HEAD_DIM), masked, True)
        reference = gna_attention_permuted(q, k, v, problem, tile, tile).float()
        for name, options in TUNE_VARIANTS:
            effective = replace(default, **options)
            if (name != "default" and effective == default) or (masked and effective.WARP_SPECIALIZE):
                continue
            row = {"window": win, "stride": stride, "tile": tile, "masked": masked, "variant": name,
                   "options": asdict(effective)}
            try:
                run = lambda: gna_attention_permuted(q, k, v, problem, tile, tile, config=options)  # noqa: E731
                row["rel_diff_vs_default"] = ((run().float() - reference).norm() / reference.norm()).item()
                row["ms"] = bench(run)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            print(row, flush=True)
            results.append(row)
    record = {**environment(), "rows": results}
    name = f"gna-tune-{record['device'].replace(' ', '_')}-{record['date']}.json"
    (out_dir / name).write_text(json.dumps(record, indent=1))


# The KV-tiling rows: name, shape, heads, window, stride, NATTEN's documented H100 figure in ms (docs/performance.md,
# NATTEN's hopper-fna docs; None where NATTEN documents none for the configuration).
KV_TILING_CASES = [
    ("HunyuanVideo", (30, 48, 80), 24, (18, 24, 24), (1, 1, 1), 79.0),
    ("HunyuanVideo", (30, 48, 80), 24, (18, 24, 24), (1, 8, 8), None),
    ("FLUX 4K", (256, 256), 24, (80, 80), (1, 1), None),
    ("Cosmos", (16, 44, 80), 32, (16, 24, 16), (1, 1, 1), None),
]
MODES = ("static", "dynamic")


def kv_tiling_rows() -> list[dict]:
    """Both KV tiling modes end to end through `gna_attention`, each at its best tiles by predicted work and at
    the other mode's, beside SDPA cuDNN dense, the simulator's tile speedup and natsim's choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from natsim.kernels import gna_attention
    from natsim.kernels.gna.tiles import choose_tiles
    from timing import bench as bench_long, rel

    rows = []
    for name, shape, heads, window, stride, natten_ms in KV_TILING_CASES:
        problem = natsim.Problem(shape, window, stride)
        q, k, v = qkv(shape, heads)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense = [t.reshape(1, -1, heads, HEAD_DIM).transpose(1, 2) for t in (q, k, v)]
            cudnn_ms = bench_long(lambda: torch.nn.functional.scaled_dot_product_attention(*dense))
        best = {mode: choose_tiles(problem, HEAD_DIM, (mode,))[:2] for mode in MODES}
        chosen = choose_tiles(problem, HEAD_DIM, MODES)
        reference = None
        case_rows = []
        for tiles in dict.fromkeys(best.values()):
            for mode in MODES:
                call = lambda: gna_attention(q, k, v, window, stride, q_tile=tiles[0], kv_tile=tiles[1],  # noqa: E731
                                             kv_tiling=mode)
                out = call()
                reference = out if reference is None else reference
                sim = natsim.simulate(problem, natsim.TileConfig(*tiles, kv_tiling=mode))
                ms = bench_long(call)
                row = {"case": name, "shape": list(shape), "heads": heads, "window": list(window),
                       "stride": list(stride), "q_tile": list(tiles[0]), "kv_tile": list(tiles[1]), "kv_tiling": mode,
                       "best_tiles_of_mode": tiles == best[mode], "ms": ms, "sdpa_cudnn_ms": cudnn_ms,
                       "natten_documented_ms": natten_ms, "tile_speedup": sim.tile_speedup,
                       "visited_tiles": sim.visited_tiles, "full_tiles": sim.full_tiles,
                       "realised_speedup": cudnn_ms / ms, "rel_diff_vs_first_row": rel(out, reference),
                       "natsim_choice": {"q_tile": list(chosen[0]), "kv_tile": list(chosen[1]), "kv_tiling": chosen[2]}}
                row["realised_over_simulated"] = row["realised_speedup"] / sim.tile_speedup
                print(json.dumps(row), flush=True)
                case_rows.append(row)
        fastest = min(case_rows, key=lambda r: r["ms"])
        for row in case_rows:
            row["natsim_choice_ms"] = next(r["ms"] for r in case_rows if (r["q_tile"], r["kv_tile"], r["kv_tiling"])
                                           == (list(chosen[0]), list(chosen[1]), chosen[2]))
            row["fastest_measured_ms"] = fastest["ms"]
        rows.extend(case_rows)
    return rows


def kv_tiling_table(rows) -> str:
    head = ("| case | stride | tiles (Q / KV) | mode | ms | cuDNN dense ms | NATTEN documented ms | realised speedup | "
            "simulated tile speedup | realised / simulated | natsim's choice (ms) | fastest measured ms |")
    lines = [head, "|" + "---|" * 12]
    dims = lambda v: "x".join(map(str, v))  # noqa: E731
    for r in rows:
        choice = r["natsim_choice"]
        natten = "-" if r["natten_documented_ms"] is None else f"{r['natten_documented_ms']:.1f}"
        lines.append(f"| {r['case']} {dims(r['shape'])} w{dims(r['window'])} | {dims(r['stride'])} | "
                     f"{dims(r['q_tile'])} / {dims(r['kv_tile'])} | {r['kv_tiling']} | {r['ms']:.2f} | "
                     f"{r['sdpa_cudnn_ms']:.1f} | {natten} | {r['realised_speedup']:.2f}x | {r['tile_speedup']:.2f}x | "
                     f"{r['realised_over_simulated']:.2f} | {dims(choice['q_tile'])} / {dims(choice['kv_tile'])} "
                     f"{choice['kv_tiling']} ({r['natsim_choice_ms']:.2f}) | {r['fastest_measured_ms']:.2f} |")
    return "\n".join(lines)


def environment() -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat()}


def table(rows) -> str:
    head = ("| case | stride | ours ms | TFLOP/s useful | realised / tile_speedup | flex ms | cuDNN ms | "
            "flash ms | permute ms (copy ms) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        fmt = lambda key: f"{r[key]:.1f}" if isinstance(r.get(key), float) else "-"  # noqa: E731
        ratio = (f"{r['realised_speedup']:.2f} / {r['tile_speedup']:.2f}" if "realised_speedup" in r
                 else f"dense / {r['tile_speedup']:.2f}")
        lines.append(f"| {r['family']} {'x'.join(map(str, r['shape']))} w{'x'.join(map(str, r['window']))} | "
                     f"{'x'.join(map(str, r['stride']))} | {fmt('ours_ms')} | {fmt('useful_tflops')} | {ratio} | "
                     f"{fmt('flex_ms')} | {fmt('sdpa_cudnn_ms')} | {fmt('sdpa_flash_ms')} | "
                     f"{fmt('permute_ms')} ({fmt('copy_same_bytes_ms')}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--tune", action="store_true", help="sweep launch configurations instead")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take minutes)")
    parser.add_argument("--families", default="hunyuan,flux,1d")
    parser.add_argument("--kv-tiling", action="store_true", help="static against dynamic KV tiling instead")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tune:
        tune(args.out)
        return
    if args.kv_tiling:
        record = {**environment(), "rows": kv_tiling_rows()}
        name = f"gna-kv-tiling-{record['device'].replace(' ', '_')}-{record['date']}.json"
        (args.out / name).write_text(json.dumps(record, indent=1))
        print(kv_tiling_table(record["rows"]))
        return
    rows = []
    for family, shape, window, strides, tile in FAMILIES:
        if family not in args.families.split(","):
            continue
        dense = run_case(family, shape, shape, (1,) * len(shape), tile, not args.no_flex, None)
        dense.update(sdpa_rows(family, shape))
        dense["dense_tflops"] = dense["dense_equiv_tflops"]
        print(json.dumps(dense), flush=True)
        rows.append(dense)
        for stride in strides:
            row = run_case(family, shape, window, stride, tile, not args.no_flex, dense["ours_ms"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    record = {**environment(), "rows": rows}
    name = f"gna-{record['device'].replace(' ', '_')}-{record['date']}.json"
    (args.out / name).write_text(json.dumps(record, indent=1))
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
