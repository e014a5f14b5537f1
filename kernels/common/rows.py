"""Head rows on 128-byte boundaries: when natsim's Triton GNA forward copies q, k and v first.

In `[B, *shape, heads, head_dim]` a head's row of a token starts `head * head_dim` elements into the token's
row. At widths whose row is not a multiple of 128 bytes (40, 72 and 88 in bf16: 80, 144 and 176 bytes) most heads
start off a 128-byte boundary, and every tile the kernel loads straddles more cache lines and memory sectors than
its bytes need. On the H100 that made the neighborhood forward at stride 1 1.30-1.33x slower than the same call
on the same values in rows padded to 64 channels (benchmarks/headdim.py --rows, docs/performance.md), and a
copy into such rows costs less than it saves where the kernel reads each key many times.

`copies_rows(launch, t)` says whether a launch `(kv_tiling, query tile tokens)` copies its inputs first: the
launch is in `ALIGNED_ROW_LAUNCHES` (the launches measured faster with the copy, copy included) and `t`'s rows
are not all aligned. `in_aligned_rows(t)` is the copy: a view of `t`'s values whose every head row starts on a
128-byte boundary, the kernel reading only head_dim columns of each.
"""

from __future__ import annotations

import torch

ROW_BYTES = 128  # a cache line: where a head's row should start
# Launches `(KV tiling, query tile tokens)` that copy misaligned rows first, measured faster copy included
# (benchmarks/headdim.py --rows given,copied on the H100).
ALIGNED_ROW_LAUNCHES: frozenset[tuple[str, int]] = frozenset()


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether every head row of `t` (`[..., heads, head_dim]`, unit stride along head_dim) starts on a
    `ROW_BYTES` boundary: the start, and every stride but head_dim's, in whole multiples of it."""
    size = t.element_size()
    return t.data_ptr() % ROW_BYTES == 0 and all(
        (stride * size) % ROW_BYTES == 0 for stride, length in zip(t.stride()[:-1], t.shape[:-1]) if length > 1)


def aligned_width(head_dim: int, dtype: torch.dtype) -> int:
    """Channels per head that make a row of `dtype` a multiple of `ROW_BYTES`: head_dim rounded up."""
    per_line = ROW_BYTES // torch.empty((), dtype=dtype).element_size()
    return -(-head_dim // per_line) * per_line


def in_aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values, `[..., heads, head_dim]`, in new memory whose rows hold `aligned_width` channels: a view of
    their first head_dim, every head row on a `ROW_BYTES` boundary (the caching allocator's blocks start on
    one)."""
    head_dim = t.shape[-1]
    rows = t.new_empty(*t.shape[:-1], aligned_width(head_dim, t.dtype))[..., :head_dim]
    return rows.copy_(t)


def copies_rows(launch: tuple[str, int], t: torch.Tensor) -> bool:
    """Whether the GNA forward's `launch` `(kv_tiling, query tile tokens)` copies `t` and its peers into aligned
    rows first: a launch measured faster so, on rows that are not aligned."""
    return launch in ALIGNED_ROW_LAUNCHES and not rows_aligned(t)
