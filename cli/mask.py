"""`natsim mask FILE`: how fast a saved block mask runs at each granularity and merge (natsim.planner.best_mask).

The sibling of `natsim sim` (one GNA configuration) and `natsim sweep` (many) for content-adaptive masks: the
mask comes from a file instead of a window. It is read here, checked, and handed to `best_mask`; the table is
the plan's candidates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import ListsGpusInHelp, load_cost_model, out, reports_bad_input
from .output import print_json
from .parsing import CliInputError, parse_backends, parse_precision

MASK_KEY = "mask"
META_KEYS = ("q_block", "kv_block", "seq_len")


def _as_4d(mask, path: Path):
    """A 2-D `[nQ, nKV]`, 3-D `[H, nQ, nKV]` or 4-D boolean mask as a 4-D torch tensor."""
    import numpy as np
    import torch

    if isinstance(mask, np.ndarray):
        if mask.dtype != np.bool_:
            raise CliInputError(f"{path}: the mask must be boolean, got an array of dtype {mask.dtype}.")
        mask = torch.from_numpy(mask)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise CliInputError(f"{path}: the mask must be a boolean tensor, got {what}.")
    if mask.dim() not in (2, 3, 4):
        raise CliInputError(
            f"{path}: the mask must be [nQ, nKV], [heads, nQ, nKV] or [batch, heads, nQ, nKV], got shape "
            f"{tuple(mask.shape)}."
        )
    while mask.dim() < 4:
        mask = mask[None]
    return mask


def _scalar(value, key: str, path: Path) -> int:
    try:
        return int(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        raise CliInputError(f"{path}: {key} must be an integer, got {value!r}.") from None


def read_mask(path: Path) -> tuple[object, dict]:
    """The mask stored in `path` and the block sizes stored beside it.

    `.pt` (torch.save): a boolean tensor, or a dict with "mask" and optionally "q_block", "kv_block", "seq_len".
    `.npz` (numpy.savez): an array "mask" (or a single array) and optionally the same three scalars."""
    import numpy as np
    import torch

    if not path.is_file():
        raise CliInputError(f"mask file {path} does not exist.")
    suffix = path.suffix.lower()
    if suffix not in (".pt", ".npz"):
        raise CliInputError(f"mask file {path} must be a .pt (torch.save) or .npz (numpy.savez) file, got {suffix!r}.")
    try:
        if suffix == ".pt":
            data = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with np.load(path, allow_pickle=False) as archive:
                data = {name: archive[name] for name in archive.files}
                arrays = [name for name, value in data.items() if value.ndim > 0]  # the scalars beside are sizes
                if MASK_KEY not in data and len(arrays) == 1:
                    data = {**data, MASK_KEY: data.pop(arrays[0])}
    except Exception as error:  # any failure to read is bad input here, named in one line
        why = " ".join(str(error).split())
        raise CliInputError(f"mask file {path} could not be read: {type(error).__name__}: {why}") from None
    if not isinstance(data, dict):
        data = {MASK_KEY: data}
    if MASK_KEY not in data:
        raise CliInputError(
            f"{path} must hold a boolean mask tensor, or a dict/archive with the key 'mask', got the keys "
            f"{sorted(map(str, data))}."
        )
    meta = {key: _scalar(data[key], key, path) for key in META_KEYS if key in data}
    return _as_4d(data[MASK_KEY], path), meta


@reports_bad_input
def mask_command(
    file: Path = typer.Argument(..., help="A saved block mask: .pt (torch.save) or .npz (numpy.savez), boolean, shaped nQ x nKV, heads x nQ x nKV or batch x heads x nQ x nKV (one row per query block, one column per key block); a dict/archive may add q_block, kv_block, seq_len."),
    q_block: Optional[int] = typer.Option(None, "--q-block", help="Queries per mask row (default: the file's, else 16)."),
    kv_block: Optional[int] = typer.Option(None, "--kv-block", help="Keys per mask column (default: the file's, else 16)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens N (default: the file's, else rows x --q-block)."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Heads of the call (default: the mask's; a mask of one head is broadcast)."),
    head_dim: int = typer.Option(128, "--head-dim", help="Head dimension: a multiple of 8 from 16 to 256."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 or fp16."),
    merges: str = typer.Option("none,consecutive,xor", "--merges", help="Merges to score, comma-separated."),
    device: Optional[str] = typer.Option(
        None, "--device",
        help="GPU whose coefficients predict the times: the name or alias of a GPU (h100; it need not be present, but must have coefficients: those listed below), or a torch device (default: the current CUDA device, if any; without coefficients, ranked by token pairs).",
    ),
    coefficients: Optional[Path] = typer.Option(None, "--coefficients", help="A cost-model JSON written by `natsim calibrate` to use instead."),
    limit: int = typer.Option(16, "--limit", min=0, help="Rows in the table (0 for all); --json is never cut."),
    as_json: bool = typer.Option(False, "--json", help="Print the mask plan as one JSON document instead of a table."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp8: score the FP8 inference kernel (ranked by the GPU's FP8 sparse coefficients from `natsim calibrate --kernels gna,sparse-fp8`, else by token pairs). Default: compute in --dtype."),
    backend: Optional[list[str]] = typer.Option(None, "--backend", help="Kernel backends the plan may run on, repeated or joined by ',': triton (natsim's kernels), fa4 (FlashAttention-4: installed, on this GPU, with coefficients from `natsim calibrate --kernels fa4`), gluon (natsim's Gluon kernel at 128 x 128 blocks: Hopper, coefficients from `natsim calibrate --kernels gluon-16bit`, or gluon-fp8 with --precision fp8). Default: every one available here."),
    training: bool = typer.Option(False, "--training", help="Plan for calls that need gradients: only backends with a backward (not the Gluon kernel)."),
) -> None:
    """Score a saved block mask at every granularity and merge; show the table, fastest first.

    The mask is a predictor's output at its finest blocks (e.g. natsim.masks.topp at 16 x 16). Each row OR-pools it to coarser blocks (32, 64, 128 queries or keys; pooling only adds blocks, never drops a kept one) and runs its query blocks one per program (none) or merged into 128-query programs (consecutive, or natsim.merge's XOR greedy). Columns: the pooled mask's density (token pairs attended), the work the kernel computes (merged groups and padding included), KV tile iterations, the predicted time with the cost model of --device (without one: the token pairs computed, and no time) and the speedup over dense attention through the same kernel.

    Example: natsim mask topp16.pt --heads 12 --device h100
    """
    from natsim.planner import best_mask

    mask, meta = read_mask(file)
    q_block = q_block if q_block is not None else meta.get("q_block", 16)
    kv_block = kv_block if kv_block is not None else meta.get("kv_block", 16)
    seq_len = seq_len if seq_len is not None else meta.get("seq_len", mask.shape[2] * q_block)
    options = {"heads": heads, "head_dim": head_dim, "dtype": dtype, "device": device,
               "merges": [m.strip() for m in merges.split(",") if m.strip()], "precision": parse_precision(precision),
               "backends": parse_backends(backend), "training": training}
    if coefficients is not None:
        options["cost_model"] = load_cost_model(coefficients)
    plan = best_mask(mask, q_block, kv_block, seq_len, **options)
    if as_json:
        print_json(out, plan.to_dict())
        return
    basis = (f"predicted on {plan.gpu}" if plan.calibrated
             else "no cost model: ranked by token pairs computed, no time predicted")
    title = (f"{file.name}: N={plan.seq_len:,}, mask {plan.fine_q_block}x{plan.fine_kv_block} blocks, "
             f"{plan.batch}x{plan.heads} heads, head_dim {plan.head_dim}, {plan.dtype}"
             f"{' (FP8 kernel)' if plan.precision else ''}{', for training' if plan.training else ''}; {basis}; "
             "best score first")
    out.print(plan.candidates_table(title, limit=limit))
    hidden = sum(1 for i, c in enumerate(plan.candidates) if 0 < limit <= i and c != plan.chosen)
    if hidden:
        out.print(f"[dim]{hidden} more rows: raise --limit or use --json.[/dim]")
    out.print(
        f"chosen: {plan.q_block}x{plan.kv_block}, merge {plan.merge}, on {plan.backend}, {plan.predicted_speedup:.2f}x "
        "over dense "
        + (f"({plan.score * 1e3:.4g} ms vs {plan.dense_score * 1e3:.4g} ms)" if plan.calibrated else "(tile work)")
    )


def register(app: typer.Typer) -> None:
    """Add the `mask` command to `app`."""
    app.command("mask", cls=ListsGpusInHelp)(mask_command)
