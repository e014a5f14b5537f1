"""`natsim calibrate`: time natsim's GNA kernels (and its sparse kernel, the GNA backward pass, the FP8 kernels and
FlashAttention-4) on this GPU and write its cost-model coefficients."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

import typer
from rich.table import Table

from .common import LazyProgress, out, reports_bad_input
from .output import fmt_dims, print_json
from .parsing import CliInputError


def _measurements_table(title: str, columns: Sequence[str], cells: Iterable[Sequence[str]], measured: Iterable[float],
                        predicted: Iterable[float], errors: Iterable[float], fitted: Iterable[bool]) -> Table:
    """One row per calibration case: its `cells` (under `columns`), then the measured and predicted ms and the
    fit's relative error (or why the case was not fitted)."""
    table = Table(title=title, title_justify="left")
    for name in (*columns, "measured ms", "predicted ms", "error"):
        table.add_column(name, justify="right")
    for row, seconds, guess, error, kept in zip(cells, measured, predicted, errors, fitted):
        table.add_row(*row, f"{seconds * 1e3:.3f}", f"{guess * 1e3:.3f}",
                      f"{error:+.1%}" if kept else "host-bound, not fitted")
    return table


def _gna_cells(cases) -> list[tuple[str, ...]]:
    return [(fmt_dims(case.problem.shape), fmt_dims(case.problem.window), fmt_dims(case.problem.stride),
             f"{fmt_dims(case.tiles.q_tile)} / {fmt_dims(case.tiles.kv_tile)}", case.tiles.kv_tiling,
             f"{case.heads} x {case.head_dim}") for case in cases]


def _sparse_cells(cases) -> list[tuple[str, ...]]:
    return [(case.pattern if case.pattern != "random" else f"random {case.sparsity:.0%} sparse", str(case.seq_len),
             f"{case.q_block}x{case.kv_block}", str(case.merge), f"{case.heads} x {case.head_dim}") for case in cases]


GNA_COLUMNS = ("shape", "window", "stride", "Q / KV tile", "KV tiling", "heads x head_dim")
SPARSE_COLUMNS = ("mask", "tokens", "blocks", "merge", "heads x head_dim")


def _cases_table(calibration) -> Table:
    return _measurements_table(
        f"calibration on {calibration.model.gpu}", GNA_COLUMNS, _gna_cells(calibration.cases), calibration.times,
        calibration.model.predict(calibration.features), calibration.errors, calibration.fitted,
    )


def _sparse_cases_table(calibration) -> Table:
    return _measurements_table(
        f"sparse kernel calibration on {calibration.model.gpu}", SPARSE_COLUMNS,
        _sparse_cells(calibration.sparse_cases), calibration.sparse_times,
        calibration.model.predict_sparse(calibration.sparse_features), calibration.sparse_errors,
        calibration.sparse_fitted,
    )


def _backward_cases_table(calibration) -> Table:
    cells = []
    for case in calibration.backward_cases:
        p, record = case.problem, case.to_dict()
        cells.append((fmt_dims(p.shape), fmt_dims(p.window), fmt_dims(p.stride), fmt_dims(p.dilation),
                      f"{fmt_dims(record['bwd_q_tile'])} / {fmt_dims(record['bwd_kv_tile'])}",
                      f"{case.heads} x {case.head_dim}"))
    return _measurements_table(
        f"GNA backward calibration on {calibration.model.gpu}",
        ("shape", "window", "stride", "dilation", "backward Q / KV tile", "heads x head_dim"), cells,
        calibration.backward_times, calibration.model.predict_backward(calibration.backward_features),
        calibration.backward_errors, calibration.backward_fitted,
    )


FA4_COLUMNS = ("call", "Q / KV block", "heads x head_dim")


def _set_tables(calibration) -> list[Table]:
    """The FP8 kernels' and FlashAttention-4's measurement tables (those calibrated)."""
    tables, model = [], calibration.model
    if calibration.fp8:
        m = calibration.fp8
        tables.append(_measurements_table(f"FP8 GNA calibration on {model.gpu}", GNA_COLUMNS, _gna_cells(m.cases),
                                          m.times, model.predict(m.features, "fp8"), m.errors, m.fitted))
    if calibration.fp8_sparse:
        m = calibration.fp8_sparse
        tables.append(_measurements_table(f"FP8 sparse kernel calibration on {model.gpu}", SPARSE_COLUMNS,
                                          _sparse_cells(m.cases), m.times, model.predict_sparse(m.features, "fp8"),
                                          m.errors, m.fitted))
    for label, m, backward in (("FlashAttention-4", calibration.fa4, False),
                               ("FlashAttention-4 backward", calibration.fa4_backward, True)):
        if m:
            tables.append(_measurements_table(f"{label} calibration on {model.gpu}", FA4_COLUMNS,
                                              [case.describe() for case in m.cases], m.times,
                                              model.predict_fa4(m.features, backward), m.errors, m.fitted))
    for label, m, precision in (("Gluon FP8", calibration.gluon_fp8, "fp8"),
                                ("Gluon 16-bit", calibration.gluon_16bit, None)):
        if m:
            tables.append(_measurements_table(f"{label} calibration on {model.gpu}", FA4_COLUMNS,
                                              [case.describe() for case in m.cases], m.times,
                                              model.predict_gluon(m.features, precision), m.errors, m.fitted))
    return tables


