"""The torch reference for GNA: exact element mask from natsim's window formula, queries in chunks.

The mask of a query at coordinate `x` is a product over dimensions of "key `y` is in `x`'s dilation group
and inside its window", with the window bounds from `natsim.dimension.key_ranges` (the one Python
definition of the window). Chunks keep memory at about `CHUNK_ELEMENTS` scores at a time, so the reference
also runs at real sizes on a GPU, in float64 if asked.

With `frame_offsets=(q0, k0, L0)` q holds frames `[q0, q0 + Tq)` of dimension 0 of a layout of `L0` frames and
k, v frames `[k0, k0 + Tk)` (natsim.distributed's halo exchange): the mask is the global one restricted to
those frames, and k, v must hold every frame the queries attend.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from natsim.dimension import key_ranges
from natsim.problem import BoolOrBools, IntOrInts

from ..common.backend import outside_autocast
from ..common.fp8 import Fp8Scales, check_fp8_call, lse_with_mean, prequantized, quantize, quantized_weights
from .checks import check_frame_offsets, check_frames, check_qkv, problem_of

CHUNK_ELEMENTS = 1 << 27


def _dim_tables(problem, device, frames=None) -> list[tuple[torch.Tensor, ...]]:
    """Per dimension: (group, start, end) of every query coordinate, and (group, in-group index) of every key
    coordinate; along dimension 0 only the query / key frames of `frames = (q0, q1, k0, k1)` if given."""
    tables = []
    for dim, (L, w, s, d, c) in enumerate(zip(problem.shape, problem.window, problem.stride, problem.dilation,
                                               problem.causal)):
        start, end = key_ranges(L, w, s, d, c)
        coord = torch.arange(L, device=device)
        group, start, end = coord % d, torch.as_tensor(start, device=device), torch.as_tensor(end, device=device)
        queries, keys = slice(None), slice(None)
        if dim == 0 and frames is not None:
            queries, keys = slice(frames[0], frames[1]), slice(frames[2], frames[3])
        tables.append((group[queries], start[queries], end[queries], group[keys], (coord // d)[keys]))
    return tables


def _chunk_mask(tables, coords: list[torch.Tensor]) -> torch.Tensor:
    """`[chunk, N_keys]` boolean mask for queries at per-dimension coordinates `coords`."""
    mask = None
    ndim = len(tables)
    for i, ((group, start, end, key_group, in_group), x) in enumerate(zip(tables, coords)):
        m = (key_group[None, :] == group[x][:, None]) & (in_group[None, :] >= start[x][:, None])
        m &= in_group[None, :] < end[x][:, None]
        view = [m.shape[0]] + [1] * ndim
        view[1 + i] = m.shape[1]
        m = m.reshape(view)
        mask = m if mask is None else mask & m
    return mask.reshape(mask.shape[0], -1)


@outside_autocast
def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
    frame_offsets: Optional[Sequence[int]] = None,
    quantized_probs: bool = False,
):
    """GNA on `[B, *shape, heads, head_dim]` tensors with the exact element mask, computed in chunks.

    Scores and softmax are computed in `compute_dtype` (float64 for float64 inputs, float32 otherwise);
    the output has q's dtype and the optional log-sum-exp `[B, *shape, heads]` is in `compute_dtype`.
    `frame_offsets=(q0, k0, L0)`: q and k, v hold frame ranges of a layout of `L0` frames (module docstring).
    `quantized_probs`: P @ V takes the softmax weights rounded as the FP8 kernels round them
    (kernels/common/fp8.py, `quantized_weights`).
    """
    frames = None
    if frame_offsets is None:
        shape = check_qkv(q, k, v)
        problem = problem_of(shape, window, stride, dilation, causal)
    else:
        problem, frames = check_frames(q, k, v, check_frame_offsets(frame_offsets), window, stride, dilation, causal)
        shape = tuple(q.shape[1:-2])
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    n = math.prod(shape)
    n_keys = math.prod(k.shape[1:-2])
    scale = head_dim**-0.5 if scale is None else scale
    qf = q.reshape(batch, n, heads, head_dim).to(compute_dtype)
    kf = k.reshape(batch, n_keys, heads, head_dim).to(compute_dtype)
    vf = v.reshape(batch, n_keys, heads, head_dim).to(compute_dtype)
    tables = _dim_tables(problem, q.device, frames)
    out = torch.empty((batch, n, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n, heads), dtype=compute_dtype, device=q.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * heads * n_keys))  # empty batches and heads too
    for first in range(0, n, chunk):
        rows = torch.arange(first, min(first + chunk, n), device=q.device)
        coords = list(torch.unravel_index(rows, shape))
        mask = _chunk_mask(tables, coords)
        scores = torch.einsum("bqhd,bkhd->bhqk", qf[:, rows], kf) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = quantized_weights(scores) if quantized_probs else torch.exp(scores - row_lse[..., None])
        out[:, rows] = torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)
        lse[:, rows] = row_lse.permute(0, 2, 1)
    out = out.reshape(q.shape)
    if return_lse:
        return out, lse.reshape(batch, *shape, heads)
    return out


@outside_autocast
def fp8_reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    scales: Optional[Fp8Scales] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """GNA with FP8's quantization rule (kernels/common/fp8.py) in float32: q, k, v quantized and dequantized,
    P rounded for P @ V as the kernels round it (against the row's final maximum). Output in q's dtype; the
    LSE that of the dequantized scores with K's mean added back (`lse_with_mean`). Inputs given in float8 e4m3
    with their `scales` are dequantized as they are (no mean), and the output is in `out_dtype` (bfloat16 by
    default)."""
    shape = check_qkv(q, k, v)
    problem_of(shape, window, stride, dilation, causal)
    _, scales, out_dtype = check_fp8_call(q, k, v, "fp8", scales, out_dtype)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    quantized = quantize(q, k, v) if scales is None else prequantized(q, k, v, scales)
    dequantized = (t.reshape(batch, *shape, heads, head_dim) for t in quantized.dequantized())
    result = reference_attention(*dequantized, window, stride, dilation, causal, scale, True, quantized_probs=True)
    out = result[0].to(q.dtype if out_dtype is None else out_dtype)
    if not return_lse:
        return out
    if quantized.k_mean is None:
        return out, result[1]
    return out, lse_with_mean(result[1], q, quantized.k_mean, scale)


@outside_autocast
def reference_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `reference_attention(q, k, v, ...)` for the output gradient `grad_out`, in `compute_dtype`.

    The softmax backward written out per chunk of queries (scores, exact softmax, `ds = p * (dO v^T -
    rowsum(dO * O))`), without autograd: memory stays at one chunk of scores, so full video layouts can be
    checked on a GPU (autograd through `reference_attention` would keep every chunk's probabilities).
    """
    shape = check_qkv(q, k, v)
    problem = problem_of(shape, window, stride, dilation, causal)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    n = math.prod(shape)
    scale = head_dim**-0.5 if scale is None else scale
    qf, kf, vf, gf = (t.reshape(batch, n, heads, head_dim).to(compute_dtype) for t in (q, k, v, grad_out))
    tables = _dim_tables(problem, q.device)
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * heads * n))
    for first in range(0, n, chunk):
        rows = torch.arange(first, min(first + chunk, n), device=q.device)
        mask = _chunk_mask(tables, list(torch.unravel_index(rows, shape)))
        scores = (torch.einsum("bqhd,bkhd->bhqk", qf[:, rows], kf) * scale).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
        delta = (out * gf[:, rows]).sum(-1).permute(0, 2, 1)  # [b, h, q]
        ds = probs * (torch.einsum("bqhd,bkhd->bhqk", gf[:, rows], vf) - delta[..., None])
        dq[:, rows] = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
        dk += torch.einsum("bhqk,bqhd->bkhd", ds, qf[:, rows]) * scale
        dv += torch.einsum("bhqk,bqhd->bkhd", probs, gf[:, rows])
    return tuple(t.reshape(q.shape) for t in (dq, dk, dv))
