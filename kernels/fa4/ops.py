"""FlashAttention-4 calls as PyTorch operators, so that torch.compile keeps them in its graph as opaque calls, CUDA
graphs capture them and autograd differentiates them, exactly as natsim's own kernels' operators.

- `natsim::fa4_gna`: GNA of one geometry (kernels/fa4/gna.py), on `[B, *shape, H, D]` tensors, or with
  `ordered` on `[B, tokens, H, D]` tensors already in the Q tile's order (a model kept in tile order);
- `natsim::fa4_blocks`: attention under a block mask whose FlashAttention-4 lists were prepared once
  (kernels/fa4/lists.py `Fa4Lists`, crossing the schema as its tensors and sizes), on `[B, N, H, D]` tensors.

Each has a backward operator of its own (`natsim::fa4_gna_backward`, `natsim::fa4_blocks_backward`); a forward
called without the LSE is run again for it in the backward. FlashAttention-4 runs on CUDA tensors only: the
public entry points never send it anything else.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from natsim import Problem

from . import run
from .gna import Fa4Gna
from .lists import Fa4Lists


@functools.lru_cache(maxsize=256)
def _geometry(shape, window, stride, dilation, causal, q_tile, kv_tile) -> Fa4Gna:
    return Fa4Gna(Problem(shape, window, stride, dilation, causal), q_tile, kv_tile)


def geometry_of(shape: Sequence[int], window: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                causal: Sequence[bool], q_tile: Sequence[int], kv_tile: Sequence[int]) -> Fa4Gna:
    """The `Fa4Gna` of an operator's arguments (schemas hand over lists; the geometry is kept per tuple)."""
    return _geometry(*(tuple(x) for x in (shape, window, stride, dilation, causal, q_tile, kv_tile)))


def _scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    return tuple(q.shape[:-1])


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def _like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


# == natsim::fa4_gna =============================================================================================


@torch.library.custom_op("natsim::fa4_gna", mutates_args=())
def fa4_gna(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Sequence[int], window: Sequence[int],
    stride: Sequence[int], dilation: Sequence[int], causal: Sequence[bool], scale: Optional[float],
    q_tile: Sequence[int], kv_tile: Sequence[int], return_lse: bool, ordered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA on FlashAttention-4: the output in q's layout (or order), and the LSE `q.shape[:-1]` in float32 (empty
    unless `return_lse`)."""
    geometry = geometry_of(shape, window, stride, dilation, causal, q_tile, kv_tile)
    call = geometry.forward_ordered if ordered else geometry.forward
    out, lse = call(q, k, v, _scale(q, scale), return_lse)
    return out, (_no_lse(q) if lse is None else lse)


@fa4_gna.register_fake
def _fa4_gna_fake(q, k, v, shape, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, ordered):
    lse = q.new_empty(_lse_shape(q), dtype=torch.float32) if return_lse else _no_lse(q)
    return _like(q), lse


@torch.library.custom_op("natsim::fa4_gna_backward", mutates_args=())
def fa4_gna_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], shape: Sequence[int], window: Sequence[int],
    stride: Sequence[int], dilation: Sequence[int], causal: Sequence[bool], scale: Optional[float],
    q_tile: Sequence[int], kv_tile: Sequence[int], ordered: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::fa4_gna`; an empty `lse` runs the forward again for it."""
    geometry = geometry_of(shape, window, stride, dilation, causal, q_tile, kv_tile)
    scale = _scale(q, scale)
    if not lse.numel():
        out, lse = (geometry.forward_ordered if ordered else geometry.forward)(q, k, v, scale, True)
    call = geometry.backward_ordered if ordered else geometry.backward
    return tuple(call(q, k, v, out, lse, grad_out, grad_lse, scale))


@fa4_gna_backward.register_fake
def _fa4_gna_backward_fake(q, k, v, out, lse, grad_out, grad_lse, shape, window, stride, dilation, causal, scale,
                           q_tile, kv_tile, ordered):
    return _like(q), _like(k), _like(v)


