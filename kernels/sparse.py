"""Sparse attention for any block mask (FG-Attn, sections 4-5 and appendix B): the Triton forward kernel, the
host work that feeds it, its public front end and a torch reference.

Semantics: query i attends key j exactly when `mask[b, h, i // q_block, j // kv_block]`; a query that attends
no key gets output 0 and LSE -inf. N need not be a multiple of either block.

How one program works (one *work item*: a group of query blocks of one (batch, head)):
- Query merging. A program holds BLOCK_M queries: `R = BLOCK_M // q_block` query blocks (the members), chosen
  by `merge`: consecutive blocks, or natsim's XOR greedy (`natsim.merge`, FG-Attn section 5.2). The members'
  rows are gathered from q with pointer loads and the outputs scattered back, so any grouping runs.
- Fine-grained KV (FG-Attn's gather-load). The program walks one list: the UNION of its members' KV blocks,
  packed `P = BLOCK_N // kv_block` blocks per tile of BLOCK_N keys. Each tile's key rows are gathered with
  pointer loads from the listed block indices; `tl.range` pipelines them (the index loads a stage ahead) with
  the matrix products. With `kv_block == BLOCK_N` on Hopper a tile is one block, read through a rank-2 tensor
  descriptor instead.
- Two loops, as in kernels/gna.py. The list starts with the blocks that every member attends and that lie
  wholly before N ("full for the group"): their whole tiles run with no mask code, because every row of a
  real member attends every key there, and the rows of no member (padding) are never stored. The rest of
  the list (partial blocks, and the few full ones that do not fill a whole tile) runs under the element
  mask: each list entry carries a bit per member (does member m attend this block?), and row r keeps
  column c when bit `r // q_block` of c's entry is set and key c < N. The output of a row therefore
  depends on its own block's row of the mask only, never on the grouping.
- Scheduling. `"grid"`: one program per work item. `"lpt"`: a persistent kernel of about one program per SM
  slot; programs take work items from a queue (one atomic counter) sorted longest-first by list length
  (longest-processing-time first, FG-Attn appendix B).
- PV skip (`pv_threshold`, SpargeAttn's second stage, its section 3.4): per tile, a member whose real rows all
  have their tile maximum more than `-pv_threshold` below their running maximum leaves the tile's P @ V out
  of its accumulator (the running sum still counts the tile); a tile every member skips runs no P @ V.
  `kernels/pvskip.py` is the torch reference of the rule, walking the same tiles.
- DEBUG (a constexpr, compiled out otherwise): each work item records the KV blocks it loaded and the (query
  block, KV block) pairs it computed (loaded blocks times its members), the figures `natsim.merge` predicts
  (`MergeResult.merged.visited` and `visited * group_sizes`), and the attended (query block, KV block) pairs
  of the mask whose P @ V the PV skip left out.

The online softmax is GNA's (`_softmax_step`, base 2, fp32 accumulators, the running maximum in scaled units).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import ops
from .backend import autocast_inputs, interpreting, runs_eagerly, use_triton
from .checks import KERNEL_DTYPES, check_tensors
from .gna import LOG2E, _softmax_step
from .gna_launch import _install_allocator, aligned, descriptor_strides_ok, has_tensor_descriptors, launch_config
from .sparsemask import SparseMask, check_block, check_dense_mask

MERGES = (None, "consecutive", "xor")
SCHEDULES = ("grid", "lpt")
SPARSE_HEAD_DIMS = (32, 64, 128)
MIN_Q_BLOCK = 8  # members are bits of an int32 per list entry: at most 16 of them in a 128-query program
MIN_DOT = 16  # tl.dot's smallest M


# -- the kernel ---------------------------------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(K, V, k_desc, v_desc, LIST, e0, end, slots, within, seq_len, stride_kn, stride_vn, dims,
                  KVB: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """K and V `[BLOCK_N, head_dim]` of the tile whose list entries start at `e0` (column c holds key
    `within[c]` of the block at entry `e0 + slots[c]`), each column's entry, and whether the column is a real
    key (entry before `end`, key before N). Unmasked tiles are whole and before N; masked ones read zeros
    elsewhere."""
    e = e0 + slots
    ok = e < end
    if USE_TMA:  # one block per tile: a rank-2 descriptor read, rows past N read as zeros
        blk = tl.load(LIST + e0, mask=e0 < end, other=0)
        k = k_desc.load([blk * BLOCK_N, 0])
        v = v_desc.load([blk * BLOCK_N, 0])
        ok &= blk * BLOCK_N + within < seq_len
    elif MASKED:
        key = tl.load(LIST + e, mask=ok, other=0) * KVB + within
        ok &= key < seq_len
        key = key.to(tl.int64)
        k = tl.load(K + key[:, None] * stride_kn + dims[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + key[:, None] * stride_vn + dims[None, :], mask=ok[:, None], other=0.0)
    else:
        key = (tl.load(LIST + e) * KVB + within).to(tl.int64)
        k = tl.load(K + key[:, None] * stride_kn + dims[None, :])
        v = tl.load(V + key[:, None] * stride_vn + dims[None, :])
    return k, v, e, ok


@triton.jit
def _skipping_step(acc, l_i, m_i, qk, v, qk_scale, pv_lambda, row_ok,
                   QB: tl.constexpr, BLOCK_M: tl.constexpr):
    """`_softmax_step` with SpargeAttn's PV skip (its section 3.4, Algorithm 1 line 15): the scores `qk` still
    update the running maximum and sum of every row, but a query block (a member: `QB` consecutive rows) whose
    real rows all have their tile maximum below their running maximum by more than `pv_lambda` (scaled base-2
    units, negative) adds nothing to its accumulator; when every member skips, P @ V is not computed at all.
    Returns the new state and which rows skipped."""
    R: tl.constexpr = BLOCK_M // QB
    m_local = tl.max(qk, 1) * qk_scale
    m_new = tl.maximum(m_i, m_local)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    gap = tl.where(row_ok, m_local - m_new, float("-inf"))
    skip = tl.max(tl.reshape(gap, [R, QB]), 1) < pv_lambda  # per member
    skip_row = tl.reshape(tl.broadcast_to(skip[:, None], [R, QB]), [BLOCK_M])
    if tl.sum(tl.where(skip_row, 0, 1)) > 0:
        acc = tl.dot(tl.where(skip_row[:, None], 0.0, p).to(v.dtype), v, acc)
    return acc, l_i, m_new, skip_row


@triton.jit
def _attend_item(
    w, Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
    heads, groups, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr, DEBUG: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, PV_SKIP: tl.constexpr,
):
    """Attention of work item `w` = (batch * heads + head) * groups + group: its members' query rows against
    the union of their KV blocks (module docstring)."""
    R: tl.constexpr = BLOCK_M // QB
    P: tl.constexpr = BLOCK_N // KVB
    bh = w // groups
    g = w % groups
    b = bh // heads
    h = bh % heads
    item = ((b * mask_b_step) * mask_heads + h * mask_h_step) * groups + g  # its lists (masks broadcast)
    b = b.to(tl.int64)
    h = h.to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    member = rows // QB
    q_blk = tl.load(MEMBERS + item * R + member)  # -1 where the group is short
    token = q_blk * QB + rows % QB
    row_ok = (q_blk >= 0) & (token < seq_len)
    token = token.to(tl.int64)
    q = tl.load(Q + b * stride_qb + h * stride_qh + token[:, None] * stride_qn + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    cols = tl.arange(0, BLOCK_N)
    slots = cols // KVB
    within = cols % KVB
    K_bh = K + b * stride_kb + h * stride_kh
    V_bh = V + b * stride_vb + h * stride_vh
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(K_bh, shape=[seq_len, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V_bh, shape=[seq_len, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
    else:
        k_desc = K  # unused: loads go through pointers
        v_desc = V
    start = tl.load(OFFSETS + item)
    end = tl.load(OFFSETS + item + 1)
    full_tiles = tl.load(FULL_TILES + item)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    loaded = full_tiles * 0  # DEBUG: KV blocks loaded
    skipped = full_tiles * 0  # DEBUG: attended (query block, KV block) pairs whose P @ V the PV skip left out
    leader = (q_blk >= 0) & (rows % QB == 0)  # one row per real member

    # Loop 1: whole tiles of blocks every member attends, wholly before N: no mask code.
    for t in tl.range(0, full_tiles, warp_specialize=WARP_SPECIALIZE):
        k, v, e, ok = _load_kv_tile(K_bh, V_bh, k_desc, v_desc, LIST, start + t * P, end, slots, within,
                                    seq_len, stride_kn, stride_vn, dims, KVB, BLOCK_N, False, USE_TMA)
        qk = tl.dot(q, k.T)
        if PV_SKIP:
            acc, l_i, m_i, skip_row = _skipping_step(acc, l_i, m_i, qk, v, qk_scale, pv_lambda, row_ok, QB,
                                                     BLOCK_M)
            if DEBUG:
                skipped += tl.sum(tl.where(leader & skip_row, 1, 0)) * P
        else:
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale)
        if DEBUG:
            loaded += P

    # Loop 2: the rest of the list, under the element mask (own block's bit, key < N, entry < end).
    e_masked = start + full_tiles * P
    for t in tl.range(0, tl.cdiv(end - e_masked, P)):
        e0 = e_masked + t * P
        k, v, e, ok = _load_kv_tile(K_bh, V_bh, k_desc, v_desc, LIST, e0, end, slots, within, seq_len,
                                    stride_kn, stride_vn, dims, KVB, BLOCK_N, True, USE_TMA)
        bits = tl.load(BITS + e, mask=e < end, other=0)
        keep = (((bits[None, :] >> member[:, None]) & 1) != 0) & ok[None, :]
        qk = tl.dot(q, k.T)
        qk = tl.where(keep, qk, float("-inf"))
        if PV_SKIP:
            acc, l_i, m_i, skip_row = _skipping_step(acc, l_i, m_i, qk, v, qk_scale, pv_lambda, row_ok, QB,
                                                     BLOCK_M)
            if DEBUG:  # the entries of the tile each skipping member attends
                attended = (((bits[None, :] >> member[:, None]) & 1) != 0) & (e < end)[None, :] \
                    & (within == 0)[None, :]
                skipped += tl.sum(tl.where(leader & skip_row, tl.sum(attended.to(tl.int32), 1), 0))
        else:
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale)
        if DEBUG:
            loaded += tl.minimum(end - e0, P)

    # A row that attends no key (its block's row is empty) gets zeros and LSE -inf, not 0 / 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    tl.store(O + b * stride_ob + h * stride_oh + token[:, None] * stride_on + dims[None, :], out,
             mask=row_ok[:, None])
    if WRITE_LSE:  # [B, N, heads]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        tl.store(LSE + (b * seq_len + token) * heads + h, lse, mask=row_ok)
    if DEBUG:  # per work item: KV blocks loaded, (query block, KV block) pairs computed and PV-skipped
        real_members = tl.sum(tl.where(leader, 1, 0))
        tl.store(COUNTS + 3 * w, loaded)
        tl.store(COUNTS + 3 * w + 1, loaded * real_members)
        tl.store(COUNTS + 3 * w + 2, skipped)


@triton.jit
def sparse_forward_kernel(
    Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS, ORDER, QUEUE,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
    heads, groups, num_items, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr, DEBUG: tl.constexpr, USE_TMA: tl.constexpr,
    PERSISTENT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False, PV_SKIP: tl.constexpr = False,
):
    """Grid: one program per work item, grid (groups, batch * heads). Persistent: programs take work items
    from `ORDER` (longest first) through the atomic counter `QUEUE` until none is left."""
    if PERSISTENT:
        i = tl.atomic_add(QUEUE, 1)
        while i < num_items:
            w = tl.load(ORDER + i)
            _attend_item(w, Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS,
                         stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                         stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
                         heads, groups, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
                         QB, KVB, BLOCK_M, BLOCK_N, HEAD_DIM, WRITE_LSE, DEBUG, USE_TMA, WARP_SPECIALIZE,
                         PV_SKIP)
            i = tl.atomic_add(QUEUE, 1)
    else:
        w = tl.program_id(1) * groups + tl.program_id(0)
        _attend_item(w, Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS,
                     stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                     stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
                     heads, groups, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
                     QB, KVB, BLOCK_M, BLOCK_N, HEAD_DIM, WRITE_LSE, DEBUG, USE_TMA, WARP_SPECIALIZE, PV_SKIP)


# -- the host work: groups, union lists, member bits ----------------------------------------------------------


@dataclass(frozen=True)
class SparseWork:
    """What the kernel reads for one mask, block sizes and grouping; reusable across calls on that mask.

    Work items are the groups of every (batch, head) of the mask (`mask_batch` x `mask_heads` x `groups`, a
    mask of batch or heads 1 broadcasts). Per item: `members` int32 `[items, R]`, its query blocks (-1 where the
    last group is short); its list `kv_list[offsets[i]:offsets[i + 1]]` (int32), the union of the members' KV
    blocks, those every member attends and that end before N first (`full_tiles[i]` whole tiles of them run
    unmasked); `member_bits` per list entry, bit m set when member m attends the block. Every index tensor is
    sized by the visited blocks. `merge_seconds`: time of the grouping (natsim.merge on the CPU for "xor",
    including the mask's copy there); `prepare_seconds`: the whole preparation.
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
    merge_seconds: float
    prepare_seconds: float

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
    below the mask's blocks. Without merging a program holds one query block (at least tl.dot's 16 rows)."""
    small = interpreting() and device.type == "cpu"
    block_m = max(q_block, MIN_DOT) if merge is None else max(q_block, 64 if small else 128)
    block_n = max(kv_block, 32 if small else 128)
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
) -> SparseWork:
    """The kernel's work for `mask` (a boolean `[B|1, H|1, nQ, nKV]` tensor with `q_block`, `kv_block` and
    `seq_len`, or a SparseMask), grouped by `merge`, on `device` (the mask's by default). Pass it as the mask
    of `sparse_attention` to reuse it across calls; `block_m` / `block_n` override `default_blocks`."""
    start = time.perf_counter()
    dense, q_block, kv_block, seq_len = _dense_mask(mask, q_block, kv_block, seq_len)
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
    offsets, full_tiles, kv_list, member_bits = _lists(dense, members, seq_len, kv_block, block_n // kv_block)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return SparseWork(q_block, kv_block, block_m, block_n, seq_len, merge, dense.shape[0], dense.shape[1],
                      members.shape[2], members.reshape(-1, group).to(torch.int32).contiguous(), offsets, full_tiles,
                      kv_list, member_bits, merge_seconds, time.perf_counter() - start)


def _check_tile(name: str, value: int, block: int, block_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (16, 32, 64, 128) or value < block:
        raise ValueError(
            f"{name} must be 16, 32, 64 or 128 and at least {block_name}={block}, got {name}={value!r}."
        )
    return value


def _dense_mask(mask, q_block, kv_block, seq_len) -> tuple[torch.Tensor, int, int, int]:
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
        from natsim import merge as natsim_merge

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


# -- launch --------------------------------------------------------------------------------------------------------


def check_sparse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v are matching `[B, N, heads, head_dim]` tensors."""
    check_tensors(q, k, v)
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, tokens, heads, head_dim], got q.shape={tuple(q.shape)}.")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k and v must have the same shape, got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}."
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            "q, k and v must share dtype and device, got "
            f"dtypes ({q.dtype}, {k.dtype}, {v.dtype}), devices ({q.device}, {k.device}, {v.device})."
        )
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k and v must be floating-point tensors, got dtype={q.dtype}.")


