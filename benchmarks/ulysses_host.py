"""Is natsim.distributed's Ulysses call bound by the host? On Wan 1.3B's 720p plan (12 heads of 128, bf16, three
groups), the synchronised call time, the host's time to enqueue it, and the call's GPU-bound time (behind a sleep
kernel that keeps the GPU busy while the host enqueues), with the host's time for a group's packing and for
issuing its three exchanges:

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/ulysses_host.py --out DIR [--tag TAG]

Times: medians of 15 calls on each rank after two warm-up calls, each started after a barrier; rank 0's figures
(the slowest rank's for the synchronised call). Writes `ulysses-host-<device>-x<P>-<date><tag>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import natsim.distributed as nd
from natsim.distributed.collectives import start_heads_chunk, transfer_group, whole_sequence
from natsim.kernels import gna_attention, pack_head_blocks
from timing import write_json
from wan_ulysses import HEAD_DIM, PLAN, SHAPE, rank_shards

HEADS = 12
SLEEP_CYCLES = 30_000_000  # about 15 ms on an H200: longer than any host enqueue measured here


def measure(fn: Callable[[], object], sleep_first: bool = False, repeats: int = 15) -> tuple[float, float]:
    """(median ms from the call's start to the GPU's end, median ms the host spent in `fn`); with `sleep_first`
    a sleep kernel is enqueued before `fn`, so the first figure is the sleep plus `fn`'s GPU-bound time."""
    fn()
    fn()
    total, host = [], []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if sleep_first:
            torch.cuda._sleep(SLEEP_CYCLES)
        enqueue = time.perf_counter()
        fn()
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        total.append((time.perf_counter() - start) * 1e3)
        host.append((enqueued - enqueue) * 1e3)
    return statistics.median(total), statistics.median(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="", help="appended to the file name")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    split, (q, k, v) = rank_shards(HEADS, rank, world)

    def call():
        return nd.gna_attention(q, k, v, strategy="ulysses", split=split, chunks=3, **PLAN)

    sleep_ms, _ = measure(lambda: None, sleep_first=True)
    call_ms, call_host_ms = measure(call)
    behind_sleep_ms, _ = measure(call, sleep_first=True)
    slowest = torch.tensor([call_ms], device="cuda", dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    span, moves = (0, HEADS // world // 3), transfer_group(None)
    packed = pack_head_blocks((q, k, v), world, span)
    whole = torch.randn(1, *SHAPE, span[1], HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    record = dict(world=world, heads=HEADS, split=list(split), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, date=str(datetime.date.today()), call_ms=float(slowest.item()),
                  call_host_ms=call_host_ms, call_gpu_bound_ms=behind_sleep_ms - sleep_ms,
                  group_packing_host_ms=measure(lambda: pack_head_blocks((q, k, v), world, span))[1],
                  group_exchanges_host_ms=measure(
                      lambda: [whole_sequence(p) for p in start_heads_chunk(packed, split, moves)])[1],
                  group_attention_ms=measure(lambda: gna_attention(whole, whole, whole, **PLAN))[0])
    dist.destroy_process_group()
    if rank:
        return
    print(json.dumps(record))
    write_json(args.out, f"ulysses-host-{record['device']}-x{world}-{record['date']}{args.tag}", record)


if __name__ == "__main__":
    main()
