"""Which backend runs one GNA call: natsim's Triton kernels, FlashAttention-4 (kernels/backends/fa4.py) or, in FP8,
natsim's Gluon kernel (kernels/backends/gluon.py); or the torch reference for CPU tensors.

`choose` decides once per distinct call (the dispatcher keeps the answer): a call that names its backend gets it
or a sentence saying why it cannot run there; a call that leaves it to natsim (`backend=None`) goes to
FlashAttention-4 where that is installed, runs the call, and every block it visits is full (dense attention, or
a block-sparse configuration: measured faster than natsim's kernels in every such case, benchmarks/results/
fa4-probe-*.json), and where natsim's kernels do not run the head dim; elsewhere to natsim's Triton kernels
(partial tiles: FlashAttention-4 evaluates the GNA mask element by element, about 8x slower there). The planner
(natsim.planner) chooses with calibrated costs instead, and names the backend it picked.

Without tiles, FlashAttention-4 takes dense attention over the flattened layout as one sequence (no permutation, no
block lists: lists would hold its kernel to their 128 x 128 blocks, 1.3-1.4x slower at head_dim 40 and 72 on an
H100, benchmarks/results/probe-fa4-dense-*.json), and a GNA configuration on the block-sparse tiles with the
fewest blocks among those it runs (the catalog's, in the Q tile's token order), else natsim's default tiles.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from natsim import Problem, TileConfig, simulate

from ..common.backend import interpreting
from ..common.checks import KERNEL_DTYPES, KERNEL_HEAD_DIMS
from ..fa4.gna import Fa4Gna
from ..fa4.rules import HEAD_DIMS as FA4_HEAD_DIMS
from ..fa4.rules import device_refusal, gna_tile_refusal
from ..gluon.forward import BLOCK_N as GLUON_BLOCK
from ..gluon.forward import refusal as gluon_refusal
from .checks import kernel_tiles
from .launch import is_dense
from .spec import GnaSpec
from .tiles import default_tiles, fp8_tiles, tile_pairs

@dataclass(frozen=True)
class Choice:
    """The backend of one call: "triton", "fa4", "gluon" or "reference"; with FlashAttention-4 or the Gluon FP8
    kernel the geometry it runs in the Q tile's token order (None: dense attention over the flattened layout)."""

    backend: str
    fa4: Optional[Fa4Gna] = None
    gluon: Optional[Fa4Gna] = None


def choose(spec: GnaSpec, problem: Problem, q: torch.Tensor) -> Choice:
    """The backend of a GNA call of `spec` on `problem` with tensors like `q` (module docstring); decided once per
    distinct call (the forward's dispatcher and the backward ask alike)."""
    heads = int(q.shape[0]) * int(q.shape[-2])  # the call's batch times heads
    return _choose(spec, problem, q.device, q.dtype, int(q.shape[-1]), heads, interpreting())


@functools.lru_cache(maxsize=1024)
def _choose(spec: GnaSpec, problem: Problem, device: torch.device, dtype: torch.dtype, head_dim: int, heads: int,
            interpreter: bool) -> Choice:
    if spec.backend == "gluon":
        return _gluon_choice(spec, problem, device, dtype, head_dim)
    if device.type != "cuda":
        if spec.backend == "fa4":
            raise ValueError(f"backend='fa4' cannot run this call: {device_refusal(device)}")
        return Choice("triton" if interpreter else "reference")
    if spec.backend == "triton":
        return Choice("triton")
    if spec.precision == "fp8" and spec.backend is None:
        return _fp8_choice(spec, problem, device, dtype, head_dim, heads)
    refusal, geometry = _fa4_geometry(spec, problem, device, dtype, head_dim)
    if spec.backend == "fa4":
        if refusal is not None:
            raise ValueError(f"backend='fa4' cannot run this call: {refusal}")
        return Choice("fa4", geometry)
    if refusal is None and (geometry is None or _block_sparse(problem, geometry.q_tile, geometry.kv_tile)
                            or head_dim not in KERNEL_HEAD_DIMS):
        return Choice("fa4", geometry)
    return Choice("triton")


