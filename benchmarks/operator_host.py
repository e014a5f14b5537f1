"""The host's time to issue one resolved GNA call through natsim's operator with its autograd layer
(`natsim::gna_resolved`) and through its twin without it (`natsim::gna_resolved_inference`, what AutoPlan calls
where no gradient is needed), beside torch's SDPA; the calls of planner.cost.host (a tiny dense call on natsim's
Triton kernel, bf16), under torch.no_grad as a diffusion step runs, in interleaved rounds:

    python benchmarks/operator_host.py --out DIR [--rounds 7]

Prints each operator's median microseconds a call with its rounds; writes `operator-host-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch

from natsim.kernels import gna_resolved
from natsim.planner.cost import host
from timing import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per operator (median)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("host times are measured on a CUDA GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    twin = host.tiny_call("triton", dtype, device)  # registers the resolver the other call reuses
    q, k, v = (torch.randn(1, host.TOKENS, host.HEADS, host.HEAD_DIM, device=device, dtype=dtype) for _ in range(3))
    resolver = host._resolver_ids["triton"]
    calls = {"natsim::gna_resolved": lambda: gna_resolved(q, k, v, resolver, None, True),
             "natsim::gna_resolved_inference": twin,
             "sdpa": host.tiny_call(host.OWN_ATTENTION, dtype, device)}
    rounds = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, call in calls.items():
                rounds[name].append(host.issue_seconds(call, device) * 1e6)
    name = torch.cuda.get_device_name()
    result = dict(device=name, torch=torch.__version__, date=str(datetime.date.today()), calls=host.CALLS,
                  operators={op: dict(median_us=statistics.median(us), rounds_us=us) for op, us in rounds.items()})
    for op, us in rounds.items():
        print(f"{op:32s} median {statistics.median(us):6.1f} us a call; rounds {[round(x, 1) for x in us]}")
    write_json(args.out, f"operator-host-{name}-{result['date']}", result)


if __name__ == "__main__":
    main()
