"""Host side of the GNA kernel: what one call needs, worked out once per distinct arguments, and its launch.

A `GnaCall` holds every decision of a call that depends only on plain-Python arguments and tensor metadata
(shapes, dtype, device, strides): the validated problem, the tiles, the data path, whether the kernel needs the
mask, launch options, grid and every scalar kernel argument. `make_call` builds one from a call's `GnaSpec` with
its choices made (kernels/gna/spec.py), and the dispatcher keeps it per distinct key (kernels/gna/dispatch.py),
so that a repeated call only checks its tensors, allocates its output and launches through a
`PreboundKernel` (Triton's JIT dispatch, which binds and specialises every one of the kernel's 70 arguments on
each call, is skipped once the kernel is compiled).

Two data paths (kernels/gna/forward.py, `LAYOUT`):
- layout: the kernel reads q, k, v and writes o where they are, `[B, *shape, heads, head_dim]`, through rank-4
  tensor descriptors (Hopper's bulk tensor copies; padding lies out of bounds and reads as zeros): no
  permutation, one launch. Taken when every dilation is 1 and the tensors meet the descriptors' rules.
- permuted: permute q, k, v into tiles (kernels/gna/permute.py), run the kernel on the permuted sequences,
  unpermute o and the LSE: dilation groups, GPUs before Hopper, unaligned tensors. Its tiles move through
  rank-2 descriptors where the device has them (`has_tensor_descriptors`), else through pointer loads.
Dense attention (window = shape, non-causal, default tiles) runs as 1-D attention over the flattened layout:
every query attends every key either way, and only the last tile holds padding instead of every dimension's.
Two kernels share the arguments and both paths: static KV tiling (kernels/gna/forward.py) and dynamic KV tiling
(kernels/gna/dynamic.py); `kv_tiling=None` lets `choose_tiles` (kernels/gna/tiles.py) pick the mode with the tiles,
between both on the layout path and static on the permuted one, whose gathers are not calibrated.

Frame ranges (`frame_offsets`, for natsim.distributed's halo exchange): q holds frames `[q0, q0 + Tq)` of
dimension 0 of a layout of `L0` frames and k, v frames `[k0, k0 + Tk)`, which must hold every frame the queries'
windows reach; a launch takes their bounds `(q0, q1, k0, k1)`. Window bounds are global; Q and KV tiles are cut
from the local first frames (natsim.partition.frame_dim_tiles counts them the same way). No dense-as-1-D there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from natsim import Problem
from natsim.partition import frame_dim_tiles
from natsim.window import group_length, window_bounds

from ..common.backend import interpreting
from ..common.fp8 import (E4M3, ROW_ALIGNMENT, Fp8Scales, Fp8Tensors, column_statistics, fp8_head_split, fp8_rows,
                          prequantized_rows, quantize_rows)
from ..common.headdim import head_split
from ..common.launch import (Overrides, descriptors_fit, has_tensor_descriptors, launch_config, split_of,
                             with_fp8)
from ..common.softmax import LOG2E
from .dynamic import gna_dynamic_kernel
from .forward import gna_forward_kernel
from .layout import TileLayout, as_3d
from .permute import permute, source_rows, unpermute
from .prebound import PreboundKernel
from .spec import GnaSpec


# -- what the kernel needs to know, from plain Python values ---------------------------------------------------


KERNELS = {"static": gna_forward_kernel, "dynamic": gna_dynamic_kernel}


@functools.lru_cache(maxsize=512)
def needs_mask(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...],
               kv_tiling: str = "static") -> bool:
    """Whether any KV tile the kernel visits can be partial (window mask) or reach into padding.

    The kernel's visited tiles per Q tile are a box, one KV tile range per dimension, and a tile is full when
    it is full along every dimension, so checking every dimension on its own is exact: this mirrors the
    kernel's `dim_setup` (static) or `_box` (dynamic: tiles start at `start(first)`) and its `full` test for
    each dilation group length and Q tile along the dimension. False for dense attention and block-sparse
    configurations; the kernel then compiles no mask code.
    """
    for L, w, s, d, c, tq, tk in zip(problem.shape, problem.window, problem.stride, problem.dilation,
                                     problem.causal, q_tile, kv_tile):
        for length in {group_length(L, d, g) for g in range(d)}:
            if length % tk and kv_tiling == "static":
                return True  # the last KV tile of the group holds padding keys
            for first in range(0, length, tq):
                last = min(first + tq, length) - 1
                start_first, end_first = window_bounds(first, length, w, s, c)
                start_last, end_last = window_bounds(last, length, w, s, c)
                if kv_tiling == "dynamic":
                    origin, count = int(start_first), -(-(int(end_last) - int(start_first)) // tk)
                else:
                    origin, count = int(start_first) // tk * tk, -(-int(end_last) // tk) - int(start_first) // tk
                for key in range(origin, origin + count * tk, tk):
                    if not (start_last <= key and end_first >= key + tk):
                        return True
    return False


def needs_mask_frames(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...],
                      frames: tuple[int, int, int, int]) -> bool:
    """`needs_mask` for queries in frames `[q0, q1)` against keys in `[k0, k1)` (`frames`) of `problem`:
    dimension 0 from the simulator's per-rank counts, the other dimensions as `needs_mask`."""

    q0, q1, k0, k1 = frames
    d, tk = problem.dilation[0], kv_tile[0]
    dim0 = frame_dim_tiles(problem, q_tile[0], tk, q0, q1 - q0, k0, k1 - k0)
    if (dim0.full != dim0.visited).any() or any(group_length(k1 - k0, d, g) % tk for g in range(d)):
        return True
    if problem.ndim == 1:
        return False
    rest = Problem(problem.shape[1:], problem.window[1:], problem.stride[1:], problem.dilation[1:],
                   problem.causal[1:])
    return needs_mask(rest, q_tile[1:], kv_tile[1:])


