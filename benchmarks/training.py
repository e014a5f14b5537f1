"""Training steps of attention under block masks: forward, backward and forward + backward of natsim's sparse
attention beside FlexAttention and dense SDPA, timed side by side in one run, one JSON:

    python benchmarks/training.py OUT_DIR [--cases random128,random64,gna,merged16,predicted] [--rounds 5]
    python benchmarks/training.py OUT_DIR --cases gna --gna-layout hunyuan   # GNA at HunyuanVideo's size
    python benchmarks/training.py OUT_DIR --small       # tiny sizes on the CPU, seconds: the smoke test's run

bf16, batch 1, head_dim 128 (32 with --small). Cases (all by default; `--cases` takes a subset):
- `random128`, `random64`: random block masks over N = 32,768 tokens, 24 heads, 128x128 and 64x64 blocks at
  sparsity 0.5, 0.7 and 0.9 (seeded, drawn on the CPU; a query block left with no KV block gets one at random);
- `gna`: a GNA window as a 128x128 block mask over row-major tokens (`natsim.masks.gna_block_mask`: every
  block pair holding a window pair), and natsim's own `gna_attention` on the exact window beside it. By default
  the layout 16x32x64 (the same 32,768 tokens and 24 heads, so it shares the random cases' q, k, v and Flex's
  compiled graph), window 10x16x20, stride 8x8x8 (exact window 90% sparse, block mask 31% dense); with
  `--gna-layout hunyuan` HunyuanVideo's 30x48x80 (115,200 tokens), window 18x24x24, stride 16x8x8 (91%, 30%),
  whose own q, k, v, Flex compile and dense SDPA add about a minute and a half;
- `merged16`: a 16x16 mask over the 32,768 tokens (every query block attends the key blocks within 512 tokens
  of it, and the 32-token spans of its cluster: each query block joins one of 32 clusters, each cluster
  attends a random 10% of spans; 13% dense), natsim with merge="xor" and schedule="lpt";
- `predicted`: benchmarks/workload.py's RoPE video workload at Wan 2.1 480p (21x30x52 = 32,760 tokens, its 12
  heads) in Hilbert order, masked by `natsim.masks.hierarchical` at natsim's default content-adaptive setup
  (that of `natsim.integrations.diffusers.Masks`: 64-token blocks scored from 16-token sub-blocks, keep 0.3).

Rows per mask, all differentiating the same q, k, v with the same output gradient:
- `natsim`: `sparse_attention(q, k, v, mask, q_block, kv_block)` with the boolean mask, prepared on every call;
- `natsim-prepared`: `sparse_attention(q, k, v, work)` with `work = prepare_sparse(mask, ...)` made once
  outside the timed region; a call that raises is recorded as "unsupported" with the error's first line;
- `flex`: FlexAttention compiled with torch.compile (eager on the CPU), its BlockMask built once from the same
  boolean mask at the mask's own blocks (`SparseMask.to_flex`); a configuration Flex refuses (its kernel tiles
  must divide the blocks; no backward on the CPU) is recorded as "refused" with the reason, and not tried
  again for other masks of that block size;
- `flex-128` (masks of blocks under 128 tokens): what Flex runs on a fine mask at its own tiles, a BlockMask at
  128-token blocks whose partial blocks apply a mask_mod reading the fine mask (benchmarks/sparse.py's
  `flex_block_mask`).
And per problem `sdpa`: dense attention through SDPA's cuDNN backend (flash where cuDNN is unavailable; the row
says so), and with `gna` natsim's `natsim-gna`.

Correct first: each row's first call is checked against a float32 reference on the first heads (output and dq, dk,
dv; relative L2 error, bf16 tolerances 1e-2 and 2e-2); a row that fails is "wrong" and not timed. The natsim rows'
gradients are also compared with Flex's on every head. Timing: every row's forward (autograd recording, as in
training), backward alone (`torch.autograd.grad` with `retain_graph` on a held output) and step (forward +
backward) run in interleaved rounds (benchmarks/timing.py's `interleaved`, the order shuffled per round, wall clock
between synchronisations, host work included); the medians over rounds are reported and every round is kept in the
JSON. Useful TFLOP/s counts attended pairs only, as FlashAttention does: forward 4 * pairs * head_dim, backward 2.5
times that, step 3.5 times. Written to OUT_DIR/training-<device>-<date>.json after every problem; a problem that
would start after `--budget-s` seconds is skipped and listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (timing, sparse, workload)

from sparse import flex_block_mask, useful_pairs  # noqa: E402
from timing import interleaved, rel  # noqa: E402
from workload import video_qkv  # noqa: E402

import natsim  # noqa: E402
from natsim.kernels import SparseMask, gna_attention, prepare_sparse, sparse_attention  # noqa: E402
from natsim.kernels.gna.reference import reference_attention, reference_gradients  # noqa: E402
from natsim.masks import gna_block_mask, hierarchical, hilbert_order, to_order  # noqa: E402

DTYPE = torch.bfloat16
CASES = ("random128", "random64", "gna", "merged16", "predicted")
SPARSITIES = (0.5, 0.7, 0.9)
OUT_TOLERANCE, GRAD_TOLERANCE = 1e-2, 2e-2  # bf16, relative L2 against float32
BACKWARD_FLOPS, STEP_FLOPS = 2.5, 3.5  # per forward FLOP
PHASES = ("fwd", "bwd", "step")
# natsim's default content-adaptive setup (natsim.integrations.diffusers.Masks: DFSAttn's), for `predicted`.
PREDICTED_BLOCK, PREDICTED_SUB_BLOCK, PREDICTED_KEEP = 64, 16, 0.3
# (layout, window, stride) of the `gna` case.
GNA_LAYOUTS = {"32k": ((16, 32, 64), (10, 16, 20), (8, 8, 8)), "hunyuan": ((30, 48, 80), (18, 24, 24), (16, 8, 8)),
               "small": ((4, 8, 8), (3, 5, 5), (2, 2, 2))}


@dataclass(frozen=True)
class Sizes:
    """The sizes of one run, the GPU table's or `--small`'s tiny ones that run on a CPU in seconds: tokens and
    heads of the random cases, head_dim, the gna case's (layout, window, stride), the workload's layout name,
    timing rounds and the least milliseconds one timer's calls take per round, heads checked against float32,
    and how far (in tokens) the 16x16 mask's local band reaches."""

    tokens: int
    heads: int
    head_dim: int
    gna: tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]
    workload: str
    rounds: int
    min_ms: float
    check_heads: int
    local_tokens: int


