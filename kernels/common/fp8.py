"""FP8 attention's quantization rule, shared by the kernels (kernels/gna/forward.py, kernels/sparse/forward.py)
and the torch references that check them.

The rule (float8 e4m3, largest finite value 448; the scores and the output accumulate in fp32):

- Q: one scale per token and head, `amax(|q_row|) / 448`. The kernels fold it into the softmax scale of their
  row, so it costs nothing per score.
- K: its mean over the real tokens (per batch and head) is subtracted first, as SageAttention does: that adds
  `q . mean` to every score of a query row, which the softmax removes exactly, and it shrinks the values that
  the 3-bit mantissa must carry where the keys share a large common component (real models' keys do). Then one
  scale per token and head, applied to each score's column (one multiply per score); or, for kernels that visit
  whole key blocks (`k_block`), one scale per block of `k_block` consecutive keys and head, which joins the
  row's scale (no multiply per score, and no vector of key scales held beside the scores). A floating-point
  format rounds each value relative to itself, so a block's shared scale loses nothing but range: only keys
  more than 2^15 times smaller than their block's largest would fall to e4m3's subnormals.
- V: one scale per channel (per batch and head, over the real tokens), applied to the output once at the end.
  The kernels read V transposed, `[B, heads, head_dim, rows]` with `rows` padded to 16: Hopper's FP8 matrix
  instructions take their second operand with the reduced dimension (the keys, for P @ V) contiguous. The
  Gluon kernel reads its keys key-major within blocks of 128 (`key_major_positions`, rows padded to 128),
  the order in which it stores P.
- P: quantized per tile with a static scale of 448: the kernels compute `448 * exp(s - m)` directly (the
  offset `log2(448)` joins the subtracted running maximum, so no multiply) and cast it to e4m3; the running
  sum counts the unrounded values in the Triton kernels and the rounded ones in the Gluon kernel, whose tensor
  cores add P up beside P @ V (`P_SUMS`; the two differ by the rounding errors' mean, far inside FP8's
  tolerance). Rows whose running maximum has not settled round against it, so the
  kernels' P rounding depends on the order of the KV tiles; the reference rounds against the row's final
  maximum. Both are the rule; tests compare them within FP8 tolerance, not bit for bit.

Inputs already in float8 e4m3 (`Fp8Scales`) skip the rule's Q, K and V steps: the kernels read the given tensors
and scales as they are (V transposed into its padded rows, a copy), no K mean is removed, and P follows the rule.

Triton 3.6's interpreter rounds fp32 -> float8 casts wrongly (it truncates, and by a whole binade in places)
but converts exactly representable values exactly, so kernels under the interpreter round P in fp32 first
(`round_to_e4m3`, `EXACT_CAST`); on the GPU the hardware conversion rounds to nearest even.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .devices import on_their_device
from .headdim import HEAD_DIMS, HeadSplit, head_dim_refusal, head_split, next_power_of_two

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
LOG2_E4M3_MAX = math.log2(E4M3_MAX)
P_OFFSET = tl.constexpr(LOG2_E4M3_MAX)  # kernels compute exp2(s - m + P_OFFSET) = 448 * exp2(s - m)
PRECISIONS = (None, "fp8")
FLOAT8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                         "float8_e5m2fnuz") if hasattr(torch, name))
OUT_DTYPES = (torch.bfloat16, torch.float16)  # what a call on float8 inputs returns
ROW_ALIGNMENT = 16  # rows of the transposed V are padded to whole 16-byte units (tensor descriptor strides)
KEY_MAJOR_BLOCK = 128  # keys per block of a key-major transposed V
P_SUMS = ("exact", "rounded")  # a softmax row's sum taken over P before or after its rounding to e4m3


def check_precision(precision: Optional[str]) -> Optional[str]:
    """`precision` is None (compute in the inputs' dtype) or "fp8" (quantize to float8 e4m3 inside the call)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be None (the inputs' dtype) or 'fp8', got precision={precision!r}.")
    return precision


