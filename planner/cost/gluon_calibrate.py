"""natsim's Gluon kernel's calibration cases: what is timed, its features, and the timed calls, through natsim's
public entry points with `backend="gluon"`.

'gluon-fp8' (`natsim calibrate --kernels gluon-fp8`, `precision="fp8"`): the cases span what GLUON_FEATURES separate
(planner.cost.gluon_features): GNA calls whose every visited block is a whole 128-token tile (HunyuanVideo's 16x8x8
stride at head_dim 128 and 64, 1-D and 2-D strides of whole tiles, dense attention over 1-D and 3-D layouts: q, k,
v permuted into tile order, as plans run them), GNA calls with partial tiles (Wan's and HunyuanVideo's 720p
layouts, with padding, strides of partial tiles, 2-D and 1-D; the mask's work per visited block), and random masks
of 128 x 128 blocks from 0% to 95% sparse on 8k to 32k tokens (nothing permuted), 24 heads.

'gluon-16bit' (the 16-bit variant, on the inputs' bf16 or fp16): block masks only, the one call it runs: random
masks of 128 x 128 blocks from 0% to 95% sparse on 8k to 64k tokens at head_dim 128 and 64 (`MASK_CASES_16BIT`),
nothing masked inside a block and nothing moved, so its fit has the per-block, per-program and per-call costs to
separate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from natsim import Problem

from ..backends import gluon_tiles_refusal
from ..catalog import element_bytes
from .gluon_features import GLUON_BLOCK, GLUON_FEATURES, gna_gluon_features, mask_gluon_features
from .timing import MIN_REPEATS, median_seconds, random_block_mask

HEADS = 24

# (shape, window, stride, tile, head_dim): every visited block a whole tile
GNA_CASES = (
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), (2, 8, 8), 128),  # HunyuanVideo (about 21 ms on an H100)
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), (2, 8, 8), 64),
    ((32768,), (2048,), (256,), (128,), 128),
    ((32768,), (4096,), (1024,), (128,), 128),
    ((256, 256), (80, 80), (16, 16), (16, 8), 128),
    ((32768,), (32768,), (1,), (128,), 128),  # dense (about 18 ms)
    ((32768,), (32768,), (1,), (128,), 64),
    ((16, 32, 64), (16, 32, 64), (1, 1, 1), (2, 8, 8), 128),  # dense over a 3-D layout: permuted
)

# (shape, window, stride, tile, head_dim): partial tiles (masked inside), padding where a side does not divide
PARTIAL_CASES = (
    ((21, 45, 80), (10, 23, 32), (1, 8, 16), (2, 8, 8), 128),  # Wan 720p, the planner's 0.9 window
    ((21, 45, 80), (7, 21, 35), (1, 1, 1), (1, 16, 8), 128),
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), (2, 16, 4), 128),  # HunyuanVideo, every block partial
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), (2, 16, 4), 64),
    ((192, 192), (48, 48), (1, 1), (8, 16), 128),
    ((32768,), (3000,), (1,), (128,), 128),
)

# (seq_len, sparsity, head_dim): random masks of 128 x 128 blocks, one per head
MASK_CASES = (
    (32768, 0.0, 128),
    (32768, 0.5, 128),
    (32768, 0.7, 128),
    (32768, 0.9, 128),
    (32768, 0.7, 64),
    (16384, 0.95, 128),
    (8192, 0.5, 128),
)

# (seq_len, sparsity, head_dim): the 16-bit variant's random masks (about 0.3 to 95 ms on an H200 at 24 heads)
MASK_CASES_16BIT = (
    (32768, 0.0, 128),
    (32768, 0.5, 128),
    (32768, 0.7, 128),
    (32768, 0.9, 128),
    (32768, 0.95, 128),
    (65536, 0.9, 128),
    (16384, 0.7, 128),
    (16384, 0.95, 128),
    (8192, 0.5, 128),
    (32768, 0.0, 64),
    (32768, 0.7, 64),
    (16384, 0.9, 64),
)


@dataclass(frozen=True)
class GluonGnaCase:
    """One Gluon GNA call to time: a problem, its 128-token tile (queries and keys) and the tensor sizes
    (batch 1)."""

    problem: Problem
    tile: tuple[int, ...]
    heads: int
    head_dim: int

    def features(self, dtype: torch.dtype) -> np.ndarray:
        return gna_gluon_features(self.problem, self.tile, batch_heads=self.heads, head_dim=self.head_dim,
                                  element_bytes=element_bytes(dtype))

    def refusal(self) -> Optional[str]:
        """None when the kernel runs this call (its 128-token tiles), else why not."""
        tokens = int(np.prod(self.tile))
        return gluon_tiles_refusal(tokens, tokens, self.head_dim, torch.bfloat16)

    def describe(self) -> tuple[str, str, str]:
        """(what, blocks, heads x head_dim): the cells of a report's row."""
        p, dims = self.problem, lambda values: "x".join(map(str, values))
        return (f"GNA {dims(p.shape)}, window {dims(p.window)}, stride {dims(p.stride)}",
                f"{dims(self.tile)} / {dims(self.tile)}", f"{self.heads} x {self.head_dim}")

    def to_dict(self) -> dict:
        return {"kind": "gna", **self.problem.to_dict(), "tile": list(self.tile), "heads": self.heads,
                "head_dim": self.head_dim}

    def call(self, dtype: torch.dtype, device: torch.device):
        """The call on random q, k, v on `device`."""
        from natsim.kernels import gna_attention

        p = self.problem
        q, k, v = (torch.randn((1, *p.shape, self.heads, self.head_dim), device=device, dtype=dtype)
                   for _ in range(3))
        return lambda: gna_attention(q, k, v, p.window, p.stride, p.dilation, p.causal, q_tile=self.tile,
                                     kv_tile=self.tile, precision="fp8", backend="gluon")