GPU_SIZES = Sizes(32768, 24, 128, GNA_LAYOUTS["32k"], "wan480p", 5, 20.0, 1, 512)
SMALL_SIZES = Sizes(256, 2, 32, GNA_LAYOUTS["small"], "small", 2, 1.0, 2, 32)


@dataclass
class MaskCase:
    """One boolean block mask `[1, H|1, nQ, nKV]` of a problem (q_block = kv_block = `block`) and the natsim
    options it runs with."""

    case: str
    name: str
    mask: torch.Tensor
    block: int
    merge: Optional[str] = None
    schedule: Optional[str] = None


@dataclass
class Problem:
    """q, k, v (leaves that require grad) and the output gradient g of one attention problem, `[1, N, H, D]`,
    with its masks; `gna` also runs natsim's `gna_attention` on that layout (tokens row-major)."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    masks: list[MaskCase]
    gna: Optional[natsim.Problem] = None


@dataclass
class Row:
    """One kernel on one problem (and mask): its record for the JSON, the differentiable call it times
    (`[1, N, H, D]` q, k, v to the output), and the status an error of its first call gives."""

    record: dict
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    mask: Optional[MaskCase] = None
    refusal: str = "error"


class Flex:
    """FlexAttention on `[B, N, H, D]` tensors, compiled on the GPU (eager on the CPU), and the block sizes it
    refused: Flex's refusal depends on the block size (its kernel tiles must divide it), so a refused size is
    not compiled again for every mask."""

    def __init__(self, device: torch.device):
        from torch.nn.attention.flex_attention import flex_attention

        def flex_bnhd(q, k, v, block_mask):
            """Flex takes `[B, H, N, D]`: transposed views in and out, inside the compiled function."""
            out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
            return out.transpose(1, 2)

        if device.type == "cuda":
            torch._dynamo.config.recompile_limit = 64  # one graph per (N, heads, block size)
            flex_bnhd = torch.compile(flex_bnhd, dynamic=False)
        self.attend = flex_bnhd
        self.refused: dict[int, str] = {}

    @staticmethod
    def block_mask(mask: MaskCase, n: int, heads: int):
        """Flex's BlockMask of the mask at its own blocks, every attended block full (no mask_mod), expanded to
        every head so that masks of one problem and block size share a compiled graph."""
        return SparseMask.from_dense(mask.mask.expand(1, heads, -1, -1), mask.block, mask.block, n).to_flex()


# -- masks ---------------------------------------------------------------------------------------------------------


def random_mask(n: int, heads: int, block: int, sparsity: float, seed: int) -> torch.Tensor:
    """Bool `[1, heads, nb, nb]` on the CPU: each block pair kept with probability 1 - sparsity, and a query
    block left with none attends one KV block drawn at random (no query without keys)."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // block)
    mask = torch.rand((1, heads, nb, nb), generator=g) >= sparsity
    pick = torch.randint(0, nb, (1, heads, nb, 1), generator=g)
    return mask | (~mask.any(-1, keepdim=True) & (torch.arange(nb) == pick))