def check_pv_threshold(pv_threshold) -> Optional[float]:
    """None (no PV skip) or SpargeAttn's lambda: a negative finite number, in natural-log units of the scaled
    scores."""
    if pv_threshold is None:
        return None
    if isinstance(pv_threshold, bool) or not isinstance(pv_threshold, (int, float)) \
            or not -math.inf < pv_threshold < 0:
        raise ValueError(
            "pv_threshold must be None or a negative finite number (how far below a row's running maximum a "
            f"tile's maximum must fall for its P @ V to be skipped), got pv_threshold={pv_threshold!r}."
        )
    return float(pv_threshold)


def check_sparse_kernel(q: torch.Tensor) -> None:
    """What the Triton kernel runs: fp16/bf16 and head_dim 32, 64 or 128."""
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"the sparse kernel supports dtype float16 and bfloat16 (fp32 accumulation), got dtype={q.dtype}; "
            "use sparse_reference for other dtypes."
        )
    if q.shape[-1] not in SPARSE_HEAD_DIMS:
        raise ValueError(f"the sparse kernel supports head_dim in {SPARSE_HEAD_DIMS}, got head_dim={q.shape[-1]}.")


def check_mask_batch(mask_batch: int, mask_heads: int, q: torch.Tensor) -> None:
    """A mask's leading dimensions are q's batch and heads, or 1 (broadcast)."""
    batch, heads = q.shape[0], q.shape[2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise ValueError(
            f"the mask's batch and heads must be 1 or q's ({batch}, {heads}), got ({mask_batch}, {mask_heads})."
        )


def _check_against(work: SparseWork, q: torch.Tensor) -> None:
    if q.shape[1] != work.seq_len:
        raise ValueError(f"q must have the mask's seq_len={work.seq_len} tokens, got q.shape={tuple(q.shape)}.")
    check_mask_batch(work.mask_batch, work.mask_heads, q)
    if work.members.device != q.device:
        raise ValueError(f"the mask must be on q's device, got {work.members.device} and q.device={q.device}.")


def default_programs(device: torch.device, num_warps: int) -> int:
    """Persistent programs: one per SM for 8-warp 128-query programs, two for smaller ones (4 in the
    interpreter)."""
    if device.type != "cuda":
        return 4
    per_sm = 1 if num_warps >= 8 else 2
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def run_sparse(
    work: SparseWork,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    return_lse: bool = False,
    schedule: str = "grid",
    programs: Optional[int] = None,
    debug: bool = False,
    specialize: bool = False,
    pv_threshold: Optional[float] = None,
):
    """`(out, lse, counts)` of one launch on prepared work (`lse` None unless asked; `counts` int32
    `[B * H * groups, 3]` with `debug`: KV blocks loaded, pairs computed, pairs PV-skipped; else None);
    `pv_threshold` (None or negative) turns on the PV skip. `specialize` warp-specializes the unmasked loop where its
    tiles load through descriptors (8 warps, 2 stages; Triton 3.6 builds it with 8 warps, not with 4), except
    with the LSE or debug counts (the LSE came out wrong under Triton 3.6's warp specialization in the GNA
    kernel); benchmarks/sparse.py --tune times it."""
    check_sparse_qkv(q, k, v)
    check_sparse_kernel(q)
    _check_against(work, q)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be 'grid' or 'lpt', got schedule={schedule!r}.")
    batch, seq_len, heads, head_dim = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, seq_len, heads), dtype=torch.float32, device=q.device) if return_lse else None
    items = batch * heads * work.groups
    counts = torch.zeros((items, 3), dtype=torch.int32, device=q.device) if debug else None
    pv_threshold = check_pv_threshold(pv_threshold)
    use_tma = (work.block_n == work.kv_block and has_tensor_descriptors(q.device)
               and all(descriptor_strides_ok(t) for t in (k, v)) and aligned(k, v))
    if use_tma:
        _install_allocator()
    config = launch_config(work.block_m, work.block_n, head_dim, masked=True, tma=use_tma, specialize=False)
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    specialize = specialize and use_tma and not (return_lse or debug or pv_threshold is not None)
    if specialize:
        options = dict(num_warps=8, num_stages=2)
    persistent = schedule == "lpt"
    if persistent:
        order = work.order(batch, heads)
        queue = torch.zeros(1, dtype=torch.int32, device=q.device)
        count = default_programs(q.device, options["num_warps"]) if programs is None else int(programs)
        if count < 1:
            raise ValueError(f"programs must be a positive int, got programs={programs!r}.")
        grid = (min(count, items),)
    else:
        order = queue = work.offsets  # unused
        grid = (work.groups, batch * heads)
    scale = head_dim**-0.5 if scale is None else float(scale)
    key = (work.block_m, work.block_n, work.q_block, work.kv_block, head_dim, q.dtype, use_tma, persistent,
           return_lse, debug, specialize, pv_threshold is not None)
    stages = _STAGES.get(key, options["num_stages"])
    while True:
        try:
            sparse_forward_kernel[grid](
                q, k, v, out, out if lse is None else lse, out if counts is None else counts,
                work.members, work.offsets, work.full_tiles, work.kv_list, work.member_bits, order, queue,
                *_bnh(q), *_bnh(k), *_bnh(v), *_bnh(out),
                heads, work.groups, items, work.mask_heads, 0 if work.mask_batch == 1 else 1,
                0 if work.mask_heads == 1 else 1, seq_len, scale * LOG2E,
                0.0 if pv_threshold is None else pv_threshold * LOG2E,
                QB=work.q_block, KVB=work.kv_block, BLOCK_M=work.block_m, BLOCK_N=work.block_n, HEAD_DIM=head_dim,
                WRITE_LSE=return_lse, DEBUG=debug, USE_TMA=use_tma, PERSISTENT=persistent,
                WARP_SPECIALIZE=specialize, PV_SKIP=pv_threshold is not None, num_warps=options["num_warps"], num_stages=stages,
            )
            break
        except OutOfResources:  # raised while compiling, before the launch: retry with one stage fewer
            if stages <= 1:
                raise
            stages -= 1
    _STAGES[key] = stages
    return out, lse, counts


