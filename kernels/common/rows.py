"""Head rows on 128-byte boundaries: when natsim's Triton GNA forward copies q, k and v first.

In `[B, *shape, heads, head_dim]` a head's row of a token starts `head * head_dim` elements into the token's
row. At widths whose row is not a multiple of 128 bytes (40, 72 and 88 in bf16: 80, 144 and 176 bytes) most heads
start off a 128-byte boundary, and every tile the kernel loads straddles more cache lines and memory sectors than
its bytes need. On the H100 that made the neighborhood forward at stride 1 1.30-1.33x slower than the same call
on the same values in rows padded to 64 channels (benchmarks/headdim.py --rows, docs/performance.md), and a
copy into such rows costs less than it saves where the kernel reads each key many times.

`copies_rows(launch, t)` says whether a launch `(kv_tiling, query tile tokens)` copies its inputs first: the
launch is in `ALIGNED_ROW_LAUNCHES` (the launches measured faster with the copy, copy included) and `t`'s head rows
start on boundaries of less than `COPY_BELOW` bytes (rows of 96 bf16 channels, 64-byte aligned, ran faster
uncopied). `in_aligned_rows(t)` is the copy: a view of `t`'s values whose every head row starts on a 128-byte
boundary, the kernel reading only head_dim columns of each. `layout_alignment` gives the same alignment for a
model's contiguous `[B, N, heads, head_dim]` tensors from head_dim alone, for the planner's price of the copy.
"""

from __future__ import annotations

import torch

ROW_BYTES = 128  # a cache line: where a head's row should start
COPY_BELOW = 64  # bytes: rows aligned to less than this are copied on the launches below
# Launches `(KV tiling, query tile tokens)` that copy such rows first, measured faster copy included
# (benchmarks/headdim.py --rows given,copied, H100): the dynamic kernel's 64-token tiles, HunyuanVideo's stride-1
# window at 40 and 72 channels 1.30x and 1.27x faster. Its 128-token tiles (Wan 720p's plan) ran 4-7% slower
# copied and the static kernel's full 128-token tiles within 5% either way, so those launches read rows in place.
ALIGNED_ROW_LAUNCHES: frozenset[tuple[str, int]] = frozenset({("dynamic", 64)})


def alignment(t: torch.Tensor) -> int:
    """The largest power of two, up to `ROW_BYTES`, of bytes on which every head row of `t` (`[..., heads,
    head_dim]`, unit stride along head_dim) starts: the start's and every other stride's (of a dimension longer
    than one)."""
    size = t.element_size()
    offsets = [t.data_ptr()] + [stride * size for stride, length in zip(t.stride()[:-1], t.shape[:-1]) if length > 1]
    return min(_power_of_two_dividing(offset) for offset in offsets)


def layout_alignment(head_dim: int, element_size: int) -> int:
    """`alignment` of contiguous `[B, N, heads, head_dim]` tensors of several heads (their start aligned, as the
    caching allocator's are): head h starts `h * head_dim` elements into a token's row."""
    return _power_of_two_dividing(head_dim * element_size)


def _power_of_two_dividing(offset: int) -> int:
    return min(offset & -offset, ROW_BYTES) if offset else ROW_BYTES


def aligned_width(head_dim: int, element_size: int) -> int:
    """Channels per head that make a row of `element_size`-byte values a multiple of `ROW_BYTES`: head_dim
    rounded up."""
    per_line = ROW_BYTES // element_size
    return -(-head_dim // per_line) * per_line


def aligned_rows(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Uninitialised `[..., heads, head_dim]` memory whose rows hold `aligned_width` channels: a view of their first
    head_dim, every head row on a `ROW_BYTES` boundary (the caching allocator's blocks start on one). On the
    "meta" device, the strides alone (what a launch is worked out from)."""
    *outer, head_dim = shape
    width = aligned_width(head_dim, torch.empty((), dtype=dtype).element_size())
    return torch.empty((*outer, width), dtype=dtype, device=device)[..., :head_dim]


def in_aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values, `[..., heads, head_dim]`, copied into `aligned_rows`."""
    return aligned_rows(t.shape, t.dtype, t.device).copy_(t)


def copies_rows(launch: tuple[str, int], t: torch.Tensor) -> bool:
    """Whether the GNA forward's `launch` `(kv_tiling, query tile tokens)` copies `t` and its peers into aligned
    rows first: a launch measured faster so, on rows aligned to less than `COPY_BELOW` bytes."""
    return launch in ALIGNED_ROW_LAUNCHES and alignment(t) < COPY_BELOW


def copies_layout_rows(launch: tuple[str, int], head_dim: int, element_size: int) -> bool:
    """`copies_rows` for a model's contiguous tensors of several heads, from head_dim alone (the planner)."""
    return launch in ALIGNED_ROW_LAUNCHES and layout_alignment(head_dim, element_size) < COPY_BELOW
