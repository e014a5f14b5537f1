"""natsim's GPU entry points as PyTorch operators: the one place that knows torch.library.

`natsim::gna_forward` is a custom operator with a fake (meta) implementation, so `torch.compile(...,
fullgraph=True)` keeps a call in its graph without tracing into Triton, and CUDA graphs capture it like any
other op. Every argument that selects a kernel variant is a plain int, float or bool list: the host-side
decisions are made from them, never from tensor values.

Gradients: `natsim::gna_forward` saves q, k, v, the output and the LSE, and its backward runs the
Triton backward kernels (kernels/gna/backward.py) on the Triton path; callers that need gradients ask the
forward for the LSE (gna_attention does). `natsim::sparse_forward` does the same with
kernels/sparse/backward.py, and `natsim::sparse_prepared` on a prepared mask (a `SparseWork`, which crosses the
schema as its tensors and sizes: kernels/sparse/work.py). Each backward is an operator of its own
(`natsim::gna_backward`, `natsim::sparse_backward`, `natsim::sparse_prepared_backward`, with fake
implementations), so that torch.compile keeps it in its graph; a forward
called without the LSE is run again for it in the backward. The torch reference (CPU tensors without the
interpreter) is differentiable on both: its backward recomputes the reference under autograd.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from .common.backend import use_triton
from .common.fp8 import check_fp8_call, refuse_gradients, scales_from
from .gna.backward import gna_backward as run_gna_backward
from .gna.checks import check_frames, check_kv_tiling, check_qkv, problem_of
from .gna.dispatch import forward
from .gna.reference import reference_attention
from .sparse.backward import sparse_backward as run_sparse_backward
from .sparse.checks import check_mask_batch, check_pv_threshold, check_sparse_qkv
from .sparse.dispatch import sparse_forward_impl, sparse_prepared_impl
from .sparse.reference import sparse_reference
from .sparse.work import dense_mask, work_from


FRAMES_GRADIENT_REFUSAL = (
    "gna_attention with frame_offsets (natsim.distributed's halo exchange) has no backward kernel yet, and q, k "
    "or v requires grad: call it under torch.no_grad() for inference, or compute gradients on one device "
    "without frame_offsets (or with the torch reference on CPU tensors)."
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
    kv_tiling: Optional[str] = None,
    frame_offsets: Optional[Sequence[int]] = None,
    precision: Optional[str] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA forward on `[B, *shape, heads, head_dim]`: the output, and the LSE `[B, *shape, heads]` (empty
    unless `return_lse`). `kv_tiling`: "static", "dynamic" or None (natsim chooses). `frame_offsets=(q0, k0,
    L0)`: q and k, v hold frame ranges of dimension 0 (kernels/gna/launch.py). `precision`: None or "fp8"
    (inference only: no gradient). q, k, v in float8 e4m3 come with `q_scale`, `k_scale`, `v_scale` and
    `out_dtype` (kernels/common/fp8.py, `Fp8Scales`)."""
    precision, scales, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale),
                                                  out_dtype)
    out, lse = forward(q, k, v, tuple(window), tuple(stride), tuple(dilation), tuple(causal), scale,
                       None if q_tile is None else tuple(q_tile), None if kv_tile is None else tuple(kv_tile),
                       return_lse, kv_tiling, None if frame_offsets is None else tuple(frame_offsets), precision,
                       scales, out_dtype)
    # tuples: the schema hands over lists, which the call cache cannot hash
    return out, (_no_lse(q) if lse is None else lse)


