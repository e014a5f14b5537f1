"""One GNA call's every non-tensor argument as one frozen value, normalised once at the public boundary.

`GnaSpec` is what `gna_attention` (its eager path) or the operator `natsim::gna_forward` (from its schema) hands to
the dispatcher, which keys its call cache on it and on tensor metadata, and what `_prepare` and `make_call` read
(kernels/gna/dispatch.py, kernels/gna/launch.py). The operator schema keeps plain lists, ints and bools:
`GnaSpec.operator_arguments` and `GnaSpec.from_operator` convert between the two, in one place.

What a spec can be checked for without the tensors is checked when it is made (`GnaSpec.of`): KV tiling,
precision, frame offsets and which of them run together. What needs the token layout (the window against the
shape, the tiles against the kernel) is checked by the first call with a layout (kernels/gna/dispatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from natsim import Problem
from natsim.problem import BoolOrBools, IntOrInts, as_bools, as_ints, as_sizes

from ..common.fp8 import Fp8Scales, check_precision, scale_tensors
from ..common.spec import kept
from ..common.checks import check_backend, check_scale
from .checks import check_frame_offsets, check_kv_tiling


class FrameRange(NamedTuple):
    """Frame ranges of dimension 0 (natsim.distributed's halo exchange): q holds frames `[q0, q0 + Tq)` of a layout
    of `frames` frames, and k, v frames `[k0, k0 + Tk)`; `Tq` and `Tk` are the tensors' own. A tuple
    `(q0, k0, frames)`, the `frame_offsets` the public entry points and the operator take."""

    q0: int
    k0: int
    frames: int

    @classmethod
    def of(cls, frame_offsets: object) -> FrameRange:
        """A caller's `frame_offsets`, checked: three non-negative ints."""
        return cls(*check_frame_offsets(frame_offsets))


@dataclass(frozen=True)
class GnaSpec:
    """Every non-tensor argument of one GNA forward call (`gna_attention`'s), normalised.

    `window`, `stride`, `dilation`, `causal`: one value per dimension of the token layout; `scale`: the score
    scale (None: `head_dim ** -0.5`); `q_tile`, `kv_tile`: per-dimension tiles, or None for natsim's choice;
    `kv_tiling`: "static", "dynamic" or None (natsim chooses); `frames`: the frame ranges q and k, v hold, or None
    for the whole layout; `precision`: None or "fp8"; `out_dtype`: the output's dtype for q, k, v given in float8
    (None otherwise); `return_lse`: whether the call returns the LSE; `backend`: "triton", "fa4" or None (natsim
chooses, kernels/gna/choice.py). Hashable: with tensor metadata, the key of
    the dispatcher's call cache.
    """

    window: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    causal: tuple[bool, ...]
    scale: Optional[float] = None
    q_tile: Optional[tuple[int, ...]] = None
    kv_tile: Optional[tuple[int, ...]] = None
    kv_tiling: Optional[str] = None
    frames: Optional[FrameRange] = None
    precision: Optional[str] = None
    out_dtype: Optional[torch.dtype] = None
    return_lse: bool = False
    backend: Optional[str] = None

    @classmethod
    def of(
        cls,
        ndim: int,
        window: IntOrInts,
        stride: IntOrInts = 1,
        dilation: IntOrInts = 1,
        causal: BoolOrBools = False,
        *,
        scale: Optional[float] = None,
        q_tile: Optional[IntOrInts] = None,
        kv_tile: Optional[IntOrInts] = None,
        kv_tiling: Optional[str] = None,
        frame_offsets: Optional[object] = None,
        precision: Optional[str] = None,
        out_dtype: Optional[torch.dtype] = None,
        return_lse: bool = False,
        backend: Optional[str] = None,
    ) -> GnaSpec:
        """The spec of a caller's arguments for a layout of `ndim` dimensions: scalars broadcast to one value per
        dimension, sequences made tuples of ints (bools for causal), with `Problem`'s sentences for values of
        other types, the scale a positive float, frame offsets a `FrameRange`; KV tiling, precision, frame
        offsets and their combinations checked (sentence errors). Made once per distinct arguments
        (kernels/common/spec.py), and only once checked: a call that raises keeps nothing."""
        return _spec_of(ndim, window, stride, dilation, causal, scale, q_tile, kv_tile, kv_tiling, frame_offsets,
                        precision, out_dtype, bool(return_lse), backend)

    @classmethod
    def for_problem(cls, problem: Problem, **fields: object) -> GnaSpec:
        """The spec of a validated problem's parameters and the other `fields` as given (trusted: callers inside
        the kernels, whose values are already checked)."""
        return cls(problem.window, problem.stride, problem.dilation, problem.causal, **fields)

    @classmethod
    def from_operator(cls, window: list[int], stride: list[int], dilation: list[int], causal: list[bool],
                      scale: Optional[float], q_tile: Optional[list[int]], kv_tile: Optional[list[int]],
                      return_lse: bool, kv_tiling: Optional[str] = None, frame_offsets: Optional[list[int]] = None,
                      precision: Optional[str] = None, out_dtype: Optional[torch.dtype] = None,
                      backend: Optional[str] = None) -> GnaSpec:
        """The spec of `natsim::gna_forward`'s schema arguments (after q, k, v; without the FP8 scales, which are
        tensors), checked as `of` checks a caller's."""
        return cls.of(len(window), window, stride, dilation, causal, scale=scale, q_tile=q_tile, kv_tile=kv_tile,
                      kv_tiling=kv_tiling, frame_offsets=frame_offsets, precision=precision, out_dtype=out_dtype,
                      return_lse=return_lse, backend=backend)

    def operator_arguments(self, scales: Optional[Fp8Scales] = None) -> tuple:
        """`natsim::gna_forward`'s arguments after q, k, v, in schema order: lists where the schema takes lists,
        and the FP8 `scales` as their three tensors (Nones without)."""
        return (list(self.window), list(self.stride), list(self.dilation), list(self.causal), self.scale,
                None if self.q_tile is None else list(self.q_tile),
                None if self.kv_tile is None else list(self.kv_tile), self.return_lse, self.kv_tiling,
                None if self.frames is None else list(self.frames), self.precision, *scale_tensors(scales),
                self.out_dtype, self.backend)

    @property
    def parameters(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
        """`(window, stride, dilation, causal)`: the GNA parameters, as `Problem` and the references take them
        after the layout."""
        return self.window, self.stride, self.dilation, self.causal

    def problem(self, shape: tuple[int, ...]) -> Problem:
        """The validated GNA problem of a token layout (raises natsim's sentence errors)."""
        return Problem(shape, *self.parameters)


@kept
def _spec_of(ndim: int, window: IntOrInts, stride: IntOrInts, dilation: IntOrInts, causal: BoolOrBools,
             scale: Optional[float], q_tile: Optional[IntOrInts], kv_tile: Optional[IntOrInts],
             kv_tiling: Optional[str], frame_offsets: Optional[object], precision: Optional[str],
             out_dtype: Optional[torch.dtype], return_lse: bool, backend: Optional[str]) -> GnaSpec:
    """`GnaSpec.of`'s work."""
    check_kv_tiling(kv_tiling)
    check_backend(backend)
    check_precision(precision)
    frames = None if frame_offsets is None else FrameRange.of(frame_offsets)
    if precision is not None and frames is not None:
        raise ValueError("precision='fp8' does not run with frame_offsets (natsim.distributed): use bf16 there.")
    if kv_tiling == "dynamic":
        if precision is not None:
            raise ValueError("precision='fp8' runs with static KV tiling only, got kv_tiling='dynamic'.")
        if frames is not None:
            raise ValueError("frame_offsets (natsim.distributed's halo exchange) run with static KV tiling only, "
                             "got kv_tiling='dynamic'.")
    return GnaSpec(as_ints(window, ndim, "window"), as_ints(stride, ndim, "stride"),
                   as_ints(dilation, ndim, "dilation"), as_bools(causal, ndim, "causal"), check_scale(scale),
                   _tile(q_tile, ndim, "q_tile"), _tile(kv_tile, ndim, "kv_tile"), kv_tiling, frames, precision,
                   out_dtype, return_lse, backend)


def _tile(value: object, ndim: int, name: str) -> Optional[tuple[int, ...]]:
    """A tile as given: None stays None, an int is one value per dimension, a sequence a tuple of 1 to 3 positive
    ints, with `Problem`'s sentences (its length against the layout is checked with the layout:
    kernels/gna/checks.py, `given_tiles`)."""
    if value is None:
        return None
    return as_sizes(value, name) if isinstance(value, (tuple, list)) else as_ints(value, ndim, name)
