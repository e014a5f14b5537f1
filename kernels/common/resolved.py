"""`natsim::attention_resolved`: attention that a callable registered by a room above the kernels decides and
computes at run time, kept out of compiled graphs as one opaque operator (the kernels never import the rooms that
register), with its backward.

How the backward gets the forward's decision: the registered callable returns, besides the output and the LSE,
the attention it decided on as a function of q, k and v alone (`Decided`: the mask, the dense or sparse choice,
the token order fixed). The operator returns that function's handle (handles.py) as a third output, and
`natsim::attention_resolved_backward` finds the function by it and recomputes the forward under autograd for the
gradients, so that the backward never decides again.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch

from .handles import autograd_inside_an_operator, fake_handle, held, hold
from .operators import (fake_lse, incoming_gradients, like, needs_gradient, no_lse, operator_without_autograd,
                        recomputed_gradients, refuse_second_order)

Decided = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float], bool],
                     tuple[torch.Tensor, Optional[torch.Tensor], Decided]]
_attentions: dict[int, Attention] = {}
_ids = itertools.count()  # never reused: a compiled graph holding a released id finds nothing, not another's


def register_attention(attention: Attention) -> int:
    """Register `attention(q, k, v, scale, return_lse) -> (out, lse or None, decided)` on `[B, N, heads,
    head_dim]` tensors and return the id that `natsim::attention_resolved` takes. For attention whose work
    depends on state decided at run time, per call (a content-adaptive mask predicted, cached and planned per
    layer and diffusion step): the operator keeps it out of compiled graphs, so that its decisions never become
    guards. `decided(q, k, v) -> (out, lse or None)` is the same attention under the same decision, a function
    of q, k and v that torch autograd differentiates (natsim's operators have backward passes): the operator's
    backward recomputes it for the gradients."""
    key = next(_ids)
    _attentions[key] = attention
    return key


def unregister_attention(attention: int) -> None:
    """Forget the attention registered as `attention` (its state, masks and plans, goes with it): its owner is done
    with it, and a later call of the operator with that id is refused."""
    _check_registered(attention)
    del _attentions[attention]


def _check_registered(attention: int) -> None:
    if attention not in _attentions:
        raise ValueError(f"attention must be an id from register_attention, got attention={attention!r}.")


@torch.library.custom_op("natsim::attention_resolved", mutates_args=())
def attention_resolved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: int, scale: Optional[float], return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered `attention` on `[B, N, heads, head_dim]`: the output, the LSE `[B, N, heads]` (empty
    unless `return_lse`) and the handle of the call's decision, which the backward reads (callers drop it)."""
    _check_registered(attention)
    out, lse, decided = _attentions[attention](q, k, v, scale, return_lse)
    return out, (no_lse(q) if lse is None else lse), hold(decided)


@attention_resolved.register_fake
def _attention_resolved_fake(q, k, v, attention, scale, return_lse):
    _check_registered(attention)
    return like(q), fake_lse(q, return_lse), fake_handle()


@torch.library.custom_op("natsim::attention_resolved_backward", mutates_args=())
def attention_resolved_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    decision: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::attention_resolved`: its decided attention (found by the handle `decision`)
    recomputed under autograd and differentiated, the LSE's gradient included."""
    decided = held(decision, "natsim::attention_resolved_backward")
    with autograd_inside_an_operator():
        grads = recomputed_gradients(decided, q, k, v, grad_out, grad_lse)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads))


@attention_resolved_backward.register_fake
def _attention_resolved_backward_fake(q, k, v, grad_out, grad_lse, decision):
    return like(q), like(k), like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *_ = inputs
    out, _, decision = output
    ctx.save_for_backward(q, k, v, out, decision)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], _grad_decision):
    """The gradients of q, k and v through `natsim::attention_resolved_backward` (none for the arguments)."""
    refuse_second_order()
    q, k, v, out, decision = ctx.saved_tensors
    dq, dk, dv = attention_resolved_backward(q, k, v, *incoming_gradients(out, grad_out, grad_lse), decision)
    return dq, dk, dv, None, None, None


attention_resolved.register_autograd(_backward, setup_context=_setup_context)


def _run_undecided(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: int, scale: Optional[float],
                   return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_registered(attention)
    out, lse, _ = _attentions[attention](q, k, v, scale, return_lse)  # _: its decision, which no backward reads
    return out, (no_lse(q) if lse is None else lse)


def _undecided_fake(q, k, v, attention, scale, return_lse):
    _check_registered(attention)
    return like(q), fake_lse(q, return_lse)


attention_resolved_inference = operator_without_autograd(
    "attention_resolved_inference",
    "(Tensor q, Tensor k, Tensor v, int attention, float? scale, bool return_lse) -> (Tensor, Tensor)",
    _run_undecided, _undecided_fake, "attention_resolved")


def resolved_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: int, scale: Optional[float],
                       return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered `attention` on `[B, N, heads, head_dim]`: the output and the LSE (empty unless
    `return_lse`), through `natsim::attention_resolved` where autograd may need the gradient, else its twin."""
    if needs_gradient(q, k, v):
        out, lse, _ = attention_resolved(q, k, v, attention, scale, return_lse)
        return out, lse
    return attention_resolved_inference(q, k, v, attention, scale, return_lse)