def _coefficients_table(model) -> Table:
    table = Table(title="coefficients (seconds per unit)", title_justify="left")
    table.add_column("kernel")
    table.add_column("feature")
    table.add_column("coefficient", justify="right")
    for name, value in model.coefficients.items():
        table.add_row("gna", name, f"{value:.4e}")
    for name, value in (model.sparse_coefficients or {}).items():
        table.add_row("sparse", name, f"{value:.4e}")
    for name, value in (model.backward_coefficients or {}).items():
        table.add_row("backward", name, f"{value:.4e}")
    for name, value in (model.fp8_coefficients or {}).items():
        table.add_row("gna-fp8", name, f"{value:.4e}")
    for name, value in (model.fp8_sparse_coefficients or {}).items():
        table.add_row("sparse-fp8", name, f"{value:.4e}")
    for name, value in (model.fa4_coefficients or {}).items():
        table.add_row("fa4", name, f"{value:.4e}")
    for name, value in (model.fa4_backward_coefficients or {}).items():
        table.add_row("fa4-backward", name, f"{value:.4e}")
    for name, value in (model.gluon_fp8_coefficients or {}).items():
        table.add_row("gluon-fp8", name, f"{value:.4e}")
    for name, value in (model.gluon_16bit_coefficients or {}).items():
        table.add_row("gluon-16bit", name, f"{value:.4e}")
    for backend, value in (model.host_seconds or {}).items():
        table.add_row("host", f"{backend}: seconds to issue a call", f"{value:.4e}")
    return table


def _summary(calibration, path) -> str:
    """One line: each calibrated kernel's fit (cases, host-bound ones left out, median and max |error|)."""
    info, parts = calibration.model.info, []
    sets = (("fitted", "", calibration.cases), ("sparse kernel", "sparse_", calibration.sparse_cases),
            ("GNA backward", "backward_", calibration.backward_cases),
            ("FP8 GNA", "gna_fp8_", calibration.fp8.cases if calibration.fp8 else ()),
            ("FP8 sparse", "sparse_fp8_", calibration.fp8_sparse.cases if calibration.fp8_sparse else ()),
            ("FlashAttention-4", "fa4_", calibration.fa4.cases if calibration.fa4 else ()),
            ("FlashAttention-4 backward", "fa4_backward_",
             calibration.fa4_backward.cases if calibration.fa4_backward else ()),
            ("Gluon FP8", "gluon_fp8_", calibration.gluon_fp8.cases if calibration.gluon_fp8 else ()),
            ("Gluon 16-bit", "gluon_16bit_", calibration.gluon_16bit.cases if calibration.gluon_16bit else ()))
    for label, prefix, cases in sets:
        if cases:
            parts.append(
                f"{label} on {info[prefix + 'cases']} cases ({info[prefix + 'host_bound_cases_left_out']} "
                f"host-bound left out): median |error| {info[prefix + 'median_abs_relative_error']:.1%}, "
                f"max {info[prefix + 'max_abs_relative_error']:.1%}"
            )
    if not calibration.cases:
        parts.append("GNA kernel coefficients kept from the stored cost model")
    return "; ".join(parts) + f"; written to {path}"


def _backend_records(calibration) -> dict:
    """FlashAttention-4's and the Gluon kernel's measurements as JSON records, per kernel ('fa4', 'fa4-backward',
    'gluon-fp8', 'gluon-16bit'; those calibrated)."""
    records, model = {}, calibration.model
    for kernel, m, predict in (("fa4", calibration.fa4, model.predict_fa4),
                               ("fa4-backward", calibration.fa4_backward,
                                lambda features: model.predict_fa4(features, backward=True)),
                               ("gluon-fp8", calibration.gluon_fp8,
                                lambda features: model.predict_gluon(features, "fp8")),
                               ("gluon-16bit", calibration.gluon_16bit,
                                lambda features: model.predict_gluon(features, None))):
        if m:
            records[kernel] = [
                {**case.to_dict(), "measured_s": float(t), "predicted_s": float(g), "fitted": bool(f)}
                for case, t, g, f in zip(m.cases, m.times, predict(m.features), m.fitted)
            ]
    return records


def _fp8_records(calibration) -> dict:
    """The FP8 measurements as JSON records, per kernel ('gna-fp8', 'sparse-fp8'; those calibrated)."""
    records = {}
    if calibration.fp8:
        m = calibration.fp8
        records["gna-fp8"] = [
            {**case.problem.to_dict(), **case.tiles.to_dict(), "heads": case.heads, "head_dim": case.head_dim,
             "measured_s": float(t), "predicted_s": float(g), "fitted": bool(f)}
            for case, t, g, f in zip(m.cases, m.times, calibration.model.predict(m.features, "fp8"), m.fitted)
        ]
    if calibration.fp8_sparse:
        m = calibration.fp8_sparse
        records["sparse-fp8"] = [
            {**case.to_dict(), "measured_s": float(t), "predicted_s": float(g), "fitted": bool(f)}
            for case, t, g, f in zip(m.cases, m.times, calibration.model.predict_sparse(m.features, "fp8"), m.fitted)
        ]
    return records