def _like(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A fake output shaped as `x` with contiguous strides, as the kernels and references allocate theirs
    (`empty_like` would copy the strides of a transposed input, and compiled graphs check them); in x's dtype
    unless `dtype` is given."""
    return x.new_empty(x.shape, dtype=dtype)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=_lse_dtype(q))


@gna_forward.register_fake
def _gna_forward_fake(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse,
                      kv_tiling=None, frame_offsets=None, precision=None, q_scale=None, k_scale=None, v_scale=None,
                      out_dtype=None):
    if frame_offsets is None:  # the same sentence errors as eager
        problem_of(check_qkv(q, k, v), window, stride, dilation, causal)
    else:
        check_frames(q, k, v, window, stride, dilation, causal, list(frame_offsets))
    check_kv_tiling(kv_tiling)
    _, _, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale), out_dtype)
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)) if return_lse else _no_lse(q)
    return _like(q, out_dtype), lse


def _setup_context(ctx, inputs, output) -> None:
    # By position: q, k, v, window, stride, dilation, causal, scale lead the schema; later arguments (tiles,
    # return_lse, kv_tiling) select kernel variants and take no gradient; then frame_offsets, and FP8's
    # precision, scales and output dtype.
    q, k, v, window, stride, dilation, causal, scale = inputs[:8]
    frame_offsets = inputs[12] if len(inputs) > 12 else None
    if frame_offsets is not None and use_triton(q):
        raise RuntimeError(FRAMES_GRADIENT_REFUSAL)
    if any(x is not None for x in inputs[13:17]):  # precision, q_scale, k_scale, v_scale
        refuse_gradients("gna_attention", q, k, v, *inputs[14:17])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.arguments = (window, stride, dilation, causal, scale)
    ctx.frame_offsets = frame_offsets
    ctx.num_inputs = len(inputs)
    ctx.set_materialize_grads(False)  # an unused LSE (the usual case) brings None, not a tensor of zeros


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


@torch.library.custom_op("natsim::gna_backward", mutates_args=())
def gna_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    window: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    causal: Sequence[bool],
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::gna_forward` on the Triton path: the backward kernels (kernels/gna/backward.py)
    from the forward's output and LSE; an empty `lse` (a forward called without `return_lse`) runs the
    forward again for it. An operator of its own, so that AOTAutograd (torch.compile) keeps the backward in
    its graph as one opaque call."""
    problem = problem_of(tuple(q.shape[1:-2]), tuple(window), tuple(stride), tuple(dilation), tuple(causal))
    if not lse.numel():
        out, lse = forward(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal, scale,
                           None, None, True)
    return run_gna_backward(q, k, v, out, lse, grad_out, grad_lse, problem, scale)


@gna_backward.register_fake
def _gna_backward_fake(q, k, v, out, lse, grad_out, grad_lse, window, stride, dilation, causal, scale):
    return _like(q), _like(k), _like(v)


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """The gradients of q, k and v (none for the other arguments): through `natsim::gna_backward` on the
    Triton path, the torch reference's recomputed under autograd on the CPU path."""
    q, k, v, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = grad_lse if grad_lse is not None and grad_lse.numel() else None
    if use_triton(q):
        dq, dk, dv = gna_backward(q, k, v, out, lse, grad_out, grad_lse, *ctx.arguments)
    else:
        window, stride, dilation, causal, scale = ctx.arguments
        dq, dk, dv = _recomputed_gradients(
            lambda q, k, v: reference_attention(q, k, v, window, stride, dilation, causal, scale, return_lse=True,
                                                frame_offsets=ctx.frame_offsets),
            q, k, v, grad_out, grad_lse,
        )
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


gna_forward.register_autograd(_backward, setup_context=_setup_context)


# == natsim::gna_resolved: GNA whose arguments a registered resolver picks per layout ============================

GnaResolver = Callable[[tuple[int, ...], int, int, torch.dtype, torch.device], Mapping[str, object]]
_resolvers: dict[int, GnaResolver] = {}


def register_resolver(resolver: GnaResolver) -> int:
    """Register `resolver(shape, heads, head_dim, dtype, device)`, which returns `gna_attention`'s keyword
    arguments (window, stride, dilation, causal, q_tile, kv_tile, kv_tiling, and optionally precision) for a
    layout, and return the id
    that `natsim::gna_resolved` takes. Rooms above the kernels (the planner) decide through it at run time,
    so that a compiled graph holds one opaque call whatever the layout, and the kernels never import them."""
    key = len(_resolvers)
    _resolvers[key] = resolver
    return key


def _resolved(resolver: int, q: torch.Tensor) -> Mapping[str, object]:
    if resolver not in _resolvers:
        raise ValueError(f"resolver must be an id from register_resolver, got resolver={resolver!r}.")
    return _resolvers[resolver](tuple(int(n) for n in q.shape[1:-2]), int(q.shape[-2]), int(q.shape[-1]), q.dtype,
                                q.device)


@torch.library.custom_op("natsim::gna_resolved", mutates_args=())
def gna_resolved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, resolver: int, scale: Optional[float], return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA forward on `[B, *shape, heads, head_dim]` with the arguments the registered `resolver` picks for this
    layout: the output, and the LSE (empty unless `return_lse`)."""
    a = _resolved(resolver, q)
    out, lse = forward(q, k, v, a["window"], a["stride"], a["dilation"], a["causal"], scale, a["q_tile"],
                       a["kv_tile"], return_lse, a["kv_tiling"], None, a.get("precision"))
    return out, (_no_lse(q) if lse is None else lse)


@gna_resolved.register_fake
def _gna_resolved_fake(q, k, v, resolver, scale, return_lse):
    check_qkv(q, k, v)
    if resolver not in _resolvers:
        raise ValueError(f"resolver must be an id from register_resolver, got resolver={resolver!r}.")
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)) if return_lse else _no_lse(q)
    return _like(q), lse


@torch.library.custom_op("natsim::gna_resolved_backward", mutates_args=())
def gna_resolved_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    resolver: int,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::gna_resolved`: the arguments resolved again (the resolver caches them) and the
    backward of `natsim::gna_forward` with them, the Triton kernels or the reference's recomputed gradients."""
    a = _resolved(resolver, q)
    arguments = (a["window"], a["stride"], a["dilation"], a["causal"], scale)
    if use_triton(q):
        return tuple(gna_backward(q, k, v, out, lse, grad_out, grad_lse, *arguments))
    window, stride, dilation, causal, scale = arguments
    return tuple(_recomputed_gradients(
        lambda q, k, v: reference_attention(q, k, v, window, stride, dilation, causal, scale, return_lse=True),
        q, k, v, grad_out, grad_lse,
    ))


@gna_resolved_backward.register_fake
def _gna_resolved_backward_fake(q, k, v, out, lse, grad_out, grad_lse, resolver, scale):
    return _like(q), _like(k), _like(v)


def _resolved_setup_context(ctx, inputs, output) -> None:
    q, k, v, resolver, scale, _ = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.arguments = (resolver, scale)
    ctx.set_materialize_grads(False)


def _resolved_backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    q, k, v, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = grad_lse if grad_lse is not None and grad_lse.numel() else None
    dq, dk, dv = gna_resolved_backward(q, k, v, out, lse, grad_out, grad_lse, *ctx.arguments)
    return dq, dk, dv, None, None, None


gna_resolved.register_autograd(_resolved_backward, setup_context=_resolved_setup_context)


# == natsim::attention_resolved: attention a registered callable computes at run time =============================

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float], bool],
                     tuple[torch.Tensor, Optional[torch.Tensor]]]