def _gna_setup_context(ctx, inputs, output) -> None:
    q, k, v, *arguments = inputs
    ctx.save_for_backward(q, k, v, *output)
    shape, window, stride, dilation, causal, scale, q_tile, kv_tile, _, ordered = arguments
    ctx.arguments = (shape, window, stride, dilation, causal, scale, q_tile, kv_tile, ordered)
    ctx.set_materialize_grads(False)


def _gna_backward(ctx, grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]):
    q, k, v, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = grad_lse if grad_lse is not None and grad_lse.numel() else None
    dq, dk, dv = fa4_gna_backward(q, k, v, out, lse, grad_out, grad_lse, *ctx.arguments)
    return (dq, dk, dv) + (None,) * 10


fa4_gna.register_autograd(_gna_backward, setup_context=_gna_setup_context)


# == natsim::fa4_blocks ==========================================================================================


def _lists(tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> Fa4Lists:
    q_block, kv_block, masked, visited = sizes
    return Fa4Lists.from_tensors(list(tensors), q_block, kv_block, bool(masked), visited)


def lists_schema(lists: Fa4Lists) -> tuple[list[torch.Tensor], list[int]]:
    """How `lists` crosses `natsim::fa4_blocks`' schema: its tensors and its sizes."""
    return lists.tensors(), [lists.q_block, lists.kv_block, int(lists.masked), lists.visited]


@torch.library.custom_op("natsim::fa4_blocks", mutates_args=())
def fa4_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists_tensors: list[torch.Tensor], lists_sizes: list[int],
    scale: Optional[float], return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `[B, N, H, D]` tensors under a block mask on FlashAttention-4, from its prepared lists
    (`lists_schema`): the output, and the LSE `[B, N, H]` (empty unless `return_lse`)."""
    out, lse = run.forward(q, k, v, _scale(q, scale), _lists(lists_tensors, lists_sizes), None, return_lse)
    return out, (_no_lse(q) if lse is None else lse)


@fa4_blocks.register_fake
def _fa4_blocks_fake(q, k, v, lists_tensors, lists_sizes, scale, return_lse):
    lse = q.new_empty(_lse_shape(q), dtype=torch.float32) if return_lse else _no_lse(q)
    return _like(q), lse


@torch.library.custom_op("natsim::fa4_blocks_backward", mutates_args=())
def fa4_blocks_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], lists_tensors: list[torch.Tensor],
    lists_sizes: list[int], scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::fa4_blocks`; an empty `lse` runs the forward again for it."""
    lists = _lists(lists_tensors, lists_sizes)
    scale = _scale(q, scale)
    if not lse.numel():
        out, lse = run.forward(q, k, v, scale, lists, None, True)
    return tuple(run.backward(q, k, v, out, grad_out, lse, grad_lse, scale, lists, None))


@fa4_blocks_backward.register_fake
def _fa4_blocks_backward_fake(q, k, v, out, lse, grad_out, grad_lse, lists_tensors, lists_sizes, scale):
    return _like(q), _like(k), _like(v)


def _blocks_setup_context(ctx, inputs, output) -> None:
    q, k, v, tensors, sizes, scale, _ = inputs
    ctx.save_for_backward(q, k, v, *output, *tensors)
    ctx.arguments = (list(sizes), scale)
    ctx.set_materialize_grads(False)


def _blocks_backward(ctx, grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    sizes, scale = ctx.arguments
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = grad_lse if grad_lse is not None and grad_lse.numel() else None
    dq, dk, dv = fa4_blocks_backward(q, k, v, out, lse, grad_out, grad_lse, tensors, sizes, scale)
    return dq, dk, dv, [None] * len(tensors), None, None, None


fa4_blocks.register_autograd(_blocks_backward, setup_context=_blocks_setup_context)
