"""The options of `natsim sim` and `natsim sweep`: a GNA problem (shape, window, dilation, causal) and its tiles,
written per dimension joined by 'x'."""

from __future__ import annotations

from typing import Optional

import typer

from natsim import TileConfig

from .parsing import broadcast, parse_dims, parse_flags

DEFAULT_TILES = {1: ((128,), (128,)), 2: ((16, 16), (16, 8)), 3: ((4, 8, 8), (2, 8, 8))}

# Shared options. Typer reads the defaults of the command functions, so these are plain values.
SHAPE = typer.Option(..., "--shape", help="Token layout, e.g. 30x48x80 (frames x height x width).")
WINDOW = typer.Option(..., "--window", help="Window (kernel size) per dimension, e.g. 18x24x24.")
DILATION = typer.Option("1", "--dilation", help="Dilation per dimension, e.g. 1x2x2.")
CAUSAL = typer.Option("0", "--causal", help="Causal per dimension as 0/1, e.g. 1x0x0 for causal in time.")
Q_TILE = typer.Option(
    None, "--q-tile",
    help="Q tile: per dimension (4x8x8) for --tiling multi, a token count (128) for --tiling 1d.",
)
KV_TILE = typer.Option(None, "--kv-tile", help="KV tile, written like --q-tile.")
TILING = typer.Option("multi", "--tiling", help="multi: tiles are boxes of the layout (token permutation); 1d: runs of row-major tokens.")
KV_TILING = typer.Option("static", "--kv-tiling", help="static: KV tiles on a fixed grid; dynamic: KV tiles start where each Q tile's keys start (multi only).")
JSON = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table.")


def problem_options(shape: str, window: str, dilation: str, causal: str) -> dict:
    """The problem's keyword arguments (shape, window, dilation, causal), each broadcast to --shape's dimensions."""
    dims = parse_dims(shape, "--shape")
    ndim = len(dims)
    return {
        "shape": dims,
        "window": broadcast(parse_dims(window, "--window"), ndim, "--window"),
        "dilation": broadcast(parse_dims(dilation, "--dilation"), ndim, "--dilation"),
        "causal": broadcast(parse_flags(causal, "--causal"), ndim, "--causal"),
    }


def tile_config(ndim: int, q_tile: Optional[str], kv_tile: Optional[str], tiling: str, kv_tiling: str) -> TileConfig:
    """The tile configuration from --q-tile/--kv-tile; one alone is used for both."""
    if q_tile is None and kv_tile is None:
        default_q, default_kv = DEFAULT_TILES[ndim]
        if tiling == "1d":
            default_q, default_kv = (128,), (128,)
        return TileConfig(default_q, default_kv, tiling, kv_tiling)
    q = parse_dims(q_tile or kv_tile, "--q-tile")
    kv = parse_dims(kv_tile or q_tile, "--kv-tile")
    if tiling == "multi":
        q, kv = broadcast(q, ndim, "--q-tile"), broadcast(kv, ndim, "--kv-tile")
    return TileConfig(q, kv, tiling, kv_tiling)
