"""Block-mask attention's PyTorch operators: the one place of the family that knows torch.library.

`natsim::sparse_forward` (under a boolean block mask) and `natsim::sparse_prepared` (on a prepared mask, a
`SparseWork`, which crosses the schema as its tensors and sizes: kernels/sparse/work.py) are custom operators with
fake implementations, so that torch.compile keeps a call in its graph as one opaque call and CUDA graphs capture
the prepared one. Their arguments are the schema form of a `SparseSpec` (kernels/sparse/spec.py, which converts
both ways).

Gradients: each forward saves q, k, v, the output and the LSE, and its backward runs the Triton backward kernels
(kernels/sparse/backward.py, on the unmerged block mask) through an operator of its own
(`natsim::sparse_backward`, `natsim::sparse_prepared_backward`, with fake implementations), so that torch.compile
keeps it in its graph; a forward called without the LSE is run again for it in the backward. The torch reference
(CPU tensors without the interpreter) is differentiable too: its backward recomputes the reference under
autograd. The PV skip and FP8 have no backward: refused with a sentence.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common.backend import use_triton
from ..common.fp8 import check_fp8_call, refuse_gradients, scales_from
from ..common.operators import fake_lse, incoming_gradients, like, no_lse, recomputed_gradients, refuse_second_order
from .backward import sparse_backward as run_sparse_backward
from .checks import check_mask_batch, check_sparse_qkv
from .dispatch import sparse_forward_impl, sparse_prepared_impl
from .reference import sparse_reference
from .spec import SparseSpec
from .work import dense_mask, work_from

PV_SKIP_GRADIENT_REFUSAL = (
    "pv_threshold skips products by a data-dependent rule that has no backward pass, and q, k or v requires "
    "grad: call it under torch.no_grad() (or torch.inference_mode()), or pass pv_threshold=None for gradients "
    "(the backward kernels differentiate exact attention under the block mask)."
)


# == natsim::sparse_forward: attention under a boolean block mask ===============================================


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
    pv_threshold: Optional[float] = None,
    precision: Optional[str] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of `[B, N, heads, head_dim]` under a boolean block mask `[B|1, H|1, nQ, nKV]`: the
    output, and the LSE `[B, N, heads]` (empty unless `return_lse`); `pv_threshold` turns on SpargeAttn's
    PV skip; `precision="fp8"` quantizes (no gradient), and q, k, v in float8 e4m3 come with `q_scale`,
    `k_scale`, `v_scale` and `out_dtype` (kernels/common/fp8.py, `Fp8Scales`). The host work (grouping, union
    lists) happens inside, so a compiled graph holds one opaque call."""
    precision, scales, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale),
                                                  out_dtype)
    spec = SparseSpec.from_operator(q_block, kv_block, merge, scale, return_lse, schedule, programs, pv_threshold,
                                    precision, out_dtype)
    out, lse = sparse_forward_impl(q, k, v, mask, spec, scales)
    return out, (no_lse(q) if not return_lse else lse)


@sparse_forward.register_fake
def _sparse_forward_fake(q, k, v, mask, q_block, kv_block, merge, scale, return_lse, schedule, programs,
                         pv_threshold=None, precision=None, q_scale=None, k_scale=None, v_scale=None,
                         out_dtype=None):
    check_sparse_qkv(q, k, v)
    precision, _, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale), out_dtype)
    SparseSpec.from_operator(q_block, kv_block, merge, scale, return_lse, schedule, programs, pv_threshold,
                             precision, out_dtype)
    dense_mask(mask, q_block, kv_block, q.shape[1])  # the same sentence errors as eager
    check_mask_batch(mask.shape[0], mask.shape[1], q)
    return like(q, out_dtype), fake_lse(q, return_lse)


def _sparse_setup_context(ctx, inputs, output) -> None:
    # q, k, v and the mask, then the schema's spec arguments up to precision, then FP8's scales and output dtype;
    # trailing arguments at their defaults may be left out of `inputs`.
    q, k, v, mask, *arguments = inputs
    spec = SparseSpec.from_operator(*arguments[:9])
    scale_tensors = arguments[9:12]
    if spec.pv_threshold is not None:
        raise RuntimeError(PV_SKIP_GRADIENT_REFUSAL)
    if spec.precision is not None or any(t is not None for t in scale_tensors):
        refuse_gradients("sparse_attention", q, k, v, *scale_tensors)
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, out, lse)
    ctx.spec = spec
    ctx.num_inputs = len(inputs)
    ctx.set_materialize_grads(False)


