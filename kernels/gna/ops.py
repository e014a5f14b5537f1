"""GNA's PyTorch operators: the one place of the family that knows torch.library.

`natsim::gna_forward` is a custom operator with a fake (meta) implementation, so `torch.compile(...,
fullgraph=True)` keeps a call in its graph without tracing into Triton, and CUDA graphs capture it like any
other op. Every argument that selects a kernel variant is a plain int, float or bool list, the schema form of a
`GnaSpec` (kernels/gna/spec.py, which converts both ways): the host-side decisions are made from them, never
from tensor values.

Gradients: `natsim::gna_forward` saves q, k, v, the output and the LSE, and its backward runs the Triton backward
kernels (kernels/gna/backward.py) through `natsim::gna_backward`, an operator of its own with a fake
implementation, so that torch.compile keeps it in its graph; callers that need gradients ask the forward for the
LSE (gna_attention does), and a forward called without it is run again for it in the backward. The torch
reference (CPU tensors without the interpreter) is differentiable too: its backward recomputes the reference
under autograd.

`natsim::gna_resolved` runs GNA with arguments that a registered resolver picks per token layout at run time
(`register_resolver`): rooms above the kernels (the planner) decide through it, so that a compiled graph holds
one opaque call whatever the layout, and the kernels never import them. It and `natsim::gna_resolved_ordered`
have twins without autograd (`..._inference`, `resolved_operators` picks), whose calls cost the host less.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from ..common.backend import use_triton
from ..common.fp8 import check_fp8_call, refuse_gradients, scales_from
from ..common.operators import (fake_lse, incoming_gradients, like, no_lse, operator_without_autograd,
                                recomputed_gradients, refuse_second_order)
from .checks import check_frames, check_qkv
from .dispatch import run_backward, run_spec
from .ordered import TileOrder, fa4_backward_ordered, layout_views, ordered_like, run_ordered
from .reference import reference_attention
from .spec import GnaSpec

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
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA forward on `[B, *shape, heads, head_dim]`: the output, and the LSE `[B, *shape, heads]` (empty
    unless `return_lse`). `kv_tiling`: "static", "dynamic" or None (natsim chooses). `frame_offsets=(q0, k0,
    L0)`: q and k, v hold frame ranges of dimension 0 (kernels/gna/launch.py). `precision`: None or "fp8"
    (inference only: no gradient). q, k, v in float8 e4m3 come with `q_scale`, `k_scale`, `v_scale` and
    `out_dtype` (kernels/common/fp8.py, `Fp8Scales`). `backend`: "triton", "fa4" or None (natsim chooses,
    kernels/gna/choice.py)."""
    precision, scales, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale),
                                                  out_dtype)
    spec = GnaSpec.from_operator(window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling,
                                 frame_offsets, precision, out_dtype, backend)
    out, lse = run_spec(q, k, v, spec, scales)
    return out, (no_lse(q) if lse is None else lse)


@gna_forward.register_fake
def _gna_forward_fake(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse,
                      kv_tiling=None, frame_offsets=None, precision=None, q_scale=None, k_scale=None, v_scale=None,
                      out_dtype=None, backend=None):
    precision, _, out_dtype = check_fp8_call(q, k, v, precision, scales_from(q_scale, k_scale, v_scale), out_dtype)
    spec = GnaSpec.from_operator(window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling,
                                 frame_offsets, precision, out_dtype, backend)
    if spec.frames is None:  # the same sentence errors as eager
        spec.problem(check_qkv(q, k, v))
    else:
        check_frames(q, k, v, spec.frames, *spec.parameters)
    return like(q, out_dtype), fake_lse(q, return_lse)