def _fp8_choice(spec: GnaSpec, problem: Problem, device: torch.device, dtype: torch.dtype, head_dim: int,
                heads: int) -> Choice:
    """An FP8 call: the Gluon FP8 kernel (kernels/backends/gluon.py) where it runs the call and every block it
    visits is a whole 128-token tile (dense attention over the flattened layout, or GNA on 128-token tiles in the
    Q tile's order: measured faster than the Triton FP8 kernel on every such case, benchmarks/results/
    fp8-gluon-*.json), or on partial 128-token tiles where those pay (`_partial_tiles_pay`); natsim's Triton FP8
    kernel elsewhere (inputs given in float8, frame ranges, dynamic KV tiling, other head dims or GPUs, small
    calls, tiles that waste many pairs)."""
    if gluon_refusal(dtype, head_dim, gpu_capability(device)) is not None:
        return Choice("triton")
    refusal, geometry = _gluon_geometry(spec, problem, head_dim)
    if refusal is None and (geometry is None or _block_sparse(problem, geometry.q_tile, geometry.kv_tile)
                            or _partial_tiles_pay(spec, problem, geometry, head_dim, heads)):
        return Choice("gluon", gluon=geometry)
    return Choice("triton")


# When the Gluon FP8 kernel's partial tiles beat the Triton FP8 kernel (one H200, batch 1, 14 GNA layouts of 4,096
# to 115,200 tokens, benchmarks/fp8_gluon_partial.py, fp8-gluon-partial-NVIDIA_H200-2026-11-28-s11-*.json): per
# query-key pair it visits it took 0.6x the Triton kernel's time on every call of 200,000 visited blocks or more
# (over batch and heads), so it won wherever it visits up to 1.21x the Triton tiles' pairs (0.68-0.75x the time)
# and lost at 1.75x (1.07x). Below some 40,000 blocks both kernels take about a millisecond, most of it fixed
# costs per call, the Gluon route's higher: it lost at 8,160 and 25,440 blocks (1.44-1.52x) and tied at 40,128
# (0.96x). Since the quantization reads q, k, v in tile order (no permuted copies on either route), the 8,160-block
# row still loses: 0.95 against 0.58 ms (fp8-gluon-partial-NVIDIA_H200-2026-11-28-s12-gather.json).
PARTIAL_PAIRS_RATIO = 1.5
PARTIAL_MIN_BLOCKS = 65_536


def _partial_tiles_pay(spec: GnaSpec, problem: Problem, geometry: Fa4Gna, head_dim: int, heads: int) -> bool:
    """Whether the Gluon FP8 kernel on `geometry`'s partial tiles beats the Triton FP8 kernel on the tiles it
    would run: at least PARTIAL_MIN_BLOCKS visited 128 x 128 blocks over the call's `heads` (batch times heads),
    and at most PARTIAL_PAIRS_RATIO times the query-key pairs the Triton kernel visits."""
    gluon = simulate(problem, TileConfig(geometry.q_tile, geometry.kv_tile)).visited_tiles
    if gluon * heads < PARTIAL_MIN_BLOCKS:
        return False
    q_tile, kv_tile = _triton_fp8_tiles(spec, problem, head_dim)
    triton = simulate(problem, TileConfig(q_tile, kv_tile)).visited_tiles * math.prod(q_tile) * math.prod(kv_tile)
    return gluon * GLUON_BLOCK * GLUON_BLOCK <= PARTIAL_PAIRS_RATIO * triton


