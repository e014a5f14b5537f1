"""Host side of the GNA kernel: what one call needs, worked out once per distinct arguments, and its launch.

A `GnaCall` holds every decision of a call that depends only on plain-Python arguments and tensor metadata
(shapes, dtype, device, strides): the validated problem, the tiles, the data path, whether the kernel needs the
mask, launch options, grid and every scalar kernel argument. `gna_call` builds one per distinct key and keeps
it, so that a repeated call only checks its tensors, allocates its output and launches through a
`PreboundKernel` (Triton's JIT dispatch, which binds and specialises every one of the kernel's 70 arguments on
each call, is skipped once the kernel is compiled).

Two data paths (kernels/gna.py, `LAYOUT`):
- layout: the kernel reads q, k, v and writes o where they are, `[B, *shape, heads, head_dim]`, through rank-4
  tensor descriptors (Hopper's bulk tensor copies; padding lies out of bounds and reads as zeros): no
  permutation, one launch. Taken when every dilation is 1 and the tensors meet the descriptors' rules.
- permuted: permute q, k, v into tiles (kernels/permute.py), run the kernel on the permuted sequences,
  unpermute o and the LSE: dilation groups, GPUs before Hopper, unaligned tensors.
Dense attention (window = shape, non-causal, default tiles) runs as 1-D attention over the flattened layout:
every query attends every key either way, and only the last tile holds padding instead of every dimension's.
Two kernels share the arguments and both paths: static KV tiling (kernels/gna.py) and dynamic KV tiling
(kernels/gna_dynamic.py); `kv_tiling=None` lets `choose_tiles` (kernels/tiles.py) pick the mode with the tiles,
between both on the layout path and static on the permuted one, whose gathers are not calibrated.

Frame ranges (`frame_offsets`, for natsim.distributed's halo exchange): q holds frames `[q0, q0 + Tq)` of
dimension 0 of a layout of `L0` frames and k, v frames `[k0, k0 + Tk)`, which must hold every frame the queries'
windows reach. Window bounds are global; Q and KV tiles are cut from the local first frames
(natsim.partition.frame_dim_tiles counts them the same way). No dense-as-1-D there.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from natsim import Problem

from .backend import interpreting
from .gna import LOG2E, gna_forward_kernel
from .gna_dynamic import gna_dynamic_kernel
from .layout import TileLayout, as_3d
from .permute import permute, unpermute

try:  # Triton >= 3.4 keeps its launch hooks here; without it every launch goes through the JIT dispatch.
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None

SHARED_MEMORY_BUDGET = 227 * 1024  # bytes: what one H100 thread block may use
TENSOR_ARGUMENTS = ("Q", "K", "V", "O", "LSE", "COUNTS")
LAUNCH_OPTIONS = ("num_warps", "num_stages")


# -- what the kernel needs to know, from plain Python values ---------------------------------------------------


KERNELS = {"static": gna_forward_kernel, "dynamic": gna_dynamic_kernel}


@functools.lru_cache(maxsize=512)
def needs_mask(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...],
               kv_tiling: str = "static") -> bool:
    """Whether any KV tile the kernel visits can be partial (window mask) or reach into padding.

    The kernel's visited tiles per Q tile are a box, one KV tile range per dimension, and a tile is full when
    it is full along every dimension, so checking every dimension on its own is exact: this mirrors the
    kernel's `_dim_setup` (static) or `_box` (dynamic: tiles start at `start(first)`) and its `full` test for
    each dilation group length and Q tile along the dimension. False for dense attention and block-sparse
    configurations; the kernel then compiles no mask code.
    """
    from natsim.window import group_length, window_bounds

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
    from natsim.partition import frame_dim_tiles
    from natsim.window import group_length

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


def launch_config(
    block_m: int, block_n: int, head_dim: int, masked: bool = True, tma: bool = False, specialize: bool = True
) -> dict:
    """Launch options for a tile of `block_m` queries, `block_n` keys and `head_dim` (see kernels/gna.py).

    A 128x128 tile without masks, with tensor descriptors, runs warp-specialized: `num_warps=4` asks for one
    consumer warpgroup per 64 query rows (Triton's Hopper pass makes two of them and adds a producer
    warpgroup for the K/V copies, 12 warps in all) and two K/V stages fill shared memory. Otherwise 8 warps
    (4 for smaller tiles) and three pipeline stages when they fit in shared memory (measured faster than two
    at 128x128x128 on the H100, benchmarks/results/gna-tune-*.json).

    `specialize=False` keeps the single-partition loop: the launcher asks for it when the kernel writes the
    LSE or debug counts. Under Triton 3.6's Hopper warp specialization the LSE came out wrong (off by more
    than 1e-2 against float64 at HunyuanVideo 16x8x8) while the output was right (H100, 2026-11-22).
    """
    q_bytes, kv_bytes = 2 * block_m * head_dim, 2 * 2 * block_n * head_dim
    large = block_m * head_dim >= 128 * 128
    if specialize and tma and not masked and large and block_m == 128 and block_n == 128:
        return dict(num_warps=4, num_stages=2, MASKED=False, USE_TMA=True, WARP_SPECIALIZE=True)
    stages = 3 if q_bytes + 3 * kv_bytes <= SHARED_MEMORY_BUDGET else 2
    return dict(num_warps=8 if large else 4, num_stages=stages, MASKED=masked, USE_TMA=tma, WARP_SPECIALIZE=False)


@functools.lru_cache(maxsize=16)
def has_tensor_descriptors(device: torch.device) -> bool:
    """Tensor descriptors (the bulk tensor copy engine) need Hopper or newer; the interpreter has them too."""
    return interpreting() or torch.cuda.get_device_capability(device)[0] >= 9


def permutes(problem: Problem, descriptors: bool = True) -> bool:
    """Whether a call of `problem` permutes its tokens (the permuted path): dilation groups, or a GPU without
    tensor descriptors. Dense-contiguous layouts on Hopper never do."""
    return not descriptors or any(d > 1 for d in problem.dilation)


def descriptor_strides_ok(t: torch.Tensor) -> bool:
    """Descriptors need a contiguous last dimension, every other stride a multiple of 16 bytes, and positive
    strides along the token dimensions (those between batch and heads: an expanded, stride-0 one is not a
    layout a descriptor can walk)."""
    size = t.element_size()
    return (t.stride(-1) == 1 and all(st * size % 16 == 0 for st in t.stride()[:-1])
            and all(st > 0 for st in t.stride()[1:-2]))


def aligned(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary (descriptors, and the kernel's pointer specialisation)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def dense_as_1d(problem: Problem) -> Optional[Problem]:
    """The 1-D problem over the flattened layout when `problem` is dense self attention, else None."""
    if problem.ndim == 1 or problem.window != problem.shape or any(problem.causal):
        return None
    return Problem((problem.num_tokens,), (problem.num_tokens,))


# -- launching without Triton's JIT dispatch -------------------------------------------------------------------


def _install_allocator() -> None:
    """In-kernel tensor descriptors need a scratch allocator; install a torch one unless the caller has one."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # pragma: no cover - layout of triton's internals changed
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_torch_allocator)


