"""Context-parallel GNA on several GPUs of one host: natsim.distributed's strategies against one GPU, one run.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/distributed.py --out DIR     # GPUs (NCCL)
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/distributed.py --setup wan --out DIR
    torchrun --nproc-per-node 2 benchmarks/distributed.py --setup small --out DIR          # CPU (gloo)

Every rank builds the same full q, k, v (one seed), keeps its frames and runs `natsim.distributed.gna_attention`
with each strategy ("ulysses", "halo", "auto"), and Ulysses again with its heads in each number of groups of
`--chunks` ("ulysses/c1": the all-to-alls not overlapped; the plain "ulysses" is natsim's default grouping);
every rank also runs the single-GPU kernel on the whole layout
on its own GPU, which is the baseline time and the output each rank's frames are checked against. A call's time
is the slowest rank's median wall time (ranks start together after a barrier, CUDA synchronised). Bytes moved
are counted at the collective (everything a rank sends to others) and set beside natsim.partition's prediction.
Frame splits: "even" (15 / 15 for HunyuanVideo) and "aligned" (split on a stride-group boundary along frames,
16 / 14 for stride 16). Rank 0 prints the table last and writes JSON (device, versions, date) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import natsim
import natsim.distributed as nd
from natsim import Problem
from natsim.distributed import gna as distributed_gna
from natsim.distributed import collectives
from natsim.kernels import gna_attention
from natsim.partition import STRATEGIES, aligned_split, even_split, heads_per_rank, offsets, strategy_cost
from natsim.stored import link_for

# name, shape, window, stride (the HunyuanVideo layout: 30 x 48 x 80 tokens, 24 heads of 128, bf16)
FULL = dict(shape=(30, 48, 80), heads=24, head_dim=128, dtype=torch.bfloat16, repeats=10, configs=[
    ("dense", (30, 48, 80), (1, 1, 1)),
    ("w18x24x24 s1x1x1", (18, 24, 24), (1, 1, 1)),
    ("w18x24x24 s16x8x8", (18, 24, 24), (16, 8, 8)),
])
# the layout of Wan 720p with 40 heads of 128 (the context-parallel table of docs/performance.md)
WAN = dict(shape=(21, 45, 80), heads=40, head_dim=128, dtype=torch.bfloat16, repeats=10, configs=[
    ("w7x21x35 s1x1x1", (7, 21, 35), (1, 1, 1)),
    ("w7x21x35 s1x7x7", (7, 21, 35), (1, 7, 7)),
    ("w9x15x40 s3x15x8", (9, 15, 40), (3, 15, 8)),
])
# float32 runs the torch reference on CPUs; on GPUs the small layout runs the kernel in bf16
SMALL = dict(shape=(8, 8, 16), heads=4, head_dim=32, dtype=torch.float32, repeats=3, configs=[
    ("dense", (8, 8, 16), (1, 1, 1)),
    ("w5x4x4 s1x1x1", (5, 4, 4), (1, 1, 1)),
    ("w5x4x4 s4x2x2", (5, 4, 4), (4, 2, 2)),
])


def wall_ms(fn, repeats: int, device: torch.device) -> float:
    """Median wall milliseconds of `fn` on this rank, ranks started together; the slowest rank's is returned."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    mine = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class ByteCounter:
    """Counts the bytes this rank hands to torch.distributed for other ranks (natsim.distributed's all-to-all
    `start_exchange` and point-to-point `send_receive`)."""

    def __init__(self, rank: int):
        self.rank, self.bytes = rank, 0
        self.start_exchange, self.send_receive = collectives.start_exchange, collectives.send_receive
        collectives.start_exchange, collectives.send_receive = self.counted_exchange, self.counted_send_receive

    def counted_exchange(self, send, shapes, group, **options):
        self.bytes += sum(t.numel() * t.element_size() for j, t in enumerate(send) if j != self.rank)
        return self.start_exchange(send, shapes, group, **options)

    def counted_send_receive(self, sends, receives, group):
        self.bytes += sum(t.numel() * t.element_size() for t, _ in sends)
        return self.send_receive(sends, receives, group)


