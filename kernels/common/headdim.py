"""How natsim's Triton kernels compute a head dim: the widths they run and the column chunks a width runs in.

Triton's `tl.dot` and `tl.arange` take power-of-two sizes of at least 16, and the kernels run every head dim
that is a multiple of 8 from 16 to 256 (`HEAD_DIMS`). A width that is not a power of two runs in one of two
ways, a compile-time choice (`HeadSplit`, one value per width from `head_split`):

- **pad**: one chunk, the next power of two, its columns past head_dim read as zeros and never stored (72 runs
  as 128 columns: 44% of the tile products are padding);
- **split**: two power-of-two chunks, `a` columns then `b` columns, the last one masked past head_dim (72 = 64 +
  16 with 8 masked columns, 96 = 64 + 32, 136 = 128 + 16). Scores sum the chunks' products (`q_a k_a^T + q_b
  k_b^T`) and P @ V keeps one accumulator per chunk of V; a backward keeps its gradients per chunk the same way.

Padding is the split with `b = 0`, and a power of two is its own single chunk. The kernels take the chunk
widths as constexprs `CHUNK_A` and `CHUNK_B` beside the true `HEAD_DIM` (masks, strides and descriptor shapes):
with `CHUNK_B = 0` the second chunk's code is not compiled. Loads mask columns past head_dim (pointer loads) or
read them out of bounds of a descriptor whose last dimension is the head's own `head_dim` columns (tensor
descriptors read zeros there and drop stores; never a `[tokens, heads * head_dim]` view, which would read the
next head's columns). Row strides of multiples of 8 elements stay 16-byte aligned in 16-bit and 8-bit dtypes.

Which way a width runs by default (`head_split(head_dim, launch=...)`): split where it does fewer tile products
than padding, pad where both do the same (24, 56, 104 to 128 minus 8, ... : one chunk is fewer instructions),
unless the width is in `PADDED_WIDTHS` or the launch in `PADDED_LAUNCHES`, the widths and launches measured faster
padded (benchmarks/headdim.py times both on a GPU). A split does fewer products but not fewer instructions: its
second chunk adds its own loads and, in P @ V, as many narrow matrix instructions as the first chunk's, so a loop
bound by instruction issue or load latency gains nothing from it (Nsight Compute on the H100: dense attention at 72
issued 421 M instructions against 387 M at 128, benchmarks/results/ncu/*-headdims-2026-11-28.txt).

Per-width launch rules, each where its kernel's tiles are chosen, all keyed on the computed width
(`HeadSplit.width`) and its `wide` flag (more than `WIDE` columns, where registers run short):
- GNA forward: the tile catalog of the computed width rounded up to a catalog key (kernels/gna/tiles.py:
  `catalog`), past 128 columns `WIDE_TILE_TOKENS`: 64- and 128-query tiles against 64 keys; warps and pipeline
  stages that fit the tiles in shared memory (kernels/common/launch.py, `launch_config`).
- GNA backward: KV tiles of 64 keys instead of 128 at wide widths (kernels/gna/backward.py, `kv_tile_tokens`).
- Block masks: 8 warps for the backward's 64 x 64 tiles at wide widths (kernels/common/backward.py,
  `launch_options`), pipeline stages that fit (the forward retries with fewer when a variant does not).
- FP8 pads (its matrix instructions reduce over 32 elements, more than a 16-column chunk holds), and so runs
  24 to 256 (kernels/common/fp8.py, `fp8_head_split`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import triton
import triton.language as tl

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 8
HEAD_DIMS = tuple(range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, HEAD_DIM_STEP))
MIN_CHUNK = 16  # tl.dot's smallest reduced and output dimension
WIDE = 128  # computed widths above this run smaller tiles or more warps (module docstring)
STRATEGIES = ("pad", "split")
# Widths that `head_split` pads by default although splitting them does fewer products: none measured yet
# (benchmarks/headdim.py on the H100 decides; a width added here runs padded everywhere).
PADDED_WIDTHS: frozenset[int] = frozenset()
# Launches that run every width up to 128 columns padded by default (wider ones, padded to 256, were not measured), as
# (KV tiling, query tile tokens): the dynamic KV tiling kernel on 128-query tiles, whose split loop waits on its
# second chunk's loads (long-scoreboard stalls 1.05 against 0.30 per instruction at 72 on Wan 720p's plan; tensor pipe
# 28% against 55%). Padded, Wan 720p's plan (1x8x16 tiles) ran 5-19% faster at 40, 72, 88 and 96 on the H100 (14.5
# against 17.0 ms at 72); on 64-token tiles and on the static kernel's full 128-token tiles splitting stayed as fast
# or faster (benchmarks/results/headdim-dynamic-NVIDIA_H100_80GB_HBM3-2026-11-28.json).
PADDED_LAUNCHES: frozenset[tuple[str, int]] = frozenset({("dynamic", 128)})


def next_power_of_two(n: int) -> int:
    """The smallest power of two of at least `n` (n >= 1)."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class HeadSplit:
    """How the kernels compute `head_dim` columns: chunk `a` (a power of two) then chunk `b` (a power of two, or
    0 for none); columns past head_dim in the last chunk are masked. `a = next power of two, b = 0` is padding."""

    head_dim: int
    a: int
    b: int = 0

    def __post_init__(self) -> None:
        for name, width in (("a", self.a), ("b", self.b)):
            if width and (width & (width - 1) or width < MIN_CHUNK):
                raise ValueError(f"a head-dim chunk is 0 or a power of two of at least {MIN_CHUNK} columns, got "
                                 f"{name}={width} for head_dim={self.head_dim}.")
        if not self.a or self.a + self.b < self.head_dim or (self.b and self.a >= self.head_dim):
            raise ValueError(f"chunks a={self.a} and b={self.b} must cover head_dim={self.head_dim}, the second "
                             "(if any) starting inside it.")

    @property
    def width(self) -> int:
        """Columns the tile products compute (head_dim plus masked ones)."""
        return self.a + self.b

    @property
    def wide(self) -> bool:
        """Whether the computed width is over `WIDE` columns (smaller tiles or more warps: module docstring)."""
        return self.width > WIDE

    def constexprs(self) -> dict[str, int]:
        """The kernels' compile-time arguments: `HEAD_DIM`, `CHUNK_A`, `CHUNK_B`."""
        return {"HEAD_DIM": self.head_dim, "CHUNK_A": self.a, "CHUNK_B": self.b}


