"""`natsim::attention_resolved`: attention that a callable registered by a room above the kernels decides and
computes at run time, kept out of compiled graphs as one opaque operator (the kernels never import the rooms that
register), with its backward.

How the backward gets the forward's decision: the registered callable returns, besides the output and the LSE,
the attention it decided on as a function of q, k and v alone (`Decided`: the mask, the dense or sparse choice,
the token order fixed). The operator keeps that function under a key and returns the key as a third output, a
CPU int64 scalar (the decision's handle); autograd (or a compiled graph's backward) saves the handle, and
`natsim::attention_resolved_backward` finds the function by it and recomputes the forward under autograd for the
gradients, so that the backward never decides again. A kept function lives as long as its handle: a forward run
without gradients drops it at once, a backward graph once it is freed.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from .operators import fake_lse, incoming_gradients, like, no_lse, recomputed_gradients

Decided = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float], bool],
                     tuple[torch.Tensor, Optional[torch.Tensor], Decided]]
_attentions: dict[int, Attention] = {}
_decided: dict[int, Decided] = {}
_keys = itertools.count()


def register_attention(attention: Attention) -> int:
    """Register `attention(q, k, v, scale, return_lse) -> (out, lse or None, decided)` on `[B, N, heads,
    head_dim]` tensors and return the id that `natsim::attention_resolved` takes. For attention whose work
    depends on state decided at run time, per call (a content-adaptive mask predicted, cached and planned per
    layer and diffusion step): the operator keeps it out of compiled graphs, so that its decisions never become
    guards. `decided(q, k, v) -> (out, lse or None)` is the same attention under the same decision, a function
    of q, k and v that torch autograd differentiates (natsim's operators have backward passes): the operator's
    backward recomputes it for the gradients."""
    key = len(_attentions)
    _attentions[key] = attention
    return key


def _check_registered(attention: int) -> None:
    if attention not in _attentions:
        raise ValueError(f"attention must be an id from register_attention, got attention={attention!r}.")


def _keep(decided: Decided) -> torch.Tensor:
    """The handle of `decided`: a CPU int64 scalar holding its key, which keeps it while the handle lives."""
    key = next(_keys)
    handle = torch.tensor(key, dtype=torch.int64)
    _decided[key] = decided
    weakref.finalize(handle, _decided.pop, key, None)
    return handle


def _fake_handle() -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("natsim::attention_resolved", mutates_args=())
def attention_resolved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: int, scale: Optional[float], return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered `attention` on `[B, N, heads, head_dim]`: the output, the LSE `[B, N, heads]` (empty
    unless `return_lse`) and the handle of the call's decision, which the backward reads (callers drop it)."""
    _check_registered(attention)
    out, lse, decided = _attentions[attention](q, k, v, scale, return_lse)
    return out, (no_lse(q) if lse is None else lse), _keep(decided)


@attention_resolved.register_fake
def _attention_resolved_fake(q, k, v, attention, scale, return_lse):
    _check_registered(attention)
    return like(q), fake_lse(q, return_lse), _fake_handle()


@contextmanager
def _autograd_inside_an_operator() -> Iterator[None]:
    """Autograd back on inside an operator's body, which runs below autograd: the backward recomputes the
    decided forward under it (the decision is a Python function known only at run time, so its gradients
    cannot be traced into a compiled graph, nor computed without autograd)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False):
        with torch.enable_grad():
            yield


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
    decided = _decided.get(int(decision))
    if decided is None:
        raise RuntimeError("natsim::attention_resolved_backward got the handle of a decision no longer kept: "
                           "its forward's graph was freed before this backward ran.")
    with _autograd_inside_an_operator():
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
    q, k, v, out, decision = ctx.saved_tensors
    dq, dk, dv = attention_resolved_backward(q, k, v, *incoming_gradients(out, grad_out, grad_lse), decision)
    return dq, dk, dv, None, None, None


attention_resolved.register_autograd(_backward, setup_context=_setup_context)
