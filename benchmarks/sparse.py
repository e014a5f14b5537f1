"""Sparse attention for any block mask on the GPU, one run, one JSON:

    python benchmarks/sparse.py --out benchmarks/results [--heads 24] [--heads-720p 40] [--flex all|coarse|none]

Per sequence length (Wan 2.1 480p, 21x30x52 = 32,760 tokens, and 720p, 21x45x80 = 75,600), head_dim 128, bf16,
batch 1: SDPA cuDNN dense and our dense GNA kernel as baselines, then masks:
- `random-XX`: random 128x128 block masks at 50, 70, 90% sparsity (one per head), run at 128x128;
- `clustered`: a 16x16 mask of semantic clusters (each 16-query block belongs to one of 32 clusters, each
  cluster attends a random 15% of 32-key spans), different per head; its 16x16 density is far below its
  128x128 density, the case FG-Attn's fine blocks and XOR merging are for;
- `gna`: natsim's GNA window mask on the layout in natsim's permuted order (16-token tiles (1, 4, 4)), the same
  for every head; its N is the permuted (tile-padded) length.
Fine masks run at 16x16 (merged xor, consecutive, none), and OR-pooled to 32x32, 64x64, 128x128 and 128x16 (a
pooled mask is a superset: more work, a different output, checked against its own reference). natsim rows run
with `schedule` grid and lpt; FlexAttention (torch.compile) runs each mask at 128-token blocks (exact block
masks for 128x128, a mask_mod reading the fine mask otherwise), errors recorded.
Every row is checked before timing against a chunked fp32 reference on two heads (relative error, bf16
tolerance 1e-2, recorded). Figures: time (median of triton.testing.do_bench, at least 10 calls), speedup over
cuDNN dense, useful TFLOP/s (attended pairs only, 4 * pairs * head_dim), merge and preparation time, simulated
speedup (dense pairs over the pairs computed after merging) and realised / simulated, lpt over grid.
A failing case is recorded in its row and the run goes on; `--budget-s` skips what is left past the budget.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import triton
from timing import bench, rel

import natsim
from natsim.kernels import SparseMask, gna_attention, prepare_sparse, sparse_attention, sparse_reference

HEAD_DIM, DTYPE = 128, torch.bfloat16
DEVICE = "cuda"
LAYOUTS = {"480p": (21, 30, 52), "720p": (21, 45, 80)}
GNA_WINDOWS = {"480p": (9, 15, 25), "720p": (9, 21, 41)}
GNA_TILE = (1, 4, 4)
CHECK_HEADS = 2
TOLERANCE = 1e-2
# (q_block, kv_block, merges) for a fine 16x16 mask; coarser ones are its OR-pooled supersets.
FINE_CONFIGS = [(16, 16, ("xor", "consecutive", None)), (32, 32, ("xor", "consecutive", None)),
                (64, 64, ("xor", "consecutive", None)), (128, 128, (None,)), (128, 16, (None,))]


def sdpa_cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))


# -- masks ------------------------------------------------------------------------------------------------------


def pool(mask: torch.Tensor, fq: int, fk: int, reduce: str = "any") -> torch.Tensor:
    """OR- (or AND-) pool a `[B, H, nQ, nKV]` block mask by `fq` x `fk` blocks; missing blocks past the end
    are False for OR and True for AND."""
    b, h, nq, nk = mask.shape
    padded = torch.full((b, h, -(-nq // fq) * fq, -(-nk // fk) * fk), reduce == "all", dtype=torch.bool,
                        device=mask.device)
    padded[..., :nq, :nk] = mask
    view = padded.view(b, h, padded.shape[2] // fq, fq, padded.shape[3] // fk, fk)
    return view.any(5).any(3) if reduce == "any" else view.all(5).all(3)


def clustered_mask(n: int, heads: int, clusters: int = 32, density: float = 0.15, seed: int = 0) -> torch.Tensor:
    """A 16x16 block mask `[1, heads, ceil(n/16), ceil(n/16)]`: each query block joins one of `clusters`
    clusters at random, each cluster attends a random `density` of 32-key spans (two 16-key blocks)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    nq = -(-n // 16)
    spans = torch.rand((heads, clusters, -(-nq // 2)), generator=g, device=DEVICE) < density
    patterns = spans.repeat_interleave(2, -1)[..., :nq]
    member = torch.randint(0, clusters, (heads, nq), generator=g, device=DEVICE)
    return torch.gather(patterns, 1, member[..., None].expand(-1, -1, nq))[None]


def gna_mask(layout: str) -> tuple[torch.Tensor, int, tuple]:
    """natsim's GNA block mask over 16-token tiles (1, 4, 4) in its permuted order: `[1, 1, nQ, nKV]`, N."""
    problem = natsim.Problem(LAYOUTS[layout], GNA_WINDOWS[layout])
    block_mask = natsim.block_mask(problem, natsim.TileConfig(GNA_TILE, GNA_TILE))
    dense = torch.from_numpy(block_mask.to_dense()).to(DEVICE)[None, None]
    return dense, dense.shape[2] * 16, problem.window


def useful_pairs(mask: torch.Tensor, q_block: int, kv_block: int, n: int, heads: int) -> float:
    """Attended (query, key) pairs over all heads, partial last blocks counted by their real tokens."""
    q_sizes = (n - torch.arange(mask.shape[2], device=mask.device) * q_block).clamp(max=q_block).double()
    k_sizes = (n - torch.arange(mask.shape[3], device=mask.device) * kv_block).clamp(max=kv_block).double()
    per_mask = torch.einsum("bhqk,q,k->bh", mask.double(), q_sizes, k_sizes)
    return float(per_mask.sum()) * heads / mask.shape[1]


# -- FlexAttention ------------------------------------------------------------------------------------------------


_flex = None


def flex_fn():
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def flex_block_mask(mask: torch.Tensor, q_block: int, kv_block: int, n: int, heads: int):
    """Flex's BlockMask at 128-token blocks for `mask` (expanded to every head): exact when the mask is
    128x128, else partial 128-blocks apply a mask_mod that reads the fine mask and full ones run unmasked."""
    from torch.nn.attention.flex_attention import BlockMask

    mask = mask.expand(1, heads, -1, -1).contiguous()
    if (q_block, kv_block) == (128, 128):
        return SparseMask.from_dense(mask, 128, 128, n).to_flex()
    fq, fk = 128 // q_block, 128 // kv_block
    coarse, full = pool(mask, fq, fk, "any"), pool(mask, fq, fk, "all")

    def mask_mod(b, h, qi, kj):
        return mask[b, h, qi // q_block, kj // kv_block]

    def csr(m):
        counts = m.sum(-1, dtype=torch.int32)
        order = torch.sort(m.to(torch.uint8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
        return counts, order

    return BlockMask.from_kv_blocks(*csr(coarse & ~full), *csr(full), BLOCK_SIZE=128, mask_mod=mask_mod,
                                    seq_lengths=(n, n))


# -- rows ----------------------------------------------------------------------------------------------------------


class Run:
    """The rows of one run, written to JSON after each, with a wall-clock budget."""

    def __init__(self, out: Path, budget_s: float, flex: str):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.flex = flex
        self.record = {**environment(), "rows": []}
        self.path = out / f"sparse-{self.record['device'].replace(' ', '_')}-{self.record['date']}.json"

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.budget_s

    def add(self, row: dict) -> None:
        row["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.record["rows"].append(row)
        self.path.write_text(json.dumps(self.record, indent=1, default=str))
        print(json.dumps(row, default=str), flush=True)

    def save(self) -> None:
        """Rewrite the JSON after a row was amended."""
        self.path.write_text(json.dumps(self.record, indent=1, default=str))

    def guarded(self, row: dict, body: Callable[[dict], None]) -> None:
        """Run `body(row)` unless over budget; record its error in the row instead of stopping."""
        if self.over_budget():
            row["skipped"] = "over the time budget"
        else:
            try:
                body(row)
            except Exception as error:  # one failing case must not lose the run
                row["error"] = f"{type(error).__name__}: {error}"[:2000]
                row["traceback"] = traceback.format_exc()[-3000:]
                torch.cuda.empty_cache()
        self.add(row)


def environment() -> dict:
    return {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
            "triton": triton.__version__, "date": datetime.date.today().isoformat(), "head_dim": HEAD_DIM, "dtype": str(DTYPE)}


def reference_on_heads(q, k, v, mask, q_block, kv_block) -> torch.Tensor:
    """The chunked fp32 reference on the first CHECK_HEADS heads."""
    m = mask[:, :CHECK_HEADS] if mask.shape[1] > 1 else mask
    return sparse_reference(*(t[:, :, :CHECK_HEADS] for t in (q, k, v)), m, q_block, kv_block, chunk=2048)


def natsim_rows(run: Run, base: dict, q, k, v, mask, q_block, kv_block, merges, cudnn_ms) -> list:
    """natsim grid and lpt rows for one mask and block pair, each merge; returns the rows."""
    n, heads, d = q.shape[1], q.shape[2], q.shape[3]
    pairs = useful_pairs(mask, q_block, kv_block, n, heads)
    ref = {}
    rows = []
    for merge in merges:
        work = {}

        def prepare():
            w = prepare_sparse(mask, q_block, kv_block, n, merge=merge)
            computed = float(w.lengths.double().sum()) * heads / w.mask_heads * w.block_m * kv_block
            work.update(w=w, sim=n * n * heads / computed if computed else math.inf)

        for schedule in ("grid", "lpt"):
            row = {**base, "kernel": "natsim", "q_block": q_block, "kv_block": kv_block, "merge": merge,
                   "schedule": schedule, "density": pairs / (n * n * heads)}

            def body(row, schedule=schedule):
                if "w" not in work:
                    prepare()
                w = work["w"]
                row.update(merge_s=w.merge_seconds, prepare_s=w.prepare_seconds, block_m=w.block_m,
                           block_n=w.block_n, simulated_speedup=work["sim"])
                out = sparse_attention(q, k, v, w, schedule=schedule)
                if "ref" not in ref:
                    ref["ref"] = reference_on_heads(q, k, v, mask, q_block, kv_block)
                row["rel_error"] = rel(out[:, :, :CHECK_HEADS], ref["ref"])
                row["correct"] = row["rel_error"] < TOLERANCE
                del out
                row["ms"] = bench(lambda: sparse_attention(q, k, v, w, schedule=schedule))
                row["speedup_over_cudnn"] = cudnn_ms / row["ms"]
                row["useful_tflops"] = 4 * pairs * d / row["ms"] / 1e9
                row["realised_over_simulated"] = row["speedup_over_cudnn"] / work["sim"]

            run.guarded(row, body)
            rows.append(row)
        work.clear()
        grid, lpt = rows[-2], rows[-1]
        if "ms" in grid and "ms" in lpt:
            lpt["lpt_over_grid"] = lpt["ms"] / grid["ms"]
            run.save()
    return rows


def flex_row(run: Run, base: dict, q, k, v, mask, q_block, kv_block, cudnn_ms) -> None:
    n, heads, d = q.shape[1], q.shape[2], q.shape[3]
    pairs = useful_pairs(mask, q_block, kv_block, n, heads)
    row = {**base, "kernel": "flex", "q_block": q_block, "kv_block": kv_block, "flex_block": 128,
           "density": pairs / (n * n * heads)}

    def body(row):
        block_mask = flex_block_mask(mask, q_block, kv_block, n, heads)
        qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
        flex = flex_fn()
        t0 = time.perf_counter()
        out = flex(qf, kf, vf, block_mask=block_mask).transpose(1, 2)
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        row["rel_error"] = rel(out[:, :, :CHECK_HEADS], reference_on_heads(q, k, v, mask, q_block, kv_block))
        row["correct"] = row["rel_error"] < TOLERANCE
        row["ms"] = bench(lambda: flex(qf, kf, vf, block_mask=block_mask))
        row["speedup_over_cudnn"] = cudnn_ms / row["ms"]
        row["useful_tflops"] = 4 * pairs * d / row["ms"] / 1e9

    run.guarded(row, body)


def layout_section(run: Run, layout: str, heads: int) -> None:
    n = math.prod(LAYOUTS[layout])
    q, k, v = (torch.randn(1, n, heads, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(3))
    base = {"layout": layout, "N": n, "heads": heads}
    dense_flops = 4 * n * n * HEAD_DIM * heads
    cudnn = {**base, "kernel": "sdpa_cudnn", "mask": "dense"}

    def cudnn_body(row):
        row["ms"] = bench(lambda: sdpa_cudnn(q, k, v))
        row["useful_tflops"] = dense_flops / row["ms"] / 1e9

    run.guarded(cudnn, cudnn_body)
    cudnn_ms = cudnn.get("ms", float("nan"))

    ours_dense = {**base, "kernel": "natsim_gna_dense", "mask": "dense"}

    def gna_body(row):
        ref = sdpa_cudnn(q, k, v).transpose(1, 2)
        row["rel_error_vs_cudnn"] = rel(gna_attention(q, k, v, window=n), ref)
        row["ms"] = bench(lambda: gna_attention(q, k, v, window=n))
        row["speedup_over_cudnn"] = cudnn_ms / row["ms"]
        row["useful_tflops"] = dense_flops / row["ms"] / 1e9

    run.guarded(ours_dense, gna_body)

    nq = -(-n // 128)
    all_ones = torch.ones((1, 1, nq, nq), dtype=torch.bool, device=DEVICE)
    natsim_rows(run, {**base, "mask": "dense-as-sparse"}, q, k, v, all_ones, 128, 128, (None,), cudnn_ms)
    for sparsity in (0.5, 0.7, 0.9):
        g = torch.Generator(device=DEVICE).manual_seed(int(sparsity * 100))
        mask = torch.rand((1, heads, nq, nq), generator=g, device=DEVICE) >= sparsity
        mbase = {**base, "mask": f"random-{int(sparsity * 100)}"}
        natsim_rows(run, mbase, q, k, v, mask, 128, 128, (None,), cudnn_ms)
        if run.flex != "none":
            flex_row(run, mbase, q, k, v, mask, 128, 128, cudnn_ms)

    fine = clustered_mask(n, heads)
    fine_section(run, {**base, "mask": "clustered"}, q, k, v, fine, cudnn_ms)
    del fine, q, k, v
    torch.cuda.empty_cache()

    gna_fine, gna_n, window = gna_mask(layout)
    q, k, v = (torch.randn(1, gna_n, heads, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(3))
    gbase = {**base, "N": gna_n, "mask": "gna", "window": window, "tile": GNA_TILE}
    gna_cudnn = {**gbase, "kernel": "sdpa_cudnn", "mask": "dense"}
    run.guarded(gna_cudnn, lambda row: row.update(ms=bench(lambda: sdpa_cudnn(q, k, v))))
    fine_section(run, gbase, q, k, v, gna_fine, gna_cudnn.get("ms", float("nan")))
    del q, k, v
    torch.cuda.empty_cache()


def fine_section(run: Run, base: dict, q, k, v, fine: torch.Tensor, cudnn_ms: float) -> None:
    """A 16x16 mask at every block size of FINE_CONFIGS (OR-pooled), natsim rows and Flex rows."""
    n = q.shape[1]
    densities = {}
    for q_block, kv_block, merges in FINE_CONFIGS:
        mask = pool(fine, q_block // 16, kv_block // 16)
        densities[f"{q_block}x{kv_block}"] = useful_pairs(mask, q_block, kv_block, n, 1) / (n * n) / mask.shape[1]
    base = {**base, "densities": densities,
            "fine_le_half_coarse": densities["16x16"] <= densities["128x128"] / 2}
    for q_block, kv_block, merges in FINE_CONFIGS:
        mask = pool(fine, q_block // 16, kv_block // 16)
        natsim_rows(run, base, q, k, v, mask, q_block, kv_block, merges, cudnn_ms)
    if run.flex == "all":
        flex_row(run, base, q, k, v, fine, 16, 16, cudnn_ms)
    if run.flex in ("all", "coarse"):
        flex_row(run, base, q, k, v, pool(fine, 8, 8), 128, 128, cudnn_ms)


def table(rows: list) -> None:
    print("\n| layout | N | heads | mask | kernel | blocks | merge | schedule | ms | x cuDNN | useful TFLOP/s | "
          "rel err | sim x | lpt/grid | merge s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        blocks = f"{r['q_block']}x{r['kv_block']}" if "q_block" in r else "-"
        status = r.get("error", r.get("skipped"))
        fmt = lambda key, spec: format(r[key], spec) if isinstance(r.get(key), (int, float)) else "-"  # noqa: E731
        print(f"| {r['layout']} | {r['N']} | {r['heads']} | {r['mask']} | {r['kernel']} | {blocks} | "
              f"{r.get('merge', '-')} | {r.get('schedule', '-')} | "
              f"{fmt('ms', '.2f') if not status else 'ERR ' + status[:40]} | {fmt('speedup_over_cudnn', '.2f')} | "
              f"{fmt('useful_tflops', '.0f')} | {fmt('rel_error', '.1e')} | {fmt('simulated_speedup', '.2f')} | "
              f"{fmt('lpt_over_grid', '.2f')} | {fmt('merge_s', '.3f')} |")


def tune(out: Path, layouts: list, heads: int) -> None:
    """--tune: the unmasked loop warp-specialized (8 warps, 2 stages) against the default single-partition loop
    (8 warps, 3 stages), on 128x128 masks that load through descriptors, grid and lpt; outputs compared."""
    from natsim.kernels import SparseSpec
    from natsim.kernels.sparse.forward import run_sparse

    rows = []
    generator = torch.Generator().manual_seed(0)
    for layout in layouts:
        n = math.prod(LAYOUTS[layout])
        q, k, v = (torch.randn(1, n, heads, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(3))
        blocks = -(-n // 128)
        for name, density in (("all-true", 1.0), ("random-70", 0.3), ("random-90", 0.1)):
            mask = (torch.rand(1, heads, blocks, blocks, generator=generator) < density).to(DEVICE)
            work = prepare_sparse(mask, 128, 128, n)
            for schedule in ("grid", "lpt"):
                spec = SparseSpec(schedule=schedule)
                baseline = run_sparse(work, q, k, v, spec)[0]
                for specialize in (False, True):
                    row = {"layout": layout, "N": n, "heads": heads, "mask": name, "schedule": schedule,
                           "warp_specialized": specialize}
                    try:
                        result = run_sparse(work, q, k, v, spec, specialize=specialize)[0]
                        row["rel_diff_vs_default"] = rel(result, baseline)
                        row["ms"] = bench(lambda: run_sparse(work, q, k, v, spec, specialize=specialize))
                    except Exception as error:  # a variant Triton cannot build is a finding, not a lost run
                        row["error"] = f"{type(error).__name__}: {error}"[:400]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    record = {**environment(), "rows": rows}
    path = out / f"sparse-tune-{record['device'].replace(' ', '_')}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--heads", type=int, default=24, help="heads at 480p (and 720p unless --heads-720p)")
    parser.add_argument("--heads-720p", type=int, default=None, help="heads at 720p (Wan 14B has 40)")
    parser.add_argument("--layouts", default="480p,720p", help="comma-separated: 480p, 720p")
    parser.add_argument("--flex", choices=("all", "coarse", "none"), default="all",
                        help="FlexAttention rows: every mask (fine masks through a mask_mod), 128x128 masks only, "
                             "or none (its compiles take tens of seconds each)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the cases left after this many seconds")
    parser.add_argument("--tune", action="store_true", help="time the warp-specialized unmasked loop instead")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tune:
        with torch.no_grad():
            tune(args.out, args.layouts.split(","), args.heads)
        return
    run = Run(args.out, args.budget_s, args.flex)
    torch.manual_seed(0)
    with torch.no_grad():
        for layout in args.layouts.split(","):
            heads = args.heads_720p if layout == "720p" and args.heads_720p else args.heads
            try:
                layout_section(run, layout, heads)
            except Exception as error:  # a failure outside a row (e.g. out of memory building a mask)
                run.add({"layout": layout, "N": math.prod(LAYOUTS[layout]), "heads": heads, "mask": "-",
                         "kernel": "-", "error": f"{type(error).__name__}: {error}"[:2000]})
    print(f"\nwrote {run.path} ({time.perf_counter() - run.start:.0f} s)")
    table(run.record["rows"])


if __name__ == "__main__":
    main()
