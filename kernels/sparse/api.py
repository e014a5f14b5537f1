"""Public entry points of attention under any block mask.

- `sparse_attention(q, k, v, mask, ...)`: `[B, N, heads, head_dim]` in and out. Its arguments become one
  `SparseSpec` (kernels/sparse/spec.py). Runs the registered operator `natsim::sparse_forward` (or, on prepared
  work, `natsim::sparse_prepared`; kernels/sparse/ops.py) under torch.compile, autograd or a dispatch mode, and
  in plain eager calls goes straight to the same implementation (kernels/sparse/dispatch.py).
- `sparse_tile_counts(mask, ...)`: runs the kernel with its debug counters on and returns its per-program counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import numpy as np
import torch

from ..common.backend import autocast_inputs, runs_eagerly, use_triton
from ..common.checks import KERNEL_DTYPES, check_backend, check_tensors
from ..common.fp8 import Fp8Scales, check_fp8_call, refuse_gradients, scale_tensors
from ..fa4 import run as fa4_run
from ..fa4.ops import fa4_blocks, lists_schema
from ..fa4.rules import tile_refusal
from ..gluon.forward import AUTO_16BIT_HEAD_DIMS, BlockLists
from ..gluon.forward import refusal as gluon_refusal
from ..gluon.ops import NO_BACKWARD_16BIT, gluon_16bit_forward, gluon_fp8_forward
from .checks import check_sparse_qkv, check_work
from .dispatch import sparse_forward_impl
from .forward import run_sparse
from .mask import SparseMask
from .ops import PV_SKIP_GRADIENT_REFUSAL, sparse_forward, sparse_prepared
from .spec import SparseSpec
from .work import SparseWork, dense_mask, prepare_sparse, work_sizes, work_tensors


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Union[torch.Tensor, SparseMask, SparseWork],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    *,
    merge: Optional[str] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    schedule: Optional[str] = None,
    programs: Optional[int] = None,
    pv_threshold: Optional[float] = None,
    precision: Optional[str] = None,
    scales: Optional[Fp8Scales] = None,
    out_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
):
    """Attention of `[B, N, heads, head_dim]` q, k, v under a block mask: query i attends key j exactly when
    `mask[b, h, i // q_block, j // kv_block]`.

    - `mask`: a boolean `[B or 1, heads or 1, ceil(N / q_block), ceil(N / kv_block)]` tensor (then `q_block`
      and `kv_block` are required: powers of two, q_block 8 to 128, kv_block 1 to 128), a `SparseMask`, or a
      `SparseWork` from `prepare_sparse`: the mask's work for the forward and the backward done once and reused
      by every call, in eager calls, under autograd, torch.compile and CUDA graphs (its blocks and merge are
      its own: leave `q_block`, `kv_block` and `merge` None). A boolean mask or SparseMask is prepared again
      on every call (and its backward lists again in the backward) and runs on natsim's kernels; a SparseWork
      runs on the backend `prepare_sparse` chose or was asked for (`prepare_sparse(..., backend="fa4")`:
      FlashAttention-4), calls that backend does not take on natsim's kernels, or, where the work names its
      backend, refused with a sentence.
    - `backend`: None (a SparseWork's own backend; natsim's kernels for a boolean mask), "triton", "fa4"
      (FlashAttention-4: a SparseWork prepared with its lists, or a boolean mask prepared for it on this call,
      outside torch.compile) or "gluon" (natsim's Gluon kernel on Hopper: 128 x 128 blocks, head_dim 64 or 128,
      forward only; in FP8, or in 16 bits its 16-bit variant). Among natsim's kernels a call naming no backend
      takes the Gluon kernel on Hopper where it fits: in FP8, and in 16 bits at head_dim 128 without gradients on
      the default schedule (measured 1.14-1.19x natsim's Triton kernel; docs/kernels.md).
    - `merge`: None (a program holds one query block, at least 16 rows), `"consecutive"` or `"xor"` (a program
      holds 128 queries, 128 // q_block blocks: consecutive ones, or natsim.merge's XOR greedy per head).
      The output never depends on it: each row is masked by its own block's row.
    - `schedule`: `"grid"` (default, one program per group) or `"lpt"` (persistent, longest group first;
      `programs` sets how many, default about one per SM slot).
    - `pv_threshold`: None (exact), or SpargeAttn's lambda (negative, natural-log units of the scaled scores):
      a query block skips a tile's P @ V when every one of its rows has the tile's maximum score more than
      `-pv_threshold` below its running maximum (module docstring; an approximation that depends on the
      order of the tiles, which `kernels/sparse/reference.py` reproduces in torch).
    - `precision`: None (the inputs' dtype) or `"fp8"` (inference only): q, k, v quantized to float8 e4m3 inside
      the call, QK^T and P @ V on FP8 tensor cores (kernels/common/fp8.py); not with `pv_threshold`; blocks of
      the kernel (`block_n`) of at least 32 keys on the GPU.
    - `scales`, `out_dtype`: q, k, v already in float8 e4m3 come with `scales=Fp8Scales(q_scale, k_scale,
      v_scale)` (per token and head for q and k, per channel for v; kernels/common/fp8.py says which shapes
      broadcast) and imply `precision="fp8"`: the kernel reads them as given (no K mean removed) and returns the
      output in `out_dtype` (torch.bfloat16 by default, or torch.float16).
    Returns the output (q's dtype, or `out_dtype`) and with `return_lse` the natural-log LSE `[B, N, heads]`
    (float32, -inf for a query that attends nothing, whose output is 0). Differentiable with respect to q, k and
    v (the Triton backward kernels, kernels/sparse/backward.py, on the unmerged mask; the reference's gradients
    on the CPU path), except with `pv_threshold`, whose skips have no gradient (refused). CPU tensors without
    TRITON_INTERPRET=1 run `sparse_reference`.
    """
    check_tensors(q, k, v)
    q, k, v = autocast_inputs(q, k, v)
    precision, scales, out_dtype = check_fp8_call(q, k, v, precision, scales, out_dtype)
    if precision is not None:
        refuse_gradients("sparse_attention", q, k, v, *scale_tensors(scales))
    prepared = isinstance(mask, SparseWork)
    check_sparse_qkv(q, k, v)  # before the mask, whose shape is read against q's
    if prepared:
        if any(value is not None for value in (q_block, kv_block, merge)):
            raise ValueError(
                "q_block, kv_block and merge are the SparseWork's own (chosen by prepare_sparse): pass None with "
                f"it, got (q_block, kv_block, merge)={(q_block, kv_block, merge)}."
            )
        check_work(mask, q)  # whichever backend then runs it
    else:
        mask, q_block, kv_block, _ = dense_mask(mask, q_block, kv_block, q.shape[1])
    # The backward kernels need the forward's LSE: ask for it whenever autograd will want gradients.
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    spec = SparseSpec.of(q_block=q_block, kv_block=kv_block, merge=merge, scale=scale,
                         return_lse=return_lse or tracked, schedule=schedule, programs=programs,
                         pv_threshold=pv_threshold, precision=precision, out_dtype=out_dtype)
    if spec.pv_threshold is not None and tracked:
        raise ValueError(PV_SKIP_GRADIENT_REFUSAL)
    check_backend(backend)
    gluon_blocks = _gluon_blocks(q, mask, spec, scales, backend, tracked)
    if gluon_blocks is not None:
        on_gluon = gluon_fp8_forward if spec.precision == "fp8" else gluon_16bit_forward
        out, lse = on_gluon(q, k, v, gluon_blocks.counts, gluon_blocks.indices, _scale(q, spec), spec.return_lse)
        return (out, lse) if return_lse else out
    if not prepared and backend == "fa4":
        if torch.compiler.is_compiling():
            raise ValueError("sparse_attention(..., backend='fa4') on a boolean mask prepares FlashAttention-4's lists "
                             "on the call, which a compiled graph cannot hold: prepare them once before, with "
                             "prepare_sparse(mask, ..., backend='fa4'), and pass that SparseWork.")
        mask = prepare_sparse(mask, q_block, kv_block, q.shape[1], merge=merge, device=q.device, backward=tracked,
                              backend="fa4")
        prepared = True
    if prepared:
        if backend == "fa4" and mask.fa4 is None:
            raise ValueError("backend='fa4' needs a SparseWork prepared with FlashAttention-4's lists "
                             "(prepare_sparse(..., backend='fa4')); this one runs on natsim's kernels.")
        if backend == "triton":
            mask = replace(mask, fa4=None, requested="triton")
        out, lse = _attend_prepared(q, k, v, mask, spec, scales, tracked)
    elif runs_eagerly(q, k, v):
        out, lse = sparse_forward_impl(q, k, v, mask, spec, scales)
    else:
        out, lse = sparse_forward(q, k, v, mask, *spec.mask_arguments(scales))
    return (out, lse) if return_lse else out


def _attend_prepared(q, k, v, work: SparseWork, spec: SparseSpec, scales: Optional[Fp8Scales], tracked: bool):
    """`sparse_attention` on prepared work that fits q (`check_work`): the kernel straight away in plain eager
    Triton calls, else the registered operator `natsim::sparse_prepared` (autograd, torch.compile, dispatch modes,
    the CPU path)."""
    if tracked and work.dkdv_lists is None:
        raise ValueError(
            "this SparseWork was prepared without the backward's lists (prepare_sparse(..., backward=False)) and "
            "q, k or v requires grad: prepare it with backward=True, or call under torch.no_grad()."
        )
    if _on_fa4(work, q, spec, scales, tracked):
        if runs_eagerly(q, k, v):
            out, lse = fa4_run.forward(q, k, v, _scale(q, spec), work.fa4, None, spec.return_lse)
            return out, lse
        return fa4_blocks(q, k, v, *lists_schema(work.fa4), spec.scale, spec.return_lse)
    if runs_eagerly(q, k, v) and use_triton(q):
        out, lse, _ = run_sparse(work, q, k, v, spec, scales)
        return out, lse
    return sparse_prepared(q, k, v, work_tensors(work), work_sizes(work), *spec.work_arguments(scales))


def _scale(q: torch.Tensor, spec: SparseSpec) -> float:
    return q.shape[-1] ** -0.5 if spec.scale is None else spec.scale


def _gluon_blocks(q: torch.Tensor, mask: Union[torch.Tensor, SparseWork], spec: SparseSpec,
                  scales: Optional[Fp8Scales], backend: Optional[str], tracked: bool) -> Optional[BlockLists]:
    """The block lists of a call that runs on the Gluon kernel (kernels/backends/gluon.py), None for a call that
    runs elsewhere. A call (or its prepared work) naming backend 'gluon' runs there or is refused with a sentence
    (CPU tensors run the kernel's torch reference on the same blocks): in FP8, or on the inputs as they are. A
    call naming no backend runs there where it fits and was measured faster than natsim's Triton kernel: CUDA
    bf16 / fp16 inputs on a GPU it runs on, 128 x 128 blocks, no PV skip, and in FP8 any head dim it runs; in 16
    bits head_dim 128, no gradients, no prepared FlashAttention-4 lists and the default schedule (CPU tensors keep
    their reference, the interpreter natsim's Triton kernel)."""
    wanted = backend if backend is not None else (mask.requested if isinstance(mask, SparseWork) else None)
    if wanted not in (None, "gluon"):
        return None
    work = mask if isinstance(mask, SparseWork) else None
    q_block, kv_block = (work.q_block, work.kv_block) if work is not None else (spec.q_block, spec.kv_block)
    fp8 = spec.precision == "fp8"
    if wanted is None:
        if not q.is_cuda or scales is not None or spec.pv_threshold is not None:
            return None
        if not fp8 and (tracked or q.shape[-1] not in AUTO_16BIT_HEAD_DIMS or spec.schedule != "grid"
                        or (work is not None and work.fa4 is not None)):
            return None
        if gluon_refusal(q.dtype, q.shape[-1], torch.cuda.get_device_capability(q.device), q_block, kv_block,
                         fp8=fp8):
            return None
    else:
        refusal = _gluon_refusal(q, spec, scales, q_block, kv_block)
        if refusal is not None:
            raise ValueError(f"backend='gluon' cannot run this call: {refusal}")
        if not fp8 and tracked:
            raise RuntimeError(NO_BACKWARD_16BIT)
    return BlockLists.from_blocks((work.mask if work is not None else mask).to(q.device))


def _gluon_refusal(q: torch.Tensor, spec: SparseSpec, scales: Optional[Fp8Scales], q_block: int,
                   kv_block: int) -> Optional[str]:
    """Why the Gluon kernel cannot run a call that names it, or None."""
    if scales is not None:
        return ("it quantizes bfloat16 / float16 inputs itself: inputs given in float8 run on natsim's Triton FP8 "
                "kernel (backend='triton').")
    if spec.pv_threshold is not None:
        return "it skips no P @ V: pv_threshold runs on natsim's Triton kernel (backend='triton')."
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return gluon_refusal(q.dtype, q.shape[-1], capability, q_block, kv_block, fp8=spec.precision == "fp8")


def _on_fa4(work: SparseWork, q: torch.Tensor, spec: SparseSpec, scales: Optional[Fp8Scales], tracked: bool) -> bool:
    """Whether a call on `work` runs on FlashAttention-4: the work has its lists and the call is one it takes (CUDA
    tensors in bf16 / fp16, no PV skip, no FP8, blocks it runs at this head dim, forward and with `tracked`
    backward). Where the work was prepared for it by name (`backend="fa4"`), a call it cannot take is refused."""
    if work.fa4 is None:
        return False
    if not q.is_cuda:
        refusal = "FlashAttention-4 runs on CUDA tensors."
    elif q.dtype not in KERNEL_DTYPES or scales is not None or spec.precision is not None:
        refusal = f"FlashAttention-4 runs bfloat16 and float16 inputs without FP8, got dtype={q.dtype}."
    elif spec.pv_threshold is not None:
        refusal = "FlashAttention-4 has no PV skip (pv_threshold)."
    else:
        refusal = tile_refusal(work.q_block, work.kv_block, q.shape[-1], backward=tracked)
    if refusal is not None and work.requested == "fa4":
        raise ValueError(f"this SparseWork was prepared for FlashAttention-4 (backend='fa4'), which cannot run this "
                         f"call: {refusal} Prepare it with backend='triton' or None.")
    return refusal is None


@dataclass(frozen=True)
class SparseTileCounts:
    """The kernel's own debug counts, one entry per program (work item) `[B, H, groups]`: `loaded` KV blocks,
    `computed` (query block, KV block) pairs, `pv_skipped` pairs of the mask (attended) whose P @ V the PV
    skip left out (0 without `pv_threshold`; at most the mask's pairs), and `members` `[B, H, groups, R]`, the
    query blocks of each program (-1 where the last group is short). `natsim.merge(mask[b, h], R, method)`
    predicts `merged.visited` and `merged.visited * group_sizes` for the same `members` (its `groups`)."""

    loaded: np.ndarray
    computed: np.ndarray
    members: np.ndarray
    merge_seconds: float
    pv_skipped: np.ndarray


def sparse_tile_counts(
    mask: Union[torch.Tensor, SparseMask],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    *,
    seq_len: Optional[int] = None,
    merge: Optional[str] = None,
    schedule: str = "grid",
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    head_dim: int = 32,
    device: Union[str, torch.device] = "cuda",
    dtype: torch.dtype = torch.float16,
    pv_threshold: Optional[float] = None,
    inputs: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    scale: Optional[float] = None,
) -> SparseTileCounts:
    """Run the kernel with its debug counters on and return its per-program counts: on `inputs` (q, k, v of
    the mask's batch and heads, on `device`), else on random ones (N = `seq_len`, by default the mask's blocks
    times its rows; `head_dim`, `dtype`). The PV-skip count depends on the inputs: pass them with
    `pv_threshold`."""
    if isinstance(mask, SparseMask):
        seq_len = mask.seq_len if seq_len is None else seq_len
    elif seq_len is None and q_block is not None and isinstance(mask, torch.Tensor) and mask.dim() == 4:
        seq_len = mask.shape[2] * q_block
    work = prepare_sparse(mask, q_block, kv_block, seq_len, merge=merge, block_m=block_m, block_n=block_n,
                          device=torch.device(device), backward=False)
    if inputs is None:
        shape = (work.mask_batch, work.seq_len, work.mask_heads, head_dim)
        inputs = tuple(torch.randn(shape, device=device).to(dtype) for _ in range(3))
    q, k, v = inputs
    spec = SparseSpec.of(scale=scale, schedule=schedule, pv_threshold=pv_threshold)
    _, _, counts = run_sparse(work, q, k, v, spec, debug=True)
    counts = counts.cpu().numpy().astype(np.int64).reshape(q.shape[0], q.shape[2], work.groups, 3)
    members = work.members.cpu().numpy().astype(np.int64).reshape(work.mask_batch, work.mask_heads, work.groups, -1)
    return SparseTileCounts(counts[..., 0], counts[..., 1], members, work.merge_seconds, counts[..., 2])
