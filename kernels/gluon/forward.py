"""A warp-specialized attention forward for Hopper, written in Gluon, over block-sparse lists of whole tiles: in FP8
(natsim's FP8 rule, below), and in 16 bits, the same design on bf16 / fp16 operands as they are (`launch_16bit`).

One program computes one query block of 128 rows of one (batch, head) against the key blocks its list names
(every key block where there is no list). Three partitions share the program's shared memory:

- a loader warp issues TMA copies: the query block once, then each listed key block's K and V (transposed) into
  a ring of `STAGES` buffers, guarded by ready / empty mbarriers;
- two consumer warpgroups each own 64 of the query rows and run the same loop over the ring, ping-pong: in its
  turn a warpgroup issues its asynchronous products (Q K^T of the next block; P V and P 1 of this one) and
  hands the turn over (an mbarrier each way), then exponentiates the next block's scores while the other
  warpgroup's products run. P goes to P V through a shared buffer of the warpgroup's.

The arithmetic is natsim's FP8 rule (kernels/common/fp8.py), with K's scales shared by its blocks of 128 keys:
Q in e4m3 with one scale per token and head, K (mean removed) with one scale per key block and head, which
joins the row's scale so that each score costs one multiply-add before its exponential; V transposed with
one scale per channel; P cast to e4m3 as `112 * exp2(s - m)` against a reference maximum m per row that moves
only when a block's maximum passes it by more than a factor of four (`RESCALE_SLACK`), so that P stays below 448
and the accumulators' rescale is skipped once the maxima settle; fp32 accumulators; V's scales applied to the
output once. Keys past the sequence (the last block's padding) are masked. A block list names whole tiles, and
for GNA also partial ones (an entry `~block`), whose scores the consumer masks by the rows' window bounds before
the softmax (`TileMask`, built by kernels/gluon/tile_mask.py: per score and dimension one subtraction and one
unsigned comparison, a per-row test where the tile spans one coordinate).

The 16-bit variant takes the same loop with no scales (the row scale is the softmax's), P in the inputs' dtype
stored as it is, V read `[keys, head_dim]` (the instruction takes 16-bit operands in either order) and two stages
in the ring at head_dim 128 (K and V take twice the shared memory). Its consumers hand a stage's K back to the
loader once Q K^T has read it, and V once P V has: with two stages the loader otherwise waited for both and the
next key block's K arrived late (dense 32k at head_dim 128 on an H200: 33.5 ms released together, 23.9 ms apart;
in FP8, with four stages, no gain: `SPLIT_RELEASE`).

Two choices keep the consumers' instruction count per score low, which is what bounds this kernel (the tensor
cores wait on the softmax's issue slots, docs/fp8.md):

- P is stored key-major: a thread's scores of one row sit in columns `8 g + 2 q + e` of the matrix
  instruction's result (q its lane's quarter, g the 8-column group, e the pair), and go to shared memory at
  `32 q + 2 g + e`, 32 consecutive bytes a thread, four 16-byte stores a block, where the natural order took
  32 two-byte stores and the byte shuffles to build them. V's keys are stored in the same order within each
  block of 128 (`quantize(..., v_key_major=True)`), so P V is unchanged.
- The row sums come from the tensor cores: P times a block of ones (an 8-column product beside P V) adds up P
  as rounded to e4m3, in place of one fp32 add per score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..common.devices import current_device_of
from ..common.fp8 import Fp8Tensors
from ..common.launch import tensor_descriptors_enabled

BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64
BLOCK_BITS = gl.constexpr(24)  # a list entry: key block in its low 24 bits, a partial block's dimension bits above
BLOCK_BITS_MASK = gl.constexpr((1 << 24) - 1)
ALL_DIMS = 0b111  # a partial block's dimension bits where they are not given: mask along every dimension
BLOCK_N = 128  # keys per block
HALF_M = BLOCK_M // 2
ONES = gl.constexpr(8)  # columns of the row-sum product P 1: the matrix instruction's narrowest
# 1.0's bits in each operand dtype (the row-sum product's block of ones)
ONE_BITS = {torch.float8_e4m3fn: 0x38, torch.bfloat16: 0x3F80, torch.float16: 0x3C00}
_GLUON_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
HEAD_DIMS = (64, 128)
# Head dims at which `sparse_attention` takes the 16-bit variant for a 16-bit block-mask call naming no backend: at
# 128 it ran 1.14-1.19x natsim's Triton kernel on random masks and HunyuanVideo's GNA mask, at 64 (dense) 0.91x
# (H200, benchmarks/results/gluon-16bit-NVIDIA_H200-2026-11-29-split.json)
AUTO_16BIT_HEAD_DIMS = (128,)
LOG2E = 1.4426950408889634
P_OFFSET = math.log2(448.0)  # log2 of e4m3's largest finite value, P's bound
RESCALE_SLACK = 2.0  # log2 units a block's row maximum may pass the reference one before that row's m moves
# Head dims that rescale lazily (`_softmax`): at 128 it ran 1-5% faster (H100; dense 32k, random masks, HunyuanVideo's
# GNA mask), at 64, whose rescale is half the multiplies, 12% slower (the warpgroup's vote and its two barriers cost
# more than they skip): benchmarks/results/fp8-gluon-lazy-rescale-ab-first-NVIDIA_H100_80GB_HBM3-2026-11-28.json and
# fp8-gluon-ab-lazy-rescale-NVIDIA_H100_80GB_HBM3-2026-11-28.json (benchmarks/fp8_gluon_ab.py).
LAZY_RESCALE_HEAD_DIMS = frozenset({128})


@dataclass(frozen=True)
class BlockLists:
    """Per (batch, head, query block of `BLOCK_M`), the key blocks (of `BLOCK_N`) to visit: `counts` int32
    `[B|1, H|1, q_blocks]` and ascending `indices` int32 `[B|1, H|1, q_blocks, kv_blocks]` (entries past a row's
    count are never read); a dimension of 1 is shared by every batch or head. A block's entry is its index where
    it is attended whole (keys past the sequence aside), and `~(index | dims << 24)` (negative) where it is a
    partial tile of a GNA call, whose elements the kernel masks along the dimensions whose bits `dims` sets
    (kernels/gluon/tile_mask.py). Indices are key blocks of the call (under `kv_blocks`, below 2 ** 24); `check`
    does not read them, which would wait on the GPU."""

    counts: torch.Tensor
    indices: torch.Tensor

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, partial: Optional[torch.Tensor] = None,
                    dims: Optional[torch.Tensor] = None) -> "BlockLists":
        """The lists of a boolean block mask `[B|1, H|1, q_blocks, kv_blocks]` of 128 x 128 blocks; `partial`
        (a boolean mask of the same shape, within `blocks`): the blocks marked partial, masked along the
        dimensions whose bits `dims` (an integer tensor of that shape) sets, along every one without it."""
        if blocks.dtype != torch.bool or blocks.dim() != 4:
            raise ValueError(f"a block mask is a boolean [B|1, H|1, q_blocks, kv_blocks] tensor, got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        counts = blocks.sum(-1, dtype=torch.int32)
        order = torch.sort((~blocks).to(torch.uint8), dim=-1, stable=True).indices
        if partial is not None:
            if partial.shape != blocks.shape or partial.dtype != torch.bool:
                raise ValueError(f"partial must be a boolean mask of the blocks' shape {tuple(blocks.shape)}, got "
                                 f"{partial.dtype} {tuple(partial.shape)}")
            bits = torch.full_like(order, ALL_DIMS) if dims is None else torch.gather(dims.long(), -1, order)
            order = torch.where(torch.gather(partial, -1, order), ~(order | bits << BLOCK_BITS.value), order)
        return cls(counts.contiguous(), order.to(torch.int32).contiguous())

    def check(self, batch: int, heads: int, q_blocks: int, kv_blocks: int, device: torch.device) -> None:
        """That these lists fit a call of `batch` x `heads` with that many blocks, on its device."""
        lead_ok = all(n in (1, want) for n, want in zip(self.counts.shape[:2], (batch, heads)))
        if (self.counts.dim() != 3 or self.indices.dim() != 4 or not lead_ok
                or self.counts.shape != self.indices.shape[:3]
                or tuple(self.indices.shape[2:]) != (q_blocks, kv_blocks)):
            raise ValueError(f"block lists {tuple(self.counts.shape)} / {tuple(self.indices.shape)} do not fit a "
                             f"call of batch {batch}, {heads} heads and {q_blocks} x {kv_blocks} blocks of "
                             f"{BLOCK_M} x {BLOCK_N} tokens")
        if self.counts.dtype != torch.int32 or self.indices.dtype != torch.int32:
            raise ValueError("block lists are int32 tensors")
        if self.counts.device != device or self.indices.device != device:
            raise ValueError(f"block lists on {self.counts.device}, the call's tensors on {device}")
        if not (self.counts.is_contiguous() and self.indices.is_contiguous()):
            raise ValueError("block lists must be contiguous")

    def mask(self, partial: bool = False) -> torch.Tensor:
        """The boolean block mask `[B|1, H|1, q_blocks, kv_blocks]` these lists name (with `partial`: of the
        blocks they mark partial)."""
        columns = torch.arange(self.indices.shape[-1], device=self.indices.device)
        listed = columns < self.counts[..., None].long()
        if partial:
            listed = listed & (self.indices < 0)
        mask = torch.zeros(self.indices.shape, dtype=torch.uint8, device=self.indices.device)
        blocks = torch.where(self.indices < 0, ~self.indices, self.indices).long() & BLOCK_BITS_MASK.value
        return mask.scatter_reduce_(-1, blocks, listed.to(torch.uint8), "amax").bool()  # any listed entry counts

    def dims(self) -> torch.Tensor:
        """The dimension bits of each block these lists mark partial `[B|1, H|1, q_blocks, kv_blocks]` (0
        elsewhere)."""
        columns = torch.arange(self.indices.shape[-1], device=self.indices.device)
        listed = (columns < self.counts[..., None].long()) & (self.indices < 0)
        code = torch.where(listed, ~self.indices, 0).long()
        bits = torch.zeros(self.indices.shape, dtype=torch.long, device=self.indices.device)
        return bits.scatter_reduce_(-1, code & BLOCK_BITS_MASK.value, code >> BLOCK_BITS.value, "amax")

    def of_batch(self, index: int) -> "BlockLists":
        """The lists of batch element `index` alone (the same lists where every element shares them)."""
        if self.counts.shape[0] == 1:
            return self
        return BlockLists(self.counts[index:index + 1], self.indices[index:index + 1])

    @staticmethod
    def strides(t: torch.Tensor) -> tuple[int, int]:
        """Batch and head strides of a list tensor, 0 where that dimension is shared."""
        return tuple(t.stride(i) if t.shape[i] > 1 else 0 for i in (0, 1))


@dataclass(frozen=True)
class TileMask:
    """The element mask inside the partial tiles of a call on tokens in the order of a 128-token `tile` (queries
    and keys): `bounds` int32 `[2 * ndim, tokens]`, per dimension the rows' window starts then ends; `bases` int32
    `[ndim, key tiles]`, per dimension each key tile's first key's coordinate. A score is kept when, along every
    dimension, `start <= base + in-tile coordinate < end` (kernels/gluon/tile_mask.py builds them for GNA)."""

    bounds: torch.Tensor
    bases: torch.Tensor
    tile: tuple[int, ...]

    @property
    def inner(self) -> tuple[int, ...]:
        """Per dimension, the in-tile column step between coordinates (the tile's row-major strides)."""
        return tuple(math.prod(self.tile[i + 1:]) for i in range(len(self.tile)))

    def check(self, rows: int, n_kv: int, device: torch.device) -> None:
        """That this mask fits a call of `rows` query tokens and `n_kv` key tokens on `device`."""
        ndim = len(self.tile)
        if (self.bounds.shape != (2 * ndim, rows) or self.bases.shape != (ndim, -(-n_kv // BLOCK_N))
                or self.bounds.dtype != torch.int32 or self.bases.dtype != torch.int32):
            raise ValueError(f"a tile mask of bounds {tuple(self.bounds.shape)} and bases {tuple(self.bases.shape)} "
                             f"does not fit {rows} query and {n_kv} key tokens in {ndim} dimensions")
        if self.bounds.device != device or self.bases.device != device:
            raise ValueError(f"tile mask on {self.bounds.device}, the call's tensors on {device}")

    def dense(self) -> torch.Tensor:
        """The boolean `[tokens, key tiles * 128]` mask the kernel applies (tests and the CPU path)."""
        columns = torch.arange(self.bases.shape[1] * BLOCK_N, device=self.bases.device)
        keep = None
        for i, (side, step) in enumerate(zip(self.tile, self.inner)):
            coordinate = self.bases[i, columns // BLOCK_N] + (columns % BLOCK_N) // step % side
            lo, hi = self.bounds[2 * i, :, None], self.bounds[2 * i + 1, :, None]
            inside = (lo <= coordinate) & (coordinate < hi)
            keep = inside if keep is None else keep & inside
        return keep


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
            IDX, idx_row, count, q_row, q_col, k_row, v_row,
            HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DENSE: gl.constexpr,
            FP8: gl.constexpr):
    """The loader warp: the query block, then K and V of each listed key block into the ring (V transposed in
    FP8, `[head_dim, keys]` per head; as it is in 16 bits, `[keys, head_dim]` like K)."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF, q_col], q_bar, q_smem.index(1))
    for i in range(count):
        if DENSE:
            block = i
        else:
            block = _block_of(gl.load(IDX + idx_row + i))
        stage = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + block * BLOCK_N, q_col], k_ready.index(stage),
                                        k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        if FP8:
            tma.async_copy_global_to_shared(v_desc, [v_row, block * BLOCK_N], v_ready.index(stage),
                                            v_smem.index(stage))
        else:
            tma.async_copy_global_to_shared(v_desc, [k_row + block * BLOCK_N, q_col], v_ready.index(stage),
                                            v_smem.index(stage))


@gluon.jit
def _block_of(entry):
    """The key block a list entry names (`BlockLists`: a partial block's entry is the complement of its index
    and its dimension bits)."""
    return (entry ^ (entry >> 31)) & BLOCK_BITS_MASK


@gluon.jit
def _dims_of(entry):
    """The dimensions a partial block's entry says to mask (bit d: dimension d)."""
    return (entry ^ (entry >> 31)) >> BLOCK_BITS


@gluon.jit
def _inside(lo, hi, base, inner, TILE: gl.constexpr, INNER: gl.constexpr):
    """Along one dimension, whether each key of a tile lies in each query's window: the key's coordinate (the
    tile's `base` plus its in-tile coordinate, from its column `inner`) in the row's `[lo, hi)`. Per score one
    subtraction and one unsigned comparison (`r - start < width`, the width at least 0); a dimension the tile
    spans one coordinate of is a test per row."""
    start = lo - base
    if TILE == 1:
        inside = gl.expand_dims((start <= 0) & (hi - base > 0), 1)
    else:
        width = gl.maximum(hi - lo, 0).to(gl.uint32)
        r = gl.expand_dims((inner // INNER) % TILE, 0)
        inside = (r - gl.expand_dims(start, 1)).to(gl.uint32, bitcast=True) < gl.expand_dims(width, 1)
    return inside


@gluon.jit
def _tile_masked(s, block, dims, bounds, BASES, kv_blocks, col_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 NDIM: gl.constexpr, TILE: gl.constexpr, INNER: gl.constexpr):
    """The scores `s` of a partial tile with the keys outside each query's window at -inf (kernels/gluon/
    tile_mask.py: per query and dimension the window `[lo, hi)`, per key tile and dimension its first key's
    coordinate, dilation groups folded into both), along the dimensions `dims` names (bit d: dimension d; along
    the others every row's window holds the whole tile)."""
    inner = gl.arange(0, BLOCK_N, layout=col_layout)
    if (dims & 1) != 0:
        s = gl.where(_inside(bounds[0], bounds[1], gl.load(BASES + block), inner, TILE[0], INNER[0]), s,
                     -float("inf"))
    if NDIM > 1:
        if (dims & 2) != 0:
            s = gl.where(_inside(bounds[2], bounds[3], gl.load(BASES + kv_blocks + block), inner, TILE[1],
                                 INNER[1]), s, -float("inf"))
    if NDIM > 2:
        if (dims & 4) != 0:
            s = gl.where(_inside(bounds[4], bounds[5], gl.load(BASES + 2 * kv_blocks + block), inner, TILE[2],
                                 INNER[2]), s, -float("inf"))
    return s


@gluon.jit
def _softmax(s, row_scale, m_i, block, n_kv, BLOCK_N: gl.constexpr, col_layout: gl.constexpr,
             P_OFFSET: gl.constexpr, SLACK: gl.constexpr, MASKED: gl.constexpr):
    """The online-softmax update of one block's raw scores `s` with `row_scale` (log2 units: the softmax scale,
    the queries' scales and the block's key scale, folded into the exponent's one multiply-add), keys past the
    sequence at -inf: P (fp32) as `2 ** P_OFFSET * exp2(s - m)`, each row's reference maximum m, the factor the
    accumulators are rescaled by, and whether any row of the warpgroup needs that.

    With a `SLACK` (log2 units; None: m is the running maximum) a row's m moves only when the block's maximum
    passes it by more than the slack; otherwise P is taken against the old m, at most `2 ** SLACK` times larger,
    which `P_OFFSET` leaves room for below e4m3's 448. Once the maxima settle (after a few blocks on most rows)
    no row moves, and the caller's branch on the warpgroup's one answer skips the accumulators' multiplies.

    `MASKED`: the call has partial tiles, whose rows may have no key in a block and no maximum yet (-inf); such a
    row takes its exponentials against 0, which gives P = 0 and, with no maximum before, a factor 0 on empty
    accumulators."""
    if (block + 1) * BLOCK_N > n_kv:  # the sequence's last block: mask its padding keys
        cols = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        s = gl.where(gl.expand_dims(cols < n_kv, 0), s, -float("inf"))
    m_block = gl.max(s, 1) * row_scale  # row scales are positive; a whole block has a key in range
    if SLACK is None:
        m_new = gl.maximum(m_i, m_block)
        moved = gl.to_tensor(True)
    else:
        m_new = gl.where(m_block > m_i + SLACK, m_block, m_i)
    m_use = m_new
    if MASKED:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(s * gl.expand_dims(row_scale, 1) - gl.expand_dims(m_use - P_OFFSET, 1))
    alpha = gl.exp2(m_i - m_use)
    if SLACK is not None:
        moved = gl.min(alpha, 0) < 1.0  # one answer for the warpgroup's 64 rows: a uniform branch
    return p, m_new, alpha, moved


@gluon.jit
def _key_major(p, HALF: gl.constexpr, BLOCK_N: gl.constexpr):
    """`p` `[HALF, BLOCK_N]` with its columns reordered from the matrix instruction's `8 g + 2 q + e` to
    `32 q + 2 g + e`: a relabelling of registers (no data moves), after which each thread holds 32 consecutive
    columns of its rows."""
    p = p.reshape([HALF, BLOCK_N // 8, 4, 2])  # [row, g, q, e]
    return p.permute([0, 2, 1, 3]).reshape([HALF, BLOCK_N])


@gluon.jit
def _pv(p, p_smem, v_tile, ones, acc, zero_l, HALF: gl.constexpr, BLOCK_N: gl.constexpr, FP8: gl.constexpr):
    """Issue acc += P V and this block's row sums P 1 (asynchronous), P in e4m3 through this warpgroup's shared
    buffer, key-major (V's keys are stored in that order): the wgmma reads it from there in the layout the
    instruction wants (measured faster than shuffling P's registers into the operand layout: 16.9 against
    18.3 ms, dense 32k, H100). The row sums start from zero in each block and join the running sum in fp32:
    Hopper's FP8 products add into their accumulator with a short mantissa, and a sum of positive terms carried
    in it over 256 blocks came out 1.4-1.8x too small (dense 32k). The previous products that read the buffer
    are complete here. In 16 bits P is stored as it is and V read `[keys, head_dim]`, which the instruction takes
    for 16-bit operands."""
    if FP8:
        p_smem.store(_key_major(p, HALF, BLOCK_N).to(gl.float8e4nv))
        v_operand = v_tile.permute((1, 0))
    else:
        p_smem.store(p.to(p_smem.dtype))
        v_operand = v_tile
    fence_async_shared()
    acc = warpgroup_mma(p_smem, v_operand, acc, is_async=True)
    l_block = warpgroup_mma(p_smem, ones.permute((1, 0)), zero_l, use_acc=False, is_async=True)
    return acc, l_block


@gluon.jit
def _rescaled(acc, l_acc, alpha, o_row_layout: gl.constexpr, l_row_layout: gl.constexpr):
    """The output and row-sum accumulators rescaled by `alpha` (some rows' reference maximum moved)."""
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
    return acc, l_acc * gl.expand_dims(gl.convert_layout(alpha, l_row_layout), 1)


@gluon.jit
def _key_scale(KS, ks_row, block, BLOCK_N: gl.constexpr, heads, FP8: gl.constexpr):
    """Key block `block`'s scale in FP8 (shared by its keys), 1 in 16 bits."""
    if FP8:
        scale = gl.load(KS + ks_row + block * (BLOCK_N * heads))
    else:
        scale = gl.to_tensor(1.0)
    return scale


@gluon.jit
def _release(k_empty, v_empty, stage, SPLIT_RELEASE: gl.constexpr):
    """Hand a stage's V back to the loader once P V has read it, and its K too unless K went back after Q K^T."""
    mbarrier.arrive(v_empty.index(stage), count=1)
    if not SPLIT_RELEASE:
        mbarrier.arrive(k_empty.index(stage), count=1)


@gluon.jit
def _consumer(HALF_INDEX: gl.constexpr, q_smem, k_smem, v_smem, p_smem, ones, q_bar, turns, k_ready, v_ready,
              k_empty, v_empty,
              IDX, idx_row, count, QS, KS, SV, OUT, LSE, BOUNDS, BASES, kv_blocks, b, h, heads, n_q, n_kv, q_start,
              qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr,
              DENSE: gl.constexpr, RETURN_LSE: gl.constexpr, P_OFFSET: gl.constexpr, SLACK: gl.constexpr,
              MASKED: gl.constexpr, NDIM: gl.constexpr, TILE: gl.constexpr, INNER: gl.constexpr,
              FP8: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    """One consumer warpgroup: 64 query rows against every listed key block, then the output (and LSE). With
    `MASKED`, the lists mark partial tiles, whose scores take the GNA mask of the rows' window bounds. Without
    `FP8` the operands are 16-bit and unscaled (`QS`, `KS` and `SV` are not read)."""
    K_STEP: gl.constexpr = 32 if FP8 else 16  # the matrix instruction's depth: 32 bytes of each operand
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, K_STEP])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ONES, K_STEP])
    l_row_layout: gl.constexpr = gl.SliceLayout(1, l_layout)

    rows = q_start + HALF_INDEX * HALF + gl.arange(0, HALF, layout=row_layout)
    if FP8:
        q_scale = gl.load(QS + ((b * n_q + rows.to(gl.int64)) * heads + h), mask=rows < n_q, other=1.0)
        row_scale = q_scale * qk_scale
    else:
        row_scale = gl.full([HALF], qk_scale, gl.float32, layout=row_layout)
    ks_row = b.to(gl.int64) * n_kv * heads + h  # key block j's scale: KS[ks_row + j * BLOCK_N * heads]
    m_i = gl.full([HALF], -float("inf"), gl.float32, layout=row_layout)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    l_acc = gl.zeros([HALF, ONES], gl.float32, layout=l_layout)  # every column: the row's sum of P
    zero_l = gl.zeros([HALF, ONES], gl.float32, layout=l_layout)
    zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(HALF_INDEX)
    p_tile = p_smem.index(HALF_INDEX)
    if MASKED:  # each row's window [lo, hi) along each dimension (the first one's again past NDIM), read once
        in_q = rows < n_q
        lo0 = gl.load(BOUNDS + rows, mask=in_q, other=0)
        hi0 = gl.load(BOUNDS + n_q + rows, mask=in_q, other=0)
        lo1, hi1, lo2, hi2 = lo0, hi0, lo0, hi0
        if NDIM > 1:
            lo1 = gl.load(BOUNDS + 2 * n_q + rows, mask=in_q, other=0)
            hi1 = gl.load(BOUNDS + 3 * n_q + rows, mask=in_q, other=0)
        if NDIM > 2:
            lo2 = gl.load(BOUNDS + 4 * n_q + rows, mask=in_q, other=0)
            hi2 = gl.load(BOUNDS + 5 * n_q + rows, mask=in_q, other=0)
        bounds = (lo0, hi0, lo1, hi1, lo2, hi2)
    mbarrier.wait(q_bar, 0)

    # Ping-pong: a warpgroup issues its products for a block (Q K^T of the next block; P V and P 1 of this one)
    # only in its turn, then hands the turn to the other, and exponentiates while the other's products run.
    my_turn = turns.index(HALF_INDEX)
    other_turn = turns.index(1 - HALF_INDEX)
    if count > 0:
        # the first block's scores and P
        if DENSE:
            block = gl.to_tensor(0)
        else:
            entry = gl.load(IDX + idx_row)
            block = _block_of(entry)
        k_scale = _key_scale(KS, ks_row, block, BLOCK_N, heads, FP8)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        if SPLIT_RELEASE:
            mbarrier.arrive(k_empty.index(0), count=1)
        if MASKED:
            if entry < 0:
                s = _tile_masked(s, block, _dims_of(entry), bounds, BASES, kv_blocks, col_layout, BLOCK_N,
                                 NDIM, TILE, INNER)
        p, m_i, alpha, moved = _softmax(s, row_scale * k_scale, m_i, block, n_kv, BLOCK_N, col_layout, P_OFFSET,
                                        SLACK, MASKED)
        for i in range(count - 1):
            if DENSE:
                block = i + 1
            else:
                entry = gl.load(IDX + idx_row + i + 1)
                block = _block_of(entry)
            k_scale = _key_scale(KS, ks_row, block, BLOCK_N, heads, FP8)
            stage = i % STAGES
            nxt = (i + 1) % STAGES
            mbarrier.wait(my_turn, (i & 1) ^ (1 - HALF_INDEX))
            mbarrier.wait(k_ready.index(nxt), ((i + 1) // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if moved or SLACK is None:
                acc, l_acc = _rescaled(acc, l_acc, alpha, o_row_layout, l_row_layout)
            mbarrier.wait(v_ready.index(stage), (i // STAGES) & 1)
            acc, l_block = _pv(p, p_tile, v_smem.index(stage), ones, acc, zero_l, HALF, BLOCK_N, FP8)
            mbarrier.arrive(other_turn, count=1)
            s = warpgroup_mma_wait(2, deps=(s,))  # groups complete in order: P V and P 1 may still run
            if SPLIT_RELEASE:
                mbarrier.arrive(k_empty.index(nxt), count=1)
            if MASKED:
                if entry < 0:
                    s = _tile_masked(s, block, _dims_of(entry), bounds, BASES, kv_blocks, col_layout, BLOCK_N,
                                     NDIM, TILE, INNER)
            p, m_i, alpha, moved = _softmax(s, row_scale * k_scale, m_i, block, n_kv, BLOCK_N, col_layout,
                                            P_OFFSET, SLACK, MASKED)
            acc, l_block = warpgroup_mma_wait(0, deps=(acc, l_block))
            l_acc += l_block
            _release(k_empty, v_empty, stage, SPLIT_RELEASE)  # this block's V (and K) are consumed
        # the last block's P V
        last = count - 1
        stage = last % STAGES
        mbarrier.wait(my_turn, (last & 1) ^ (1 - HALF_INDEX))
        if moved or SLACK is None:
            acc, l_acc = _rescaled(acc, l_acc, alpha, o_row_layout, l_row_layout)
        mbarrier.wait(v_ready.index(stage), (last // STAGES) & 1)
        acc, l_block = _pv(p, p_tile, v_smem.index(stage), ones, acc, zero_l, HALF, BLOCK_N, FP8)
        mbarrier.arrive(other_turn, count=1)
        acc, l_block = warpgroup_mma_wait(0, deps=(acc, l_block))
        l_acc += l_block
        _release(k_empty, v_empty, stage, SPLIT_RELEASE)

    # out = acc * v_scale / l; rows with no key get zeros
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    l_i = gl.convert_layout(gl.max(l_acc, 1), row_layout)
    l_o = gl.convert_layout(l_i, o_row_layout)
    inv = gl.where(l_o > 0, 1.0 / l_o, 0.0)
    out = acc * gl.expand_dims(inv, 1)  # the 2 ** P_OFFSET of P cancels between acc and l
    if FP8:
        out = out * gl.expand_dims(gl.load(SV + (b * heads + h) * HEAD_DIM + d), 0)
    o_rows = q_start + HALF_INDEX * HALF + gl.arange(0, HALF, layout=o_row_layout)
    o_offsets = gl.expand_dims((b * n_q + o_rows.to(gl.int64)) * heads + h, 1) * HEAD_DIM + gl.expand_dims(d, 0)
    gl.store(OUT + o_offsets, out.to(OUT.dtype.element_ty), mask=gl.expand_dims(o_rows < n_q, 1))
    if RETURN_LSE:
        lse = gl.where(l_i > 0, (m_i + gl.log2(l_i) - P_OFFSET) * (1.0 / 1.4426950408889634), -float("inf"))
        gl.store(LSE + (b * n_q + rows.to(gl.int64)) * heads + h, lse, mask=rows < n_q)


@gluon.jit
def _forward_kernel(q_desc, k_desc, v_desc, QS, KS, SV, OUT, LSE, COUNTS, IDX, BOUNDS, BASES,
                        heads, n_q, n_kv, qk_scale, cnt_b, cnt_h, idx_b, idx_h, kv_blocks,
                        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        DENSE: gl.constexpr, RETURN_LSE: gl.constexpr, P_OFFSET: gl.constexpr,
                        SLACK: gl.constexpr, MASKED: gl.constexpr, NDIM: gl.constexpr, TILE: gl.constexpr,
                        INNER: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                        FP8: gl.constexpr, ONE_BITS: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    q_block = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // heads
    h = bh % heads
    if DENSE:
        count = kv_blocks
        idx_row = 0
    else:
        count = gl.load(COUNTS + b * cnt_b + h * cnt_h + q_block)
        idx_row = (b * idx_b + h * idx_h + q_block * kv_blocks).to(gl.int64)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    BITS: gl.constexpr = 8 if FP8 else 16
    BITS_TYPE: gl.constexpr = gl.uint8 if FP8 else gl.uint16
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, BLOCK_N],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=BITS, rank=2))
    ones = gl.allocate_shared_memory(q_desc.dtype, [ONES, BLOCK_N],
                                     gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=BITS, rank=2))
    # 1.0 written as its bits: Triton 3.6 folds a converted constant (full(1.0).to(float8e4nv)) into wrong bytes
    # (measured on an H100: the row sums came out as garbage)
    ones.store(gl.full([ONES, BLOCK_N], ONE_BITS, BITS_TYPE,
                       layout=gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])).to(q_desc.dtype, bitcast=True))
    fence_async_shared()  # the consumers' matrix instructions read the ones
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a stage's K, and its V
        mbarrier.init(v_empty.index(i), count=2)

    q_start = q_block * (2 * HALF)
    q_row = b * n_q + q_start
    q_col = h * HEAD_DIM
    k_row = b * n_kv
    v_row = (b * heads + h) * HEAD_DIM
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, p_smem, ones, q_bar, turns, k_ready, v_ready, k_empty, v_empty,
                     IDX, idx_row, count, QS, KS, SV, OUT, LSE, BOUNDS, BASES, kv_blocks, b, h, heads, n_q, n_kv, q_start, qk_scale,
                     HEAD_DIM, BLOCK_N, HALF, STAGES, DENSE, RETURN_LSE, P_OFFSET, SLACK, MASKED, NDIM, TILE,
                     INNER, FP8, SPLIT_RELEASE)),
        (_consumer, (1, q_smem, k_smem, v_smem, p_smem, ones, q_bar, turns, k_ready, v_ready, k_empty, v_empty,
                     IDX, idx_row, count, QS, KS, SV, OUT, LSE, BOUNDS, BASES, kv_blocks, b, h, heads, n_q, n_kv, q_start, qk_scale,
                     HEAD_DIM, BLOCK_N, HALF, STAGES, DENSE, RETURN_LSE, P_OFFSET, SLACK, MASKED, NDIM, TILE,
                     INNER, FP8, SPLIT_RELEASE)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                   IDX, idx_row, count, q_row, q_col, k_row, v_row, HALF, BLOCK_N, STAGES, DENSE, FP8)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


STAGES = 4  # K and V buffers in the ring (16.8 ms against 17.0 with two, dense 32k at head_dim 128, H100)
# In 16 bits K and V take twice the shared memory: two stages fit at head_dim 128 beside Q and P (194 KB of 227)
STAGES_16BIT = {64: 4, 128: 2}
# FP8 hands K back with V (apart it ran dense 32k in 16.67 ms against 16.28 and block masks 1-2 % faster, H200:
# no clear gain, one barrier more a block); 16 bits always apart (the module's docstring)
SPLIT_RELEASE = False
CONSUMER_REGS = 240  # registers per thread of a consumer warpgroup (232 spilled before the key scales were shared)
LOADER_REGS = 24
MAX_REGS = 168  # the kernel's budget per thread over its 12 warps: 3 x 168 = 2 x 240 + 24


DESCRIPTORS_OFF = ("the Gluon kernel loads its tiles through TMA, and tensor descriptors are turned off in this "
                   "process (set_tensor_descriptors(False) or NATSIM_NO_TMA=1).")


def refusal(dtype: torch.dtype, head_dim: int, capability: Optional[tuple[int, int]], q_block: int = BLOCK_M,
            kv_block: int = BLOCK_N, fp8: bool = True) -> Optional[str]:
    """None where the kernel runs a call of bf16 / fp16 inputs of `dtype` and `head_dim` with these blocks on a
    GPU of compute `capability` (None: CPU tensors, which run its torch reference), in FP8 (quantized by the
    kernel) or, with `fp8` False, on the inputs as they are (the 16-bit variant); else one sentence why not
    (what kernels/backends/gluon.py tabulates)."""
    name = _name(fp8)
    if capability is not None and capability[0] != 9:
        major, minor = capability
        return f"{name} runs on Hopper GPUs (compute capability 9.x), got {major}.{minor}."
    if capability is not None and not tensor_descriptors_enabled():
        return DESCRIPTORS_OFF
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{name} {'quantizes' if fp8 else 'runs'} bfloat16 or float16 inputs, got dtype={dtype}."
    if head_dim not in HEAD_DIMS:
        return f"{name} runs head_dim 64 or 128, got head_dim={head_dim}."
    if (q_block, kv_block) != (BLOCK_M, BLOCK_N):
        return f"{name} runs blocks of {BLOCK_M} x {BLOCK_N} tokens, got {q_block} x {kv_block}."
    return None


def _name(fp8: bool) -> str:
    """The kernel as a refusal names it."""
    return "the Gluon FP8 kernel" if fp8 else "the Gluon kernel's 16-bit variant"


def check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: bool = True) -> None:
    """What the kernel runs, refused with a sentence otherwise: Hopper GPUs (its wgmma and TMA; CPU tensors run
    the reference), bf16 or fp16 `[B, rows, heads, head_dim]` q, k, v on one device with k and v alike,
    head_dim 64 or 128; in FP8, or with `fp8` False on the inputs as they are."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q, k, v must be [B, rows, heads, head_dim] with k and v alike, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"{_name(fp8)} attends a sequence to itself: q, k and v must hold as many tokens, got "
                         f"{q.shape[1]} and {k.shape[1]}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("q, k and v must be on one device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    why = refusal(q.dtype, q.shape[-1], capability, fp8=fp8)
    if why is not None:
        elsewhere = capability is not None and capability[0] != 9
        raise ValueError(why + (" natsim's Triton kernels run these calls elsewhere." if elsewhere else ""))


def launch(x: Fp8Tensors, lists: Optional[BlockLists], scale: float, out_dtype: torch.dtype,
           return_lse: bool, tile_mask: Optional[TileMask] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on quantized tensors whose K scales are shared by blocks of `BLOCK_N` keys and whose V is
    key-major (`quantize(..., k_block=BLOCK_N, v_key_major=True)`): the output and the LSE of the scores it saw
    (K's mean removed; an empty tensor without `return_lse`). `tile_mask`: the GNA mask of the partial tiles the
    lists mark (kernels/gluon/tile_mask.py); without it no entry may be marked."""
    if not x.v_key_major:
        raise ValueError("the Gluon FP8 kernel reads V key-major within blocks of 128 keys: quantize with "
                         "v_key_major=True")
    batch, rows, heads, head_dim = x.q.shape
    v_t = x.v_t.view(batch * heads * head_dim, x.v_t.shape[-1])
    v_desc = TensorDescriptor.from_tensor(v_t, [head_dim, BLOCK_N],
                                          gl.NVMMASharedLayout.get_default_for([head_dim, BLOCK_N], gl.float8e4nv))
    descriptors = (_descriptor(x.q, HALF_M), _descriptor(x.k, BLOCK_N), v_desc)
    scales = (x.q_scale, x.k_scale, x.v_scale.contiguous())
    return _run(descriptors, scales, x.q, x.k.shape[1], lists, scale, out_dtype, return_lse, tile_mask)


def launch_16bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: Optional[BlockLists], scale: float,
                 return_lse: bool, tile_mask: Optional[TileMask] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same kernel on contiguous bf16 or fp16 `[B, rows, heads, head_dim]` q, k, v as they are: no scales,
    P in the inputs' dtype, V read `[keys, head_dim]`. Returns the output in q's dtype and the LSE (natural log;
    an empty tensor without `return_lse`)."""
    if not all(t.is_contiguous() for t in (q, k, v)):
        raise ValueError("the Gluon kernel reads contiguous q, k and v")
    batch, n_kv = q.shape[0], k.shape[1]
    if batch > 1 and n_kv % BLOCK_N:
        # The last key block runs past the sequence: in one launch its rows would be the next batch element's keys
        # and values, and P's zeros there times a non-finite value of theirs is NaN. One launch per element reads
        # past the tensor's end instead, where TMA fills zeros. (FP8 zero-pads its transposed V.)
        parts = [launch_16bit(q[i:i + 1], k[i:i + 1], v[i:i + 1], None if lists is None else lists.of_batch(i),
                              scale, return_lse, tile_mask) for i in range(batch)]
        out = torch.cat([part[0] for part in parts])
        lse = torch.cat([part[1] for part in parts]) if return_lse else parts[0][1]
        return out, lse
    descriptors = (_descriptor(q, HALF_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N))
    return _run(descriptors, None, q, k.shape[1], lists, scale, q.dtype, return_lse, tile_mask)


def _descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """The TMA descriptor of `[B, tokens, heads, head_dim]` `x` as its `[B * tokens, heads * head_dim]` matrix,
    in tiles of `block_rows` tokens of one head."""
    batch, tokens, heads, head_dim = x.shape
    dtype = _GLUON_DTYPES[x.dtype]
    return TensorDescriptor.from_tensor(x.view(batch * tokens, heads * head_dim), [block_rows, head_dim],
                                        gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], dtype))


def _run(descriptors: tuple, scales: Optional[tuple[torch.Tensor, ...]], q: torch.Tensor, n_kv: int,
         lists: Optional[BlockLists], scale: float, out_dtype: torch.dtype, return_lse: bool,
         tile_mask: Optional[TileMask]) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel on the three descriptors of `q` (the operand as the kernel reads it), k and v, with FP8's
    scales (q, k, v) or None (16-bit operands)."""
    if tile_mask is not None and lists is None:
        raise ValueError("a tile mask masks the partial tiles of block lists: pass the lists")
    batch, rows, heads, head_dim = q.shape
    device = q.device
    out = torch.empty((batch, rows, heads, head_dim), dtype=out_dtype, device=device)
    lse = torch.empty((batch, rows, heads) if return_lse else (0,), dtype=torch.float32, device=device)
    q_blocks, kv_blocks = triton.cdiv(rows, BLOCK_M), triton.cdiv(n_kv, BLOCK_N)
    if lists is None:
        counts = indices = torch.zeros(1, dtype=torch.int32, device=device)
        strides = (0, 0, 0, 0)
    else:
        lists.check(batch, heads, q_blocks, kv_blocks, device)
        counts, indices = lists.counts, lists.indices
        strides = (*lists.strides(counts), *lists.strides(indices))
    if tile_mask is None:
        bounds = bases = counts
    else:
        tile_mask.check(rows, n_kv, device)
        bounds, bases = tile_mask.bounds, tile_mask.bases
    q_scale, k_scale, v_scale = scales or (counts, counts, counts)  # 16-bit operands: never read
    with current_device_of(out):
        _forward_kernel[(q_blocks, batch * heads)](
            *descriptors, q_scale, k_scale, v_scale, out, lse, counts, indices, bounds, bases, heads, rows, n_kv,
            scale * LOG2E, *strides, kv_blocks, **kernel_options(head_dim, lists is None, return_lse, tile_mask,
                                                                 q.dtype))
    return out, lse


def kernel_options(head_dim: int, dense: bool, return_lse: bool, tile_mask: Optional[TileMask] = None,
                   operand: torch.dtype = torch.float8_e4m3fn) -> dict:
    """The kernel's compile-time arguments and launch options for one head dim, dense or over lists, with the
    `tile_mask` of the partial tiles it masks (None: every visited block whole), on operands of dtype `operand`
    (float8 e4m3, or bf16 / fp16 taken as they are)."""
    fp8 = operand == torch.float8_e4m3fn
    slack = RESCALE_SLACK if head_dim in LAZY_RESCALE_HEAD_DIMS else None
    masked = tile_mask is not None
    tile, inner = (tile_mask.tile, tile_mask.inner) if masked else ((1,), (1,))
    # In 16 bits P needs no headroom: it stays below 2 ** SLACK
    p_offset = P_OFFSET - (slack or 0.0) if fp8 else 0.0
    return dict(HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, STAGES=STAGES if fp8 else STAGES_16BIT[head_dim],
                DENSE=dense, RETURN_LSE=return_lse, P_OFFSET=p_offset, SLACK=slack, MASKED=masked, NDIM=len(tile),
                TILE=_padded3(tile), INNER=_padded3(inner), CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS,
                FP8=fp8, ONE_BITS=ONE_BITS[operand], SPLIT_RELEASE=SPLIT_RELEASE or not fp8, num_warps=4,
                maxnreg=MAX_REGS)


def _padded3(values: tuple[int, ...]) -> tuple[int, ...]:
    """Three per-dimension constants (the kernel indexes three; past NDIM they are never read)."""
    return tuple(values) + (1,) * (3 - len(values))