_CPU, _CUDA = torch.device("cpu"), torch.device("cuda")


def _torch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device=_CPU if interpreting() else _CUDA)


class PreboundKernel:
    """One Triton kernel with a fixed grid and every argument fixed but its tensors.

    The first call goes through `kernel[grid](...)`, which compiles (or finds) the kernel specialised for
    these arguments. Later calls hand the arguments straight to the compiled kernel's launcher, as Triton's
    dispatch would after binding, specialising and hashing them: valid because every scalar argument is the
    same by construction and the tensors are 16-byte aligned as on the first call (checked; an unaligned
    call takes the dispatch, which specialises for it). The interpreter always takes the dispatch.
    """

    def __init__(self, fn, grid: tuple[int, int, int], arguments: dict, options: dict, check_alignment: bool):
        self.fn = fn
        self.grid = grid
        self.arguments = arguments
        self.options = options
        self.check_alignment = check_alignment
        parameters = inspect.signature(fn.fn).parameters
        self.template = [arguments.get(name, parameters[name].default) for name in fn.arg_names]
        self.slots = [fn.arg_names.index(name) for name in TENSOR_ARGUMENTS]
        self.compiled = None

    def __call__(self, *tensors: torch.Tensor) -> None:
        """Launch on `tensors` (Q, K, V, O, LSE, COUNTS). Without `check_alignment` the caller guarantees
        16-byte aligned tensors (its key includes their alignment, and it allocates the rest)."""
        index = tensors[0].get_device()  # -1 for CPU tensors (the interpreter)
        if index >= 0 and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                self._launch(tensors, index)
        else:
            self._launch(tensors, index)

    def _launch(self, tensors: tuple[torch.Tensor, ...], index: int) -> None:
        kernel = self.compiled
        if kernel is None or (self.check_alignment and not aligned(*tensors)):
            compiled = self.fn[self.grid](**self.arguments, **dict(zip(TENSOR_ARGUMENTS, tensors)), **self.options)
            if _knobs is not None and hasattr(compiled, "packed_metadata") and aligned(*tensors):
                self.compiled = compiled
            return
        args = self.template.copy()
        for slot, tensor in zip(self.slots, tensors):
            args[slot] = tensor
        stream = torch._C._cuda_getCurrentRawStream(index)
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        if _hooked(enter) or _hooked(leave):  # a profiler listens: give it what Triton's dispatch would
            kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata,
                       kernel.launch_metadata(self.grid, stream, *args), enter, leave, *args)
        else:
            kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook has anything to call (a HookChain with calls, or a plain function)."""
    return hook is not None and bool(getattr(hook, "calls", True))


# -- one call ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GnaCall:
    """Everything about a GNA forward call but its tensors: run it with `gna_call(...).run(q, k, v)`.

    `problem`, `q_tile`, `kv_tile` are what the kernel runs (a dense problem as 1-D over the flattened layout);
    `shape` is the caller's layout; `kv_tiling` which kernel: static (kernels/gna.py) or dynamic
    (kernels/gna_dynamic.py) KV tiles. `layout` selects the data path (module docstring). `kernel` is the
    pre-bound launch for the tensors the kernel reads: the caller's (layout) or permuted ones.
    """

    problem: Problem
    shape: tuple[int, ...]
    q_tile: tuple[int, ...]
    kv_tile: tuple[int, ...]
    layout: bool
    return_lse: bool
    debug: bool
    kernel: PreboundKernel
    kv_tiling: str = "static"
    frames: Optional[tuple[int, int, int, int]] = None  # (q0, q1, k0, k1) along dimension 0, or None

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

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """`(out, lse)` of `[B, *shape, heads, head_dim]` inputs in that layout (`lse` None unless asked)."""
        flattened = self.q_shape != self.shape  # dense attention as 1-D: views when contiguous
        if flattened:
            batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
            q, k, v = (t.reshape(batch, *self.problem.shape, heads, head_dim) for t in (q, k, v))
        if self.layout:
            out = new_output(q.shape, q.dtype, q.device)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if self.return_lse else None
            self.kernel(q, k, v, out, out if lse is None else lse, out)
        else:
            dilation = self.problem.dilation
            out_p, lse_p, _ = self.run_permuted(permute(q, self.q_tile, dilation), permute(k, self.kv_tile, dilation),
                                                permute(v, self.kv_tile, dilation))
            out = unpermute(out_p, self.q_shape, self.q_tile, dilation)
            lse = (None if lse_p is None
                   else unpermute(lse_p[..., None], self.q_shape, self.q_tile, dilation)[..., 0])
        if flattened:
            out = out.view(batch, *self.shape, heads, head_dim)
            lse = None if lse is None else lse.view(batch, *self.shape, heads)
        return out, lse

    def run_permuted(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """`(out, lse, counts)` of permuted `[B, tokens, heads, head_dim]` inputs, in q's permuted order."""
        out = new_output(q.shape, q.dtype, q.device)
        lse = (torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32, device=q.device)
               if self.return_lse else None)
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
    q_tile: tuple[int, ...],
    kv_tile: tuple[int, ...],
    *,
    batch: int,
    heads: int,
    head_dim: int,
    scale: float,
    layout_tensors: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    return_lse: bool,
    debug: bool = False,
    options: Optional[dict] = None,
    check_alignment: bool = False,
    kv_tiling: str = "static",
    frames: Optional[tuple[int, int, int, int]] = None,
) -> GnaCall:
    """Work out one call. `layout_tensors` are q, k, v in the kernel's layout for the layout path (their strides
    are bound), or None for the permuted path. `options` override `launch_config`'s (tuning; `MASKED` may only
    be forced on) and may set `HEAD_MAJOR`. `check_alignment`: check the tensors' alignment on every launch
    (callers that pass their own permuted tensors; `forward` keys on it instead). `kv_tiling` picks the
    kernel; the dynamic one gathers box tiles with pointer loads on the permuted path and is never
    warp-specialized (Triton 3.6 does not specialize its loops: rank-4 descriptors or pointer gathers).
    `frames` `(q0, q1, k0, k1)`: q holds frames `[q0, q1)` of dimension 0 and k, v `[k0, k1)` (module
    docstring); static KV tiling only."""
    if kv_tiling not in KERNELS:
        raise ValueError(f"kv_tiling must be one of {tuple(KERNELS)} here, got kv_tiling={kv_tiling!r}.")
    if frames is not None and kv_tiling != "static":
        raise ValueError(f"frame ranges run with static KV tiling only, got kv_tiling={kv_tiling!r}.")
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
    launch = launch_config(q_layout.tile_tokens, kv_layout.tile_tokens, head_dim, masked, True,
                           specialize=not (return_lse or debug) and mode != 1 and kv_tiling == "static")
    launch.update(options or {})
    if masked and not launch["MASKED"]:
        raise ValueError(f"{problem} with tiles {q_tile} / {kv_tile} visits partial or padded KV tiles: "
                         "the kernel needs MASKED=True.")
    if launch["USE_TMA"]:
        _install_allocator()
    head_major = launch.pop("HEAD_MAJOR", False)
    if layout:
        strides = [(t.stride(0), *_token_strides(t, problem.ndim), t.stride(-2)) for t in layout_tensors]
        contiguous = torch.empty((batch, *q_shape, heads, head_dim), device="meta")
        strides.append((contiguous.stride(0), *_token_strides(contiguous, problem.ndim), contiguous.stride(-2)))
    else:  # contiguous permuted [B, tokens, H, D]: only the token stride (position 2) is read
        q_tokens, kv_tokens = q_layout.num_tokens, kv_layout.num_tokens
        strides = [(n * heads * head_dim, 0, 0, heads * head_dim, head_dim)
                   for n in (q_tokens, kv_tokens, kv_tokens, q_tokens)]
    names = [f"stride_{t}{axis}" for t in "qkvo" for axis in ("b", "0", "1", "2", "h")]
    arguments = dict(zip(names, (s for group in strides for s in group)))
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
        HEAD_DIM=head_dim, WRITE_LSE=return_lse, DEBUG=debug, HEAD_MAJOR=head_major, LAYOUT=mode,
        **{name: value for name, value in launch.items() if name not in LAUNCH_OPTIONS},
    )
    if kv_tiling == "static":  # the frame range (the whole layout without one); the dynamic kernel has none
        arguments.update(G0=as_3d(problem.shape)[0], KL0=kv_layout.shape[0], Q0_OFF=q0, K0_OFF=k0)
    if layout and not arguments["USE_TMA"]:
        raise ValueError("the layout path reads through tensor descriptors: USE_TMA cannot be turned off there.")
    grid = (batch * heads, q_layout.num_tiles, 1) if head_major else (q_layout.num_tiles, batch * heads, 1)
    options = {name: launch[name] for name in LAUNCH_OPTIONS}
    return GnaCall(problem, shape, q_tile, kv_tile, layout, return_lse, debug,
                   PreboundKernel(KERNELS[kv_tiling], grid, arguments, options, check_alignment=check_alignment),
                   kv_tiling, frames)