def local_clustered_mask(n: int, heads: int, local_tokens: int, seed: int, clusters: int = 32,
                         density: float = 0.1) -> torch.Tensor:
    """Bool `[1, heads, nb, nb]` at 16-token blocks on the CPU: a query block attends the key blocks within
    `local_tokens` of it, and the 32-token spans of its cluster (it joins one of `clusters` at random; each
    cluster attends a random `density` of spans): local plus similar-content attention, whose XOR-merged
    groups visit far fewer blocks than consecutive ones."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // 16)
    spans = torch.rand((heads, clusters, -(-nb // 2)), generator=g) < density
    patterns = spans.repeat_interleave(2, -1)[..., :nb]
    member = torch.randint(0, clusters, (heads, nb), generator=g)
    clustered = torch.gather(patterns, 1, member[..., None].expand(-1, -1, nb))
    blocks = torch.arange(nb)
    local = (blocks[:, None] - blocks[None, :]).abs() * 16 <= local_tokens
    return (clustered | local)[None]


def gna_case(layout: tuple, device: torch.device) -> tuple[natsim.Problem, MaskCase]:
    """The GNA problem of `layout` (shape, window, stride) and its window as a 128x128 block mask over
    row-major tokens, `[1, 1, nQ, nKV]`."""
    shape, window, stride = layout
    problem = natsim.Problem(shape, window, stride)
    mask = gna_block_mask(shape, problem.window, problem.stride, q_block=128, kv_block=128, device=device)
    name = f"gna {'x'.join(map(str, shape))} w{'x'.join(map(str, window))} s{'x'.join(map(str, stride))}"
    return problem, MaskCase("gna", name, mask, 128)


# -- problems ------------------------------------------------------------------------------------------------------


def leaves(shape: tuple, device: torch.device, seed: int, count: int = 4) -> list[torch.Tensor]:
    """`count` seeded standard-normal bf16 tensors, drawn on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=g, device=device, dtype=DTYPE) for _ in range(count)]


def shares_tokens(sizes: Sizes) -> bool:
    """Whether the GNA layout has the random cases' N, so that the GNA case joins their problem."""
    return math.prod(sizes.gna[0]) == sizes.tokens


def token_problem(cases: list[str], sizes: Sizes, device: torch.device) -> Problem:
    """N tokens, random q, k, v: the random masks at 128 and 64 blocks, the clustered 16x16 mask, and the GNA
    case when its layout has N tokens."""
    n, heads = sizes.tokens, sizes.heads
    q, k, v, g = leaves((1, n, heads, sizes.head_dim), device, seed=0)
    masks = []
    for case, block in (("random128", 128), ("random64", 64)):
        if case in cases:
            masks += [MaskCase(case, f"random-{round(s * 100)}", random_mask(n, heads, block, s, seed=round(s * 100))
                               .to(device), block) for s in SPARSITIES]
    gna = None
    if "gna" in cases and shares_tokens(sizes):
        gna, mask = gna_case(sizes.gna, device)
        masks.append(mask)
    if "merged16" in cases:
        mask = local_clustered_mask(n, heads, sizes.local_tokens, seed=16).to(device)
        masks.append(MaskCase("merged16", "local+clustered", mask, 16, merge="xor", schedule="lpt"))
    return Problem(f"N={n}", q, k, v, g, masks, gna)


