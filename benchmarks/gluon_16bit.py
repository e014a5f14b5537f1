"""The Gluon kernel's 16-bit variant (kernels/gluon/forward.py on bf16 operands, no quantization) beside the
bf16 peers and its FP8 self, one run, one JSON:

    python benchmarks/gluon_16bit.py OUT_DIR [--rounds 7] [--tag -x]

First its accuracy on small calls (bf16 and fp16; dense, random block masks with empty rows, GNA partial tiles with
padding; head_dim 64 and 128; the output and the LSE against float32 attention under the same mask). Then, batch 1,
bf16: dense attention over 32,768 tokens (24 heads of 128, and of 64); random 128 x 128 masks at 70 % and 90 %;
HunyuanVideo's GNA block mask (30x48x80, window 18x24x24, stride 16x8x8, tiles 2x8x8, every visited tile whole)
on tokens in the tile order; and neighbourhoods whose tiles are partial: Wan 2.1's 720p latent (21x45x80, 40
heads) at window 7x21x35 and HunyuanVideo's at 18x24x24, stride 1, on natsim's 128-token tile that visits the
fewest blocks, the permutation into its order and back included. Per row, median ms over interleaved rounds
(benchmarks/timing.py) of the 16-bit Gluon kernel, natsim's Triton kernel, natsim's own choice for the call,
FlashAttention-4 bf16 where installed and the call's blocks are whole, SDPA cuDNN on dense rows, and the Gluon
FP8 call. Writes OUT_DIR/gluon-16bit-<gpu>-<date><tag>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gluon import case_blocks, fa4_installed  # noqa: E402
from fp8_gluon_partial import gluon_tile  # noqa: E402
from sparse import sdpa_cudnn  # noqa: E402
from timing import interleaved, rel, write_json  # noqa: E402

from natsim import Problem  # noqa: E402
from natsim.kernels import gna_attention, prepare_sparse, reference_attention, sparse_attention  # noqa: E402
from natsim.kernels import sparse_reference  # noqa: E402
from natsim.kernels.gluon import forward as gluon  # noqa: E402
from natsim.kernels.gluon.ops import fp8_block_attention  # noqa: E402
from natsim.kernels.gluon.tile_mask import gna_block_lists, gna_tile_mask  # noqa: E402
from natsim.kernels.gna.permute import permute, unpermute  # noqa: E402

TOKENS, HEADS = 32768, 24


def gna_16bit(q, k, v, problem: Problem, tile: tuple[int, ...], return_lse: bool = False):
    """GNA of `problem` on the 16-bit Gluon kernel: q, k, v `[B, *shape, H, D]` moved into `tile`'s order, the
    simulator's visited blocks as lists, partial ones masked inside; the output (and LSE) back on the layout."""
    lists, partial = gna_block_lists(problem, tile, q.device)
    mask = gna_tile_mask(problem, tile, q.device) if partial else None
    dilation = problem.dilation
    qp, kp, vp = (permute(t, tile, dilation) for t in (q, k, v))
    out, lse = gluon.launch_16bit(qp, kp, vp, lists, q.shape[-1] ** -0.5, return_lse, mask)
    out = unpermute(out, problem.shape, tile, dilation)
    if return_lse:
        lse = unpermute(lse[..., None], problem.shape, tile, dilation)[..., 0]
    return out, lse