def takes_layout_path(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel can read these tensors where they are: no dilation, descriptors on this device,
    descriptor-friendly strides and 16-byte aligned starts."""
    return (not permutes(problem, has_tensor_descriptors(q.device))
            and all(descriptor_strides_ok(t) for t in (q, k, v)) and aligned(q, k, v))


# -- the cached forward: arguments in, output out --------------------------------------------------------------

MAX_CALLS = 1024  # distinct argument sets kept (a model has a handful of attention shapes)
_calls: dict = {}
_warned_cpu = False


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output memory (tests replace this to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


def forward(q, k, v, window, stride=1, dilation=1, causal=False, scale=None, q_tile=None, kv_tile=None,
            return_lse=False, kv_tiling=None, frame_offsets=None):
    """GNA forward of `[B, *shape, heads, head_dim]` tensors: `(out, lse)`, `lse` None unless asked.

    `kv_tiling` "static" or "dynamic" picks the kernel; None lets natsim choose by predicted work
    (kernels/tiles.py, `choose_tiles`). The first call with given tensor metadata and arguments validates
    everything and works the call out (`_prepare`); later ones look it up. Tensor metadata (shapes, dtypes,
    devices, strides, 16-byte alignment; for CPU tensors whether the interpreter is on) is part of the key, so
    a call with other tensors is checked afresh. Lists among the arguments are keyed as tuples.
    """
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.get_device(), v.get_device(),
           q.stride(), k.stride(), v.stride(), q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0
           and v.data_ptr() % 16 == 0, q.is_cuda or interpreting(),
           window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling, frame_offsets)
    try:
        run = _calls.get(key)
    except TypeError:  # a list among the arguments
        key = tuple(tuple(item) if isinstance(item, list) else item for item in key)
        run = _calls.get(key)
    if run is None:
        run = (_prepare(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling)
               if frame_offsets is None else
               _prepare_frames(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse,
                               kv_tiling, frame_offsets))
        if len(_calls) >= MAX_CALLS:
            _calls.pop(next(iter(_calls)))
        _calls[key] = run
    return run(q, k, v)


def _prepare(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling):
    """Validate a call and return the function that runs it on tensors like these."""
    from .checks import check_kernel_inputs, check_kv_tiling, check_qkv, kernel_tiles, problem_of
    from .tiles import choose_tiles

    shape = check_qkv(q, k, v)
    problem = problem_of(shape, window, stride, dilation, causal)
    check_kv_tiling(kv_tiling)
    if not (q.is_cuda or interpreting()):
        return functools.partial(_run_reference, problem=problem, scale=scale, return_lse=return_lse)
    check_kernel_inputs(q)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    kernel_problem = problem
    if q_tile is None and kv_tile is None:
        kernel_problem = dense_as_1d(problem) or problem
        given = (None, None)
    else:
        given = kernel_tiles(problem, q_tile, kv_tile)
    views = tuple(t.reshape(batch, *kernel_problem.shape, heads, head_dim) for t in (q, k, v))
    layout = takes_layout_path(kernel_problem, *views)
    # natsim chooses between the modes only where both are costed alike: the in-place path (kernels/tiles.py).
    modes = (kv_tiling,) if kv_tiling is not None else (tuple(KERNELS) if layout else ("static",))
    q_dims, kv_dims, mode = choose_tiles(kernel_problem, head_dim, modes, *given)
    call = make_call(kernel_problem, shape, q_dims, kv_dims, batch=batch, heads=heads, head_dim=head_dim,
                     scale=scale, layout_tensors=views if layout else None, return_lse=return_lse, kv_tiling=mode)
    return call.run


def _prepare_frames(q, k, v, window, stride, dilation, causal, scale, q_tile, kv_tile, return_lse, kv_tiling,
                    frame_offsets):
    """`_prepare` for a frame range: q holds frames from `frame_offsets[0]`, k and v from `frame_offsets[1]`,
    of a layout of `frame_offsets[2]` frames along dimension 0 (static KV tiling only)."""
    from .checks import check_kernel_inputs, check_kv_tiling, kernel_tiles
    from .reference import check_frames
    from .tiles import default_tiles

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


def frames_as_3d(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...]):
    """A frame-range problem with trailing dimensions of length 1 up to three (window, stride, dilation 1,
    tiles 1): the kernel pads at the front (kernels/layout.py), and the frame offsets act on its dimension 0,
    which must be the layout's first. Counts and token order are unchanged."""
    pad = 3 - problem.ndim
    if not pad:
        return problem, q_tile, kv_tile
    ones = (1,) * pad
    return (Problem(problem.shape + ones, problem.window + ones, problem.stride + ones, problem.dilation + ones,
                    problem.causal + (False,) * pad), q_tile + ones, kv_tile + ones)


def _run_reference(q, k, v, *, problem: Problem, scale, return_lse, frame_offsets=None):
    """CPU tensors without the interpreter: the exact torch reference, with a one-time warning."""
    global _warned_cpu
    from .reference import reference_attention

    if not _warned_cpu:
        import warnings

        warnings.warn("gna_attention got CPU tensors: running the torch reference (exact but slow); "
                      "use CUDA tensors for the Triton kernel.", stacklevel=4)
        _warned_cpu = True
    result = reference_attention(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal,
                                 scale, return_lse, frame_offsets=frame_offsets)
    return result if return_lse else (result, None)
