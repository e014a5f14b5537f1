"""GNA backward on the GPU: forward and forward + backward against SDPA (cuDNN, flash) and FlexAttention.

    python benchmarks/backward.py --out benchmarks/results           # the issue-13 table (HunyuanVideo)
    python benchmarks/backward.py --out DIR --tune                   # backward tiles and launch options
    python benchmarks/backward.py --out DIR --variant DIR/backward-tune-*.json   # the table with the winner
    python benchmarks/backward.py --out DIR --layout 160x160:40x40:8x16 --layout 31x45x77:13x15x17:4x4x4
                                                                     # any layouts, ours beside Flex

HunyuanVideo 30x48x80, 24 heads, head_dim 128, bf16, window 18x24x24 at strides 1x1x1, 1x8x8 and 16x8x8,
and dense attention. Ours: `gna_attention` with q, k, v requiring grad (the registered operator, its
backward through `natsim::gna_backward`: three kernels on the caller's layout in place); the backward alone is
timed with `retain_graph`. SDPA runs dense attention;
FlexAttention gets the identical element mask on the forward's permuted tiles (benchmarks/gna.py's
`flex_block_mask`: partial and full 128x128 blocks plus a mask_mod) and is timed forward and forward +
backward. Gradients are checked on two heads of the full layout against the float32 chunked reference
(`reference_gradients`). Simulated speedups are the backward tiles' (`natsim.simulate_backward`): the
dK/dV kernel's KV-major counts and the dQ kernel's Q-major counts, relative to dense attention.

`--layout SHAPE:WINDOW:STRIDE[:DILATION]` (repeatable) times layouts the table does not name instead, ours
beside Flex (on 2x8x8, 8x16 or 128-token tiles by the layout's rank, dilation groups permuted as ours are),
24 heads, gradients checked as above; written to backward-layouts-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton
from timing import bench as bench_median
from timing import rel

import natsim
from natsim.kernels import gna_attention, permute
from natsim.kernels.gna.backward import backward_tiles
from natsim.kernels.gna.dispatch import forward
from natsim.kernels.gna.launch import dense_as_1d
from natsim.kernels.gna.reference import reference_gradients

HEADS, HEAD_DIM, DTYPE = 24, 128, torch.bfloat16
SHAPE, WINDOW = (30, 48, 80), (18, 24, 24)
FLEX_TILE = (2, 8, 8)
FLEX_TILES = {1: (128,), 2: (8, 16), 3: FLEX_TILE}  # Flex's 128-token tiles by the layout's rank
CHECK_HEADS = 2
BF16_TOLERANCE = 2e-2


def bench(fn) -> float:
    """Median milliseconds over at least three calls (dense rows take a second per call)."""
    return bench_median(fn, min_calls=3, min_rep_ms=100.0)


def inputs(shape, heads=HEADS):
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, *shape, heads, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(4))
    return q, k, v, g


def simulated(problem: natsim.Problem) -> dict:
    """The backward tiles and their simulated tile speedups over dense attention under the same tiles."""
    kernel_problem = dense_as_1d(problem) or problem
    q_tile, kv_tile = backward_tiles(kernel_problem, HEAD_DIM)
    tiles = natsim.TileConfig(q_tile, kv_tile)
    kv_major = natsim.simulate_backward(kernel_problem, tiles)
    q_major = natsim.simulate(kernel_problem, tiles)
    return {"bwd_q_tile": list(q_tile), "bwd_kv_tile": list(kv_tile), "block_sparse": q_major.block_sparse,
            "sim_dkdv_speedup_max": kv_major.tile_speedup, "sim_dq_speedup_max": q_major.tile_speedup,
            "sim_speedup_mean": kv_major.tile_speedup_mean, "visited_pairs": kv_major.visited_tiles,
            "full_pairs": kv_major.full_tiles}


def ours(problem, q, k, v, g) -> dict:
    args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation)
    row = {}
    with torch.no_grad():
        row["fwd_ms"] = bench(lambda: gna_attention(q, k, v, **args))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = gna_attention(qg, kg, vg, **args)
    grads = torch.autograd.grad(out, (qg, kg, vg), g, retain_graph=True)
    row["bwd_ms"] = bench(lambda: torch.autograd.grad(out, (qg, kg, vg), g, retain_graph=True))
    row["fwd_bwd_ms"] = bench(lambda: torch.autograd.grad(gna_attention(qg, kg, vg, **args), (qg, kg, vg), g))

    return row, grads


def ours_row(problem, q, k, v, g, with_check: bool) -> dict:
    """Our timings and backward / forward ratio, with the gradient check; an error is recorded, not raised, so
    that one failing row does not lose the run."""
    try:
        row, grads = ours(problem, q, k, v, g)
        row["bwd_over_fwd"] = row["bwd_ms"] / row["fwd_ms"]
        if with_check:
            row.update(check(problem, q, k, v, g, grads))
        return row
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:500]}


def check(problem, q, k, v, g, grads) -> dict:
    """Relative errors of our gradients on the first heads against the float32 chunked reference."""
    heads = slice(0, CHECK_HEADS)
    want = reference_gradients(*(t[..., heads, :] for t in (q, k, v, g)), problem.window, problem.stride,
                               problem.dilation)
    return {f"rel_err_{name}": rel(got[..., heads, :], ref) for name, got, ref in zip(("dq", "dk", "dv"), grads, want)}


def flex(problem, q, k, v, g, tile=FLEX_TILE) -> dict:
    """FlexAttention forward and forward + backward under the same element mask, on tokens permuted to `tile`
    (and the problem's dilation groups)."""
    from gna import flex_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    row = {}
    try:
        t0 = time.time()
        fq, fk, fv, fg = (permute(t, tile, problem.dilation).transpose(1, 2).contiguous() for t in (q, k, v, g))
        block_mask = flex_block_mask(problem, tile, fq.shape[2])
        torch._dynamo.config.recompile_limit = 64
        compiled = torch.compile(flex_attention, dynamic=False)
        with torch.no_grad():
            row["flex_fwd_ms"] = bench(lambda: compiled(fq, fk, fv, block_mask=block_mask))
        fq, fk, fv = (t.requires_grad_() for t in (fq, fk, fv))
        run = lambda: torch.autograd.grad(compiled(fq, fk, fv, block_mask=block_mask), (fq, fk, fv), fg)  # noqa: E731
        run()
        row["flex_setup_s"] = time.time() - t0
        row["flex_fwd_bwd_ms"] = bench(run)
        row["flex_bwd_ms"] = row["flex_fwd_bwd_ms"] - row["flex_fwd_ms"]
    except Exception as error:  # recorded, so one failing baseline does not lose the run
        row["flex_error"] = f"{type(error).__name__}: {error}"[:300]
    return row


def sdpa(q, k, v, g) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, g = (t.reshape(1, -1, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v, g))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    row = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                attend = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
                with torch.no_grad():
                    row[f"sdpa_{name}_fwd_ms"] = bench(attend)
                row[f"sdpa_{name}_fwd_bwd_ms"] = bench(lambda: torch.autograd.grad(attend(), (q, k, v), g))
                row[f"sdpa_{name}_bwd_ms"] = row[f"sdpa_{name}_fwd_bwd_ms"] - row[f"sdpa_{name}_fwd_ms"]
        except Exception as error:
            row[f"sdpa_{name}_error"] = f"{type(error).__name__}: {error}"[:300]
    return row


CASES = {"dense": ((1, 1, 1), SHAPE), "1x1x1": ((1, 1, 1), WINDOW), "1x8x8": ((1, 8, 8), WINDOW),
         "16x8x8": ((16, 8, 8), WINDOW)}
FLEX_ORDER = ("16x8x8", "1x8x8", "1x1x1", "dense")  # block-sparse rows first: the targets are theirs


def run(cases, with_flex: bool, with_check: bool, save) -> list[dict]:
    """The rows named in `cases` (CASES keys): ours and SDPA first, then FlexAttention in the same order (its
    compiles take longest); `save(rows)` after each step, so that a run cut short keeps what it measured."""
    q, k, v, g = inputs(SHAPE)
    baseline = sdpa(q, k, v, g)
    print(json.dumps(baseline), flush=True)
    rows = []
    for stride, window in (CASES[name] for name in cases):
        problem = natsim.Problem(SHAPE, window, stride)
        row = {"case": "dense" if window == SHAPE else "x".join(map(str, stride)), "shape": list(SHAPE),
               "window": list(window), "stride": list(stride), "heads": HEADS, "head_dim": HEAD_DIM,
               "dtype": str(DTYPE), **simulated(problem), **baseline}
        row.update(ours_row(problem, q, k, v, g, with_check))
        print(json.dumps(row), flush=True)
        rows.append(row)
        save(rows)
    dense = [r["bwd_ms"] for r in rows if r["case"] == "dense" and "bwd_ms" in r]
    for row in rows:
        if dense and "bwd_ms" in row:
            row["realised_bwd_speedup"] = dense[0] / row["bwd_ms"]
    save(rows)
    if with_flex:
        for row in sorted(rows, key=lambda r: FLEX_ORDER.index(r["case"])):
            row.update(flex(natsim.Problem(SHAPE, tuple(row["window"]), tuple(row["stride"])), q, k, v, g))
            if "flex_bwd_ms" in row and "bwd_ms" in row:
                row["flex_bwd_over_ours"] = row["flex_bwd_ms"] / row["bwd_ms"]
            print(json.dumps(row), flush=True)
            save(rows)
    return rows


def parse_layout(text: str) -> natsim.Problem:
    """`SHAPE:WINDOW:STRIDE[:DILATION]`, each `AxBxC`, as a Problem (its own checks and errors)."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--layout takes SHAPE:WINDOW:STRIDE[:DILATION] such as 160x160:40x40:8x16, got {text!r}.")
    sizes = [tuple(int(x) for x in part.split("x")) for part in parts]
    return natsim.Problem(*sizes)


def run_layouts(problems, with_flex: bool, with_check: bool, save) -> list[dict]:
    """Ours (forward, backward) and Flex's on each problem, 24 heads; `save(rows)` after each."""
    rows = []
    for problem in problems:
        q, k, v, g = inputs(problem.shape)
        row = {"case": f"{'x'.join(map(str, problem.shape))} w{'x'.join(map(str, problem.window))} "
                       f"s{'x'.join(map(str, problem.stride))} d{'x'.join(map(str, problem.dilation))}",
               "shape": list(problem.shape), "window": list(problem.window), "stride": list(problem.stride),
               "dilation": list(problem.dilation), "heads": HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
               **simulated(problem)}
        row.update(ours_row(problem, q, k, v, g, with_check))
        if with_flex:
            row["flex_tile"] = list(FLEX_TILES[problem.ndim])
            row.update(flex(problem, q, k, v, g, FLEX_TILES[problem.ndim]))
            if "flex_bwd_ms" in row and "bwd_ms" in row:
                row["flex_bwd_over_ours"] = row["flex_bwd_ms"] / row["bwd_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        save(rows)
        del q, k, v, g
    return rows


# Backward variants for --tune, most promising first (the sweep stops starting new ones past its time budget):
# (Q tile halvings of the 128-key KV box, `options` of `gna_backward`). History (H100, 2026-11-23,
# backward-tune-*.json): the first tune made ATOMIC_DQ the default (120 / 119 ms at 1x8x8 / 16x8x8 against
# 148 / 140 for a dQ kernel on the dK/dV kernel's tiles; USE_TMA and 32-query tiles slower); a second found
# TMA bulk reductions for the atomic dQ and a rotated Q order per program within 2% (both dropped); the third,
# timing `gna_backward` whole, made the dQ kernel run on mirrored tiles (128 queries, 64 keys) with three
# stages the default: 106.2 / 102.9 ms against 112.6 / 107.2 for ATOMIC_DQ. All three on permuted copies; the
# kernels now read the caller's layout in place. 2026-11-25, in place: USE_TMA came back as rank-4 descriptors
# over the caller's layout, on by default in unmasked kernels (kernels/gna/backward.py's `uses_descriptors`), and
# ATOMIC_DQ=2 (bulk tensor reduces) within 1-14% of the dQ kernel, off.
TUNE = [
    (1, dict(ATOMIC_DQ=False, IN_TILE=True, num_stages=3)),
    (1, dict(ATOMIC_DQ=False, IN_TILE=True, num_stages=3, USE_TMA=False)),
    (1, dict(ATOMIC_DQ=2, IN_TILE=True, num_stages=2)),
    (1, dict(ATOMIC_DQ=False, num_stages=3)),
    (1, dict(ATOMIC_DQ=True, IN_TILE=True)),
    (1, dict(ATOMIC_DQ=False, IN_TILE=True, num_stages=3, DQ_STAGES=4)),
    (1, dict(ATOMIC_DQ=False, IN_TILE=True)),
    (2, dict(ATOMIC_DQ=False, IN_TILE=True, num_stages=3)),
]
TUNE_STRIDES = [(1, 8, 8), (16, 8, 8)]
TUNE_BUDGET_S = 120.0


def tune_bench(fn) -> float:
    """Median milliseconds over at least three calls (a backward variant takes 0.1 to 0.3 s here)."""
    return bench_median(fn, min_calls=3, min_rep_ms=50.0)


def tune(budget_s: float = TUNE_BUDGET_S, save=lambda result: None) -> dict:
    """`gna_backward` as training calls it (the delta pass and both kernels) for each TUNE variant at
    TUNE_STRIDES, until `budget_s` has passed (variants not started are listed as skipped); each variant is
    set as natsim's default for its run. Gradients are compared with the first variant's; the winner is the
    fastest over both strides among those within BF16_TOLERANCE. `save(result)` after each variant, so that a
    run cut short keeps its winner so far."""
    from natsim.kernels import gna_backward as module

    q, k, v, g = inputs(SHAPE)
    start = time.time()
    cases = []
    for stride in TUNE_STRIDES:
        out, lse = forward(q, k, v, WINDOW, stride, 1, False, None, None, None, True)
        cases.append((natsim.Problem(SHAPE, WINDOW, stride), out, lse))
    defaults = module.Q_TILE_HALVINGS, dict(module.DEFAULT_VARIANT)
    rows, reference, skipped = [], {}, []
    for index, (halvings, options) in enumerate(TUNE):
        if time.time() - start > budget_s:
            skipped.append({"q_halvings": halvings, "options": options})
            continue
        module.Q_TILE_HALVINGS = halvings
        module.DEFAULT_VARIANT.clear()
        module.DEFAULT_VARIANT.update(options)
        for problem, out, lse in cases:
            q_tile, kv_tile = backward_tiles(problem, HEAD_DIM, halvings)
            row = {"variant": index, "stride": list(problem.stride), "q_halvings": halvings, "q_tile": list(q_tile),
                   "kv_tile": list(kv_tile), "options": options}
            try:
                call = lambda: module.gna_backward(q, k, v, out, lse, g, None, problem)  # noqa: E731
                grads = call()
                key = tuple(problem.stride)
                reference.setdefault(key, grads)
                row["rel_diff_vs_first"] = max(rel(a, b) for a, b in zip(grads, reference[key]))
                del grads
                row["ms"] = tune_bench(call)
                row["sim_speedup_mean"] = natsim.simulate_backward(problem, natsim.TileConfig(q_tile, kv_tile)) \
                    .tile_speedup_mean
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"[:300]
            row["elapsed_s"] = time.time() - start
            print(json.dumps(row), flush=True)
            rows.append(row)
        save({"rows": rows, "skipped": skipped, "winner": tune_winner(rows)})
    module.Q_TILE_HALVINGS = defaults[0]
    module.DEFAULT_VARIANT.clear()
    module.DEFAULT_VARIANT.update(defaults[1])
    result = {"rows": rows, "skipped": skipped, "winner": tune_winner(rows)}
    save(result)
    return result


def tune_winner(rows) -> dict | None:
    """The variant with the least total time over the tuned strides, among those that ran every stride within
    BF16_TOLERANCE of the first variant's gradients: `{"q_halvings", "options", "total_ms"}`, or None."""
    totals: dict[int, list] = {}
    for row in rows:
        totals.setdefault(row["variant"], []).append(row)
    good = {index: sum(r["ms"] for r in group) for index, group in totals.items()
            if len(group) == len(TUNE_STRIDES) and all("ms" in r and r["rel_diff_vs_first"] < BF16_TOLERANCE
                                                       for r in group)}
    if not good:
        return None
    index = min(good, key=good.get)
    halvings, options = TUNE[index]
    return {"variant": index, "q_halvings": halvings, "options": options, "total_ms": good[index]}


def use_variant(path: Path) -> dict:
    """Run the backward with the winner of a --tune JSON (or a JSON object `{"q_halvings", "options"}`): set
    natsim's backward defaults (tiles and launch options) for this process, and return what was set."""
    from natsim.kernels import gna_backward

    record = json.loads(Path(path).read_text())
    variant = record.get("winner", record) if isinstance(record, dict) else None
    if not variant or "q_halvings" not in variant:
        print(f"--variant {path}: no winner in it; running natsim's default backward variant.", flush=True)
        return {"q_halvings": gna_backward.Q_TILE_HALVINGS, "options": dict(gna_backward.DEFAULT_VARIANT),
                "note": f"no winner in {path}"}
    gna_backward.Q_TILE_HALVINGS = int(variant["q_halvings"])
    gna_backward.DEFAULT_VARIANT.clear()
    gna_backward.DEFAULT_VARIANT.update(variant.get("options", {}))
    return {"q_halvings": gna_backward.Q_TILE_HALVINGS, "options": dict(gna_backward.DEFAULT_VARIANT)}


def environment() -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat()}


def table(rows) -> str:
    head = ("| case | bwd tiles | ours fwd ms | ours bwd ms | bwd / fwd | realised / simulated bwd speedup | "
            "flex fwd / bwd ms | cuDNN fwd / bwd ms | flash fwd / bwd ms | rel err dq / dk / dv |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        f = lambda key, d=1: f"{r[key]:.{d}f}" if isinstance(r.get(key), float) else "-"  # noqa: E731
        tiles = f"{'x'.join(map(str, r['bwd_q_tile']))} / {'x'.join(map(str, r['bwd_kv_tile']))}"
        lines.append(
            f"| {r['case']} | {tiles} | {f('fwd_ms')} | {f('bwd_ms')} | "
            f"{f('bwd_over_fwd', 2)} | {f('realised_bwd_speedup', 2)} / {f('sim_speedup_mean', 2)} | "
            f"{f('flex_fwd_ms')} / {f('flex_bwd_ms')} | "
            f"{f('sdpa_cudnn_fwd_ms')} / {f('sdpa_cudnn_bwd_ms')} | "
            f"{f('sdpa_flash_fwd_ms')} / {f('sdpa_flash_bwd_ms')} | "
            f"{f('rel_err_dq', 4)} / {f('rel_err_dk', 4)} / {f('rel_err_dv', 4)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--tune", action="store_true", help="sweep backward tiles and launch options instead")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take minutes)")
    parser.add_argument("--no-check", action="store_true", help="skip the float32 gradient check")
    parser.add_argument("--budget-s", type=float, default=TUNE_BUDGET_S,
                        help="--tune: start no new variant after this many seconds")
    parser.add_argument("--variant", type=Path, default=None,
                        help="run the table with the winner of this --tune JSON (tiles and launch options)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"table rows, joined by ',' (default: {','.join(CASES)}); FlexAttention runs in this order")
    parser.add_argument("--layout", action="append", default=[],
                        help="SHAPE:WINDOW:STRIDE[:DILATION] (repeatable): time these layouts, ours beside Flex, "
                             "instead of the table")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = environment()
    device = record["device"].replace(" ", "_")
    if args.tune:
        path = args.out / f"backward-tune-{device}-{record['date']}.json"
        result = tune(args.budget_s, lambda result: path.write_text(json.dumps({**record, **result}, indent=1)))
        print(f"winner: {json.dumps(result['winner'])}; skipped {len(result['skipped'])} variants; wrote {path}")
        return
    if args.variant is not None:
        record["variant"] = use_variant(args.variant)
    if args.layout:
        problems = [parse_layout(text) for text in args.layout]
        path = args.out / f"backward-layouts-{device}-{record['date']}.json"
        rows = run_layouts(problems, not args.no_flex, not args.no_check,
                           lambda rows: path.write_text(json.dumps({**record, "rows": rows}, indent=1)))
        print(table(rows))
        return
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in cases if name not in CASES]
    if unknown:
        raise SystemExit(f"--cases takes names from {','.join(CASES)}, got {unknown}.")
    path = args.out / f"backward-{device}-{record['date']}.json"
    rows = run(cases, not args.no_flex, not args.no_check,
               lambda rows: path.write_text(json.dumps({**record, "rows": rows}, indent=1)))
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