def accuracy() -> list[dict]:
    """The 16-bit kernel against float32 attention under the same mask on small calls."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            for tokens, density in ((1000, 1.0), (1280, 0.4), (700, 0.2)):
                q, k, v = (torch.randn(2, tokens, 3, head_dim, device="cuda", dtype=dtype, generator=gen)
                           for _ in range(3))
                blocks = triton.cdiv(tokens, 128)
                mask = torch.rand(2, 3, blocks, blocks, device="cuda", generator=gen) < density
                mask[0, 0, 0] = False  # a query block with no key
                lists = None if density == 1.0 else gluon.BlockLists.from_blocks(mask)
                out, lse = gluon.launch_16bit(q, k, v, lists, head_dim ** -0.5, True)
                ref, ref_lse = sparse_reference(q.float(), k.float(), v.float(),
                                                torch.ones_like(mask) if lists is None else mask, 128, 128,
                                                return_lse=True)
                finite = torch.isfinite(ref_lse)
                rows.append(dict(case=f"mask {tokens} tokens, density {density}", dtype=str(dtype),
                                 head_dim=head_dim, relative_error=rel(out, ref),
                                 lse_max_error=float((lse[finite] - ref_lse[finite]).abs().max()),
                                 lse_empty_rows_agree=bool(torch.equal(torch.isfinite(lse), finite))))
            for shape, window, stride, dilation, causal in (((6, 10, 13), (3, 5, 7), (1, 2, 3), (2, 1, 1),
                                                             (True, False, False)),
                                                            ((24, 33), (9, 12), (1, 1), (1, 2), (False, False))):
                problem = Problem(shape, window, stride, dilation, causal)
                q, k, v = (torch.randn(1, *shape, 2, head_dim, device="cuda", dtype=dtype, generator=gen)
                           for _ in range(3))
                tile = gluon_tile(problem, head_dim)
                out, lse = gna_16bit(q, k, v, problem, tile, return_lse=True)
                ref, ref_lse = reference_attention(q.float(), k.float(), v.float(), window, stride, dilation,
                                                   causal, return_lse=True)
                rows.append(dict(case=f"gna {shape} window {window} tile {tile}", dtype=str(dtype),
                                 head_dim=head_dim, relative_error=rel(out, ref),
                                 lse_max_error=float((lse - ref_lse).abs().max())))
    return rows


def _output(result):
    """A call's output where it also returns its LSE."""
    return result[0] if isinstance(result, tuple) else result


def _split_release(fn):
    """`fn` with the FP8 kernel releasing K after Q K^T (as the 16-bit one does) rather than with V."""
    def run():
        gluon.SPLIT_RELEASE = True
        try:
            return fn()
        finally:
            gluon.SPLIT_RELEASE = False
    return run


def mask_timers(q, k, v, blocks) -> dict:
    dense = bool(blocks.all())
    lists = None if dense else gluon.BlockLists.from_blocks(blocks)
    scale = q.shape[-1] ** -0.5
    tokens = q.shape[1]
    out = {"gluon 16-bit": lambda: gluon.launch_16bit(q, k, v, lists, scale, False)[0],
           "gluon fp8": lambda: fp8_block_attention(q, k, v, lists),
           "gluon fp8, split release": _split_release(lambda: fp8_block_attention(q, k, v, lists))}
    if dense:
        out["natsim triton"] = lambda: gna_attention(q, k, v, (tokens,), backend="triton")
        out["natsim default"] = lambda: gna_attention(q, k, v, (tokens,))
        out["cudnn"] = lambda: sdpa_cudnn(q, k, v).transpose(1, 2)  # [B, H, N, D] back to natsim's layout
        if fa4_installed():
            from flash_attn.cute.interface import flash_attn_func
            out["fa4"] = lambda: _output(flash_attn_func(q, k, v))
    else:
        work = prepare_sparse(blocks, 128, 128, tokens, backend="triton", backward=False)
        out["natsim triton"] = lambda: sparse_attention(q, k, v, work)
        if fa4_installed():
            fa4_work = prepare_sparse(blocks, 128, 128, tokens, backend="fa4", backward=False)
            out["fa4"] = lambda: sparse_attention(q, k, v, fa4_work)
    return out


