"""The Gluon kernel's front: `fp8_block_attention` and its registered operator `natsim::gluon_fp8_forward`,
which quantizes bf16 / fp16 inputs by natsim's FP8 rule (K's scales shared by key blocks) and runs the kernel
(kernels/gluon/forward.py) on a Hopper GPU, or the rule's torch reference on CPU tensors; and
`gluon_block_attention` with its operator `natsim::gluon_16bit_forward`, the same kernel on the bf16 / fp16 inputs
as they are, or float32 attention under the same blocks on CPU tensors. `sparse_attention` and `gna_attention`
with `precision="fp8"` reach the first where the kernel takes the call, `sparse_attention` in 16 bits the second
(kernels/sparse/api.py says where)."""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton

from natsim import Problem

from ..common.checks import check_scale
from ..common.fp8 import quantize, refuse_gradients
from .forward import BLOCK_M, BLOCK_N, BlockLists, TileMask, check_call, launch, launch_16bit
from .tile_mask import gna_block_lists, gna_tile_mask


def fp8_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        blocks: Union[None, torch.Tensor, BlockLists] = None, scale: Optional[float] = None,
                        return_lse: bool = False):
    """Attention of bf16 / fp16 `[B, rows, heads, head_dim]` q, k, v in FP8 over the 128 x 128 blocks `blocks`
    keeps (a boolean `[B|1, H|1, q_blocks, kv_blocks]` mask or its `BlockLists`; every block where None):
    quantized by natsim's FP8 rule with K's scales shared by its blocks of 128 keys (kernels/common/fp8.py),
    then the warp-specialized kernel on a Hopper GPU, or the rule's torch reference on CPU tensors. A registered
    operator (`natsim::gluon_fp8_forward`): it compiles with `torch.compile(fullgraph=True)` and replays in CUDA
    graphs. Returns the output in q's dtype, and with `return_lse` the LSE `[B, rows, heads]` (float32,
    natural log) of the unquantized scores' definition."""
    refuse_gradients("the Gluon FP8 kernel", q, k, v)  # the operator has no backward: train in bf16
    out, lse = gluon_fp8_forward(q, k, v, *_operator_arguments(q, blocks, scale), return_lse)
    return (out, lse) if return_lse else out


def gluon_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          blocks: Union[None, torch.Tensor, BlockLists] = None, scale: Optional[float] = None,
                          return_lse: bool = False):
    """Attention of bf16 / fp16 `[B, rows, heads, head_dim]` q, k, v over the 128 x 128 blocks `blocks` keeps (a
    boolean `[B|1, H|1, q_blocks, kv_blocks]` mask or its `BlockLists`; every block where None) on the Gluon
    kernel's 16-bit variant (the FP8 kernel's design on the inputs as they are: no quantization, P in the inputs'
    dtype, fp32 accumulation) on a Hopper GPU, or float32 attention under the same blocks on CPU tensors. A
    registered operator (`natsim::gluon_16bit_forward`) without a backward: it compiles with
    `torch.compile(fullgraph=True)` and replays in CUDA graphs; inputs that require grad are refused (natsim's
    Triton kernels train). Returns the output in q's dtype, and with `return_lse` the LSE `[B, rows, heads]`
    (float32, natural log; -inf for a row that attends nothing, whose output is 0)."""
    refuse_16bit_gradients(q, k, v)
    out, lse = gluon_16bit_forward(q, k, v, *_operator_arguments(q, blocks, scale), return_lse)
    return (out, lse) if return_lse else out


