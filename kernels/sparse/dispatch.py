"""One sparse-attention forward call under a boolean block mask or on prepared work (`SparseWork`), from its
`SparseSpec` (kernels/sparse/spec.py): the Triton kernel on CUDA tensors (or in the interpreter), the torch
reference on CPU tensors. What both the registered operators and the eager fast path of `sparse_attention` run."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..common.backend import use_triton
from ..common.fp8 import Fp8Scales
from .checks import check_mask_batch, check_sparse_kernel, check_sparse_qkv
from .forward import run_sparse
from .reference import fp8_sparse_reference, sparse_pv_reference, sparse_reference
from .spec import SparseSpec
from .work import SparseWork, prepare_for_call, prepare_sparse

_warned_cpu = False


def sparse_forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, spec: SparseSpec,
                        scales: Optional[Fp8Scales] = None):
    """`(out, lse)` of a boolean block mask of `spec.q_block` x `spec.kv_block` tokens: the Triton kernel (CUDA
    tensors or the interpreter), else the torch reference (of the PV skip with `spec.pv_threshold`) with a
    one-time warning. What both the operator and the eager fast path run. Inputs given in float8 come with
    their full-size `scales` (`check_fp8_call`, which the public boundary ran)."""
    global _warned_cpu
    check_sparse_qkv(q, k, v)
    check_mask_batch(mask.shape[0], mask.shape[1], q)
    if not use_triton(q):
        if not _warned_cpu:
            warnings.warn("sparse_attention got CPU tensors: running the torch reference (exact but slow); "
                          "use CUDA tensors for the Triton kernel.", stacklevel=4)
            _warned_cpu = True
        if spec.pv_threshold is not None:
            work = prepare_sparse(mask, spec.q_block, spec.kv_block, q.shape[1], merge=spec.merge, device=q.device,
                                  backward=False)
            return sparse_pv_reference(work, q, k, v, spec.pv_threshold, spec.scale)[:2]
        return _reference(q, k, v, mask, spec.q_block, spec.kv_block, spec, scales)
    check_sparse_kernel(q, float8=scales is not None)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "sparse_attention with a mask prepares its work on the host, which a CUDA graph cannot capture: "
            "build it before the capture with prepare_sparse(mask, ...) and pass that SparseWork as the mask."
        )
    work = prepare_for_call(mask, spec.q_block, spec.kv_block, q.shape[1], spec.merge, q.device)
    out, lse, _ = run_sparse(work, q, k, v, spec, scales)
    return out, lse


def sparse_prepared_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, work: SparseWork, spec: SparseSpec,
                         scales: Optional[Fp8Scales] = None):
    """`(out, lse)` on prepared work: the Triton kernel (CUDA tensors or the interpreter), else the torch
    reference on the work's mask (of the PV skip with `spec.pv_threshold`). No host work: CUDA graphs capture it.
    `scales`: as `sparse_forward_impl`'s."""
    check_sparse_qkv(q, k, v)
    if not use_triton(q):
        if spec.pv_threshold is not None:
            return sparse_pv_reference(work, q, k, v, spec.pv_threshold, spec.scale)[:2]
        return _reference(q, k, v, work.mask, work.q_block, work.kv_block, spec, scales)
    check_sparse_kernel(q, float8=scales is not None)
    out, lse, _ = run_sparse(work, q, k, v, spec, scales)
    return out, lse


def _reference(q, k, v, mask: torch.Tensor, q_block: int, kv_block: int, spec: SparseSpec,
               scales: Optional[Fp8Scales]):
    """The exact reference, or with precision "fp8" the one that applies FP8's quantization rule (to inputs given
    in float8 with `scales`: their dequantized values)."""
    if spec.precision == "fp8":
        return fp8_sparse_reference(q, k, v, mask, q_block, kv_block, spec.scale, return_lse=True, scales=scales,
                                    out_dtype=spec.out_dtype)
    return sparse_reference(q, k, v, mask, q_block, kv_block, spec.scale, return_lse=True)
