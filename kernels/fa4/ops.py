"""FlashAttention-4 under a prepared block mask as a PyTorch operator, `natsim::fa4_blocks`, so that torch.compile
keeps it in its graph as an opaque call, CUDA graphs capture it and autograd differentiates it, exactly as natsim's
own kernels' operators: attention of `[B, N, H, D]` tensors on FlashAttention-4's lists prepared once
(kernels/fa4/lists.py `Fa4Lists`, crossing the schema as its tensors and sizes). Its backward is an operator of its
own, `natsim::fa4_blocks_backward`; a forward called without the LSE is run again for it in the backward.
FlashAttention-4 runs on CUDA tensors only: the public entry points never send it anything else. (GNA on
FlashAttention-4 runs inside natsim's GNA operators, kernels/gna/ops.py, whose dispatcher picks the backend.)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..common.operators import fake_lse, incoming_gradients, like, no_lse, refuse_second_order
from . import run
from .lists import Fa4Lists


def _scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


# == natsim::fa4_blocks ==========================================================================================


def _lists(tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> Fa4Lists:
    q_block, kv_block, masked = sizes
    return Fa4Lists.from_tensors(list(tensors), q_block, kv_block, bool(masked))


def lists_schema(lists: Fa4Lists) -> tuple[list[torch.Tensor], list[int]]:
    """How `lists` crosses `natsim::fa4_blocks`' schema: its tensors and its sizes (ints a compiled graph guards
    on, so only what every mask of the work's shape and blocks shares)."""
    return lists.tensors(), [lists.q_block, lists.kv_block, int(lists.masked)]


@torch.library.custom_op("natsim::fa4_blocks", mutates_args=())
def fa4_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists_tensors: list[torch.Tensor], lists_sizes: list[int],
    scale: Optional[float], return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `[B, N, H, D]` tensors under a block mask on FlashAttention-4, from its prepared lists
    (`lists_schema`): the output, and the LSE `[B, N, H]` (empty unless `return_lse`)."""
    out, lse = run.forward(q, k, v, _scale(q, scale), _lists(lists_tensors, lists_sizes), None, return_lse)
    return out, (no_lse(q) if lse is None else lse)


@fa4_blocks.register_fake
def _fa4_blocks_fake(q, k, v, lists_tensors, lists_sizes, scale, return_lse):
    return like(q), fake_lse(q, return_lse)


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
    return like(q), like(k), like(v)


def _blocks_setup_context(ctx, inputs, output) -> None:
    q, k, v, tensors, sizes, scale, _ = inputs
    ctx.save_for_backward(q, k, v, *output, *tensors)
    ctx.arguments = (list(sizes), scale)
    ctx.set_materialize_grads(False)


def _blocks_backward(ctx, grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]):
    refuse_second_order()
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    sizes, scale = ctx.arguments
    grad_out, grad_lse = incoming_gradients(out, grad_out, grad_lse)
    dq, dk, dv = fa4_blocks_backward(q, k, v, out, lse, grad_out, grad_lse, tensors, sizes, scale)
    return dq, dk, dv, [None] * len(tensors), None, None, None


fa4_blocks.register_autograd(_blocks_backward, setup_context=_blocks_setup_context)
