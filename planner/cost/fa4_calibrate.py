"""FlashAttention-4's calibration cases (`natsim calibrate --kernels fa4,fa4-backward`): what is timed, its
features, and the timed calls, through natsim's public entry points with `backend="fa4"`.

The cases span what FA4_FEATURES separate (planner.cost.fa4_features): GNA calls that are block-sparse (every
visited block full: HunyuanVideo's 16x8x8 stride, 1-D and 2-D strides of whole tiles), that run most blocks
through the element mask (stride 1), and that mix the two (a dimension the tile does not divide: its last KV tiles
hold padding keys and are masked), on 64- to 256-token query blocks and 64- and 128-token key blocks, head_dim 64
and 128; and random block masks (every visited block full, nothing permuted) from 0% to 95% sparse on 16k and 32k
tokens at 128x128, 64x128 and 128x64 blocks. The backward ("fa4-backward") times the cases whose blocks
FlashAttention-4's backward runs (key blocks of 128 tokens), over the same features. Calls of a GNA layout
include permuting q, k, v into tile order and unpermuting the output, as plans run them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import torch

from natsim import Problem, TileConfig

from ..backends import fa4_gna_refusal, fa4_mask_refusal
from ..catalog import element_bytes
from .fa4_features import FA4_FEATURES, gna_fa4_features, mask_fa4_features
from .timing import MIN_REPEATS, median_seconds, random_block_mask

HEADS = 24
Call = tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # a call and its q, k, v
BACKWARD_MIN_REPEATS = 10  # backward calls take 10 ms to a second: ten make a stable median

# (shape, window, stride, q_tile, kv_tile, head_dim)
GNA_CASES = (
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), (4, 8, 8), (2, 8, 8), 128),  # HunyuanVideo, block-sparse (23.3 ms)
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), (4, 8, 8), (2, 8, 8), 128),  # the same at stride 1: masked (362 ms)
    ((30, 48, 80), (18, 24, 24), (2, 8, 8), (2, 8, 8), (2, 8, 8), 64),
    ((30, 48, 80), (18, 24, 24), (1, 8, 8), (1, 8, 8), (1, 8, 8), 128),
    ((16, 44, 80), (8, 20, 40), (1, 4, 8), (2, 8, 8), (2, 8, 8), 128),  # 44 rows: padded KV tiles masked
    ((256, 256), (80, 80), (16, 16), (16, 8), (8, 8), 128),
    ((256, 256), (80, 80), (1, 1), (16, 8), (16, 8), 128),
    ((32768,), (2048,), (256,), (128,), (128,), 128),
    ((32768,), (32768,), (1,), (128,), (128,), 128),  # dense (18.7 ms)
    ((32768,), (2048,), (1,), (128,), (64,), 64),
)

# (seq_len, q_block, kv_block, sparsity, head_dim): random masks, one per head
MASK_CASES = (
    (32768, 128, 128, 0.0, 128),
    (32768, 128, 128, 0.7, 128),  # 6.0 ms forward on an H100
    (32768, 128, 128, 0.9, 128),  # 2.2 ms
    (32768, 64, 128, 0.7, 128),
    (32768, 128, 64, 0.7, 128),
    (32768, 128, 128, 0.7, 64),
    (16384, 128, 128, 0.95, 128),
)


@dataclass(frozen=True)
class Fa4GnaCase:
    """One FlashAttention-4 GNA call to time: a problem, its multi-D tiles (static KV tiling) and the tensor sizes
    (batch 1)."""

    problem: Problem
    q_tile: tuple[int, ...]
    kv_tile: tuple[int, ...]
    heads: int
    head_dim: int

    def features(self, dtype: torch.dtype) -> np.ndarray:
        return gna_fa4_features(self.problem, self.q_tile, self.kv_tile, batch_heads=self.heads,
                                head_dim=self.head_dim, element_bytes=element_bytes(dtype))

    def refusal(self, backward: bool) -> Optional[str]:
        """None when FlashAttention-4 runs this call (and with `backward`, its backward), else why not."""
        return fa4_gna_refusal(TileConfig(self.q_tile, self.kv_tile), self.head_dim, torch.bfloat16, backward)

    def describe(self) -> tuple[str, str, str]:
        """(what, blocks, heads x head_dim): the cells of a report's row."""
        p, dims = self.problem, lambda values: "x".join(map(str, values))
        return (f"GNA {dims(p.shape)}, window {dims(p.window)}, stride {dims(p.stride)}",
                f"{dims(self.q_tile)} / {dims(self.kv_tile)}", f"{self.heads} x {self.head_dim}")

    def to_dict(self) -> dict:
        return {"kind": "gna", **self.problem.to_dict(), "q_tile": list(self.q_tile), "kv_tile": list(self.kv_tile),
                "heads": self.heads, "head_dim": self.head_dim}

    def call(self, dtype: torch.dtype, device: torch.device, requires_grad: bool = False) -> Call:
        """Random q, k, v on `device` and the call on them."""
        from natsim.kernels import gna_attention

        p = self.problem
        q, k, v = (torch.randn((1, *p.shape, self.heads, self.head_dim), device=device, dtype=dtype,
                               requires_grad=requires_grad) for _ in range(3))
        return (lambda: gna_attention(q, k, v, p.window, p.stride, p.dilation, p.causal, q_tile=self.q_tile,
                                      kv_tile=self.kv_tile, backend="fa4")), (q, k, v)