# Pipeline stages per launch variant, lowered once when a variant's shared memory did not fit (launch_config's
# budget leaves no room for the layout conversions of some variants).
_STAGES: dict = {}


def _bnh(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of batch, token and head of a `[B, N, H, D]` tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


# -- public front end ----------------------------------------------------------------------------------------------


_warned_cpu = False


def sparse_forward_impl(q, k, v, mask: torch.Tensor, q_block: int, kv_block: int, merge: Optional[str],
                        scale: Optional[float], return_lse: bool, schedule: str, programs: Optional[int],
                        pv_threshold: Optional[float] = None):
    """`(out, lse)` of a boolean block mask: the Triton kernel (CUDA tensors or the interpreter), else the torch
    reference (of the PV skip with `pv_threshold`) with a one-time warning. What both the operator and the
    eager fast path run."""
    global _warned_cpu
    check_sparse_qkv(q, k, v)
    check_mask_batch(mask.shape[0], mask.shape[1], q)
    if not use_triton(q):
        if not _warned_cpu:
            import warnings

            warnings.warn("sparse_attention got CPU tensors: running the torch reference (exact but slow); "
                          "use CUDA tensors for the Triton kernel.", stacklevel=4)
            _warned_cpu = True
        if pv_threshold is not None:
            from .pvskip import sparse_pv_reference

            work = prepare_sparse(mask, q_block, kv_block, q.shape[1], merge=merge, device=q.device)
            return sparse_pv_reference(work, q, k, v, pv_threshold, scale)[:2]
        return sparse_reference(q, k, v, mask, q_block, kv_block, scale, return_lse=True)
    check_sparse_kernel(q)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "sparse_attention with a mask prepares its work on the host, which a CUDA graph cannot capture: "
            "build it before the capture with prepare_sparse(mask, ...) and pass that SparseWork as the mask."
        )
    work = prepare_sparse(mask, q_block, kv_block, q.shape[1], merge=merge, device=q.device)
    out, lse, _ = run_sparse(work, q, k, v, scale, return_lse, schedule, programs, pv_threshold=pv_threshold)
    return out, lse


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Union[torch.Tensor, SparseMask, SparseWork],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    *,
    merge: Optional[str] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    schedule: Optional[str] = None,
    programs: Optional[int] = None,
    pv_threshold: Optional[float] = None,
):
    """Attention of `[B, N, heads, head_dim]` q, k, v under a block mask: query i attends key j exactly when
    `mask[b, h, i // q_block, j // kv_block]`.

    - `mask`: a boolean `[B or 1, heads or 1, ceil(N / q_block), ceil(N / kv_block)]` tensor (then `q_block`
      and `kv_block` are required: powers of two, q_block 8 to 128, kv_block 1 to 128), a `SparseMask`, or a
      `SparseWork` from `prepare_sparse` (the host work done once, reused; eager calls only).
    - `merge`: None (a program holds one query block, at least 16 rows), `"consecutive"` or `"xor"` (a program
      holds 128 queries, 128 // q_block blocks: consecutive ones, or natsim.merge's XOR greedy per head).
      The output never depends on it: each row is masked by its own block's row.
    - `schedule`: `"grid"` (default, one program per group) or `"lpt"` (persistent, longest group first;
      `programs` sets how many, default about one per SM slot).
    - `pv_threshold`: None (exact), or SpargeAttn's lambda (negative, natural-log units of the scaled scores):
      a query block skips a tile's P @ V when every one of its rows has the tile's maximum score more than
      `-pv_threshold` below its running maximum (module docstring; an approximation that depends on the
      order of the tiles, which `kernels/pvskip.py` reproduces in torch).
    Returns the output (q's dtype) and with `return_lse` the natural-log LSE `[B, N, heads]` (float32, -inf
    for a query that attends nothing, whose output is 0). Differentiable with respect to q, k and v (the
    Triton backward kernels, kernels/sparse_backward.py, on the unmerged mask; the reference's gradients on
    the CPU path), except with `pv_threshold`, whose skips have no gradient (refused). CPU tensors without
    TRITON_INTERPRET=1 run `sparse_reference`.
    """
    check_tensors(q, k, v)
    q, k, v = autocast_inputs(q, k, v)
    schedule = "grid" if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be None, 'grid' or 'lpt', got schedule={schedule!r}.")
    if isinstance(mask, SparseWork):
        if not runs_eagerly(q, k, v) or not use_triton(q):
            raise ValueError(
                "a SparseWork runs in plain eager calls of the Triton kernel only; pass the boolean mask or the "
                "SparseMask under torch.compile, autograd or on the torch reference path."
            )
        out, lse, _ = run_sparse(mask, q, k, v, scale, return_lse, schedule, programs, pv_threshold=pv_threshold)
        return (out, lse) if return_lse else out
    if q.dim() < 2:
        raise ValueError(f"q must be [batch, tokens, heads, head_dim], got q.shape={tuple(q.shape)}.")
    dense, q_block, kv_block, _ = _dense_mask(mask, q_block, kv_block, q.shape[1])
    if merge not in MERGES:
        raise ValueError(f"merge must be None, 'consecutive' or 'xor', got merge={merge!r}.")
    scale = None if scale is None else float(scale)
    pv_threshold = check_pv_threshold(pv_threshold)
    if pv_threshold is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(ops.PV_SKIP_GRADIENT_REFUSAL)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if runs_eagerly(q, k, v):
        out, lse = sparse_forward_impl(q, k, v, dense, q_block, kv_block, merge, scale, return_lse, schedule,
                                       programs, pv_threshold)
    else:
        # The backward kernels need the forward's LSE: ask for it whenever autograd will want gradients.
        out, lse = ops.sparse_forward(q, k, v, dense, q_block, kv_block, merge, scale, return_lse or tracked,
                                      schedule, programs, pv_threshold)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class SparseTileCounts:
    """The kernel's own debug counts, one entry per program (work item) `[B, H, groups]`: `loaded` KV blocks,
    `computed` (query block, KV block) pairs, `pv_skipped` pairs of the mask (attended) whose P @ V the PV
    skip left out (0 without `pv_threshold`; at most the mask's pairs), and `members` `[B, H, groups, R]`, the query blocks of each program (-1 where the
    last group is short). `natsim.merge(mask[b, h], R, method)` predicts `merged.visited` and
    `merged.visited * group_sizes` for the same `members` (its `groups`)."""

    loaded: np.ndarray
    computed: np.ndarray
    members: np.ndarray
    merge_seconds: float
    pv_skipped: np.ndarray


