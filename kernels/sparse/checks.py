"""Argument checks at the sparse kernel's public boundary, with NATTEN-style sentence errors: q, k, v, what the
Triton kernel runs, a mask's batch and heads against q's, schedules and the PV-skip threshold."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..common.checks import KERNEL_DTYPES, check_head_dim, check_interpretable, check_matching, check_tensors
from ..common.fp8 import E4M3
from ..common.headdim import HEAD_DIMS, head_dim_refusal
from .work import SparseWork

SCHEDULES = ("grid", "lpt")
SPARSE_HEAD_DIMS = HEAD_DIMS  # 16 to 256 in steps of 8 (kernels/common/headdim.py)


def check_sparse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v are matching `[B, N, heads, head_dim]` tensors."""
    check_tensors(q, k, v)
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, tokens, heads, head_dim], got q.shape={tuple(q.shape)}.")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k and v must have the same shape, got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}."
        )
    check_matching(q, k, v)
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k and v must be floating-point tensors, got dtype={q.dtype}.")
    check_head_dim(q)


def check_pv_threshold(pv_threshold) -> Optional[float]:
    """None (no PV skip) or SpargeAttn's lambda: a negative finite number, in natural-log units of the scaled
    scores."""
    if pv_threshold is None:
        return None
    if isinstance(pv_threshold, bool) or not isinstance(pv_threshold, (int, float)) \
            or not -math.inf < pv_threshold < 0:
        raise ValueError(
            "pv_threshold must be None or a negative finite number (how far below a row's running maximum a "
            f"tile's maximum must fall for its P @ V to be skipped), got pv_threshold={pv_threshold!r}."
        )
    return float(pv_threshold)


def check_sparse_kernel(q: torch.Tensor, float8: bool = False) -> None:
    """What the Triton kernel runs: fp16/bf16 (float8 e4m3 too where the call was given `float8` inputs with
    their scales, kernels/common/fp8.py) and head_dim 16 to 256 in steps of 8."""
    if q.dtype not in KERNEL_DTYPES and not (float8 and q.dtype == E4M3):
        raise ValueError(
            f"the sparse kernel supports dtype float16 and bfloat16 (fp32 accumulation), got dtype={q.dtype}; "
            "use sparse_reference for other dtypes."
        )
    check_interpretable(q)
    refusal = head_dim_refusal(q.shape[-1], "sparse kernel", SPARSE_HEAD_DIMS)
    if refusal is not None:
        raise ValueError(refusal)


def check_mask_batch(mask_batch: int, mask_heads: int, q: torch.Tensor) -> None:
    """A mask's leading dimensions are q's batch and heads, or 1 (broadcast)."""
    batch, heads = q.shape[0], q.shape[2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise ValueError(
            f"the mask's batch and heads must be 1 or q's ({batch}, {heads}), got ({mask_batch}, {mask_heads})."
        )


def check_work(work: SparseWork, q: torch.Tensor) -> None:
    """A prepared `SparseWork` fits q: its sequence length, batch and heads, and device."""
    if q.shape[1] != work.seq_len:
        raise ValueError(f"q must have the mask's seq_len={work.seq_len} tokens, got q.shape={tuple(q.shape)}.")
    check_mask_batch(work.mask_batch, work.mask_heads, q)
    if work.members.device != q.device:
        raise ValueError(f"the mask must be on q's device, got {work.members.device} and q.device={q.device}.")
