"""The `natsim` command: simulate GNA tile counts and sweep strides and tiles from the shell."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from natsim import Problem, TileConfig, default_tile_catalog, simulate, sweep

from .output import check_plot_path, figures_table, fmt_dims, plot_speedups, print_json, results_table
from .parsing import CliInputError, broadcast, parse_dims, parse_flags, parse_strides

app = typer.Typer(
    name="natsim",
    help=(
        "Simulate, before anything runs, how many tiles a sparse-attention kernel visits for a "
        "Generalized Neighborhood Attention (GNA) configuration, and the speedup that allows.\n\n"
        "Sizes are written per dimension joined by 'x' (frames x height x width), e.g. "
        "--shape 30x48x80 --window 18x24x24; a single number applies to every dimension."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Tables are wide: when stdout is not a terminal (a pipe, a file, a test), do not cut them to 80 columns.
out = Console(width=None if sys.stdout.isatty() else 132)
err = Console(stderr=True)

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


def reports_bad_input(command: Callable) -> Callable:
    """Turn invalid input into one red line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (CliInputError, ValueError, TypeError) as error:
            err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


class ListsGpusInHelp(TyperCommand):
    """A command whose --help ends with the GPUs that have cost-model coefficients (for --device).

    The list comes from the coefficient files when the help is shown: reading them needs natsim.planner,
    which imports torch, too slow to do on every start of `natsim`.
    """

    def format_help(self, ctx, formatter) -> None:
        from natsim.planner.costmodel import describe_gpus, known_gpus

        self.epilog = escape(
            f"GPUs with cost-model coefficients, for --device: {describe_gpus(known_gpus())}. --device takes a "
            "GPU's full name (any case) or its alias, and needs no GPU present."
        )
        super().format_help(ctx, formatter)


def _problem_options(shape: str, window: str, dilation: str, causal: str) -> dict:
    dims = parse_dims(shape, "--shape")
    ndim = len(dims)
    return {
        "shape": dims,
        "window": broadcast(parse_dims(window, "--window"), ndim, "--window"),
        "dilation": broadcast(parse_dims(dilation, "--dilation"), ndim, "--dilation"),
        "causal": broadcast(parse_flags(causal, "--causal"), ndim, "--causal"),
    }


def _tile_config(ndim: int, q_tile: Optional[str], kv_tile: Optional[str], tiling: str, kv_tiling: str) -> TileConfig:
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
    """The cost model for predicted times: from --coefficients, else that of the GPU --device names; None,
    with a note on stderr, when that GPU has no coefficients (imports torch)."""
    from natsim.planner.costmodel import cost_model_for, describe_gpus, gpu_of, known_gpus

    from .plan import load_cost_model

    if coefficients is not None:
        return load_cost_model(coefficients)
    gpu = gpu_of(device)
    model = cost_model_for(gpu)
    if model is None:
        where = gpu if gpu is not None else f"--device {device} (no CUDA GPU)"
        err.print(
            f"[yellow]note: no cost-model coefficients for {escape(where)}, so no predicted times; coefficients "
            f"exist for {escape(describe_gpus(known_gpus()))}.[/yellow]",
            highlight=False, soft_wrap=True,
        )
    return model


class _LazyProgress:
    """A progress bar on stderr that appears only once work has taken longer than a second."""

    def __init__(self, description: str, delay: float = 1.0):
        self.description = description
        self.delay = delay
        self.started_at = time.perf_counter()
        self.bar: Optional[Progress] = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if time.perf_counter() - self.started_at < self.delay:
                return
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                TimeRemainingColumn(), console=err, transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@app.command("sweep", cls=ListsGpusInHelp)
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
    limit: int = typer.Option(20, "--limit", help="Rows in the table (0 for all); --json is never cut."),
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
    options = _problem_options(shape, window, dilation, causal)
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
        tiles = [_tile_config(ndim, q_tile, kv_tile, tiling, kv_tiling)]
    model = None
    if device is not None or coefficients is not None:
        if tiling != "multi":
            raise CliInputError(f"predicted times (--device, --coefficients) need --tiling multi, the GNA kernel's tiles, got --tiling {tiling}.")
        model = _sweep_cost_model(device, coefficients)
    progress = _LazyProgress("simulating")
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


@app.command("sim")
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
    options = _problem_options(shape, window, dilation, causal)
    ndim = len(options["shape"])
    problem = Problem(stride=broadcast(parse_dims(stride, "--stride"), ndim, "--stride"), **options)
    result = simulate(problem, _tile_config(ndim, q_tile, kv_tile, tiling, kv_tiling))
    if as_json:
        print_json(out, result.to_dict())
    else:
        out.print(figures_table(result))


# `natsim plan`, `natsim calibrate` and `natsim mask` live beside this file; they use the helpers above.
from .calibrate import register as register_calibrate  # noqa: E402
from .mask import register as register_mask  # noqa: E402
from .plan import register as register_plan  # noqa: E402

register_plan(app)
register_calibrate(app)
register_mask(app)

if __name__ == "__main__":
    app()