def refuse_gradients(name: str, *tensors: Optional[torch.Tensor]) -> None:
    """FP8 attention is for inference: inputs (q, k, v and any given scales) that require grad are refused with a
    sentence."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{name} with precision='fp8' is for inference and has no backward pass, and an input requires grad. "
            "Train in bfloat16 (precision=None), or call it under torch.no_grad() / torch.inference_mode()."
        )


@dataclass(frozen=True)
class Fp8Scales:
    """The scales of q, k and v given to `gna_attention` / `sparse_attention` already in float8 e4m3
    (`[B, *tokens, heads, head_dim]`): the call attends `q.float() * q_scale[..., None]`,
    `k.float() * k_scale[..., None]` and V with `v_scale` applied per channel, `v.float()[b, ..., h, d] *
    v_scale[b, h, d]`. Every scale is a float32 tensor on the inputs' device:

    - `q_scale`, `k_scale`: one per token and head, `[B, *tokens, heads]`, or any shape that broadcasts to it by
      torch's rules: a 0-d tensor (one scale for the whole tensor), `[heads]` (per head), `[B, 1, ..., 1, heads]`
      (per batch and head).
    - `v_scale`: one per channel, `[B, heads, head_dim]`, or any shape that broadcasts to it: 0-d, `[heads, 1]`
      (per head), `[B, heads, 1]`, `[head_dim]`.

    The call expands them to those full shapes once (the layout the kernels read). Scales must be positive and
    finite (the kernels fold q's into each row's running maximum, which takes it positive), and their values are
    not checked: that would wait on the GPU on every call, which a CUDA graph cannot capture. Nothing else is
    applied to the given values; in particular no K mean is removed (kernels/common/fp8.py's rule removes it
    before quantizing): a caller who wants that smoothing subtracts K's mean over the tokens before quantizing,
    and the returned LSE is then that of the smoothed scores.
    """

    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("q_scale", "k_scale", "v_scale"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a float32 torch.Tensor, got {type(t).__name__}.")
            if t.dtype != torch.float32:
                raise TypeError(f"{name} must be a float32 torch.Tensor, got {name}.dtype={t.dtype}.")


def check_fp8_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: Optional[str],
                   scales: Optional[Fp8Scales], out_dtype: Optional[torch.dtype]
                   ) -> tuple[Optional[str], Optional[Fp8Scales], Optional[torch.dtype]]:
    """A call's precision arguments, checked against its `[B, *tokens, heads, head_dim]` q, k, v: returns
    `(precision, scales, out_dtype)`. For bf16 / fp16 (or other) inputs `(precision, None, None)`; `scales` and
    `out_dtype` are refused there. For inputs in float8 e4m3 (all three): `("fp8", scales, out_dtype)` with the
    scales expanded to their full shapes (contiguous float32 `[B, *tokens, heads]`, `[B, *tokens, heads]`,
    `[B, heads, head_dim]`) and the output dtype (bfloat16 unless float16 is asked for); precision None is read
    as "fp8", which float8 inputs imply."""
    check_precision(precision)
    if not any(t.dtype in FLOAT8_DTYPES for t in (q, k, v)):
        if scales is not None:
            raise ValueError(f"scales are for q, k and v given in float8 e4m3, got q.dtype={q.dtype}: pass "
                             f"{q.dtype} inputs without scales (precision='fp8' quantizes them inside the call).")
        if out_dtype is not None:
            raise ValueError(f"out_dtype is for q, k and v given in float8 (the output of {q.dtype} inputs keeps "
                             f"their dtype), got out_dtype={out_dtype}.")
        return precision, None, None
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must have the same dtype, got q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}."
        )
    if q.dtype != E4M3:
        raise ValueError(f"float8 inputs must be torch.float8_e4m3fn (the FP8 kernels' format), got dtype={q.dtype}.")
    if scales is None:
        raise ValueError("q, k and v in float8 need their scales: pass scales=Fp8Scales(q_scale, k_scale, v_scale) "
                         "(one per token and head for q and k, one per channel for v), got scales=None.")
    if not isinstance(scales, Fp8Scales):
        raise TypeError(f"scales must be a natsim.kernels.Fp8Scales, got {type(scales).__name__}.")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got out_dtype={out_dtype}.")
    if q.dim() < 3 or k.dim() < 3 or v.dim() < 3:
        raise ValueError(f"q, k and v must be [batch, *tokens, heads, head_dim], got q.shape={tuple(q.shape)}.")
    full = []
    for name, t, shape, layout in (
            ("q_scale", scales.q_scale, q.shape[:-1], "[batch, *tokens, heads]"),
            ("k_scale", scales.k_scale, k.shape[:-1], "[batch, *tokens, heads]"),
            ("v_scale", scales.v_scale, torch.Size((v.shape[0], v.shape[-2], v.shape[-1])),
             "[batch, heads, head_dim]")):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device, got {name}.device={t.device} and q.device={q.device}.")
        try:
            fits = torch.broadcast_shapes(t.shape, shape) == shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"{name} must broadcast to {layout} = {tuple(shape)} (torch's broadcasting rules), "
                             f"got {name}.shape={tuple(t.shape)}.")
        full.append(t.expand(shape).contiguous())
    return "fp8", Fp8Scales(*full), out_dtype


def scale_tensors(scales: Optional[Fp8Scales]) -> tuple[Optional[torch.Tensor], ...]:
    """`(q_scale, k_scale, v_scale)` as the registered operators take them (three Nones without scales)."""
    return (None, None, None) if scales is None else (scales.q_scale, scales.k_scale, scales.v_scale)


def scales_from(q_scale: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                v_scale: Optional[torch.Tensor]) -> Optional[Fp8Scales]:
    """The registered operators' three scale arguments as `Fp8Scales` (None when none is given)."""
    if q_scale is None and k_scale is None and v_scale is None:
        return None
    return Fp8Scales(q_scale, k_scale, v_scale)


