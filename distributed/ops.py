"""The halo exchange as PyTorch operators: differentiable, and opaque to torch.compile.

Autograd does not track torch.distributed's collectives, and torch.compile would have to trace them. So the halo
exchange of collectives.py is a custom operator (`natsim::cp_gather_halo`) whose backward is the operator of its
adjoint move (`natsim::cp_return_halo`: the gradient of every halo frame back to the rank that holds that frame,
which adds it to its own; its backward is the gather), and whose fake implementation gives torch.compile the
output shapes without running a collective: a compiled graph holds each move as one opaque call, forward and
backward, whatever the point-to-point sends inside, and the same code runs eager and compiled. Ulysses' moves
live inside its own operator (pipeline.py), which attends between them.

A process group crosses an operator's schema as its name (`collectives.group_name`). Every rank must make the
same calls with the same `requires_grad`, so that the backward's collectives pair up.

Every rank must also run the operators in the same order. One call of natsim.distributed runs one operator per
direction of each move, each reading what the one before it produced, so no compiler can reorder them. Operators
of calls that do not depend on each other (two attention calls on unrelated inputs in one compiled graph) are
another matter: Inductor orders independent operators by their buffers' sizes, which differ from rank to rank with
uneven splits or halo routes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import collectives
from .collectives import HaloRoutes, group_name, transfer_group

@torch.library.custom_op("natsim::cp_gather_halo", mutates_args=())
def _gather_halo(k: torch.Tensor, v: torch.Tensor, routes: Sequence[int], group: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return collectives.gather_halo(k, v, HaloRoutes.from_ints(routes), transfer_group(group))


@_gather_halo.register_fake
def _gather_halo_fake(k, v, routes, group):
    first, last = HaloRoutes.from_ints(routes).keys
    return tuple(x.new_empty((x.shape[0], last - first, *x.shape[2:])) for x in (k, v))


@torch.library.custom_op("natsim::cp_return_halo", mutates_args=())
def _return_halo(grad_k: torch.Tensor, grad_v: torch.Tensor, routes: Sequence[int], group: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return collectives.return_halo(grad_k, grad_v, HaloRoutes.from_ints(routes), transfer_group(group))


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
