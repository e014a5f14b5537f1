"""Every backend a user could pick, beside natsim's choice, per case: is the planner's pick the fastest?

Per row, in one run on one GPU (bf16, batch 1), after a correctness check of every timer's output against natsim's
Triton kernel (relative error under 1e-2), the timers that pass timed together in interleaved rounds (medians):

- `natsim`: what natsim picks by itself: for GNA the planner's plan (`natsim.planner.best`, default backends)
  called on q, k, v in the layout's row-major order (any permutation it needs included); for a block mask the
  work `prepare_sparse` makes with natsim's choice of backend;
- `triton`, `fa4`: the same configuration forced onto natsim's Triton kernels or onto FlashAttention-4 through
  natsim (permutation included);
- `fa4-direct`: FlashAttention-4 called straight away (`flash_attn.cute.interface.flash_attn_func`, with
  natsim's lists as its block-sparse tensors) on tensors already in tile order: the kernel alone, what a user
  who keeps a model in tile order gets;
- `flex`: FlexAttention (compiled, dynamic=False) with a BlockMask of the same blocks (partial ones through a
  mask_mod), on tensors in tile order;
- `cudnn`: SDPA's cuDNN backend, dense (the speedups' reference).

Rows: HunyuanVideo 30x48x80 (24 heads of 128) at stride 16x8x8 and 1x1x1 (window 18x24x24); a Wan 720p layout
21x45x80 (40 heads) planned at sparsity 0.9, at head_dim 128, 96 and 72 (`wan720-0.9-d96`); dense attention over 32,768 tokens (24 heads), at head_dim 128 and
at the widths of DENSE_HEAD_DIMS (`dense-32768-d72`: the head dims diffusers models use); random 128x128 masks
at 50/70/90% sparsity over 32,768 tokens, forward and forward + backward; a 16x16 clustered mask; a GNA layout
at head_dim 64 (Cosmos 16x44x80, 32 heads) planned at 0.9. The table's last columns: natsim's pick over the
fastest timer of the row (target >= 0.97), and which timer that was.

    python benchmarks/backends.py OUT_DIR [--rows hunyuan-16x8x8,dense-32768] [--small]

Writes OUT_DIR/backends-<gpu>-<date>.json as rows finish; a row that fails is recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (timing, gna, sparse)

from timing import bench, interleaved, rel  # noqa: E402

import natsim  # noqa: E402
from natsim import planner  # noqa: E402
from natsim.kernels import chosen_backend, gna_attention, prepare_sparse, sparse_attention  # noqa: E402

DTYPE = torch.bfloat16
CHECK_TOLERANCE = 1e-2
ROUNDS = 5  # interleaved rounds per row
DENSE_HEAD_DIMS = (40, 72, 88, 96, 112)  # CogView4, PixArt, Latte, Allegro, Sana-Video
MIN_MS = 200.0  # each timer's calls in a round last at least this long


# -- the timers ---------------------------------------------------------------------------------------------------


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense attention through SDPA's cuDNN backend, `[B, N, H, D]` in and out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def fa4_direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists, mask_mod=None) -> torch.Tensor:
    """FlashAttention-4's public function on `[B, N, H, D]` tensors in tile order, natsim's lists as its blocks (and
    natsim's GNA mask_mod for the partial ones)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import flash_attn_func

    sparse = None if lists is None else BlockSparseTensorsTorch(*lists.forward,
                                                                block_size=(lists.q_block, lists.kv_block))
    out = flash_attn_func(q, k, v, block_sparse_tensors=sparse, mask_mod=mask_mod)
    return out[0] if isinstance(out, tuple) else out


_flex = None


def flex(q, k, v, block_mask, block: int = 128):
    """Compiled FlexAttention on `[B, N, H, D]` tensors; blocks under 128 tokens ask its kernel for tiles of their
    size (it refuses blocks its tiles do not divide)."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.recompile_limit = 64
        _flex = torch.compile(flex_attention, dynamic=False)
    options = None if block >= 128 else {"BLOCK_M": block, "BLOCK_N": block}
    return _flex(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask,
                 kernel_options=options).transpose(1, 2)


def flex_gna_mask(problem: natsim.Problem, tile: tuple[int, ...], tokens: int):
    """Flex's BlockMask of GNA over tokens in `tile` order (same blocks for queries and keys): FlashAttention-4's
    lists, which follow FlexAttention's convention (a KV tile holding padding keys among the masked blocks), and
    GNA's mask on tile-ordered tokens as its mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    from natsim.kernels.fa4.gna import Fa4Gna
    from natsim.kernels.fa4.gna_mask import Arithmetic, GnaMask

    arithmetic = Arithmetic(where=torch.where, const=lambda value: value)
    mask = GnaMask(problem, tile)
    masked_counts, masked_indices, full_counts, full_indices = Fa4Gna(problem, tile, tile).lists(
        torch.device("cuda")).forward
    block = math.prod(tile)
    return BlockMask.from_kv_blocks(masked_counts, masked_indices, full_counts, full_indices,
                                    BLOCK_SIZE=(block, block), seq_lengths=(tokens, tokens),
                                    mask_mod=lambda b, h, q_idx, kv_idx: mask.allowed(q_idx, kv_idx, arithmetic))


def flex_block_mask(mask: torch.Tensor, q_block: int, kv_block: int, n: int, heads: int):
    """Flex's BlockMask of a boolean block mask (blocks of one size, every visited block full)."""
    from natsim.kernels import SparseMask

    return SparseMask.from_dense(mask.expand(1, heads, -1, -1).contiguous(), q_block, kv_block, n).to_flex()


# -- rows ---------------------------------------------------------------------------------------------------------


def timed(row: dict, timers: dict[str, Callable[[], torch.Tensor]], reference: torch.Tensor,
          order: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
    """Check every timer against `reference` (outputs in tile order brought back by `order`), then time those that
    pass together, interleaved (benchmarks/timing.py: each round runs every timer once, in a shuffled order, so
    that clock drift falls on all alike): the median over ROUNDS rounds, and the rounds themselves."""
    passed = {}
    for name, fn in timers.items():
        try:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            if order is not None and name in ("fa4-direct", "flex"):
                out = order(out)
            row[f"{name}_err"] = rel(out, reference)
            if row[f"{name}_err"] > CHECK_TOLERANCE:
                row[f"{name}_error"] = f"relative error {row[f'{name}_err']:.3g} over {CHECK_TOLERANCE}"
                continue
            passed[name] = fn
        except Exception as error:  # recorded: the other timers still run
            row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:400]
    rounds = interleaved(passed, ROUNDS, MIN_MS, torch.cuda.synchronize)
    for name, times in rounds.items():
        row[f"{name}_ms"] = statistics.median(times)
        row[f"{name}_rounds_ms"] = times


def gna_row(name: str, shape, heads: int, head_dim: int, *, sparsity: Optional[float] = None, window=None,
            stride=None, fa4_tiles=((4, 8, 8), (2, 8, 8))) -> dict:
    """A GNA row: natsim's pick (the planner's plan at `sparsity`, or for a given `window` and `stride` what
    `gna_attention` chooses by itself), the same configuration on each backend, FA4 direct, Flex, cuDNN.
    FlashAttention-4 direct and Flex run the plan's tiles, or `fa4_tiles` where natsim chose its own."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, *shape, heads, head_dim, device="cuda", generator=gen, dtype=DTYPE) for _ in range(3))
    if sparsity is not None:
        plan = planner.best(shape, sparsity, heads=heads, head_dim=head_dim, device="cuda")
        arguments = {key: value for key, value in plan.kernel_arguments().items() if key != "backend"}
        natsim_call, picked = (lambda: plan(q, k, v)), plan.backend
        problem, tiles = plan.problem, (plan.tiles.q_tile, plan.tiles.kv_tile)
        extra = dict(predicted_ms=None if plan.predicted_time_s is None else plan.predicted_time_s * 1e3,
                     kv_tiling=plan.tiles.kv_tiling)
    else:
        arguments = dict(window=window, stride=stride)
        natsim_call, picked = (lambda: gna_attention(q, k, v, **arguments)), chosen_backend(q, k, v, **arguments)
        problem, tiles, extra = natsim.Problem(shape, window, stride), fa4_tiles, {}
    row = dict(row=name, shape=shape, heads=heads, head_dim=head_dim, window=problem.window, stride=problem.stride,
               q_tile=tiles[0], kv_tile=tiles[1], picked=picked, sparsity=natsim.simulate(
                   problem, natsim.TileConfig(*tiles)).sparsity, **extra)
    reference = gna_attention(q, k, v, **arguments, backend="triton")
    fa4_arguments = dict(arguments, q_tile=tiles[0], kv_tile=tiles[1], kv_tiling="static")
    timers = {"natsim": natsim_call,
              "triton": lambda: gna_attention(q, k, v, **arguments, backend="triton"),
              "fa4": lambda: gna_attention(q, k, v, **fa4_arguments, backend="fa4")}
    from natsim.kernels.fa4.gna import Fa4Gna

    fa4 = Fa4Gna(problem, *tiles)
    ordered = [fa4.to_order(t) for t in (q, k, v)]
    lists = fa4.lists(q.device)
    timers["fa4-direct"] = lambda: fa4_direct(*ordered, lists, fa4.mask_mod(lists))
    block_mask = flex_gna_mask(problem, tiles[0], ordered[0].shape[1])
    timers["flex"] = lambda: flex(*ordered, block_mask, math.prod(tiles[0]))
    timed(row, timers, reference, order=fa4.from_order)
    row["cudnn_ms"] = bench(lambda: cudnn(*(t.reshape(1, -1, heads, head_dim) for t in (q, k, v))))
    return row


def dense_row(n: int, heads: int, head_dim: int = 128) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, heads, head_dim, device="cuda", generator=gen, dtype=DTYPE) for _ in range(3))
    name = f"dense-{n}" if head_dim == 128 else f"dense-{n}-d{head_dim}"
    row = dict(row=name, tokens=n, heads=heads, head_dim=head_dim, picked=chosen_backend(q, k, v, (n,)))
    reference = gna_attention(q, k, v, n, backend="triton")
    from torch.nn.attention.flex_attention import create_block_mask

    dense_mask = create_block_mask(lambda b, h, i, j: i >= 0, None, None, n, n, device="cuda")
    timed(row, {"natsim": lambda: gna_attention(q, k, v, n),
                "triton": lambda: gna_attention(q, k, v, n, backend="triton"),
                "fa4": lambda: gna_attention(q, k, v, n, backend="fa4"),
                "fa4-direct": lambda: fa4_direct(q, k, v, None),
                "flex": lambda: flex(q, k, v, dense_mask),
                "cudnn": lambda: cudnn(q, k, v)}, reference)
    return row


def mask_row(name: str, mask: torch.Tensor, q_block: int, kv_block: int, n: int, heads: int,
             backward: bool) -> dict:
    """A block-mask row: the mask prepared with natsim's choice of backend, and on each backend; FA4 direct, Flex,
    cuDNN."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, n, heads, 128, device="cuda", generator=gen, dtype=DTYPE).requires_grad_(backward)
               for _ in range(3))
    grad = torch.randn_like(q)
    row = dict(row=name, tokens=n, heads=heads, head_dim=128, q_block=q_block, kv_block=kv_block,
               sparsity=1.0 - float(mask.float().mean()), pass_="forward + backward" if backward else "forward")
    works = {}
    for backend in (None, "triton", "fa4"):
        try:
            works[backend] = prepare_sparse(mask, q_block, kv_block, n, backend=backend, backward=backward)
        except ValueError as refusal:  # a backend that does not run these blocks: recorded, the others run
            row[f"{backend}_error"] = str(refusal)[:400]
    row["picked"] = works[None].backend
    block_mask = flex_block_mask(mask, q_block, kv_block, n, heads)

    def step(fn):
        if not backward:
            return fn
        def forward_backward():
            out = fn()
            out.backward(grad)
            return out
        return forward_backward

    reference = sparse_attention(q.detach(), k.detach(), v.detach(), works["triton"])
    lists = works["fa4"].fa4 if "fa4" in works else None
    timers = {"natsim": step(lambda: sparse_attention(q, k, v, works[None])),
              **{backend: step(lambda backend=backend: sparse_attention(q, k, v, works[backend]))
                 for backend in ("triton", "fa4") if backend in works},
              "flex": step(lambda: flex(q, k, v, block_mask, min(q_block, kv_block))),
              "cudnn": step(lambda: cudnn(q, k, v))}
    if not backward and lists is not None:
        timers["fa4-direct"] = lambda: fa4_direct(q, k, v, lists)
    with torch.no_grad() if not backward else torch.enable_grad():
        timed(row, {n: t for n, t in timers.items() if n != "cudnn"}, reference)
        row["cudnn_ms"] = bench(timers["cudnn"])
    return row


