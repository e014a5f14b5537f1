"""A whole denoising run of a diffusers video transformer with content-adaptive masks against its own attention,
one run, one JSON:

    python benchmarks/diffusers_masks.py --out DIR [--case wan-720p] [--steps 50] [--eager]
    python benchmarks/diffusers_masks.py --out DIR --backends "triton;triton,gluon"   # one masked run per set
    python benchmarks/diffusers_masks.py --out /tmp/x --small --steps 4      # CPU smoke test, seconds

The model of benchmarks/diffusers_step.py's case (random weights, bf16, batch 1) runs a plain Euler
flow-matching loop over `steps` timesteps from the same noise and text, first with the model's own attention,
then with `natsim.integrations.diffusers.apply(model, masks=Masks(steps))` (DFSAttn's setup: dense warm-up
quarter, hierarchical predictor at 64-token blocks, the cache's shrinking budget), both under
`compile_repeated_blocks(fullgraph=True)` (or eagerly with `--eager`). Each step is timed (synchronised wall
clock; the first step of each run, which compiles, is reported apart). Figures: the run's total and speedup,
the mean dense (warm-up) step against the model's own, the first sparse step (prediction and planning on the
critical path) against a dense one, the mean later sparse step, the planning time, and the relative
difference of the final latent to the model's own run. With `--backends`, the masked run is repeated once per set
of kernel backends its mask plans may run on (`Masks(backends=...)`; sets separated by ";", names by ","; "all"
for every backend available here), in the same process after the one run with the model's own attention, and
each record names its plans' backends. The first set's first sparse step also pays the process's first planning
(numba's compiles of the mask counting) and the sparse kernels' first compiles, which later sets reuse: compare the
sets' later sparse steps, or run the baseline set first. The JSON is written after every set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

import diffusers_step as step_bench
from timing import write_json
from natsim.integrations import diffusers as nd


def run(model, args: dict, steps: int) -> tuple[list[float], torch.Tensor]:
    """Per-step milliseconds of an Euler loop over `steps` timesteps, and the final latent."""
    latent = args["hidden_states"].clone()
    times = []
    with torch.no_grad():
        for i in range(steps):
            timestep = 1000.0 * (1 - i / steps)
            call = dict(args, hidden_states=latent,
                        timestep=torch.full_like(args["timestep"], timestep, dtype=args["timestep"].dtype))
            start = time.perf_counter()
            velocity = model(**call)[0]
            step_bench.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            latent = latent - velocity.to(latent.dtype) / steps
    return times, latent


def profile_step(model, args: dict, steps: int, top: int = 15) -> list[dict]:
    """Device milliseconds per kernel name over one step at the end of the run (a sparse step that reuses the
    cached masks), most first."""
    from torch.profiler import ProfilerActivity, profile

    call = dict(args, timestep=torch.full_like(args["timestep"], 1000.0 / steps, dtype=args["timestep"].dtype))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(**call)
        step_bench.synchronize()
    rows = [dict(name=e.key[:100], device_ms=e.device_time_total / 1e3, calls=e.count)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["device_ms"])
    for r in rows[:top]:
        print(f"{r['device_ms']:9.2f} ms {r['calls']:5d}  {r['name']}")
    return rows[:top]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--case", default="wan-720p", help="a case of benchmarks/diffusers_step.py")
    parser.add_argument("--steps", type=int, default=50, help="denoising steps of the run")
    parser.add_argument("--eager", action="store_true", help="run eagerly instead of compiling the blocks")
    parser.add_argument("--small", action="store_true", help="a tiny model on the CPU (a smoke test of the script)")
    parser.add_argument("--backends", default="all",
                        help="sets of backends the mask plans may run on, ';' between sets, ',' between names "
                             "('all': every one available here), one masked run each")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one more sparse step (torch.profiler): device time per kernel")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    cls_name, config, layout, text, _ = (step_bench.small_case(options.case) if options.small
                                          else step_bench.CASES[options.case])
    torch.manual_seed(0)
    model = step_bench.build(cls_name, config)
    args = step_bench.inputs(cls_name, config, layout, text)
    if not options.eager:
        model.compile_repeated_blocks(fullgraph=True, **({} if step_bench.DEVICE == "cuda" else
                                                         {"backend": "eager"}))
    every_masks = [nd.Masks(steps=options.steps, block=16 if options.small else 64, backends=backends)
                   for backends in parse_backend_sets(options.backends)]
    check_runs_here(every_masks)
    own_times, own_latent = run(model, args, options.steps)
    records = []
    for masks in every_masks:
        applied = nd.apply(model, masks=masks, dtype=torch.float16 if options.small else None)
        masked_times, masked_latent = run(model, args, options.steps)
        record = masked_record(options, cls_name, layout, masks, applied, own_times, own_latent, masked_times,
                               masked_latent)
        if options.profile:
            record["profile"] = profile_step(model, args, options.steps)
        nd.remove(model)
        records.append(record)
        write(options, records)
    for record in records:
        print(json.dumps({k: v for k, v in record.items() if not k.endswith("step_ms")}))
        print(f"\n{options.case} {options.steps} steps ({record['compiled']}), backends {record['backends']}: own "
              f"{record['own_total_s']:.1f} s, masks {record['masked_total_s']:.1f} s, {record['speedup']:.2f}x; "
              f"dense step {record['masked_dense_mean_step_ms']} vs own {record['own_mean_step_ms']:.0f} ms; first "
              f"sparse step {record['first_sparse_step_ms']:.0f} ms ({record['first_sparse_over_dense']:.2f} of a "
              f"dense one); later sparse {record['later_sparse_mean_step_ms']} ms; planning "
              f"{record['plan_seconds']:.2f} s; plans on {sorted({p['backend'] for p in record['plans']})}; final "
              f"latent differs by {record['final_latent_relative_difference']:.3f}")


def write(options, records: list) -> None:
    """The records so far as `diffusers-masks-<case>-<device>-<date>.json` under --out (written after every set,
    so that a set that fails keeps the earlier ones)."""
    import diffusers
    import triton

    device = torch.cuda.get_device_name() if step_bench.DEVICE == "cuda" else "cpu"
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, diffusers=diffusers.__version__,
                  date=datetime.date.today().isoformat(), records=records)
    write_json(options.out, f"diffusers-masks-{options.case}-{device}-{result['date']}", result)


def check_runs_here(every_masks: list) -> None:
    """Each set's backends run here and the cost model prices them (the planner's sentence otherwise), before
    anything runs."""
    from natsim.planner.backends import backend_choice
    from natsim.planner.cost.resolve import resolve_cost_model

    gpu, model = resolve_cost_model(None, None)
    for masks in every_masks:
        backend_choice(masks.backends, device=None, model=model, training=False, gpu=gpu, fp8=False)


def parse_backend_sets(text: str) -> list:
    """--backends as a list of sets: None for 'all', else a tuple of names (the planner checks them)."""
    sets = [part.strip() for part in text.split(";") if part.strip()]
    return [None if part == "all" else tuple(name.strip() for name in part.split(",")) for part in sets] or [None]


def masked_record(options, cls_name: str, layout, masks, applied, own_times: list, own_latent: torch.Tensor,
                  masked_times: list, masked_latent: torch.Tensor) -> dict:
    """One masked run's figures against the model's own run (module docstring)."""
    dense_steps = sum(applied.masked.cache.is_dense(i) for i in range(options.steps))
    first_sparse = masked_times[dense_steps]
    later_sparse = masked_times[dense_steps + 1:]
    own_mean = statistics.mean(own_times[1:])
    record = dict(
        case=options.case, model=cls_name, layout=list(layout), steps=options.steps,
        backends="all" if masks.backends is None else list(masks.backends),
        compiled="eager" if options.eager else "repeated blocks", masks={k: (list(v) if isinstance(v, tuple) else v)
                                                                          for k, v in vars(masks).items()},
        own_step_ms=own_times, masked_step_ms=masked_times,
        own_total_s=sum(own_times[1:]) / 1e3, masked_total_s=sum(masked_times[1:]) / 1e3,
        dense_steps=dense_steps, own_mean_step_ms=own_mean,
        masked_dense_mean_step_ms=statistics.mean(masked_times[1:dense_steps]) if dense_steps > 1 else None,
        first_sparse_step_ms=first_sparse, first_sparse_over_dense=first_sparse / own_mean,
        later_sparse_mean_step_ms=statistics.mean(later_sparse) if later_sparse else None,
        plan_seconds=sum(applied.masked.stats.plan_seconds.values()),
        predictions=applied.masked.stats.predictions, dense_calls=applied.masked.stats.dense_calls,
        calls=applied.masked.stats.calls,
        plans=[dict(q_block=p.q_block, kv_block=p.kv_block, merge=p.merge, backend=p.backend,
                    predicted_speedup=p.predicted_speedup, backends=list(p.backends),
                    best_by_backend={c.backend: c.to_dict() for c in reversed(p.candidates)})
               for p in applied.plans.values()],
        final_latent_relative_difference=float((masked_latent.float() - own_latent.float()).norm()
                                               / own_latent.float().norm()),
    )
    record["speedup"] = record["own_total_s"] / record["masked_total_s"]
    return record


if __name__ == "__main__":
    main()
