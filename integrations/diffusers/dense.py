"""Dense attention with its log-sum-exp, for the parts of routed attention that natsim does not make sparse (video
queries against text keys; the dense steps of content-adaptive masks), so that they merge exactly with a sparse
part through their LSEs.

Its backward takes the LSE's gradient as well as the output's: the merge weights the two parts by their LSEs, so
training joint attention needs both. On the GPU the forward is PyTorch's flash kernel (its memory-efficient kernel
under a key mask), whose LSE output autograd does not differentiate; the backward (`_DenseWithLse`) is written out
instead, over chunks of queries: with P recomputed from the saved LSE, dS = P * (dO V^T - rowsum(dO * O) + dLSE),
dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO. The keys here are few (text), so a chunk's scores are small.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false

CHUNK_SCORES = 1 << 25  # scores per chunk of queries in the backward (128 MiB in float32)


def attention_with_lse(q, k, v, keep: Optional[torch.Tensor], scale: float, known_queries: bool = True):
    """Dense attention of `[B, Nq, heads, D]` queries over `[B, Nk, heads, D]` keys (`keep`: `[B, Nk]` or None):
    the output (float32) and the natural-log LSE `[B, Nq, heads]` (-inf, with output 0, where every key is
    masked), both differentiable. On the GPU, PyTorch's flash or memory-efficient kernel, which return their LSE,
    with the backward of the module docstring; elsewhere in float32 torch ops, differentiated by autograd.
    `known_queries`: False where the query count is data-dependent under torch.compile (`_takes_flash`)."""
    if q.is_cuda:
        return _DenseWithLse.apply(q, k, v, keep, scale, known_queries)
    return _torch_attention_with_lse(q, k, v, keep, scale)


def _torch_attention_with_lse(q, k, v, keep: Optional[torch.Tensor], scale: float):
    scores = (q.float().transpose(1, 2) @ k.float().permute(0, 2, 3, 1)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    # The LSE over the keys and one masked key more: a reduction over at least one key, which torch.compile
    # can trace where the key count is data-dependent and may be 0 (a class that drops padding text, Mochi).
    padded = F.pad(scores, (0, 1), value=float("-inf"))
    top = padded.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), 0.0, top)
    lse = torch.log(torch.exp(padded - top).sum(-1)) + top[..., 0]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = (probs @ v.float().transpose(1, 2)).transpose(1, 2)
    return out, lse.transpose(1, 2)


def _cuda_attention_with_lse(q, k, v, keep: Optional[torch.Tensor], scale: float, known_queries: bool = True):
    """`attention_with_lse`'s forward on the GPU: PyTorch's flash kernel, which takes any key count as it is,
    where `_takes_flash`; otherwise its memory-efficient kernel (a bias for the mask and the padding). The flash
    call saves a compiled step the bias's and the padding's kernels, a few launches of host work on each joint
    call."""
    if _takes_flash(k, keep, known_queries):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)[:2]
        return out.transpose(1, 2).float(), lse.transpose(1, 2)
    return _efficient_attention_with_lse(q, k, v, keep, scale)


def _takes_flash(k: torch.Tensor, keep: Optional[torch.Tensor], known_queries: bool) -> bool:
    """Whether the flash kernel runs a GPU call: no key mask, a query count known to be what it is
    (`known_queries`), and keys known to be at least one while tracing. A count that is data-dependent under
    torch.compile (a class that drops padding text, Mochi, whose count may be 0) takes the memory-efficient
    path, which runs any count."""
    return keep is None and known_queries and guard_or_false(k.shape[1] > 0)


def _efficient_attention_with_lse(q, k, v, keep: Optional[torch.Tensor], scale: float):
    """`attention_with_lse` through `aten._scaled_dot_product_efficient_attention`: keys padded to a multiple of
    16 (its bias rows must be 16-element aligned), masked keys and padding through an additive bias."""
    batch, queries, heads, _ = q.shape
    keys = k.shape[1]
    # A data-dependent key count (under torch.compile, a class that drops padding text) pads 1 to 16 keys: a
    # multiple of 16 that is never 0 keys, without a branch on the count.
    aligned = guard_or_false(keys % 16 == 0)
    pad = 0 if aligned else 16 - keys % 16
    bias = None
    if keep is not None or not aligned:
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


def _probabilities(q, k, lse, keep: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """`[B, heads, Nq, Nk]` float32 softmax probabilities recomputed from the forward's LSE (0 at masked keys, and
    on rows whose every key is masked)."""
    scores = (q.float().transpose(1, 2) @ k.float().permute(0, 2, 3, 1)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    lse = lse.transpose(1, 2)[..., None]
    return torch.exp(scores - torch.where(torch.isinf(lse), float("inf"), lse))


class _DenseWithLse(torch.autograd.Function):
    """`attention_with_lse` with the backward of the module docstring (the LSE's gradient included)."""

    @staticmethod
    def forward(ctx, q, k, v, keep: Optional[torch.Tensor], scale: float, known_queries: bool = True):
        if q.is_cuda:
            out, lse = _cuda_attention_with_lse(q, k, v, keep, scale, known_queries)
        else:  # for tests
            out, lse = _torch_attention_with_lse(q, k, v, keep, scale)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, keep = ctx.saved_tensors
        scale = ctx.scale
        batch, queries, heads, _ = q.shape
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.float()
        grad_lse = torch.zeros_like(lse) if grad_lse is None else torch.where(torch.isinf(lse), 0.0, grad_lse)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        chunk = max(1, CHUNK_SCORES // max(1, batch * heads * k.shape[1]))
        for start in range(0, queries, chunk):
            rows = slice(start, min(queries, start + chunk))
            p = _probabilities(q[:, rows], k, lse[:, rows], keep, scale)
            d_o = grad_out[:, rows]
            delta = (d_o * out[:, rows]).sum(-1) - grad_lse[:, rows]  # [B, rows, heads]
            dp = torch.einsum("bqhd,bkhd->bhqk", d_o, v.float())
            ds = p * (dp - delta.transpose(1, 2)[..., None])
            dq[:, rows] = torch.einsum("bhqk,bkhd->bqhd", ds, k.float()) * scale
            dk += torch.einsum("bhqk,bqhd->bkhd", ds, q[:, rows].float()) * scale
            dv += torch.einsum("bhqk,bqhd->bkhd", p, d_o)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
