"""Content-adaptive block-mask predictors, public through `natsim.masks`.

Each predictor looks at q and k (`[B, N, heads, head_dim]`, any device and float dtype) and returns the boolean
block mask `[B, H, ceil(N / q_block), ceil(N / kv_block)]` that `sparse_attention` takes: True where a query
block should attend a key block. They are torch tensor code only (no loop over blocks), so they run on the GPU
where q and k are, in float32:

- `topp`: FG-Attn section 5.3, mean-pooled blocks, the smallest set of key blocks holding probability `p`.
- `sparge`: SpargeAttn's first stage (section 3.2, Algorithm 1 lines 4-6), `topp`'s selection over the pooled
  scores of the blocks whose tokens are alike, and every block pair whose query or key block is not.
- `hierarchical`: DFSAttn's coarse-then-fine scoring (section 5.2, Eq. 11-12), pooled sub-blocks, their
  attention summed per block pair, the top `keep` fraction of key blocks per query block.

A last partial block is pooled over its real tokens only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from natsim.kernels.backends.triton import MIN_Q_BLOCK, check_block

# Elements of one float32 temporary of `hierarchical`'s sub-block scores (128 MiB); larger inputs go in chunks
# of query blocks.
_CHUNK_ELEMENTS = 1 << 25


def _check_qk(q, k) -> None:
    """q and k are floating-point `[B, N, heads, head_dim]` tensors of one shape on one device."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            "q and k must be [batch, tokens, heads, head_dim] tensors of one shape, got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}."
        )
    if q.device != k.device or not q.dtype.is_floating_point or not k.dtype.is_floating_point:
        raise ValueError(
            "q and k must be floating-point tensors on one device, got "
            f"q: {q.dtype} on {q.device}, k: {k.dtype} on {k.device}."
        )


def _check_fraction(name: str, value) -> float:
    """A number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {name}={value!r}.")
    return float(value)


def _scale(scale, q: torch.Tensor) -> float:
    if scale is None:
        return q.shape[-1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number or None, got scale={scale!r}.")
    return float(scale)


def _block_sums(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[B, H, ceil(N / block), D]` sums of each block of tokens of `[B, N, H, D]` x, and the float32
    count of real tokens per block. Whole blocks are summed in place (float32 accumulation, no float32 copy of
    x); only the last partial block is padded."""
    batch, n, heads, dim = x.shape
    whole = n // block
    if n == 0:  # no tokens: no blocks
        return x.new_zeros((batch, heads, 0, dim), dtype=torch.float32), x.new_zeros((0,), dtype=torch.float32)
    parts = []
    if whole:
        parts.append(x[:, :whole * block].reshape(batch, whole, block, heads, dim).sum(2, dtype=torch.float32))
    if n > whole * block:
        parts.append(x[:, whole * block:].sum(1, keepdim=True, dtype=torch.float32))
    sums = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    counts = (n - torch.arange(sums.shape[1], device=x.device) * block).clamp(max=block).to(torch.float32)
    return sums.transpose(1, 2), counts


def mean_pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 `[B, H, ceil(N / block), D]`: the mean of each block of tokens; the last block over its real ones."""
    sums, counts = _block_sums(x, block)
    return sums / counts[:, None]


def self_similarity(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 `[B, H, ceil(N / block)]`: the mean cosine similarity over all ordered pairs of tokens of each
    block (a token with itself included, so a one-token block scores 1): `|sum of unit vectors|^2 / n^2`,
    which needs no n x n product. A zero token counts as similar to nothing."""
    norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
    sums, counts = _block_sums(x / norms.to(x.dtype).clamp_min(torch.finfo(x.dtype).tiny), block)
    return sums.square().sum(-1) / counts.square()


