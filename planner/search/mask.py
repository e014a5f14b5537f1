"""`best_mask(mask, ...)`: choose the block granularity and query merging that run a predicted mask fastest.

A predictor's mask can run at its own blocks or OR-pooled to coarser ones (32, 64, 128 tokens along queries
and keys): fewer, larger blocks mean less per-block overhead but more work, since a coarse block is attended
when any of its fine blocks is; pooling only adds blocks, so every candidate computes at least what was asked
for. Small query blocks can also be merged into 128-query programs (`natsim.merge`: consecutive, or FG-Attn's
XOR greedy), which gives back part of their sparsity for wider matrix products.

Each candidate (query block, KV block, merge) is counted as the kernel would run it: the work
`natsim.kernels.prepare_sparse` would make with the GPU's program tiles (grouped as it groups, by natsim.merge's
XOR greedy for "xor"), counted on the mask's bit-packed rows (planner.search.mask_work, which the tests hold to
`prepare_sparse`), turned into planner.cost.sparse_features' features and scored by the cost model's sparse
coefficients, or, without coefficients for the GPU, by the token pairs the kernel computes (tile work). The
winner is the best score, except that a candidate within TIE_TOLERANCE of it that needs less host work (no merge
before consecutive before xor, then coarser blocks) is preferred: the host's merge time is not in the kernel
model. With `precision="fp8"` the candidates are scored by the FP8 sparse kernel's coefficients (the same work,
FP8's cost per unit; tile work without them) and the plan runs in FP8. The result is a `MaskPlan`
(planner.plans.mask).

Where FlashAttention-4 is a backend the search ranks (planner.backends: installed, on this GPU, with its
coefficients), every granularity it runs unmerged is a candidate too, scored by its own coefficients on the
blocks the pooled mask visits (planner.cost.fa4_features; every visited block is full, nothing is permuted).
Where it has coefficients but does not run here it is priced all the same, and the plan records what it would
have picked. natsim's Gluon kernel adds a candidate at 128 x 128 blocks, unmerged (planner.cost.gluon_features),
where its coefficients exist: in FP8 in FlashAttention-4's place, and in 16 bits its variant beside
FlashAttention-4 for inference. With `training=True` the plan runs in a model that trains through it: only
backends with a backward are ranked (natsim's Triton kernels; FlashAttention-4 where the cost model has its
backward coefficients and its backward runs the blocks), each still scored by its forward alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Optional, Sequence, Union

import numpy as np
import torch

from natsim.kernels import SparseMask
from natsim.kernels.backends import capabilities
from natsim.kernels.backends.triton import check_precision, default_blocks, fp8_head_split

from ..backends import BackendsLike, backend_choice, fa4_mask_refusal, gluon_tiles_refusal
from ..catalog import as_dtype, dtype_name
from ..cost.fa4_features import FA4_FEATURES, mask_fa4_features
from ..cost.gluon_features import GLUON_FEATURES, mask_gluon_features
from ..cost.model import CostModel, host_call
from ..cost.resolve import CostModelLike, DeviceLike, resolve_cost_model
from ..cost.sparse_features import SPARSE_FEATURES
from ..plans.mask import MERGES, MaskCandidate, MaskLike, MaskPlan, fine_mask
from .mask_work import PackedMask
from ..plans.ranking import BASIS_COST_MODEL, BASIS_TILES, TIE_TOLERANCE

BLOCKS = (16, 32, 64, 128)  # the granularities scored (those at least the mask's own)
DENSE_BLOCK = 128  # the dense reference: every 128 x 128 block, one query block per program
_GPU = torch.device("cuda")  # program tiles are the GPU's, whatever device plans (default_blocks reads the type)
SPARSE_HEAD_DIMS = capabilities("triton", "masks").head_dims  # those the sparse kernel runs


def token_density(mask: torch.Tensor, q_block: int, kv_block: int, seq_len: int) -> float:
    """The share of (query, key) token pairs a block mask attends, averaged over its batch and heads (the last
    partial blocks count their real tokens only)."""
    def lengths(block: int, count: int) -> torch.Tensor:
        return (seq_len - torch.arange(count, device=mask.device) * block).clamp(max=block).to(torch.float64)

    q_len, kv_len = lengths(q_block, mask.shape[2]), lengths(kv_block, mask.shape[3])
    pairs = (mask.to(torch.float64) @ kv_len) @ q_len  # [B, H]
    return float(pairs.mean()) / (seq_len * seq_len)


def _positive(name: str, value, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}.")
    return int(value)


def _blocks(name: str, values: Optional[Sequence[int]], finest: int) -> tuple[int, ...]:
    """The granularities to score along one axis: `values`, or by default the mask's own block and those of
    BLOCKS above it (each a power of two from the mask's block to 128)."""
    allowed = tuple(sorted({finest, *(b for b in BLOCKS if b > finest)}))
    chosen = allowed if values is None else tuple(values)
    bad = [b for b in chosen if isinstance(b, bool) or b not in allowed]
    if bad or not chosen:
        raise ValueError(
            f"{name} must be a non-empty subset of {allowed} (the mask's block {finest} and coarser ones up to "
            f"{BLOCKS[-1]}), got {name}={tuple(chosen)!r}."
        )
    return tuple(sorted(set(int(b) for b in chosen)))


def _candidate(rows: PackedMask, q_block: int, kv_block: int, merge: str, batch: int, heads: int, head_dim: int,
               cost_model: Optional[CostModel], precision: Optional[str] = None) -> tuple[MaskCandidate, np.ndarray]:
    """One candidate scored on the work `prepare_sparse` would make for it (counted by planner.search.mask_work),
    with the GPU's program tiles, and its feature row."""
    _, _, group, method = _grouping(q_block, kv_block, merge)
    block_m, block_n = default_blocks(q_block, kv_block, None if merge == "none" else merge, _GPU)
    row, seconds = rows.features(q_block, kv_block, group, method, block_m=block_m, block_n=block_n, batch=batch,
                                 heads=heads, head_dim=head_dim)
    tiles = row[SPARSE_FEATURES.index("tiles")]
    pairs = tiles * block_m * block_n  # the call's computed token pairs
    seq_len = rows.seq_len
    score = float(cost_model.predict_sparse(row, precision)) if cost_model is not None else float(pairs)
    return MaskCandidate(
        q_block=q_block, kv_block=kv_block, merge=merge, block_m=block_m, block_n=block_n,
        density=rows.density(q_block, kv_block),
        work=float(pairs) / (batch * heads * seq_len * seq_len), tiles=int(tiles),
        programs=int(row[SPARSE_FEATURES.index("programs")]), score=score,
        merge_s=seconds if merge == "xor" else 0.0,
    ), row


def _visited_blocks(rows: PackedMask, q_block: int, kv_block: int, batch: int, heads: int) -> int:
    """Blocks the pooled mask visits at `q_block` x `kv_block`, over every batch entry and head (a mask of batch or
    heads 1 serves each)."""
    copies = (batch // rows.batch) * (heads // rows.heads)
    return int(rows.row_counts(q_block, kv_block).sum()) * copies


def _unmerged_candidate(rows: PackedMask, q_block: int, kv_block: int, batch: int, heads: int, visited: int,
                        programs: float, score: float, backend: str) -> MaskCandidate:
    """A library kernel's candidate: `visited` blocks of `q_block` x `kv_block`, every one full, unmerged."""
    return MaskCandidate(
        q_block=q_block, kv_block=kv_block, merge="none", block_m=q_block, block_n=kv_block,
        density=rows.density(q_block, kv_block),
        work=visited * q_block * kv_block / (batch * heads * rows.seq_len ** 2), tiles=visited,
        programs=math.ceil(programs), score=score, merge_s=0.0, backend=backend,
    )


def _fa4_candidate(rows: PackedMask, q_block: int, kv_block: int, batch: int, heads: int, head_dim: int,
                   cost_model: CostModel) -> tuple[MaskCandidate, np.ndarray]:
    """FlashAttention-4's candidate at `q_block` x `kv_block` (unmerged): the blocks the pooled mask visits, every
    one full, scored by the cost model's FlashAttention-4 coefficients, and its feature row."""
    visited = _visited_blocks(rows, q_block, kv_block, batch, heads)
    row = mask_fa4_features(visited, q_block=q_block, kv_block=kv_block, seq_len=rows.seq_len,
                            batch_heads=batch * heads, head_dim=head_dim)
    return _unmerged_candidate(rows, q_block, kv_block, batch, heads, visited, row[FA4_FEATURES.index("programs")],
                               float(cost_model.predict_fa4(row)), "fa4"), row


def _gluon_candidate(rows: PackedMask, batch: int, heads: int, head_dim: int, dtype: torch.dtype,
                     cost_model: CostModel, precision: Optional[str]) -> tuple[MaskCandidate, np.ndarray]:
    """The Gluon kernel's candidate at its 128 x 128 blocks (unmerged) in `precision` (None: its 16-bit variant):
    the blocks the pooled mask visits, every one full, scored by the cost model's Gluon coefficients of that
    precision, and its feature row."""
    visited = _visited_blocks(rows, DENSE_BLOCK, DENSE_BLOCK, batch, heads)
    row = mask_gluon_features(visited, seq_len=rows.seq_len, batch_heads=batch * heads, head_dim=head_dim,
                              element_bytes=dtype.itemsize, fp8=precision == "fp8")
    return _unmerged_candidate(rows, DENSE_BLOCK, DENSE_BLOCK, batch, heads, visited,
                               row[GLUON_FEATURES.index("programs")], float(cost_model.predict_gluon(row, precision)),
                               "gluon"), row


def _none_runs(backend: str, q_options: tuple[int, ...], kv_options: tuple[int, ...], head_dim: int,
               dtype: torch.dtype, training: bool) -> str:
    """Why `backend` (FlashAttention-4 or the Gluon kernel: natsim's Triton kernels run every candidate) has no
    candidate among these blocks."""
    if backend == "fa4":
        why = fa4_mask_refusal(q_options[0], kv_options[0], head_dim, dtype, backward=training)
        runs = "FlashAttention-4 with its backward runs" if training else "FlashAttention-4 runs"
        return (f"{runs} none of q_blocks={q_options} x kv_blocks={kv_options} at head_dim={head_dim} (for the "
                f"first: {why})")
    why = gluon_tiles_refusal(DENSE_BLOCK, DENSE_BLOCK, head_dim, dtype)
    if why is not None:
        return f"natsim's Gluon kernel does not run this call: {why}"
    return (f"natsim's Gluon kernel runs {DENSE_BLOCK} x {DENSE_BLOCK} blocks unmerged only, which q_blocks="
            f"{q_options}, kv_blocks={kv_options} and merges leave out")


def _grouping(q_block: int, kv_block: int, merge: str) -> tuple[int, int, int, str]:
    """`(q_block, kv_block, group, method)`: how `prepare_sparse` groups a candidate's query blocks, with the GPU's
    program tiles (XOR's greedy only where a group holds several blocks)."""
    block_m, _ = default_blocks(q_block, kv_block, None if merge == "none" else merge, _GPU)
    group = block_m // q_block
    return q_block, kv_block, group, "xor" if merge == "xor" and group > 1 else "consecutive"


@functools.lru_cache(maxsize=16)
def _dense_rows(seq_len: int) -> PackedMask:
    """Dense attention's mask, every 128 x 128 block on N = `seq_len` (the plans' reference), packed."""
    blocks = -(-seq_len // DENSE_BLOCK)
    return PackedMask(torch.ones((1, 1, blocks, blocks), dtype=torch.bool), DENSE_BLOCK, DENSE_BLOCK, seq_len)


def _preference(c: MaskCandidate) -> tuple:
    """Less host work first: no merge, consecutive, xor; then coarser blocks; then natsim's Triton kernels."""
    return (MERGES.index(c.merge), -c.q_block * c.kv_block, c.backend != "triton")


def _pick(candidates: Sequence[MaskCandidate]) -> MaskCandidate:
    """The winner among `candidates` (sorted by score): the least host work within TIE_TOLERANCE of the best."""
    limit = candidates[0].score * (1.0 + TIE_TOLERANCE)
    return min((c for c in candidates if c.score <= limit), key=_preference)


def best_mask(
    mask: MaskLike,
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    seq_len: Optional[int] = None,
    *,
    heads: Optional[int] = None,
    batch: Optional[int] = None,
    head_dim: int = 128,
    dtype: Union[torch.dtype, str] = torch.bfloat16,
    device: DeviceLike = None,
    cost_model: Optional[CostModelLike] = None,
    q_blocks: Optional[Sequence[int]] = None,
    kv_blocks: Optional[Sequence[int]] = None,
    merges: Sequence[str] = MERGES,
    keep_mask: bool = True,
    precision: Optional[str] = None,
    backends: BackendsLike = None,
    training: bool = False,
) -> MaskPlan:
    """The fastest way to run a predicted block mask with `sparse_attention`: its granularity and merge.

    - `mask`: the predictor's mask at its finest blocks: a boolean `[B|1, H|1, ceil(N / q_block),
      ceil(N / kv_block)]` tensor or numpy array (with `q_block`, `kv_block`, `seq_len` = N), or a SparseMask.
      Its rows are counted on the CPU (a CUDA mask is copied there once); the plan keeps its pooled mask on
      the mask's device.
    - `heads`, `batch`: the call's (default: the mask's; a mask dimension of 1 broadcasts). `head_dim` (32, 64,
      128) and `dtype` (bf16, fp16) describe q, k, v.
    - `device` picks the GPU whose stored coefficients score the candidates, as for `best`: a GPU's name or
      alias such as "h100" plans for it from any machine (refused when it has no coefficients here); None or a
      torch device means the GPU at hand. `cost_model` (a CostModel, or the path of a coefficients file)
      replaces the stored ones. Without sparse coefficients candidates are ranked by computed token pairs and
      the plan says so.
    - `q_blocks`, `kv_blocks`: the granularities to try (default: the mask's own block and 16, 32, 64, 128
      above it);
      `merges`: among "none", "consecutive", "xor" (a merge needs query blocks under 128).
    - `keep_mask`: keep the pooled mask in the plan, so that `plan(q, k, v)` runs it.
    - `precision`: None (the inputs' dtype) or "fp8": plan and run the FP8 inference kernel, scored by the FP8
      sparse coefficients (by token pairs without them).
    - `backends`: the kernel backends the plan may run on ("triton", "fa4", "gluon"), as for `best`: None means
      every one available here (FlashAttention-4 where it is installed, runs on the device and the cost model has
      its coefficients; it runs unmerged blocks, in the inputs' dtype; natsim's Gluon kernel on Hopper with its
      coefficients of the plan's precision, at 128 x 128 blocks unmerged, head_dim 64 or 128).
    - `training`: the plan runs where gradients flow through it (a model in training): only backends with a
      backward are ranked (not the Gluon kernel; FlashAttention-4 where the cost model has its backward
      coefficients and its backward runs the blocks), by their forward's predicted time. FP8 plans are for
      inference.

    >>> plan = best_mask(topp(q, k, 16, 16, 0.9), 16, 16, q.shape[1], device="h100")   # doctest: +SKIP
    >>> out = plan(q, k, v)                                                             # doctest: +SKIP
    """
    dense = fine_mask(mask, q_block, kv_block, seq_len)
    if isinstance(mask, SparseMask):
        q_block, kv_block, seq_len = mask.q_block, mask.kv_block, mask.seq_len
    mask_batch, mask_heads = dense.shape[:2]
    batch = _positive("batch", batch, mask_batch)
    heads = _positive("heads", heads, mask_heads)
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise ValueError(
            f"the mask's batch and heads must be 1 or the call's (batch={batch}, heads={heads}), got "
            f"mask.shape={tuple(dense.shape)}."
        )
    if isinstance(head_dim, bool) or head_dim not in SPARSE_HEAD_DIMS:
        raise ValueError(f"head_dim must be one the sparse kernel runs {SPARSE_HEAD_DIMS}, got head_dim={head_dim!r}.")
    dtype = as_dtype(dtype)
    merges = tuple(merges)
    if not merges or any(m not in MERGES for m in merges):
        raise ValueError(f"merges must be a non-empty subset of {MERGES}, got merges={merges!r}.")
    q_options = _blocks("q_blocks", q_blocks, q_block)
    kv_options = _blocks("kv_blocks", kv_blocks, kv_block)
    precision = check_precision(precision)
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got training={training!r}.")
    if precision is not None:
        if training:
            raise ValueError(f"precision={precision!r} is for inference (its kernels have no backward pass), so "
                             "training must be False; plan training in bfloat16 or float16 (precision=None).")
        fp8_head_split(head_dim)  # the FP8 kernels' head dims, refused with their sentence before any search
    gpu, model = resolve_cost_model(device, cost_model)
    if model is not None and not model.has("sparse" if precision is None else "sparse-fp8"):
        model = None
    excluded = {}
    if precision is not None:
        excluded["fa4"] = (f"it runs no FP8 on the GPUs natsim runs it on, so precision={precision!r} plans natsim's "
                           "kernels")
    elif training:
        excluded["gluon"] = "it has no backward pass, and training=True plans for gradients"
    if "none" not in merges:
        for name in ("fa4", "gluon"):
            excluded.setdefault(name, f"it runs unmerged blocks only, and merges={merges!r} leaves out 'none'")
    choice = backend_choice(backends, device=device, model=model, training=training, gpu=gpu, excluded=excluded,
                            fp8=precision == "fp8")

    rows = PackedMask(dense, q_block, kv_block, seq_len)
    # one 128-query block per program already: a merge changes nothing
    options = [(qb, kb, merge) for qb in q_options for kb in kv_options for merge in merges
               if merge == "none" or qb < DENSE_BLOCK]
    rows.prepare({(qb, kb) for qb, kb, _ in options})  # pooled rows and their counts, on every core
    rows.count([_grouping(qb, kb, merge) for qb, kb, merge in options])  # every candidate's counts, on every core
    scored, features = [], {}
    if "triton" in choice.priced:
        for qb, kb, merge in options:
            candidate, row = _candidate(rows, qb, kb, merge, batch, heads, head_dim, model, precision)
            scored.append(candidate)
            features[candidate.key] = row
    if "fa4" in choice.priced:
        for qb, kb in sorted({(qb, kb) for qb, kb, merge in options if merge == "none"}):
            if fa4_mask_refusal(qb, kb, head_dim, dtype, backward=training) is None:
                candidate, row = _fa4_candidate(rows, qb, kb, batch, heads, head_dim, model)
                scored.append(candidate)
                features[candidate.key] = row
    if ("gluon" in choice.priced and (DENSE_BLOCK, DENSE_BLOCK, "none") in options
            and gluon_tiles_refusal(DENSE_BLOCK, DENSE_BLOCK, head_dim, dtype) is None):
        candidate, row = _gluon_candidate(rows, batch, heads, head_dim, dtype, model, precision)
        scored.append(candidate)
        features[candidate.key] = row
    if model is not None:  # a call takes at least its backend's host time (planner.cost.host)
        scored = [replace(c, score=float(model.at_least_host(c.score, host_call(c.backend, precision))))
                  for c in scored]
    scored.sort(key=lambda c: (c.score, _preference(c)))
    runnable = [c for c in scored if c.backend in choice.allowed]
    if not options:
        raise ValueError(f"no candidate to score: merges={merges!r} need query blocks under {DENSE_BLOCK}.")
    if not runnable:
        raise ValueError("no candidate to score: " + "; ".join(
            _none_runs(name, q_options, kv_options, head_dim, dtype, training) for name in choice.allowed))
    winner = _pick(runnable)
    would_pick = _pick(scored) if choice.priced != choice.allowed else None
    dense_candidate, _ = _candidate(_dense_rows(seq_len), DENSE_BLOCK, DENSE_BLOCK, "none", batch, heads, head_dim,
                                    model, precision)
    breakdown = {}
    if winner.backend == "fa4":
        breakdown = model.fa4_breakdown(features[winner.key])
    elif winner.backend == "gluon":
        breakdown = model.gluon_breakdown(features[winner.key], precision)
    elif model is not None:
        breakdown = model.sparse_breakdown(features[winner.key], precision)
    kept = None
    if keep_mask:
        fine = (winner.q_block, winner.kv_block) == (q_block, kv_block)
        kept = dense if fine else rows.mask(winner.q_block, winner.kv_block)
    dense_score = dense_candidate.score if model is None else float(model.at_least_host(dense_candidate.score,
                                                                                        "triton"))
    return MaskPlan(
        seq_len=seq_len, fine_q_block=q_block, fine_kv_block=kv_block, q_block=winner.q_block,
        kv_block=winner.kv_block, merge=winner.merge, batch=batch, heads=heads, head_dim=head_dim,
        dtype=dtype_name(dtype), gpu=gpu, basis=BASIS_COST_MODEL if model is not None else BASIS_TILES,
        score=winner.score, dense_score=dense_score, breakdown=breakdown, candidates=tuple(scored),
        mask=kept, precision=precision, backend=winner.backend, backends=choice.allowed, would_pick=would_pick,
        backend_notes=choice.notes, training=training,
    )
