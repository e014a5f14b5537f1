"""Candidate windows for a target sparsity: meeting it, close to it, shaped like the layout, tile-aligned.

Every window of the layout is considered at once (numpy over the grid of per-dimension sizes), at stride 1,
where sparsity is lowest: a larger stride never attends more keys, so a window admissible at stride 1 is
admissible at every stride. The rules, in order:

1. admissible: sparsity at least the target;
2. shaped like the layout: the spread of the per-dimension coverages `window_i / shape_i` (largest over
   smallest) at most ASPECT_LIMIT times the smallest spread any admissible window achieves;
3. close to the target: density (1 - sparsity) at least (1 - DENSITY_SLACK) times the densest window left;
4. ranked: best aligned to the catalog's KV tiles first (where block-sparse configurations live: the
   alignment is the largest product, over catalog KV tiles, of the tile sides that divide the window,
   so a window made of whole KV tiles scores the tile's token count), then the densest, then the best
   shaped; the first MAX_WINDOWS are the candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from natsim import TileConfig

DENSITY_SLACK = 0.05
ASPECT_LIMIT = 1.5
MAX_WINDOWS = 6


def attended_pairs_stride1(length: int, window: np.ndarray, causal: bool) -> np.ndarray:
    """(query, key) pairs along one dimension at stride 1 and dilation 1, for every window in `window`.

    Non-causal: every query sees exactly `w` keys. Causal: query `i` sees `min(i + 1, w)` keys.
    """
    window = np.asarray(window, np.int64)
    if causal:
        return window * (window + 1) // 2 + (length - window) * window
    return length * window


@dataclass(frozen=True)
class WindowCandidates:
    """The candidate windows, best first, with the band they were drawn from."""

    windows: tuple[tuple[int, ...], ...]
    sparsity: tuple[float, ...]
    kv_alignment: tuple[int, ...]
    band: tuple[float, float]


def _grid(shape: Sequence[int], causal: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Density and coverage spread of every window, flattened row-major over the per-dimension sizes."""
    sizes = np.meshgrid(*[np.arange(1, L + 1) for L in shape], indexing="ij", sparse=True)
    density = np.ones(tuple(shape))
    for length, w, c in zip(shape, sizes, causal):
        density = density * (attended_pairs_stride1(length, w, c) / float(length * length))
    coverages = [w / length for length, w in zip(shape, sizes) if length > 1]
    spread = np.ones(tuple(shape))
    if coverages:
        spread = spread * np.maximum.reduce(np.broadcast_arrays(*coverages)) / np.minimum.reduce(
            np.broadcast_arrays(*coverages)
        )
    return density.reshape(-1), spread.reshape(-1)


def candidate_windows(
    shape: Sequence[int],
    target_sparsity: float,
    causal: Sequence[bool],
    kv_tiles: Sequence[TileConfig],
    limit: int = MAX_WINDOWS,
) -> WindowCandidates:
    """The candidate windows of `shape` for `target_sparsity` (module docstring: the rules)."""
    density, spread = _grid(shape, causal)
    admissible = reaches(density, target_sparsity)
    if not admissible.any():
        raise ValueError(
            f"shape={tuple(shape)} cannot reach target_sparsity={target_sparsity}: its sparsest window "
            f"(1 along every dimension) has sparsity {1.0 - density.min():.6f}."
        )
    shaped = admissible & (spread <= ASPECT_LIMIT * spread[admissible].min() * (1 + 1e-12))
    densest = density[shaped].max()
    band = shaped & (density >= (1.0 - DENSITY_SLACK) * densest * (1 - 1e-12))
    rows = np.nonzero(band)[0]
    windows = np.stack(np.unravel_index(rows, tuple(shape)), axis=1) + 1  # (k, ndim)

    kv_shapes = np.array(sorted({t.kv_tile for t in kv_tiles}), np.int64)  # (m, ndim)
    divides = windows[:, None, :] % kv_shapes[None, :, :] == 0
    aligned = np.where(divides, kv_shapes[None, :, :], 1).prod(axis=2).max(axis=1)
    order = np.lexsort((spread[rows], -density[rows], -aligned))[:limit]
    return WindowCandidates(
        windows=tuple(tuple(int(v) for v in windows[i]) for i in order),
        sparsity=tuple(float(1.0 - density[rows[i]]) for i in order),
        kv_alignment=tuple(int(aligned[i]) for i in order),
        band=(float(1.0 - densest), float(1.0 - (1.0 - DENSITY_SLACK) * densest)),
    )


def window_density(shape: Sequence[int], window: Sequence[int], causal: Sequence[bool]) -> float:
    """Attended pairs over all pairs of `window` at stride 1 (the highest over strides): one minus its sparsity."""
    pairs = math.prod(
        int(attended_pairs_stride1(L, np.array(w), c)) for L, w, c in zip(shape, window, causal)
    )
    n = math.prod(shape)
    return pairs / (n * n)


def reaches(density, target_sparsity: float):
    """Whether a window of this density (a float or an array) reaches `target_sparsity`, up to float rounding
    (1e-12 relative): a window whose sparsity is the target exactly, as a user writes it (window 7 of 100 tokens
    for 0.93), reaches it."""
    return density <= (1.0 - target_sparsity) * (1 + 1e-12)
