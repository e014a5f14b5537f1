"""Dense attention with its log-sum-exp, for the parts of routed attention that natsim does not make sparse (video
queries against text keys; the dense steps of content-adaptive masks), so that they merge exactly with a sparse
part through their LSEs."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def attention_with_lse(q, k, v, keep: Optional[torch.Tensor], scale: float):
    """Dense attention of `[B, Nq, heads, D]` queries over `[B, Nk, heads, D]` keys (`keep`: `[B, Nk]` or None):
    the output (float32) and the natural-log LSE `[B, Nq, heads]` (-inf, with output 0, where every key is
    masked). On the GPU, PyTorch's memory-efficient attention kernel, which returns its LSE; elsewhere in
    float32 torch ops."""
    if q.is_cuda:
        return _efficient_attention_with_lse(q, k, v, keep, scale)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out, lse.transpose(1, 2)


def _efficient_attention_with_lse(q, k, v, keep: Optional[torch.Tensor], scale: float):
    """`_attention_with_lse` through `aten._scaled_dot_product_efficient_attention`: keys padded to a multiple of
    16 (its bias rows must be 16-element aligned), masked keys and padding through an additive bias."""
    batch, queries, heads, _ = q.shape
    keys = k.shape[1]
    pad = -keys % 16
    bias = None
    if keep is not None or pad:
        keep = torch.ones(batch, keys, dtype=torch.bool, device=q.device) if keep is None else keep
        keep = F.pad(keep, (0, pad), value=False)
        bias = torch.zeros(batch, 1, 1, keys + pad, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~keep[:, None, None, :], float("-inf")).expand(batch, heads, queries, keys + pad)
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, True, scale=scale)[:2]
    lse = lse[..., :queries].transpose(1, 2)
    out = torch.where(torch.isinf(lse)[..., None], 0.0, out.transpose(1, 2).float())
    return out, lse
