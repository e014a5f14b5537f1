"""Regrouping heads for Ulysses (context parallelism): the copies between a rank's tokens with every head
(`[N, H, D]` rows, N the batch and token dimensions flattened) and the per-destination blocks an all-to-all sends
(`[P, N, c, D]`: for each of the P ranks, that rank's heads `[j h + lo, j h + hi)` of every row, `h = ceil(H /
P)`, `c = hi - lo`). Where P does not divide H the heads are padded to `P h`: heads past H are zeros in the blocks
and are not placed back, so that every rank attends `h` heads, some of the last ones zeros.

Both directions are bandwidth-bound strided copies. PyTorch copies a strided view element by element without
vector loads (about a third of an H200's bandwidth), one launch per tensor; here one Triton launch moves q, k
and v together (`pack_head_blocks`) or places one returned group (`place_head_blocks`), each row's `c * D`
contiguous values in 16-byte vectors (Wan 720p on 2 H200s: a group's packing 0.06 ms against three copies of
0.053 ms, a placement 0.022 ms against 0.053-0.070). CPU tensors take the same copies through torch, which is
also the kernels' reference. These are not operators: they run inside `natsim::cp_ulysses` (whose forward and
backward are the registered operators, opaque to torch.compile and refused under CUDA graph capture), record no
gradients, and refuse inputs that require grad with a sentence.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from natsim.partition import heads_per_rank

from .backend import use_triton
from .devices import on_their_device

MAX_TENSORS = 3
_BLOCK_ROWS = 16
_MAX_BLOCK_COLUMNS = 1024


@triton.jit
def _regroup_kernel(rows0, rows1, rows2, stride0, stride1, stride2, blocks, n_rows, row_width, rank_stride, first,
                    width, tensor_stride, column_blocks, TO_BLOCKS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                    BLOCK_COLUMNS: tl.constexpr):
    """One program: BLOCK_ROWS rows x BLOCK_COLUMNS values of destination `program_id(1)`'s block of tensor
    `program_id(2)`, copied from the rows to the blocks (TO_BLOCKS; values past a row's `row_width`, padded
    heads, as zeros) or back (those values not written)."""
    pid, rank, tensor = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = (pid // column_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = (pid % column_blocks) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    keep = (row < n_rows)[:, None] & (column < width)[None, :]
    row = row.to(tl.int64)
    if tensor == 0:
        base, row_stride = rows0, stride0
    elif tensor == 1:
        base, row_stride = rows1, stride1
    else:
        base, row_stride = rows2, stride2
    in_row = rank * rank_stride + first + column
    real = keep & (in_row < row_width)[None, :]
    in_rows = base + row[:, None] * row_stride + in_row[None, :]
    in_blocks = (blocks + tensor.to(tl.int64) * tensor_stride + (rank.to(tl.int64) * n_rows + row)[:, None] * width
                 + column[None, :])
    if TO_BLOCKS:
        tl.store(in_blocks, tl.load(in_rows, mask=real, other=0.0), mask=keep)
    else:
        tl.store(in_rows, tl.load(in_blocks, mask=real), mask=real)


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`[..., H, D]` as `[N, H * D]` rows without a copy, or None where its heads and channels are not one
    contiguous row (then the torch copy runs)."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return None
    try:
        return x.view(-1, x.shape[-2] * x.shape[-1]) if x.dim() > 2 else None
    except RuntimeError:
        return None


def _check(tensors: Sequence[torch.Tensor], parts: int, span: tuple[int, int]) -> tuple[int, int]:
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"regrouping moves 1 to {MAX_TENSORS} tensors at once, got {len(tensors)}.")
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in tensors):
        raise ValueError("the tensors regrouped together must share shape, dtype and device, got "
                         f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in tensors]}.")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("the head regrouping copies do not record gradients (natsim::cp_ulysses moves tensors "
                         "with them inside its own forward and backward): call them on tensors that do not require "
                         "grad, or under torch.no_grad().")
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got parts={parts}.")
    per_rank = heads_per_rank(first.shape[-2], parts)
    lo, hi = span
    if not 0 <= lo < hi <= per_rank:
        raise ValueError(f"span must be heads [lo, hi) of the {per_rank} each rank attends, got span={span}.")
    return per_rank, hi - lo


@on_their_device
def _launch(rows: Sequence[torch.Tensor], blocks: torch.Tensor, parts: int, per_rank: int, span: tuple[int, int],
            head_dim: int, to_blocks: bool) -> None:
    n_rows, width = rows[0].shape[0], (span[1] - span[0]) * head_dim
    block_columns = min(triton.next_power_of_2(width), _MAX_BLOCK_COLUMNS)
    column_blocks = triton.cdiv(width, block_columns)
    padded = list(rows) + [rows[0]] * (MAX_TENSORS - len(rows))
    grid = (triton.cdiv(n_rows, _BLOCK_ROWS) * column_blocks, parts, len(rows))
    _regroup_kernel[grid](*padded, *(r.stride(0) for r in padded), blocks, n_rows, rows[0].shape[1],
                          per_rank * head_dim, span[0] * head_dim, width, parts * n_rows * width, column_blocks,
                          TO_BLOCKS=to_blocks, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLUMNS=block_columns)


def pack_head_blocks(tensors: Sequence[torch.Tensor], parts: int, span: tuple[int, int]) -> torch.Tensor:
    """`[len(tensors), P, *x.shape[:-2], c, D]`: for each tensor `x` (`[..., H, D]`, all alike) and each rank j
    of `P = parts`, its heads `[j h + lo, j h + hi)` (`span = (lo, hi)`, `h = ceil(H / P)`, heads past H as
    zeros); each `[j]` block is contiguous, what an all-to-all sends rank j. One launch for all of them on a
    GPU."""
    per_rank, heads = _check(tensors, parts, span)
    x = tensors[0]
    packed = x.new_empty((len(tensors), parts, *x.shape[:-2], heads, x.shape[-1]))
    rows = [_as_rows(t) for t in tensors]
    if use_triton(x) and all(r is not None for r in rows) and packed.numel():
        _launch(rows, packed, parts, per_rank, span, x.shape[-1], to_blocks=True)
        return packed
    lo, hi = span
    for out, t in zip(packed, tensors):
        t = torch.nn.functional.pad(t, (0, 0, 0, parts * per_rank - t.shape[-2]))  # zero heads past H, if any
        out.copy_(t.unflatten(-2, (parts, per_rank))[..., lo:hi, :].movedim(-3, 0))
    return packed


def place_head_blocks(blocks: torch.Tensor, out: torch.Tensor, parts: int, span: tuple[int, int]) -> None:
    """The inverse of `pack_head_blocks` for one tensor: `blocks`, `[P, *out.shape[:-2], c, D]` contiguous (rank j's
    block at `[j]`), copied into heads `[j h + lo, j h + hi)` of `out` (`[..., H, D]`), those past H left out."""
    per_rank, heads = _check([out], parts, span)
    expected = (parts, *out.shape[:-2], heads, out.shape[-1])
    if tuple(blocks.shape) != expected or blocks.dtype != out.dtype or not blocks.is_contiguous():
        raise ValueError(f"blocks must be contiguous {expected} of {out.dtype}, got {tuple(blocks.shape)} of "
                         f"{blocks.dtype} (contiguous: {blocks.is_contiguous()}).")
    rows = _as_rows(out)
    if use_triton(out) and rows is not None and out.numel():
        _launch([rows], blocks, parts, per_rank, span, out.shape[-1], to_blocks=False)
        return
    lo, hi = span
    if parts * per_rank == out.shape[-2]:
        out.unflatten(-2, (parts, per_rank))[..., lo:hi, :].copy_(blocks.movedim(0, -3))
        return
    for j, block in enumerate(blocks):
        first, last = j * per_rank + lo, min(j * per_rank + hi, out.shape[-2])
        if last > first:
            out[..., first:last, :].copy_(block[..., :last - first, :])
