"""What every family's registered operators share (kernels/gna/ops.py, kernels/sparse/ops.py,
kernels/common/resolved.py): the fake outputs that torch.compile traces with, the empty LSE of a call that did not
ask for one, the incoming gradients as the backward kernels take them, the CPU path's backward, the torch
reference's gradients recomputed under autograd, and operators without autograd for calls that need no gradient.

Why those twins: a custom operator's Python autograd layer runs on every call, under `torch.no_grad` too. On the
CPU machine the resolved GNA operator's dispatch cost 23 us over its body, an operator with only CPU and CUDA
kernels 7; on an H100's host a tiny call took 67.7 against 40.2 us (docs/performance.md). Diffusion models attend
without gradients, and a compiled step of dozens of calls on an image's few thousand tokens is bound by the host.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
_without_autograd = torch.library.Library("natsim", "FRAGMENT")


def operator_without_autograd(name: str, schema: str, body: Callable, fake: Callable,
                              twin: str) -> torch._ops.OpOverload:
    """Define `natsim::{name}{schema}` (the arguments and outputs, as torch.library writes them) with `body` as
    its CPU and CUDA kernel, `fake` for tracing, and no autograd layer; return the operator. The twin of the
    operator `twin`, which has autograd, for calls that need no gradient (module docstring): a call whose inputs
    autograd may need gradients of is refused with a sentence naming `twin`, instead of outputs with none."""

    def kernel(*arguments):
        if needs_gradient(*(a for a in arguments if isinstance(a, torch.Tensor))):
            raise RuntimeError(f"natsim::{name} has no backward, and an input requires grad with grad mode on: call "
                               f"natsim::{twin}, or this operator under torch.no_grad().")
        return body(*arguments)

    _without_autograd.define(f"{name}{schema}")
    for device in ("CPU", "CUDA"):
        _without_autograd.impl(name, kernel, device)
    torch.library.register_fake(f"natsim::{name}", fake, lib=_without_autograd)
    return getattr(torch.ops.natsim, name).default


def needs_gradient(*tensors: torch.Tensor) -> bool:
    """Whether autograd may ask a call on `tensors` for gradients: grad mode on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def like(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A fake output shaped as `x` with contiguous strides, as the kernels and references allocate theirs
    (`empty_like` would copy the strides of a transposed input, and compiled graphs check them); in x's dtype
    unless `dtype` is given."""
    return x.new_empty(x.shape, dtype=dtype)


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The LSE's dtype: float64 for float64 inputs (the references), float32 otherwise."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def no_lse(q: torch.Tensor) -> torch.Tensor:
    """The empty LSE an operator returns when the call did not ask for one (a schema's outputs are tensors)."""
    return q.new_empty((0,), dtype=lse_dtype(q))


def fake_lse(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    """A fake LSE `[B, *tokens, heads]` of `[B, *tokens, heads, head_dim]` q, or the empty one."""
    return q.new_empty(q.shape[:-1], dtype=lse_dtype(q)) if return_lse else no_lse(q)


def incoming_gradients(out: torch.Tensor, grad_out: Optional[torch.Tensor],
                       grad_lse: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gradients autograd hands an operator's backward (without materialized zeros), as the backward passes
    take them: a tensor for the output (zeros when it was unused), None for an unused or empty LSE."""
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    return grad_out, grad_lse if grad_lse is not None and grad_lse.numel() else None


SECOND_ORDER_REFUSAL = (
    "natsim's attention has no second derivative: its backward is a kernel (on the CPU, a recomputation) that "
    "autograd does not differentiate again, so a loss on its gradients (create_graph=True: a gradient penalty, a "
    "double backward) needs another attention there, such as torch.nn.functional.scaled_dot_product_attention "
    "under the same mask."
)


def refuse_second_order() -> None:
    """Raise `SECOND_ORDER_REFUSAL` where autograd is about to record an operator's backward for differentiating it
    again: autograd runs a backward in grad mode only under `create_graph=True`."""
    if torch.is_grad_enabled():
        raise RuntimeError(SECOND_ORDER_REFUSAL)


def recomputed_gradients(reference: Reference, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor]):
    """dq, dk, dv of `reference(q, k, v) -> (out, lse)` recomputed under autograd: the CPU path's backward."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = reference(*inputs)
        outputs, grads = [out], [grad_out]
        if grad_lse is not None and grad_lse.numel():
            outputs.append(lse)
            grads.append(grad_lse)
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
