"""GNA backward on the GPU: forward and forward + backward against SDPA (cuDNN, flash) and FlexAttention.

    python benchmarks/backward.py --out benchmarks/results           # the issue-13 table (HunyuanVideo)
    python benchmarks/backward.py --out DIR --tune                   # backward tiles and launch options

HunyuanVideo 30x48x80, 24 heads, head_dim 128, bf16, window 18x24x24 at strides 1x1x1, 1x8x8 and 16x8x8,
and dense attention. Ours: `gna_attention` with q, k, v requiring grad (the registered operator, its
backward through `natsim::gna_backward`: permute, three kernels, unpermute); the backward alone is timed
with `retain_graph`, and the backward kernels alone on permuted tensors. SDPA runs dense attention;
FlexAttention gets the identical element mask on the forward's permuted tiles (benchmarks/gna.py's
`flex_block_mask`: partial and full 128x128 blocks plus a mask_mod) and is timed forward and forward +
backward. Gradients are checked on two heads of the full layout against the float32 chunked reference
(`reference_gradients`). Simulated speedups are the backward tiles' (`natsim.simulate_backward`): the
dK/dV kernel's KV-major counts and the dQ kernel's Q-major counts, relative to dense attention.
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
from natsim.kernels.gna_backward import backward_permuted, backward_tiles
from natsim.kernels.gna_launch import dense_as_1d, forward
from natsim.kernels.reference import reference_gradients

HEADS, HEAD_DIM, DTYPE = 24, 128, torch.bfloat16
SHAPE, WINDOW = (30, 48, 80), (18, 24, 24)
STRIDES = [(1, 1, 1), (1, 8, 8), (16, 8, 8)]
FLEX_TILE = (2, 8, 8)
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
    args = dict(window=problem.window, stride=problem.stride)
    row = {}
    with torch.no_grad():
        row["fwd_ms"] = bench(lambda: gna_attention(q, k, v, **args))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = gna_attention(qg, kg, vg, **args)
    grads = torch.autograd.grad(out, (qg, kg, vg), g, retain_graph=True)
    row["bwd_ms"] = bench(lambda: torch.autograd.grad(out, (qg, kg, vg), g, retain_graph=True))
    row["fwd_bwd_ms"] = bench(lambda: torch.autograd.grad(gna_attention(qg, kg, vg, **args), (qg, kg, vg), g))

    # The backward kernels alone (delta, dK/dV, dQ) on permuted tensors: what the permutations add.
    kernel_problem = dense_as_1d(problem) or problem
    q_tile, kv_tile = backward_tiles(kernel_problem, HEAD_DIM)
    flat = lambda t: t.reshape(1, *kernel_problem.shape, *t.shape[-2:])  # noqa: E731
    _, lse = forward(q, k, v, problem.window, problem.stride, 1, False, None, None, None, True)
    qp, op, gp = (permute(flat(t), q_tile) for t in (q, out.detach(), g))
    kp, vp = (permute(flat(t), kv_tile) for t in (k, v))
    lp = permute(flat(lse[..., None]), q_tile)[..., 0].contiguous()
    scale = HEAD_DIM**-0.5
    row["bwd_kernels_ms"] = bench(lambda: backward_permuted(qp, kp, vp, op, lp, gp, None, kernel_problem, q_tile,
                                                            kv_tile, scale))
    return row, grads


def check(problem, q, k, v, g, grads) -> dict:
    """Relative errors of our gradients on the first heads against the float32 chunked reference."""
    heads = slice(0, CHECK_HEADS)
    want = reference_gradients(*(t[..., heads, :] for t in (q, k, v, g)), problem.window, problem.stride)
    return {f"rel_err_{name}": rel(got[..., heads, :], ref) for name, got, ref in zip(("dq", "dk", "dv"), grads, want)}


def flex(problem, q, k, v, g) -> dict:
    """FlexAttention forward and forward + backward under the same element mask, on permuted tokens."""
    from gna import flex_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    row = {}
    try:
        t0 = time.time()
        fq, fk, fv, fg = (permute(t, FLEX_TILE).transpose(1, 2).contiguous() for t in (q, k, v, g))
        block_mask = flex_block_mask(problem, FLEX_TILE, fq.shape[2])
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


def run(with_flex: bool, with_check: bool, save) -> list[dict]:
    """Every row: ours and SDPA first, then FlexAttention (its compiles take longest); `save(rows)` after each
    step, so that a run cut short keeps what it measured."""
    q, k, v, g = inputs(SHAPE)
    baseline = sdpa(q, k, v, g)
    print(json.dumps(baseline), flush=True)
    cases = [((1, 1, 1), SHAPE)] + [(s, WINDOW) for s in STRIDES]
    rows = []
    for stride, window in cases:
        problem = natsim.Problem(SHAPE, window, stride)
        row = {"case": "dense" if window == SHAPE else "x".join(map(str, stride)), "shape": list(SHAPE),
               "window": list(window), "stride": list(stride), "heads": HEADS, "head_dim": HEAD_DIM,
               "dtype": str(DTYPE), **simulated(problem), **baseline}
        try:
            timings, grads = ours(problem, q, k, v, g)
            row.update(timings)
            row["bwd_over_fwd"] = row["bwd_ms"] / row["fwd_ms"]
            dense_bwd = rows[0].get("bwd_ms") if rows else row["bwd_ms"]
            if dense_bwd is not None:
                row["realised_bwd_speedup"] = dense_bwd / row["bwd_ms"]
            if with_check:
                row.update(check(problem, q, k, v, g, grads))
            del grads
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"[:500]
        print(json.dumps(row), flush=True)
        rows.append(row)
        save(rows)
    if with_flex:
        for row in rows:
            row.update(flex(natsim.Problem(SHAPE, tuple(row["window"]), tuple(row["stride"])), q, k, v, g))
            if "flex_bwd_ms" in row and "bwd_ms" in row:
                row["flex_bwd_over_ours"] = row["flex_bwd_ms"] / row["bwd_ms"]
            print(json.dumps(row), flush=True)
            save(rows)
    return rows


TUNE = [  # (q tile, kv tile, options) for the backward kernels; ATOMIC_DQ: dQ by atomics; USE_TMA: descriptors
    ((1, 8, 8), (2, 8, 8), {}),
    ((1, 8, 8), (2, 8, 8), dict(num_warps=4, num_stages=2)),
    ((1, 8, 8), (2, 8, 8), dict(num_warps=8, num_stages=3)),
    ((1, 8, 8), (2, 8, 8), dict(ATOMIC_DQ=True)),
    ((1, 8, 8), (2, 8, 8), dict(USE_TMA=True)),
    ((1, 8, 8), (2, 8, 8), dict(USE_TMA=True, ATOMIC_DQ=True)),
    ((1, 8, 8), (2, 8, 8), dict(USE_TMA=True, num_warps=4)),
    ((1, 8, 8), (2, 8, 8), dict(ATOMIC_DQ=True, num_warps=4)),
    ((1, 4, 8), (2, 8, 8), dict(num_warps=4)),
    ((1, 4, 8), (2, 8, 8), dict(num_warps=8)),
    ((1, 4, 8), (2, 8, 8), dict(ATOMIC_DQ=True, num_warps=8)),
    ((2, 8, 8), (2, 8, 8), dict(num_warps=8)),
    ((1, 8, 8), (1, 8, 8), dict(num_warps=4)),
    ((2, 8, 8), (1, 8, 8), dict(num_warps=8)),
]


def tune() -> list[dict]:
    """Backward kernels alone on permuted tensors for each (tiles, options) at strides 1x1x1 and 16x8x8."""
    q, k, v, g = inputs(SHAPE)
    rows = []
    for stride in [(1, 1, 1), (16, 8, 8)]:
        problem = natsim.Problem(SHAPE, WINDOW, stride)
        out, lse = forward(q, k, v, WINDOW, stride, 1, False, None, None, None, True)
        reference = None
        for q_tile, kv_tile, options in TUNE:
            row = {"stride": list(stride), "q_tile": list(q_tile), "kv_tile": list(kv_tile), "options": options}
            try:
                qp, op, gp = (permute(t, q_tile) for t in (q, out, g))
                kp, vp = (permute(t, kv_tile) for t in (k, v))
                lp = permute(lse[..., None], q_tile)[..., 0].contiguous()
                call = lambda: backward_permuted(qp, kp, vp, op, lp, gp, None, problem, q_tile, kv_tile,  # noqa: E731
                                                 HEAD_DIM**-0.5, options=options)
                dq = call()[0][:, :1024].float()
                row["ms"] = bench(call)
                row["sim_speedup_mean"] = natsim.simulate_backward(problem, natsim.TileConfig(q_tile, kv_tile)) \
                    .tile_speedup_mean
                if q_tile == TUNE[0][0]:  # same permutation of q: the first tokens' dq compare directly
                    reference = dq if reference is None else reference
                    row["rel_diff_dq_first_tokens"] = rel(dq, reference)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def environment() -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat()}


def table(rows) -> str:
    head = ("| case | bwd tiles | ours fwd ms | ours bwd ms (kernels) | bwd / fwd | realised / simulated bwd speedup | "
            "flex fwd / bwd ms | cuDNN fwd / bwd ms | flash fwd / bwd ms | rel err dq / dk / dv |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        f = lambda key, d=1: f"{r[key]:.{d}f}" if isinstance(r.get(key), float) else "-"  # noqa: E731
        tiles = f"{'x'.join(map(str, r['bwd_q_tile']))} / {'x'.join(map(str, r['bwd_kv_tile']))}"
        lines.append(
            f"| {r['case']} | {tiles} | {f('fwd_ms')} | {f('bwd_ms')} ({f('bwd_kernels_ms')}) | "
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
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = environment()
    device = record["device"].replace(" ", "_")
    if args.tune:
        record["rows"] = tune()
        (args.out / f"backward-tune-{device}-{record['date']}.json").write_text(json.dumps(record, indent=1))
        return
    path = args.out / f"backward-{device}-{record['date']}.json"
    rows = run(not args.no_flex, not args.no_check, lambda rows: path.write_text(json.dumps({**record, "rows": rows},
                                                                                           indent=1)))
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
