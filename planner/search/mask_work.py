"""What the sparse kernel would run for each candidate of a mask plan, counted on bit-packed rows.

`best_mask` scores each (query block, KV block, merge) by the features of the work that `prepare_sparse`
would make for it (planner.cost.sparse_features). Preparing that work per candidate builds the kernel's lists:
tens of milliseconds to seconds per candidate on a video layout's mask, and a plan scores forty. The features need
much less: per work item (a group of query blocks of one batch element and head), how many KV blocks the group
visits (the union of its members' rows) and how many of those every member attends and end before N (their
intersection over whole blocks). `PackedMask` packs the mask's rows into bits once, OR-pools them to every
granularity on the packed words (`or_pool`'s pooling), and counts unions and intersections per group with
`natsim.merging.merged_counts_many`, which groups exactly as `prepare_sparse` does (consecutively, or by
natsim.merge's XOR greedy), every candidate's masks at once on the machine's cores. The tests hold every count to
`prepare_sparse`'s.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from natsim.merging import merged_counts_many, pack_rows, row_counts

from ..cost.sparse_features import feature_row

# Morton compaction: after OR-ing each bit pair into its even bit, these (shift, mask) steps gather a word's 32
# even bits into its low half.
_EVEN_BITS = np.uint64(0x5555555555555555)
_COMPACT = tuple((np.uint64(shift), np.uint64(mask)) for shift, mask in (
    (1, 0x3333333333333333), (2, 0x0F0F0F0F0F0F0F0F), (4, 0x00FF00FF00FF00FF), (8, 0x0000FFFF0000FFFF),
    (16, 0x00000000FFFFFFFF)))


def halve_columns(bits: np.ndarray) -> np.ndarray:
    """Packed rows `[..., words]` with each pair of adjacent columns OR-ed into one: column j of the result is
    columns 2j and 2j + 1 (`ceil(words / 2)` words)."""
    if bits.shape[-1] % 2:
        bits = np.concatenate([bits, np.zeros((*bits.shape[:-1], 1), np.uint64)], axis=-1)
    x = (bits | (bits >> np.uint64(1))) & _EVEN_BITS
    for shift, mask in _COMPACT:
        x = (x | (x >> shift)) & mask
    return x[..., 0::2] | (x[..., 1::2] << np.uint64(32))


def halve_rows(bits: np.ndarray) -> np.ndarray:
    """Packed rows `[..., rows, words]` with each pair of adjacent rows OR-ed into one (a missing last row is
    empty)."""
    if bits.shape[-2] % 2:
        bits = np.concatenate([bits, np.zeros((*bits.shape[:-2], 1, bits.shape[-1]), np.uint64)], axis=-2)
    return bits[..., 0::2, :] | bits[..., 1::2, :]


def _column_bits(columns: np.ndarray, words: int) -> np.ndarray:
    """A boolean row of columns packed into `words` words (zeros past its end)."""
    packed = pack_rows(columns)
    return np.concatenate([packed, np.zeros(words - len(packed), np.uint64)])


class PackedMask:
    """A boolean block mask `[B|1, H|1, nQ, nKV]` at `q_block` x `kv_block` tokens on N = `seq_len`, packed once
    and pooled on demand to coarser blocks (each pooling kept: coarser ones start from the finer)."""

    def __init__(self, dense: torch.Tensor, q_block: int, kv_block: int, seq_len: int):
        self.batch, self.heads, self.num_q, self.num_kv = dense.shape
        self.q_block, self.kv_block, self.seq_len = q_block, kv_block, seq_len
        self.device = dense.device
        rows = dense.detach().to("cpu").contiguous().numpy().reshape(-1, self.num_q, self.num_kv)
        self._pooled = {(1, 1): pack_rows(rows)}
        self._works: dict[tuple, tuple[np.ndarray, np.ndarray, float]] = {}

    def pooled(self, q_factor: int, kv_factor: int) -> np.ndarray:
        """The packed rows `[B * H, ceil(nQ / q_factor), words]` of the mask OR-pooled by `q_factor` x
        `kv_factor` blocks (powers of two)."""
        key = (q_factor, kv_factor)
        if key not in self._pooled:
            if q_factor > 1:
                self._pooled[key] = halve_rows(self.pooled(q_factor // 2, kv_factor))
            else:
                self._pooled[key] = halve_columns(self.pooled(1, kv_factor // 2))
        return self._pooled[key]

    def _counts(self, q_block: int, kv_block: int) -> tuple[int, int, np.ndarray]:
        """(query blocks, KV blocks, packed rows) at `q_block` x `kv_block` tokens."""
        bits = self.pooled(q_block // self.q_block, kv_block // self.kv_block)
        return -(-self.seq_len // q_block), -(-self.seq_len // kv_block), bits

    def density(self, q_block: int, kv_block: int) -> float:
        """`token_density` of the mask pooled to `q_block` x `kv_block`: the share of (query, key) token pairs it
        attends, averaged over its batch and heads, the last partial blocks counting their real tokens."""
        num_q, num_kv, bits = self._counts(q_block, kv_block)
        last = num_kv - 1
        last_bit = ((bits[..., last // 64] >> np.uint64(last % 64)) & np.uint64(1)).astype(np.int64)
        keys = kv_block * row_counts(bits) - (kv_block * num_kv - self.seq_len) * last_bit  # [B * H, nQ]
        queries = np.full(num_q, q_block, np.int64)
        queries[-1] = self.seq_len - q_block * (num_q - 1)
        pairs = (keys @ queries).astype(np.float64)  # exact: at most N^2 per mask
        return float(torch.from_numpy(pairs).mean()) / (self.seq_len * self.seq_len)

    def work(self, q_block: int, kv_block: int, group: int, method: str) -> tuple[np.ndarray, np.ndarray, float]:
        """`(visited, full, seconds)` of the mask at `q_block` x `kv_block` with query blocks grouped `group` at a
        time by `method` ("consecutive" or "xor"), as `prepare_sparse` groups them: per work item `[B * H,
        groups]` the KV blocks its group visits and those every member attends that end before N (`whole`),
        and the seconds the grouping and counting took on one core (kept from `count` when it was asked first)."""
        key = (q_block, kv_block, group, method)
        if key not in self._works:
            self.count([key])
        return self._works[key]

    def count(self, keys: list[tuple[int, int, int, str]]) -> None:
        """Group and count every `(q_block, kv_block, group, method)` of `keys` at once, their masks spread over
        the cores (`natsim.merging.merged_counts_many`), and keep the results for `work`."""
        requests = []
        for q_block, kv_block, group, method in keys:
            _, num_kv, bits = self._counts(q_block, kv_block)
            whole = _column_bits(np.arange(num_kv) < self.seq_len // kv_block, bits.shape[-1])
            requests.append((bits, bits & whole, group, method))
        self._works.update(zip(keys, merged_counts_many(requests)))

    def features(self, q_block: int, kv_block: int, group: int, method: str, *, block_m: int, block_n: int,
                 batch: int, heads: int, head_dim: int) -> tuple[np.ndarray, float]:
        """`(feature row, grouping seconds)` of one sparse-kernel call on `[batch, N, heads, head_dim]` tensors
        with the mask at `q_block` x `kv_block`, grouped as `work` says, on `block_m` x `block_n` program tiles."""
        visited, full, seconds = self.work(q_block, kv_block, group, method)
        per_tile = block_n // kv_block
        full_tiles = full // per_tile
        masked = (visited - full_tiles * per_tile + per_tile - 1) // per_tile
        copies = (batch // self.batch) * (heads // self.heads)
        row = feature_row(int(full_tiles.sum()), int(masked.sum()), visited.size, block_m=block_m, block_n=block_n,
                          kv_block=kv_block, copies=copies, head_dim=head_dim)
        return row, seconds

    def mask(self, q_block: int, kv_block: int) -> torch.Tensor:
        """The boolean mask pooled to `q_block` x `kv_block` (`or_pool`'s), on the mask's device."""
        num_q, num_kv, bits = self._counts(q_block, kv_block)
        octets = bits.astype("<u8", copy=False).view(np.uint8)  # bytes in column order
        columns = np.unpackbits(octets, axis=-1, count=num_kv, bitorder="little").astype(bool)
        return torch.from_numpy(columns.reshape(self.batch, self.heads, num_q, num_kv)).to(self.device)