def gna_problem(sizes: Sizes, device: torch.device) -> Problem:
    """The GNA layout of another N: its own random q, k, v (row-major), the window's block mask, natsim's GNA."""
    gna, mask = gna_case(sizes.gna, device)
    q, k, v, g = leaves((1, gna.num_tokens, sizes.heads, sizes.head_dim), device, seed=1)
    return Problem(f"N={gna.num_tokens}", q, k, v, g, [mask], gna)


def predicted_problem(sizes: Sizes, device: torch.device) -> Problem:
    """benchmarks/workload.py's video attention in Hilbert order, masked by natsim's hierarchical predictor."""
    work = video_qkv(sizes.workload, head_dim=sizes.head_dim, device=device, dtype=DTYPE, seed=0)
    order = hilbert_order(work.shape)
    q, k, v = (to_order(t, order).contiguous() for t in (work.q, work.k, work.v))
    (g,) = leaves(tuple(q.shape), device, seed=2, count=1)
    with torch.no_grad():
        mask = hierarchical(q, k, PREDICTED_BLOCK, PREDICTED_BLOCK, keep=PREDICTED_KEEP, sub_block=PREDICTED_SUB_BLOCK)
    name = f"{sizes.workload} hierarchical keep={PREDICTED_KEEP}"
    return Problem(f"N={q.shape[1]} workload", q, k, v, g, [MaskCase("predicted", name, mask, PREDICTED_BLOCK)])


# -- rows ----------------------------------------------------------------------------------------------------------


def base_record(problem: Problem, kernel: str, mask: Optional[MaskCase], pairs: float) -> dict:
    """The fields every row has: what ran, on what, and its useful work."""
    _, n, heads, head_dim = problem.q.shape
    record = {"problem": problem.name, "N": n, "heads": heads, "kernel": kernel, "status": "ok",
              "case": mask.case if mask else None, "mask": mask.name if mask else "dense",
              "blocks": f"{mask.block}x{mask.block}" if mask else None, "pairs": pairs,
              "density": pairs / (n * n * heads), "forward_flops": 4 * pairs * head_dim}
    if mask is not None:
        record.update(merge=mask.merge, schedule=mask.schedule or "grid")
    return record


def sdpa_row(problem: Problem, backend_name: str) -> Row:
    """Dense SDPA through one backend ("cudnn" or "flash")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    def attend(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

    _, n, heads, _ = problem.q.shape
    record = base_record(problem, "sdpa", None, float(n * n * heads))
    record["backend"] = backend_name
    return Row(record, attend, refusal="unavailable")


def mask_rows(problem: Problem, mask: MaskCase, flex: Flex) -> list[Row]:
    """Flex first (the natsim rows compare their gradients with its), natsim with the boolean mask, natsim
    with the mask prepared once."""
    _, n, heads, _ = problem.q.shape
    pairs = useful_pairs(mask.mask, mask.block, mask.block, n, heads)

    flex_record = base_record(problem, "flex", mask, pairs)
    block_mask = None
    if mask.block in flex.refused:
        flex_record.update(status="refused", reason=f"{flex.refused[mask.block]} (refused at this block size before)")
    else:
        try:
            block_mask = flex.block_mask(mask, n, heads)
        except Exception as error:  # a BlockMask Flex cannot build is its refusal too
            flex_record.update(status="refused", reason=first_line(error))
    rows = [Row(flex_record, lambda q, k, v: flex.attend(q, k, v, block_mask), mask, refusal="refused")]
    if mask.block < 128:  # what Flex runs on a fine mask: 128-token blocks, the partial ones under a mask_mod
        coarse = flex_block_mask(mask.mask, mask.block, mask.block, n, heads)
        rows.append(Row(base_record(problem, "flex-128", mask, pairs),
                        lambda q, k, v: flex.attend(q, k, v, coarse), mask, refusal="refused"))

    options = dict(schedule=mask.schedule)
    rows.append(Row(base_record(problem, "natsim", mask, pairs),
                    lambda q, k, v: sparse_attention(q, k, v, mask.mask, mask.block, mask.block, merge=mask.merge,
                                                     **options), mask))
    prepared = base_record(problem, "natsim-prepared", mask, pairs)
    work = None
    try:
        work = prepare_sparse(mask.mask, mask.block, mask.block, n, merge=mask.merge)
        prepared.update(prepare_s=work.prepare_seconds, merge_s=work.merge_seconds)
    except Exception as error:
        prepared.update(status="error", reason=first_line(error), traceback=traceback.format_exc()[-3000:])
    rows.append(Row(prepared, lambda q, k, v: sparse_attention(q, k, v, work, **options), mask,
                    refusal="unsupported"))
    return rows


def gna_row(problem: Problem) -> Row:
    """natsim's `gna_attention` on the exact window, q, k, v viewed as `[1, *shape, H, D]`."""
    gna = problem.gna
    _, n, heads, head_dim = problem.q.shape
    pairs = float(natsim.simulate(gna, natsim.TileConfig((1,) * gna.ndim, (1,) * gna.ndim)).attended_pairs * heads)

    def attend(q, k, v):
        view = (1, *gna.shape, heads, head_dim)
        out = gna_attention(q.view(view), k.view(view), v.view(view), window=gna.window, stride=gna.stride)
        return out.view(1, n, heads, head_dim)

    record = base_record(problem, "natsim-gna", None, pairs)
    record.update(case="gna", mask=f"gna exact w{'x'.join(map(str, gna.window))} s{'x'.join(map(str, gna.stride))}")
    return Row(record, attend)


