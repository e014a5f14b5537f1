"""Where one routed attention call of a diffusers model spends its GPU time, bf16 against FP8, kernel by kernel.

    python benchmarks/profile_joint_call.py OUT_DIR [--case hunyuan-720p]

Builds the case's model of benchmarks/diffusers_step.py with one block of each kind (random weights, nothing
downloaded), applies natsim in bf16 and then with `precision="fp8"` (`keep_own=False`), captures the first routed
call over the whole layout (for joint attention: the video and text tokens together) and, per precision, times it
(median of 5, eager) and profiles three calls with `torch.profiler`: the heaviest kernels by GPU time per call,
which separate the attention kernel from what surrounds it (the text part's dense calls and their LSE merge, the
tile-order copies, FP8's quantization and its statistics). Writes OUT_DIR/profile-joint-call-<case>-<gpu>.json and
prints the lists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusers_step import CASES, build, captured_qkv, inputs, median_ms  # noqa: E402
from timing import heaviest_kernels  # noqa: E402

from natsim.integrations import diffusers as nd  # noqa: E402

CALLS = 3  # profiled calls per precision


def profiled(call) -> list[tuple[str, int, float]]:
    """`(kernel name, launches, milliseconds)` per call of `call`, heaviest first, over `CALLS` calls."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(name, launches // CALLS, ms / CALLS) for name, launches, ms in heaviest_kernels(kernels, 20)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--case", default="hunyuan-720p", help=f"one of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/profile_joint_call.py profiles GPU kernels: it needs a CUDA GPU.")
    cls_name, config, layout, text, options = CASES[args.case]
    config = {key: min(value, 1) if "layers" in key else value for key, value in config.items()}
    torch.manual_seed(0)
    model = build(cls_name, config)
    model_args = inputs(cls_name, config, layout, text)
    record = dict(case=args.case, device=torch.cuda.get_device_name(), torch=torch.__version__, runs={})
    for run, precision in (("bf16", None), ("fp8", "fp8")):
        applied = nd.apply(model, **options, precision=precision, keep_own=False)
        captured = captured_qkv(model, model_args, applied)
        call = lambda: captured.router.attend(captured.q, captured.k, captured.v, captured.mask, None)  # noqa: E731
        with torch.no_grad():
            ms = median_ms(call, 5)
            kernels = profiled(call)
        plan = next(iter(applied.plans.values()))
        record["runs"][run] = dict(ms=ms, q_shape=list(captured.q.shape), backend=plan.backend,
                                   kernels=[dict(name=name, launches=n, ms=t) for name, n, t in kernels])
        print(f"{run}: {ms:.2f} ms a call on {plan.backend}, q {tuple(captured.q.shape)}")
        for name, n, t in kernels:
            print(f"  {t:8.3f} ms  x{n:<3d} {name[:100]}")
        del captured
        nd.remove(model)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile-joint-call-{args.case}-{record['device'].replace(' ', '_')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