def top_mass(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Per row of `probs` (`[..., nKV]`), the smallest set of entries whose sum reaches `p`, largest first, equal
    values lowest index first; zero entries are never kept. FG-Attn's top-p and SpargeAttn's TopCdf."""
    sorted_probs, index = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the entries kept ahead of each one
    # p = 1 keeps every nonzero entry: a float32 running sum can round to 1 before the smallest are reached
    keep = ((before < p) | (p >= 1.0)) & (sorted_probs > 0)
    return torch.zeros_like(keep).scatter(-1, index, keep)


def topp(
    q: torch.Tensor,
    k: torch.Tensor,
    q_block: int,
    kv_block: int,
    p: float,
    *,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """FG-Attn's top-p block mask (section 5.3): bool `[B, H, ceil(N / q_block), ceil(N / kv_block)]`.

    q and k (`[B, N, heads, head_dim]`, any device and float dtype) are mean-pooled over query and key blocks
    (a last partial block over its real tokens); `softmax(pooled_q @ pooled_k^T * scale)` over KV blocks
    (float32, `scale` defaults to `head_dim ** -0.5`) estimates how much of a query block's attention each key
    block holds. Each query block keeps the smallest set of key blocks, largest probability first, whose
    mass reaches `p`; equal probabilities are taken lowest key block first, so the mask is deterministic and
    a larger `p` keeps a superset. Blocks whose float32 probability is 0 are never kept, so `p = 1` keeps
    every block with nonzero probability (and the most probable block is always kept).
    """
    _check_qk(q, k)
    q_block = check_block("q_block", q_block, MIN_Q_BLOCK)
    kv_block = check_block("kv_block", kv_block)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"p must be a probability in (0, 1], got p={p!r}.")
    scores = torch.matmul(mean_pool(q, q_block), mean_pool(k, kv_block).transpose(-1, -2)) * _scale(scale, q)
    return top_mass(torch.softmax(scores, dim=-1), p)


def sparge(
    q: torch.Tensor,
    k: torch.Tensor,
    q_block: int,
    kv_block: int,
    *,
    cdf: float = 0.9,
    sim_threshold: float = 0.6,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """SpargeAttn's block mask (selective token compression and TopCdf, its section 3.2): bool
    `[B, H, ceil(N / q_block), ceil(N / kv_block)]`.

    A block can be compressed to its mean token when its tokens are alike: its `self_similarity` (mean
    cosine similarity of its tokens) is at least `sim_threshold` (the paper's theta). The compressed scores
    `pooled_q @ pooled_k^T * scale` (`scale` defaults to `head_dim ** -0.5`) go through a softmax over the
    key blocks that can be compressed (the others are left out of it), and each query block keeps, as
    `topp` does, the smallest set of those key blocks whose probability reaches `cdf` (the paper's tau).
    Blocks that cannot be compressed are never dropped: a dissimilar query block attends every key block and
    every query block attends a dissimilar key block (the paper's Eq. 5). The paper's TopCdf keeps the
    blocks whose cumulative sum stays within `cdf`; this keeps the smallest set that reaches it (the most
    probable block is always kept).
    """
    _check_qk(q, k)
    q_block = check_block("q_block", q_block, MIN_Q_BLOCK)
    kv_block = check_block("kv_block", kv_block)
    cdf = _check_fraction("cdf", cdf)
    if isinstance(sim_threshold, bool) or not isinstance(sim_threshold, (int, float)) \
            or not -1.0 <= sim_threshold <= 1.0:
        raise ValueError(f"sim_threshold must be a cosine similarity in [-1, 1], got sim_threshold={sim_threshold!r}.")
    q_alike = self_similarity(q, q_block) >= sim_threshold  # [B, H, nQ]
    k_alike = self_similarity(k, kv_block) >= sim_threshold  # [B, H, nKV]
    scores = torch.matmul(mean_pool(q, q_block), mean_pool(k, kv_block).transpose(-1, -2)) * _scale(scale, q)
    scores = scores.masked_fill(~k_alike[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no alike key block: a row of zeros, kept whole below
    return top_mass(probs, cdf) | ~q_alike[..., :, None] | ~k_alike[:, :, None, :]


def _check_keep(keep) -> float:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be a fraction of key blocks in (0, 1], got keep={keep!r}.")
    return float(keep)


def blocks_to_keep(keep: float, num_kv: int) -> int:
    """`ceil(keep * num_kv)` key blocks (at least 1), rounding off float noise (0.3 * 10 is 3, not 4)."""
    return min(num_kv, max(1, math.ceil(round(keep * num_kv, 9))))


def hierarchical(
    q: torch.Tensor,
    k: torch.Tensor,
    q_block: int,
    kv_block: int,
    *,
    keep: float,
    sub_block: int = 16,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """DFSAttn's hierarchical block scoring (its section 5.2, Eq. 11-12): bool
    `[B, H, ceil(N / q_block), ceil(N / kv_block)]` with `ceil(keep * ceil(N / kv_block))` key blocks (at
    least one) per query block.

    q and k are mean-pooled over sub-blocks of `sub_block` tokens (`min(sub_block, q_block)` on the query
    side and `min(sub_block, kv_block)` on the key side, so sub-blocks tile blocks);
    `softmax(pooled_q @ pooled_k^T * scale)` over all key sub-blocks (`scale` defaults to
    `head_dim ** -0.5`) is the sub-block attention, and a block pair's score is the sum of it over the pair's
    query and key sub-blocks. A block holding several kinds of tokens is thus scored by each kind instead
    of by their blurred mean. Each query block keeps its highest-scoring key blocks, equal scores lowest
    block first. The sub-block scores are computed for chunks of query blocks at a time (at most 128 MiB of
    float32 each).
    """
    _check_qk(q, k)
    q_block = check_block("q_block", q_block, MIN_Q_BLOCK)
    kv_block = check_block("kv_block", kv_block)
    keep = _check_keep(keep)
    sub_block = check_block("sub_block", sub_block)
    scale = _scale(scale, q)
    q_sub, kv_sub = min(sub_block, q_block), min(sub_block, kv_block)
    q_per, kv_per = q_block // q_sub, kv_block // kv_sub  # sub-blocks per block
    n = q.shape[1]
    num_q, num_kv = -(-n // q_block), -(-n // kv_block)
    pooled_q = mean_pool(q, q_sub)  # [B, H, nQs, D]
    pooled_k = mean_pool(k, kv_sub).transpose(-1, -2)  # [B, H, D, nKVs]
    batch, heads, num_q_sub, _ = pooled_q.shape
    num_kv_sub = pooled_k.shape[-1]
    if batch * heads * num_q_sub == 0:  # an empty batch, no heads or no tokens: an empty mask
        return torch.zeros((batch, heads, num_q, num_kv), dtype=torch.bool, device=q.device)
    per_chunk = max(1, _CHUNK_ELEMENTS // (batch * heads * q_per * num_kv_sub))  # query blocks per chunk
    scores = []
    for first in range(0, num_q, per_chunk):
        last = min(first + per_chunk, num_q)
        attn = torch.softmax(torch.matmul(pooled_q[:, :, first * q_per:last * q_per], pooled_k) * scale, -1)
        attn = torch.nn.functional.pad(attn, (0, num_kv * kv_per - num_kv_sub, 0, (last - first) * q_per
                                              - attn.shape[2]))  # padded sub-blocks score 0
        scores.append(attn.view(batch, heads, last - first, q_per, num_kv, kv_per).sum((3, 5)))
    scores = torch.cat(scores, 2) if len(scores) > 1 else scores[0]
    index = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :blocks_to_keep(keep, num_kv)]
    return torch.zeros(scores.shape, dtype=torch.bool, device=q.device).scatter(-1, index, True)
