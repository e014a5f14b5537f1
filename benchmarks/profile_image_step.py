"""The compiled step of image cases of benchmarks/diffusers_step.py with natsim, profiled: eager and compiled
medians, the host's enqueue time of one compiled step (no synchronisation), torch.profiler's kernels by GPU time
and operators by CPU time; then the model's own compiled step and its enqueue time.

    python benchmarks/profile_image_step.py sd3-1024,pixart-sigma-1024
"""
import sys, time, os
sys.path.insert(0, "benchmarks")
import torch
import diffusers_step as ds
from natsim.integrations import diffusers as nd
from torch.profiler import profile, ProfilerActivity

for name in sys.argv[1].split(","):
    cls_name, config, layout, text, options = ds.CASES[name]
    torch.manual_seed(0)
    model = ds.build(cls_name, config)
    args = ds.inputs(cls_name, config, layout, text)
    applied = nd.apply(model, **options, keep_own=False)
    with torch.no_grad():
        model(**args)
    plan = next(iter(applied.plans.values()))
    print(name, "plan", plan.problem.window, plan.problem.stride, plan.tiles.q_tile, plan.tiles.kv_tile, plan.backend, flush=True)
    eager = ds.median_ms(lambda: model(**args), 5)
    cm = ds.compile_step(model)
    with torch.no_grad():
        comp = ds.median_ms(lambda: cm(**args), 5)
        # host time of one compiled step (no sync)
        torch.cuda.synchronize(); t = time.perf_counter(); cm(**args); host = (time.perf_counter() - t) * 1e3; torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            cm(**args); torch.cuda.synchronize()
    print(f"{name}: eager {eager:.2f} ms compiled {comp:.2f} ms host-enqueue {host:.2f} ms", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
    nd.remove(model)
    cm2 = ds.compile_step(model)
    with torch.no_grad():
        own = ds.median_ms(lambda: cm2(**args), 5)
        torch.cuda.synchronize(); t = time.perf_counter(); cm2(**args); host = (time.perf_counter() - t) * 1e3; torch.cuda.synchronize()
    print(f"{name}: own compiled {own:.2f} ms host-enqueue {host:.2f}", flush=True)
    del model, cm, cm2; torch._dynamo.reset(); torch.cuda.empty_cache()