_attentions: dict[int, Attention] = {}


def register_attention(attention: Attention) -> int:
    """Register `attention(q, k, v, scale, return_lse) -> (out, lse or None)` on `[B, N, heads, head_dim]`
    tensors and return the id that `natsim::attention_resolved` takes. For attention whose work depends on
    state decided at run time, per call (a content-adaptive mask predicted, cached and planned per layer and
    diffusion step): the operator keeps it out of compiled graphs, so that its decisions never become guards."""
    key = len(_attentions)
    _attentions[key] = attention
    return key


@torch.library.custom_op("natsim::attention_resolved", mutates_args=())
def attention_resolved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: int, scale: Optional[float], return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered `attention` on `[B, N, heads, head_dim]`: the output and the LSE `[B, N, heads]` (empty
    unless `return_lse`). Inference only: it has no backward."""
    if attention not in _attentions:
        raise ValueError(f"attention must be an id from register_attention, got attention={attention!r}.")
    out, lse = _attentions[attention](q, k, v, scale, return_lse)
    return out, (_no_lse(q) if lse is None else lse)


@attention_resolved.register_fake
def _attention_resolved_fake(q, k, v, attention, scale, return_lse):
    if attention not in _attentions:
        raise ValueError(f"attention must be an id from register_attention, got attention={attention!r}.")
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)) if return_lse else _no_lse(q)
    return _like(q), lse


# == natsim::sparse_forward: attention under any block mask (kernels/sparse/) ================================

PV_SKIP_GRADIENT_REFUSAL = (
    "pv_threshold skips products by a data-dependent rule that has no backward pass, and q, k or v requires "
    "grad: call it under torch.no_grad() (or torch.inference_mode()), or pass pv_threshold=None for gradients "
    "(the backward kernels differentiate exact attention under the block mask)."
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
    out, lse = sparse_forward_impl(q, k, v, mask, q_block, kv_block, merge, scale, return_lse, schedule, programs,
                                   pv_threshold, precision, scales, out_dtype)
    return out, (_no_lse(q) if not return_lse else lse)


@sparse_forward.register_fake
def _sparse_forward_fake(q, k, v, mask, q_block, kv_block, merge, scale, return_lse, schedule, programs,
                         pv_threshold=None, precision=None, q_scale=None, k_scale=None, v_scale=None,
                         out_dtype=None):
    check_sparse_qkv(q, k, v)
    check_pv_threshold(pv_threshold)
    _, _, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale), out_dtype)
    dense_mask(mask, q_block, kv_block, q.shape[1])  # the same sentence errors as eager
    check_mask_batch(mask.shape[0], mask.shape[1], q)
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)) if return_lse else _no_lse(q)
    return _like(q, out_dtype), lse


def _sparse_setup_context(ctx, inputs, output) -> None:
    # By position: q, k, v, mask, q_block, kv_block, merge, scale lead the schema; later arguments select
    # kernel variants and take no gradient; FP8's precision, scales and output dtype come last.
    q, k, v, mask, q_block, kv_block, merge, scale = inputs[:8]
    if inputs[11] is not None:  # pv_threshold
        raise RuntimeError(PV_SKIP_GRADIENT_REFUSAL)
    if any(x is not None for x in inputs[12:16]):  # precision, q_scale, k_scale, v_scale
        refuse_gradients("sparse_attention", q, k, v, *inputs[13:16])
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, out, lse)
    ctx.arguments = (q_block, kv_block, scale)
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
        out, lse = sparse_forward_impl(q, k, v, mask, q_block, kv_block, None, scale, True, "grid", None)
    return run_sparse_backward(q, k, v, out, lse, grad_out, grad_lse, mask, q_block, kv_block, scale)


@sparse_backward.register_fake
def _sparse_backward_fake(q, k, v, mask, out, lse, grad_out, grad_lse, q_block, kv_block, scale):
    return _like(q), _like(k), _like(v)


def _sparse_backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """The gradients of q, k and v (none for the other arguments): through `natsim::sparse_backward` on the
    Triton path, the torch reference's recomputed under autograd on the CPU path."""
    q, k, v, mask, out, lse = ctx.saved_tensors
    q_block, kv_block, scale = ctx.arguments
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = grad_lse if grad_lse is not None and grad_lse.numel() else None
    if use_triton(q):
        dq, dk, dv = sparse_backward(q, k, v, mask, out, lse, grad_out, grad_lse, q_block, kv_block, scale)
    else:
        dq, dk, dv = _recomputed_gradients(
            lambda q, k, v: sparse_reference(q, k, v, mask, q_block, kv_block, scale, return_lse=True),
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
    work = work_from(work_tensors, work_sizes)
    out, lse = sparse_prepared_impl(q, k, v, work, scale, return_lse, schedule, programs, pv_threshold, precision,
                                    scales, out_dtype)
    return out, (_no_lse(q) if not return_lse else lse)


@sparse_prepared.register_fake
def _sparse_prepared_fake(q, k, v, work_tensors, work_sizes, scale, return_lse, schedule, programs,
                          pv_threshold, precision=None, q_scale=None, k_scale=None, v_scale=None, out_dtype=None):
    check_sparse_qkv(q, k, v)
    check_pv_threshold(pv_threshold)
    _, _, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale), out_dtype)
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)) if return_lse else _no_lse(q)
    return _like(q, out_dtype), lse