def head_dim_refusal(head_dim: int, kernel: str, head_dims: tuple[int, ...] = HEAD_DIMS) -> Optional[str]:
    """None when `kernel` (its name in the sentence) runs `head_dim` among `head_dims`, else the sentence."""
    if head_dim in head_dims:
        return None
    low, high = head_dims[0], head_dims[-1]
    return (f"the {kernel} supports head_dim {low} to {high} in steps of {HEAD_DIM_STEP}, got "
            f"head_dim={head_dim}.")


def head_split(head_dim: int, strategy: Optional[str] = None, launch: Optional[tuple[str, int]] = None
               ) -> HeadSplit:
    """The chunks `head_dim` (one of `HEAD_DIMS`) runs in: `strategy` "pad" (one chunk, the next power of two)
    or "split" (the largest power of two below head_dim, then the smallest power of two of at least 16 that
    covers the rest; padding where that is no fewer columns), or None for the default (module docstring) of the
    launch `(kv_tiling, query tile tokens)` where given."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(head_dim_refusal(head_dim, "Triton kernel"))
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be 'pad', 'split' or None (the width's default), got strategy={strategy!r}.")
    padded = next_power_of_two(head_dim)
    if padded == head_dim:
        return HeadSplit(head_dim, head_dim)
    a = padded // 2
    b = max(MIN_CHUNK, next_power_of_two(head_dim - a))
    padded_by_default = head_dim in PADDED_WIDTHS or (launch in PADDED_LAUNCHES and padded <= WIDE)
    pad = strategy == "pad" or (strategy is None and padded_by_default) or a + b >= padded
    return HeadSplit(head_dim, padded) if pad else HeadSplit(head_dim, a, b)


# -- the kernels' side ------------------------------------------------------------------------------------------


@triton.jit
def chunk_columns(OFFSET: tl.constexpr, WIDTH: tl.constexpr):
    """Column indices `[OFFSET, OFFSET + WIDTH)` of one chunk."""
    return OFFSET + tl.arange(0, WIDTH)


@triton.jit
def _chunk_mask(cols, HEAD_DIM: tl.constexpr, row_ok, PAST_END: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The load or store mask of a chunk: columns before head_dim (only where the chunk reaches past it) and rows
    where `row_ok` (None: every row); None when nothing is masked."""
    mask = None
    if PAST_END:
        if TRANSPOSED:
            mask = (cols < HEAD_DIM)[:, None]
        else:
            mask = (cols < HEAD_DIM)[None, :]
    if row_ok is not None:
        if TRANSPOSED:
            rows_mask = row_ok[None, :]
        else:
            rows_mask = row_ok[:, None]
        if mask is None:
            mask = rows_mask
        else:
            mask = mask & rows_mask
    return mask


@triton.jit
def load_columns(base, rows, OFFSET: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, row_ok=None,
                 TRANSPOSED: tl.constexpr = False):
    """A chunk `[rows, WIDTH]` (`[WIDTH, rows]` TRANSPOSED) through pointers: row r starts `rows[r]` elements past
    `base` (integer offsets: the cell offsets are summed before the pointer, as the kernels did before chunks,
    which keeps their registers), columns are contiguous. Columns past head_dim and rows where `row_ok` is False
    (None: every row) read zeros; the column mask is compiled only where the chunk reaches past head_dim."""
    cols = chunk_columns(OFFSET, WIDTH)
    if TRANSPOSED:
        ptrs = base + (rows[None, :] + cols[:, None])
    else:
        ptrs = base + (rows[:, None] + cols[None, :])
    mask = _chunk_mask(cols, HEAD_DIM, row_ok, OFFSET + WIDTH > HEAD_DIM, TRANSPOSED)
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def store_columns(base, rows, values, OFFSET: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
                  row_ok=None):
    """Store a chunk `[rows, WIDTH]` through pointers (row r starts `rows[r]` elements past `base`), columns past
    head_dim and rows where `row_ok` is False (None: every row) left alone."""
    cols = chunk_columns(OFFSET, WIDTH)
    ptrs = base + (rows[:, None] + cols[None, :])
    values = values.to(base.dtype.element_ty)
    mask = _chunk_mask(cols, HEAD_DIM, row_ok, OFFSET + WIDTH > HEAD_DIM, False)
    if mask is None:
        tl.store(ptrs, values)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def chunked_dot(a_a, a_b, b_a, b_b, CHUNK_B: tl.constexpr, acc=None):
    """`a @ b` reduced over head_dim's chunks: `a_a @ b_a (+ a_b @ b_b)`, added to `acc` when given (fp32)."""
    if acc is None:
        out = tl.dot(a_a, b_a)
    else:
        out = tl.dot(a_a, b_a, acc)
    if CHUNK_B > 0:
        out = tl.dot(a_b, b_b, out)
    return out
