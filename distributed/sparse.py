"""Attention under any block mask on tokens sharded over a process group (Ulysses in groups of heads,
pipeline.py): head-parallel attention composes with any per-head block mask, so each rank runs its heads of the
mask over the whole sequence. Where the ranks do not divide the heads, Ulysses pads them with zero heads
(natsim.partition.heads_per_rank), which take the last head's mask: their outputs are not placed back, so any
mask would do, and a real one keeps every row of the kernel's lists well formed."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Union

import torch

from natsim.kernels import SparseMask, autocast_inputs, constant_of_the_graph, constants_when_compiled
from natsim.kernels import sparse_attention as single_gpu_sparse_attention
from natsim.partition import heads_per_rank

from .collectives import resolve_split, world
from .pipeline import heads_of, register_attend, ulysses_attention


def _check_blocks(mask, q_block: Optional[int], kv_block: Optional[int], tokens: int) -> None:
    """A block mask tensor's block counts against the whole sequence's `tokens` (the single-GPU call checks a rank's
    cut of it, whose shape the caller never gave)."""
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and isinstance(q_block, int)
            and isinstance(kv_block, int) and q_block > 0 and kv_block > 0):
        return  # a SparseMask, or arguments the single-GPU call refuses with its own sentence
    blocks = (-(-tokens // q_block), -(-tokens // kv_block))
    if tuple(mask.shape[2:]) != blocks:
        raise ValueError(f"mask must be [batch or 1, heads or 1, ceil(N / q_block), ceil(N / kv_block)] = [*, *, "
                         f"{blocks[0]}, {blocks[1]}] for the N = {tokens} tokens of all ranks, got "
                         f"mask.shape={tuple(mask.shape)}.")


def _mask_heads(mask, heads: int, lo: int, hi: int):
    """Heads `[lo, hi)` of a per-head block mask (a tensor or SparseMask) of `heads` heads; heads from `heads` on
    (Ulysses' zero heads) take the last head's mask. A mask of one head broadcasts."""
    if isinstance(mask, SparseMask):
        count = mask.kv_num_blocks.shape[1]
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        count = mask.shape[1]
    else:
        raise ValueError("mask must be a [B or 1, heads or 1, num_q_blocks, num_kv_blocks] boolean block mask or a "
                         f"SparseMask, got {tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}.")
    if count not in (1, heads):
        raise ValueError(f"mask must have 1 or heads={heads} heads (its dimension 1), got {count}.")
    if count == 1:
        return mask
    index = None if hi <= heads else torch.tensor([min(head, heads - 1) for head in range(lo, hi)])

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[:, lo:hi] if index is None else t.index_select(1, index.to(t.device))

    if isinstance(mask, SparseMask):
        return replace(mask, kv_num_blocks=pick(mask.kv_num_blocks), kv_indices=pick(mask.kv_indices))
    return pick(mask)


@constant_of_the_graph
def _attend(blocks: Optional[tuple[int, int, int, int, int]], q_block: Optional[int], kv_block: Optional[int],
            merge: Optional[str], schedule: Optional[str]) -> int:
    """The id of the single-GPU call under a block mask as Ulysses' attention (pipeline.py), registered once per
    distinct arguments; the mask travels as the call's tensors (`extras`: a boolean mask, or a SparseMask's counts
    and indices with its sizes `blocks`), cut to each group's heads. Host work torch.compile runs while tracing,
    its result a constant of the graph."""

    def attend(q, k, v, extras, scale, span):
        parts = [heads_of(t, span) for t in extras]
        mask = parts[0] if blocks is None else SparseMask(*blocks, *parts)
        return single_gpu_sparse_attention(q, k, v, mask, q_block, kv_block, merge=merge, scale=scale,
                                           schedule=schedule)

    return register_attend(attend, key=("sparse", blocks, q_block, kv_block, merge, schedule))


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Union[torch.Tensor, SparseMask],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    *,
    group=None,
    split: Optional[Sequence[int]] = None,
    merge: Optional[str] = None,
    scale: Optional[float] = None,
    schedule: Optional[str] = None,
    chunks: Optional[int] = None,
) -> torch.Tensor:
    """`natsim.kernels.sparse_attention` on `[B, N_r, heads, head_dim]` tokens sharded over `group` (Ulysses).

    `mask` is the whole sequence's block mask (`[B or 1, heads or 1, nQ, nKV]` booleans or a `SparseMask`), the same
    on every rank; each rank runs its `ceil(heads / P)` heads of it (zero heads pad what P does not divide), in
    `chunks` groups (natsim.partition.head_groups: by default up to three of two heads or more) whose transfers
    overlap another group's attention (pipeline.py). Returns this rank's output tokens. Differentiable with respect
    to q, k and v as the single-GPU call is: its backward on this rank's heads, group by group between the transfers
    mirrored. Every rank must make the same call, with the same `requires_grad`.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a [batch, tokens, heads, head_dim] tensor, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
    q, k, v = autocast_inputs(q, k, v)  # as natsim.kernels does: the inputs in an autocast region's dtype
    q_block, kv_block, split, chunks = constants_when_compiled(q_block, kv_block, split, chunks)
    size, rank = world(group)
    split = resolve_split(q, split, group)
    _check_blocks(mask, q_block, kv_block, sum(split))
    (heads,) = constants_when_compiled(q.shape[-2])  # a value under a dynamic-shape trace too
    h = heads_per_rank(heads, size)
    mask = _mask_heads(mask, heads, rank * h, (rank + 1) * h)
    if isinstance(mask, SparseMask):
        blocks = (mask.q_block, mask.kv_block, mask.num_q_blocks, mask.num_kv_blocks, mask.seq_len)
        extras = (mask.kv_num_blocks, mask.kv_indices)
    else:
        blocks, extras = None, (mask,)
    return ulysses_attention(_attend(blocks, q_block, kv_block, merge, schedule), q, k, v, split, rank, group,
                             extras=extras, scale=scale, chunks=chunks)
