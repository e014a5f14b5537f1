"""The final latent of a short denoising run with natsim's FP8 attention, against bf16, one run, one JSON:

    python benchmarks/diffusers_fp8.py --out DIR [--cases wan-480p,hunyuan-720p] [--steps 8]
    python benchmarks/diffusers_fp8.py --out /tmp/x --small      # CPU smoke test: tiny models, seconds

Each case is a model of benchmarks/diffusers_step.py (built from its published configuration with random weights,
nothing downloaded; bf16 on the GPU, batch 1, random text states). From one noise latent, `--steps` steps of a
flow-matching Euler sampler (`x <- x + (sigma_next - sigma) * v`, sigma from 1 to 0, the model's prediction v) run
three ways: (a) the model's own attention, (b) natsim GNA (`apply(model, ...)`, the case's options), (c) the same
with `precision="fp8"`. Reported per case: the relative L2 difference and the cosine similarity of the final
latents, (c) against (b) (what FP8 costs), (b) against (a) (what sparsity costs) and (c) against (a); the median
step time of each run after its first step (which plans and compiles), synchronised wall clock, eager; the
attention alone (median of 5 calls on the q, k, v of a routed call, captured from a step: the model's own SDPA,
natsim's bf16 and FP8 plans) and its share of each run's step, `calls x attention / step` (calls: the routed
attention modules), which says how much of a step-time difference is the attention's; then each run's step
compiled as benchmarks/diffusers_step.py compiles it (`compile_step`, fullgraph), median of 5 after warm-up (one
with --small), and the backend each plan runs on (FP8: the Gluon kernel where the plan's tiles are 128-token tiles
on Hopper and the cost model prices it faster, natsim's Triton FP8 kernel elsewhere). Writes
`diffusers-fp8-<device>-<date>.json`; the table comes last.

The GPU run (one H100, both default cases; by the H100 step times in docs/fp8.md the 48 steps take about 85 s,
under three minutes with model building, planning, Triton's first compiles and the attention timings):

    python benchmarks/diffusers_fp8.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from diffusers_step import (CASES, build, captured_qkv, compiled_step_ms, inputs, median_ms, run_header, small_case,
                            synchronize)
from natsim.integrations import diffusers as nd

DEFAULT_CASES = "wan-480p,hunyuan-720p"


def denoise(model, args: dict, noise: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
    """The final latent of `steps` Euler steps from `noise` and each step's milliseconds."""
    scale = float(args["timestep"].flatten()[0]) / 0.5  # the case's timestep at sigma 0.5: 1000 or 1 (FLUX)
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    x, times = noise.clone(), []
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            step_args = dict(args, hidden_states=x, timestep=torch.full_like(args["timestep"], sigma * scale))
            synchronize()
            start = time.perf_counter()
            velocity = model(**step_args)[0]
            synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            x = (x.float() + (sigma_next - sigma) * velocity.float()).to(x.dtype)
    return x.float(), times


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Relative L2 difference of `a` to `b` and their cosine similarity (flattened, float64)."""
    a, b = a.double().flatten(), b.double().flatten()
    return {"relative_difference": float((a - b).norm() / b.norm()),
            "cosine": float(torch.dot(a, b) / (a.norm() * b.norm()))}


def run_case(name: str, steps: int, small: bool = False) -> dict:
    cls_name, config, layout, text, options = small_case(name) if small else CASES[name]
    torch.manual_seed(0)
    model = build(cls_name, config)
    args = inputs(cls_name, config, layout, text)
    noise = args["hidden_states"].clone()
    record = dict(case=name, model=cls_name, layout=list(layout), text_tokens=text, steps=steps,
                  options={k: str(v) if isinstance(v, torch.dtype) else v for k, v in options.items()},
                  layers={k: v for k, v in config.items() if "layers" in k})
    latents, step_ms, attention_ms = {}, {}, {}
    for run, precision in (("own", None), ("natsim_bf16", None), ("natsim_fp8", "fp8")):
        applied = None if run == "own" else nd.apply(model, **options, precision=precision, keep_own=False)
        latents[run], times = denoise(model, args, noise, steps)
        step_ms[run] = statistics.median(times[1:]) if len(times) > 1 else times[0]
        if applied is not None:
            record[f"{run}_plans"] = [
                {"window": list(p.problem.window), "stride": list(p.problem.stride), "q_tile": list(p.tiles.q_tile),
                 "kv_tile": list(p.tiles.kv_tile), "kv_tiling": p.tiles.kv_tiling, "precision": p.precision,
                 "backend": p.backend}
                for p in applied.plans.values()]
            captured = captured_qkv(model, args, applied)
            q, k, v, mask = captured.q, captured.k, captured.v, captured.mask
            with torch.no_grad():
                if "own" not in attention_ms:
                    attention_ms["own"] = median_ms(lambda: F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask), 5)
                attention_ms[run] = median_ms(lambda: captured.router.attend(q, k, v, mask, None), 5)
            record["attention_calls"] = captured.calls
            del captured, q, k, v, mask
            nd.remove(model)
    record["step_ms"] = step_ms
    compiled_ms = {}
    for run, precision in (("own", None), ("natsim_bf16", None), ("natsim_fp8", "fp8")):
        torch._dynamo.reset()
        if run != "own":
            nd.apply(model, **options, precision=precision, keep_own=False)
        compiled_ms[run], _, record[f"{run}_graph_break"] = compiled_step_ms(model, args, 1 if small else 5)
        if run != "own":
            nd.remove(model)
    record["compiled_step_ms"] = compiled_ms
    record["attention_ms"] = attention_ms
    record["attention_share"] = {run: min(1.0, record["attention_calls"] * attention_ms[run] / step_ms[run])
                                 for run in step_ms}
    record["fp8_vs_bf16"] = compare(latents["natsim_fp8"], latents["natsim_bf16"])
    record["bf16_vs_own"] = compare(latents["natsim_bf16"], latents["own"])
    record["fp8_vs_own"] = compare(latents["natsim_fp8"], latents["own"])
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per run")
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU (a smoke test of the script)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result, path = run_header("fp8", args.out)
    for name in args.cases.split(","):
        record = run_case(name, args.steps, args.small)
        print(json.dumps(record), flush=True)
        result["records"].append(record)
        path.write_text(json.dumps(result, indent=1))
    Console(width=170).print(table(result, path))


def table(result: dict, path: Path) -> Table:
    """The final latents' differences, then per run (own / bf16 / FP8) the step and attention milliseconds and
    the attention share."""
    out = Table(title=f"final latent after {result['records'][0]['steps']} steps on {result['device']} "
                      f"(written to {path})")
    for name in ("case", "fp8 vs bf16", "cosine", "bf16 vs own", "cosine", "fp8 vs own", "cosine",
                 "step ms own/bf16/fp8", "compiled", "attention ms own/bf16/fp8", "share own/bf16/fp8"):
        out.add_column(name, justify="right")
    runs = ("own", "natsim_bf16", "natsim_fp8")
    for r in result["records"]:
        latents = [f"{r[key][field]:{spec}}" for key in ("fp8_vs_bf16", "bf16_vs_own", "fp8_vs_own")
                   for field, spec in (("relative_difference", ".2e"), ("cosine", ".6f"))]
        out.add_row(r["case"], *latents,
                    " / ".join(f"{r['step_ms'][run]:.1f}" for run in runs),
                    " / ".join(f"{r['compiled_step_ms'][run]:.1f}" for run in runs),
                    " / ".join(f"{r['attention_ms'][run]:.2f}" for run in runs),
                    " / ".join(f"{r['attention_share'][run]:.2f}" for run in runs))
    return out


if __name__ == "__main__":
    main()