def gna_timers(q, k, v, problem: Problem, head_dim: int) -> tuple[dict, tuple[int, ...]]:
    tile = gluon_tile(problem, head_dim)
    geometry = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal)
    lists, partial = gna_block_lists(problem, tile, q.device)
    mask = gna_tile_mask(problem, tile, q.device) if partial else None
    qp, kp, vp = (permute(t, tile, problem.dilation) for t in (q, k, v))
    out = {"gluon 16-bit": lambda: gna_16bit(q, k, v, problem, tile)[0],
           "gluon 16-bit kernel": lambda: gluon.launch_16bit(qp, kp, vp, lists, q.shape[-1] ** -0.5, False, mask),
           "natsim triton": lambda: gna_attention(q, k, v, backend="triton", **geometry),
           "natsim default": lambda: gna_attention(q, k, v, **geometry),
           "gluon fp8": lambda: gna_attention(q, k, v, q_tile=tile, kv_tile=tile, precision="fp8", backend="gluon",
                                              **geometry)}
    return out, tile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tag", default="")
    parser.add_argument("--no-accuracy", action="store_true", help="time only")
    parser.add_argument("--cases", help="comma-separated row numbers (from 0) to time; all by default")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), fa4=fa4_installed(),
                  accuracy=[] if args.no_accuracy else accuracy(), rows=[])
    for row in result["accuracy"]:
        print(json.dumps(row), flush=True)
    cases = [("dense 32k", TOKENS, HEADS, 128, None), ("dense 32k, hd64", TOKENS, HEADS, 64, None),
             ("random 70%", TOKENS, HEADS, 128, 0.7), ("random 90%", TOKENS, HEADS, 128, 0.9),
             ("hunyuan 16x8x8 tile order", 30 * 48 * 80, HEADS, 128, "hunyuan"),
             ("wan 720p, window 7x21x35", (21, 45, 80), 40, 128, Problem((21, 45, 80), (7, 21, 35))),
             ("hunyuan 720p, window 18x24x24", (30, 48, 80), 24, 128, Problem((30, 48, 80), (18, 24, 24)))]
    chosen = cases if args.cases is None else [cases[int(i)] for i in args.cases.split(",")]
    for name, tokens, heads, head_dim, kind in chosen:
        gen = torch.Generator(device="cuda").manual_seed(0)
        layout = tokens if isinstance(tokens, tuple) else (tokens,)
        q, k, v = (torch.randn(1, *layout, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        tile = None
        if isinstance(kind, Problem):
            calls, tile = gna_timers(q, k, v, kind, head_dim)
        else:
            calls = mask_timers(q, k, v, case_blocks(tokens, kind))
        reference = calls["natsim triton"]
        outputs = {key: fn() for key, fn in calls.items()}
        expected = reference()
        rounds = interleaved(calls, args.rounds, 200.0, torch.cuda.synchronize)
        ms = {key: statistics.median(values) for key, values in rounds.items()}
        row = dict(case=name, heads=heads, head_dim=head_dim, tile=tile and list(tile), ms=ms,
                   against_triton={key: rel(_output(out), _output(expected)) for key, out in outputs.items()
                                   if _output(out).shape == _output(expected).shape},  # not those in tile order
                   over_gluon_16bit={key: t / ms["gluon 16-bit"] for key, t in ms.items()})
        if kind is None:
            flops = 4 * tokens * tokens * head_dim * heads  # Q K^T and P V
            row["tflops"] = {key: flops / (t * 1e-3) / 1e12 for key, t in ms.items()}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, outputs, expected
        torch.cuda.empty_cache()
    write_json(args.out, f"gluon-16bit-{device}-{result['date']}{args.tag}", result)
    for row in result["rows"]:
        cells = "  ".join(f"{key} {t:.2f} ({row['over_gluon_16bit'][key]:.2f}x)" for key, t in row["ms"].items())
        print(f"{row['case']:30s} {cells}")
    if not result["accuracy"]:
        return
    worst = max(result["accuracy"], key=lambda r: r["relative_error"])
    print(f"accuracy: worst relative error {worst['relative_error']:.2e} ({worst['case']}, {worst['dtype']}, "
          f"hd {worst['head_dim']}); worst LSE error {max(r['lse_max_error'] for r in result['accuracy']):.2e}")


if __name__ == "__main__":
    main()
