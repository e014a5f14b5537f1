"""Head dims that are not powers of two: natsim's Triton GNA forward padded against split, in useful TFLOP/s.

    python benchmarks/headdim.py --out benchmarks/results             # H100: the table that sets PADDED_WIDTHS
    python benchmarks/headdim.py --out DIR --widths 72,96 --cases dense
    python benchmarks/headdim.py --out DIR --small                    # CPU interpreter, tiny shapes, seconds
    python benchmarks/headdim.py --out DIR --cases hunyuan-1x1x1 --aligned-rows   # each head's row 128-byte aligned
    python benchmarks/headdim.py --out DIR --cases hunyuan-1x1x1 --rows given,aligned,copied,natsim   # row layouts

A head dim that is not a power of two runs in column chunks (kernels/common/headdim.py): padded to the next power
of two ("pad") or split into two power-of-two chunks ("split", 72 = 64 + 16, 96 = 64 + 32). For each case (GNA in
place at HunyuanVideo's layout, block-sparse and neighborhood attention, the same neighborhood and the Wan 720p
plan on the dynamic KV tiling kernel, and dense attention over one 32,768-token sequence) and each width,
`gna_attention` runs on natsim's kernels (its own tiles and data path, as a user's call) once with every width
padded and once with every width split where a split computes fewer columns (`PADDED_WIDTHS` set for the run, the
call cache emptied between the two), and is timed with `triton.testing.do_bench` (median). Useful TFLOP/s count the
attended (query, key) pairs at the true head dim, `4 * pairs * head_dim * heads`; each row also gives its
throughput over head_dim 128's (the target: at least 0.85 at 72 and 96). The two strategies' outputs are held
against each other and, on a small problem, against the float64 reference before anything is timed. Set
`PADDED_WIDTHS` to the widths whose "pad" row is faster (or `PADDED_LAUNCHES` to the launches, KV tiling and query
tile, where padding is faster at every width).

Writes `headdim-<device>-<date>.json` (`headdim-small.json` with --small) with the device, torch and Triton
versions and the date, and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

if "--small" in sys.argv[1:] and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before natsim.kernels is imported

import torch
import triton

import natsim
from natsim.kernels import gna_attention, reference_attention
from natsim.kernels.common import headdim
from natsim.kernels.common import rows as head_rows
from natsim.kernels.gna import dispatch

WIDTHS = (40, 64, 72, 88, 96, 112, 128)
# q, k, v as made (natsim's copy into aligned rows off); made in aligned rows; copied into them by the caller in each
# call; as made, natsim copying where its table says (kernels/common/rows.py: what a user's call does)
ROW_LAYOUTS = ("given", "aligned", "copied", "natsim")
HEADS, DTYPE = 24, torch.bfloat16
# case: (shape, window, stride, plan options of gna_attention: tiles and KV tiling, {} for its defaults); dense
# attention is its layout as the window. The dynamic cases run the dynamic KV tiling kernel: Wan 720p as the planner
# plans Wan 1.3B at 0.9 (benchmarks/wan_ulysses.py), and HunyuanVideo's stride-1 window.
DYNAMIC = {"kv_tiling": "dynamic"}
CASES = {
    "hunyuan-16x8x8": ((30, 48, 80), (18, 24, 24), (16, 8, 8), {}),
    "hunyuan-1x1x1": ((30, 48, 80), (18, 24, 24), (1, 1, 1), {}),
    "dense": ((32768,), (32768,), (1,), {}),
    "wan720-plan": ((21, 45, 80), (10, 23, 32), (1, 8, 16),
                    {"q_tile": (1, 8, 16), "kv_tile": (1, 8, 16), **DYNAMIC}),
    "hunyuan-1x1x1-dynamic": ((30, 48, 80), (18, 24, 24), (1, 1, 1), DYNAMIC),
}
SMALL_CASES = {
    "small-gna": ((4, 6, 8), (3, 3, 5), (1, 2, 2), {}),
    "small-dense": ((96,), (96,), (1,), {}),
    "small-dynamic": ((4, 6, 8), (3, 3, 5), (1, 1, 1), DYNAMIC),
}
SMALL_WIDTHS = (40, 72)


@contextlib.contextmanager
def strategy(name: str, copies: bool = False):
    """Every width padded ("pad") or split where that computes fewer columns ("split") while inside, on fresh
    calls (the dispatcher keeps a call's chunks with it); no launch pads by default (`PADDED_LAUNCHES`) meanwhile,
    and none copies rows into aligned ones (`ALIGNED_ROW_LAUNCHES`) unless `copies`."""
    saved = headdim.PADDED_WIDTHS, headdim.PADDED_LAUNCHES, head_rows.ALIGNED_ROW_LAUNCHES
    headdim.PADDED_WIDTHS = frozenset(headdim.HEAD_DIMS) if name == "pad" else frozenset()
    headdim.PADDED_LAUNCHES = frozenset()
    if not copies:
        head_rows.ALIGNED_ROW_LAUNCHES = frozenset()
    dispatch._calls.clear()
    try:
        yield
    finally:
        headdim.PADDED_WIDTHS, headdim.PADDED_LAUNCHES, head_rows.ALIGNED_ROW_LAUNCHES = saved
        dispatch._calls.clear()


def strategies(head_dim: int) -> tuple[str, ...]:
    """The strategies that differ at `head_dim`: both where a split computes fewer columns, else padding alone."""
    return ("pad", "split") if headdim.head_split(head_dim, "split").b else ("pad",)


def timed(fn, small: bool) -> float:
    """Median milliseconds (one run after a warm-up one in the interpreter, which has no CUDA events)."""
    if small:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_small(head_dim: int, device: str, dtype: torch.dtype) -> float:
    """The largest relative error against the float64 reference of the strategies at `head_dim`, on a small
    problem with partial tiles and padding."""
    torch.manual_seed(head_dim)
    q, k, v = (torch.randn(1, 5, 7, 9, 2, head_dim, device=device, dtype=dtype) for _ in range(3))
    ref = reference_attention(q.double(), k.double(), v.double(), (3, 4, 5), (1, 2, 2))
    errors = []
    for name in strategies(head_dim):
        with strategy(name):
            errors.append(rel(gna_attention(q, k, v, (3, 4, 5), (1, 2, 2), backend="triton"), ref))
    return max(errors)


def inputs(shape, heads: int, head_dim: int, device: str, dtype: torch.dtype, aligned: bool) -> tuple:
    """Random q, k, v `[1, *shape, heads, head_dim]`; `aligned`: views of the first head_dim channels of wider
    heads (natsim's `aligned_rows`), so that every head's row starts on a 128-byte boundary."""
    size = (1, *shape, heads, head_dim)
    if not aligned:
        return tuple(torch.randn(size, device=device, dtype=dtype) for _ in range(3))
    return tuple(head_rows.aligned_rows(size, dtype, device).normal_() for _ in range(3))


def run_case(case: str, shape, window, stride, options: dict, head_dim: int, heads: int, device: str,
             dtype: torch.dtype, small: bool, layouts: tuple[str, ...] = ("given",)) -> list[dict]:
    """One row per strategy and row layout (`ROW_LAYOUTS`) at `head_dim`: milliseconds, useful TFLOP/s, the
    chunks run. "copied" times the copy of q, k and v into aligned rows with the call."""
    problem = natsim.Problem(shape, window, stride)
    tile = (1,) * (len(shape) - 1) + (16,)  # any tile: the attended pairs are the mask's
    pairs = natsim.simulate(problem, natsim.TileConfig(tile, tile)).attended_pairs
    useful = 4.0 * pairs * head_dim * heads
    torch.manual_seed(0)
    made = {aligned: inputs(shape, heads, head_dim, device, dtype, aligned)
            for aligned in {layout == "aligned" for layout in layouts}}
    rows, outputs = [], []
    for layout in layouts:
        q, k, v = made[layout == "aligned"]
        prepare = head_rows.in_aligned_rows if layout == "copied" else (lambda t: t)
        for name in strategies(head_dim):
            with strategy(name, copies=layout == "natsim"), torch.no_grad():
                split = headdim.head_split(head_dim)
                run = lambda: gna_attention(prepare(q), prepare(k), prepare(v), window, stride,  # noqa: E731
                                            backend="triton", **options)
                outputs.append((layout, run()))
                ms = timed(run, small)
            rows.append({"case": case, "shape": list(shape), "window": list(window), "stride": list(stride),
                         "plan": {key: list(v) if isinstance(v, tuple) else v for key, v in options.items()},
                         "heads": heads, "head_dim": head_dim, "strategy": name, "chunks": [split.a, split.b],
                         "computed_width": split.width, "rows": layout, "aligned_rows": layout in ("aligned", "copied"),
                         "ms": ms, "useful_tflops": useful / ms / 1e9})
    for aligned in made:  # outputs of one set of inputs must agree
        group = [out for layout, out in outputs if (layout == "aligned") == aligned]
        agreement = max(rel(out, group[0]) for out in group)
        for row in rows:
            if (row["rows"] == "aligned") == aligned:
                row["pad_vs_split_rel_error"] = agreement
        if agreement > 2e-2:
            raise SystemExit(f"{case} at head_dim {head_dim}: the strategies' outputs differ by {agreement:.2e}.")
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's useful TFLOP/s over its case's at head_dim 128 in the same row layout, where timed."""
    base = {(r["case"], r["rows"]): r["useful_tflops"] for r in rows if r["head_dim"] == 128}
    for row in rows:
        if (row["case"], row["rows"]) in base:
            row["of_128"] = row["useful_tflops"] / base[row["case"], row["rows"]]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| case | head_dim | rows | strategy | chunks | ms | useful TFLOP/s | of head_dim 128 |",
             "|" + "---|" * 8]
    for r in rows:
        ratio = f"{r['of_128']:.2f}" if "of_128" in r else "-"
        lines.append(f"| {r['case']} | {r['head_dim']} | {r['rows']} | {r['strategy']} | "
                     f"{r['chunks'][0]}+{r['chunks'][1]} | {r['ms']:.3f} | {r['useful_tflops']:.3g} | {ratio} |")
    return "\n".join(lines)


def environment(small: bool) -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "small": small}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--widths", default=None, help=f"head dims, comma-separated (default {WIDTHS})")
    parser.add_argument("--cases", default=None, help=f"cases, comma-separated (default {','.join(CASES)})")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU in Triton's interpreter")
    parser.add_argument("--aligned-rows", action="store_true",
                        help="q, k, v as views of wider heads (natsim's aligned_rows), so that "
                             "each head's row starts on a 128-byte boundary (do misaligned rows slow 40, 72, 88?); "
                             "the same as --rows aligned")
    parser.add_argument("--rows", default=None,
                        help=f"row layouts to time, comma-separated, from {','.join(ROW_LAYOUTS)}: q, k, v as made "
                             "(given), made in aligned rows (aligned), copied into aligned rows in each call (copied), "
                             "as made with natsim's own copy where it makes one (natsim)")
    args = parser.parse_args(argv)
    layouts = tuple(args.rows.split(",")) if args.rows else ("aligned",) if args.aligned_rows else ("given",)
    if args.aligned_rows and args.rows:
        raise SystemExit("pass --aligned-rows or --rows, not both.")
    if unknown := [layout for layout in layouts if layout not in ROW_LAYOUTS]:
        raise SystemExit(f"--rows takes {', '.join(ROW_LAYOUTS)}; got {', '.join(unknown)}.")
    if args.small:
        cases, widths, device, dtype, heads = SMALL_CASES, SMALL_WIDTHS, "cpu", torch.float16, 1
        if torch.cuda.is_available():
            device = "cuda"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/headdim.py needs a CUDA GPU; use --small for the CPU run.")
        cases, widths, device, dtype, heads = CASES, WIDTHS, "cuda", DTYPE, args.heads
    if args.widths:
        widths = tuple(int(w) for w in args.widths.split(","))
    if args.cases:
        cases = {name: cases[name] for name in args.cases.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    rows, checks = [], {}
    for head_dim in widths:
        checks[head_dim] = check_small(head_dim, device, dtype)
        if checks[head_dim] > 2e-2:
            raise SystemExit(f"head_dim {head_dim}: {checks[head_dim]:.2e} from the float64 reference.")
    for case, (shape, window, stride, options) in cases.items():
        for head_dim in widths:
            for row in run_case(case, shape, window, stride, options, head_dim, heads, device, dtype, args.small,
                                layouts):
                print(json.dumps(row), flush=True)
                rows.append(row)
    record = {**environment(args.small), "reference_rel_error": checks, "rows": with_ratios(rows)}
    suffix = "" if layouts == ("given",) else "-" + "-".join(layouts)
    name = (f"headdim-small{suffix}.json" if args.small
            else f"headdim-{record['device'].replace(' ', '_')}-{record['date']}{suffix}.json")
    (args.out / name).write_text(json.dumps(record, indent=1))
    print(table(rows))
    return record


if __name__ == "__main__":
    main()
