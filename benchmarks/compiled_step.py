"""One configuration's compiled denoising step and routed attention call, from the natsim this process imports:

    python benchmarks/compiled_step.py OUT_DIR --case hunyuan-720p --precision fp8 --tag branch

An A/B of two versions of natsim on one GPU runs this once per version and configuration (one configuration a
process: Dynamo compiles as in a fresh process), alternating, in one device call. Builds the case's model of
benchmarks/diffusers_step.py (random weights, nothing downloaded), applies natsim (`keep_own=False`, the case's
options, `--precision`), times the routed attention call on the q, k, v of the first call over the whole layout
(median of 9, eager) and the step compiled as diffusers_step.py compiles it (median of `--steps` after warm-up), and
writes OUT_DIR/compiled-step-<case>-<precision>-<tag>-<gpu>.json with the plan's backend and where natsim was
imported from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusers_step import CASES, build, captured_qkv, compiled_step_ms, inputs, median_ms  # noqa: E402

import natsim  # noqa: E402
from natsim.integrations import diffusers as nd  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--case", default="hunyuan-720p", help=f"one of {', '.join(CASES)}")
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--tag", default="run", help="names the version of natsim in the file name")
    parser.add_argument("--steps", type=int, default=7, help="timed compiled steps (median)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/compiled_step.py times GPU steps: it needs a CUDA GPU.")
    cls_name, config, layout, text, options = CASES[args.case]
    torch.manual_seed(0)
    model = build(cls_name, config)
    model_args = inputs(cls_name, config, layout, text)
    applied = nd.apply(model, **options, precision=None if args.precision == "bf16" else "fp8", keep_own=False)
    captured = captured_qkv(model, model_args, applied)
    with torch.no_grad():
        call_ms = median_ms(lambda: captured.router.attend(captured.q, captured.k, captured.v, captured.mask, None), 9)
    plan = next(iter(applied.plans.values()))
    del captured
    step_ms, _, graph_break = compiled_step_ms(model, model_args, args.steps)
    record = dict(case=args.case, precision=args.precision, tag=args.tag, natsim=str(Path(natsim.__file__).parent),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, backend=plan.backend,
                  call_ms=call_ms, compiled_step_ms=step_ms, graph_break=graph_break)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / (f"compiled-step-{args.case}-{args.precision}-{args.tag}-"
                       f"{record['device'].replace(' ', '_')}.json")
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