def _setup_context(ctx, inputs, output) -> None:
    # q, k, v, then the schema's spec arguments up to precision, then FP8's scales, the output dtype and the
    # backend; trailing arguments at their defaults may be left out of `inputs`.
    q, k, v, *arguments = inputs
    spec = GnaSpec.from_operator(*arguments[:11], backend=arguments[15] if len(arguments) > 15 else None)
    scale_tensors = arguments[11:14]
    if spec.frames is not None and use_triton(q):
        raise RuntimeError(FRAMES_GRADIENT_REFUSAL)
    if spec.precision is not None or any(t is not None for t in scale_tensors):
        refuse_gradients("gna_attention", q, k, v, *scale_tensors)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.spec = spec
    ctx.num_inputs = len(inputs)
    ctx.set_materialize_grads(False)  # an unused LSE (the usual case) brings None, not a tensor of zeros


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
    q_tile: Optional[Sequence[int]] = None,
    kv_tile: Optional[Sequence[int]] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::gna_forward` on the GPU (or in the interpreter) from the forward's output and LSE,
    on the backend the forward ran (kernels/gna/dispatch.py `run_backward`: FlashAttention-4 where its backward
    runs the tiles, natsim's Triton backward kernels otherwise); an empty `lse` (a forward called without
    `return_lse`) runs the forward again for it. An operator of its own, so that AOTAutograd (torch.compile)
    keeps the backward in its graph as one opaque call."""
    spec = GnaSpec.from_operator(window, stride, dilation, causal, scale, q_tile, kv_tile, False, backend=backend)
    return run_backward(q, k, v, out, lse, grad_out, grad_lse, spec)


@gna_backward.register_fake
def _gna_backward_fake(q, k, v, out, lse, grad_out, grad_lse, window, stride, dilation, causal, scale, q_tile=None,
                       kv_tile=None, backend=None):
    return like(q), like(k), like(v)


def _gradients(spec: GnaSpec, q, k, v, out, lse, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor]):
    """dq, dk, dv of a GNA forward of `spec`: through `natsim::gna_backward` on the Triton path, the torch
    reference's recomputed under autograd on the CPU path."""
    if use_triton(q):
        return gna_backward(q, k, v, out, lse, grad_out, grad_lse, *spec.parameters, spec.scale,
                            *(None if t is None else list(t) for t in (spec.q_tile, spec.kv_tile)), spec.backend)
    return recomputed_gradients(
        lambda q, k, v: reference_attention(q, k, v, *spec.parameters, spec.scale, return_lse=True,
                                            frame_offsets=spec.frames),
        q, k, v, grad_out, grad_lse,
    )


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """The gradients of q, k and v (none for the other arguments)."""
    refuse_second_order()
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _gradients(ctx.spec, q, k, v, out, lse, *incoming_gradients(out, grad_out, grad_lse))
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


gna_forward.register_autograd(_backward, setup_context=_setup_context)


# == natsim::gna_resolved: GNA whose arguments a registered resolver picks per layout ============================

GnaResolver = Callable[[tuple[int, ...], int, int, torch.dtype, torch.device], Mapping[str, object]]
_resolvers: dict[int, GnaResolver] = {}


def register_resolver(resolver: GnaResolver) -> int:
    """Register `resolver(shape, heads, head_dim, dtype, device)`, which returns `gna_attention`'s keyword
    arguments (window, stride, dilation, causal, q_tile, kv_tile, kv_tiling, and optionally precision and
    backend) for a layout, and return the id that `natsim::gna_resolved` takes. Rooms above the kernels (the planner) decide
    through it at run time, so that a compiled graph holds one opaque call whatever the layout, and the kernels
    never import them."""
    key = len(_resolvers)
    _resolvers[key] = resolver
    return key


def _check_registered(resolver: int) -> None:
    if type(resolver) is not int:  # made symbolic by a dynamic-shape trace (a second plan's id): checked at run time
        return
    if resolver not in _resolvers:
        raise ValueError(f"resolver must be an id from register_resolver, got resolver={resolver!r}.")


def _resolved(resolver: int, q: torch.Tensor, scale: Optional[float], return_lse: bool) -> GnaSpec:
    """The spec that the registered `resolver` picks for q's layout."""
    _check_registered(resolver)
    a = _resolvers[resolver](tuple(int(n) for n in q.shape[1:-2]), int(q.shape[-2]), int(q.shape[-1]), q.dtype,
                             q.device)
    return GnaSpec.of(q.dim() - 3, a["window"], a["stride"], a["dilation"], a["causal"], scale=scale,
                      q_tile=a["q_tile"], kv_tile=a["kv_tile"], kv_tiling=a["kv_tiling"],
                      precision=a.get("precision"), return_lse=return_lse, backend=a.get("backend"))


def _run_resolved(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, resolver: int, scale: Optional[float],
                  return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = run_spec(q, k, v, _resolved(resolver, q, scale, return_lse))
    return out, (no_lse(q) if lse is None else lse)


@torch.library.custom_op("natsim::gna_resolved", mutates_args=())
def gna_resolved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, resolver: int, scale: Optional[float], return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA forward on `[B, *shape, heads, head_dim]` with the arguments the registered `resolver` picks for this
    layout: the output, and the LSE (empty unless `return_lse`)."""
    return _run_resolved(q, k, v, resolver, scale, return_lse)


@gna_resolved.register_fake
def _gna_resolved_fake(q, k, v, resolver, scale, return_lse):
    check_qkv(q, k, v)
    _check_registered(resolver)
    return like(q), fake_lse(q, return_lse)


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
    return tuple(_gradients(_resolved(resolver, q, scale, True), q, k, v, out, lse, grad_out, grad_lse))


@gna_resolved_backward.register_fake
def _gna_resolved_backward_fake(q, k, v, out, lse, grad_out, grad_lse, resolver, scale):
    return like(q), like(k), like(v)


def _resolved_setup_context(ctx, inputs, output) -> None:
    """Both resolved operators: q, k, v and the output saved, the arguments between v and `return_lse` kept."""
    q, k, v, *arguments, _ = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.arguments = tuple(arguments)
    ctx.set_materialize_grads(False)


def _resolved_backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    refuse_second_order()
    q, k, v, out, lse = ctx.saved_tensors
    grads = incoming_gradients(out, grad_out, grad_lse)
    if use_triton(q):
        dq, dk, dv = gna_resolved_backward(q, k, v, out, lse, *grads, *ctx.arguments)
    else:  # the reference's gradients recompute under autograd, which an operator's body runs without
        resolver, scale = ctx.arguments
        dq, dk, dv = _gradients(_resolved(int(resolver), q, scale, True), q, k, v, out, lse, *grads)
    return dq, dk, dv, None, None, None


gna_resolved.register_autograd(_resolved_backward, setup_context=_resolved_setup_context)


# == natsim::gna_resolved_ordered: the same, on tokens a model keeps in tile order ================================


def _resolved_ordered(resolver: int, q: torch.Tensor, shape: Sequence[int], tile: Sequence[int],
                      dilation: Sequence[int], scale: Optional[float], return_lse: bool) -> tuple[TileOrder, GnaSpec]:
    """The order of `q`'s tokens and the spec the registered `resolver` picks for their layout, checked to agree."""
    _check_registered(resolver)
    order = TileOrder.of(shape, tile, dilation)
    a = _resolvers[resolver](order.shape, int(q.shape[-2]), int(q.shape[-1]), q.dtype, q.device)
    spec = GnaSpec.of(len(order.shape), a["window"], a["stride"], a["dilation"], a["causal"], scale=scale,
                      q_tile=a["q_tile"], kv_tile=a["kv_tile"], kv_tiling=a["kv_tiling"],
                      precision=a.get("precision"), return_lse=return_lse, backend=a.get("backend"))
    if tuple(spec.dilation) != order.dilation:
        raise ValueError(f"tokens in the tile order of dilation {order.dilation} need a GNA call of that dilation, "
                         f"got dilation={spec.dilation}.")
    return order, spec


def _run_resolved_ordered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Sequence[int],
                          tile: Sequence[int], dilation: Sequence[int], resolver: int, scale: Optional[float],
                          return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    order, spec = _resolved_ordered(resolver, q, shape, tile, dilation, scale, return_lse)
    out, lse = run_ordered(q, k, v, order, spec)
    return out, (no_lse(q) if lse is None else lse)


@torch.library.custom_op("natsim::gna_resolved_ordered", mutates_args=())
def gna_resolved_ordered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Sequence[int], tile: Sequence[int],
    dilation: Sequence[int], resolver: int, scale: Optional[float], return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`natsim::gna_resolved` on `[B, N, heads, head_dim]` tensors whose tokens are in the tile order of the
    layout `shape` (kernels/gna/ordered.py `TileOrder`): the output and the LSE `[B, N, heads]` (empty unless
    `return_lse`) in that order. The resolver's Q tile must be `tile`."""
    return _run_resolved_ordered(q, k, v, shape, tile, dilation, resolver, scale, return_lse)


@gna_resolved_ordered.register_fake
def _gna_resolved_ordered_fake(q, k, v, shape, tile, dilation, resolver, scale, return_lse):
    _check_registered(resolver)
    if all(type(n) is int for n in (*shape, *tile, *dilation)):  # else symbolic in a dynamic-shape trace: at run time
        TileOrder.of(shape, tile, dilation)
    return like(q), fake_lse(q, return_lse)


@torch.library.custom_op("natsim::gna_resolved_ordered_backward", mutates_args=())
def gna_resolved_ordered_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], shape: Sequence[int], tile: Sequence[int],
    dilation: Sequence[int], resolver: int, scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::gna_resolved_ordered`, in tile order: FlashAttention-4's backward on them as they
    are where it ran the forward, else the row-major call's gradients between permutations."""
    return _ordered_gradients(*_resolved_ordered(resolver, q, shape, tile, dilation, scale, True), q, k, v, out, lse,
                              grad_out, grad_lse)


