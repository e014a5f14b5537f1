"""`natsim sim`: every figure of one GNA configuration (natsim.simulate)."""

from __future__ import annotations

from typing import Optional

import typer

from natsim import Problem, simulate

from .common import out, reports_bad_input
from .options import (CAUSAL, DILATION, JSON, KV_TILE, KV_TILING, Q_TILE, SHAPE, TILING, WINDOW, problem_options,
                      tile_config)
from .output import figures_table, print_json
from .parsing import broadcast, parse_dims


@reports_bad_input
def sim_command(
    shape: str = SHAPE,
    window: str = WINDOW,
    stride: str = typer.Option("1", "--stride", help="Stride per dimension, e.g. 16x8x8."),
    dilation: str = DILATION,
    causal: str = CAUSAL,
    q_tile: Optional[str] = Q_TILE,
    kv_tile: Optional[str] = KV_TILE,
    tiling: str = TILING,
    kv_tiling: str = KV_TILING,
    as_json: bool = JSON,
) -> None:
    """Simulate one configuration and print every figure.

    Default tiles: 3-D Q 4x8x8 / KV 2x8x8, 2-D Q 16x16 / KV 16x8, 1-D 128 / 128 tokens.

    Example: natsim sim --shape 30x48x80 --window 18x24x24 --stride 16x8x8
    """
    options = problem_options(shape, window, dilation, causal)
    ndim = len(options["shape"])
    problem = Problem(stride=broadcast(parse_dims(stride, "--stride"), ndim, "--stride"), **options)
    result = simulate(problem, tile_config(ndim, q_tile, kv_tile, tiling, kv_tiling))
    if as_json:
        print_json(out, result.to_dict())
    else:
        out.print(figures_table(result))


def register(app: typer.Typer) -> None:
    """Add the `sim` command to `app`."""
    app.command("sim")(sim_command)
