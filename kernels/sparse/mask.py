"""`SparseMask`: which blocks of queries attend which blocks of keys, as index tensors on the mask's device.

The one mask type every any-mask kernel speaks (shared/design/architecture.md): block-granular, per batch and
head, in FlexAttention's CSR layout (`kv_num_blocks`, `kv_indices`), so conversions to and from
`torch.nn.attention.flex_attention.BlockMask` are a copy of index tensors, and the simulator
(`natsim.merge`, numpy only) sees it through `to_numpy()`. Query i attends key j exactly when KV block
`j // kv_block` is listed in the row of Q block `i // q_block`. Index tensors are as wide as the busiest
Q block's list, never N x N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

MIN_BLOCK = 1
MAX_BLOCK = 128


def check_block(name: str, value, smallest: int = MIN_BLOCK) -> int:
    """A block size: a power-of-two int between `smallest` and 128 (what the sparse kernel runs)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {name}={value!r}.")
    value = int(value)
    if value < smallest or value > MAX_BLOCK or value & (value - 1):
        raise ValueError(f"{name} must be a power of two between {smallest} and {MAX_BLOCK}, got {name}={value}.")
    return value


def check_seq_len(seq_len) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int (tokens), got seq_len={seq_len!r}.")
    return int(seq_len)


def check_dense_mask(mask, num_q_blocks: int, num_kv_blocks: int, name: str = "mask") -> torch.Tensor:
    """A boolean `[B or 1, H or 1, num_q_blocks, num_kv_blocks]` tensor, or a sentence error."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a SparseMask, got {type(mask).__name__}.")
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a boolean tensor, got {name}.dtype={mask.dtype}.")
    if mask.dim() != 4 or tuple(mask.shape[2:]) != (num_q_blocks, num_kv_blocks):
        raise ValueError(
            f"{name} must be [batch or 1, heads or 1, ceil(N / q_block), ceil(N / kv_block)] = "
            f"[*, *, {num_q_blocks}, {num_kv_blocks}], got {name}.shape={tuple(mask.shape)}."
        )
    return mask


@dataclass(frozen=True)
class SparseMask:
    """A block mask per (batch, head): Q block q attends the KV blocks `kv_indices[b, h, q, :kv_num_blocks[b, h, q]]`.

    - `q_block`, `kv_block`: tokens per Q block and per KV block (powers of two up to 128).
    - `num_q_blocks`, `num_kv_blocks`: `ceil(seq_len / q_block)` and `ceil(seq_len / kv_block)`.
    - `seq_len`: N, the tokens of the sequence (the last blocks may be partial).
    - `kv_num_blocks`: int32 `[B or 1, H or 1, num_q_blocks]`, the KV blocks each Q block attends.
    - `kv_indices`: int32 `[B or 1, H or 1, num_q_blocks, max_kv]`, ascending per row; entries past a row's
      count carry no meaning. A leading dimension of 1 broadcasts over the batch or the heads.
    """

    q_block: int
    kv_block: int
    num_q_blocks: int
    num_kv_blocks: int
    seq_len: int
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor

    def __post_init__(self) -> None:
        check_block("q_block", self.q_block)
        check_block("kv_block", self.kv_block)
        check_seq_len(self.seq_len)
        expected = (-(-self.seq_len // self.q_block), -(-self.seq_len // self.kv_block))
        if (self.num_q_blocks, self.num_kv_blocks) != expected:
            raise ValueError(
                "num_q_blocks and num_kv_blocks must be ceil(seq_len / q_block) and ceil(seq_len / kv_block) = "
                f"{expected}, got num_q_blocks={self.num_q_blocks}, num_kv_blocks={self.num_kv_blocks}."
            )
        counts, indices = self.kv_num_blocks, self.kv_indices
        if counts.dtype != torch.int32 or indices.dtype != torch.int32:
            raise ValueError(
                "kv_num_blocks and kv_indices must be int32 tensors, got "
                f"kv_num_blocks.dtype={counts.dtype}, kv_indices.dtype={indices.dtype}."
            )
        if counts.dim() != 3 or indices.dim() != 4 or counts.shape != indices.shape[:3] \
                or counts.shape[2] != self.num_q_blocks:
            raise ValueError(
                f"kv_num_blocks must be [B or 1, H or 1, {self.num_q_blocks}] and kv_indices "
                f"[B or 1, H or 1, {self.num_q_blocks}, max_kv] with the same leading dimensions, got "
                f"kv_num_blocks.shape={tuple(counts.shape)}, kv_indices.shape={tuple(indices.shape)}."
            )
        if counts.device != indices.device:
            raise ValueError(
                "kv_num_blocks and kv_indices must be on one device, got "
                f"{counts.device} and {indices.device}."
            )

    # -- constructors -----------------------------------------------------------------------------------------

    @classmethod
    def from_dense(cls, mask: torch.Tensor, q_block: int, kv_block: int, seq_len: int) -> "SparseMask":
        """From a boolean `[B or 1, H or 1, ceil(seq_len / q_block), ceil(seq_len / kv_block)]` tensor."""
        q_block, kv_block = check_block("q_block", q_block), check_block("kv_block", kv_block)
        seq_len = check_seq_len(seq_len)
        num_q, num_kv = -(-seq_len // q_block), -(-seq_len // kv_block)
        mask = check_dense_mask(mask, num_q, num_kv)
        counts, indices = _dense_to_csr(mask)
        return cls(q_block, kv_block, num_q, num_kv, seq_len, counts, indices)

    @classmethod
    def from_block_mask(cls, block_mask, q_block: int, kv_block: int, seq_len: int,
                        device: Optional[torch.device] = None) -> "SparseMask":
        """From natsim's `BlockMask` (one head, e.g. `natsim.block_mask(problem, tiles)` over 1-D tiles in the
        kernel's token order): its partial and full lists together are the attended blocks, broadcast over
        batch and heads. The GNA kernel computes a partial block's window mask; this mask attends it whole."""
        from natsim import BlockMask

        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a natsim.BlockMask, got {type(block_mask).__name__}.")
        q_block, kv_block = check_block("q_block", q_block), check_block("kv_block", kv_block)
        seq_len = check_seq_len(seq_len)
        num_q, num_kv = -(-seq_len // q_block), -(-seq_len // kv_block)
        if (block_mask.num_q_tiles, block_mask.num_kv_tiles) != (num_q, num_kv):
            raise ValueError(
                f"block_mask must have ceil(seq_len / q_block) = {num_q} Q tiles and ceil(seq_len / kv_block) = "
                f"{num_kv} KV tiles, got num_q_tiles={block_mask.num_q_tiles}, "
                f"num_kv_tiles={block_mask.num_kv_tiles}."
            )
        dense = torch.from_numpy(block_mask.to_dense()).to(device)[None, None]
        return cls.from_dense(dense, q_block, kv_block, seq_len)

    @classmethod
    def from_flex(cls, block_mask, allow_mask_mod: bool = False) -> "SparseMask":
        """From FlexAttention's `BlockMask`: its partial and full blocks together are the attended blocks.

        A SparseMask is block-granular: a Flex mask whose partial blocks carry a `mask_mod` (anything but
        Flex's `noop_mask`) loses it, so that is refused unless `allow_mask_mod=True`. The sequence length is
        the mask's `seq_lengths` (Flex keeps one per Q and KV; they must be equal)."""
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask, noop_mask

        if not isinstance(block_mask, FlexBlockMask):
            raise TypeError(
                f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__}."
            )
        q_len, kv_len = block_mask.seq_lengths
        if q_len != kv_len:
            raise ValueError(f"the sparse kernel runs self attention: seq_lengths must be equal, got {(q_len, kv_len)}.")
        q_block, kv_block = block_mask.BLOCK_SIZE
        partial = block_mask.kv_num_blocks.sum() > 0
        if partial and block_mask.mask_mod is not noop_mask and not allow_mask_mod:
            raise ValueError(
                "block_mask has partial blocks with a mask_mod, which a block-granular SparseMask cannot keep; "
                "pass allow_mask_mod=True to attend those blocks whole."
            )
        num_q, num_kv = -(-q_len // q_block), -(-q_len // kv_block)
        dense = _csr_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, num_kv)[..., :num_q, :]
        if block_mask.full_kv_num_blocks is not None:
            dense |= _csr_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, num_kv)[..., :num_q, :]
        return cls.from_dense(dense, q_block, kv_block, q_len)

    # -- conversions ------------------------------------------------------------------------------------------

    def to_flex(self, mask_mod: Optional[Callable] = None):
        """FlexAttention's `BlockMask` of the same blocks, `BLOCK_SIZE=(q_block, kv_block)`.

        Without `mask_mod` every attended block is a full block (Flex runs it unmasked; keys past `seq_len` are
        Flex's own padding). With one, every attended block is partial and Flex applies `mask_mod` inside it.
        Flex's kernels tile by at least 16 (its Triton tiles must divide the block size on the GPU), so on the
        GPU `q_block` and `kv_block` of at least 16 are what `flex_attention` runs; smaller blocks convert,
        but Flex's compiled kernel rejects them."""
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

        counts = self.kv_num_blocks
        indices = torch.zeros((*counts.shape, self.num_kv_blocks), dtype=torch.int32, device=counts.device)
        width = min(self.kv_indices.shape[-1], self.num_kv_blocks)
        indices[..., :width] = self.kv_indices[..., :width]
        empty_counts, empty_indices = torch.zeros_like(counts), torch.zeros_like(indices)
        if mask_mod is None:
            args = (empty_counts, empty_indices, counts, indices)
        else:
            args = (counts, indices, empty_counts, empty_indices)
        return FlexBlockMask.from_kv_blocks(*args, BLOCK_SIZE=(self.q_block, self.kv_block), mask_mod=mask_mod,
                                            seq_lengths=(self.seq_len, self.seq_len))

    def to_dense(self) -> torch.Tensor:
        """A boolean `[B or 1, H or 1, num_q_blocks, num_kv_blocks]` tensor on the mask's device."""
        return _csr_to_dense(self.kv_num_blocks, self.kv_indices, self.num_kv_blocks)

    def to_numpy(self) -> np.ndarray:
        """A numpy boolean `[B or 1, H or 1, num_q_blocks, num_kv_blocks]` array: `to_numpy()[b, h]` is the 2-D
        mask `natsim.merge` and `natsim.BlockMask.from_dense` take (one head at a time)."""
        return self.to_dense().cpu().numpy()

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    @property
    def density(self) -> float:
        """Attended block pairs over all block pairs (over every batch and head the mask holds)."""
        return float(self.kv_num_blocks.sum()) / (self.kv_num_blocks.numel() * self.num_kv_blocks)


def _dense_to_csr(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and ascending indices (int32) per row of a boolean `[..., nQ, nKV]` tensor, rows as wide as the
    busiest one (at least 1)."""
    counts = mask.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    # A stable descending sort of the booleans puts each row's attended columns first, in ascending order.
    order = torch.sort(mask.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :width]
    valid = torch.arange(width, device=mask.device) < counts[..., None]
    return counts, torch.where(valid, order, 0).to(torch.int32)


def _csr_to_dense(counts: torch.Tensor, indices: torch.Tensor, num_kv: int) -> torch.Tensor:
    """The boolean `[..., nQ, num_kv]` tensor of a CSR block list (entries past a row's count ignored)."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
    dense = torch.zeros((*indices.shape[:-1], num_kv + 1), dtype=torch.bool, device=indices.device)
    valid &= (indices >= 0) & (indices < num_kv)
    dense.scatter_(-1, torch.where(valid, indices.long(), num_kv), True)  # invalid entries land in a spare column
    return dense[..., :num_kv]