@dataclass(frozen=True)
class Fa4MaskCase:
    """One FlashAttention-4 call under a random block mask (each block kept with probability 1 - `sparsity`, a mask
    per head, seeded with `seed`) at `q_block` x `kv_block` on `[1, seq_len, heads, head_dim]` tensors."""

    seq_len: int
    q_block: int
    kv_block: int
    sparsity: float
    head_dim: int
    heads: int = HEADS
    seed: int = 0

    def mask(self) -> torch.Tensor:
        """The boolean mask `[1, heads, ceil(N / q_block), ceil(N / kv_block)]` on the CPU, the same every call."""
        return random_block_mask(self.seq_len, self.q_block, self.kv_block, self.heads, self.sparsity, self.seed)

    def features(self, dtype: torch.dtype) -> np.ndarray:
        return mask_fa4_features(int(self.mask().sum()), q_block=self.q_block, kv_block=self.kv_block,
                                 seq_len=self.seq_len, batch_heads=self.heads, head_dim=self.head_dim)

    def refusal(self, backward: bool) -> Optional[str]:
        """None when FlashAttention-4 runs this call (and with `backward`, its backward), else why not."""
        return fa4_mask_refusal(self.q_block, self.kv_block, self.head_dim, torch.bfloat16, backward)

    def describe(self) -> tuple[str, str, str]:
        return (f"random mask {self.sparsity:.0%} sparse, N={self.seq_len}", f"{self.q_block}x{self.kv_block}",
                f"{self.heads} x {self.head_dim}")

    def to_dict(self) -> dict:
        return {"kind": "mask", "seq_len": self.seq_len, "q_block": self.q_block, "kv_block": self.kv_block,
                "sparsity": self.sparsity, "heads": self.heads, "head_dim": self.head_dim, "seed": self.seed}

    def call(self, dtype: torch.dtype, device: torch.device, requires_grad: bool = False) -> Call:
        """Random q, k, v on `device` and the call on them: the forward on work prepared once beforehand (as a plan
        runs its mask), or, for gradients, on the mask itself."""
        from natsim.kernels import prepare_sparse, sparse_attention

        q, k, v = (torch.randn((1, self.seq_len, self.heads, self.head_dim), device=device, dtype=dtype,
                               requires_grad=requires_grad) for _ in range(3))
        mask = self.mask().to(device)
        if requires_grad:
            return (lambda: sparse_attention(q, k, v, mask, self.q_block, self.kv_block, backend="fa4")), (q, k, v)
        work = prepare_sparse(mask, self.q_block, self.kv_block, self.seq_len, device=device, backward=False,
                              backend="fa4")
        return (lambda: sparse_attention(q, k, v, work, backend="fa4")), (q, k, v)


Fa4Case = Union[Fa4GnaCase, Fa4MaskCase]


def fa4_calibration_cases() -> list[Fa4Case]:
    """The FlashAttention-4 calls `natsim calibrate --kernels ...,fa4` times (GNA_CASES, then MASK_CASES)."""
    gna = [Fa4GnaCase(Problem(shape, window, stride), q_tile, kv_tile, HEADS, head_dim)
           for shape, window, stride, q_tile, kv_tile, head_dim in GNA_CASES]
    masks = [Fa4MaskCase(seq_len, q_block, kv_block, sparsity, head_dim, seed=i)
             for i, (seq_len, q_block, kv_block, sparsity, head_dim) in enumerate(MASK_CASES)]
    return [*gna, *masks]


def fa4_backward_calibration_cases() -> list[Fa4Case]:
    """The calls `natsim calibrate --kernels ...,fa4-backward` times the backward of: the forward's cases whose
    blocks FlashAttention-4's backward runs."""
    return [case for case in fa4_calibration_cases() if case.refusal(backward=True) is None]


def fa4_case_features(cases: list[Fa4Case], dtype: torch.dtype) -> np.ndarray:
    """The FA4_FEATURES matrix of `cases` (rows in order), the forward's and the backward's alike."""
    if not cases:
        return np.zeros((0, len(FA4_FEATURES)))
    return np.stack([case.features(dtype) for case in cases])


def time_fa4_case(case: Fa4Case, dtype: torch.dtype, device: torch.device, min_repeats: int = MIN_REPEATS) -> float:
    """Median seconds of one FlashAttention-4 forward call of `case` (random inputs) on a CUDA `device`."""
    run, _ = case.call(dtype, device)
    return median_seconds(run, device, min_repeats)


def time_fa4_backward_case(case: Fa4Case, dtype: torch.dtype, device: torch.device,
                           min_repeats: int = BACKWARD_MIN_REPEATS) -> float:
    """Median seconds of one FlashAttention-4 backward call of `case` on a CUDA `device`: the gradients of q, k, v
    through autograd from one forward, its graph kept between calls (unpermuting the gradients included)."""
    run, inputs = case.call(dtype, device, requires_grad=True)
    out = run()
    grad = torch.randn_like(out)
    return median_seconds(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), device, min_repeats)
