"""Tile configurations: how a kernel cuts queries and keys into tiles (gna-semantics.md, section 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence, Union

from .problem import Problem, as_sizes

Tiling = Literal["multi", "1d"]
KVTiling = Literal["static", "dynamic"]
TileShape = Union[int, Sequence[int]]

TILINGS = ("multi", "1d")
KV_TILINGS = ("static", "dynamic")


@dataclass(frozen=True)
class TileConfig:
    """Q and KV tile shapes plus the tiling modes.

    - `tiling="multi"`: tiles are boxes in the token layout (what token permutation gives a kernel);
      `q_tile` / `kv_tile` hold one size per dimension (a single int is used for every dimension).
    - `tiling="1d"`: tokens in row-major order are cut into runs of `q_tile` / `kv_tile` tokens,
      each a single int.
    - `kv_tiling="static"`: KV tiles sit on a fixed grid; `"dynamic"` starts them where each Q tile's
      KV region starts (multi-D tiling only).

    >>> TileConfig(q_tile=(4, 8, 8), kv_tile=(2, 8, 8)).q_tokens
    256
    """

    q_tile: tuple[int, ...]
    kv_tile: tuple[int, ...]
    tiling: Tiling = "multi"
    kv_tiling: KVTiling = "static"

    def __post_init__(self) -> None:
        if self.tiling not in TILINGS:
            raise ValueError(f"tiling must be one of {TILINGS}, got tiling={self.tiling!r}.")
        if self.kv_tiling not in KV_TILINGS:
            raise ValueError(f"kv_tiling must be one of {KV_TILINGS}, got kv_tiling={self.kv_tiling!r}.")
        q_tile = as_sizes(self.q_tile, "q_tile")
        kv_tile = as_sizes(self.kv_tile, "kv_tile")
        if self.tiling == "1d":
            if len(q_tile) != 1 or len(kv_tile) != 1:
                raise ValueError(
                    "1-D tiling takes one token count per tile, got "
                    f"q_tile={self.q_tile!r}, kv_tile={self.kv_tile!r}."
                )
            if self.kv_tiling == "dynamic":
                raise ValueError(
                    "dynamic KV tiling needs multi-D tiling (a 1-D run of tokens has no per-dimension "
                    "KV region to start tiles at), got tiling='1d', kv_tiling='dynamic'."
                )
        elif len(q_tile) != len(kv_tile) and 1 not in (len(q_tile), len(kv_tile)):
            raise ValueError(
                "q_tile and kv_tile must have the same number of dimensions, got "
                f"q_tile={q_tile}, kv_tile={kv_tile}."
            )
        object.__setattr__(self, "q_tile", q_tile)
        object.__setattr__(self, "kv_tile", kv_tile)

    @property
    def q_tokens(self) -> int:
        """Queries per tile."""
        return math.prod(self.q_tile)

    @property
    def kv_tokens(self) -> int:
        """Keys per tile."""
        return math.prod(self.kv_tile)

    def dims(self, problem: Problem) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The per-dimension (q_tile, kv_tile) for `problem` under multi-D tiling.

        A single int broadcasts to every dimension; any other count must match the problem's.
        """
        if self.tiling != "multi":
            raise ValueError("per-dimension tile shapes exist only for tiling='multi'.")
        out = []
        for name, tile in (("q_tile", self.q_tile), ("kv_tile", self.kv_tile)):
            if len(tile) == 1:
                tile = tile * problem.ndim
            if len(tile) != problem.ndim:
                raise ValueError(
                    f"{name} must have one size per dimension of the layout, got "
                    f"{name}={tile} for shape={problem.shape}."
                )
            out.append(tile)
        return out[0], out[1]

    def to_dict(self) -> dict:
        return {
            "q_tile": list(self.q_tile),
            "kv_tile": list(self.kv_tile),
            "tiling": self.tiling,
            "kv_tiling": self.kv_tiling,
        }

    def __str__(self) -> str:
        fmt = lambda t: "x".join(map(str, t))  # noqa: E731
        kind = "" if self.tiling == "multi" else " (1-D)"
        return f"Q {fmt(self.q_tile)} / KV {fmt(self.kv_tile)}{kind}, {self.kv_tiling} KV"