def permutes(problem: Problem, descriptors: bool = True, fp8: bool = False) -> bool:
    """Whether a call of `problem` permutes its tokens (the permuted path): dilation groups, or a GPU without
    tensor descriptors, or in FP8 a layout of two or three dimensions (FP8 reads only 1-D layouts in place).
    Dense-contiguous layouts on Hopper never do in bf16 / fp16."""
    return not descriptors or any(d > 1 for d in problem.dilation) or (fp8 and problem.ndim > 1)


def is_dense(problem: Problem) -> bool:
    """Every query attends every key: the window covers the layout, nothing causal (any number of dims)."""
    return problem.window == problem.shape and not any(problem.causal)


def dense_as_1d(problem: Problem) -> Optional[Problem]:
    """The 1-D problem over the flattened layout when `problem` is dense self attention in several dims, else
    None."""
    if problem.ndim == 1 or not is_dense(problem):
        return None
    return Problem((problem.num_tokens,), (problem.num_tokens,))


# -- one call ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GnaCall:
    """Everything about a GNA forward call but its tensors: run it with `make_call(...).run(q, k, v)`.

    `spec` is the call with every choice made: its `q_tile`, `kv_tile` and `kv_tiling` are what the kernel runs,
    static (kernels/gna/forward.py) or dynamic (kernels/gna/dynamic.py) KV tiles; `problem` is the problem the
    kernel runs (dense attention as 1-D over the flattened layout, a frame range's in three dimensions), `shape`
    the caller's layout. `layout` selects the data path (module docstring). `kernel` is the pre-bound launch for
    the tensors the kernel reads: the caller's (layout) or permuted ones. `frames`: `(q0, q1, k0, k1)` along
    dimension 0, or None.
    """

    problem: Problem
    shape: tuple[int, ...]
    spec: GnaSpec
    layout: bool
    debug: bool
    kernel: PreboundKernel
    frames: Optional[tuple[int, int, int, int]] = None

    @property
    def q_shape(self) -> tuple[int, ...]:
        """The layout q and o hold: the problem's, or its query frames."""
        return self.problem.shape if self.frames is None else (self.frames[1] - self.frames[0],
                                                               *self.problem.shape[1:])

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """The layout k and v hold: the problem's, or its key frames."""
        return self.problem.shape if self.frames is None else (self.frames[3] - self.frames[2],
                                                               *self.problem.shape[1:])

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: Optional[Fp8Scales] = None):
        """`(out, lse)` of `[B, *shape, heads, head_dim]` inputs in that layout (`lse` None unless asked); an FP8
        call of inputs given in float8 takes their full-size `scales` (kernels/common/fp8.py)."""
        flattened = self.q_shape != self.shape  # dense attention as 1-D: views when contiguous
        if flattened:
            batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
            q, k, v = (t.reshape(batch, *self.problem.shape, heads, head_dim) for t in (q, k, v))
            if scales is not None:
                scales = Fp8Scales(*(s.reshape(batch, *self.problem.shape, heads)
                                     for s in (scales.q_scale, scales.k_scale)), scales.v_scale)
        spec = self.spec
        if spec.precision == "fp8":
            out, lse = self.run_fp8(q, k, v, scales)
        elif self.layout:
            out = new_output(q.shape, q.dtype, q.device)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if spec.return_lse else None
            self.kernel(q, k, v, out, out if lse is None else lse, out)
        else:
            dilation = self.problem.dilation
            out_p, lse_p, _ = self.run_permuted(permute(q, spec.q_tile, dilation), permute(k, spec.kv_tile, dilation),
                                                permute(v, spec.kv_tile, dilation))
            out = unpermute(out_p, self.q_shape, spec.q_tile, dilation)
            lse = (None if lse_p is None
                   else unpermute(lse_p[..., None], self.q_shape, spec.q_tile, dilation)[..., 0])
        if flattened:
            out = out.view(batch, *self.shape, heads, head_dim)
            lse = None if lse is None else lse.view(batch, *self.shape, heads)
        return out, lse

    def run_fp8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: Optional[Fp8Scales] = None):
        """`(out, lse)` of an FP8 call: q, k, v in float8 in the kernel's row order (`_fp8_rows`), the kernel on
        them and their scales, the output unpermuted unless the kernel read a 1-D layout in place (rows are
        tokens there). The output has the inputs' dtype, or the spec's `out_dtype` for inputs given in float8."""
        t = self._fp8_rows(q, k, v, scales, q_dot_mean=self.spec.return_lse)
        out = new_output(t.q.shape, q.dtype if scales is None else self.spec.out_dtype, q.device)
        lse = torch.empty(t.q.shape[:-1], dtype=torch.float32, device=q.device) if self.spec.return_lse else None
        self.kernel(t.q, t.k, t.v_t, out, out if lse is None else lse, out, t.q_scale, t.k_scale, t.v_scale)
        dots = t.q_dot_mean  # q . mean(k) per row, where K's mean was removed and the LSE asked for
        if not self.layout:
            dilation, q_tile = self.problem.dilation, self.spec.q_tile
            out = unpermute(out, self.q_shape, q_tile, dilation)
            lse, dots = (None if x is None else unpermute(x[..., None], self.q_shape, q_tile, dilation)[..., 0]
                         for x in (lse, dots))
        if lse is not None and dots is not None:  # the kernel's LSE is of the scores with K's mean removed
            lse = lse + self.kernel.arguments["qk_scale"] / LOG2E * dots.reshape(lse.shape)
        return out, lse

    def _fp8_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scales: Optional[Fp8Scales], q_dot_mean: bool = False) -> Fp8Tensors:
        """q, k, v as the FP8 kernel reads them, in place (a 1-D layout) or in the permuted order: quantized by the
        rule as they are read in that order (K's mean and V's scales over the real tokens; padding rows are zeros
        quantized, and the kernel never uses them), or given in float8 with `scales` (their bytes and scales
        permuted alike; padding reads zeros)."""
        batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
        dilation, q_tile, kv_tile = self.problem.dilation, self.spec.q_tile, self.spec.kv_tile
        flat = tuple(x.reshape(batch, -1, heads, head_dim) for x in (q, k, v))
        if scales is None:  # quantized as they are read in the kernel's order: no permuted copies
            orders = ({} if self.layout else
                      dict(q_rows=source_rows(self.q_shape, q_tile, dilation, q.device),
                           kv_rows=source_rows(self.kv_shape, kv_tile, dilation, q.device)))
            return quantize_rows(*flat, *column_statistics(k, v), q_dot_mean=q_dot_mean, **orders)
        if self.layout:
            rows = flat
        else:
            rows = (_permute_any(q, q_tile, dilation), _permute_any(k, kv_tile, dilation),
                    _permute_any(v, kv_tile, dilation))
        if self.layout:
            q_scale, k_scale = (s.reshape(batch, -1, heads) for s in (scales.q_scale, scales.k_scale))
        else:
            q_scale = permute(scales.q_scale[..., None], q_tile, dilation)[..., 0]
            k_scale = permute(scales.k_scale[..., None], kv_tile, dilation)[..., 0]
            # Padding queries take scale 1, as the rule gives their zero rows: a scale of 0 would turn their
            # masked scores (-inf) into NaN (rows the output drops, but work for nothing and NaN in the LSE).
            real = permute(torch.ones((1, *self.q_shape, 1, 1), dtype=torch.uint8, device=q.device), q_tile,
                           dilation)[..., 0]
            q_scale = torch.where(real.bool(), q_scale, 1.0)
        return prequantized_rows(*rows, q_scale, k_scale, scales.v_scale)

    def run_permuted(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """`(out, lse, counts)` of permuted `[B, tokens, heads, head_dim]` inputs, in q's permuted order."""
        out = new_output(q.shape, q.dtype, q.device)
        lse = (torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32, device=q.device)
               if self.spec.return_lse else None)
        num_q_tiles = self.kernel.grid[0]
        counts = torch.zeros((num_q_tiles, 2), dtype=torch.int32, device=q.device) if self.debug else None
        self.kernel(q, k, v, out, out if lse is None else lse, out if counts is None else counts)
        return out, lse, counts


