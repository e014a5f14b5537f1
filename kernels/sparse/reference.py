"""The torch references of attention under a block mask: what the sparse kernel is tested against and what CPU
tensors run.

- `sparse_reference`: exact attention under the block mask expanded to elements.
- `fp8_sparse_reference`: the same with FP8's quantization rule applied (kernels/common/fp8.py).
- `sparse_pv_reference`: SpargeAttn's PV skip (its section 3.4, Algorithm 1 line 15) as `sparse_attention`'s
  `pv_threshold` runs it: what the Triton kernel computes, tile by tile, in float32 (float64 for float64
  inputs).

The PV skip depends on the order in which a program meets its keys (the running maximum), so this reference walks
the kernel's own work (`SparseWork`): per work item, the members' rows against the item's list of KV blocks,
`block_n // kv_block` list entries per tile, in list order. Per tile and member (query block): the tile's
scores update every row's running maximum `m` and sum `l` as in FlashAttention; when every real row of the
member has `rowmax(tile scores) - m_new < pv_threshold`, the member adds nothing to its output accumulator
for this tile. With `pv_threshold=None` nothing is skipped and this is exact sparse attention. Loops run over
tiles (vectorised over every work item), so it is for tests and the CPU path, not for speed.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..common.backend import outside_autocast
from ..common.fp8 import Fp8Scales, check_fp8_call, lse_with_mean, prequantized, quantize, quantized_weights
from .checks import check_mask_batch, check_pv_threshold, check_sparse_qkv
from .mask import SparseMask
from .work import SparseWork, dense_mask


@outside_autocast
def sparse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Union[torch.Tensor, SparseMask],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    chunk: int = 1024,
    quantized_probs: bool = False,
    p_sum: str = "exact",
):
    """Exact attention of `[B, N, heads, head_dim]` tensors under the block mask expanded to elements, in float32
    (float64 for float64 inputs), `chunk` query rows at a time; differentiable. Empty rows: output 0, LSE -inf.
    `quantized_probs`: P @ V takes the weights rounded as the FP8 kernels round them, over the row sum `p_sum`
    names (kernels/common/fp8.py, `quantized_weights`)."""
    check_sparse_qkv(q, k, v)
    dense, q_block, kv_block, _ = dense_mask(mask, q_block, kv_block, q.shape[1])
    batch, seq_len, heads, head_dim = q.shape
    dense = dense.to(q.device)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = head_dim**-0.5 if scale is None else float(scale)
    kt = k.to(compute).permute(0, 2, 3, 1)  # [B, H, D, N]
    vt = v.to(compute).transpose(1, 2)  # [B, H, N, D]
    key_blocks = torch.arange(seq_len, device=q.device) // kv_block
    outs, lses = [], []
    for first in range(0, seq_len, chunk):
        rows = torch.arange(first, min(first + chunk, seq_len), device=q.device)
        allowed = dense[:, :, rows // q_block][..., key_blocks]  # [B|1, H|1, rows, N]
        out, lse = attention_under(q[:, rows].to(compute), kt, vt, allowed, scale, quantized_probs, p_sum)
        outs.append(out)
        lses.append(lse)
    if not outs:  # no tokens
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    else:
        out, lse = torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 1)
    return (out, lse) if return_lse else out


def attention_under(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, allowed: torch.Tensor, scale: float,
                    quantized_probs: bool = False, p_sum: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `[B, rows, H, D]` queries over keys `kt` `[B, H, D, N]` and values `vt` `[B, H, N, D]` under
    the element mask `allowed` `[B|1, H|1, rows, N]`, in the inputs' dtype: the output `[B, rows, H, D]` and the
    natural-log LSE `[B, rows, H]` (rows with no key: output 0, LSE -inf); with `quantized_probs` the weights
    rounded as the FP8 kernels round them, over the row sum `p_sum` names (`quantized_weights`)."""
    scores = (q.transpose(1, 2) @ kt) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    attends = allowed.any(-1, keepdim=True)
    scores = torch.where(attends, scores, 0.0)  # empty rows: finite, and zeroed below
    lse = torch.logsumexp(scores, -1, keepdim=True)
    weights = quantized_weights(scores.masked_fill(~allowed, float("-inf")), p_sum) if quantized_probs \
        else torch.exp(scores - lse)
    out = (weights @ vt) * attends
    return out.transpose(1, 2), torch.where(attends, lse, float("-inf"))[..., 0].transpose(1, 2)


@outside_autocast
def fp8_sparse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Union[torch.Tensor, SparseMask],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    scales: Optional[Fp8Scales] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """`sparse_reference` with FP8's quantization rule (kernels/common/fp8.py) in float32: q, k, v quantized and
    dequantized, P rounded for P @ V as the kernels round it (against the row's final maximum); the LSE with
    K's mean added back. Output in q's dtype. Inputs given in float8 e4m3 with their `scales` are dequantized as
    they are (no mean), and the output is in `out_dtype` (bfloat16 by default)."""
    check_sparse_qkv(q, k, v)
    _, scales, out_dtype = check_fp8_call(q, k, v, "fp8", scales, out_dtype)
    quantized = quantize(q, k, v) if scales is None else prequantized(q, k, v, scales)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = sparse_reference(*quantized.dequantized(), mask, q_block, kv_block, scale, return_lse=True,
                                quantized_probs=True)
    out = out.to(q.dtype if out_dtype is None else out_dtype)
    if not return_lse:
        return out
    return out, (lse if quantized.k_mean is None else lse_with_mean(lse, q, quantized.k_mean, scale))


