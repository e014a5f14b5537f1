"""The forward kernel's union lists (kernels/sparse/work.py) built on the GPU by two Triton kernels.

A boolean mask used once per call (the usual training and compiled case) pays its preparation on every call;
built from torch ops that is some 25 small launches, about 1.5 ms on an H100 whatever the mask's size, a third
of a 90%-sparse call at 32K tokens. Here one program per work item (a group of query blocks of one (batch,
head)) walks the mask's KV blocks in chunks:

1. `count_kernel`: the members' bits of each KV block (bit m: member m attends it), and per item the length of
   the union and how many of its blocks are full (every real member attends them, wholly before N).
2. The offsets are a cumulative sum of the lengths (one torch op), and the total sizes the lists: one host
   read (none for work used by one call, whose lists are sized for every pair when that is small).
3. `fill_kernel`: the same bits again, each union block written at its place: full blocks first, then the
   partial ones, both in ascending order, with its member bits.

The result is bit for bit the torch builder's (`work._lists`), which CPU tensors run (tests compare the two in
the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 512  # KV blocks per step of a program
UNREAD_ENTRIES = 2**24  # list entries (64 MB a list) up to which work for one call is sized without a read-back


@triton.jit
def _member_bits(MASK, MEMBERS, item, mask_item, kv, num_q_blocks, num_kv_blocks, R: tl.constexpr):
    """Per KV block `kv` (a chunk): bit m set when member m of `item` (a query block, -1 for none) attends it,
    and the bits of the real members."""
    bits = tl.zeros(kv.shape, dtype=tl.int32)
    all_bits = 0
    inside = kv < num_kv_blocks
    for m in tl.static_range(R):
        row = tl.load(MEMBERS + item * R + m)
        real = row >= 0
        safe = tl.where(real, row, 0).to(tl.int64)
        attended = tl.load(MASK + (mask_item * num_q_blocks + safe) * num_kv_blocks + kv, mask=inside, other=0)
        bits |= ((attended != 0) & real).to(tl.int32) << m
        all_bits |= real.to(tl.int32) << m
    return bits, all_bits


@triton.jit
def count_kernel(MASK, MEMBERS, LENGTHS, FULL, num_q_blocks, num_kv_blocks, whole_blocks, groups,
                 R: tl.constexpr, CHUNK: tl.constexpr):
    """Per work item: the KV blocks of its union (`LENGTHS`) and how many of them are full (`FULL`)."""
    item = tl.program_id(0)
    mask_item = item // groups
    length = 0
    full = 0
    for start in range(0, num_kv_blocks, CHUNK):
        kv = start + tl.arange(0, CHUNK)
        bits, all_bits = _member_bits(MASK, MEMBERS, item, mask_item, kv, num_q_blocks, num_kv_blocks, R)
        union = bits != 0
        length += tl.sum(union.to(tl.int32))
        full += tl.sum(((bits == all_bits) & union & (kv < whole_blocks)).to(tl.int32))
    tl.store(LENGTHS + item, length)
    tl.store(FULL + item, full)


@triton.jit
def fill_kernel(MASK, MEMBERS, OFFSETS, FULL, LIST, BITS, num_q_blocks, num_kv_blocks, whole_blocks, groups,
                R: tl.constexpr, CHUNK: tl.constexpr):
    """Per work item: its union's KV blocks at `LIST[OFFSETS[item]:]`, full ones first, each run ascending, and
    their member bits at the same places of `BITS`."""
    item = tl.program_id(0)
    mask_item = item // groups
    next_full = tl.load(OFFSETS + item)
    next_partial = next_full + tl.load(FULL + item)
    for start in range(0, num_kv_blocks, CHUNK):
        kv = start + tl.arange(0, CHUNK)
        bits, all_bits = _member_bits(MASK, MEMBERS, item, mask_item, kv, num_q_blocks, num_kv_blocks, R)
        union = bits != 0
        full = (bits == all_bits) & union & (kv < whole_blocks)
        partial = union & ~full
        full_i = full.to(tl.int32)
        partial_i = partial.to(tl.int32)
        place = tl.where(full, next_full + tl.cumsum(full_i, 0) - full_i,
                         next_partial + tl.cumsum(partial_i, 0) - partial_i)
        tl.store(LIST + place, kv, mask=union)
        tl.store(BITS + place, bits, mask=union)
        next_full += tl.sum(full_i)
        next_partial += tl.sum(partial_i)


def build_lists(dense: torch.Tensor, members: torch.Tensor, seq_len: int, kv_block: int, per_tile: int,
                exact: bool = True):
    """`(offsets, full_tiles, kv_list, member_bits)` of `work._lists`, from the boolean mask `[B|1, H|1, nQ,
    nKV]` and the groups' members `[B|1, H|1, groups, R]` (-1 where a group is short), by the two kernels.

    `exact=False` (work for one call) sizes the lists for every (group, KV block) pair when that stays under
    `UNREAD_ENTRIES`, so that nothing is read back: the host does not wait for the GPU, which is still running
    the previous layers; entries past the total carry no meaning."""
    mask_batch, mask_heads, groups, group = members.shape
    num_q_blocks, num_kv_blocks = dense.shape[2], dense.shape[3]
    items = mask_batch * mask_heads * groups
    device = dense.device
    mask_bytes = dense.contiguous().view(torch.uint8)
    members = members.reshape(items, group).to(torch.int32).contiguous()
    lengths = torch.empty(items, dtype=torch.int32, device=device)
    full = torch.empty(items, dtype=torch.int32, device=device)
    shared = dict(num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks, whole_blocks=seq_len // kv_block,
                  groups=groups, R=group, CHUNK=min(CHUNK, triton.next_power_of_2(num_kv_blocks)))
    count_kernel[(items,)](mask_bytes, members, lengths, full, **shared)
    offsets = torch.empty(items + 1, dtype=torch.int32, device=device)
    offsets[:1] = 0
    if not exact and items * num_kv_blocks <= UNREAD_ENTRIES:  # int32 sums cannot overflow below 2**31
        torch.cumsum(lengths, 0, dtype=torch.int32, out=offsets[1:])
        kv_list = torch.empty(items * num_kv_blocks, dtype=torch.int32, device=device)
        member_bits = torch.empty_like(kv_list)
    else:
        total = lengths.sum(dtype=torch.int64).item()
        if total >= 2**31:
            raise ValueError(f"the mask visits {total} (query group, KV block) pairs, more than the int32 lists hold.")
        torch.cumsum(lengths, 0, dtype=torch.int32, out=offsets[1:])
        kv_list = torch.zeros(max(total, 1), dtype=torch.int32, device=device)
        member_bits = torch.zeros_like(kv_list)
    fill_kernel[(items,)](mask_bytes, members, offsets, full, kv_list, member_bits, **shared)
    return offsets, (full // per_tile).contiguous(), kv_list, member_bits
