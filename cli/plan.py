"""`natsim plan`: choose window, stride and tiles for a token layout and a target sparsity (natsim.planner)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from natsim import end_to_end_speedup

from .common import ListsGpusInHelp, load_cost_model, out, reports_bad_input
from .output import print_json
from .parsing import CliInputError, broadcast, parse_backends, parse_dims, parse_flags, parse_precision


def _end_to_end(plan, attention_share: Optional[float], dense_steps: Optional[int], steps: Optional[int]) -> Optional[dict]:
    """The end-to-end estimate with the plan's predicted speedup, when --attention-share is given."""
    if attention_share is None:
        if dense_steps is not None or steps is not None:
            raise CliInputError("--dense-steps and --steps need --attention-share (the share of time in attention).")
        return None
    steps = 1 if steps is None else steps
    dense_steps = 0 if dense_steps is None else dense_steps
    return {
        "attention_share": attention_share,
        "dense_steps": dense_steps,
        "steps": steps,
        "attention_speedup": plan.predicted_speedup,
        "attention_speedup_basis": plan.basis,
        "speedup": end_to_end_speedup(attention_share, plan.predicted_speedup, dense_steps, steps),
    }


@reports_bad_input
def plan_command(
    shape: str = typer.Option(..., "--shape", help="Token layout, e.g. 30x48x80 (frames x height x width)."),
    sparsity: float = typer.Option(..., "--sparsity", help="Target sparsity in [0, 1): the share of (query, key) pairs left out."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads (predicted time is per call of all heads; default: one head)."),
    head_dim: int = typer.Option(128, "--head-dim", help="Head dimension (selects the tile catalog)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 or fp16."),
    causal: str = typer.Option("0", "--causal", help="Causal per dimension as 0/1, e.g. 1x0x0 for causal in time."),
    window: Optional[str] = typer.Option(None, "--window", help="Keep this window (e.g. 18x24x24) and choose only stride and tiles."),
    max_stride: Optional[str] = typer.Option(None, "--max-stride", help="Largest stride per dimension, e.g. 1x8x8."),
    device: Optional[str] = typer.Option(
        None, "--device",
        help="GPU whose coefficients rank the plans: the name or alias of a GPU (h100, h200; it need not be present, but must have coefficients: those listed below), or a torch device (cuda:1; default: the current CUDA device, ranked by simulated tile work when it has no coefficients).",
    ),
    coefficients: Optional[Path] = typer.Option(None, "--coefficients", help="A cost-model JSON written by `natsim calibrate` to use instead."),
    kv_tiling: Optional[str] = typer.Option(None, "--kv-tiling", help="static or dynamic: fix the KV tiling mode (default: search every mode the cost model was calibrated on, both without one)."),
    attention_share: Optional[float] = typer.Option(None, "--attention-share", help="Share of end-to-end time spent in attention, for the end-to-end estimate."),
    dense_steps: Optional[int] = typer.Option(None, "--dense-steps", help="Diffusion steps kept dense (default 0)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Diffusion steps in all (default 1)."),
    training: bool = typer.Option(False, "--training", help="Rank by forward + backward time (training), the backward by its own coefficients (`natsim calibrate --kernels gna,backward`), else by tile work; with --world-size, each strategy forward + backward."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON document instead of a report."),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Ranks sharing the layout's frames (context parallelism, inference or --training): also choose the strategy (ulysses, padding heads the ranks do not divide; or halo, static KV tiling only, training with stride 1 along the frames) and the frame split, and show the per-rank table."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp8: plan the FP8 inference kernel (inputs in --dtype, quantized inside the call; static KV tiling, KV tiles of 32+ tokens; ranked by the GPU's FP8 coefficients from `natsim calibrate --kernels gna,gna-fp8`, else by tile work). auto: plan both and run FP8 only where it is predicted faster than --dtype by more than 2% (the report shows both). Not with --training or --world-size. Default: compute in --dtype."),
    backend: Optional[list[str]] = typer.Option(None, "--backend", help="Kernel backends the plan may run on, repeated or joined by ',': triton (natsim's kernels), fa4 (FlashAttention-4: installed, on this GPU, with coefficients from `natsim calibrate --kernels fa4`, for --training fa4-backward too), gluon (natsim's Gluon FP8 kernel, with --precision fp8: Hopper, coefficients from `natsim calibrate --kernels gluon-fp8`). Default: every one available here; the report shows each backend's best plan."),
) -> None:
    """Choose the fastest GNA configuration of a layout that is at least as sparse as asked.

    Candidate windows meet the target, stay close to it and are shaped like the layout; strides, tiles and kernel backends are scored with the simulator and the cost model of the GPU at hand (without one, by simulated tile work, and the report says so). Among configurations within 2% of the best, the smallest stride product wins. With --attention-share (and --steps, --dense-steps) it also estimates the end-to-end speedup.

    Example: natsim plan --shape 30x48x80 --sparsity 0.9 --heads 24 --attention-share 0.8 --steps 50 --dense-steps 15

    FP8 inference: natsim plan --shape 30x48x80 --sparsity 0.9 --heads 24 --device h100 --precision fp8
    """
    from natsim.planner import best

    dims = parse_dims(shape, "--shape")
    ndim = len(dims)
    options = {
        "heads": heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "causal": broadcast(parse_flags(causal, "--causal"), ndim, "--causal"),
        "window": None if window is None else broadcast(parse_dims(window, "--window"), ndim, "--window"),
        "max_stride": None if max_stride is None else broadcast(parse_dims(max_stride, "--max-stride"), ndim, "--max-stride"),
        "device": device,
        "cost_model": None if coefficients is None else load_cost_model(coefficients),
        "training": training,
        "world_size": world_size,
        "kv_tiling": kv_tiling,
        "precision": parse_precision(precision, auto=True),
        "backends": parse_backends(backend),
    }
    plan = best(dims, sparsity, **options)
    estimate = _end_to_end(plan, attention_share, dense_steps, steps)
    if as_json:
        payload = plan.to_dict()
        if estimate is not None:
            payload["end_to_end"] = estimate
        print_json(out, payload)
        return
    out.print(plan.explain())
    if estimate is not None:
        out.print(
            f"End-to-end estimate: {estimate['speedup']:.2f}x with attention {attention_share:.0%} of the time, "
            f"{estimate['dense_steps']} of {estimate['steps']} steps dense, attention {plan.predicted_speedup:.2f}x "
            f"faster ({plan.basis})."
        )


def register(app: typer.Typer) -> None:
    """Add the `plan` command to `app`."""
    app.command("plan", cls=ListsGpusInHelp)(plan_command)
