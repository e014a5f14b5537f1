"""The permuted token layout: dilation groups, then tiles, then tokens inside a tile.

Every dimension's dilation group is padded to `ceil(L / (T * d)) * T` tokens, so all groups hold the same
number of tiles (gna-semantics.md, section 2). Permuted position of a token, row-major at every level:

    ((group index * tiles per group + tile index) * tokens per tile) + position inside the tile

where the group index runs over `(g_1, ..., g_n)`, the tile index over the per-group tile grid and the
position over the tile shape. This is also how `natsim.simulate(..., per_q_tile=True)` numbers Q tiles.
Kernels always see three dimensions: a 1-D or 2-D layout gets leading dimensions of length 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from natsim.dimension import ceil_div

KERNEL_DIMS = 3


def as_3d(values: tuple[int, ...], fill: int = 1) -> tuple[int, ...]:
    """Prepend `fill` so that a per-dimension tuple has three entries."""
    return (fill,) * (KERNEL_DIMS - len(values)) + tuple(values)


@dataclass(frozen=True)
class TileLayout:
    """A token layout `shape` cut into tiles of shape `tile` per dilation group (any number of dims)."""

    shape: tuple[int, ...]
    tile: tuple[int, ...]
    dilation: tuple[int, ...]

    @property
    def tiles_per_group(self) -> tuple[int, ...]:
        """Tiles along each dimension of one dilation group."""
        return tuple(ceil_div(L, t * d) for L, t, d in zip(self.shape, self.tile, self.dilation))

    @property
    def num_groups(self) -> int:
        return math.prod(self.dilation)

    @property
    def tile_tokens(self) -> int:
        return math.prod(self.tile)

    @property
    def num_tiles(self) -> int:
        """Tiles of every dilation group together (padding-only tiles included)."""
        return self.num_groups * math.prod(self.tiles_per_group)

    @property
    def num_tokens(self) -> int:
        """Length of the permuted sequence, padding included."""
        return self.num_tiles * self.tile_tokens

    @property
    def row_major(self) -> bool:
        """Whether the permuted order is the layout's own row-major order: no padding, tiles of one token along
        the leading dimensions, then one dimension cut into runs, then whole dimensions (a 1-D tile of a
        sequence; tiles of whole rows). Permuting is then a reshape. Dimensions of length 1 (tile 1, no
        dilation) play no part; a dilated dimension is row-major only where it leads and each of its groups
        holds one token (`L == d`, tile 1): the groups come first in the permuted order, each one a single index
        of that dimension."""
        dims = [(L, t, d) for L, t, d in zip(self.shape, self.tile, self.dilation) if (L, t, d) != (1, 1, 1)]
        lead = 0
        while lead < len(dims) and dims[lead][0] == dims[lead][2] and dims[lead][1] == 1:
            lead += 1
        rest = dims[lead:]
        if any(d != 1 for _, _, d in rest) or any(L % t for L, t, _ in rest):
            return False
        cut = next((i for i, (_, t, _) in enumerate(rest) if t != 1), len(rest))
        return all(t == L for L, t, _ in rest[cut + 1:])

    def to_3d(self) -> "TileLayout":
        return TileLayout(as_3d(self.shape), as_3d(self.tile), as_3d(self.dilation))
