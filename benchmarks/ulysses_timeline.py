"""natsim.distributed's Ulysses in groups of heads on the Wan 720p plan: one call's time per number of even groups
and in the default groups (`natsim.partition.head_groups`), and the GPU timeline of one call in the default groups on
rank 0 (which kernel ran when, on any stream), to see what overlaps:

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/ulysses_timeline.py --out DIR [--heads 12]
    TORCH_NCCL_HIGH_PRIORITY=1 NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/ulysses_timeline.py --out DIR

The layout 21x45x80 (Wan 720p), bf16, head_dim 128, natsim's plan for Wan 1.3B at 0.9 (window 10x23x32, stride
1x8x16, tiles 1x8x16, dynamic KV tiling); frames split as evenly as they go. Times: the slowest rank's median of
15 synchronised calls; "attention alone": the single-GPU kernel on one rank's heads of the whole layout. Rank 0
prints a JSON line and the timeline (start ms from the call's first kernel, duration ms, kernel) and writes
`ulysses-timeline-<device>-x<P>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import natsim.distributed as nd
from natsim.kernels import gna_attention
from natsim.partition import head_groups
from timing import write_json
from wan_ulysses import HEAD_DIM, PLAN, SHAPE, rank_shards


def slowest_median_ms(fn, repeats: int = 15) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    mine = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def timeline(call) -> list[dict]:
    """The GPU kernels of the second of two calls, in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):  # the same kernels each call: the second half of the list is the second call
            call()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    second = kernels[len(kernels) // 2:]
    first = second[0].time_range.start
    return [dict(start_ms=(e.time_range.start - first) / 1e3, ms=e.time_range.elapsed_us() / 1e3, kernel=e.name)
            for e in second]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heads", type=int, default=12)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    split, (q, k, v) = rank_shards(args.heads, rank, world)
    whole = torch.randn(1, *SHAPE, args.heads // world, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    record = dict(world=world, heads=args.heads, split=list(split), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, high_priority=os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "0"),
                  date=str(datetime.date.today()),
                  attention_alone_ms=slowest_median_ms(lambda: gna_attention(whole, whole, whole, **PLAN)))
    per_rank = args.heads // world
    for chunks in sorted({1, 2, 3, per_rank} & set(range(1, per_rank + 1))):
        record[f"groups_{chunks}_ms"] = slowest_median_ms(
            lambda: nd.gna_attention(q, k, v, strategy="ulysses", split=split, chunks=chunks, **PLAN))
    record["default_groups_ms"] = slowest_median_ms(
        lambda: nd.gna_attention(q, k, v, strategy="ulysses", split=split, **PLAN))
    record["timeline_groups"] = list(head_groups(per_rank))
    record["timeline"] = timeline(lambda: nd.gna_attention(q, k, v, strategy="ulysses", split=split, **PLAN))
    dist.destroy_process_group()
    if rank:
        return
    print(json.dumps({key: value for key, value in record.items() if key != "timeline"}))
    for event in record["timeline"]:
        print(f"{event['start_ms']:8.3f} {event['ms']:7.3f} ms  {event['kernel'][:70]}")
    write_json(args.out, f"ulysses-timeline-{record['device']}-x{world}-{record['date']}", record)


if __name__ == "__main__":
    main()