@dataclass(frozen=True)
class Fp8Tensors:
    """Q, K and V in float8 as the kernels read them, for `[B, rows, heads, head_dim]` inputs: quantized by the
    rule above, or given in float8 (`prequantized_rows`).

    `q`, `k`: float8 e4m3 `[B, rows, heads, head_dim]` (`fp8_rows`' layout: contiguous, or heads 16 bytes
    apart); `q_scale`, `k_scale`: float32 `[B, rows, heads]`; `v_t`: float8 e4m3 `[B, heads, head_dim,
    rows_padded]` (V transposed, zeros past the rows; with `v_key_major`, key `r` at `key_major_positions(r)`);
    `v_scale`: float32 `[B, heads, head_dim]`; `k_mean`: K's mean `[B, heads, head_dim]`, None for inputs given
    in float8 (no mean removed); `q_dot_mean`: `q . mean(k)` per row `[B, rows, heads]` (float32, from the
    unquantized q) where the quantization was asked for it, which the LSE of the scores with K's mean removed
    lacks (`lse_with_mean`). Dequantized, `q ~ q_fp8 * q_scale[..., None]`, `k - mean ~ k_fp8 * k_scale[...,
    None]`, `v ~ v_t.transpose * v_scale`.
    """

    q: torch.Tensor
    k: torch.Tensor
    v_t: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: Optional[torch.Tensor]
    v_key_major: bool = False
    q_dot_mean: Optional[torch.Tensor] = None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (mean removed) and V as the kernels see them, `[B, rows, heads, head_dim]` in `dtype`."""
        q = self.q.to(dtype) * self.q_scale[..., None].to(dtype)
        k = self.k.to(dtype) * self.k_scale[..., None].to(dtype)
        rows = self.k.shape[1]
        v_t = self.v_t[..., key_major_positions(rows, self.v_t.device)] if self.v_key_major else self.v_t[..., :rows]
        v = v_t.permute(0, 3, 1, 2).to(dtype) * self.v_scale[:, None].to(dtype)
        return q, k, v


def key_major_positions(rows: int, device) -> torch.Tensor:
    """Where a key-major transposed V keeps keys `0 .. rows-1`: within each block of 128 keys, key
    `8 g + 2 q + e` (q < 4, e < 2) at `32 q + 2 g + e`. That is the Gluon kernel's P order: the matrix
    instruction leaves a thread its row's scores in columns `8 g + 2 q + e` of one q, which it stores as 32
    consecutive bytes (kernels/gluon/forward.py)."""
    r = torch.arange(rows, device=device)
    j = r % KEY_MAJOR_BLOCK
    return r - j + 32 * (j // 2 % 4) + 2 * (j // 8) + j % 2


def column_statistics(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K's mean and V's per-channel scale over the tokens of `[B, *tokens, heads, head_dim]` tensors:
    `([B, heads, head_dim], [B, heads, head_dim])`, float32. One Triton pass over both on CUDA tensors and in the
    interpreter (`_statistics_kernel`: per chunk of rows a partial sum and maximum, then a sum and a maximum over the
    chunks, in a fixed order: the same bits on every call), torch reductions otherwise."""
    if k.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return _statistics_triton(*(t.reshape(t.shape[0], -1, *t.shape[-2:]) for t in (k, v)))
    dims = tuple(range(1, k.dim() - 2))
    k_mean = torch.mean(k, dim=dims, dtype=torch.float32)
    v_amax = torch.maximum(torch.amax(v, dim=dims), -torch.amin(v, dim=dims)).float()
    return k_mean, _scale_of(v_amax)