def random_mask(n: int, heads: int, sparsity: float, block: int = 128, seed: int = 2) -> torch.Tensor:
    """`[1, heads, n/block, n/block]` blocks kept at random with probability 1 - sparsity, the diagonal always."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-n // block)
    mask = torch.rand(1, heads, blocks, blocks, device="cuda", generator=gen) >= sparsity
    mask[..., torch.arange(blocks), torch.arange(blocks)] = True
    return mask


def rows(small: bool) -> dict[str, Callable[[], dict]]:
    scale = 4 if small else 1
    hunyuan, window = ((16, 48, 32), (8, 24, 16)) if small else ((30, 48, 80), (18, 24, 24))
    n = 32768 // scale
    table = {
        "hunyuan-16x8x8": lambda: gna_row("hunyuan-16x8x8", hunyuan, 24, 128, window=window,
                                          stride=(16 if not small else 8, 8, 8)),
        "hunyuan-1x1x1": lambda: gna_row("hunyuan-1x1x1", hunyuan, 24, 128, window=window, stride=(1, 1, 1)),
        "wan720-0.9": lambda: gna_row("wan720-0.9", (21, 45, 80 // scale), 40, 128, sparsity=0.9),
        **{f"wan720-0.9-d{d}": (lambda d=d: gna_row(f"wan720-0.9-d{d}", (21, 45, 80 // scale), 40, d, sparsity=0.9))
           for d in (72, 96)},
        "dense-32768": lambda: dense_row(n, 24),
        **{f"dense-32768-d{d}": (lambda d=d: dense_row(n, 24, d)) for d in DENSE_HEAD_DIMS},
        "cosmos-d64-0.9": lambda: gna_row("cosmos-d64-0.9", (16, 44, 80 // scale), 32, 64, sparsity=0.9),
    }
    for sparsity in (0.5, 0.7, 0.9):
        for backward in (False, True):
            key = f"random-{int(sparsity * 100)}{'-fb' if backward else ''}"
            table[key] = (lambda s=sparsity, b=backward, key=key:
                          mask_row(key, random_mask(n, 24, s), 128, 128, n, 24, b))
    table["clustered-16x16"] = lambda: mask_row("clustered-16x16", clustered(n, 24), 16, 16, n, 24, False)
    return table


def clustered(n: int, heads: int) -> torch.Tensor:
    from sparse import clustered_mask

    return clustered_mask(n, heads)


def print_table(results: list[dict]) -> None:
    timers = ("natsim", "triton", "fa4", "fa4-direct", "flex", "cudnn")
    print("| row | picked | " + " | ".join(f"{t} ms" for t in timers) + " | natsim / fastest | fastest |")
    print("|---" * (len(timers) + 4) + "|")
    for row in results:
        times = {t: row.get(f"{t}_ms") for t in timers}
        others = {t: ms for t, ms in times.items() if ms is not None and t != "natsim"}
        fastest = min(others, key=others.get) if others else None
        ratio = f"{others[fastest] / times['natsim']:.3f}" if fastest and times["natsim"] else "-"
        cells = [f"{ms:.2f}" if ms is not None else ("err" if f"{t}_error" in row else "-") for t, ms in times.items()]
        print(f"| {row['row']} | {row.get('picked', '-')} | " + " | ".join(cells) + f" | {ratio} | {fastest or '-'} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: every row)")
    parser.add_argument("--small", action="store_true", help="smaller layouts (a quick check of the script)")
    args = parser.parse_args(argv)
    table = rows(args.small)
    names = list(table) if args.rows is None else args.rows.split(",")
    unknown = [name for name in names if name not in table]
    if unknown:
        parser.error(f"unknown rows {unknown}; the rows are {list(table)}")
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    path = args.out / f"backends-{gpu}-{datetime.date.today()}.json"
    import importlib.metadata as metadata
    import triton

    header = dict(benchmark="backends", device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=str(datetime.date.today()), small=args.small)
    try:
        header["flash_attn_4"] = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        header["flash_attn_4"] = None
    results = []
    for name in names:
        try:
            row = table[name]()
        except Exception as error:
            row = dict(row=name, error=f"{type(error).__name__}: {error}"[:600], trace=traceback.format_exc()[-2000:])
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}, default=str), flush=True)
        path.write_text(json.dumps(dict(header, rows=results), indent=1, default=str))
    print_table(results)


if __name__ == "__main__":
    main()