@outside_autocast
def sparse_pv_reference(
    work: SparseWork,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pv_threshold: Optional[float],
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out, lse, skipped)` of `[B, N, heads, head_dim]` q, k, v on prepared `work`: the output (q's dtype),
    the natural-log LSE `[B, N, heads]` (-inf and output 0 for a query that attends nothing) and, per work
    item `(b * heads + h) * groups + g`, the attended (query block, KV block) pairs whose P @ V was skipped
    (int64), the kernel's third debug count."""
    check_sparse_qkv(q, k, v)
    check_mask_batch(work.mask_batch, work.mask_heads, q)
    pv_threshold = check_pv_threshold(pv_threshold)
    batch, seq_len, heads, head_dim = q.shape
    if seq_len != work.seq_len:
        raise ValueError(f"q must have the mask's seq_len={work.seq_len} tokens, got q.shape={tuple(q.shape)}.")
    device = q.device
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = head_dim**-0.5 if scale is None else float(scale)
    qb, kvb, group, per_tile = work.q_block, work.kv_block, work.group, work.block_n // work.kv_block

    # Work items w = (b * heads + h) * groups + g, and the mask item whose lists they read.
    b, h, g = torch.meshgrid(torch.arange(batch, device=device), torch.arange(heads, device=device),
                             torch.arange(work.groups, device=device), indexing="ij")
    b, h, g = b.reshape(-1), h.reshape(-1), g.reshape(-1)
    item = ((b * (work.mask_batch > 1)) * work.mask_heads + h * (work.mask_heads > 1)) * work.groups + g
    offsets, kv_list, bits = (t.to(device, torch.int64) for t in (work.offsets, work.kv_list, work.member_bits))
    start, end = offsets[item], offsets[item + 1]
    members = work.members.to(device, torch.int64)[item]  # [I, R]
    member_of_row = torch.arange(group * qb, device=device) // qb  # [M]
    token = members[:, member_of_row] * qb + torch.arange(group * qb, device=device) % qb  # [I, M]
    row_ok = (members[:, member_of_row] >= 0) & (token < seq_len)
    token = token.clamp(0, seq_len - 1)
    rows = torch.where(row_ok[..., None], q[b[:, None], token, h[:, None]].to(compute), 0.0)  # [I, M, D]

    acc = torch.zeros(rows.shape, dtype=compute, device=device)
    l_i = torch.zeros(row_ok.shape, dtype=compute, device=device)
    m_i = torch.full(row_ok.shape, -1.0e30, dtype=compute, device=device)
    skipped = torch.zeros(item.shape, dtype=torch.int64, device=device)
    within = torch.arange(kvb, device=device)
    tiles = int(((end - start + per_tile - 1) // per_tile).max()) if item.numel() else 0
    for t in range(tiles):
        entry = start[:, None] + t * per_tile + torch.arange(per_tile, device=device)  # [I, P]
        valid = entry < end[:, None]
        entry = torch.where(valid, entry, 0)
        keys = (kv_list[entry][..., None] * kvb + within).reshape(len(item), -1)  # [I, C]
        key_ok = valid.repeat_interleave(kvb, 1) & (keys < seq_len)
        keys = keys.clamp(max=seq_len - 1)
        member_bit = (bits[entry].repeat_interleave(kvb, 1)[:, None, :] >> member_of_row[None, :, None]) & 1
        allowed = key_ok[:, None, :] & (member_bit != 0)  # [I, M, C]
        scores = rows @ k[b[:, None], keys, h[:, None]].to(compute).transpose(1, 2) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        m_local = scores.amax(-1)
        m_new = torch.maximum(m_i, m_local)
        p = torch.exp(scores - m_new[..., None])
        alpha = torch.exp(m_i - m_new)
        l_i = l_i * alpha + p.sum(-1)
        acc = acc * alpha[..., None]
        keep_row = torch.ones_like(row_ok)
        if pv_threshold is not None:
            gap = torch.where(row_ok, m_local - m_new, float("-inf"))
            skip = gap.view(len(item), group, qb).amax(-1) < pv_threshold  # [I, R]
            attended = ((bits[entry][:, None, :] >> torch.arange(group, device=device)[None, :, None]) & 1) != 0
            skipped += ((skip & (members >= 0)) * (attended & valid[:, None, :]).sum(-1)).sum(-1)
            keep_row = ~skip[:, member_of_row]
        acc = acc + (p * keep_row[..., None]) @ v[b[:, None], keys, h[:, None]].to(compute)
        m_i = m_new

    empty = l_i == 0
    out_rows = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l_i)[..., None])
    lse_rows = torch.where(empty, float("-inf"), m_i + torch.log(torch.where(empty, 1.0, l_i)))
    out = torch.zeros(q.shape, dtype=compute, device=device)
    lse = torch.full((batch, seq_len, heads), float("-inf"), dtype=compute, device=device)
    bi, hi = b[:, None].expand_as(token)[row_ok], h[:, None].expand_as(token)[row_ok]
    out[bi, token[row_ok], hi] = out_rows[row_ok]
    lse[bi, token[row_ok], hi] = lse_rows[row_ok]
    return out.to(q.dtype), lse.to(torch.float64 if compute == torch.float64 else torch.float32), skipped