def parse_kernels(text: str) -> tuple[str, ...]:
    """'gna,sparse' -> ('gna', 'sparse'): the kernels to calibrate."""
    from natsim.planner.cost.calibrate import check_kernels

    names = tuple(part.strip().lower() for part in text.split(","))
    try:
        return check_kernels(names)
    except ValueError:
        raise CliInputError(
            f"--kernels takes one or more of gna, sparse, backward, gna-fp8, sparse-fp8, fa4, fa4-backward, gluon-fp8, gluon-16bit, host joined by "
            f"',' (a GPU with a stored cost model keeps the sets of the kernels not named), got --kernels {text!r}."
        ) from None


@reports_bad_input
def calibrate_command(
    device: Optional[str] = typer.Option(None, "--device", help="CUDA device to calibrate, e.g. cuda:1 (default: the current one)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 or fp16."),
    output: Optional[Path] = typer.Option(
        None, "--output",
        help="Where to write the coefficients (default: <gpu>.json in $NATSIM_DATA_DIR/coefficients, else $XDG_DATA_HOME/natsim/coefficients, else ~/.local/share/natsim/coefficients, where the planner looks first).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the fitted model and every measurement as JSON."),
    kernels: str = typer.Option(
        "gna,sparse", "--kernels",
        help="Kernels to time and fit, joined by ',': gna (the GNA kernel), sparse (the block-mask kernel), backward (the GNA backward pass, for `natsim plan --training`), gna-fp8 and sparse-fp8 (the FP8 kernels, for `--precision fp8`; compute capability 8.9 or newer), fa4 and fa4-backward (FlashAttention-4's forward and backward, so that plans can pick it; where it runs: Hopper, pip install 'natsim\\[fa4]'), gluon-fp8 (natsim's Gluon FP8 kernel, so that FP8 plans can pick it; Hopper), gluon-16bit (its 16-bit variant, so that bf16 / fp16 mask plans for inference can pick it; Hopper), host (the host's time to issue one call on each backend that runs here, which plans price a call at least at, and of torch's SDPA, against which the diffusers integration weighs natsim's call per layout). Where this GPU has a stored cost model (yours, else natsim's shipped one) it is extended: the kernels named are refitted, the others' coefficients kept; without one, gna must be named.",
    ),
) -> None:
    """Time a fixed set of GNA configurations (and of sparse-kernel masks) on this GPU and fit the planner's cost model to them.

    Needs a CUDA GPU; takes a few minutes. The coefficients are written to your data folder (not into the installed package), where `natsim plan` and `natsim.planner.best` look for this GPU's coefficients before those shipped with natsim; or to --output, for `natsim plan --coefficients`.

    Example: natsim calibrate --dtype bf16
    """
    from natsim.planner.cost.calibrate import calibrate, default_path

    chosen = parse_kernels(kernels)
    progress = LazyProgress("timing")
    try:
        calibration = calibrate(device=device, dtype=dtype, progress=progress, kernels=chosen)
    finally:
        progress.close()
    path = calibration.model.save(output if output is not None else default_path(calibration.model.gpu))
    if as_json:
        predicted = calibration.model.predict(calibration.features)
        sparse_predicted = (calibration.model.predict_sparse(calibration.sparse_features)
                            if calibration.sparse_cases else [])
        backward_predicted = (calibration.model.predict_backward(calibration.backward_features)
                              if calibration.backward_cases else [])
        backend_records = _backend_records(calibration)
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
                "sparse_measurements": [
                    {**case.to_dict(), "measured_s": float(t), "predicted_s": float(g), "fitted": bool(f)}
                    for case, t, g, f in zip(calibration.sparse_cases, calibration.sparse_times,
                                             sparse_predicted, calibration.sparse_fitted)
                ],
                "backward_measurements": [
                    {**case.to_dict(), "measured_s": float(t), "predicted_s": float(g), "fitted": bool(f)}
                    for case, t, g, f in zip(calibration.backward_cases, calibration.backward_times,
                                             backward_predicted, calibration.backward_fitted)
                ],
                "fp8_measurements": _fp8_records(calibration),
                "fa4_measurements": {kernel: rows for kernel, rows in backend_records.items()
                                     if kernel.startswith("fa4")},
                "gluon_measurements": backend_records.get("gluon-fp8", []),
                "gluon_16bit_measurements": backend_records.get("gluon-16bit", []),
            },
        )
        return
    if calibration.cases:
        out.print(_cases_table(calibration))
    if calibration.sparse_cases:
        out.print(_sparse_cases_table(calibration))
    if calibration.backward_cases:
        out.print(_backward_cases_table(calibration))
    for table in _set_tables(calibration):
        out.print(table)
    out.print(_coefficients_table(calibration.model))
    out.print(_summary(calibration, path))


def register(app: typer.Typer) -> None:
    """Add the `calibrate` command to `app`."""
    app.command("calibrate")(calibrate_command)
