"""Public entry points of GNA attention.

- `gna_attention(q, k, v, window, ...)`: `[B, *shape, heads, head_dim]` in and out. Its arguments become one
  `GnaSpec` (kernels/gna/spec.py). Runs the registered operator `natsim::gna_forward` (kernels/gna/ops.py)
  under torch.compile, autograd or a dispatch mode, and in plain eager calls goes straight to the same cached
  implementation (kernels/gna/dispatch.py), which skips the dispatcher's per-call cost. Both do exactly the
  same work.
- `gna_attention_permuted(q, k, v, problem, q_tile, kv_tile, ...)`: tensors already permuted
  (kernels/gna/permute.py), q with `q_tile`, k and v with `kv_tile`; output in q's permuted order.
- `gna_tile_counts(...)`: runs the kernel with its debug counters on and returns, per Q tile, the KV tiles
  visited and the KV tiles run without the window mask.

On CPU tensors (without TRITON_INTERPRET=1) `gna_attention` runs `reference_attention` and warns once.
"""

from __future__ import annotations

import functools
from typing import Mapping, Optional, Union

import numpy as np
import torch

from natsim import Problem
from natsim.partition import key_frames
from natsim.problem import BoolOrBools, IntOrInts

from ..common.backend import autocast_inputs, refuse_untracked, runs_eagerly, use_triton
from ..common.checks import check_matching, check_scale, check_tensors
from ..common.fp8 import Fp8Scales, check_fp8_call, refuse_gradients, scale_tensors
from ..common.launch import Overrides, has_tensor_descriptors, launch_overrides
from .checks import check_kernel_inputs, check_qkv, kernel_tiles
from .choice import choose
from .dispatch import prepared, run_spec
from .launch import GnaCall, frames_as_3d, make_call
from .layout import TileLayout
from .ops import gna_forward
from .spec import GnaSpec
from .tiles import default_tiles


def gna_attention_permuted(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    q_tile: Optional[IntOrInts] = None,
    kv_tile: Optional[IntOrInts] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    config: Union[tuple[int, int], Mapping[str, object], None] = None,
):
    """GNA on permuted `[B, tokens, heads, head_dim]` tensors; output (and `[B, tokens, heads]` LSE) permuted.

    `config=(num_warps, num_stages)` overrides the launch configuration (for tuning; no warp specialization);
    a dict overrides any of the launch options (kernels/common/launch.py, `LaunchOptions`: `num_warps`,
    `num_stages`, `USE_TMA`, `WARP_SPECIALIZE`, `MASKED`, which may only be forced on, `HEAD_MAJOR`, a grid
    over (batch * heads, Q tiles), and `CHUNK_A` / `CHUNK_B`, head_dim's column chunks, kernels/common/headdim.py:
    `head_split(head_dim, "pad")`'s or `"split"`'s); another name is refused with a sentence.
    """
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a natsim.Problem, got {type(problem).__name__}.")
    check_tensors(q, k, v)
    check_matching(q, k, v)
    if not use_triton(q):
        raise ValueError(
            f"gna_attention_permuted runs the Triton kernel only: it needs CUDA tensors (or "
            f"TRITON_INTERPRET=1), got q.device={q.device}."
        )
    refuse_untracked("gna_attention_permuted", q, k, v)
    if q.dim() != 4:
        raise ValueError(f"q must be permuted to [batch, tokens, heads, head_dim], got q.shape={tuple(q.shape)}.")
    check_kernel_inputs(q)
    q_dims, kv_dims = kernel_tiles(problem, q_tile, kv_tile)
    if isinstance(config, tuple):
        config = dict(num_warps=config[0], num_stages=config[1], WARP_SPECIALIZE=False)
    scale = check_scale(scale)
    spec = GnaSpec.for_problem(problem, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                               q_tile=q_dims, kv_tile=kv_dims, kv_tiling="static", return_lse=bool(return_lse))
    call = _permuted_call(problem, spec, q.shape[0], q.shape[2], q.shape[3], has_tensor_descriptors(q.device),
                          launch_overrides(config, "config"))  # tensors checked for alignment per launch
    _check_permuted(call, q, k, v)
    out, lse, _ = call.run_permuted(*(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)))
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=256)
def _permuted_call(problem: Problem, spec: GnaSpec, batch: int, heads: int, head_dim: int, descriptors: bool,
                   overrides: Overrides = (), debug: bool = False,
                   frames: Optional[tuple[int, int, int, int]] = None) -> GnaCall:
    """The call that runs `spec` on permuted tensors of `problem` (kept per distinct arguments; `descriptors`:
    the device's `has_tensor_descriptors`, so that turning them off makes another call)."""
    return make_call(problem, problem.shape, spec, batch=batch, heads=heads, head_dim=head_dim, layout_tensors=None,
                     frames=frames, overrides=overrides, debug=debug, check_alignment=True, descriptors=descriptors)


