"""The sparse kernel's host work for one block mask: query groups (merging), union lists and member bits.

`prepare_sparse` turns a boolean block mask (or a `SparseMask`) into a `SparseWork`, what the forward kernel
reads (kernels/sparse/forward.py says how) and the backward kernels' tile lists (kernels/sparse/backward.py);
torch ops on the mask's device, but for the XOR grouping, which runs `natsim.merge` on the CPU. A `SparseWork`
is reusable across calls on that mask, as FlexAttention's BlockMask is: `sparse_attention` takes it in eager
calls, under autograd, torch.compile and CUDA graphs. Its two variable-length lists are marked dynamic for
torch.compile, so that masks of one size but different densities share a compiled graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional, Union

import numpy as np
import torch

from natsim import merge as natsim_merge

from ..common.backend import interpreting
from ..fa4.lists import Fa4Lists, lists_from_blocks
from ..fa4.rules import device_refusal, tile_refusal
from ..common.checks import check_backend
from ..common.spec import concrete
from .backward import BackwardTiles, TileList, backward_tiles, tile_lists
from .lists import build_lists
from .mask import SparseMask, check_block, check_dense_mask

MERGES = (None, "consecutive", "xor")
MIN_Q_BLOCK = 8  # members are bits of an int32 per list entry: at most 16 of them in a 128-query program
MIN_DOT = 16  # tl.dot's smallest M


@dataclass(frozen=True)
class SparseWork:
    """What the kernel reads for one mask, block sizes and grouping; reusable across calls on that mask.

    Work items are the groups of every (batch, head) of the mask (`mask_batch` x `mask_heads` x `groups`, a
    mask of batch or heads 1 broadcasts). Per item: `members` int32 `[items, R]`, its query blocks (-1 where the
    last group is short); its list `kv_list[offsets[i]:offsets[i + 1]]` (int32), the union of the members' KV
    blocks, those every member attends and that end before N first (`full_tiles[i]` whole tiles of them run
    unmasked); `member_bits` per list entry, bit m set when member m attends the block. Every index tensor is
    sized by the visited blocks. `mask`: the boolean block mask itself (the element mask of partial tiles);
    `tiles`, `dkdv_lists`, `dq_lists`: the backward kernels' tiles and lists (None in work prepared without
    them, for inference). `merge_seconds`: time of the
    grouping (natsim.merge on the CPU for "xor", including the mask's copy there); `prepare_seconds`: the whole
    preparation. `fa4`: FlashAttention-4's lists of the mask (kernels/fa4/lists.py) where the work runs on it
    (`prepare_sparse(..., backend=...)`), else None; `requested`: the backend `prepare_sparse` was asked for
    (None: natsim chose).
    """

    q_block: int
    kv_block: int
    block_m: int
    block_n: int
    seq_len: int
    merge: Optional[str]
    mask_batch: int
    mask_heads: int
    groups: int
    members: torch.Tensor
    offsets: torch.Tensor
    full_tiles: torch.Tensor
    kv_list: torch.Tensor
    member_bits: torch.Tensor
    mask: torch.Tensor
    tiles: BackwardTiles
    dkdv_lists: Optional[TileList]
    dq_lists: Optional[TileList]
    merge_seconds: float
    prepare_seconds: float
    fa4: Optional[Fa4Lists] = None
    requested: Optional[str] = None

    @property
    def backend(self) -> str:
        """The backend the work runs on: "fa4" (FlashAttention-4's lists) or "triton"."""
        return "triton" if self.fa4 is None else "fa4"

    @property
    def group(self) -> int:
        """R, query blocks per program."""
        return self.block_m // self.q_block

    @property
    def lengths(self) -> torch.Tensor:
        """int32 `[mask_batch, mask_heads, groups]`: KV blocks each work item visits (its union)."""
        return (self.offsets[1:] - self.offsets[:-1]).view(self.mask_batch, self.mask_heads, self.groups)

    def order(self, batch: int, heads: int) -> torch.Tensor:
        """Work items `(b * heads + h) * groups + g` of a `[batch, heads]` call, longest list first (LPT)."""
        lengths = self.lengths.expand(batch, heads, self.groups).reshape(-1)
        return torch.sort(lengths, descending=True, stable=True).indices.to(torch.int32)


def default_blocks(q_block: int, kv_block: int, merge: Optional[str], device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 128 x 128 on the GPU (64 x 32 in the interpreter, for tiny test shapes), never
    below the mask's blocks. Without merging a program holds one query block (at least tl.dot's 16 rows), and
    a tile one KV block of 64 tokens: a 128-key tile of two such blocks runs masked whenever they differ (H100,
    random 64 x 64 masks at 70% sparsity: 9.2 ms against 13.3; benchmarks/results/sparse-backward-tune3-*)."""
    small = interpreting() and device.type == "cpu"
    block_m = max(q_block, MIN_DOT) if merge is None else max(q_block, 64 if small else 128)
    block_n = kv_block if merge is None and kv_block == 64 and not small else max(kv_block, 32 if small else 128)
    return block_m, block_n


def prepare_sparse(
    mask: Union[torch.Tensor, SparseMask],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    seq_len: Optional[int] = None,
    *,
    merge: Optional[str] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    device: Optional[torch.device] = None,
    backward: bool = True,
    backend: Optional[str] = None,
) -> SparseWork:
    """The kernel's work for `mask` (a boolean `[B|1, H|1, nQ, nKV]` tensor with `q_block`, `kv_block` and
    `seq_len`, or a SparseMask), grouped by `merge`, on `device` (the mask's by default). Pass it as the mask
    of `sparse_attention` to reuse it across calls; `block_m` / `block_n` override `default_blocks`.
    `backward=False` leaves out the backward kernels' lists (work for inference only).

    `backend`: "triton" (natsim's kernels), "fa4" (FlashAttention-4: its lists are built too; no merge, blocks
    it runs, kernels/backends/fa4.py), or None: FlashAttention-4 where it is installed and runs the mask's blocks
    unmerged (with `backward`, its backward too), natsim's kernels otherwise. Work on FlashAttention-4 keeps
    natsim's own lists as well, for calls FlashAttention-4 does not take (CPU tensors, and with natsim's choice
    of backend, the PV skip, FP8 or a head dim whose blocks it does not run)."""
    check_backend(backend)
    start = time.perf_counter()
    work = _prepare(mask, q_block, kv_block, seq_len, merge, block_m, block_n, device, backward, exact=True)
    lists = _fa4_lists(work, backend, backward)
    if lists is not None or backend is not None:
        work = replace(work, fa4=lists, requested=backend)
    if work.mask.is_cuda:
        torch.cuda.synchronize(work.mask.device)
    return replace(work, prepare_seconds=time.perf_counter() - start)


def fa4_refusal(q_block: int, kv_block: int, merge: Optional[str], device: torch.device, head_dim: int = 128,
                backward: bool = False) -> Optional[str]:
    """None when FlashAttention-4 runs a mask of these blocks on `device` (at `head_dim`; with `backward`, its
    gradients too), else why not (a sentence)."""
    if merge is not None:
        return f"FlashAttention-4 runs a block mask unmerged (each query block its own row), got merge={merge!r}."
    return device_refusal(device) or tile_refusal(q_block, kv_block, head_dim, backward)


def _fa4_lists(work: "SparseWork", backend: Optional[str], backward: bool) -> Optional[Fa4Lists]:
    """FlashAttention-4's lists of the work's mask, where `backend` asks for them or natsim chooses it."""
    if backend == "triton":
        return None
    refusal = fa4_refusal(work.q_block, work.kv_block, work.merge, work.mask.device, backward=backward)
    if refusal is not None:
        if backend == "fa4":
            raise ValueError(f"prepare_sparse(..., backend='fa4') cannot run this mask: {refusal}")
        return None
    return lists_from_blocks(work.mask, work.mask, work.q_block, work.kv_block)


def prepare_for_call(mask: torch.Tensor, q_block: int, kv_block: int, seq_len: int, merge: Optional[str],
                     device: torch.device) -> SparseWork:
    """Forward work for one call on a boolean mask: no backward lists, and on the GPU nothing read back where
    the lists are small enough to size for every pair (kernels/sparse/lists.py), so the host queues the call
    without waiting for the GPU."""
    return _prepare(mask, q_block, kv_block, seq_len, merge, None, None, device, backward=False, exact=False)


def _prepare(mask, q_block, kv_block, seq_len, merge, block_m, block_n, device, backward: bool,
             exact: bool) -> SparseWork:
    """`prepare_sparse`'s work; `exact=False` lets the GPU builder size its lists without a read-back."""
    dense, q_block, kv_block, seq_len = dense_mask(mask, q_block, kv_block, seq_len)
    if merge not in MERGES:
        raise ValueError(f"merge must be None, 'consecutive' or 'xor', got merge={merge!r}.")
    device = dense.device if device is None else torch.device(device)
    dense = dense.to(device)
    default_m, default_n = default_blocks(q_block, kv_block, merge, device)
    block_m = _check_tile("block_m", default_m if block_m is None else block_m, q_block, "q_block")
    block_n = _check_tile("block_n", default_n if block_n is None else block_n, kv_block, "kv_block")
    group = block_m // q_block
    if group > 32 // 2:
        raise ValueError(
            f"a program holds at most 16 query blocks, got block_m={block_m} and q_block={q_block} "
            f"({group} blocks); use q_block >= {block_m // 16}."
        )
    merge_start = time.perf_counter()
    members = _members(dense, group, merge)
    merge_seconds = time.perf_counter() - merge_start
    if dense.is_cuda:  # one Triton pass on the GPU, torch ops elsewhere
        lists = build_lists(dense, members, seq_len, kv_block, block_n // kv_block, exact)
    else:
        lists = _lists(dense, members, seq_len, kv_block, block_n // kv_block)
    offsets, full_tiles, kv_list, member_bits = lists
    for variable in (kv_list, member_bits):  # their length is the mask's visited blocks
        torch._dynamo.maybe_mark_dynamic(variable, 0)
    dense = dense.contiguous()
    tiles = backward_tiles(q_block, kv_block, device)
    dkdv_lists, dq_lists = tile_lists(dense, tiles, q_block, kv_block, seq_len) if backward else (None, None)
    return SparseWork(q_block, kv_block, block_m, block_n, seq_len, merge, dense.shape[0], dense.shape[1],
                      members.shape[2], members.reshape(-1, group).to(torch.int32).contiguous(), offsets, full_tiles,
                      kv_list, member_bits, dense, tiles, dkdv_lists, dq_lists, merge_seconds, 0.0)


def _check_tile(name: str, value: int, block: int, block_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (16, 32, 64, 128) or value < block:
        raise ValueError(
            f"{name} must be 16, 32, 64 or 128 and at least {block_name}={block}, got {name}={value!r}."
        )
    return value


def dense_mask(mask, q_block, kv_block, seq_len) -> tuple[torch.Tensor, int, int, int]:
    """The boolean block mask, its blocks and N, from a SparseMask or a tensor with its blocks (checked)."""
    if isinstance(mask, SparseMask):
        for name, given, own in (("q_block", q_block, mask.q_block), ("kv_block", kv_block, mask.kv_block),
                                 ("seq_len", seq_len, mask.seq_len)):
            if given is not None and given != own:
                raise ValueError(f"{name} must match the SparseMask's {name}={own}, got {name}={given}.")
        return mask.to_dense(), mask.q_block, mask.kv_block, mask.seq_len
    if q_block is None or kv_block is None:
        raise ValueError(
            "q_block and kv_block must be given with a boolean mask tensor (tokens per mask row and column), "
            f"got q_block={q_block}, kv_block={kv_block}."
        )
    q_block = check_block("q_block", q_block, MIN_Q_BLOCK)
    kv_block = check_block("kv_block", kv_block)
    if seq_len is None:
        raise ValueError("seq_len must be given with a boolean mask tensor, got seq_len=None.")
    num_q, num_kv = -(-seq_len // q_block), -(-seq_len // kv_block)
    return check_dense_mask(mask, num_q, num_kv), q_block, kv_block, seq_len


def _members(dense: torch.Tensor, group: int, merge: Optional[str]) -> torch.Tensor:
    """int64 `[B|1, H|1, groups, group]`: the query blocks of each group (-1 where the last is short)."""
    mask_batch, mask_heads, num_q, _ = dense.shape
    num_groups = -(-num_q // group)
    if merge == "xor" and group > 1:
        masks = dense.cpu().numpy()
        groups = np.stack([np.stack([natsim_merge(masks[b, h], group, "xor").groups for h in range(mask_heads)])
                           for b in range(mask_batch)])
        return torch.from_numpy(groups).to(dense.device)
    blocks = torch.arange(num_groups * group, device=dense.device)
    blocks = torch.where(blocks < num_q, blocks, -1).view(1, 1, num_groups, group)
    return blocks.expand(mask_batch, mask_heads, num_groups, group)


def _lists(dense: torch.Tensor, members: torch.Tensor, seq_len: int, kv_block: int, per_tile: int):
    """Per work item, the union of its members' KV blocks as one flat CSR list (full-for-the-group blocks
    first), the whole tiles of full blocks, and each entry's member bits. Torch ops on the mask's device; the
    largest temporary is one int32 per (group, KV block)."""
    mask_batch, mask_heads, num_groups, group = members.shape
    num_kv = dense.shape[-1]
    bits = torch.zeros((mask_batch, mask_heads, num_groups, num_kv), dtype=torch.int32, device=dense.device)
    all_bits = torch.zeros((mask_batch, mask_heads, num_groups), dtype=torch.int32, device=dense.device)
    for m in range(group):
        index = members[..., m]
        real = index >= 0
        rows = torch.gather(dense, 2, index.clamp(min=0)[..., None].expand(-1, -1, -1, num_kv)) & real[..., None]
        bits |= rows.to(torch.int32) << m
        all_bits |= real.to(torch.int32) << m
    union = bits != 0
    whole = torch.arange(num_kv, device=dense.device) < seq_len // kv_block  # no key at or past N
    full = (bits == all_bits[..., None]) & whole
    partial = union & ~full
    num_full = full.sum(-1, dtype=torch.int32)
    lengths = union.sum(-1, dtype=torch.int32).reshape(-1)
    position = torch.where(full, full.cumsum(-1, dtype=torch.int32) - 1,
                           num_full[..., None] + partial.cumsum(-1, dtype=torch.int32) - 1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=dense.device)
    offsets[1:] = lengths.cumsum(0)
    total = int(offsets[-1])
    if total >= 2**31:
        raise ValueError(f"the mask visits {total} (query group, KV block) pairs, more than the int32 lists hold.")
    flat = (offsets[:-1].view(mask_batch, mask_heads, num_groups, 1) + position)[union]
    kv_list = torch.zeros(max(total, 1), dtype=torch.int32, device=dense.device)
    member_bits = torch.zeros(max(total, 1), dtype=torch.int32, device=dense.device)
    blocks = torch.arange(num_kv, dtype=torch.int32, device=dense.device).expand_as(bits)
    kv_list[flat] = blocks[union]
    member_bits[flat] = bits[union]
    return offsets.to(torch.int32), (num_full // per_tile).reshape(-1).contiguous(), kv_list, member_bits


def work_tensors(work: SparseWork) -> list[torch.Tensor]:
    """A `SparseWork`'s tensors in the order `work_from` reads them: how it crosses an operator's schema."""
    tensors = [work.members, work.offsets, work.full_tiles, work.kv_list, work.member_bits, work.mask]
    if work.dkdv_lists is not None:
        tensors += [work.dkdv_lists.count, work.dkdv_lists.full, work.dkdv_lists.index,
                    work.dq_lists.count, work.dq_lists.full, work.dq_lists.index]
    return tensors


def work_sizes(work: SparseWork) -> list[int]:
    """A `SparseWork`'s sizes in the order `work_from` reads them."""
    t = work.tiles
    return [work.q_block, work.kv_block, work.block_m, work.block_n, work.seq_len, work.groups,
            t.dkdv_queries, t.dkdv_keys, t.dq_queries, t.dq_keys]


def work_from(tensors: list[torch.Tensor], sizes: list[int]) -> SparseWork:
    """The `SparseWork` of `work_tensors` and `work_sizes` (its merge name and timings are not carried). Sizes an
    operator's backward gets symbolic under a compile with dynamic shapes are made constants: a work's blocks and
    lengths are fixed."""
    members, offsets, full_tiles, kv_list, member_bits, mask, *lists = tensors
    q_block, kv_block, block_m, block_n, seq_len, groups, *tiles = concrete(list(sizes))
    dkdv_lists, dq_lists = (TileList(*lists[:3]), TileList(*lists[3:])) if lists else (None, None)
    return SparseWork(q_block, kv_block, block_m, block_n, seq_len, None, mask.shape[0], mask.shape[1], groups,
                      members, offsets, full_tiles, kv_list, member_bits, mask, BackwardTiles(*tiles), dkdv_lists,
                      dq_lists, 0.0, 0.0)