STATISTICS_ROWS = 1024  # rows per program of the statistics kernel, `STATISTICS_BLOCK` at a time
STATISTICS_BLOCK = 64


@on_their_device
def _statistics_triton(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`column_statistics` of `[B, rows, heads, head_dim]` k and v through `_statistics_kernel`."""
    batch, rows, heads, head_dim = k.shape
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    chunks = triton.cdiv(rows, STATISTICS_ROWS)
    sums = torch.empty((chunks, batch, heads, head_dim), dtype=torch.float32, device=k.device)
    peaks = torch.empty_like(sums)
    _statistics_kernel[(chunks, batch * heads)](
        k, v, sums, peaks, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), rows, heads,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_two(head_dim), BLOCK_R=STATISTICS_BLOCK, ROWS=STATISTICS_ROWS)
    return sums.sum(0) / rows, _scale_of(peaks.amax(0))


@triton.jit
def _statistics_kernel(K, V, SUMS, PEAKS, k_stride_b, k_stride_r, k_stride_h, v_stride_b, v_stride_r, v_stride_h,
                       rows, heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       ROWS: tl.constexpr):
    """One chunk of ROWS rows of one (batch, head): K's column sums and V's column absolute maxima over them, in
    float32, into `SUMS` and `PEAKS` `[chunks, B, heads, head_dim]` (columns past head_dim not stored)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    peak = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, ROWS, BLOCK_R):
        r = (chunk * ROWS + start + tl.arange(0, BLOCK_R)).to(tl.int64)
        ok = (r < rows)[:, None] & d_ok[None, :]
        k = tl.load(K + b * k_stride_b + h * k_stride_h + r[:, None] * k_stride_r + d[None, :], mask=ok, other=0.0)
        v = tl.load(V + b * v_stride_b + h * v_stride_h + r[:, None] * v_stride_r + d[None, :], mask=ok, other=0.0)
        total += tl.sum(k.to(tl.float32), 0)
        peak = tl.maximum(peak, tl.max(tl.abs(v.to(tl.float32)), 0))
    out = ((chunk * tl.num_programs(1) + bh) * HEAD_DIM).to(tl.int64) + d
    tl.store(SUMS + out, total, mask=d_ok)
    tl.store(PEAKS + out, peak, mask=d_ok)


