"""The sparse kernels' lists built on the GPU by Triton kernels: the forward's union lists (kernels/sparse/work.py)
by two, each backward kernel's tile lists (kernels/sparse/backward.py) by one.

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

The backward's tile lists (kernels/sparse/backward.py, `TileList`) have the same cost built from torch ops
(flags per tile pair, then a per-row sort: 0.84 ms on an H100 for a `[1, 24, 256, 256]` mask, 9% of a
90%-sparse backward). `tile_list_kernel` builds one kernel's lists in one launch: one program per row of its
tile mask (a Q tile for the dQ kernel, a KV tile for the dK/dV kernel) of one mask item walks the row's columns
in chunks twice, reducing each tile pair's block pairs to its flags: the first pass counts the full pairs, the
second writes every listed column at its place (full ones first, then the partial ones, both ascending), the
places again cumulative sums within the chunk. The counts come out of the same program, so nothing is read
back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.devices import on_their_device

CHUNK = 512  # mask columns per step of a program: KV blocks (forward lists) or tiles (backward lists)
LOAD_BLOCKS = 4096  # mask bytes per load of the tile builder: a tile of 128 one-token KV blocks steps 32 columns
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


@on_their_device
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


@triton.jit
def _pair_flags(MASK, mask_item, row, cols, num_cols, num_q_blocks, num_kv_blocks, whole_kv_tiles,
                TQ: tl.constexpr, TK: tl.constexpr, QB: tl.constexpr, KVB: tl.constexpr, Q_SPAN: tl.constexpr,
                KV_SPAN: tl.constexpr, BY_KEYS: tl.constexpr):
    """(listed, full) of the tile pairs (`row`, `cols[n]`): listed when any of the pair's block pairs is
    attended, full when each of them whose query block exists is attended and no key of the KV tile lies at or
    past N.

    The pair spans `Q_SPAN` query blocks from the Q tile's first token's block and `KV_SPAN` KV blocks from the
    KV tile's (one block, repeated, for a tile smaller than a block): a loop over the query blocks, each a
    `[chunk, KV_SPAN]` load or-ed into two such accumulators, reduced along the KV blocks at the end. Blocks
    past the mask read as unattended: a query block past N holds no query, so it never makes a pair partial,
    and a KV block past N only occurs in a KV tile that reaches N, which is never full."""
    inside = cols < num_cols
    if BY_KEYS:
        q_tiles = cols
        kv_tiles = tl.zeros_like(cols) + row
    else:
        q_tiles = tl.zeros_like(cols) + row
        kv_tiles = cols
    kv = (kv_tiles * TK // KVB)[:, None] + tl.arange(0, KV_SPAN)[None, :]
    kv_ok = inside[:, None] & (kv < num_kv_blocks)
    first_q = q_tiles * TQ // QB
    attended = tl.zeros(kv.shape, dtype=tl.int1)
    holes = tl.zeros(kv.shape, dtype=tl.int1)
    for i in range(Q_SPAN):  # not unrolled: 16 unrolled loads of 4096 bytes made a 1.6 MB sm_90 kernel (10 s)
        q = first_q + i
        real = q < num_q_blocks
        offsets = (mask_item * num_q_blocks + q)[:, None] * num_kv_blocks + kv
        bits = tl.load(MASK + offsets, mask=real[:, None] & kv_ok, other=0) != 0
        attended |= bits
        holes |= real[:, None] & ~bits
    listed = tl.max(attended.to(tl.int32), axis=1) != 0
    return listed, listed & (tl.max(holes.to(tl.int32), axis=1) == 0) & (kv_tiles < whole_kv_tiles)


@triton.jit
def tile_list_kernel(MASK, COUNT, FULL, INDEX, num_cols, num_q_blocks, num_kv_blocks, whole_kv_tiles,
                     TQ: tl.constexpr, TK: tl.constexpr, QB: tl.constexpr, KVB: tl.constexpr,
                     Q_SPAN: tl.constexpr, KV_SPAN: tl.constexpr, BY_KEYS: tl.constexpr, CHUNK: tl.constexpr):
    """Per row of one mask item's tile mask (grid: rows, mask items): its listed columns at `INDEX[row]`, full
    ones first, each run ascending, their number at `COUNT[row]` and that of the full ones at `FULL[row]`.

    Two passes over the columns: the first counts the full pairs, which is where the partial ones start; the
    second writes each listed column at its place."""
    row = tl.program_id(0)
    mask_item = tl.program_id(1).to(tl.int64)
    at = mask_item * tl.num_programs(0) + row
    num_full = 0
    for start in range(0, num_cols, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        _, full = _pair_flags(MASK, mask_item, row, cols, num_cols, num_q_blocks, num_kv_blocks, whole_kv_tiles,
                              TQ, TK, QB, KVB, Q_SPAN, KV_SPAN, BY_KEYS)
        num_full += tl.sum(full.to(tl.int32))
    next_full = 0
    next_partial = num_full
    for start in range(0, num_cols, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        listed, full = _pair_flags(MASK, mask_item, row, cols, num_cols, num_q_blocks, num_kv_blocks,
                                   whole_kv_tiles, TQ, TK, QB, KVB, Q_SPAN, KV_SPAN, BY_KEYS)
        partial = listed & ~full
        full_i = full.to(tl.int32)
        partial_i = partial.to(tl.int32)
        place = tl.where(full, next_full + tl.cumsum(full_i, 0) - full_i,
                         next_partial + tl.cumsum(partial_i, 0) - partial_i)
        tl.store(INDEX + at * num_cols + place, cols, mask=listed)
        next_full += tl.sum(full_i)
        next_partial += tl.sum(partial_i)
    tl.store(COUNT + at, next_partial)
    tl.store(FULL + at, num_full)


@on_their_device
def build_tile_lists(mask: torch.Tensor, tile_q: int, tile_k: int, q_block: int, kv_block: int, seq_len: int,
                     by_keys: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(count, full, index)` of one backward kernel's tile lists, from the boolean block mask `[B|1, H|1, nQ,
    nKV]` by one launch on its device: rows are Q tiles of `tile_q` tokens and columns KV tiles of `tile_k`
    (the dQ kernel's), or the other way round when `by_keys` (the dK/dV kernel's).

    Per row, `count` listed pairs (int32 `[B|1, H|1, rows]`), the first `full` of them full, and `index` (int32
    `[B|1, H|1, rows, cols]`) the listed columns, full ones first, each run ascending; entries past `count` are
    left unwritten. Nothing is read back, so the host can queue it while the GPU runs earlier work."""
    mask_batch, mask_heads, num_q_blocks, num_kv_blocks = mask.shape
    q_tiles, kv_tiles = -(-seq_len // tile_q), -(-seq_len // tile_k)
    num_rows, num_cols = (kv_tiles, q_tiles) if by_keys else (q_tiles, kv_tiles)
    device = mask.device
    count = torch.empty(mask_batch, mask_heads, num_rows, dtype=torch.int32, device=device)
    full = torch.empty_like(count)
    index = torch.empty(mask_batch, mask_heads, num_rows, num_cols, dtype=torch.int32, device=device)
    kv_span = max(tile_k // kv_block, 1)
    chunk = min(CHUNK, triton.next_power_of_2(num_cols), LOAD_BLOCKS // kv_span)
    tile_list_kernel[(num_rows, mask_batch * mask_heads)](
        mask.contiguous().view(torch.uint8), count, full, index, num_cols, num_q_blocks, num_kv_blocks,
        seq_len // tile_k, TQ=tile_q, TK=tile_k, QB=q_block, KVB=kv_block, Q_SPAN=max(tile_q // q_block, 1),
        KV_SPAN=kv_span, BY_KEYS=by_keys, CHUNK=chunk)
    return count, full, index