def run_case(name, window, stride, split_name, setup, q, k, v, single_out, single_ms, rank, world, device,
             counter, chunk_counts: tuple[int, ...]) -> dict:
    shape, heads, head_dim = setup["shape"], setup["heads"], setup["head_dim"]
    problem = Problem(shape, window, stride)
    split = even_split(shape[0], world) if split_name == "even" else aligned_split(problem, world)
    t = offsets(split)
    mine = slice(t[rank], t[rank + 1])
    ql, kl, vl = (x[:, mine].contiguous() for x in (q, k, v))
    tiles = distributed_gna.strategy_tiles(problem, head_dim)
    link = link_for(torch.cuda.get_device_name(device) if device.type == "cuda" else None, world)
    auto = nd.choose(problem, tiles, split, 1, heads, head_dim, q.element_size(), link=link)  # what "auto" runs
    record = dict(config=name, window=list(window), stride=list(stride), split=list(split), auto_choice=auto,
                  single_gpu_ms=single_ms, strategies={})
    grouped = [f"ulysses/c{c}" for c in chunk_counts if c <= heads_per_rank(heads, world)]
    for label in (*STRATEGIES, "auto", *grouped):
        strategy, _, chunks = label.partition("/c")

        def call():
            return nd.gna_attention(ql, kl, vl, window, stride, strategy=strategy, split=split,
                                    chunks=int(chunks) if chunks else None)

        out = call()
        error = torch.tensor([rel(out, single_out[:, mine])], dtype=torch.float64, device=device)
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        counter.bytes = 0
        call()
        sent = torch.tensor([counter.bytes], dtype=torch.float64, device=device)
        dist.all_reduce(sent)
        ms = wall_ms(call, setup["repeats"], device)
        entry = dict(ms=ms, speedup_over_1gpu=single_ms / ms, max_rel_error_vs_1gpu=float(error.item()),
                     bytes_moved=int(sent.item()))
        if strategy != "auto":
            cost = strategy_cost(problem, getattr(tiles, strategy), split, strategy, batch=1, heads=heads,
                                 head_dim=head_dim, element_bytes=q.element_size(), link=link,
                                 chunks=int(chunks) if chunks else None)
            entry.update(predicted_bytes_moved=cost.bytes_moved, predicted_s=cost.seconds,
                         predicted_imbalance=cost.imbalance,
                         ranks=[r.to_dict() for r in cost.ranks])
        record["strategies"][label] = entry
    measured = {s: record["strategies"][s]["ms"] for s in STRATEGIES}
    record["faster_measured"] = min(measured, key=measured.get)
    record["auto_picked_faster"] = auto == record["faster_measured"]
    record["best_speedup_over_1gpu"] = single_ms / min(measured.values())
    record["halo_over_ulysses_bytes"] = (record["strategies"]["halo"]["bytes_moved"]
                                         / record["strategies"]["ulysses"]["bytes_moved"])
    return record