@dataclass(frozen=True)
class GluonMaskCase:
    """One Gluon call under a random mask of 128 x 128 blocks (each kept with probability 1 - `sparsity`, a mask
    per head, seeded with `seed`) on `[1, seq_len, heads, head_dim]` tensors, in `precision` ("fp8", or None: the
    16-bit variant on the inputs' dtype)."""

    seq_len: int
    sparsity: float
    head_dim: int
    heads: int = HEADS
    seed: int = 0
    precision: Optional[str] = "fp8"

    def mask(self) -> torch.Tensor:
        """The boolean mask `[1, heads, ceil(N / 128), ceil(N / 128)]` on the CPU, the same every call."""
        return random_block_mask(self.seq_len, GLUON_BLOCK, GLUON_BLOCK, self.heads, self.sparsity, self.seed)

    def features(self, dtype: torch.dtype) -> np.ndarray:
        return mask_gluon_features(int(self.mask().sum()), seq_len=self.seq_len, batch_heads=self.heads,
                                   head_dim=self.head_dim, element_bytes=element_bytes(dtype),
                                   fp8=self.precision == "fp8")

    def refusal(self) -> Optional[str]:
        return gluon_tiles_refusal(GLUON_BLOCK, GLUON_BLOCK, self.head_dim, torch.bfloat16)

    def describe(self) -> tuple[str, str, str]:
        return (f"random mask {self.sparsity:.0%} sparse, N={self.seq_len}", f"{GLUON_BLOCK}x{GLUON_BLOCK}",
                f"{self.heads} x {self.head_dim}")

    def to_dict(self) -> dict:
        return {"kind": "mask", "seq_len": self.seq_len, "sparsity": self.sparsity, "heads": self.heads,
                "head_dim": self.head_dim, "seed": self.seed, "precision": self.precision}

    def call(self, dtype: torch.dtype, device: torch.device):
        """The call on random q, k, v on `device`, on work prepared once beforehand (as a plan runs its mask)."""
        from natsim.kernels import prepare_sparse, sparse_attention

        q, k, v = (torch.randn((1, self.seq_len, self.heads, self.head_dim), device=device, dtype=dtype)
                   for _ in range(3))
        work = prepare_sparse(self.mask().to(device), GLUON_BLOCK, GLUON_BLOCK, self.seq_len, device=device,
                              backward=False, backend="gluon")
        return lambda: sparse_attention(q, k, v, work, precision=self.precision, backend="gluon")


GluonCase = Union[GluonGnaCase, GluonMaskCase]


def gluon_calibration_cases() -> list[GluonCase]:
    """The calls `natsim calibrate --kernels ...,gluon-fp8` times (GNA_CASES, PARTIAL_CASES, then MASK_CASES)."""
    gna = [GluonGnaCase(Problem(shape, window, stride), tile, HEADS, head_dim)
           for shape, window, stride, tile, head_dim in (*GNA_CASES, *PARTIAL_CASES)]
    masks = [GluonMaskCase(seq_len, sparsity, head_dim, seed=i)
             for i, (seq_len, sparsity, head_dim) in enumerate(MASK_CASES)]
    return [*gna, *masks]


def gluon_16bit_calibration_cases() -> list[GluonMaskCase]:
    """The calls `natsim calibrate --kernels ...,gluon-16bit` times: MASK_CASES_16BIT on the 16-bit variant."""
    return [GluonMaskCase(seq_len, sparsity, head_dim, seed=i, precision=None)
            for i, (seq_len, sparsity, head_dim) in enumerate(MASK_CASES_16BIT)]


def gluon_case_features(cases: list[GluonCase], dtype: torch.dtype) -> np.ndarray:
    """The GLUON_FEATURES matrix of `cases` (rows in order)."""
    if not cases:
        return np.zeros((0, len(GLUON_FEATURES)))
    return np.stack([case.features(dtype) for case in cases])


def time_gluon_case(case: GluonCase, dtype: torch.dtype, device: torch.device,
                    min_repeats: int = MIN_REPEATS) -> float:
    """Median seconds of one Gluon call of `case` (random inputs, an FP8 call's quantization included) on a CUDA
    `device`."""
    return median_seconds(case.call(dtype, device), device, min_repeats)