def sparse_tile_counts(
    mask: Union[torch.Tensor, SparseMask],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    *,
    seq_len: Optional[int] = None,
    merge: Optional[str] = None,
    schedule: str = "grid",
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    head_dim: int = 32,
    device: Union[str, torch.device] = "cuda",
    dtype: torch.dtype = torch.float16,
    pv_threshold: Optional[float] = None,
    inputs: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    scale: Optional[float] = None,
) -> SparseTileCounts:
    """Run the kernel with its debug counters on and return its per-program counts: on `inputs` (q, k, v of
    the mask's batch and heads, on `device`), else on random ones (N = `seq_len`, by default the mask's blocks
    times its rows; `head_dim`, `dtype`). The PV-skip count depends on the inputs: pass them with
    `pv_threshold`."""
    if isinstance(mask, SparseMask):
        seq_len = mask.seq_len if seq_len is None else seq_len
    elif seq_len is None and q_block is not None and isinstance(mask, torch.Tensor) and mask.dim() == 4:
        seq_len = mask.shape[2] * q_block
    work = prepare_sparse(mask, q_block, kv_block, seq_len, merge=merge, block_m=block_m, block_n=block_n,
                          device=torch.device(device))
    if inputs is None:
        shape = (work.mask_batch, work.seq_len, work.mask_heads, head_dim)
        inputs = tuple(torch.randn(shape, device=device).to(dtype) for _ in range(3))
    q, k, v = inputs
    _, _, counts = run_sparse(work, q, k, v, scale, schedule=schedule, debug=True, pv_threshold=pv_threshold)
    counts = counts.cpu().numpy().astype(np.int64).reshape(q.shape[0], q.shape[2], work.groups, 3)
    members = work.members.cpu().numpy().astype(np.int64).reshape(work.mask_batch, work.mask_heads, work.groups, -1)
    return SparseTileCounts(counts[..., 0], counts[..., 1], members, work.merge_seconds, counts[..., 2])


# -- torch reference -----------------------------------------------------------------------------------------------


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
):
    """Exact attention of `[B, N, heads, head_dim]` tensors under the block mask expanded to elements, in float32
    (float64 for float64 inputs), `chunk` query rows at a time; differentiable. Empty rows: output 0, LSE -inf."""
    check_sparse_qkv(q, k, v)
    dense, q_block, kv_block, _ = _dense_mask(mask, q_block, kv_block, q.shape[1])
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
        scores = (q[:, rows].to(compute).transpose(1, 2) @ kt) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        attends = allowed.any(-1, keepdim=True)
        scores = torch.where(attends, scores, 0.0)  # empty rows: finite, and zeroed below
        lse = torch.logsumexp(scores, -1, keepdim=True)
        out = (torch.exp(scores - lse) @ vt) * attends
        outs.append(out.transpose(1, 2))
        lses.append(torch.where(attends, lse, float("-inf"))[..., 0].transpose(1, 2))
    out = torch.cat(outs, 1).to(q.dtype)
    lse = torch.cat(lses, 1)
    return (out, lse) if return_lse else out
