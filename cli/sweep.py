"""`natsim sweep`: every stride and tile configuration of a GNA window, best first (natsim.sweep), and with a
cost model the kernel time the planner predicts for each."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from natsim import TileConfig, default_tile_catalog, sweep

from .common import LazyProgress, ListsGpusInHelp, err, load_cost_model, out, reports_bad_input
from .options import (CAUSAL, DILATION, JSON, KV_TILE, KV_TILING, Q_TILE, SHAPE, TILING, WINDOW, problem_options,
                      tile_config)
from .output import check_plot_path, fmt_dims, plot_speedups, print_json, results_table
from .parsing import CliInputError, broadcast, parse_strides


def _kernel_tiles(shape, head_dim: int, q_tile: Optional[str], kv_tile: Optional[str], tiling: str, kv_tiling: str) -> list[TileConfig]:
    """--kernel-tiles: the planner's tile catalog for the layout and head_dim (imports torch)."""
    if q_tile is not None or kv_tile is not None:
        given = " ".join(f"{name} {value}" for name, value in (("--q-tile", q_tile), ("--kv-tile", kv_tile)) if value)
        raise CliInputError(f"--kernel-tiles chooses the tiles itself, so it takes no --q-tile or --kv-tile, got {given}.")
    if tiling != "multi":
        raise CliInputError(f"--kernel-tiles needs --tiling multi (the GNA kernel's tiles are boxes), got --tiling {tiling}.")
    from natsim.planner import tile_catalog

    return [TileConfig(t.q_tile, t.kv_tile, "multi", kv_tiling) for t in tile_catalog(shape, head_dim)]


def _sweep_cost_model(device: Optional[str], coefficients: Optional[Path]):
    """The cost model for predicted times: from --coefficients, else that of the GPU --device names (refused
    when a GPU named by its name or alias has none); None, with a note on stderr, when the GPU at hand (or a
    torch device) has no coefficients (imports torch)."""
    from natsim.planner.cost import describe_gpus, known_gpus
    from natsim.planner.cost.resolve import resolve_cost_model

    if coefficients is not None:
        return load_cost_model(coefficients)
    gpu, model = resolve_cost_model(device, None)  # a GPU named without coefficients is refused, as by `plan`
    if model is None:
        where = gpu if gpu is not None else f"--device {device} (no CUDA GPU)"
        err.print(
            f"[yellow]note: no cost-model coefficients for {escape(where)}, so no predicted times; coefficients "
            f"exist for {escape(describe_gpus(known_gpus()))}.[/yellow]",
            highlight=False, soft_wrap=True,
        )
    return model


