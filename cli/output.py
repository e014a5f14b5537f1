"""How the CLI shows results: rich tables for people, JSON for programs, an optional plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from natsim import SimResult

from .parsing import CliInputError


def fmt_dims(values: Sequence) -> str:
    return "x".join(str(int(v)) for v in values)


def print_json(console: Console, payload) -> None:
    """One JSON document on stdout (no rich markup, no wrapping)."""
    console.file.write(json.dumps(payload, indent=2) + "\n")


def results_table(results: Sequence[SimResult], title: str, predicted_ms: Optional[Sequence[float]] = None) -> Table:
    """One row per configuration; with `predicted_ms` (one per result) a column of predicted kernel times."""
    table = Table(title=title, title_justify="left")
    table.add_column("stride", justify="right")
    table.add_column("Q tile", justify="right")
    table.add_column("KV tile", justify="right")
    if predicted_ms is not None:
        table.add_column("predicted ms", justify="right")
    table.add_column("sparsity", justify="right")
    table.add_column("FLOP-wise", justify="right")
    table.add_column("tile speedup", justify="right")
    table.add_column("mean tile", justify="right")
    table.add_column("visited tiles", justify="right")
    table.add_column("block-sparse", justify="center")
    for i, r in enumerate(results):
        predicted = () if predicted_ms is None else (f"{predicted_ms[i]:.4g}",)
        table.add_row(
            fmt_dims(r.problem.stride),
            fmt_dims(r.tiles.q_tile),
            fmt_dims(r.tiles.kv_tile),
            *predicted,
            f"{r.sparsity:.1%}",
            f"{r.flop_speedup:.2f}x",
            f"{r.tile_speedup:.2f}x",
            f"{r.tile_speedup_mean:.2f}x",
            f"{r.visited_tiles:,}",
            "[green]yes[/green]" if r.block_sparse else "",
        )
    return table


def figures_table(result: SimResult) -> Table:
    """Every figure of one configuration, one per row."""
    table = Table(title=f"{result.problem}; {result.tiles}", title_justify="left", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("meaning", style="dim")
    rows = [
        ("sparsity", f"{result.sparsity:.4f}", "1 - attended pairs / N^2"),
        ("flop_speedup", f"{result.flop_speedup:.3f}x", "FLOP-wise upper bound, N^2 / attended pairs"),
        ("tile_speedup", f"{result.tile_speedup:.3f}x", "KV tiles / most KV tiles any Q tile visits"),
        ("tile_speedup_mean", f"{result.tile_speedup_mean:.3f}x", "dense tiles / visited tiles"),
        ("visited_tiles", f"{result.visited_tiles:,}", "(Q tile, KV tile) pairs visited"),
        ("full_tiles", f"{result.full_tiles:,}", "visited pairs that need no mask"),
        ("max_kv_tiles", f"{result.max_kv_tiles:,}", "most KV tiles one Q tile visits"),
        ("dense_tiles", f"{result.dense_tiles:,}", "Q tiles x KV tiles of self attention"),
        ("block_sparse", "yes" if result.block_sparse else "no", "every visited tile is full"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or a CliInputError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliInputError(
            "--plot needs matplotlib; install it with pip install 'natsim[plot]'."
        ) from None
    return plt


def check_plot_path(path: Path) -> None:
    """Fail before any work is done when --plot cannot be written: no matplotlib, or a path that is a
    folder, in a folder that does not exist, or not writable."""
    _pyplot()
    folder = path.parent
    if path.is_dir():
        raise CliInputError(f"--plot takes the name of a PNG file, got --plot {path}, which is a folder.")
    if not folder.is_dir():
        raise CliInputError(f"--plot must name a file in an existing folder, got --plot {path}: there is no folder {folder}.")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliInputError(f"--plot must name a file you may write, got --plot {path}: permission denied.")


def plot_speedups(results: Sequence[SimResult], path: Path) -> None:
    """Bars of FLOP-wise and tile speedup per configuration, as in the GNA paper's Figure 4."""
    plt = _pyplot()
    tile_names = {f"{fmt_dims(r.tiles.q_tile)}/{fmt_dims(r.tiles.kv_tile)}" for r in results}
    one_tile = len(tile_names) == 1
    labels = [
        fmt_dims(r.problem.stride) if one_tile
        else f"{fmt_dims(r.problem.stride)}\n{fmt_dims(r.tiles.q_tile)}/{fmt_dims(r.tiles.kv_tile)}"
        for r in results
    ]
    xs = range(len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, (0.6 if one_tile else 0.9) * len(results)), 4.0))
    ax.bar([x - 0.2 for x in xs], [r.flop_speedup for r in results], width=0.4, label="FLOP-wise")
    ax.bar([x + 0.2 for x in xs], [r.tile_speedup for r in results], width=0.4, label="tile speedup")
    ax.set_xticks(list(xs), labels, fontsize=8 if one_tile else 6)
    ax.set_xlabel("stride" if one_tile else "stride; Q tile / KV tile")
    ax.set_ylabel("speedup upper bound (x)")
    ax.set_ylim(0, 1.25 * max(r.flop_speedup for r in results))
    problem = results[0].problem
    title = f"shape {fmt_dims(problem.shape)}, window {fmt_dims(problem.window)}"
    if one_tile:
        title += f", tiles Q/KV {tile_names.pop()}"
    ax.set_title(title)
    ax.legend(loc="upper right", ncols=2)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as error:
        raise CliInputError(f"--plot {path} could not be written: {error.strerror or error}.") from None
    finally:
        plt.close(fig)