def _check_permuted(call: GnaCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    problem = call.problem
    q_layout = TileLayout(problem.shape, call.spec.q_tile, problem.dilation)
    kv_layout = TileLayout(problem.shape, call.spec.kv_tile, problem.dilation)
    batch, heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
    for name, t, layout in (("q", q, q_layout), ("k", k, kv_layout), ("v", v, kv_layout)):
        if t.dim() != 4 or t.shape[0] != batch or t.shape[1] != layout.num_tokens or t.shape[2:] != q.shape[2:]:
            raise ValueError(
                f"{name} must be permuted to [{batch}, {layout.num_tokens}, {heads}, {head_dim}] for "
                f"{problem} with tile {layout.tile}, got {name}.shape={tuple(t.shape)}."
            )


def gna_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    scale: Optional[float] = None,
    q_tile: Optional[IntOrInts] = None,
    kv_tile: Optional[IntOrInts] = None,
    return_lse: bool = False,
    kv_tiling: Optional[str] = None,
    frame_offsets: Optional[tuple[int, int, int]] = None,
    precision: Optional[str] = None,
    scales: Optional[Fp8Scales] = None,
    out_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
):
    """Generalized Neighborhood Attention, forward, on `[B, *shape, heads, head_dim]` tensors (1 to 3 dims).

    Scalars broadcast over dimensions. `q_tile` / `kv_tile` are per-dimension tile shapes; one given alone is
    used for both, and without either natsim picks the tiles with the least predicted work for this problem
    among those the kernel runs well (natsim.kernels.gna.tiles; dense attention runs over the flattened sequence).
    `kv_tiling` "static" visits the fixed grid of KV tiles a Q tile's keys overlap (kernels/gna/forward.py);
    "dynamic" tiles exactly the box of keys it needs from the box's corner (kernels/gna/dynamic.py); None lets
    natsim choose by predicted work where both are costed (the in-place path; static elsewhere).
    Returns the output in q's layout, and with `return_lse` also the natural-log log-sum-exp
    `[B, *shape, heads]` in float32. Differentiable with respect to q, k and v (and through the LSE): the
    Triton backward kernels on CUDA tensors, the reference's gradients on CPU ones; inside an autocast region
    q, k, v are cast to its dtype.

    `frame_offsets=(q0, k0, L0)` (natsim.distributed's halo exchange; static KV tiling, no backward kernel):
    q holds frames `[q0, q0 + Tq)` of the layout's dimension 0, which has `L0` frames, and k, v hold frames
    `[k0, k0 + Tk)`, every frame q's windows reach; windows are the global layout's. The output covers q's
    frames.

    `precision="fp8"` (inference only) quantizes q, k, v to float8 e4m3 inside the call and runs QK^T and P @ V
    on FP8 tensor cores with fp32 accumulation (kernels/common/fp8.py: scales per token for Q and K, K's mean
    removed, per channel for V, P per tile); the output keeps the inputs' dtype. Static KV tiling, no
    `frame_offsets`; CPU tensors run a reference that applies the same quantization.

    q, k, v already in float8 e4m3 come with `scales=Fp8Scales(q_scale, k_scale, v_scale)` (per token and head
    for q and k, per channel for v; kernels/common/fp8.py says which shapes broadcast) and imply
    `precision="fp8"`: the kernel reads them as given (no K mean removed; the LSE is of the given values'
    scores) and returns the output in `out_dtype` (torch.bfloat16 by default, or torch.float16).

    `backend`: "triton" (natsim's kernels), "fa4" (FlashAttention-4, when installed: `pip install
    'natsim[fa4]'`; q, k, v in the Q tile's token order, permuted for it, the KV tile the Q tile or a slab of it
    along its first dimension longer than 1; bf16 / fp16, no frame ranges, no FP8, static KV tiling), or None:
    natsim chooses, FlashAttention-4 where it runs the call and every block it visits is full (dense attention,
    block-sparse configurations) or natsim's kernels do not run the head dim, natsim's kernels elsewhere
    (kernels/gna/choice.py; `chosen_backend` says which). A backend that cannot run the call is refused with a
    sentence saying why. Gradients run on the forward's backend where its backward takes the tiles.
    """
    check_tensors(q, k, v)
    q, k, v = autocast_inputs(q, k, v)
    precision, scales, out_dtype = check_fp8_call(q, k, v, precision, scales, out_dtype)
    if precision is not None:
        refuse_gradients("gna_attention", q, k, v, *scale_tensors(scales))
    eager = runs_eagerly(q, k, v)  # no gradient to track there
    # The backward kernels need the forward's LSE: ask for it whenever autograd will want gradients.
    tracked = not eager and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    spec = GnaSpec.of(q.dim() - 3, window, stride, dilation, causal, scale=scale, q_tile=q_tile, kv_tile=kv_tile,
                      kv_tiling=kv_tiling, frame_offsets=frame_offsets, precision=precision, out_dtype=out_dtype,
                      return_lse=return_lse or tracked, backend=backend)
    if eager:
        out, lse = run_spec(q, k, v, spec, scales)
    else:
        out, lse = gna_forward(q, k, v, *spec.operator_arguments(scales))
    return (out, lse) if return_lse else out