def _operator_arguments(q: torch.Tensor, blocks: Union[None, torch.Tensor, BlockLists], scale: Optional[float]
                        ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
    """The operators' `counts`, `indices` (None for every block) and `scale` of a front's arguments."""
    lists = BlockLists.from_blocks(blocks) if isinstance(blocks, torch.Tensor) else blocks
    counts, indices = (None, None) if lists is None else (lists.counts, lists.indices)
    return counts, indices, q.shape[-1] ** -0.5 if scale is None else check_scale(scale)


NO_BACKWARD_16BIT = ("the Gluon kernel's 16-bit variant has no backward pass, and an input requires grad: call it "
                     "under torch.no_grad() / torch.inference_mode(), or train on natsim's Triton kernels "
                     "(sparse_attention(..., backend='triton')).")


def refuse_16bit_gradients(*tensors: torch.Tensor) -> None:
    """The 16-bit variant has no backward pass: inputs that require grad are refused with a sentence."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(NO_BACKWARD_16BIT)


@torch.library.custom_op("natsim::gluon_16bit_forward", mutates_args=())
def gluon_16bit_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: Optional[torch.Tensor],
                        indices: Optional[torch.Tensor], scale: float, return_lse: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gluon_block_attention`'s operator: the kernel on CUDA tensors, float32 attention under the lists' blocks
    on CPU tensors; the LSE is empty without `return_lse`."""
    lists = None if counts is None else BlockLists(counts, indices)
    check_call(q, k, v, fp8=False)
    check_scale(scale)  # the kernel takes each row's maximum of the unscaled scores
    if not q.is_cuda:
        return _cpu_16bit(q, k, v, lists, scale, return_lse)
    return launch_16bit(q.contiguous(), k.contiguous(), v.contiguous(), lists, scale, return_lse)


@gluon_16bit_forward.register_fake
def _(q, k, v, counts, indices, scale, return_lse):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1] if return_lse else (0,), dtype=torch.float32)


def _cpu_16bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: Optional[BlockLists], scale: float,
               return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What the 16-bit variant computes, in float32: attention under the lists' 128 x 128 blocks."""
    from ..sparse.reference import sparse_reference  # the sparse room routes 16-bit calls here
    batch, rows, heads, _ = q.shape
    q_blocks, kv_blocks = triton.cdiv(rows, BLOCK_M), triton.cdiv(k.shape[1], BLOCK_N)
    mask = torch.ones(1, 1, q_blocks, kv_blocks, dtype=torch.bool)
    if lists is not None:
        lists.check(batch, heads, q_blocks, kv_blocks, q.device)
        mask = lists.mask()
    out, lse = sparse_reference(q.float(), k.float(), v.float(), mask, BLOCK_M, BLOCK_N, scale, return_lse=True)
    return out.to(q.dtype).contiguous(), (lse.contiguous() if return_lse else lse.new_empty(0))