def _triton_fp8_tiles(spec: GnaSpec, problem: Problem, head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tiles natsim's Triton FP8 kernel runs the call on under static KV tiling (as kernels/gna/dispatch.py
    picks them)."""
    given = (None, None)
    if spec.q_tile is not None or spec.kv_tile is not None:
        given = kernel_tiles(problem, spec.q_tile, spec.kv_tile)
    q_tile, kv_tile, _ = fp8_tiles(problem, head_dim, ("static",), *given)
    return q_tile, kv_tile


def _gluon_choice(spec: GnaSpec, problem: Problem, device: torch.device, dtype: torch.dtype, head_dim: int) -> Choice:
    """A call that names the Gluon FP8 kernel: its geometry, or a sentence saying why it cannot run the call (CPU
    tensors run the kernel's rule, its operator's torch reference, on the same blocks)."""
    if spec.precision != "fp8":
        raise ValueError("backend='gluon' runs GNA in precision='fp8' only (its 16-bit variant runs block masks: "
                         f"sparse_attention), got precision={spec.precision!r}.")
    refusal = gluon_refusal(dtype, head_dim, gpu_capability(device) if device.type == "cuda" else None)
    if refusal is None:
        refusal, geometry = _gluon_geometry(spec, problem, head_dim)
    if refusal is not None:
        raise ValueError(f"backend='gluon' cannot run this call: {refusal}")
    return Choice("gluon", gluon=geometry)


def _gluon_geometry(spec: GnaSpec, problem: Problem, head_dim: int) -> tuple[Optional[str], Optional[Fa4Gna]]:
    """(why the Gluon FP8 kernel cannot run this call's geometry, or None; the geometry it runs in the Q tile's
    token order, None for dense attention over the flattened layout). Without tiles given: among natsim's
    128-token tiles, those with every visited block full that visit the fewest blocks, else those that visit the
    fewest (partial tiles, masked inside: kernels/gluon/tile_mask.py)."""
    if spec.out_dtype is not None or spec.frames is not None or spec.kv_tiling == "dynamic":
        return ("the Gluon FP8 kernel quantizes bfloat16 / float16 inputs itself over a whole layout with static KV "
                "tiling: not inputs given in float8, frame_offsets or kv_tiling='dynamic'."), None
    if spec.q_tile is None and spec.kv_tile is None:
        if is_dense(problem):
            return None, None
        pairs = [(q, kv) for q, kv in tile_pairs(problem.shape, head_dim) if _gluon_tiles(q, kv)]
        whole = [pair for pair in pairs if _block_sparse(problem, *pair)]
        if not pairs:
            return f"none of natsim's tiles of the layout {problem.shape} holds {GLUON_BLOCK} tokens.", None
        fewest = min(whole or pairs, key=lambda pair: simulate(problem, TileConfig(*pair)).visited_tiles)
        return None, Fa4Gna(problem, *fewest)
    q_tile = tuple(spec.q_tile if spec.q_tile is not None else spec.kv_tile)
    kv_tile = tuple(spec.kv_tile if spec.kv_tile is not None else spec.q_tile)
    refusal = _tile_problem(problem, q_tile, kv_tile)
    if refusal is None and not _gluon_tiles(q_tile, kv_tile):
        refusal = (f"the Gluon FP8 kernel runs GNA on one tile of {GLUON_BLOCK} tokens for queries and keys, got "
                   f"q_tile={q_tile}, kv_tile={kv_tile} on {problem}.")
    return (refusal, None) if refusal is not None else (None, Fa4Gna(problem, q_tile, kv_tile))


def gpu_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device (a seam tests replace on machines without one)."""
    return torch.cuda.get_device_capability(device)


def _gluon_tiles(q_tile: tuple[int, ...], kv_tile: tuple[int, ...]) -> bool:
    """Tiles the Gluon FP8 kernel runs GNA on: one 128-token tile for queries and keys."""
    return tuple(q_tile) == tuple(kv_tile) and math.prod(q_tile) == GLUON_BLOCK


def backward_refusal(choice: Choice, head_dim: int) -> Optional[str]:
    """None when FlashAttention-4 differentiates a call it ran forward (`choice`), else why not; natsim's Triton
    backward then takes it where it runs the head dim."""
    if choice.fa4 is None:
        return None
    return gna_tile_refusal(choice.fa4.q_tile, choice.fa4.kv_tile, head_dim, backward=True)


