"""One GNA forward call, from arguments to output: the Triton kernel on CUDA tensors (or in the interpreter),
the torch reference on CPU tensors.

`forward` keys every call on its plain-Python arguments and tensor metadata; the first call with a key validates
everything and works the call out (`_prepare`, a `GnaCall` of kernels/gna/launch.py), later ones look it up, so
that a repeated call only checks its tensors, allocates its output and launches.
"""

from __future__ import annotations

import functools
import math

from natsim import Problem

from ..common.backend import interpreting
from ..common.fp8 import check_fp8_device, check_fp8_tiles, check_precision, fp8_q_tile
from .checks import check_frames, check_kernel_inputs, check_kv_tiling, check_qkv, kernel_tiles, problem_of
from .launch import KERNELS, dense_as_1d, frames_as_3d, make_call, takes_layout_path
from .reference import fp8_reference_attention, reference_attention
from .tiles import choose_tiles, default_tiles

MAX_CALLS = 1024  # distinct argument sets kept (a model has a handful of attention shapes)
_calls: dict = {}
_warned_cpu = False


def forward(q, k, v, window, stride=1, dilation=1, causal=False, scale=None, q_tile=None, kv_tile=None,
            return_lse=False, kv_tiling=None, frame_offsets=None, precision=None, scales=None, out_dtype=None):
    """GNA forward of `[B, *shape, heads, head_dim]` tensors: `(out, lse)`, `lse` None unless asked.

    `kv_tiling` "static" or "dynamic" picks the kernel; None lets natsim choose by predicted work
    (kernels/gna/tiles.py, `choose_tiles`). The first call with given tensor metadata and arguments validates
    everything and works the call out (`_prepare`); later ones look it up. Tensor metadata (shapes, dtypes,
    devices, strides, 16-byte alignment; for CPU tensors whether the interpreter is on) is part of the key, so
    a call with other tensors is checked afresh. Lists among the arguments are keyed as tuples. `precision`
    "fp8" quantizes inside the call (kernels/common/fp8.py; static KV tiling, no frame ranges), or with float8
    inputs takes them as given, with their full-size `scales` (`check_fp8_call`, which the public boundary ran)
    and the output in `out_dtype`.
    """
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.get_device(), v.get_device(),
           q.stride(), k.stride(), v.stride(), q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0
           and v.data_ptr() % 16 == 0, q.is_cuda or interpreting(),
           window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling, frame_offsets, precision,
           out_dtype)
    try:
        run = _calls.get(key)
    except TypeError:  # a list among the arguments
        key = tuple(tuple(item) if isinstance(item, list) else item for item in key)
        run = _calls.get(key)
    if run is None:
        check_precision(precision)
        if precision is not None and frame_offsets is not None:
            raise ValueError("precision='fp8' does not run with frame_offsets (natsim.distributed): use bf16 there.")
        run = (_prepare(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling,
                        precision == "fp8", out_dtype)
               if frame_offsets is None else
               _prepare_frames(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse,
                               kv_tiling, frame_offsets))
        if len(_calls) >= MAX_CALLS:
            _calls.pop(next(iter(_calls)))
        _calls[key] = run
    return run(q, k, v) if scales is None else run(q, k, v, scales)


