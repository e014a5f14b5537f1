"""Calibration: time a fixed set of GNA configurations on the GPU at hand and fit the cost model to them.

The set (`calibration_cases`) spans what the features separate: masked-heavy (stride 1), block-sparse and
dense configurations, 1-D, 2-D and 3-D layouts, the catalog's three tile sizes, head_dim 64 and 128 and widths
between (40-112, HEAD_DIMS), and very sparse ones where per-program work shows, and small layouts of 3-7K tokens whose calls take 0.1-1 ms.
The cost model predicts GPU work; a call shorter than its host overhead (Python, argument checks, the launch:
about 0.05 ms through the prebound launch path) takes the host's time instead, max(host, GPU) rather than a
sum, so measurements under HOST_BOUND_S are left out of the fit.
Features come from the simulator (CPU); times from `time_case` (permutation included, as plans run it);
the fit is `planner.cost.fit.fit_coefficients`, a pure function tested on CPU against known coefficients.

The sparse kernel (natsim.kernels.sparse) gets a set of its own (`sparse_calibration_cases`) and a second
coefficient set (planner.cost.sparse_features): block masks at the granularities a mask planner chooses between
(128x128, 128x16, 64x64, 64x128, 32x32, 16x16), merged by XOR, consecutively or not at all, on 16k to 35k tokens
with the same 24 heads. Their features come from the prepared work (`prepare_sparse` on the CPU, with the
GPU's program tiles), their times from `time_sparse_case`, the same host-bound rule and the same fit.

FP8 (`precision="fp8"`, natsim.kernels.common.fp8) runs its own kernels: 'gna-fp8' times a set of GNA cases
(`fp8_calibration_cases`: static KV tiling, the only kind FP8 runs) and 'sparse-fp8' a subset of the sparse
cases in FP8, each fitted to the same features as its bf16 kernel (the GNA features with the quantization pass's
bytes and FP8's permutation of 2-D and 3-D layouts) into coefficient sets of their own.

The GNA backward pass (`natsim::gna_backward`: delta pass, dK/dV and dQ kernels in place, on the backward's
own tiles) gets a third set (`backward_calibration_cases`, BACKWARD_CASES) and coefficients
(planner.cost.backward_features): masked, block-sparse, dense, causal and dilated problems in 1-D, 2-D and 3-D on 16k
to 33k tokens, 24 heads. A calibration extends this GPU's stored cost model where there is one: the sets of the
kernels it times are refitted, the others kept (`kernels=("backward",)` adds backward coefficients to a shipped
file; `kernels=("gna",)` refits the forward and keeps the backward's, FP8's and FlashAttention-4's sets).

FlashAttention-4 (`backend="fa4"`, where it runs: a Hopper GPU with it installed) gets two sets of its own, 'fa4'
and 'fa4-backward' (planner.cost.fa4_calibrate: GNA calls, block-sparse and masked, and random block masks,
through natsim's entry points), fitted over planner.cost.fa4_features' FA4_FEATURES; elsewhere they are refused
with the sentence saying why it does not run. natsim's Gluon FP8 kernel (`backend="gluon"`, Hopper) gets one,
'gluon-fp8' (planner.cost.gluon_calibrate: GNA on whole and partial 128-token tiles, random 128 x 128 masks),
fitted over planner.cost.gluon_features' GLUON_FEATURES, and its 16-bit variant another, 'gluon-16bit' (random 128 x
128 masks on the inputs' dtype: the one call it runs). 'host' measures, for every backend that runs here, the
host's time to issue one call (planner.cost.host), which searches price a call at least at, and that of torch's
SDPA, a model's own attention, against which the diffusers integration weighs natsim's call (AutoPlan.verdict).
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from natsim import Problem, TileConfig, block_mask, simulate
from natsim.tiles import KV_TILINGS

from natsim.kernels import prepare_sparse
from natsim.kernels.backends import fa4 as fa4_backend
from natsim.kernels.backends import gluon as gluon_backend
from natsim.kernels.backends.triton import (default_blocks, gna_backward_for_timing, gna_forward_for_timing,
                                           has_tensor_descriptors, permutes)

from ..catalog import as_dtype, dtype_name, element_bytes
from .backward_features import BACKWARD_FEATURES, backward_features, backward_work
from .fa4_calibrate import (fa4_backward_calibration_cases, fa4_calibration_cases, fa4_case_features,
                            time_fa4_backward_case, time_fa4_case)
from .fa4_features import FA4_FEATURES
from .features import FEATURES, features_of
from .gluon_calibrate import (gluon_16bit_calibration_cases, gluon_calibration_cases, gluon_case_features,
                              time_gluon_case)
from .gluon_features import GLUON_FEATURES
from .host import host_refusal, host_seconds
from .files import cost_model_for, gpu_file_name, own_host, user_coefficients_dir
from .fit import fit_coefficients, relative_errors
from .gpus import gpu_of
from .model import HOST_CALLS, CostModel
from .sparse_features import SPARSE_FEATURES
from .timing import MIN_REPEATS, median_seconds
from .sparse_features import sparse_features as work_features

KERNELS = ("gna", "sparse", "backward", "gna-fp8", "sparse-fp8", "fa4", "fa4-backward", "gluon-fp8", "gluon-16bit",
           "host")
DEFAULT_KERNELS = ("gna", "sparse")  # what `calibrate` times unless told: the backward is asked for by name

# Tile shapes per number of dimensions, one per (Q tokens, KV tokens) pair of the catalog.
TILES = {
    1: (((128,), (128,)), ((128,), (64,)), ((64,), (64,))),
    2: (((16, 8), (16, 8)), ((16, 8), (8, 8)), ((8, 8), (8, 8))),
    3: (((2, 8, 8), (2, 8, 8)), ((4, 8, 4), (2, 8, 4)), ((1, 8, 8), (1, 8, 8))),
}

HEADS = 24
HOST_BOUND_S = 5e-5

# (shape, window, stride, causal, head dims)
LAYOUTS = (
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), False, (128,)),
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), False, (64, 128)),
    ((30, 48, 80), (30, 48, 80), (1, 1, 1), False, (128,)),
    ((16, 44, 80), (8, 20, 40), (1, 4, 8), True, (128,)),
    ((30, 48, 80), (2, 8, 8), (2, 8, 8), False, (64,)),
    ((256, 256), (80, 80), (1, 1), False, (128,)),
    ((256, 256), (80, 80), (16, 16), False, (64, 128)),
    ((32768,), (2048,), (1,), False, (64, 128)),
    ((32768,), (2048,), (256,), False, (128,)),
    ((32768,), (128,), (128,), False, (128,)),
    ((32768,), (32768,), (1,), True, (128,)),
)

# Configurations of the kind the planner picks, on layouts the planner benchmark does not use: tiles that
# are long along one dimension, 64-token KV tiles in 3-D, and masked (not block-sparse) ones with large
# strides, where the fixed grid above says little; the last three are masked calls whose tiles are nearly all
# full (windows close to the layout along a stride-1 dimension), which separate the masked kernel's cost for
# full tiles from the mask-free kernel's. (shape, window, stride, q_tile, kv_tile); head_dim 128.
PLANNER_LIKE = (
    ((24, 40, 64), (18, 28, 40), (2, 16, 1), (2, 16, 4), (2, 16, 4)),
    ((24, 40, 64), (18, 28, 40), (1, 1, 1), (1, 16, 8), (1, 16, 8)),
    ((24, 40, 64), (21, 24, 48), (1, 8, 16), (1, 8, 16), (1, 8, 16)),
    ((20, 36, 72), (12, 22, 48), (4, 2, 16), (4, 2, 8), (4, 2, 8)),
    ((20, 36, 72), (12, 22, 48), (1, 2, 4), (4, 2, 8), (4, 2, 8)),
    ((16, 40, 64), (8, 21, 32), (8, 1, 32), (8, 1, 16), (8, 1, 8)),
    ((16, 40, 64), (8, 21, 32), (8, 2, 32), (4, 2, 16), (4, 1, 16)),
    ((16, 40, 64), (8, 21, 32), (2, 1, 2), (8, 1, 16), (8, 1, 16)),
    ((128, 192), (64, 74), (64, 2), (64, 2), (32, 2)),
    ((192, 160), (128, 92), (4, 4), (32, 4), (16, 4)),
    ((32, 32, 48), (24, 16, 40), (8, 16, 1), (8, 4, 4), (8, 4, 4)),
    ((20, 40, 80), (16, 24, 72), (2, 24, 1), (2, 8, 8), (2, 8, 8)),
    ((256, 192), (160, 184), (32, 1), (32, 4), (32, 4)),
)


# Dilated configurations: the only calls that still permute tokens on GPUs with tensor descriptors, so the
# only ones that show the permutation's cost. (shape, window, stride, dilation, q_tile, kv_tile); head_dim 128.
DILATED = (
    ((30, 48, 80), (9, 12, 12), (1, 4, 4), (1, 2, 2), (2, 8, 8), (2, 8, 8)),
    ((256, 256), (40, 40), (1, 1), (2, 2), (16, 8), (16, 8)),
    ((16, 44, 80), (8, 11, 20), (8, 1, 4), (2, 4, 4), (2, 4, 16), (2, 4, 16)),
)


# Dynamic KV tiling (kernels/gna_dynamic.py): stride-1 layouts where its boxes save tiles, and one where they
# save none (1x8x8), so the fit sees the dynamic kernel's per-tile cost whatever its counts. The features are
# the static kernel's, from the dynamic mode's simulated counts: the in-place dynamic kernel does the same
# work per tile (a descriptor load at any corner, the same two loops); the fit's errors on these cases say how
# well that holds. (shape, window, stride, q_tile, kv_tile); head_dim 128, in place (no dilation).
DYNAMIC = (
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), (4, 4, 4), (4, 4, 4)),
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), (2, 8, 4), (2, 8, 4)),
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), (2, 8, 8), (2, 4, 8)),
    ((30, 48, 80), (18, 24, 24), (1, 8, 8), (2, 8, 8), (2, 8, 8)),
    ((256, 256), (80, 80), (1, 1), (8, 16), (8, 16)),
    ((256, 256), (80, 80), (1, 1), (16, 8), (16, 8)),
    ((16, 44, 80), (16, 24, 16), (1, 1, 1), (2, 4, 16), (2, 4, 16)),
    ((24, 40, 64), (18, 28, 40), (1, 1, 1), (1, 16, 8), (1, 16, 8)),
)


# Head counts and sizes the grid above lacks: head_dim 64 at 32-48 heads (where a 48-head, head_dim 64 layout was
# predicted 17-18% fast) and small layouts of 3-6K tokens, where host time and a few waves of programs show.
# (shape, window, stride, heads, head_dim); each with the first and last tiles of TILES for its rank.
HEADS_AND_SIZES = (
    ((11, 28, 40), (5, 14, 19), (1, 1, 1), 48, 64),
    ((11, 28, 40), (5, 14, 19), (1, 4, 8), 48, 64),
    ((14, 24, 36), (7, 12, 12), (2, 8, 4), 32, 64),
    ((8, 16, 24), (4, 8, 12), (1, 1, 1), 24, 128),
    ((4, 32, 32), (3, 16, 16), (1, 8, 8), 16, 64),
    ((64, 96), (32, 48), (1, 1), 48, 64),
    ((6144,), (1024,), (1,), 32, 64),
)

# Head dims that are not powers of two: the kernels run them in power-of-two chunks or padded, the features count
# their work at the next power of two, and the dynamic kernel's 64-query launches copy rows that do not start on
# 128-byte boundaries into aligned ones first (natsim.kernels.common.rows; the features count the copy's bytes).
# Masked (stride 1), block-sparse and 1-D calls at 40-112, so that the fit weighs these widths with the rest.
# (shape, window, stride, kv_tiling, q_tile, kv_tile, head dims); 24 heads.
HEAD_DIMS = (
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), "static", (2, 8, 8), (2, 8, 8), (40, 96)),
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), "dynamic", (1, 8, 8), (1, 8, 8), (40, 72, 88)),
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), "dynamic", (2, 8, 8), (2, 4, 8), (72, 112)),
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), "static", (2, 8, 8), (2, 8, 8), (40, 72, 96, 112)),
    ((32768,), (2048,), (256,), "static", (128,), (128,), (72, 96)),
    ((256, 256), (80, 80), (16, 16), "static", (16, 8), (16, 8), (88,)),
)

# Small calls of the dynamic kernel (the planner's usual pick on small layouts): long thin tiles, 32-48 heads, a
# few thousand tokens, where a wave or two of programs decides the time. (shape, window, stride, heads, head_dim,
# q_tile, kv_tile).
SMALL_DYNAMIC = (
    ((8, 12, 72), (4, 6, 24), (2, 2, 8), 48, 128, (2, 2, 32), (2, 1, 32)),
    ((10, 20, 40), (5, 10, 12), (1, 1, 1), 32, 128, (2, 4, 16), (2, 4, 16)),
    ((12, 18, 30), (6, 9, 15), (2, 4, 4), 48, 64, (2, 8, 8), (2, 8, 8)),
    ((36, 120), (12, 40), (4, 8), 40, 64, (8, 16), (8, 8)),
)


@dataclass(frozen=True)
class Case:
    """One configuration to time: a GNA problem, its tiles, and the tensor sizes (batch 1)."""

    problem: Problem
    tiles: TileConfig
    heads: int
    head_dim: int


def calibration_cases() -> list[Case]:
    """The configurations `natsim calibrate` times (about a hundred; minutes on an H100, most of it compiling)."""
    cases = []
    for shape, window, stride, causal, head_dims in LAYOUTS:
        problem = Problem(shape, window, stride, causal=causal)
        for head_dim in head_dims:
            for q_tile, kv_tile in TILES[len(shape)]:
                cases.append(Case(problem, TileConfig(q_tile, kv_tile), HEADS, head_dim))
    for shape, window, stride, q_tile, kv_tile in PLANNER_LIKE:
        cases.append(Case(Problem(shape, window, stride), TileConfig(q_tile, kv_tile), HEADS, 128))
    for shape, window, stride, dilation, q_tile, kv_tile in DILATED:
        cases.append(Case(Problem(shape, window, stride, dilation), TileConfig(q_tile, kv_tile), HEADS, 128))
    for shape, window, stride, q_tile, kv_tile in DYNAMIC:
        cases.append(Case(Problem(shape, window, stride), TileConfig(q_tile, kv_tile, kv_tiling="dynamic"), HEADS, 128))
    for shape, window, stride, heads, head_dim in HEADS_AND_SIZES:
        tiles = TILES[len(shape)]
        for q_tile, kv_tile in (tiles[0], tiles[-1]):
            cases.append(Case(Problem(shape, window, stride), TileConfig(q_tile, kv_tile), heads, head_dim))
    for shape, window, stride, heads, head_dim, q_tile, kv_tile in SMALL_DYNAMIC:
        tiles = TileConfig(q_tile, kv_tile, kv_tiling="dynamic")
        cases.append(Case(Problem(shape, window, stride), tiles, heads, head_dim))
    for shape, window, stride, kv_tiling, q_tile, kv_tile, head_dims in HEAD_DIMS:
        tiles = TileConfig(q_tile, kv_tile, kv_tiling=kv_tiling)
        cases.extend(Case(Problem(shape, window, stride), tiles, HEADS, head_dim) for head_dim in head_dims)
    return cases


def fp8_calibration_cases() -> list[Case]:
    """The GNA configurations `natsim calibrate --kernels ...,gna-fp8` times in FP8: the grid's layouts with the
    catalog's largest and smallest tiles (1-D ones with the middle pair too, whose narrow KV tile under a wide Q
    tile separates the two narrow-tile features), the head-count and size cases with their largest, and each
    static row of HEAD_DIMS at its first width (FP8 pads such widths; static KV tiling throughout: FP8 runs no
    other)."""
    cases = []
    for shape, window, stride, causal, head_dims in LAYOUTS:
        problem = Problem(shape, window, stride, causal=causal)
        tiles = TILES[len(shape)] if len(shape) == 1 else (TILES[len(shape)][0], TILES[len(shape)][-1])
        for head_dim in head_dims:
            for q_tile, kv_tile in tiles:
                cases.append(Case(problem, TileConfig(q_tile, kv_tile), HEADS, head_dim))
    for shape, window, stride, heads, head_dim in HEADS_AND_SIZES:
        q_tile, kv_tile = TILES[len(shape)][0]
        cases.append(Case(Problem(shape, window, stride), TileConfig(q_tile, kv_tile), heads, head_dim))
    for shape, window, stride, kv_tiling, q_tile, kv_tile, head_dims in HEAD_DIMS:
        if kv_tiling == "static":
            cases.append(Case(Problem(shape, window, stride), TileConfig(q_tile, kv_tile), HEADS, head_dims[0]))
    return cases


def case_features(cases: Sequence[Case], dtype: torch.dtype, descriptors: bool = True,
                  precision: Optional[str] = None) -> np.ndarray:
    """The feature matrix of `cases` (rows in order), from the simulator. `descriptors`: the GPU has tensor
    descriptors, so only dilated calls (and in FP8, 2-D and 3-D ones) permute tokens
    (natsim.kernels.backends.triton.permutes); `precision="fp8"` adds the quantization pass."""
    size, fp8 = element_bytes(dtype), precision == "fp8"
    return np.stack(
        [
            features_of(simulate(c.problem, c.tiles), batch_heads=c.heads, head_dim=c.head_dim, element_bytes=size,
                        permutation=permutes(c.problem, descriptors, fp8), quantized=fp8)
            for c in cases
        ]
    )


def time_case(case: Case, dtype: torch.dtype, device: torch.device, min_repeats: int = MIN_REPEATS,
              precision: Optional[str] = None, backend: str = "triton") -> float:
    """Median seconds of one `gna_attention` call for `case` (random inputs, in `precision`) on a CUDA `device`,
    run by `backend` (natsim's Triton kernels unless told otherwise; "fa4" includes the permutation into tile
    order)."""
    from natsim.kernels import gna_attention

    p = case.problem
    q, k, v = (
        torch.randn((1, *p.shape, case.heads, case.head_dim), device=device, dtype=dtype) for _ in range(3)
    )

    def run():
        return gna_attention(
            q, k, v, p.window, p.stride, p.dilation, p.causal, q_tile=case.tiles.q_tile, kv_tile=case.tiles.kv_tile,
            kv_tiling=case.tiles.kv_tiling, precision=precision, backend=backend,
        )

    return median_seconds(run, device, min_repeats)


# -- the sparse kernel ------------------------------------------------------------------------------------------

FINE_BLOCK = 16  # tokens per block of the fine masks; coarser blocks are their OR-pooled supersets
# Wan 2.1 480p (21x30x52 tokens) and its GNA window: the mask of natsim's GNA over 16-token tiles (1, 4, 4) in
# the permuted order, N = 34,944 (the tile-padded layout), as benchmarks/sparse.py runs it.
GNA_LAYOUT, GNA_WINDOW, GNA_TILE = (21, 30, 52), (9, 15, 25), (1, 4, 4)
GNA_SEQ_LEN = 34944

# (pattern, seq_len, q_block, kv_block, merge, head_dim, sparsity). Times on an H100 (bf16, 24 heads) from
# benchmarks/results/sparse-480p-*.json: 1.5 ms (random, 95%) to about 35 ms (16x16 consecutive and unmerged).
# Random 128x128 masks separate unmasked FLOPs from per-tile and per-program costs (their density moves both);
# merged 16x16 and 64x64 masks run the masked loop with gathered tiles, 64x128 merged runs it with
# descriptor-loaded tiles, 128x16 runs gathered tiles mostly unmasked, and unmerged 16x16 and 64x64 run
# narrow programs.
SPARSE_CASES = (
    ("random", 16384, 128, 128, None, 128, 0.0),
    ("random", 32768, 128, 128, None, 128, 0.5),
    ("random", 32768, 128, 128, None, 128, 0.8),
    ("random", 32768, 128, 128, None, 128, 0.95),
    ("random", 32768, 128, 128, None, 64, 0.8),
    ("clustered", 32768, 16, 16, "xor", 128, 0.0),
    ("clustered", 32768, 16, 16, "consecutive", 128, 0.0),
    ("clustered", 32768, 16, 16, None, 128, 0.0),
    ("clustered", 32768, 64, 64, "xor", 128, 0.0),
    ("clustered", 32768, 64, 64, None, 128, 0.0),
    ("clustered", 32768, 64, 128, "consecutive", 128, 0.0),
    ("clustered", 32768, 128, 16, None, 128, 0.0),
    ("gna", GNA_SEQ_LEN, 16, 16, "xor", 128, 0.0),
    ("gna", GNA_SEQ_LEN, 16, 16, "xor", 64, 0.0),
    ("gna", GNA_SEQ_LEN, 32, 32, "consecutive", 128, 0.0),
    ("gna", GNA_SEQ_LEN, 128, 16, None, 128, 0.0),
    ("random", 16384, 128, 128, None, 64, 0.5),
    ("clustered", 32768, 64, 64, None, 64, 0.0),
)
PATTERNS = ("random", "clustered", "gna")


@dataclass(frozen=True)
class SparseCase:
    """One sparse-kernel call to time: a block-mask `pattern` at `q_block` x `kv_block`, grouped by `merge`, on
    `[1, seq_len, heads, head_dim]` tensors.

    Patterns (`sparse_case_mask`): `random`, each block kept with probability 1 - `sparsity`, a mask per head;
    `clustered`, FINE_BLOCK query blocks in 32 clusters that each attend 15% of 32-key spans (benchmarks/sparse.py),
    one mask for every head; `gna`, natsim's GNA mask of GNA_LAYOUT, one mask for every head. Fine masks are
    OR-pooled to the case's blocks. `seed` seeds the random ones.
    """

    pattern: str
    seq_len: int
    q_block: int
    kv_block: int
    merge: Optional[str]
    head_dim: int
    sparsity: float = 0.0
    heads: int = HEADS
    seed: int = 0

    @property
    def blocks(self) -> tuple[int, int]:
        """(block_m, block_n): the program tile the kernel uses for these blocks on a GPU."""
        return default_blocks(self.q_block, self.kv_block, self.merge, torch.device("cuda"))

    def to_dict(self) -> dict:
        block_m, block_n = self.blocks
        return {**asdict(self), "block_m": block_m, "block_n": block_n}


def sparse_calibration_cases() -> list[SparseCase]:
    """The sparse-kernel calls `natsim calibrate` times (SPARSE_CASES)."""
    return [
        SparseCase(pattern, seq_len, q_block, kv_block, merge, head_dim, sparsity, seed=i)
        for i, (pattern, seq_len, q_block, kv_block, merge, head_dim, sparsity) in enumerate(SPARSE_CASES)
    ]


# The sparse cases FP8 is timed on (indices into SPARSE_CASES): random masks at four densities and both head dims,
# merged and unmerged fine masks, gathered and descriptor-loaded tiles; thirteen (enough to separate every
# feature: a test holds them to it), to keep FP8's compiles short.
FP8_SPARSE_CASES = (0, 1, 2, 3, 4, 5, 7, 9, 11, 12, 13, 14, 16)


def fp8_sparse_calibration_cases() -> list[SparseCase]:
    """The sparse-kernel calls `natsim calibrate --kernels ...,sparse-fp8` times in FP8 (FP8_SPARSE_CASES)."""
    cases = sparse_calibration_cases()
    return [cases[i] for i in FP8_SPARSE_CASES]


def _pool(mask: torch.Tensor, fq: int, fk: int) -> torch.Tensor:
    """OR-pool a `[B, H, nQ, nKV]` block mask by `fq` x `fk` blocks (blocks past the end attend nothing)."""
    b, h, nq, nk = mask.shape
    padded = torch.zeros((b, h, -(-nq // fq) * fq, -(-nk // fk) * fk), dtype=torch.bool)
    padded[..., :nq, :nk] = mask
    return padded.view(b, h, padded.shape[2] // fq, fq, padded.shape[3] // fk, fk).any(5).any(3)


def _fine_mask(case: SparseCase, generator: torch.Generator) -> torch.Tensor:
    """The case's FINE_BLOCK x FINE_BLOCK mask `[1, 1, nQ, nKV]`, one for every head."""
    if case.pattern == "gna":
        dense = block_mask(Problem(GNA_LAYOUT, GNA_WINDOW), TileConfig(GNA_TILE, GNA_TILE)).to_dense()
        return torch.from_numpy(dense)[None, None]
    n = -(-case.seq_len // FINE_BLOCK)
    clusters, density = 32, 0.15
    spans = torch.rand((clusters, -(-n // 2)), generator=generator) < density
    patterns = spans.repeat_interleave(2, -1)[..., :n]
    member = torch.randint(0, clusters, (n,), generator=generator)
    return patterns[member][None, None]


def sparse_case_mask(case: SparseCase) -> torch.Tensor:
    """The case's boolean block mask `[1, heads or 1, ceil(N / q_block), ceil(N / kv_block)]` on the CPU, the same
    on every call (seeded with `case.seed`)."""
    if case.pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got pattern={case.pattern!r}.")
    generator = torch.Generator().manual_seed(case.seed)
    if case.pattern == "random":
        shape = (1, case.heads, -(-case.seq_len // case.q_block), -(-case.seq_len // case.kv_block))
        return torch.rand(shape, generator=generator) >= case.sparsity
    return _pool(_fine_mask(case, generator), case.q_block // FINE_BLOCK, case.kv_block // FINE_BLOCK)


def prepare_case(case: SparseCase, device: torch.device):
    """The case's forward `SparseWork` on `device`, with the GPU's program tiles wherever it is prepared."""
    block_m, block_n = case.blocks
    return prepare_sparse(sparse_case_mask(case), case.q_block, case.kv_block, case.seq_len, merge=case.merge,
                          block_m=block_m, block_n=block_n, device=device, backward=False, backend="triton")


def sparse_case_features(cases: Sequence[SparseCase]) -> np.ndarray:
    """The sparse feature matrix of `cases` (rows in order), from their work prepared on the CPU."""
    return np.stack([work_features(prepare_case(c, torch.device("cpu")), 1, c.heads, c.head_dim) for c in cases])


def time_sparse_case(
    case: SparseCase, dtype: torch.dtype, device: torch.device, min_repeats: int = MIN_REPEATS,
    precision: Optional[str] = None,
) -> float:
    """Median seconds of one `sparse_attention` call for `case` (random inputs, work prepared once beforehand,
    schedule 'grid', in `precision`) on a CUDA `device`."""
    from natsim.kernels import sparse_attention

    work = prepare_case(case, device)
    q, k, v = (
        torch.randn((1, case.seq_len, case.heads, case.head_dim), device=device, dtype=dtype) for _ in range(3)
    )
    return median_seconds(lambda: sparse_attention(q, k, v, work, precision=precision, backend="triton"), device,
                          min_repeats)


# -- the GNA backward pass -----------------------------------------------------------------------------------------

# (shape, window, stride, dilation, causal, head_dim): the backward's tiles are its own (backward_tiles), so the
# cases vary the problem only. Masked stride-1 and block-sparse 3-D windows, dense (flattened to 1-D), 2-D and
# 1-D windows, causal with padding (44 rows), dilation (the permutation's bytes grow with padding), head_dim 64.
# Ten, each a kernel specialisation of its own (tiles, mask, head_dim), so that compiling stays near a minute.
BACKWARD_CASES = (
    ((16, 32, 48), (8, 16, 24), (1, 1, 1), (1, 1, 1), False, 128),
    ((16, 32, 48), (8, 16, 24), (8, 8, 8), (1, 1, 1), False, 128),
    ((16, 32, 48), (8, 16, 24), (1, 8, 8), (1, 1, 1), False, 64),
    ((16, 32, 48), (16, 32, 48), (1, 1, 1), (1, 1, 1), False, 128),
    ((16, 44, 80), (8, 20, 40), (1, 4, 8), (1, 1, 1), (True, False, False), 128),
    ((16, 32, 48), (4, 8, 12), (1, 1, 1), (2, 2, 2), False, 128),
    ((256, 256), (80, 80), (1, 1), (1, 1), False, 128),
    ((32768,), (2048,), (1,), (1,), False, 128),
    ((32768,), (2048,), (256,), (1,), False, 64),
    ((16384,), (16384,), (1,), (1,), True, 128),
)
BACKWARD_MIN_REPEATS = 10  # backward calls take 10-200 ms: ten make a stable median and keep calibration short


@dataclass(frozen=True)
class BackwardCase:
    """One GNA backward call to time: a problem and the tensor sizes (batch 1); tiles are the backward's own."""

    problem: Problem
    heads: int
    head_dim: int

    def to_dict(self) -> dict:
        work = backward_work(self.problem, self.head_dim)
        return {**self.problem.to_dict(), "heads": self.heads, "head_dim": self.head_dim,
                "bwd_q_tile": list(work.q_tile), "bwd_kv_tile": list(work.kv_tile)}


def backward_calibration_cases() -> list[BackwardCase]:
    """The GNA backward calls `natsim calibrate --kernels ...,backward` times (BACKWARD_CASES)."""
    return [BackwardCase(Problem(shape, window, stride, dilation, causal), HEADS, head_dim)
            for shape, window, stride, dilation, causal, head_dim in BACKWARD_CASES]


def backward_case_features(cases: Sequence[BackwardCase], dtype: torch.dtype) -> np.ndarray:
    """The backward feature matrix of `cases` (rows in order), from the simulator."""
    size = element_bytes(dtype)
    return np.stack([backward_features(backward_work(c.problem, c.head_dim), batch_heads=c.heads,
                                       head_dim=c.head_dim, element_bytes=size) for c in cases])


def backward_case_inputs(case: BackwardCase, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random q, k, v and output gradient for `case`, with the forward's output and LSE: `(q, k, v, out, lse,
    grad_out)`, what `natsim::gna_backward` receives in a training step."""
    p = case.problem
    q, k, v, grad = (torch.randn((1, *p.shape, case.heads, case.head_dim), device=device, dtype=dtype)
                     for _ in range(4))
    out, lse = gna_forward_for_timing(q, k, v, p)
    return q, k, v, out, lse, grad


def backward_case_call(case: BackwardCase, inputs: Sequence[torch.Tensor]) -> Callable[[], object]:
    """The GNA backward call of `case` on `inputs` (`backward_case_inputs`), returning dq, dk, dv."""
    q, k, v, out, lse, grad = inputs
    return lambda: gna_backward_for_timing(q, k, v, out, lse, grad, case.problem)


def time_backward_case(case: BackwardCase, dtype: torch.dtype, device: torch.device,
                       min_repeats: int = BACKWARD_MIN_REPEATS) -> float:
    """Median seconds of one GNA backward call for `case` on a CUDA `device`."""
    return median_seconds(backward_case_call(case, backward_case_inputs(case, dtype, device)), device, min_repeats)


def check_kernels(kernels: Iterable[str]) -> tuple[str, ...]:
    """The kernels to calibrate, in KERNELS order: any of 'gna', 'sparse', 'backward', 'gna-fp8', 'sparse-fp8',
    'fa4', 'fa4-backward', 'gluon-fp8', 'gluon-16bit', 'host', at least one. `calibrate` extends the GPU's stored cost model
    where there is one (without one, 'gna' must be among them: every model carries the GNA kernel's coefficients)."""
    names = tuple(kernels)
    unknown = [name for name in names if name not in KERNELS]
    if unknown or not names:
        raise ValueError(
            f"kernels must name one or more of {KERNELS} (a GPU's stored cost model keeps the sets of those not named), "
            f"got kernels={names!r}."
        )
    return tuple(name for name in KERNELS if name in names)


def _empty(columns: int) -> np.ndarray:
    return np.zeros((0, columns))


@dataclass(frozen=True)
class Calibration:
    """A fitted cost model with the measurements behind it.

    `fitted[i]` says whether case i entered the fit (False: host-bound, under HOST_BOUND_S); `errors` are
    (predicted - measured) / measured for every case. The `sparse_` and `backward_` fields are the same for the
    sparse kernel's and the GNA backward's cases; each set is empty when it was not calibrated (the GNA set too,
    when only the others were, extending a stored model).
    """

    model: CostModel
    cases: tuple[Case, ...]
    features: np.ndarray
    times: np.ndarray
    errors: np.ndarray
    fitted: np.ndarray
    sparse_cases: tuple[SparseCase, ...] = ()
    sparse_features: np.ndarray = field(default_factory=lambda: _empty(len(SPARSE_FEATURES)))
    sparse_times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    sparse_errors: np.ndarray = field(default_factory=lambda: np.zeros(0))
    sparse_fitted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    backward_cases: tuple[BackwardCase, ...] = ()
    backward_features: np.ndarray = field(default_factory=lambda: _empty(len(BACKWARD_FEATURES)))
    backward_times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    backward_errors: np.ndarray = field(default_factory=lambda: np.zeros(0))
    backward_fitted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    fp8: Optional["Measurements"] = None
    fp8_sparse: Optional["Measurements"] = None
    fa4: Optional["Measurements"] = None
    fa4_backward: Optional["Measurements"] = None
    gluon_fp8: Optional["Measurements"] = None
    gluon_16bit: Optional["Measurements"] = None


@dataclass(frozen=True)
class Measurements:
    """One kernel's calibration (an FP8 kernel's, FlashAttention-4's): its cases, their features and measured
    seconds, the fit's relative errors and which cases entered the fit (as the fields of `Calibration` for natsim's
    bf16 kernels)."""

    cases: tuple
    features: np.ndarray
    times: np.ndarray
    errors: np.ndarray
    fitted: np.ndarray


def _fit(features: np.ndarray, times: np.ndarray, names: Sequence[str], kernel: str):
    """(coefficients, errors, fitted) of one kernel's measurements, host-bound ones left out of the fit."""
    fitted = times >= HOST_BOUND_S
    if fitted.sum() < len(names):
        raise ValueError(
            f"only {fitted.sum()} of {len(times)} {kernel} calibration cases kept this GPU busy for "
            f"{HOST_BOUND_S * 1e3:g} ms or more; the cost model needs at least {len(names)} that are not host-bound."
        )
    coefficients = fit_coefficients(features[fitted], times[fitted], names)
    return coefficients, relative_errors(features, times, coefficients, names), fitted


def _error_info(prefix: str, errors: np.ndarray, fitted: np.ndarray) -> dict:
    return {
        f"{prefix}cases": int(fitted.sum()),
        f"{prefix}host_bound_cases_left_out": int((~fitted).sum()),
        f"{prefix}median_abs_relative_error": float(np.median(np.abs(errors[fitted]))),
        f"{prefix}max_abs_relative_error": float(np.max(np.abs(errors[fitted]))),
    }


def calibrate(
    device: Union[None, str, torch.device] = None,
    dtype: Union[torch.dtype, str] = torch.bfloat16,
    progress: Optional[Callable[[int, int], None]] = None,
    kernels: Iterable[str] = DEFAULT_KERNELS,
) -> Calibration:
    """Time the calibration cases of `kernels` ('gna': `calibration_cases()`, 'sparse':
    `sparse_calibration_cases()`, 'backward': `backward_calibration_cases()`, 'gna-fp8': `fp8_calibration_cases()`
    in FP8, 'sparse-fp8': `fp8_sparse_calibration_cases()` in FP8, 'fa4': `fa4_calibration_cases()` on
    FlashAttention-4, 'fa4-backward': `fa4_backward_calibration_cases()`, their backward, 'gluon-fp8':
    `gluon_calibration_cases()` on natsim's Gluon FP8 kernel, 'gluon-16bit': `gluon_16bit_calibration_cases()` on
    its 16-bit variant) with natsim.kernels on a
    CUDA GPU and fit the cost model to them. Where the GPU has a stored cost model (`cost_model_for`: the user's
    file, else the shipped one) it is extended: the coefficients of the kernels calibrated are replaced, the others
    kept (recalibrating 'gna' keeps FlashAttention-4's and the FP8 kernels' sets), and its info records the
    calibration under "extended". Without a stored model 'gna' must be among the kernels. FlashAttention-4's sets
    are refused where it does not run (natsim.kernels.backends.fa4.device_refusal's sentence), the Gluon kernel's
    off Hopper."""
    kernels = check_kernels(kernels)
    dtype = as_dtype(dtype)
    gpu = gpu_of(device)
    if gpu is None:
        raise ValueError(
            f"calibration times the Triton kernels on a CUDA GPU, got device={device!r} "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()})."
        )
    base = cost_model_for(gpu)
    if "gna" not in kernels and base is None:
        raise ValueError(
            f"kernels={kernels!r} leaves out 'gna', which extends the stored cost model of {gpu}, but there is none; "
            "calibrate with 'gna' among the kernels."
        )
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    cases = calibration_cases() if "gna" in kernels else []
    sparse_cases = sparse_calibration_cases() if "sparse" in kernels else []
    backward_cases = backward_calibration_cases() if "backward" in kernels else []
    fp8_cases = fp8_calibration_cases() if "gna-fp8" in kernels else []
    fp8_sparse_cases = fp8_sparse_calibration_cases() if "sparse-fp8" in kernels else []
    if (fp8_cases or fp8_sparse_cases) and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kernels={kernels!r} asks for FP8, which needs a GPU of compute capability 8.9 or newer "
                         f"(Ada, Hopper, Blackwell), got {gpu}.")
    fa4_cases = fa4_calibration_cases() if "fa4" in kernels else []
    fa4_backward_cases = fa4_backward_calibration_cases() if "fa4-backward" in kernels else []
    refusal = fa4_backend.device_refusal(device) if fa4_cases or fa4_backward_cases else None
    if refusal is not None:
        raise ValueError(f"kernels={kernels!r} asks for FlashAttention-4, which does not run on {gpu}: {refusal}")
    gluon_cases = gluon_calibration_cases() if "gluon-fp8" in kernels else []
    gluon_16bit_cases = gluon_16bit_calibration_cases() if "gluon-16bit" in kernels else []
    refusal = gluon_backend.device_refusal(device) if gluon_cases or gluon_16bit_cases else None
    if refusal is not None:
        raise ValueError(f"kernels={kernels!r} asks for natsim's Gluon kernel, which does not run on {gpu}: "
                         f"{refusal}")
    features = case_features(cases, dtype, has_tensor_descriptors(device)) if cases else _empty(len(FEATURES))
    sparse_matrix = sparse_case_features(sparse_cases) if sparse_cases else _empty(len(SPARSE_FEATURES))
    backward_matrix = (backward_case_features(backward_cases, dtype) if backward_cases
                       else _empty(len(BACKWARD_FEATURES)))
    total = (len(cases) + len(sparse_cases) + len(backward_cases) + len(fp8_cases) + len(fp8_sparse_cases)
             + len(fa4_cases) + len(fa4_backward_cases) + len(gluon_cases) + len(gluon_16bit_cases))
    timed: list[float] = []

    def time_all(items, timer, **options) -> np.ndarray:
        start = len(timed)
        for item in items:
            timed.append(timer(item, dtype, device, **options))
            if progress is not None:
                progress(len(timed), total)
        return np.array(timed[start:])

    times = time_all(cases, time_case)
    sparse_times = time_all(sparse_cases, time_sparse_case)
    backward_times = time_all(backward_cases, time_backward_case)
    fp8_times = time_all(fp8_cases, time_case, precision="fp8")
    fp8_sparse_times = time_all(fp8_sparse_cases, time_sparse_case, precision="fp8")
    fa4_times = time_all(fa4_cases, time_fa4_case)
    fa4_backward_times = time_all(fa4_backward_cases, time_fa4_backward_case)
    gluon_times = time_all(gluon_cases, time_gluon_case)
    gluon_16bit_times = time_all(gluon_16bit_cases, time_gluon_case)
    host, info = own_host(base) if base is not None else ({}, {})  # not the host times lent by other GPUs' files
    if "host" in kernels:
        host.update({call: host_seconds(call, dtype, device) for call in HOST_CALLS
                     if host_refusal(call, device) is None})
    coefficients, errors, fitted = _fit(features, times, FEATURES, "GNA") if cases else \
        (base.coefficients, np.zeros(0), np.zeros(0, dtype=bool))
    if cases:
        dynamic = np.array([case.tiles.kv_tiling == "dynamic" for case in cases])
        info.update(_error_info("", errors, fitted))
        if (fitted & dynamic).any():
            info.update(_error_info("dynamic_", errors[dynamic], fitted[dynamic]))
        info["kv_tilings"] = list(KV_TILINGS) if (fitted & dynamic).any() else ["static"]
    sparse = base.sparse_coefficients if base is not None else None
    sparse_errors, sparse_fitted = np.zeros(0), np.zeros(0, dtype=bool)
    if sparse_cases:
        sparse, sparse_errors, sparse_fitted = _fit(sparse_matrix, sparse_times, SPARSE_FEATURES, "sparse")
        info.update(_error_info("sparse_", sparse_errors, sparse_fitted))
    backward = base.backward_coefficients if base is not None else None
    backward_errors, backward_fitted = np.zeros(0), np.zeros(0, dtype=bool)
    if backward_cases:
        backward, backward_errors, backward_fitted = _fit(backward_matrix, backward_times, BACKWARD_FEATURES,
                                                          "backward")
        info.update(_error_info("backward_", backward_errors, backward_fitted))
    sets = {}  # the FP8, FlashAttention-4 and Gluon sets: coefficients by attribute, measurements by kernel
    for attribute, kernel, items, matrix, seconds, names in (
        ("fp8_coefficients", "gna-fp8", fp8_cases,
         case_features(fp8_cases, dtype, has_tensor_descriptors(device), "fp8") if fp8_cases else None, fp8_times,
         FEATURES),
        ("fp8_sparse_coefficients", "sparse-fp8", fp8_sparse_cases,
         sparse_case_features(fp8_sparse_cases) if fp8_sparse_cases else None, fp8_sparse_times, SPARSE_FEATURES),
        ("fa4_coefficients", "fa4", fa4_cases, fa4_case_features(fa4_cases, dtype), fa4_times, FA4_FEATURES),
        ("fa4_backward_coefficients", "fa4-backward", fa4_backward_cases,
         fa4_case_features(fa4_backward_cases, dtype), fa4_backward_times, FA4_FEATURES),
        ("gluon_fp8_coefficients", "gluon-fp8", gluon_cases, gluon_case_features(gluon_cases, dtype), gluon_times,
         GLUON_FEATURES),
        ("gluon_16bit_coefficients", "gluon-16bit", gluon_16bit_cases,
         gluon_case_features(gluon_16bit_cases, dtype), gluon_16bit_times, GLUON_FEATURES),
    ):
        sets[attribute] = getattr(base, attribute) if base is not None else None
        if items:
            fitted_set, set_errors, set_fitted = _fit(matrix, seconds, names, kernel)
            sets[attribute] = fitted_set
            sets[kernel] = Measurements(tuple(items), matrix, seconds, set_errors, set_fitted)
            info.update(_error_info(kernel.replace("-", "_") + "_", set_errors, set_fitted))
    import triton

    stamp = {"date": datetime.date.today().isoformat(), "dtype": dtype_name(dtype), "torch": torch.__version__,
             "triton": triton.__version__, "python": platform.python_version()}
    if base is None:
        info.update(stamp)
    else:  # one record per extension, oldest first (a file written before kept only the last, as a dict)
        earlier = info.get("extended", [])
        earlier = [earlier] if isinstance(earlier, dict) else earlier
        info["extended"] = [*earlier, {**stamp, "kernels": list(kernels)}]
    model = CostModel(gpu=gpu, coefficients=coefficients, sparse_coefficients=sparse,
                      backward_coefficients=backward, fp8_coefficients=sets["fp8_coefficients"],
                      fp8_sparse_coefficients=sets["fp8_sparse_coefficients"], fa4_coefficients=sets["fa4_coefficients"],
                      fa4_backward_coefficients=sets["fa4_backward_coefficients"],
                      gluon_fp8_coefficients=sets["gluon_fp8_coefficients"],
                      gluon_16bit_coefficients=sets["gluon_16bit_coefficients"], host_seconds=host or None, info=info)
    return Calibration(model, tuple(cases), features, times, errors, fitted, tuple(sparse_cases), sparse_matrix,
                       sparse_times, sparse_errors, sparse_fitted, tuple(backward_cases), backward_matrix,
                       backward_times, backward_errors, backward_fitted, sets.get("gna-fp8"), sets.get("sparse-fp8"),
                       sets.get("fa4"), sets.get("fa4-backward"), sets.get("gluon-fp8"), sets.get("gluon-16bit"))


def default_path(gpu: str) -> Path:
    """Where `natsim calibrate` writes `gpu`'s coefficients unless told otherwise: the user's coefficient
    folder (planner.cost.files.user_coefficients_dir), where the planner looks before natsim's shipped files."""
    return user_coefficients_dir() / gpu_file_name(gpu)