@reports_bad_input
def sweep_command(
    shape: str = SHAPE,
    window: str = WINDOW,
    stride: Optional[List[str]] = typer.Option(
        None, "--stride",
        help="A stride per dimension (repeat the option for several), or 'all' (the default): every stride from 1 to the window.",
    ),
    dilation: str = DILATION,
    causal: str = CAUSAL,
    q_tile: Optional[str] = Q_TILE,
    kv_tile: Optional[str] = KV_TILE,
    tiling: str = TILING,
    kv_tiling: str = KV_TILING,
    show_all: bool = typer.Option(False, "--all", help="Show every configuration, not only the pruned view."),
    limit: int = typer.Option(20, "--limit", min=0, help="Rows in the table (0 for all); --json is never cut."),
    as_json: bool = JSON,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of FLOP-wise vs tile speedup per shown configuration (needs matplotlib)."),
    kernel_tiles: bool = typer.Option(
        False, "--kernel-tiles",
        help="Try only the tiles the planner scores for natsim's GNA kernel (natsim.planner.tile_catalog for --head-dim) instead of every 64/128/256-token shape.",
    ),
    head_dim: int = typer.Option(128, "--head-dim", help="Head dimension, for --kernel-tiles and predicted times."),
    heads: int = typer.Option(1, "--heads", help="Attention heads in the predicted time (one call, batch 1)."),
    device: Optional[str] = typer.Option(
        None, "--device",
        help="Predict each row's kernel time with this GPU's cost model and rank by it: the name or alias of a GPU listed below (h100), which need not be present, or a torch device (cuda:0). Default: no prediction.",
    ),
    coefficients: Optional[Path] = typer.Option(None, "--coefficients", help="Predict times with a cost-model JSON written by `natsim calibrate` instead."),
) -> None:
    """Sweep strides and tiles; show the best configurations, best first.

    Without --q-tile/--kv-tile, every power-of-two tile shape of 64, 128 and 256 tokens is tried (multi-D tiling), or with --kernel-tiles those natsim's GNA kernel runs well. By default the table shows the GNA paper's pruned view: a configuration stays only if its tile speedup beats every configuration with a smaller stride product. Block-sparse configurations (every visited tile full, no mask needed) are marked.

    With a cost model (--device h100 or --coefficients FILE) each row also gets the kernel time the planner predicts for it (--heads heads, --head-dim; the permutation counted only where the call permutes, with dilation), and predicted time replaces tile speedup: in the ranking and in the pruned view (a configuration stays only if it is predicted faster than every configuration with a smaller stride product).

    Example: natsim sweep --shape 30x48x80 --window 18x24x24 --q-tile 4x8x8 --kv-tile 2x8x8
    """
    if plot is not None:
        check_plot_path(plot)
    options = problem_options(shape, window, dilation, causal)
    ndim = len(options["shape"])
    strides = parse_strides(stride)
    if strides is not None:
        strides = [broadcast(s, ndim, "--stride") for s in strides]
    if kernel_tiles:
        tiles = _kernel_tiles(options["shape"], head_dim, q_tile, kv_tile, tiling, kv_tiling)
    elif q_tile is None and kv_tile is None and tiling == "multi":
        if kv_tiling != "static":
            tiles = [TileConfig(t.q_tile, t.kv_tile, "multi", kv_tiling) for t in default_tile_catalog(options["shape"])]
        else:
            tiles = None
    else:
        tiles = [tile_config(ndim, q_tile, kv_tile, tiling, kv_tiling)]
    model = None
    if device is not None or coefficients is not None:
        if tiling != "multi":
            raise CliInputError(f"predicted times (--device, --coefficients) need --tiling multi, the GNA kernel's tiles, got --tiling {tiling}.")
        model = _sweep_cost_model(device, coefficients)
    progress = LazyProgress("simulating")
    try:
        result = sweep(strides=strides, tiles=tiles, progress=progress, **options)
    finally:
        progress.close()

    predicted_ms = None
    if model is None:
        rows = result.best(pruned=not show_all)
    else:
        from natsim.planner import fastest_first, predicted_times

        seconds = predicted_times(result, model, heads=heads, head_dim=head_dim)
        order = fastest_first(result, seconds, pruned=not show_all)
        rows = [result.result(int(i)) for i in order]
        predicted_ms = [float(s) * 1e3 for s in seconds[order]]
    if as_json:
        records = [r.to_dict() for r in rows]
        if predicted_ms is not None:
            records = [{**record, "predicted_ms": ms} for record, ms in zip(records, predicted_ms)]
        print_json(out, records)
    else:
        shown = rows if limit <= 0 else rows[:limit]
        view = "all configurations" if show_all else "pruned view"
        order_by = "best first"
        if model is not None:
            view = "all configurations" if show_all else "pruned view by predicted time"
            order_by = (
                f"fastest first as predicted for {model.gpu} ({heads} head{'s' if heads > 1 else ''}, "
                f"head_dim {head_dim})"
            )
        title = (
            f"shape {fmt_dims(result.problem.shape)}, window {fmt_dims(result.problem.window)}: "
            f"{len(result):,} configurations, {len(rows):,} in the {view}, {order_by}"
        )
        out.print(results_table(shown, title, None if predicted_ms is None else predicted_ms[: len(shown)]))
        if len(shown) < len(rows):
            out.print(f"[dim]{len(rows) - len(shown):,} more rows: raise --limit or use --json.[/dim]")
    if plot is not None:
        plot_speedups(rows[: max(limit, 1) if limit > 0 else len(rows)], plot)
        if not as_json:
            out.print(f"plot written to {plot}")


def register(app: typer.Typer) -> None:
    """Add the `sweep` command to `app`."""
    app.command("sweep", cls=ListsGpusInHelp)(sweep_command)