def first_line(error: BaseException) -> str:
    """The error's type and the first non-empty line of its message."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:400]


def first_call(row: Row, problem: Problem, sync: Callable[[], None]) -> Optional[tuple[torch.Tensor, ...]]:
    """The row's first forward and backward (compiles, prepares): (out, dq, dk, dv) detached, or None with the
    row's status and reason set from the error."""
    if row.record["status"] != "ok":
        return None
    try:
        start = time.perf_counter()
        out = row.attend(problem.q, problem.k, problem.v)
        grads = torch.autograd.grad(out, (problem.q, problem.k, problem.v), problem.g)
        sync()
        row.record["first_call_s"] = time.perf_counter() - start
        return (out.detach(), *grads)
    except Exception as error:  # recorded in the row: one failing kernel must not lose the run
        row.record.update(status=row.refusal, reason=first_line(error))
        if row.refusal == "error":
            row.record["traceback"] = traceback.format_exc()[-3000:]
        return None
    finally:
        r = row.record
        print(f"  {r['problem']} | {r['mask']} | {r['kernel']}: {r['status']} {r.get('reason', '')} "
              f"(first call {r.get('first_call_s', math.nan):.1f} s)", flush=True)


# -- correctness ---------------------------------------------------------------------------------------------------


def block_reference(q, k, v, g, mask: torch.Tensor, block: int, chunk: int = 1024) -> tuple[torch.Tensor, ...]:
    """float32 output and dq, dk, dv of `[B, N, h, D]` q, k, v (a few heads) under a `[B|1, h|1, nQ, nKV]` block
    mask for the output gradient g: `chunk` queries at a time with FlashAttention's backward formulas written
    out, so that no temporary outgrows chunk x N (autograd through a reference would keep every chunk's
    scores). A query that attends nothing has output and gradients 0."""
    n, head_dim = q.shape[1], q.shape[3]
    scale = head_dim**-0.5
    qf, kf, vf, gf = (t.detach().float().transpose(1, 2) for t in (q, k, v, g))  # [B, h, N, D]
    out, dq = torch.empty_like(qf), torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    key_blocks = torch.arange(n, device=q.device) // block
    for first in range(0, n, chunk):
        rows = slice(first, min(first + chunk, n))
        query_blocks = torch.arange(rows.start, rows.stop, device=q.device) // block
        allowed = mask[:, :, query_blocks][..., key_blocks]
        scores = (qf[:, :, rows] @ kf.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        p = torch.exp(scores - torch.logsumexp(scores, -1, keepdim=True)).nan_to_num(0.0)
        o = p @ vf
        go = gf[:, :, rows]
        ds = p * (go @ vf.transpose(-1, -2) - (go * o).sum(-1, keepdim=True))
        out[:, :, rows] = o
        dq[:, :, rows] = ds @ kf * scale
        dk += ds.transpose(-1, -2) @ qf[:, :, rows] * scale
        dv += p.transpose(-1, -2) @ go
    return tuple(t.transpose(1, 2) for t in (out, dq, dk, dv))


def reference(problem: Problem, row: Row, heads: int) -> tuple[torch.Tensor, ...]:
    """float32 (out, dq, dk, dv) of the row's attention on the first `heads` heads: the block mask's, or GNA's
    exact window (natsim's chunked GNA references)."""
    q, k, v, g = (t[:, :, :heads] for t in (problem.q, problem.k, problem.v, problem.g))
    if row.mask is not None:
        mask = row.mask.mask
        return block_reference(q, k, v, g, mask[:, :heads] if mask.shape[1] > 1 else mask, row.mask.block)
    gna = problem.gna
    view = (1, *gna.shape, heads, q.shape[-1])
    q, k, v, g = (t.detach().reshape(view) for t in (q, k, v, g))
    out = reference_attention(q, k, v, gna.window, gna.stride, compute_dtype=torch.float32)
    grads = reference_gradients(q, k, v, g, gna.window, gna.stride)
    return tuple(t.reshape(1, -1, heads, q.shape[-1]) for t in (out, *grads))


def check(row: Row, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], flex_grads) -> None:
    """Errors of the row's output and gradients against the float32 reference on its heads, and of its
    gradients against Flex's on every head; a row beyond the bf16 tolerances is "wrong"."""
    heads = want[0].shape[2]
    errors = {name: rel(a[:, :, :heads], b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    row.record["errors_vs_fp32"] = errors
    row.record["out_err_vs_fp32"] = errors["out"]
    row.record["grad_err_vs_fp32"] = max(errors["dq"], errors["dk"], errors["dv"])
    if flex_grads is not None:
        row.record["grad_err_vs_flex"] = max(rel(a, b) for a, b in zip(got[1:], flex_grads))
    if not (errors["out"] < OUT_TOLERANCE and row.record["grad_err_vs_fp32"] < GRAD_TOLERANCE):
        row.record.update(status="wrong", reason=f"beyond bf16 tolerance: {json.dumps(errors)}")


# -- one problem ---------------------------------------------------------------------------------------------------


def problem_rows(problem: Problem, flex: Flex, sync: Callable[[], None], check_heads: int) -> list[Row]:
    """Every row of the problem, each run once and checked: SDPA (cuDNN, else flash), per mask Flex and the two
    natsim rows, and natsim's GNA with the GNA case."""
    sdpa = sdpa_row(problem, "cudnn")
    first_call(sdpa, problem, sync)
    if sdpa.record["status"] != "ok":
        note = f"cuDNN unavailable ({sdpa.record['reason']}); flash instead"
        sdpa = sdpa_row(problem, "flash")
        sdpa.record["backend_note"] = note
        first_call(sdpa, problem, sync)
    rows = [sdpa]
    for mask in problem.masks:
        flex_grads = want = None
        for row in mask_rows(problem, mask, flex):
            rows.append(row)
            got = first_call(row, problem, sync)
            if got is None:
                reason = row.record.get("reason", "")
                if row.record["kernel"] == "flex" and not reason.startswith("OutOfMemoryError"):
                    flex.refused.setdefault(mask.block, reason)
                continue
            want = reference(problem, row, check_heads) if want is None else want
            check(row, got, want, None if row.record["kernel"] == "flex" else flex_grads)
            if row.record["kernel"] == "flex":
                flex_grads = got[1:]
            del got
    if problem.gna is not None:
        row = gna_row(problem)
        got = first_call(row, problem, sync)
        if got is not None:
            check(row, got, reference(problem, row, check_heads), None)
        rows.append(row)
    return rows


def time_rows(rows: list[Row], problem: Problem, sizes: Sizes, sync: Callable[[], None]) -> None:
    """Forward, backward alone and step of every row whose status is ok, in interleaved rounds: medians, every
    round, useful TFLOP/s and the ratios to Flex (same mask) and to dense SDPA (same problem) in the records.
    Where the backward alone cannot run again on a held graph, it is given as step - forward, and says so."""
    q, k, v, g = problem.q, problem.k, problem.v, problem.g
    outputs: dict[int, torch.Tensor] = {}

    def held(row: Row) -> torch.Tensor:
        """The row's one output whose graph every backward-alone call replays (retain_graph)."""
        if id(row) not in outputs:
            outputs[id(row)] = row.attend(q, k, v)
        return outputs[id(row)]

    timers = {}
    for index, row in enumerate(rows):
        if row.record["status"] != "ok":
            continue
        phases = {"fwd": lambda row=row: row.attend(q, k, v),
                  "bwd": lambda row=row: torch.autograd.grad(held(row), (q, k, v), g, retain_graph=True),
                  "step": lambda row=row: torch.autograd.grad(row.attend(q, k, v), (q, k, v), g)}
        for phase, fn in phases.items():
            try:
                fn()
                sync()
                timers[(index, phase)] = fn
            except Exception as error:
                row.record.setdefault("phase_errors", {})[phase] = first_line(error)
        if (index, "fwd") not in timers or (index, "step") not in timers:
            row.record.update(status="error", reason=json.dumps(row.record["phase_errors"]))
            timers = {key: fn for key, fn in timers.items() if key[0] != index}
    for (index, phase), values in interleaved(timers, sizes.rounds, sizes.min_ms, sync).items():
        record = rows[index].record
        record.setdefault("rounds_ms", {})[phase] = values
        record.setdefault("ms", {})[phase] = statistics.median(values)
    flops = {"fwd": 1.0, "bwd": BACKWARD_FLOPS, "step": STEP_FLOPS}
    for row in rows:
        record = row.record
        if "ms" not in record:
            continue
        if "bwd" not in record["ms"]:
            record["ms"]["bwd"] = record["ms"]["step"] - record["ms"]["fwd"]
            record["bwd_derived"] = "step - fwd: the backward alone did not run on a held graph"
        record["tflops"] = {p: flops[p] * record["forward_flops"] / record["ms"][p] / 1e9 for p in PHASES}
    relate(rows)


def relate(rows: list[Row]) -> None:
    """Per timed row: ours / Flex per phase for natsim rows (Flex on the same mask), and the dense SDPA step
    over the row's step (its speedup over dense training attention)."""
    sdpa = next((r.record for r in rows if r.record["kernel"] == "sdpa" and "ms" in r.record), None)
    flex = {id(r.mask): r.record for r in rows if r.record["kernel"] == "flex" and "ms" in r.record}
    for row in rows:
        record = row.record
        if "ms" not in record:
            continue
        if sdpa is not None:
            record["sdpa_step_over_step"] = sdpa["ms"]["step"] / record["ms"]["step"]
        peer = flex.get(id(row.mask))
        if record["kernel"] in ("natsim", "natsim-prepared") and peer is not None:
            record["ours_over_flex"] = {p: record["ms"][p] / peer["ms"][p] for p in PHASES}


# -- the run -------------------------------------------------------------------------------------------------------


def environment(device: torch.device, sizes: Sizes) -> dict:
    """Device, versions, date and the run's settings."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "dtype": str(DTYPE), "batch": 1,
            "head_dim": sizes.head_dim, "rounds": sizes.rounds, "min_ms_per_round": sizes.min_ms,
            "check_heads": sizes.check_heads, "tolerances": {"out": OUT_TOLERANCE, "grad": GRAD_TOLERANCE},
            "flops": {"forward": "4 * pairs * head_dim", "backward": f"{BACKWARD_FLOPS} x forward",
                      "step": f"{STEP_FLOPS} x forward"}}


def builders(cases: list[str], sizes: Sizes) -> list[tuple[str, Callable[[Sizes, torch.device], Problem]]]:
    """The problems the selected cases need, in run order."""
    shared = {"random128", "random64", "merged16"} | ({"gna"} if shares_tokens(sizes) else set())
    chosen = []
    if shared & set(cases):
        chosen.append((f"N={sizes.tokens}", lambda sizes, device: token_problem(cases, sizes, device)))
    if "gna" in cases and not shares_tokens(sizes):
        chosen.append(("gna", gna_problem))
    if "predicted" in cases:
        chosen.append(("predicted", predicted_problem))
    return chosen


def run(out: Path, cases: list[str], sizes: Sizes, device: torch.device, budget_s: float) -> dict:
    """Every selected problem: rows, checks, timing; the JSON rewritten after each problem. A problem that
    would start past `budget_s` is skipped, and one that fails outside its rows is recorded as an error row."""
    start = time.perf_counter()
    record = {**environment(device, sizes), "cases": cases, "gna_layout": sizes.gna, "rows": []}
    path = out / f"training-{record['device'].replace(' ', '_')}-{record['date']}.json"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flex = Flex(device)
    for name, build in builders(cases, sizes):
        if time.perf_counter() - start > budget_s:
            record["rows"].append({"problem": name, "kernel": "-", "status": "skipped",
                                   "reason": f"would start past the {budget_s:.0f} s budget"})
            print(f"{name}: skipped (budget)", flush=True)
            continue
        try:
            problem = build(sizes, device)
            for t in (problem.q, problem.k, problem.v):
                t.requires_grad_()
            rows = problem_rows(problem, flex, sync, sizes.check_heads)
            time_rows(rows, problem, sizes, sync)
            record["rows"] += [row.record for row in rows]
        except Exception as error:  # a failure outside a row (e.g. out of memory building a mask)
            record["rows"].append({"problem": name, "kernel": "-", "status": "error", "reason": first_line(error),
                                   "traceback": traceback.format_exc()[-3000:]})
        problem = rows = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        record["elapsed_s"] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(record, indent=1))
        print(f"{name}: done at {record['elapsed_s']} s", flush=True)
    record["elapsed_s"] = round(time.perf_counter() - start, 1)
    path.write_text(json.dumps(record, indent=1))
    record["path"] = str(path)
    return record


def table(record: dict) -> Table:
    """The rows as a rich table: times, useful TFLOP/s, ratios, errors, status."""
    table = Table(title=f"training step on {record['device']}, torch {record['torch']}, bf16, head_dim "
                        f"{record['head_dim']}: medians of {record['rounds']} interleaved rounds")
    for name in ("problem", "mask", "kernel", "blocks", "density", "fwd ms", "bwd ms", "step ms",
                 "TFLOP/s f/b/s", "ours/Flex f/b/s", "dense/step", "grad err", "vs Flex", "status"):
        text = name in ("problem", "mask", "kernel", "status")
        table.add_column(name, justify="left" if text else "right", no_wrap=text, overflow="ellipsis",
                         max_width=40 if name == "status" else None)

    def number(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "-"

    for r in record["rows"]:
        ms, tflops, ratio = r.get("ms", {}), r.get("tflops", {}), r.get("ours_over_flex", {})
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        if r["kernel"] == "sdpa" and r["status"] == "ok":
            status = r["backend"] + (" (cuDNN unavailable)" if "backend_note" in r else "")
        table.add_row(
            r["problem"], r.get("mask", "-"), r["kernel"], r.get("blocks") or "-", number(r.get("density"), ".3f"),
            *(number(ms.get(p), ".2f") for p in PHASES),
            "/".join(number(tflops.get(p), ".0f") for p in PHASES) if tflops else "-",
            "/".join(number(ratio.get(p), ".2f") for p in PHASES) if ratio else "-",
            number(r.get("sdpa_step_over_step"), ".2f"), number(r.get("grad_err_vs_fp32"), ".1e"),
            number(r.get("grad_err_vs_flex"), ".1e"), status)
    return table


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for training-<device>-<date>.json")
    parser.add_argument("--small", action="store_true", help="tiny sizes on the CPU, seconds (the smoke test)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--gna-layout", choices=("32k", "hunyuan"), default="32k",
                        help="the gna case's layout: 16x32x64 (shares the random cases' problem) or HunyuanVideo's")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; --small 2)")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="skip the problems that would start after this many seconds")
    args = parser.parse_args(argv)
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    if not cases or set(cases) - set(CASES):
        parser.error(f"--cases takes names from {','.join(CASES)}, got {args.cases!r}.")
    sizes = SMALL_SIZES if args.small else dataclasses.replace(GPU_SIZES, gna=GNA_LAYOUTS[args.gna_layout])
    if args.rounds is not None:
        sizes = dataclasses.replace(sizes, rounds=args.rounds)
    if args.small:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("benchmarks/training.py needs a CUDA GPU; --small runs tiny sizes on the CPU.")
    args.out.mkdir(parents=True, exist_ok=True)
    record = run(args.out, cases, sizes, device, args.budget_s)
    console = Console(width=240)
    console.print(f"wrote {record['path']} ({record['elapsed_s']} s)")
    console.print(table(record))
    return record


if __name__ == "__main__":
    main()
