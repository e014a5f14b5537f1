"""What the sparse kernel would run for each candidate of a mask plan, counted on bit-packed rows.

`best_mask` scores each (query block, KV block, merge) by the features of the work that `prepare_sparse`
would make for it (planner.cost.sparse_features). Preparing that work per candidate builds the kernel's lists:
tens of milliseconds to seconds per candidate on a video layout's mask, and a plan scores forty. The features need
much less: per work item (a group of query blocks of one batch element and head), how many KV blocks the group
visits (the union of its members' rows) and how many of those every member attends and end before N (their
intersection over whole blocks). `PackedMask` packs the mask's rows into bits once (where the mask lives: a CUDA
mask sends only its packed words to the host), OR-pools them to every granularity on the packed words (`or_pool`'s
pooling), and counts unions and intersections per group with `natsim.merging.merged_counts_many`, which groups
exactly as `prepare_sparse` does (consecutively, or by natsim.merge's XOR greedy), every candidate's masks at once
on the machine's cores. What several candidates share is computed once per granularity and kept: the pooled rows,
their whole-block columns, their per-row counts (the density). The tests hold every count to `prepare_sparse`'s.
"""

from __future__ import annotations

from typing import Iterable

import numba
import numpy as np
import torch

from natsim.merging import map_on_cores, merged_counts_many, pack_rows, row_counts

from ..cost.sparse_features import feature_row
from ..plans.mask import or_pool

_JOB_WORDS = 1 << 16  # the fewest packed words of the finest mask that one job of `prepare` pools

# Morton compaction: after OR-ing each bit pair into its even bit, steps of shift 1, 2, 4, 8, 16 under these masks
# gather a word's 32 even bits into its low half.
_EVEN_BITS = np.uint64(0x5555555555555555)
_M1, _M2, _M4, _M8, _M16 = (np.uint64(mask) for mask in (
    0x3333333333333333, 0x0F0F0F0F0F0F0F0F, 0x00FF00FF00FF00FF, 0x0000FFFF0000FFFF, 0x00000000FFFFFFFF))