def quantize_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor,
                  v_scale: torch.Tensor, k_block: int = 1, v_key_major: bool = False,
                  q_dot_mean: bool = False, q_rows: Optional[torch.Tensor] = None,
                  kv_rows: Optional[torch.Tensor] = None) -> Fp8Tensors:
    """Quantize `[B, rows, heads, head_dim]` q, k, v by the rule, with K's mean and V's scales given (taken over
    the real tokens: rows here may include padding); K's scales shared by blocks of `k_block` rows (1: one per
    row; still stored one per row); V's keys key-major within blocks of 128 where `v_key_major` (the Gluon
    kernel's order); with `q_dot_mean`, also `q . mean(k)` per row (`Fp8Tensors.q_dot_mean`), taken in the same
    read of q. `q_rows` / `kv_rows` (int32 `[rows out]`, kernels/gna/permute.py's `source_rows`) gather as they
    quantize: output row `r` is input row `q_rows[r]` of q (`kv_rows[r]` of k and v), zeros where it is -1, so a
    permuted order costs no permuted copy. One Triton pass per tensor on CUDA tensors and in the interpreter
    (`_quantize_kernel`), torch otherwise; both round alike (tests/test_fp8.py)."""
    runs_kernel = q.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not runs_kernel:
        q, k, v = _gathered(q, q_rows), _gathered(k, kv_rows), _gathered(v, kv_rows)
        q_rows = kv_rows = None
    batch, _, heads, head_dim = k.shape
    rows = k.shape[1] if kv_rows is None else kv_rows.shape[0]
    alignment = KEY_MAJOR_BLOCK if v_key_major else ROW_ALIGNMENT
    padded = -(-rows // alignment) * alignment
    v_t = torch.zeros((batch, heads, head_dim, padded), dtype=E4M3, device=v.device)
    q_out = q.shape[1] if q_rows is None else q_rows.shape[0]
    dots = torch.empty((batch, q_out, heads), dtype=torch.float32, device=q.device) if q_dot_mean else None
    if runs_kernel:
        q8, q_scale = _quantize_triton(q, 0, k_mean, v_scale, dots=dots, source=q_rows)
        k8, k_scale = _quantize_triton(k, 1, k_mean, v_scale, block=k_block, source=kv_rows)
        _quantize_triton(v, 2, k_mean, v_scale, v_t, key_major=v_key_major, source=kv_rows)
    else:
        if q_dot_mean:
            dots = (q.float() * k_mean[:, None]).sum(-1)
        q8, q_scale = _per_row(q.float())
        k8, k_scale = _per_row(k.float() - k_mean[:, None], k_block)
        q8, k8 = aligned_rows(q8), aligned_rows(k8)
        columns = key_major_positions(rows, v.device) if v_key_major else slice(0, rows)
        v_t[..., columns] = (v.float() / v_scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).permute(0, 2, 3, 1).to(E4M3)
    return Fp8Tensors(q8, k8, v_t, q_scale, k_scale, v_scale, k_mean, v_key_major, dots)


def _gathered(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """`[B, rows, heads, head_dim]` x read at `rows` (zeros where -1), as the quantization kernel gathers."""
    if rows is None:
        return x
    index = rows.to(device=x.device, dtype=torch.int64)
    taken = x.index_select(1, index.clamp(min=0))
    return torch.where((index >= 0)[None, :, None, None], taken, torch.zeros((), dtype=x.dtype))


def prequantized_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                      k_scale: torch.Tensor, v_scale: torch.Tensor) -> Fp8Tensors:
    """`Fp8Tensors` of `[B, rows, heads, head_dim]` q, k, v given in float8 e4m3 with their full-size scales
    (`check_fp8_call`; q's and k's `[B, rows, heads]`): nothing is quantized again; V is copied transposed into
    rows padded to 16 (zeros past the rows), and no K mean is removed."""
    batch, rows, heads, head_dim = k.shape
    padded = -(-rows // ROW_ALIGNMENT) * ROW_ALIGNMENT
    v_t = torch.zeros((batch, heads, head_dim, padded), dtype=E4M3, device=v.device)
    v_t[..., :rows] = v.permute(0, 2, 3, 1)
    return Fp8Tensors(aligned_rows(q), aligned_rows(k), v_t, q_scale, k_scale, v_scale, None)


def fp8_rows(shape: tuple[int, ...], device) -> torch.Tensor:
    """Uninitialised float8 `[B, rows, heads, head_dim]` whose heads start `ROW_ALIGNMENT` bytes apart: contiguous
    where head_dim is a multiple of 16, else a view of the first head_dim columns of heads padded to one (a head dim
    of 8 modulo 16 would start every other head off a 16-byte boundary, which tensor descriptors refuse)."""
    *outer, head_dim = shape
    padded = -(-head_dim // ROW_ALIGNMENT) * ROW_ALIGNMENT
    return torch.empty((*outer, padded), dtype=E4M3, device=device)[..., :head_dim]


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` (float8 `[B, rows, heads, head_dim]`) in `fp8_rows`' layout: itself where that is its layout, else a
    copy."""
    if x.stride() == fp8_rows(x.shape, "meta").stride():
        return x
    return fp8_rows(x.shape, x.device).copy_(x)


def prequantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: Fp8Scales) -> Fp8Tensors:
    """`prequantized_rows` of `[B, *tokens, heads, head_dim]` float8 q, k, v and their full-size scales; the
    result's rows are the flattened tokens."""
    flat = tuple(t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]) for t in (q, k, v))
    batch, rows, heads = flat[0].shape[:3]
    return prequantized_rows(*flat, scales.q_scale.reshape(batch, rows, heads),
                             scales.k_scale.reshape(batch, rows, heads), scales.v_scale)


QUANTIZE_ROWS = 64  # rows per program of the quantization kernel


@on_their_device
def _quantize_triton(x: torch.Tensor, mode: int, k_mean: torch.Tensor, v_scale: torch.Tensor,
                     v_t: Optional[torch.Tensor] = None, block: int = 1, key_major: bool = False,
                     dots: Optional[torch.Tensor] = None, source: Optional[torch.Tensor] = None):
    """Mode 0 (Q) and 1 (K, mean removed): `(x_fp8, row_scales)`, K's scale shared by blocks of `block` rows
    (a power of two); mode 2 (V): writes V transposed into `v_t`, key-major within blocks of 128 where
    `key_major`. Mode 0 with `dots` (`[B, rows, heads]` float32) also writes each row's `q . mean(k)` there.
    With `source` (int32 `[rows out]`), output row `r` reads input row `source[r]` (zeros where -1)."""
    batch, _, heads, head_dim = x.shape
    rows = x.shape[1] if source is None else source.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if mode == 2:
        out, scales = v_t, v_scale
    else:
        out = fp8_rows((batch, rows, heads, head_dim), x.device)
        scales = torch.empty((batch, rows, heads), dtype=torch.float32, device=x.device)
    block_rows = max(block, QUANTIZE_ROWS)
    grid = (triton.cdiv(rows, block_rows), batch * heads)
    _quantize_kernel[grid](x, out, scales, k_mean, scales if dots is None else dots,
                           scales if source is None else source, x.stride(0), x.stride(1), x.stride(2), rows, heads,
                           v_t.shape[-1] if mode == 2 else out.stride(2), HEAD_DIM=head_dim,
                           BLOCK_D=next_power_of_two(head_dim), BLOCK_R=block_rows, SHARED=block, MODE=mode,
                           KEY_MAJOR=key_major, DOT_MEAN=dots is not None, GATHER=source is not None,
                           EXACT_CAST=not x.is_cuda)
    return (None, None) if mode == 2 else (out, scales)


@triton.jit
def _quantize_kernel(X, OUT, SCALES, K_MEAN, DOTS, SOURCE, stride_b, stride_r, stride_h, rows, heads, out_stride,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SHARED: tl.constexpr,
                     MODE: tl.constexpr, KEY_MAJOR: tl.constexpr, DOT_MEAN: tl.constexpr, GATHER: tl.constexpr,
                     EXACT_CAST: tl.constexpr):
    """BLOCK_R rows of one (batch, head): Q (MODE 0) and K (MODE 1, its mean subtracted) with one scale per row,
    written `[B, rows, heads, head_dim]` with heads `out_stride` apart (`fp8_rows`) and scales `[B, rows,
    heads]` (K's shared by groups of SHARED rows where SHARED > 1); V (MODE 2) divided by its channel scales
    `SCALES` `[B, heads, head_dim]` and written transposed, `[B, heads, head_dim, out_stride]` (key-major within
    blocks of 128 where KEY_MAJOR: `key_major_positions`). With DOT_MEAN (Q), each row's `q . mean(k)` goes to
    `DOTS` `[B, rows, heads]`. With GATHER, output row `r` reads input row `SOURCE[r]` (int32; -1: a zero row).
    Rows run `BLOCK_D` (head_dim's next power of two) columns, those past head_dim masked."""
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    ok = r < rows
    cell_ok = ok[:, None] & d_ok[None, :]
    if GATHER:
        src = tl.load(SOURCE + r, mask=ok, other=-1)
        read_ok = (src >= 0)[:, None] & d_ok[None, :]
    else:
        src = r
        read_ok = cell_ok
    x = tl.load(X + b * stride_b + h * stride_h + src.to(tl.int64)[:, None] * stride_r + d[None, :],
                mask=read_ok, other=0.0).to(tl.float32)
    if MODE == 2:
        x = x / tl.load(SCALES + (b * heads + h) * HEAD_DIM + d, mask=d_ok, other=1.0)[None, :]
        x8 = cast_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0), EXACT_CAST)
        column = r
        if KEY_MAJOR:
            j = r % 128
            column = r - j + 32 * (j // 2 % 4) + 2 * (j // 8) + j % 2
        tl.store(OUT + ((b * heads + h) * HEAD_DIM + d[None, :]) * out_stride + column[:, None], x8, mask=cell_ok)
    else:
        row = (b * rows + r) * heads + h
        if MODE == 1:
            x = x - tl.load(K_MEAN + (b * heads + h) * HEAD_DIM + d, mask=d_ok, other=0.0)[None, :]
        if DOT_MEAN:
            mean = tl.load(K_MEAN + (b * heads + h) * HEAD_DIM + d, mask=d_ok, other=0.0)
            tl.store(DOTS + row, tl.sum(x * mean[None, :], 1), mask=ok)
        amax = tl.max(tl.abs(x), 1)
        if SHARED > 1:  # each group of SHARED rows takes its largest row's amax
            amax = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(amax, (BLOCK_R // SHARED, SHARED)), 1)[:, None],
                                              (BLOCK_R // SHARED, SHARED)), (BLOCK_R,))
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        x8 = cast_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0), EXACT_CAST)
        tl.store(OUT + row[:, None] * out_stride + d[None, :], x8, mask=cell_ok)
        tl.store(SCALES + row, scale, mask=ok)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_block: int = 1, v_key_major: bool = False,
             q_dot_mean: bool = False, rows: Optional[torch.Tensor] = None) -> Fp8Tensors:
    """Quantize `[B, *tokens, heads, head_dim]` q, k, v by the rule (K's scales shared by blocks of `k_block`
    tokens; V key-major where `v_key_major`; `q . mean(k)` per row where `q_dot_mean`); the result's rows are the
    flattened tokens, or with `rows` (int32, kernels/gna/permute.py's `source_rows`) those tokens in that order
    for all three, read as they are quantized (-1: a padding row of zeros). K's mean and V's scales are taken
    over the tokens."""
    k_mean, v_scale = column_statistics(k, v)
    flat = tuple(t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]) for t in (q, k, v))
    return quantize_rows(*flat, k_mean, v_scale, k_block, v_key_major, q_dot_mean, q_rows=rows, kv_rows=rows)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of values with absolute maximum `amax` (1 where everything is zero)."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _per_row(x: torch.Tensor, block: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (float32 `[B, rows, heads, channels]`) quantized with one scale per row and head, shared by blocks of
    `block` rows."""
    amax = x.abs().amax(-1)
    if block > 1:
        batch, rows, heads = amax.shape
        padded = torch.zeros(batch, -(-rows // block) * block, heads, dtype=amax.dtype, device=amax.device)
        padded[:, :rows] = amax
        amax = padded.unflatten(1, (-1, block)).amax(2, keepdim=True).expand(-1, -1, block, -1).flatten(1, 2)[:, :rows]
    scale = _scale_of(amax)
    return (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to the nearest float8 e4m3 value (ties to even, saturating at 448), in x's dtype."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(x.dtype)


def quantized_weights(scores: torch.Tensor, p_sum: str = "exact") -> torch.Tensor:
    """Softmax weights over the last dimension of `scores` (natural-log units, -inf where masked) as the FP8
    kernels use them for P @ V: `round_e4m3(448 * exp(s - max)) / 448` over the row's sum of `exp(s - max)`,
    taken before the rounding (`p_sum="exact"`, the Triton kernels) or after it (`"rounded"`, the Gluon
    kernel). Rows with no finite score get zeros."""
    if p_sum not in P_SUMS:
        raise ValueError(f"p_sum is one of {P_SUMS}, got {p_sum!r}")
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top)
    weights = round_to_e4m3(e * E4M3_MAX) / E4M3_MAX
    total = (weights if p_sum == "rounded" else e).sum(-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


@triton.jit
def cast_e4m3(p, EXACT_CAST: tl.constexpr):
    """`p` (fp32, in [-448, 448]) as float8 e4m3, rounded to nearest even: the hardware conversion, or with
    EXACT_CAST (the interpreter) a rounding in fp32 to a representable value first (module docstring)."""
    if EXACT_CAST:
        bits = p.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share the smallest normal's step
        step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        scaled = p / step
        rounded = (scaled + 12582912.0) - 12582912.0  # 1.5 * 2**23: fp32 addition rounds to nearest even
        p = tl.minimum(tl.maximum(rounded * step, -448.0), 448.0)
    return p.to(tl.float8e4nv)


@triton.jit
def value_scales(SV_head, OFFSET: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """V's channel scales of one column chunk `[OFFSET, OFFSET + WIDTH)` (kernels/common/headdim.py) of one batch
    and head (`SV_head`), over P's static 448 (what the FP8 kernels multiply their accumulators by at the end);
    zeros past head_dim."""
    channels = OFFSET + tl.arange(0, WIDTH)
    if OFFSET + WIDTH > HEAD_DIM:
        scales = tl.load(SV_head + channels, mask=channels < HEAD_DIM, other=0.0)
    else:
        scales = tl.load(SV_head + channels)
    return scales * (1.0 / 448.0)


def check_fp8_device(q: torch.Tensor) -> None:
    """FP8 matrix instructions: CUDA GPUs of compute capability 8.9 (Ada) or newer; the interpreter too."""
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        name = torch.cuda.get_device_name(q.device)
        raise ValueError(f"precision='fp8' needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: "
                         f"Ada, Hopper, Blackwell), got {name}. Use precision=None (bfloat16) there.")


def check_fp8_tiles(q: torch.Tensor, block_m: int, block_n: int) -> None:
    """FP8 matrix instructions reduce over 32 elements: a KV tile (P @ V's reduced dimension) of fewer than 32
    keys, or a Q tile of fewer than 16 queries, does not compile on the GPU (the interpreter runs any)."""
    if q.is_cuda and (block_n < 32 or block_m < 16):
        raise ValueError(f"precision='fp8' needs KV tiles of at least 32 tokens and Q tiles of at least 16, got "
                         f"{block_m}-token Q tiles and {block_n}-token KV tiles: pass larger q_tile / kv_tile.")


def lse_with_mean(lse: torch.Tensor, q: torch.Tensor, k_mean: torch.Tensor, scale: float) -> torch.Tensor:
    """The LSE of the unsmoothed scores from that of the smoothed ones: every score of a query row is smaller
    by `scale * q . mean(k)` after K's mean is subtracted, so its log-sum-exp is too. `lse` `[B, *tokens,
    heads]`, `q` `[B, *tokens, heads, head_dim]`, `k_mean` `[B, heads, head_dim]`."""
    mean = k_mean.reshape(k_mean.shape[0], *(1,) * (q.dim() - 3), *k_mean.shape[1:])
    return lse + scale * (q.float() * mean).sum(-1).to(lse.dtype)


def fp8_launch_config(block_m: int, block_n: int, split: HeadSplit) -> dict:
    """Warps and stages of the FP8 kernels at head dim `split` (its computed width), as overrides of the launch
    options' fields (kernels/common/launch.py, `LaunchOptions`) (H100, Triton 3.6,
    benchmarks/results/fp8-tune-*.json): no warp specialization (Triton 3.6 fails to build it for some FP8 tiles
    and it bought nothing where it built); 8 warps and 4 stages for 128x128 tiles (4 warps ran them at half
    speed), else 4 warps and 3 stages, and 8 warps at widths over 128. The launch lowers the stages where the
    tiles (one byte an element) do not fit in shared memory (kernels/common/launch.py, `with_fp8`)."""
    large = block_m * block_n >= 128 * 128
    return dict(num_warps=8 if large or split.wide else 4, num_stages=4 if large else 3, WARP_SPECIALIZE=False)


# FP8 pads head_dim to a power of two (kernels/common/headdim.py): its matrix instructions reduce over 32
# elements, which a 16-column chunk of a split does not hold; a head dim that pads to 16 columns has none.
FP8_HEAD_DIMS = tuple(d for d in HEAD_DIMS if next_power_of_two(d) >= 32)


def fp8_head_split(head_dim: int) -> HeadSplit:
    """The column chunks FP8 runs `head_dim` in: one, padded to the next power of two; a sentence for a head dim
    outside `FP8_HEAD_DIMS`."""
    refusal = head_dim_refusal(head_dim, "FP8 kernel (precision='fp8')", FP8_HEAD_DIMS)
    if refusal is not None:
        raise ValueError(refusal + " FP8 pads head_dim to a power of two of at least 32 columns; use "
                         "precision=None (bfloat16) for smaller ones.")
    return head_split(head_dim, "pad")


def fp8_q_tile(q_tile: tuple[int, ...]) -> tuple[int, ...]:
    """The Q tile FP8 runs for natsim's choice `q_tile`: a 128-query tile halved along its first dimension longer
    than 1 (64 x 128 tiles ran dense FP8 attention 1.4x faster than 128 x 128 on the H100: the softmax of
    one 64-row tile overlaps the other warps' matrix products better)."""
    if math.prod(q_tile) != 128:
        return q_tile
    for axis, length in enumerate(q_tile):
        if length > 1:
            return (*q_tile[:axis], length // 2, *q_tile[axis + 1:])
    return q_tile
