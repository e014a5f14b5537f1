"""natsim's GPU entry points as PyTorch operators: the one place that knows torch.library.

`natsim::gna_forward` is a custom operator with a fake (meta) implementation, so `torch.compile(...,
fullgraph=True)` keeps a call in its graph without tracing into Triton, and CUDA graphs capture it like any
other op. Every argument that selects a kernel variant is a plain int, float or bool list: the host-side
decisions are made from them, never from tensor values.

Gradients (issue 13): the Triton kernels have no backward pass yet. A call whose inputs require grad under
grad mode is refused at once on the Triton path, with the ways to get gradients today, instead of returning
an output that silently drops them. The torch reference (CPU tensors without the interpreter) is
differentiable: its backward recomputes the reference under autograd.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .backend import use_triton
from .gna_launch import forward

GRADIENT_REFUSAL = (
    "natsim's Triton GNA kernel has no backward pass yet, and q, k or v requires grad: the output would "
    "silently carry no gradient to them. For inference, call it under torch.no_grad() (or "
    "torch.inference_mode()); for gradients today, run the torch reference on CPU tensors "
    "(natsim.kernels.reference_attention, or gna_attention on CPU tensors without TRITON_INTERPRET=1)."
)


@torch.library.custom_op("natsim::gna_forward", mutates_args=())
def gna_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    causal: Sequence[bool],
    scale: Optional[float],
    q_tile: Optional[Sequence[int]],
    kv_tile: Optional[Sequence[int]],
    return_lse: bool,
    frame_offsets: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA forward on `[B, *shape, heads, head_dim]`: the output, and the LSE `[B, *shape, heads]` (empty
    unless `return_lse`). `frame_offsets=(q0, k0, L0)`: q and k, v hold frame ranges of dimension 0
    (kernels/gna_launch.py)."""
    out, lse = forward(q, k, v, tuple(window), tuple(stride), tuple(dilation), tuple(causal), scale,
                       None if q_tile is None else tuple(q_tile), None if kv_tile is None else tuple(kv_tile),
                       return_lse, None if frame_offsets is None else tuple(frame_offsets))
    # tuples: the schema hands over lists, which the call cache cannot hash
    return out, (_no_lse(q) if lse is None else lse)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=_lse_dtype(q))


@gna_forward.register_fake
def _gna_forward_fake(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse,
                      frame_offsets=None):
    from .checks import check_qkv, problem_of
    from .reference import check_frames

    if frame_offsets is None:  # the same sentence errors as eager
        problem_of(check_qkv(q, k, v), window, stride, dilation, causal)
    else:
        check_frames(q, k, v, window, stride, dilation, causal, list(frame_offsets))
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)) if return_lse else _no_lse(q)
    return torch.empty_like(q), lse


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, *frames = inputs
    if use_triton(q):
        raise RuntimeError(GRADIENT_REFUSAL)
    ctx.save_for_backward(q, k, v)
    ctx.arguments = (window, stride, dilation, causal, scale)
    ctx.frame_offsets = frames[0] if frames else None


def _recomputed_gradients(reference, q, k, v, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """dq, dk, dv of `reference(q, k, v) -> (out, lse)` recomputed under autograd: the CPU path's backward."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = reference(*inputs)
        outputs, grads = [out], [grad_out]
        if grad_lse is not None and grad_lse.numel():
            outputs.append(lse)
            grads.append(grad_lse)
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """Gradients of the torch reference, recomputed under autograd (CPU path only)."""
    from .reference import reference_attention

    window, stride, dilation, causal, scale = ctx.arguments
    dq, dk, dv = _recomputed_gradients(
        lambda q, k, v: reference_attention(q, k, v, window, stride, dilation, causal, scale, return_lse=True,
                                            frame_offsets=ctx.frame_offsets),
        *ctx.saved_tensors, grad_out, grad_lse,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


gna_forward.register_autograd(_backward, setup_context=_setup_context)


# == natsim::sparse_forward: attention under any block mask (kernels/sparse.py) ===================================

SPARSE_GRADIENT_REFUSAL = (
    "natsim's Triton sparse attention kernel has no backward pass yet, and q, k or v requires grad: the output "
    "would silently carry no gradient to them. For inference, call it under torch.no_grad() (or "
    "torch.inference_mode()); for gradients today, run the torch reference on CPU tensors "
    "(natsim.kernels.sparse_reference, or sparse_attention on CPU tensors without TRITON_INTERPRET=1)."
)


@torch.library.custom_op("natsim::sparse_forward", mutates_args=())
def sparse_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    q_block: int,
    kv_block: int,
    merge: Optional[str],
    scale: Optional[float],
    return_lse: bool,
    schedule: str,
    programs: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of `[B, N, heads, head_dim]` under a boolean block mask `[B|1, H|1, nQ, nKV]`: the
    output, and the LSE `[B, N, heads]` (empty unless `return_lse`). The host work (grouping, union lists)
    happens inside, so a compiled graph holds one opaque call."""
    from .sparse import sparse_forward_impl

    out, lse = sparse_forward_impl(q, k, v, mask, q_block, kv_block, merge, scale, return_lse, schedule, programs)
    return out, (_no_lse(q) if not return_lse else lse)


@sparse_forward.register_fake
def _sparse_forward_fake(q, k, v, mask, q_block, kv_block, merge, scale, return_lse, schedule, programs):
    from .sparse import _dense_mask, check_mask_batch, check_sparse_qkv

    check_sparse_qkv(q, k, v)
    _dense_mask(mask, q_block, kv_block, q.shape[1])  # the same sentence errors as eager
    check_mask_batch(mask.shape[0], mask.shape[1], q)
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)) if return_lse else _no_lse(q)
    return torch.empty_like(q), lse


def _sparse_setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, q_block, kv_block, merge, scale, return_lse, schedule, programs = inputs
    if use_triton(q):
        raise RuntimeError(SPARSE_GRADIENT_REFUSAL)
    ctx.save_for_backward(q, k, v, mask)
    ctx.arguments = (q_block, kv_block, scale)


def _sparse_backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """Gradients of the torch reference, recomputed under autograd (CPU path only)."""
    from .sparse import sparse_reference

    q, k, v, mask = ctx.saved_tensors
    q_block, kv_block, scale = ctx.arguments
    dq, dk, dv = _recomputed_gradients(
        lambda q, k, v: sparse_reference(q, k, v, mask, q_block, kv_block, scale, return_lse=True),
        q, k, v, grad_out, grad_lse,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


sparse_forward.register_autograd(_sparse_backward, setup_context=_sparse_setup_context)
