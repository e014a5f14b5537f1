"""`natsim calibrate`: time natsim's GNA kernels on this GPU and write its cost-model coefficients."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .output import fmt_dims, print_json


def _cases_table(calibration) -> Table:
    table = Table(title=f"calibration on {calibration.model.gpu}", title_justify="left")
    for name in ("shape", "window", "stride", "Q / KV tile", "heads x head_dim", "measured ms", "predicted ms", "error"):
        table.add_column(name, justify="right")
    predicted = calibration.model.predict(calibration.features)
    rows = zip(calibration.cases, calibration.times, predicted, calibration.errors, calibration.fitted)
    for case, measured, guess, error, fitted in rows:
        p = case.problem
        table.add_row(
            fmt_dims(p.shape),
            fmt_dims(p.window),
            fmt_dims(p.stride),
            f"{fmt_dims(case.tiles.q_tile)} / {fmt_dims(case.tiles.kv_tile)}",
            f"{case.heads} x {case.head_dim}",
            f"{measured * 1e3:.3f}",
            f"{guess * 1e3:.3f}",
            f"{error:+.1%}" if fitted else "host-bound, not fitted",
        )
    return table


def _coefficients_table(model) -> Table:
    table = Table(title="coefficients (seconds per unit)", title_justify="left")
    table.add_column("feature")
    table.add_column("coefficient", justify="right")
    for name, value in model.coefficients.items():
        table.add_row(name, f"{value:.4e}")
    return table


def register(app: typer.Typer) -> None:
    """Add the `calibrate` command to `app`."""
    from .main import _LazyProgress, out, reports_bad_input  # imported late: main registers us

    @app.command("calibrate")
    @reports_bad_input
    def calibrate_command(
        device: Optional[str] = typer.Option(None, "--device", help="CUDA device to calibrate, e.g. cuda:1 (default: the current one)."),
        dtype: str = typer.Option("bf16", "--dtype", help="bf16 or fp16."),
        output: Optional[Path] = typer.Option(
            None, "--output",
            help="Where to write the coefficients (default: <gpu>.json in $NATSIM_DATA_DIR/coefficients, else $XDG_DATA_HOME/natsim/coefficients, else ~/.local/share/natsim/coefficients, where the planner looks first).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the fitted model and every measurement as JSON."),
    ) -> None:
        """Time a fixed set of GNA configurations on this GPU and fit the planner's cost model to them.

        Needs a CUDA GPU; takes a few minutes. The coefficients are written to your data folder (not into the installed package), where `natsim plan` and `natsim.planner.best` look for this GPU's coefficients before those shipped with natsim; or to --output, for `natsim plan --coefficients`.

        Example: natsim calibrate --dtype bf16
        """
        from natsim.planner.calibrate import calibrate, default_path

        progress = _LazyProgress("timing")
        try:
            calibration = calibrate(device=device, dtype=dtype, progress=progress)
        finally:
            progress.close()
        path = calibration.model.save(output if output is not None else default_path(calibration.model.gpu))
        if as_json:
            predicted = calibration.model.predict(calibration.features)
            print_json(
                out,
                {
                    "model": calibration.model.to_dict(),
                    "written_to": str(path),
                    "measurements": [
                        {
                            **case.problem.to_dict(),
                            **case.tiles.to_dict(),
                            "heads": case.heads,
                            "head_dim": case.head_dim,
                            "measured_s": float(t),
                            "predicted_s": float(g),
                            "fitted": bool(f),
                        }
                        for case, t, g, f in zip(calibration.cases, calibration.times, predicted, calibration.fitted)
                    ],
                },
            )
            return
        out.print(_cases_table(calibration))
        out.print(_coefficients_table(calibration.model))
        info = calibration.model.info
        left_out = info["host_bound_cases_left_out"]
        out.print(
            f"fitted on {info['cases']} cases ({left_out} host-bound left out): median |error| "
            f"{info['median_abs_relative_error']:.1%}, max {info['max_abs_relative_error']:.1%}; written to {path}"
        )