def _token_strides(t: torch.Tensor, ndim: int) -> tuple[int, int, int]:
    """Strides of the kernel's three layout dimensions in `[B, *shape, H, D]` (missing leading ones filled in
    as if the layout went on outwards)."""
    strides = list(t.stride()[1:1 + ndim])
    lengths = list(t.shape[1:1 + ndim])
    while len(strides) < 3:
        strides.insert(0, strides[0] * lengths[0])
        lengths.insert(0, 1)
    return tuple(strides)


def make_call(
    problem: Problem,
    shape: tuple[int, ...],
    spec: GnaSpec,
    *,
    batch: int,
    heads: int,
    head_dim: int,
    layout_tensors: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    frames: Optional[tuple[int, int, int, int]] = None,
    overrides: Overrides = (),
    debug: bool = False,
    check_alignment: bool = False,
    descriptors: bool = True,
) -> GnaCall:
    """Work out one call of `problem` (what the kernel runs; `shape` is the caller's layout) from `spec`, the call with
    every choice made: its tiles and KV tiling ("static" or "dynamic", never None here), scale (None: `head_dim **
    -0.5`), LSE, precision and output dtype. `layout_tensors` are q, k, v in the kernel's layout for the layout path
    (their strides are bound), or None for the permuted path. `frames` `(q0, q1, k0, k1)`: q holds frames `[q0, q1)`
    of dimension 0 and k, v `[k0, k1)` (module docstring); static KV tiling only. `overrides` (checked names,
    `launch_overrides`) override `launch_config`'s options (tuning; `MASKED` may only be forced on) and may set
    `HEAD_MAJOR` and head_dim's column chunks `CHUNK_A` / `CHUNK_B` (kernels/common/headdim.py; by default
    `head_split`'s for the launch's KV tiling and query tile, padded in FP8). `check_alignment`: check the tensors'
    alignment on every launch (callers that pass their own permuted tensors; `forward` keys on it instead). The
    dynamic kernel gathers box tiles with pointer loads on the permuted path and is never warp-specialized (Triton
    3.6 does not specialize its loops: rank-4 descriptors or pointer gathers). Precision "fp8" runs the FP8 variant
    of the static kernel (kernels/common/fp8.py) on permuted sequences or a 1-D layout in place, on q, k, v
    quantized inside the call or, with `spec.out_dtype` (the output's dtype), given in float8 with their scales.
    `descriptors`: the device has tensor descriptors and they are allowed (`has_tensor_descriptors`); without them
    the permuted path loads and stores through pointers (`USE_TMA` off), and the layout path, which needs them, is
    refused.
    """
    q_tile, kv_tile, kv_tiling = spec.q_tile, spec.kv_tile, spec.kv_tiling
    fp8 = spec.precision == "fp8"
    q0, q1, k0, k1 = (0, problem.shape[0], 0, problem.shape[0]) if frames is None else frames
    q_shape, kv_shape = (q1 - q0, *problem.shape[1:]), (k1 - k0, *problem.shape[1:])
    q_layout = TileLayout(q_shape, q_tile, problem.dilation).to_3d()
    kv_layout = TileLayout(kv_shape, kv_tile, problem.dilation).to_3d()
    masked = (needs_mask(problem, q_tile, kv_tile, kv_tiling) if frames is None
              else needs_mask_frames(problem, q_tile, kv_tile, frames))
    layout = layout_tensors is not None
    # The kernel's LAYOUT switch: 0 permuted sequences; 1 the token layout in rank-4 boxes; 2 a 1-D layout in
    # place, through the same rank-2 descriptors as permuted sequences. Triton 3.6 cannot warp-specialize a
    # loop that loads through rank-4 descriptors (its warp-specialization pass fails), so LAYOUT 1 runs the
    # single-partition loop.
    mode = 0 if not layout else (2 if problem.ndim == 1 else 1)
    if fp8 and (kv_tiling != "static" or frames is not None or mode == 1):
        raise ValueError("FP8 runs the static kernel on permuted sequences or a 1-D layout, without frame ranges.")
    split = split_of(head_dim, overrides, fp8_head_split(head_dim) if fp8 else
                     head_split(head_dim, launch=(kv_tiling, q_layout.tile_tokens)))
    launch = launch_config(q_layout.tile_tokens, kv_layout.tile_tokens, split, masked, descriptors,
                           specialize=not (spec.return_lse or debug) and mode != 1 and kv_tiling == "static")
    if fp8:
        launch = with_fp8(launch, q_layout.tile_tokens, kv_layout.tile_tokens, split)
    launch = launch.overridden(overrides)
    if masked and not launch.MASKED:
        raise ValueError(f"{problem} with tiles {q_tile} / {kv_tile} visits partial or padded KV tiles: "
                         "the kernel needs MASKED=True.")
    if layout and fp8:  # the quantized copies, in `fp8_rows`' layout
        layout_tensors = tuple(fp8_rows(t.shape, "meta") for t in layout_tensors)
    if layout:
        strides = [(t.stride(0), *_token_strides(t, problem.ndim), t.stride(-2)) for t in layout_tensors]
        contiguous = torch.empty((batch, *q_shape, heads, head_dim), device="meta")
        strides.append((contiguous.stride(0), *_token_strides(contiguous, problem.ndim), contiguous.stride(-2)))
    else:  # permuted [B, tokens, H, D], contiguous (or FP8's `fp8_rows`): only the token stride (position 2) is read
        q_tokens, kv_tokens = q_layout.num_tokens, kv_layout.num_tokens
        per_head = fp8_rows((1, 1, 1, head_dim), "meta").stride(2) if fp8 else head_dim
        strides = [(n * heads * width, 0, 0, heads * width, width)
                   for n, width in ((q_tokens, per_head), (kv_tokens, per_head), (kv_tokens, head_dim),
                                    (q_tokens, head_dim))]
    names = [f"stride_{t}{axis}" for t in "qkvo" for axis in ("b", "0", "1", "2", "h")]
    arguments = dict(zip(names, (s for group in strides for s in group)))
    scale = head_dim**-0.5 if spec.scale is None else spec.scale
    arguments.update(
        heads=heads, qk_scale=scale * LOG2E,
        **dict(zip(("L0", "L1", "L2"), q_layout.shape)),
        **dict(zip(("W0", "W1", "W2"), as_3d(problem.window))),
        **dict(zip(("S0", "S1", "S2"), as_3d(problem.stride))),
        **dict(zip(("D0", "D1", "D2"), q_layout.dilation)),
        **dict(zip(("NQ0", "NQ1", "NQ2"), q_layout.tiles_per_group)),
        **dict(zip(("NK0", "NK1", "NK2"), kv_layout.tiles_per_group)),
        **dict(zip(("C0", "C1", "C2"), as_3d(problem.causal, False))),
        **dict(zip(("TQ0", "TQ1", "TQ2"), q_layout.tile)),
        **dict(zip(("TK0", "TK1", "TK2"), kv_layout.tile)),
        HEAD_DIM=head_dim, CHUNK_A=split.a, CHUNK_B=split.b, WRITE_LSE=spec.return_lse, DEBUG=debug,
        HEAD_MAJOR=launch.HEAD_MAJOR, LAYOUT=mode,
        MASKED=launch.MASKED, USE_TMA=launch.USE_TMA, WARP_SPECIALIZE=launch.WARP_SPECIALIZE,
    )
    if fp8:  # V transposed: its token stride is the padded row count (kernels/common/fp8.py)
        kv_rows = kv_layout.num_tokens if not layout else problem.num_tokens
        arguments.update(FP8=True, EXACT_CAST=interpreting(),
                         stride_v2=-(-kv_rows // ROW_ALIGNMENT) * ROW_ALIGNMENT)
    if kv_tiling == "static":  # the frame range (the whole layout without one); the dynamic kernel has none
        arguments.update(G0=as_3d(problem.shape)[0], KL0=kv_layout.shape[0], Q0_OFF=q0, K0_OFF=k0)
    if layout and not launch.USE_TMA:
        raise ValueError("the layout path reads through tensor descriptors: USE_TMA cannot be turned off there.")
    grid = ((batch * heads, q_layout.num_tiles, 1) if launch.HEAD_MAJOR
            else (q_layout.num_tiles, batch * heads, 1))
    kernel = PreboundKernel(KERNELS[kv_tiling], grid, arguments, launch.triton_options(),
                            check_alignment=check_alignment)
    return GnaCall(problem, shape, spec, layout, debug, kernel, frames)


def takes_layout_path(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: bool = False) -> bool:
    """Whether the kernel can read these tensors where they are: no dilation, descriptors on this device (and in
    FP8 a 1-D layout: `permutes`), descriptor-friendly strides and 16-byte aligned starts."""
    return not permutes(problem, has_tensor_descriptors(q.device), fp8) and descriptors_fit(q, k, v)


def frames_as_3d(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...]):
    """A frame-range problem with trailing dimensions of length 1 up to three (window, stride, dilation 1,
    tiles 1): the kernel pads at the front (kernels/gna/layout.py), and the frame offsets act on its dimension 0,
    which must be the layout's first. Counts and token order are unchanged."""
    pad = 3 - problem.ndim
    if not pad:
        return problem, q_tile, kv_tile
    ones = (1,) * pad
    return (Problem(problem.shape + ones, problem.window + ones, problem.stride + ones, problem.dilation + ones,
                    problem.causal + (False,) * pad), q_tile + ones, kv_tile + ones)


def _permute_any(x: torch.Tensor, tile: tuple[int, ...], dilation: tuple[int, ...]) -> torch.Tensor:
    """`permute` for any dtype: float8 tensors move as their bytes (a gather; zero bytes are 0.0 in e4m3)."""
    if x.dtype == E4M3:
        return permute(x.view(torch.uint8), tile, dilation).view(E4M3)
    return permute(x, tile, dilation)


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output memory (tests replace this to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)
