"""`natsim::attention_resolved`: attention that a callable registered by a room above the kernels computes at run
time, kept out of compiled graphs as one opaque operator (the kernels never import the rooms that register).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .operators import fake_lse, like, no_lse

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


def _check_registered(attention: int) -> None:
    if attention not in _attentions:
        raise ValueError(f"attention must be an id from register_attention, got attention={attention!r}.")


@torch.library.custom_op("natsim::attention_resolved", mutates_args=())
def attention_resolved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: int, scale: Optional[float], return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered `attention` on `[B, N, heads, head_dim]`: the output and the LSE `[B, N, heads]` (empty
    unless `return_lse`). Inference only: it has no backward."""
    _check_registered(attention)
    out, lse = _attentions[attention](q, k, v, scale, return_lse)
    return out, (no_lse(q) if lse is None else lse)


@attention_resolved.register_fake
def _attention_resolved_fake(q, k, v, attention, scale, return_lse):
    _check_registered(attention)
    return like(q), fake_lse(q, return_lse)
