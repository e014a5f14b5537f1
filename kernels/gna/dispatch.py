"""One GNA call, from its spec to output: the backend kernels/gna/choice.py picks (natsim's Triton kernel on CUDA
tensors or in the interpreter, FlashAttention-4), the torch reference on CPU tensors; and its backward.

`run_spec` keys every call on its `GnaSpec` (kernels/gna/spec.py) and tensor metadata; the first call with a key
validates what needs the tensors and works the call out (`_prepare`, a `GnaCall` of kernels/gna/launch.py), later
ones look it up, so that a repeated call only checks its tensors, allocates its output and launches (and, on the
launches kernels/common/rows.py lists, copies q, k and v whose head rows start off 64-byte boundaries into aligned
rows first). `forward`
takes the same call as plain arguments, for callers that want the dispatcher's output without the public entry
point's autograd and operator (calibration, benchmarks).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Callable, Optional

import torch

from natsim import Problem
from natsim.problem import BoolOrBools, IntOrInts

from ..common.backend import interpreting
from ..common.checks import KERNEL_HEAD_DIMS
from ..common.fp8 import Fp8Scales, check_fp8_device, check_fp8_tiles, fp8_head_split
from ..common.headdim import head_dim_refusal
from ..common.launch import has_tensor_descriptors, tensor_descriptors_enabled
from ..common.rows import aligned_rows, copies_rows, in_aligned_rows
from ..fa4 import run as fa4_run
from ..gluon.ops import gluon_fp8_forward, gna_fp8_ordered
from .backward import gna_backward
from .checks import check_frames, check_kernel_inputs, check_qkv, given_tiles, kernel_tiles
from .choice import Choice, backward_refusal, choose
from .launch import KERNELS, GnaCall, dense_as_1d, frames_as_3d, make_call, takes_layout_path
from .reference import fp8_reference_attention, reference_attention
from .spec import GnaSpec
from .tiles import choose_tiles, default_tiles, fp8_tiles

MAX_CALLS = 1024  # distinct calls kept (a model has a handful of attention shapes)
_calls: dict = {}
_warned_cpu = False

Output = tuple[torch.Tensor, Optional[torch.Tensor]]
Runner = Callable[..., Output]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: IntOrInts, stride: IntOrInts = 1,
            dilation: IntOrInts = 1, causal: BoolOrBools = False, scale: Optional[float] = None,
            q_tile: Optional[IntOrInts] = None, kv_tile: Optional[IntOrInts] = None, return_lse: bool = False,
            kv_tiling: Optional[str] = None, frame_offsets: Optional[tuple[int, int, int]] = None,
            precision: Optional[str] = None, scales: Optional[Fp8Scales] = None,
            out_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None) -> Output:
    """GNA forward of `[B, *shape, heads, head_dim]` tensors from `gna_attention`'s arguments: `(out, lse)`,
    `lse` None unless asked. Their spec (`GnaSpec.of`, checked) run by `run_spec`; no autograd, no operator.
    Inputs given in float8 come with their full-size `scales` and `out_dtype` as `check_fp8_call` returns them."""
    spec = GnaSpec.of(q.dim() - 3, window, stride, dilation, causal, scale=scale, q_tile=q_tile, kv_tile=kv_tile,
                      kv_tiling=kv_tiling, frame_offsets=frame_offsets, precision=precision, out_dtype=out_dtype,
                      return_lse=return_lse, backend=backend)
    return run_spec(q, k, v, spec, scales)


def run_spec(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: GnaSpec,
             scales: Optional[Fp8Scales] = None) -> Output:
    """GNA forward of `spec` on `[B, *shape, heads, head_dim]` tensors: `(out, lse)`, `lse` None unless
    `spec.return_lse`.

    `spec.kv_tiling` "static" or "dynamic" picks the kernel; None lets natsim choose by predicted work
    (kernels/gna/tiles.py, `choose_tiles`). The first call with a spec and given tensor metadata validates what
    needs the tensors and works the call out (`_prepare`); later ones look it up. Tensor metadata (shapes,
    dtypes, devices, strides, 16-byte alignment; for CPU tensors whether the interpreter is on) is part of the
    key, so a call with other tensors is checked afresh, and so is whether tensor descriptors are allowed
    (kernels/common/launch.py, `set_tensor_descriptors`). `spec.precision` "fp8" quantizes inside the call
    (kernels/common/fp8.py; static KV tiling, no frame ranges), or with float8 inputs takes them as given, with
    their full-size `scales` (`check_fp8_call`, which the public boundary ran) and the output in
    `spec.out_dtype`.
    """
    run = prepared(q, k, v, spec)
    return run(q, k, v) if scales is None else run(q, k, v, scales)


def prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: GnaSpec) -> Runner:
    """The function that runs `spec` on tensors like q, k, v: validated and worked out on the first call with
    their metadata (raising the call's sentence where it is refused), looked up after."""
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.get_device(), v.get_device(),
           q.stride(), k.stride(), v.stride(), q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0
           and v.data_ptr() % 16 == 0, q.is_cuda or interpreting(), tensor_descriptors_enabled(), spec)
    run = _calls.get(key)
    if run is None:
        run = _prepare(q, k, v, spec) if spec.frames is None else _prepare_frames(q, k, v, spec)
        if len(_calls) >= MAX_CALLS:
            _calls.pop(next(iter(_calls)))
        _calls[key] = run
    return run


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: GnaSpec) -> Runner:
    """Validate a call against its tensors and return the function that runs it on tensors like these (and, for
    inputs given in float8, whose output is in `spec.out_dtype`, on their scales)."""
    shape = check_qkv(q, k, v)
    problem = spec.problem(shape)
    choice = choose(spec, problem, q)
    if choice.backend == "reference":
        if spec.q_tile is not None or spec.kv_tile is not None:
            given_tiles(problem, spec.q_tile, spec.kv_tile)  # the reference runs any tiles, but not malformed ones
        return functools.partial(_run_reference, problem=problem, spec=spec)
    if choice.backend == "fa4":
        return functools.partial(_run_fa4, choice=choice, spec=spec)
    if choice.backend == "gluon":
        return functools.partial(_run_gluon, choice=choice, spec=spec)
    fp8 = spec.precision == "fp8"
    check_kernel_inputs(q, float8=spec.out_dtype is not None)
    if fp8:
        check_fp8_device(q)
        fp8_head_split(q.shape[-1])  # a sentence for a head dim FP8 does not run
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    kernel_problem = problem
    if spec.q_tile is None and spec.kv_tile is None:
        kernel_problem = dense_as_1d(problem) or problem
        given = (None, None)
    else:
        given = kernel_tiles(problem, spec.q_tile, spec.kv_tile)
    views = tuple(t.reshape(batch, *kernel_problem.shape, heads, head_dim) for t in (q, k, v))
    layout = takes_layout_path(kernel_problem, *views, fp8=fp8)
    # natsim chooses between the modes only where both are costed alike: the in-place path (kernels/gna/tiles.py).
    modes = ((spec.kv_tiling,) if spec.kv_tiling is not None
             else (tuple(KERNELS) if layout and not fp8 else ("static",)))
    q_dims, kv_dims, mode = (fp8_tiles if fp8 else choose_tiles)(kernel_problem, head_dim, modes, *given)
    if fp8:
        check_fp8_tiles(q, math.prod(q_dims), math.prod(kv_dims))
    # In place, the kernel reads q, k, v where they are: in aligned copies where that pays (kernels/common/rows.py;
    # the permuted path's permutation makes its own rows). The call's strides are the copies'.
    aligned = layout and not fp8 and any(copies_rows((mode, math.prod(q_dims)), t) for t in (q, k, v))
    if aligned:
        views = tuple(aligned_rows(t.shape, t.dtype, "meta") for t in views)
    call = make_call(kernel_problem, shape, replace(spec, q_tile=q_dims, kv_tile=kv_dims, kv_tiling=mode),
                     batch=batch, heads=heads, head_dim=head_dim, layout_tensors=views if layout else None,
                     descriptors=has_tensor_descriptors(q.device))
    return functools.partial(_run_aligned, call=call) if aligned else call.run