def gna_fp8_ordered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem, tile: tuple[int, ...],
                    scale: float, return_lse: bool, rows: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA of `problem` in FP8 on `[B, tokens, heads, head_dim]` q, k, v in the 128-token `tile`'s order
    (queries and keys), or with `rows` (kernels/gna/permute.py's `source_rows` of that order) on the layout's
    tokens row-major, which the quantization reads in that order: the simulator's visited blocks as the kernel's
    lists, the partial ones masked inside by the tile mask (kernels/gluon/tile_mask.py). Returns the output and
    the LSE (empty without `return_lse`) in the tile's order."""
    lists, partial = gna_block_lists(problem, tuple(tile), q.device)
    masked = gna_tile_mask(problem, tuple(tile), q.device) if partial else None
    mask_args = (masked.bounds, masked.bases, list(masked.tile)) if masked is not None else (None, None, None)
    return gluon_fp8_forward(q, k, v, lists.counts, lists.indices, scale, return_lse, *mask_args, rows)


@torch.library.custom_op("natsim::gluon_fp8_forward", mutates_args=())
def gluon_fp8_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: Optional[torch.Tensor],
                      indices: Optional[torch.Tensor], scale: float, return_lse: bool,
                      bounds: Optional[torch.Tensor] = None, bases: Optional[torch.Tensor] = None,
                      tile: Optional[list[int]] = None, rows: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_block_attention`'s operator: the kernel on CUDA tensors, the rule's reference on CPU tensors; the LSE
    is empty without `return_lse`. `bounds`, `bases` and `tile`: a GNA call's `TileMask`
    (kernels/gluon/tile_mask.py), for the partial tiles its lists mark. `rows` (int32 `[rows]`): the call
    attends the inputs' rows in this order (-1: a padding row), read as they are quantized; the output and the
    LSE come in that order."""
    lists = None if counts is None else BlockLists(counts, indices)
    tile_mask = None if bounds is None else TileMask(bounds, bases, tuple(tile))
    check_call(q, k, v)
    check_scale(scale)  # the kernel takes each row's maximum of the unscaled scores
    _check_rows(q, k, rows)
    if not q.is_cuda:
        return _cpu_reference(q, k, v, lists, scale, return_lse, tile_mask, rows)
    x = quantize(q, k, v, k_block=BLOCK_N, v_key_major=True, q_dot_mean=return_lse, rows=rows)
    out, lse = launch(x, lists, scale, q.dtype, return_lse, tile_mask)
    # the kernel's LSE is of the scores with K's mean removed: add `scale * q . mean(k)` back, taken in the
    # quantization's read of q
    return out, (lse + scale * x.q_dot_mean if return_lse else lse)


@gluon_fp8_forward.register_fake
def _(q, k, v, counts, indices, scale, return_lse, bounds=None, bases=None, tile=None, rows=None):
    shape = q.shape if rows is None else (q.shape[0], rows.shape[0], *q.shape[2:])
    lse_shape = shape[:-1] if return_lse else (0,)
    return q.new_empty(shape), q.new_empty(lse_shape, dtype=torch.float32)


def _check_rows(q: torch.Tensor, k: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
    """An order is int32 `[rows]` on the inputs' device, over q and k of as many tokens (one order for all three)."""
    if rows is None:
        return
    if rows.dim() != 1 or rows.dtype != torch.int32 or rows.device != q.device:
        raise ValueError(f"rows must be an int32 [rows] tensor on q's device, got shape {tuple(rows.shape)}, "
                         f"dtype {rows.dtype}, device {rows.device}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"one order reads q, k and v: they must hold as many tokens, got {q.shape[1]} and "
                         f"{k.shape[1]}")


def _cpu_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: Optional[BlockLists], scale: float,
                   return_lse: bool, tile_mask: Optional[TileMask] = None, order: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's reference (K's scales shared by blocks of 128 keys, P rounded against the row's final maximum
    and summed as rounded) in float32 under the lists' block mask, and inside the partial tiles they mark under
    the tile mask; on the rows of `order` where given (K's mean and V's scales over the inputs' rows)."""
    from ..sparse.reference import attention_under, sparse_reference  # the sparse room routes FP8 calls here
    x = quantize(q, k, v, k_block=BLOCK_N, v_key_major=True, q_dot_mean=return_lse, rows=order)
    batch, rows, heads, _ = x.q.shape
    n_kv = x.k.shape[1]
    q_blocks, kv_blocks = triton.cdiv(rows, BLOCK_M), triton.cdiv(n_kv, BLOCK_N)
    mask = torch.ones(1, 1, q_blocks, kv_blocks, dtype=torch.bool)
    if lists is not None:
        lists.check(batch, heads, q_blocks, kv_blocks, q.device)
        mask = lists.mask()
    if tile_mask is None:
        out, lse = sparse_reference(*x.dequantized(), mask, BLOCK_M, BLOCK_N, scale, return_lse=True,
                                    quantized_probs=True, p_sum="rounded")
    else:
        tile_mask.check(rows, n_kv, q.device)
        if lists is None:
            raise ValueError("a tile mask masks the partial tiles of block lists: pass the lists")

        def elements(blocks: torch.Tensor) -> torch.Tensor:  # a block mask as a mask of the call's elements
            return blocks.repeat_interleave(BLOCK_M, -2).repeat_interleave(BLOCK_N, -1)[..., :rows, :n_kv]

        partial = elements(lists.mask(partial=True))
        allowed = (elements(mask) & ~partial) | (partial & tile_mask.dense()[:, :n_kv])
        dq, dk, dv = (t.float() for t in x.dequantized())
        out, lse = attention_under(dq, dk.permute(0, 2, 3, 1), dv.transpose(1, 2), allowed, scale,
                                   quantized_probs=True, p_sum="rounded")
    # the LSE of the scores with K's mean removed, plus `scale * q . mean(k)` per row: that of the call's scores
    lse = lse + scale * x.q_dot_mean if return_lse else lse.new_empty(0)
    return out.to(q.dtype).contiguous(), lse.contiguous()  # the kernel's layout, which the fake gives