@numba.njit(cache=True, nogil=True)
def _halve_words(bits, out):
    """`halve_columns` of 2-D packed rows `[rows, words]` into `out` `[rows, ceil(words / 2)]`, a word at a time."""
    rows, words = bits.shape
    for r in range(out.shape[0]):  # element by element: array assignments compile numba's broadcasting
        for w in range(out.shape[1]):
            out[r, w] = 0
    for r in range(rows):
        for w in range(words):
            x = (bits[r, w] | (bits[r, w] >> np.uint64(1))) & _EVEN_BITS
            x = (x | (x >> np.uint64(1))) & _M1
            x = (x | (x >> np.uint64(2))) & _M2
            x = (x | (x >> np.uint64(4))) & _M4
            x = (x | (x >> np.uint64(8))) & _M8
            x = (x | (x >> np.uint64(16))) & _M16
            out[r, w // 2] |= x << np.uint64(32 * (w % 2))


@numba.njit(cache=True, nogil=True)
def _halve_row_pairs(bits, out):
    """`halve_rows` of 2-D packed rows `[rows, words]` into `out` `[ceil(rows / 2), words]`."""
    rows, words = bits.shape
    for r in range(rows // 2):
        for w in range(words):
            out[r, w] = bits[2 * r, w] | bits[2 * r + 1, w]
    if rows % 2:
        for w in range(words):
            out[rows // 2, w] = bits[rows - 1, w]


def halve_columns(bits: np.ndarray) -> np.ndarray:
    """Packed rows `[..., words]` with each pair of adjacent columns OR-ed into one: column j of the result is
    columns 2j and 2j + 1 (`ceil(words / 2)` words)."""
    words = bits.shape[-1]
    flat = np.ascontiguousarray(bits, dtype=np.uint64).reshape(-1, words)
    out = np.empty((len(flat), (words + 1) // 2), np.uint64)
    _halve_words(flat, out)
    return out.reshape(*bits.shape[:-1], (words + 1) // 2)


def halve_rows(bits: np.ndarray) -> np.ndarray:
    """Packed rows `[..., rows, words]` with each pair of adjacent rows OR-ed into one (a missing last row is
    empty)."""
    rows, words = bits.shape[-2:]
    flat = np.ascontiguousarray(bits, dtype=np.uint64).reshape(-1, rows, words)
    out = np.empty((len(flat), (rows + 1) // 2, words), np.uint64)
    for source, target in zip(flat, out):
        _halve_row_pairs(source, target)
    return out.reshape(*bits.shape[:-2], (rows + 1) // 2, words)


def _parent(key: tuple[int, int]) -> tuple[int, int]:
    """The pooling `(q_factor, kv_factor)` that `key` halves: rows are halved from (q / 2, kv), columns only at
    q = 1 (from (1, kv / 2)), so columns are compacted on the fewest words."""
    q_factor, kv_factor = key
    return (q_factor // 2, kv_factor) if q_factor > 1 else (1, kv_factor // 2)


def pack_rows_torch(mask: torch.Tensor) -> torch.Tensor:
    """`natsim.merging.pack_rows` in torch ops on the mask's device: boolean rows `[..., columns]` packed into int64
    words `[..., ceil(columns / 64)]` holding the same bits (bit k of word w is column 64 w + k, zeros past the
    end). A CUDA mask is packed there, so that an eighth of its bytes crosses to the host."""
    columns = mask.shape[-1]
    words = -(-columns // 64)
    padded = torch.zeros((*mask.shape[:-1], words * 64), dtype=torch.uint8, device=mask.device)
    padded[..., :columns] = mask
    weights = torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8, device=mask.device)
    octets = (padded.view(*mask.shape[:-1], words * 8, 8) * weights).sum(-1, dtype=torch.uint8)  # bits: no carry
    return octets.view(torch.int64)  # little-endian, as pack_rows' "<u8" words


def _column_bits(columns: np.ndarray, words: int) -> np.ndarray:
    """A boolean row of columns packed into `words` words (zeros past its end)."""
    packed = pack_rows(columns)
    return np.concatenate([packed, np.zeros(words - len(packed), np.uint64)])


class PackedMask:
    """A boolean block mask `[B|1, H|1, nQ, nKV]` at `q_block` x `kv_block` tokens on N = `seq_len`, packed once
    and pooled to coarser blocks, on demand or all at once (`prepare`); each pooling is kept, and coarser ones
    start from the finer."""

    def __init__(self, dense: torch.Tensor, q_block: int, kv_block: int, seq_len: int):
        self.batch, self.heads, self.num_q, self.num_kv = dense.shape
        self.q_block, self.kv_block, self.seq_len = q_block, kv_block, seq_len
        self.device = dense.device
        self._dense = dense.detach()
        rows = self._dense.reshape(-1, self.num_q, self.num_kv)
        if rows.device.type == "cpu":
            packed = pack_rows(rows.contiguous().numpy())
        else:
            packed = pack_rows_torch(rows).cpu().numpy().view(np.uint64)
        self._pooled = {(1, 1): packed}
        self._whole_rows: dict[tuple[int, int], np.ndarray] = {}
        self._row_counts: dict[tuple[int, int], np.ndarray] = {}
        self._densities: dict[tuple[int, int], float] = {}
        self._works: dict[tuple, tuple[np.ndarray, np.ndarray, float]] = {}

    def pooled(self, q_factor: int, kv_factor: int) -> np.ndarray:
        """The packed rows `[B * H, ceil(nQ / q_factor), words]` of the mask OR-pooled by `q_factor` x
        `kv_factor` blocks (powers of two)."""
        key = (q_factor, kv_factor)
        if key not in self._pooled:
            halve = halve_rows if q_factor > 1 else halve_columns
            self._pooled[key] = halve(self.pooled(*_parent(key)))
        return self._pooled[key]

    def prepare(self, granularities: Iterable[tuple[int, int]]) -> None:
        """Pool the mask to every `(q_block, kv_block)` of `granularities` (and the poolings they start from) and
        count its rows there, the masks spread over the cores (`natsim.merging.map_on_cores`), so that `pooled`,
        `row_counts` and `density` find them kept: the same arrays as pooling on demand, made at once."""
        wanted = [self._factors(q_block, kv_block) for q_block, kv_block in granularities]
        keys = set()
        for key in wanted:
            while key not in self._pooled and key not in keys:
                keys.add(key)
                key = _parent(key)
        order = sorted(keys)  # a parent sorts before what it is halved into
        pooled = dict(self._pooled)
        for key in order:
            masks, rows, words = pooled[_parent(key)].shape
            shape = (masks, (rows + 1) // 2, words) if key[0] > 1 else (masks, rows, (words + 1) // 2)
            pooled[key] = np.empty(shape, np.uint64)
        counts = {key: np.empty(pooled[key].shape[:2], np.int64) for key in set(wanted) - set(self._row_counts)}

        def some_masks(masks: range) -> None:
            for m in masks:
                for key in order:
                    (_halve_row_pairs if key[0] > 1 else _halve_words)(pooled[_parent(key)][m], pooled[key][m])
                for key, out in counts.items():
                    out[m] = row_counts(pooled[key][m])

        masks, rows, words = pooled[1, 1].shape
        per_job = -(-_JOB_WORDS // (rows * words))  # small masks share a job: a job costs the threads microseconds
        map_on_cores(some_masks, [range(m, min(m + per_job, masks)) for m in range(0, masks, per_job)])
        self._pooled = pooled
        self._row_counts.update(counts)

    def _factors(self, q_block: int, kv_block: int) -> tuple[int, int]:
        return q_block // self.q_block, kv_block // self.kv_block

    def _whole(self, q_block: int, kv_block: int) -> np.ndarray:
        """The pooled rows at `q_block` x `kv_block` with only their KV blocks that end before N: the rows
        themselves when N is a multiple of `kv_block` (kept per granularity)."""
        key = self._factors(q_block, kv_block)
        if key not in self._whole_rows:
            bits = self.pooled(*key)
            num_kv = -(-self.seq_len // kv_block)
            if self.seq_len % kv_block:
                bits = bits & _column_bits(np.arange(num_kv) < self.seq_len // kv_block, bits.shape[-1])
            self._whole_rows[key] = bits
        return self._whole_rows[key]

    def row_counts(self, q_block: int, kv_block: int) -> np.ndarray:
        """KV blocks per query block of the mask at `q_block` x `kv_block`, int64 `[B * H, nQ]` (kept)."""
        key = self._factors(q_block, kv_block)
        if key not in self._row_counts:
            self._row_counts[key] = row_counts(self.pooled(*key))
        return self._row_counts[key]

    def density(self, q_block: int, kv_block: int) -> float:
        """`token_density` of the mask pooled to `q_block` x `kv_block`: the share of (query, key) token pairs it
        attends, averaged over its batch and heads, the last partial blocks counting their real tokens (kept)."""
        key = self._factors(q_block, kv_block)
        if key not in self._densities:
            num_q, num_kv = -(-self.seq_len // q_block), -(-self.seq_len // kv_block)
            bits = self.pooled(*key)
            last = num_kv - 1
            last_bit = ((bits[..., last // 64] >> np.uint64(last % 64)) & np.uint64(1)).astype(np.int64)
            keys = kv_block * self.row_counts(q_block, kv_block) - (kv_block * num_kv - self.seq_len) * last_bit
            queries = np.full(num_q, q_block, np.int64)
            queries[-1] = self.seq_len - q_block * (num_q - 1)
            pairs = (keys @ queries).astype(np.float64)  # exact: at most N^2 per mask
            self._densities[key] = float(torch.from_numpy(pairs).mean()) / (self.seq_len * self.seq_len)
        return self._densities[key]

    def work(self, q_block: int, kv_block: int, group: int, method: str) -> tuple[np.ndarray, np.ndarray, float]:
        """`(visited, full, seconds)` of the mask at `q_block` x `kv_block` with query blocks grouped `group` at a
        time by `method` ("consecutive" or "xor"), as `prepare_sparse` groups them: per work item `[B * H,
        groups]` the KV blocks its group visits and those every member attends that end before N (`whole`),
        and the seconds the grouping and counting took on one core (0 for group 1, which is the row counts; kept
        from `count` when it was asked first)."""
        key = (q_block, kv_block, group, method)
        if key not in self._works:
            self.count([key])
        return self._works[key]

    def count(self, keys: list[tuple[int, int, int, str]]) -> None:
        """Group and count every `(q_block, kv_block, group, method)` of `keys` at once, their masks spread over
        the cores (`natsim.merging.merged_counts_many`), and keep the results for `work`. Ungrouped candidates
        (group 1) are the per-row counts, which the density keeps too."""
        requests, asked = [], []
        for key in keys:
            q_block, kv_block, group, method = key
            bits, whole = self.pooled(*self._factors(q_block, kv_block)), self._whole(q_block, kv_block)
            if group == 1:
                counts = self.row_counts(q_block, kv_block)
                self._works[key] = (counts, counts if whole is bits else row_counts(whole), 0.0)  # bits: N not cut
            else:
                requests.append((bits, whole, group, method))
                asked.append(key)
        self._works.update(zip(asked, merged_counts_many(requests)))

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
        """The boolean mask pooled to `q_block` x `kv_block` (`or_pool`'s), on the mask's device: unpacked from the
        packed rows on the CPU, pooled where it lives elsewhere (nothing crosses back from the host)."""
        if self.device.type != "cpu":
            return or_pool(self._dense, *self._factors(q_block, kv_block))
        num_q, num_kv = -(-self.seq_len // q_block), -(-self.seq_len // kv_block)
        bits = self.pooled(*self._factors(q_block, kv_block))
        octets = bits.astype("<u8", copy=False).view(np.uint8)  # bytes in column order
        columns = np.unpackbits(octets, axis=-1, count=num_kv, bitorder="little").view(bool)  # bytes 0 or 1
        return torch.from_numpy(columns.reshape(self.batch, self.heads, num_q, num_kv))