def _ordered_gradients(order: TileOrder, spec: GnaSpec, q, k, v, out, lse, grad_out, grad_lse):
    """dq, dk, dv of GNA of `spec` on tokens in `order`: FlashAttention-4's backward on them as they are where it
    ran the forward, else the row-major call's gradients between permutations."""
    grads = fa4_backward_ordered(q, k, v, out, lse, grad_out, grad_lse, order, spec)
    if grads is None:
        views = layout_views(order, q, k, v, out, lse, grad_out, grad_lse)
        grads = tuple(ordered_like(order, g) for g in _gradients(spec, *views))
    return grads


@gna_resolved_ordered_backward.register_fake
def _gna_resolved_ordered_backward_fake(q, k, v, out, lse, grad_out, grad_lse, shape, tile, dilation, resolver,
                                        scale):
    return like(q), like(k), like(v)


def _resolved_ordered_backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    refuse_second_order()
    q, k, v, out, lse = ctx.saved_tensors
    grads = incoming_gradients(out, grad_out, grad_lse)
    if use_triton(q):
        dq, dk, dv = gna_resolved_ordered_backward(q, k, v, out, lse, *grads, *ctx.arguments)
    else:  # the reference's gradients recompute under autograd, which an operator's body runs without
        shape, tile, dilation, resolver, scale = ctx.arguments
        # a dynamic-shape trace hands the layout over as symbols: the reference needs (and guards on) its values
        shape, tile, dilation = ([int(n) for n in values] for values in (shape, tile, dilation))
        order, spec = _resolved_ordered(int(resolver), q, shape, tile, dilation, scale, True)
        dq, dk, dv = _ordered_gradients(order, spec, q, k, v, out, lse, *grads)
    return (dq, dk, dv) + (None,) * 6