def _fa4_geometry(spec: GnaSpec, problem: Problem, device: torch.device, dtype: torch.dtype,
                  head_dim: int) -> tuple[Optional[str], Optional[Fa4Gna]]:
    """(why FlashAttention-4 cannot run the call, or None; the geometry it runs, None for dense attention)."""
    refusal = device_refusal(device)
    if refusal is not None:
        return refusal, None
    if dtype not in KERNEL_DTYPES:
        return f"FlashAttention-4 runs float16 and bfloat16 inputs, got dtype={dtype}.", None
    if spec.precision is not None or spec.frames is not None or spec.kv_tiling == "dynamic":
        return ("FlashAttention-4 runs bfloat16 / float16 GNA with static KV tiling over a whole layout: not "
                "precision='fp8', frame_offsets or kv_tiling='dynamic'."), None
    if head_dim not in FA4_HEAD_DIMS:
        return f"FlashAttention-4 runs head_dim 8 to 256 in steps of 8, got head_dim={head_dim}.", None
    if spec.q_tile is None and spec.kv_tile is None:
        if is_dense(problem):  # FlashAttention-4's dense call with its own tiles (module docstring)
            return None, None
        return None, _default_geometry(problem, head_dim)
    q_tile = spec.q_tile if spec.q_tile is not None else spec.kv_tile
    kv_tile = spec.kv_tile if spec.kv_tile is not None else spec.q_tile
    refusal = _tile_problem(problem, q_tile, kv_tile) or gna_tile_refusal(q_tile, kv_tile, head_dim)
    return refusal, None if refusal else Fa4Gna(problem, tuple(q_tile), tuple(kv_tile))


def _tile_problem(problem: Problem, q_tile, kv_tile) -> Optional[str]:
    if len(q_tile) != problem.ndim or len(kv_tile) != problem.ndim:
        return f"tiles must have one side per dimension of the layout {problem.shape}, got {q_tile} / {kv_tile}."
    return None


@functools.lru_cache(maxsize=256)
def _default_geometry(problem: Problem, head_dim: int) -> Fa4Gna:
    """The block-sparse tiles with the fewest visited blocks among the catalog's that FlashAttention-4 runs, else
    natsim's default tiles where it runs them, else the catalog's first it runs (module docstring)."""
    pairs = [(q, kv) for q, kv in tile_pairs(problem.shape, head_dim) if gna_tile_refusal(q, kv, head_dim) is None]
    sparse = [(simulate(problem, TileConfig(q, kv)).visited_tiles, i) for i, (q, kv) in enumerate(pairs)
              if _block_sparse(problem, q, kv)]
    if sparse:
        return Fa4Gna(problem, *pairs[min(sparse)[1]])
    if head_dim in KERNEL_HEAD_DIMS:
        q_tile, kv_tile = default_tiles(problem, head_dim)
        if gna_tile_refusal(q_tile, kv_tile, head_dim) is None:
            return Fa4Gna(problem, q_tile, kv_tile)
    if not pairs:
        raise ValueError(f"FlashAttention-4 runs none of natsim's tiles on the layout {problem.shape}; pass q_tile "
                         "and kv_tile.")
    return Fa4Gna(problem, *pairs[0])


@functools.lru_cache(maxsize=1024)
def _block_sparse(problem: Problem, q_tile, kv_tile) -> bool:
    """Every visited block full for FlashAttention-4: the simulator's full tiles, and no KV tile holding padding
    keys (every dimension a whole number of KV tiles per dilation group; kernels/fa4/lists.py)."""
    divides = all(L % (t * d) == 0 for L, t, d in zip(problem.shape, kv_tile, problem.dilation))
    return divides and simulate(problem, TileConfig(q_tile, kv_tile)).block_sparse