def chosen_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: IntOrInts, stride: IntOrInts = 1,
                   dilation: IntOrInts = 1, causal: BoolOrBools = False, q_tile: Optional[IntOrInts] = None,
                   kv_tile: Optional[IntOrInts] = None, kv_tiling: Optional[str] = None,
                   backend: Optional[str] = None, precision: Optional[str] = None,
                   scales: Optional[Fp8Scales] = None) -> str:
    """The backend `gna_attention` runs these arguments on: "triton", "fa4", "gluon" (FP8) or "reference" (CPU
    tensors), or the sentence error it would raise (kernels/gna/choice.py): the call is worked out as
    `gna_attention` works it out (under autocast, in autocast's dtype; q, k, v in float8 with their `scales`; FP8's
    refusal of inputs that require grad), so where it would be refused this raises the same sentence."""
    check_tensors(q, k, v)
    q, k, v = autocast_inputs(q, k, v)
    precision, scales, out_dtype = check_fp8_call(q, k, v, precision, scales, None)
    if precision is not None:
        refuse_gradients("gna_attention", q, k, v, *scale_tensors(scales))
    spec = GnaSpec.of(q.dim() - 3, window, stride, dilation, causal, q_tile=q_tile, kv_tile=kv_tile,
                      kv_tiling=kv_tiling, backend=backend, precision=precision, out_dtype=out_dtype)
    prepared(q, k, v, spec)
    return choose(spec, spec.problem(check_qkv(q, k, v)), q).backend


def gna_tile_counts(
    shape: IntOrInts,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    q_tile: Optional[IntOrInts] = None,
    kv_tile: Optional[IntOrInts] = None,
    head_dim: int = 32,
    device: str = "cuda",
    dtype: torch.dtype = torch.float16,
    kv_tiling: str = "static",
    frames: Optional[tuple[int, int, int, int]] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the kernel of `kv_tiling` ("static" or "dynamic") with its debug counters on (random inputs,
    batch 1, one head, permuted tokens).

    Returns `(visited, unmasked)`, one entry per Q tile in permuted order: the KV tiles the kernel visited
    and the KV tiles it found full (every real query attends every real key; the static kernel runs exactly
    these without the window mask, the dynamic one all of them but those holding keys past the group's end).
    Compare with `natsim.simulate(problem, TileConfig(..., kv_tiling=kv_tiling), per_q_tile=True)`.
    With `frames=(q0, q1, k0, k1)` (queries in frames `[q0, q1)` of dimension 0, keys in `[k0, k1)`; static
    KV tiling) compare with `natsim.partition.rank_tiles`.
    """
    if kv_tiling not in ("static", "dynamic"):
        raise ValueError(f"kv_tiling must be 'static' or 'dynamic', got kv_tiling={kv_tiling!r}.")
    if frames is not None and kv_tiling != "static":
        raise ValueError(f"frames run with static KV tiling only, got kv_tiling={kv_tiling!r}.")
    problem = Problem(shape, window, stride, dilation, causal)
    if q_tile is None and kv_tile is None:
        q_dims, kv_dims = default_tiles(problem, head_dim)
    else:
        q_dims, kv_dims = kernel_tiles(problem, q_tile, kv_tile)
    q_shape = kv_shape = problem.shape
    if frames is not None:
        frames = tuple(int(x) for x in frames)
        need = key_frames(problem, frames[0], frames[1])
        if not (0 <= frames[0] < frames[1] <= problem.shape[0] and frames[2] <= need[0] and need[1] <= frames[3]
                <= problem.shape[0]):
            raise ValueError(f"frames must be (q0, q1, k0, k1) with 0 <= q0 < q1 <= {problem.shape[0]} and keys "
                             f"[k0, k1) within the layout holding the frames the queries attend, {need}, got "
                             f"frames={frames}.")
        problem, q_dims, kv_dims = frames_as_3d(problem, q_dims, kv_dims)
        q_shape = (frames[1] - frames[0], *problem.shape[1:])
        kv_shape = (frames[3] - frames[2], *problem.shape[1:])
    q_tokens = TileLayout(q_shape, q_dims, problem.dilation).num_tokens
    kv_tokens = TileLayout(kv_shape, kv_dims, problem.dilation).num_tokens
    q = torch.randn((1, q_tokens, 1, head_dim), device=device, dtype=dtype)
    k = torch.randn((1, kv_tokens, 1, head_dim), device=device, dtype=dtype)
    v = torch.randn((1, kv_tokens, 1, head_dim), device=device, dtype=dtype)
    check_kernel_inputs(q)
    spec = GnaSpec.for_problem(problem, scale=head_dim**-0.5, q_tile=q_dims, kv_tile=kv_dims, kv_tiling=kv_tiling)
    call = _permuted_call(problem, spec, 1, 1, head_dim, has_tensor_descriptors(q.device), debug=True, frames=frames)
    _, _, counts = call.run_permuted(q, k, v)
    counts = counts.cpu().numpy().astype(np.int64)
    return counts[:, 0], counts[:, 1]
