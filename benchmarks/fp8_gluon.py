"""The warp-specialized Gluon FP8 kernel (kernels/gluon/forward.py) beside the bf16 peers, one run, one JSON:

    python benchmarks/fp8_gluon.py OUT_DIR

Rows (24 heads of 128, bf16 inputs, batch 1): dense attention over 32,768 tokens; random 128 x 128 block masks
at 70 % and 90 % sparsity over 32,768 tokens; HunyuanVideo's GNA mask (30x48x80, window 18x24x24, stride
16x8x8, tiles 2x8x8: every visited tile full) on tokens in the tile order. Per row, median ms over interleaved
rounds (benchmarks/timing.py) of: the Gluon FP8 call (quantization included) and its kernel alone on quantized
tensors; natsim's Triton FP8 and bf16 kernels; FlashAttention-4 bf16 on the same block mask (where installed);
SDPA cuDNN dense. Accuracy of the Gluon call against float32 attention on the first two heads. Writes
OUT_DIR/fp8-gluon-<gpu>-<date>.json and prints the table with each time's ratio to FlashAttention-4 bf16.
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
from sparse import sdpa_cudnn  # noqa: E402
from timing import interleaved, rel  # noqa: E402

import natsim  # noqa: E402
from natsim.kernels import gna_attention, prepare_sparse, sparse_attention, sparse_reference  # noqa: E402
from natsim.kernels.common.fp8 import quantize  # noqa: E402
from natsim.kernels.gluon import forward as gluon  # noqa: E402
from natsim.kernels.gluon.ops import fp8_block_attention  # noqa: E402

TOKENS, HEADS, HEAD_DIM = 32768, 24, 128


def random_blocks(tokens: int, sparsity: float, seed: int) -> torch.Tensor:
    blocks = tokens // 128
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, HEADS, blocks, blocks, generator=gen) >= sparsity
    return (mask | torch.eye(blocks, dtype=torch.bool)).cuda()


def hunyuan_blocks() -> torch.Tensor:
    problem = natsim.Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    mask = natsim.block_mask(problem, natsim.TileConfig((2, 8, 8), (2, 8, 8)))
    assert mask.to_dense().sum() == mask.full_dense().sum()  # whole tiles only
    return torch.from_numpy(mask.to_dense())[None, None].cuda()


def case_blocks(tokens: int, kind) -> torch.Tensor:
    """A row's block mask: every block (`kind` None), HunyuanVideo's GNA mask ("hunyuan"), or random blocks at the
    sparsity `kind`."""
    if kind is None:
        return torch.ones(1, 1, tokens // 128, tokens // 128, dtype=torch.bool, device="cuda")
    if kind == "hunyuan":
        return hunyuan_blocks()
    return random_blocks(tokens, kind, seed=1)


def fa4_installed() -> bool:
    from natsim.kernels.fa4.library import unavailable
    return unavailable(torch.device("cuda")) is None


def timers(q, k, v, blocks):
    """What the row times: name -> call."""
    dense = bool(blocks.all())
    lists = None if dense else gluon.BlockLists.from_blocks(blocks)
    x = quantize(q, k, v, k_block=gluon.BLOCK_N, v_key_major=True)
    scale = q.shape[-1] ** -0.5
    out = {
        "gluon fp8": lambda: fp8_block_attention(q, k, v, lists),
        "gluon fp8 kernel": lambda: gluon.launch(x, lists, scale, q.dtype, False),
    }
    tokens = q.shape[1]
    if dense:
        out["natsim triton fp8"] = lambda: gna_attention(q, k, v, (tokens,), precision="fp8", backend="triton")
        out["natsim triton bf16"] = lambda: gna_attention(q, k, v, (tokens,), backend="triton")
    else:
        work = prepare_sparse(blocks, 128, 128, tokens, backend="triton", backward=False)
        out["natsim triton fp8"] = lambda: sparse_attention(q, k, v, work, precision="fp8")
        out["natsim triton bf16"] = lambda: sparse_attention(q, k, v, work)
    if fa4_installed():
        if dense:
            from flash_attn.cute.interface import flash_attn_func
            out["fa4 bf16"] = lambda: flash_attn_func(q, k, v)
        else:
            fa4_work = prepare_sparse(blocks, 128, 128, tokens, backend="fa4", backward=False)
            out["fa4 bf16"] = lambda: sparse_attention(q, k, v, fa4_work)
    out["cudnn bf16 dense"] = lambda: sdpa_cudnn(q, k, v)
    return out


def accuracy(q, k, v, blocks) -> dict:
    q2, k2, v2 = (t[:, :, :2].contiguous() for t in (q, k, v))
    mask = blocks[:, :2] if blocks.shape[1] > 1 else blocks
    out = fp8_block_attention(q2, k2, v2, None if bool(blocks.all()) else mask)
    ref = sparse_reference(q2.float(), k2.float(), v2.float(), mask, 128, 128)
    cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    return dict(relative_error=rel(out, ref), cosine=cosine)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), heads=HEADS, head_dim=HEAD_DIM, rows=[])
    cases = [("dense 32k", TOKENS, None), ("random 70%", TOKENS, 0.7), ("random 90%", TOKENS, 0.9),
             ("hunyuan 16x8x8 tile order", 30 * 48 * 80, "hunyuan")]
    for name, tokens, kind in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        blocks = case_blocks(tokens, kind)
        calls = timers(q, k, v, blocks)
        for fn in calls.values():
            fn()
        rounds = interleaved(calls, args.rounds, 200.0, torch.cuda.synchronize)
        ms = {key: statistics.median(values) for key, values in rounds.items()}
        row = dict(case=name, tokens=tokens, density=float(blocks.float().mean()), ms=ms,
                   accuracy=accuracy(q, k, v, blocks))
        if "fa4 bf16" in ms:
            row["over_fa4_bf16"] = {key: ms["fa4 bf16"] / t for key, t in ms.items()}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    path = args.out / f"fp8-gluon-{device.replace(' ', '_')}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    names = list(result["rows"][0]["ms"])
    print(f"\n{'case':28s} " + " ".join(f"{n:>18s}" for n in names) + "   (ms; FA4 bf16 / this in brackets)")
    for row in result["rows"]:
        cells = []
        for n in names:
            t = row["ms"].get(n)
            ratio = row.get("over_fa4_bf16", {}).get(n)
            cells.append("-" if t is None else f"{t:.2f}" + (f" ({ratio:.2f}x)" if ratio else ""))
        print(f"{row['case']:28s} " + " ".join(f"{c:>18s}" for c in cells))
    print(f"accuracy (float32 reference): " + "; ".join(
        f"{r['case']}: {r['accuracy']['relative_error']:.2e} / cos {r['accuracy']['cosine']:.5f}"
        for r in result["rows"]))


if __name__ == "__main__":
    main()