def targets(records: list) -> dict:
    """The context-parallel targets (docs/performance.md), from the block-sparse stride-16x8x8 records (best split) and every record's auto."""
    sparse = [r for r in records if r["stride"][0] == 16] or records
    return {"best_speedup_over_1gpu_16x8x8": max(r["best_speedup_over_1gpu"] for r in sparse),
            "target_speedup": 1.8,
            "min_halo_over_ulysses_bytes_16x8x8": min((r["halo_over_ulysses_bytes"] for r in sparse
                                                       if r["halo_over_ulysses_bytes"] is not None), default=None),
            "target_bytes_ratio": 1 / 3,
            "auto_picked_faster_everywhere": all(r["auto_picked_faster"] for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON (rank 0 writes it)")
    parser.add_argument("--setup", choices=("hunyuan", "wan", "small"), default="hunyuan",
                        help="hunyuan: 30x48x80, 24 heads; wan: 21x45x80, 40 heads; small: a tiny layout (CPU with "
                             "gloo, or a quick GPU check)")
    parser.add_argument("--splits", default="even,aligned", help="comma-separated: even, aligned")
    parser.add_argument("--chunks", default="1,2,3,5",
                        help="comma-separated group counts Ulysses is also timed with (each at most heads / ranks)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    setup = dict(hunyuan=FULL, wan=WAN, small=SMALL)[args.setup]
    if cuda:
        setup = {**setup, "dtype": torch.bfloat16}
    counter = ByteCounter(rank)
    torch.manual_seed(0)
    shape, heads, head_dim, dtype = setup["shape"], setup["heads"], setup["head_dim"], setup["dtype"]
    q, k, v = (torch.randn(1, *shape, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    records = []
    for name, window, stride in setup["configs"]:
        single_out = gna_attention(q, k, v, window, stride)
        single_ms = wall_ms(lambda: gna_attention(q, k, v, window, stride), setup["repeats"], device)
        problem, seen = Problem(shape, window, stride), set()
        for split_name in args.splits.split(","):
            split = even_split(shape[0], world) if split_name == "even" else aligned_split(problem, world)
            if split in seen:
                continue
            seen.add(split)
            records.append(run_case(name, window, stride, split_name, setup, q, k, v, single_out, single_ms, rank,
                                    world, device, counter, tuple(int(c) for c in args.chunks.split(","))))
            if rank == 0:
                print(json.dumps({key: records[-1][key] for key in ("config", "split", "auto_choice",
                                                                     "faster_measured")}), flush=True)
    if rank == 0:
        write(args.out, records, setup, world, device, cuda, args.setup)
    dist.destroy_process_group()


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def write(out: Path, records: list, setup: dict, world: int, device: torch.device, cuda: bool, name_of: str) -> None:
    import triton

    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    result = dict(benchmark="distributed", device=name, world_size=world, backend="nccl" if cuda else "gloo",
                  torch=torch.__version__, triton=triton.__version__, natsim=natsim.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  shape=list(setup["shape"]), heads=setup["heads"], head_dim=setup["head_dim"],
                  dtype=str(setup["dtype"]).replace("torch.", ""), targets=targets(records), records=records,
                  high_priority_transfers=cuda and collectives.high_priority_transfers())
    out.mkdir(parents=True, exist_ok=True)
    slug = name.replace(" ", "_").replace("/", "_")
    prefix = "" if name_of == "hunyuan" else f"{name_of}-"
    path = out / f"distributed-{prefix}{slug}-x{world}-{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=2))
    header = (f"{'config':<20} {'split':<8} {'1 GPU ms':>9} {'strategy':<14} {'ms':>9} {'speedup':>8} "
              f"{'MB moved':>9} {'pred MB':>9} {'rel err':>8}")
    print(f"\n{name}, {world} ranks ({result['backend']}), torch {torch.__version__}, triton {triton.__version__}")
    print(header)
    for r in records:
        for strategy, e in r["strategies"].items():
            label = strategy + (f"->{r['auto_choice']}" if strategy == "auto" else "")
            predicted = f"{e['predicted_bytes_moved'] / 1e6:9.1f}" if "predicted_bytes_moved" in e else f"{'':>9}"
            print(f"{r['config']:<20} {'/'.join(map(str, r['split'])):<8} {r['single_gpu_ms']:9.2f} {label:<14} "
                  f"{e['ms']:9.2f} {e['speedup_over_1gpu']:7.2f}x {e['bytes_moved'] / 1e6:9.1f} {predicted} "
                  f"{e['max_rel_error_vs_1gpu']:8.1e}")
        print(f"{'':<20} auto picked {r['auto_choice']}, faster measured {r['faster_measured']}; halo / ulysses "
              f"bytes {_ratio(r['halo_over_ulysses_bytes'])}")
    goal = result["targets"]
    print(f"targets: best speedup at stride 16x8x8 {goal['best_speedup_over_1gpu_16x8x8']:.2f}x (>= 1.8), halo / "
          f"ulysses bytes {_ratio(goal['min_halo_over_ulysses_bytes_16x8x8'])} (<= 0.33), auto picked the faster "
          f"strategy everywhere: {goal['auto_picked_faster_everywhere']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