def _sparse_prepared_setup_context(ctx, inputs, output) -> None:
    q, k, v, tensors, sizes, scale, return_lse, schedule, programs, pv_threshold = inputs[:10]
    if pv_threshold is not None:
        raise RuntimeError(PV_SKIP_GRADIENT_REFUSAL)
    if any(x is not None for x in inputs[10:14]):  # precision, q_scale, k_scale, v_scale
        refuse_gradients("sparse_attention", q, k, v, *inputs[11:14])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *tensors)
    ctx.arguments = (list(sizes), scale)
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
        out, lse = sparse_prepared_impl(q, k, v, work, scale, True, "grid", None)
    return run_sparse_backward(q, k, v, out, lse, grad_out, grad_lse, work.mask, work.q_block, work.kv_block, scale,
                               tiles=work.tiles, lists=(work.dkdv_lists, work.dq_lists))


@sparse_prepared_backward.register_fake
def _sparse_prepared_backward_fake(q, k, v, out, lse, grad_out, grad_lse, work_tensors, work_sizes, scale):
    return _like(q), _like(k), _like(v)


def _sparse_prepared_gradients(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """The gradients of q, k and v: through `natsim::sparse_prepared_backward` on the Triton path, the torch
    reference's recomputed under autograd on the CPU path."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    sizes, scale = ctx.arguments
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = grad_lse if grad_lse is not None and grad_lse.numel() else None
    if use_triton(q):
        dq, dk, dv = sparse_prepared_backward(q, k, v, out, lse, grad_out, grad_lse, tensors, sizes, scale)
    else:
        work = work_from(tensors, sizes)
        dq, dk, dv = _recomputed_gradients(
            lambda q, k, v: sparse_reference(q, k, v, work.mask, work.q_block, work.kv_block, scale,
                                             return_lse=True),
            q, k, v, grad_out, grad_lse,
        )
    # One entry per argument the call passed (trailing arguments at their defaults are not), the work's tensor
    # list as a list: an operator with a tensor list checks the structure.
    return (dq, dk, dv, [None] * len(tensors)) + (None,) * (len(ctx.needs_input_grad) - 4)


sparse_prepared.register_autograd(_sparse_prepared_gradients, setup_context=_sparse_prepared_setup_context)