gna_resolved_ordered.register_autograd(_resolved_ordered_backward, setup_context=_resolved_setup_context)


# == the same two operators without autograd, for calls that need no gradient (common/operators.py) ==========

gna_resolved_inference = operator_without_autograd(
    "gna_resolved_inference",
    "(Tensor q, Tensor k, Tensor v, int resolver, float? scale, bool return_lse) -> (Tensor, Tensor)",
    _run_resolved, _gna_resolved_fake, "gna_resolved")
gna_resolved_ordered_inference = operator_without_autograd(
    "gna_resolved_ordered_inference",
    "(Tensor q, Tensor k, Tensor v, int[] shape, int[] tile, int[] dilation, int resolver, float? scale, "
    "bool return_lse) -> (Tensor, Tensor)",
    _run_resolved_ordered, _gna_resolved_ordered_fake, "gna_resolved_ordered")


def resolved_operators(tracked: bool) -> tuple[Callable, Callable]:
    """(`natsim::gna_resolved`, `natsim::gna_resolved_ordered`) for a call whose gradient autograd may need
    (`tracked`: `needs_gradient` of its inputs), else their twins without autograd."""
    if tracked:
        return gna_resolved, gna_resolved_ordered
    return gna_resolved_inference, gna_resolved_ordered_inference
