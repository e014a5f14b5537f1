"""natsim.distributed's moves as PyTorch operators: differentiable, and opaque to torch.compile.

Autograd does not track torch.distributed's collectives, and torch.compile would have to trace them. So each move
of collectives.py is a custom operator (`natsim::cp_*`) whose backward is the operator of its adjoint move, and
whose fake implementation gives torch.compile the output shapes without running a collective: a compiled graph
holds each move as one opaque call, forward and backward, whatever the collectives inside (point-to-point ones
included), and the same code runs eager and compiled.

- `frames_to_heads` / `heads_to_frames` (Ulysses): each one's backward is the other; a backward through Ulysses
  runs the forward's four all-to-alls mirrored (the output's gradient to head-sharded sequences, the gradients of
  q, k and v back to frame-sharded slabs).
- `gather_halo` (the halo exchange): its backward, `natsim::cp_return_halo`, sends the gradient of every halo
  frame back to the rank that holds that frame, which adds it to its own (and its backward is the gather).

A process group crosses an operator's schema as its name (`collectives.group_name`). Every rank must make the
same calls with the same `requires_grad`, so that the backward's collectives pair up.

Every rank must also run the operators in the same order. One call of natsim.distributed runs one operator per
direction of each move (q, k and v travel in one; the gradients of q, k and v in one), each reading what the one
before it produced, so no compiler can reorder them. Operators of calls that do not depend on each other (two
attention calls on unrelated inputs in one compiled graph) are another matter: Inductor orders independent
operators by their buffers' sizes, which differ from rank to rank with uneven splits or halo routes.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from . import collectives
from .collectives import HaloRoutes, group_name

# -- Ulysses ------------------------------------------------------------------------------------------------


@torch.library.custom_op("natsim::cp_frames_to_heads", mutates_args=())
def _frames_to_heads(xs: Sequence[torch.Tensor], split: Sequence[int], rank: int, group: str) -> list[torch.Tensor]:
    resolved = _resolve_process_group(group)
    return [collectives.frames_to_heads(x, split, resolved) for x in xs]


@_frames_to_heads.register_fake
def _frames_to_heads_fake(xs, split, rank, group):
    return [x.new_empty((x.shape[0], sum(split), *x.shape[2:-2], x.shape[-2] // len(split), x.shape[-1]))
            for x in xs]


@torch.library.custom_op("natsim::cp_heads_to_frames", mutates_args=())
def _heads_to_frames(xs: Sequence[torch.Tensor], split: Sequence[int], rank: int, group: str) -> list[torch.Tensor]:
    resolved = _resolve_process_group(group)
    return [collectives.heads_to_frames(x, split, rank, resolved) for x in xs]


@_heads_to_frames.register_fake
def _heads_to_frames_fake(xs, split, rank, group):
    return [x.new_empty((x.shape[0], split[rank], *x.shape[2:-2], x.shape[-2] * len(split), x.shape[-1]))
            for x in xs]


def _keep_arguments(ctx, inputs, output) -> None:
    ctx.arguments = inputs[1:]


_frames_to_heads.register_autograd(lambda ctx, grads: (_heads_to_frames(grads, *ctx.arguments), None, None, None),
                                   setup_context=_keep_arguments)
_heads_to_frames.register_autograd(lambda ctx, grads: (_frames_to_heads(grads, *ctx.arguments), None, None, None),
                                   setup_context=_keep_arguments)


def frames_to_heads(xs: Sequence[torch.Tensor], split: tuple[int, ...], rank: int, group) -> list[torch.Tensor]:
    """Ulysses' first all-to-alls, one operator for all of `xs`: each `[B, T_r, *rest, H, D]` of this rank's
    frames, every head, to the whole sequence of its `H / P` heads `[B, L, *rest, H / P, D]`. Its backward is
    `heads_to_frames` of the gradients."""
    return _frames_to_heads(list(xs), split, rank, group_name(group))


def heads_to_frames(xs: Sequence[torch.Tensor], split: tuple[int, ...], rank: int, group) -> list[torch.Tensor]:
    """Ulysses' second all-to-alls, the inverse of `frames_to_heads` (and its backward)."""
    return _heads_to_frames(list(xs), split, rank, group_name(group))


# -- the halo exchange --------------------------------------------------------------------------------------


@torch.library.custom_op("natsim::cp_gather_halo", mutates_args=())
def _gather_halo(k: torch.Tensor, v: torch.Tensor, routes: Sequence[int], group: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return collectives.gather_halo(k, v, HaloRoutes.from_ints(routes), _resolve_process_group(group))


@_gather_halo.register_fake
def _gather_halo_fake(k, v, routes, group):
    first, last = HaloRoutes.from_ints(routes).keys
    return tuple(x.new_empty((x.shape[0], last - first, *x.shape[2:])) for x in (k, v))


@torch.library.custom_op("natsim::cp_return_halo", mutates_args=())
def _return_halo(grad_k: torch.Tensor, grad_v: torch.Tensor, routes: Sequence[int], group: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return collectives.return_halo(grad_k, grad_v, HaloRoutes.from_ints(routes), _resolve_process_group(group))


@_return_halo.register_fake
def _return_halo_fake(grad_k, grad_v, routes, group):
    first, last = HaloRoutes.from_ints(routes).own
    return tuple(g.new_empty((g.shape[0], last - first, *g.shape[2:])) for g in (grad_k, grad_v))


def _keep_routes(ctx, inputs, output) -> None:
    ctx.arguments = inputs[2:]


_gather_halo.register_autograd(lambda ctx, grad_k, grad_v: (*_return_halo(grad_k, grad_v, *ctx.arguments), None, None),
                               setup_context=_keep_routes)
_return_halo.register_autograd(lambda ctx, grad_k, grad_v: (*_gather_halo(grad_k, grad_v, *ctx.arguments), None, None),
                               setup_context=_keep_routes)


def gather_halo(k: torch.Tensor, v: torch.Tensor, routes: HaloRoutes, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The halo exchange: k and v `[B, T_r, ...]` of this rank's frames -> k and v of the frames `routes.keys`,
    received point-to-point from the ranks that hold them. Its backward sends the gradients of the received
    frames back to those ranks and adds, on each rank, those of its own frames."""
    return _gather_halo(k, v, routes.as_ints(), group_name(group))
