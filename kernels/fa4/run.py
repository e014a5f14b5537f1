"""One FlashAttention-4 call on token sequences `[B, N, heads, head_dim]`, forward or backward, with or without
block-sparse lists and an element mask. natsim's LSE is `[B, N, heads]`; FlashAttention-4's is `[B, heads, N]`."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..common.devices import on_their_device
from .library import block_sparse_type, interface
from .lists import Fa4Lists


def _block_sparse(lists: Optional[Fa4Lists], backward: bool):
    if lists is None:
        return None
    mask_cnt, mask_idx, full_cnt, full_idx = lists.backward if backward else lists.forward
    return block_sparse_type()(mask_cnt, mask_idx, full_cnt, full_idx, block_size=(lists.q_block, lists.kv_block))


@on_their_device
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lists: Optional[Fa4Lists],
            mask_mod: Optional[Callable], return_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`(out, lse [B, N, heads] or None)`; `lists` None runs dense attention."""
    out, lse, *_ = interface()._flash_attn_fwd(
        q, k, v, softmax_scale=scale, mask_mod=mask_mod if lists is not None and lists.masked else None,
        block_sparse_tensors=_block_sparse(lists, False), return_lse=return_lse,
    )
    return out, None if lse is None or not return_lse else lse.transpose(1, 2).contiguous()


@on_their_device
def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
             lse: torch.Tensor, grad_lse: Optional[torch.Tensor], scale: float, lists: Optional[Fa4Lists],
             mask_mod: Optional[Callable]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from the forward's output and LSE `[B, N, heads]` (and the LSE's gradient, if any)."""
    dq, dk, dv = interface()._flash_attn_bwd(
        q, k, v, out, grad_out, lse.transpose(1, 2).contiguous(), scale,
        mask_mod=mask_mod if lists is not None and lists.masked else None,
        block_sparse_tensors=_block_sparse(lists, True),
        dlse=None if grad_lse is None else grad_lse.transpose(1, 2).contiguous(),
    )[:3]
    return dq, dk, dv