def _prepare(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling, fp8=False,
             out_dtype=None):
    """Validate a call and return the function that runs it on tensors like these (and, for inputs given in
    float8, whose output is in `out_dtype`, on their scales)."""
    shape = check_qkv(q, k, v)
    problem = problem_of(shape, window, stride, dilation, causal)
    check_kv_tiling(kv_tiling)
    if fp8 and kv_tiling == "dynamic":
        raise ValueError("precision='fp8' runs with static KV tiling only, got kv_tiling='dynamic'.")
    if not (q.is_cuda or interpreting()):
        return functools.partial(_run_reference, problem=problem, scale=scale, return_lse=return_lse, fp8=fp8,
                                 out_dtype=out_dtype)
    check_kernel_inputs(q, float8=out_dtype is not None)
    if fp8:
        check_fp8_device(q)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    kernel_problem = problem
    if q_tile is None and kv_tile is None:
        kernel_problem = dense_as_1d(problem) or problem
        given = (None, None)
    else:
        given = kernel_tiles(problem, q_tile, kv_tile)
    views = tuple(t.reshape(batch, *kernel_problem.shape, heads, head_dim) for t in (q, k, v))
    layout = takes_layout_path(kernel_problem, *views, fp8=fp8)
    # natsim chooses between the modes only where both are costed alike: the in-place path (kernels/gna/tiles.py).
    modes = (kv_tiling,) if kv_tiling is not None else (tuple(KERNELS) if layout and not fp8 else ("static",))
    q_dims, kv_dims, mode = choose_tiles(kernel_problem, head_dim, modes, *given)
    if fp8:
        if given == (None, None):
            q_dims = fp8_q_tile(q_dims)
        check_fp8_tiles(q, math.prod(q_dims), math.prod(kv_dims))
    call = make_call(kernel_problem, shape, q_dims, kv_dims, batch=batch, heads=heads, head_dim=head_dim,
                     scale=scale, layout_tensors=views if layout else None, return_lse=return_lse, kv_tiling=mode,
                     fp8=fp8, out_dtype=out_dtype)
    return call.run


def _prepare_frames(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling,
                    frame_offsets):
    """`_prepare` for a frame range: q holds frames from `frame_offsets[0]`, k and v from `frame_offsets[1]`,
    of a layout of `frame_offsets[2]` frames along dimension 0 (static KV tiling only)."""
    problem, frames = check_frames(q, k, v, window, stride, dilation, causal, frame_offsets)
    check_kv_tiling(kv_tiling)
    if kv_tiling == "dynamic":
        raise ValueError("frame_offsets (natsim.distributed's halo exchange) run with static KV tiling only, got "
                         "kv_tiling='dynamic'.")
    if not (q.is_cuda or interpreting()):
        return functools.partial(_run_reference, problem=problem, scale=scale, return_lse=return_lse,
                                 frame_offsets=frame_offsets)
    check_kernel_inputs(q)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    if q_tile is None and kv_tile is None:
        q_dims, kv_dims = default_tiles(problem, head_dim)
    else:
        q_dims, kv_dims = kernel_tiles(problem, q_tile, kv_tile)
    problem, q_dims, kv_dims = frames_as_3d(problem, q_dims, kv_dims)
    views = tuple(t.reshape(*t.shape[:-2], *(1,) * (6 - t.dim()), *t.shape[-2:]) for t in (q, k, v))
    layout = takes_layout_path(problem, *views)
    call = make_call(problem, tuple(views[0].shape[1:-2]), q_dims, kv_dims, batch=batch, heads=heads, head_dim=head_dim,
                     scale=scale, layout_tensors=views if layout else None, return_lse=return_lse, frames=frames)

    def run(q, k, v):
        out, lse = call.run(*(t.reshape(t.shape[0], t.shape[1], *problem.shape[1:], *t.shape[-2:])
                              for t in (q, k, v)))
        return out.view(q.shape), None if lse is None else lse.view(q.shape[:-1])

    return run


def _run_reference(q, k, v, scales=None, *, problem: Problem, scale, return_lse, frame_offsets=None, fp8=False,
                   out_dtype=None):
    """CPU tensors without the interpreter: the exact torch reference (of FP8's rule with `fp8`, on the inputs
    given in float8 with `scales`), with a one-time warning."""
    global _warned_cpu
    if not _warned_cpu:
        import warnings

        warnings.warn("gna_attention got CPU tensors: running the torch reference (exact but slow); "
                      "use CUDA tensors for the Triton kernel.", stacklevel=4)
        _warned_cpu = True
    if fp8:
        result = fp8_reference_attention(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal,
                                         scale, return_lse, scales=scales, out_dtype=out_dtype)
    else:
        result = reference_attention(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal,
                                     scale, return_lse, frame_offsets=frame_offsets)
    return result if return_lse else (result, None)