def _run_aligned(q, k, v, *, call: GnaCall) -> Output:
    """`call` on copies of q, k and v whose head rows start on 128-byte boundaries (kernels/common/rows.py)."""
    return call.run(in_aligned_rows(q), in_aligned_rows(k), in_aligned_rows(v))


def _scale(spec: GnaSpec, q: torch.Tensor) -> float:
    return q.shape[-1] ** -0.5 if spec.scale is None else spec.scale


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`[B, *shape, H, D]` as one sequence `[B, N, H, D]`."""
    return t.reshape(t.shape[0], -1, *t.shape[-2:])


def _run_gluon(q, k, v, *, choice: Choice, spec: GnaSpec) -> Output:
    """The Gluon FP8 kernel: GNA of the chosen geometry on tokens in its Q tile's order (the simulator's visited
    blocks as its lists, the partial ones masked inside by the tile mask; the quantization reads the layout in
    that order), or dense attention over the flattened layout."""
    geometry, scale = choice.gluon, _scale(spec, q)
    if geometry is None:
        out, lse = gluon_fp8_forward(_flat(q), _flat(k), _flat(v), None, None, scale, spec.return_lse)
        return out.view(q.shape), lse.view(q.shape[:-1]) if spec.return_lse else None
    out, lse = gna_fp8_ordered(_flat(q), _flat(k), _flat(v), geometry.problem, geometry.q_tile, scale,
                               spec.return_lse, rows=geometry.order_rows(q.device))
    return geometry.from_order(out), geometry.lse_from_order(lse) if spec.return_lse else None


def _run_fa4(q, k, v, *, choice: Choice, spec: GnaSpec) -> Output:
    """FlashAttention-4: GNA of the chosen geometry, or dense attention over the flattened layout."""
    if choice.fa4 is not None:
        return choice.fa4.forward(q, k, v, _scale(spec, q), spec.return_lse)
    out, lse = fa4_run.forward(_flat(q), _flat(k), _flat(v), _scale(spec, q), None, None, spec.return_lse)
    return out.view(q.shape), None if lse is None else lse.view(q.shape[:-1])


def run_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], spec: GnaSpec):
    """dq, dk, dv of a GNA forward of `spec` on GPU tensors (or in the interpreter) from its output and LSE; an
    empty `lse` (a forward called without it) runs the forward again for it. FlashAttention-4 differentiates
    what it ran forward where its backward runs the tiles (kernels/backends/fa4.py), natsim's Triton backward
    kernels the rest."""
    problem = spec.problem(tuple(q.shape[1:-2]))
    if not lse.numel():
        out, lse = run_spec(q, k, v, replace(spec, return_lse=True))
    choice = choose(spec, problem, q)
    head_dim = q.shape[-1]
    if choice.backend == "fa4" and backward_refusal(choice, head_dim) is None:
        scale = _scale(spec, q)
        if choice.fa4 is not None:
            return choice.fa4.backward(q, k, v, out, lse, grad_out, grad_lse, scale)
        rows = lambda t: None if t is None else t.reshape(t.shape[0], -1, t.shape[-1])  # noqa: E731
        grads = fa4_run.backward(_flat(q), _flat(k), _flat(v), _flat(out), _flat(grad_out), rows(lse), rows(grad_lse),
                                 scale, None, None)
        return tuple(g.view(t.shape) for g, t in zip(grads, (q, k, v)))
    refusal = head_dim_refusal(head_dim, "Triton backward", KERNEL_HEAD_DIMS)
    if choice.backend == "fa4" and refusal is not None:
        raise ValueError(f"natsim has no backward for this call: {backward_refusal(choice, head_dim)} {refusal}")
    return gna_backward(q, k, v, out, lse, grad_out, grad_lse, problem, spec.scale)


def _prepare_frames(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: GnaSpec) -> Runner:
    """`_prepare` for a frame range (`spec.frames`): q holds frames from `q0`, k and v from `k0`, of a layout of
    `frames` frames along dimension 0 (static KV tiling only)."""
    problem, bounds = check_frames(q, k, v, spec.frames, *spec.parameters)
    if not (q.is_cuda or interpreting()):
        return functools.partial(_run_reference, problem=problem, spec=spec)
    check_kernel_inputs(q)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if spec.q_tile is None and spec.kv_tile is None:
        q_dims, kv_dims = default_tiles(problem, head_dim)
    else:
        q_dims, kv_dims = kernel_tiles(problem, spec.q_tile, spec.kv_tile)
    problem, q_dims, kv_dims = frames_as_3d(problem, q_dims, kv_dims)
    views = tuple(t.reshape(*t.shape[:-2], *(1,) * (6 - t.dim()), *t.shape[-2:]) for t in (q, k, v))
    layout = takes_layout_path(problem, *views)
    call = make_call(problem, tuple(views[0].shape[1:-2]),
                     replace(spec, q_tile=q_dims, kv_tile=kv_dims, kv_tiling="static"), batch=batch, heads=heads,
                     head_dim=head_dim, layout_tensors=views if layout else None, frames=bounds,
                     descriptors=has_tensor_descriptors(q.device))

    def run(q, k, v):
        out, lse = call.run(*(t.reshape(t.shape[0], t.shape[1], *problem.shape[1:], *t.shape[-2:])
                              for t in (q, k, v)))
        return out.view(q.shape), None if lse is None else lse.view(q.shape[:-1])

    return run


def _run_reference(q, k, v, scales=None, *, problem: Problem, spec: GnaSpec):
    """CPU tensors without the interpreter: the exact torch reference (of FP8's rule with precision "fp8", on the
    inputs given in float8 with `scales`), with a one-time warning."""
    global _warned_cpu
    if not _warned_cpu:
        import warnings

        warnings.warn("gna_attention got CPU tensors: running the torch reference (exact but slow); "
                      "use CUDA tensors for the Triton kernel.", stacklevel=4)
        _warned_cpu = True
    parameters = (problem.window, problem.stride, problem.dilation, problem.causal)
    if spec.precision == "fp8":
        result = fp8_reference_attention(q, k, v, *parameters, spec.scale, spec.return_lse, scales=scales,
                                         out_dtype=spec.out_dtype)
    else:
        result = reference_attention(q, k, v, *parameters, spec.scale, spec.return_lse, frame_offsets=spec.frames)
    return result if spec.return_lse else (result, None)