@torch.library.custom_op("natsim::sparse_backward", mutates_args=())
def sparse_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    q_block: int,
    kv_block: int,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::sparse_forward` on the Triton path (kernels/sparse/backward.py, on the unmerged
    block mask: merging never changes an output row). An empty `lse` (a forward called without `return_lse`)
    runs the forward again for it."""
    if not lse.numel():
        spec = SparseSpec(q_block, kv_block, scale=scale, return_lse=True)
        out, lse = sparse_forward_impl(q, k, v, mask, spec)
    return run_sparse_backward(q, k, v, out, lse, grad_out, grad_lse, mask, q_block, kv_block, scale)


@sparse_backward.register_fake
def _sparse_backward_fake(q, k, v, mask, out, lse, grad_out, grad_lse, q_block, kv_block, scale):
    return like(q), like(k), like(v)


def _sparse_backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """The gradients of q, k and v (none for the other arguments): through `natsim::sparse_backward` on the
    Triton path, the torch reference's recomputed under autograd on the CPU path."""
    refuse_second_order()
    q, k, v, mask, out, lse = ctx.saved_tensors
    spec = ctx.spec
    grad_out, grad_lse = incoming_gradients(out, grad_out, grad_lse)
    if use_triton(q):
        dq, dk, dv = sparse_backward(q, k, v, mask, out, lse, grad_out, grad_lse, spec.q_block, spec.kv_block,
                                     spec.scale)
    else:
        dq, dk, dv = recomputed_gradients(
            lambda q, k, v: sparse_reference(q, k, v, mask, spec.q_block, spec.kv_block, spec.scale,
                                             return_lse=True),
            q, k, v, grad_out, grad_lse,
        )
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


sparse_forward.register_autograd(_sparse_backward, setup_context=_sparse_setup_context)


# == natsim::sparse_prepared: attention on a prepared block mask (a SparseWork) ================================


@torch.library.custom_op("natsim::sparse_prepared", mutates_args=())
def sparse_prepared(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    work_tensors: list[torch.Tensor],
    work_sizes: list[int],
    scale: Optional[float],
    return_lse: bool,
    schedule: str,
    programs: Optional[int],
    pv_threshold: Optional[float],
    precision: Optional[str] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of `[B, N, heads, head_dim]` on a prepared mask, given as `work_tensors(work)` and
    `work_sizes(work)`: the output, and the LSE `[B, N, heads]` (empty unless `return_lse`). No host work, so a
    CUDA graph captures it and repeated calls pay no preparation. `precision="fp8"` quantizes (no gradient), and
    q, k, v in float8 e4m3 come with `q_scale`, `k_scale`, `v_scale` and `out_dtype` (kernels/common/fp8.py)."""
    precision, scales, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale),
                                                  out_dtype)
    spec = SparseSpec.from_operator(None, None, None, scale, return_lse, schedule, programs, pv_threshold,
                                    precision, out_dtype)
    out, lse = sparse_prepared_impl(q, k, v, work_from(work_tensors, work_sizes), spec, scales)
    return out, (no_lse(q) if not return_lse else lse)


@sparse_prepared.register_fake
def _sparse_prepared_fake(q, k, v, work_tensors, work_sizes, scale, return_lse, schedule, programs,
                          pv_threshold, precision=None, q_scale=None, k_scale=None, v_scale=None, out_dtype=None):
    check_sparse_qkv(q, k, v)
    precision, _, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale), out_dtype)
    SparseSpec.from_operator(None, None, None, scale, return_lse, schedule, programs, pv_threshold, precision,
                             out_dtype)
    return like(q, out_dtype), fake_lse(q, return_lse)


def _sparse_prepared_setup_context(ctx, inputs, output) -> None:
    # q, k, v, the work's tensors and sizes, then the schema's spec arguments up to precision, then FP8's scales
    # and output dtype; trailing arguments at their defaults may be left out of `inputs`.
    q, k, v, tensors, sizes, *arguments = inputs
    spec = SparseSpec.from_operator(None, None, None, *arguments[:6])
    scale_tensors = arguments[6:9]
    if spec.pv_threshold is not None:
        raise RuntimeError(PV_SKIP_GRADIENT_REFUSAL)
    if spec.precision is not None or any(t is not None for t in scale_tensors):
        refuse_gradients("sparse_attention", q, k, v, *scale_tensors)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *tensors)
    ctx.arguments = (list(sizes), spec.scale)
    ctx.set_materialize_grads(False)


@torch.library.custom_op("natsim::sparse_prepared_backward", mutates_args=())
def sparse_prepared_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    work_tensors: list[torch.Tensor],
    work_sizes: list[int],
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::sparse_prepared` on the Triton path, with the backward lists the work carries. An
    empty `lse` (a forward called without `return_lse`) runs the forward again for it."""
    work = work_from(work_tensors, work_sizes)
    if not lse.numel():
        out, lse = sparse_prepared_impl(q, k, v, work, SparseSpec(scale=scale, return_lse=True))
    return run_sparse_backward(q, k, v, out, lse, grad_out, grad_lse, work.mask, work.q_block, work.kv_block, scale,
                               tiles=work.tiles, lists=(work.dkdv_lists, work.dq_lists))


@sparse_prepared_backward.register_fake
def _sparse_prepared_backward_fake(q, k, v, out, lse, grad_out, grad_lse, work_tensors, work_sizes, scale):
    return like(q), like(k), like(v)


def _sparse_prepared_gradients(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """The gradients of q, k and v: through `natsim::sparse_prepared_backward` on the Triton path, the torch
    reference's recomputed under autograd on the CPU path."""
    refuse_second_order()
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    sizes, scale = ctx.arguments
    grad_out, grad_lse = incoming_gradients(out, grad_out, grad_lse)
    if use_triton(q):
        dq, dk, dv = sparse_prepared_backward(q, k, v, out, lse, grad_out, grad_lse, tensors, sizes, scale)
    else:
        work = work_from(tensors, sizes)
        dq, dk, dv = recomputed_gradients(
            lambda q, k, v: sparse_reference(q, k, v, work.mask, work.q_block, work.kv_block, scale,
                                             return_lse=True),
            q, k, v, grad_out, grad_lse,
        )
    # One entry per argument the call passed (trailing arguments at their defaults are not), the work's tensor
    # list as a list: an operator with a tensor list checks the structure.
    return (dq, dk, dv, [None] * len(tensors)) + (None,) * (len(ctx.needs_input_grad) - 4)


sparse_prepared.register_autograd(_sparse_prepared_gradients, setup_context=_sparse_prepared_setup_context)
