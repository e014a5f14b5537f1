"""The interconnect measured on the machine at hand: how fast the ranks of a process group make the moves the
strategies make (natsim.partition.Link).

`calibrate_link` times, on every rank together, the two moves of natsim.distributed at a few sizes: Ulysses'
all-to-all (`collectives.start_heads_chunk` of a `[1, tokens, heads, head_dim]` slab for all of a rank's heads,
waited for: each rank keeps `1 / P` of it and exchanges the rest) and the halo exchange's point-to-point sends
(each rank sends its slab to the next rank and receives the previous one's, both directions at once, as
neighbouring ranks do). Each size's time is the median over repeats of the slowest rank (all ranks start together
after a barrier), and a rank's bytes are the larger of what it sends and receives, as natsim.partition prices
them. Per move a least-squares line
`seconds = latency + bytes / rate` through those points gives its `Rate` (the latency kept at 0 or more).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from natsim.kernels import pack_head_blocks
from natsim.partition import Link, Rate

from .collectives import send_receive, start_heads_chunk, transfer_group, whole_sequence, world

SIZES_MB = (4, 16, 64, 256)  # bytes a rank holds per move, in MiB


def calibrate_link(group=None, device: Optional[torch.device] = None, sizes_mb: Sequence[float] = SIZES_MB,
                   repeats: int = 5, source: str = "") -> Link:
    """Measure the interconnect of `group`'s ranks (module docstring): every rank calls it, with the same
    arguments, and gets the same `Link`. `device`: where the moved tensors live (the current CUDA device where
    there is one, else the CPU, for gloo)."""
    size, rank = world(group)
    if size < 2:
        raise ValueError("calibrate_link measures moves between ranks: it needs a process group of two or more.")
    if repeats < 1 or not sizes_mb or min(sizes_mb) <= 0:
        raise ValueError(f"repeats must be >= 1 and sizes_mb positive sizes, got repeats={repeats}, "
                         f"sizes_mb={tuple(sizes_mb)}.")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what gloo moves on CPUs
    heads, head_dim, element = size, 64, dtype.itemsize  # one head per rank
    moves = transfer_group(group)  # the group the strategies' moves run on
    all_to_all, point_to_point = [], []
    for mb in sizes_mb:
        tokens = max(1, int(mb * 2**20) // (heads * head_dim * element))
        slab = torch.randn(1, tokens, heads, head_dim, device=device).to(dtype)
        moved = slab.numel() * element * (size - 1) // size  # sent, and received, by every rank
        split = (tokens,) * size
        whole = (0, heads // size)  # one group: every head a rank holds

        def ulysses():
            whole_sequence(start_heads_chunk(pack_head_blocks((slab,), size, whole), split, moves)[0])

        all_to_all.append((moved, _slowest(ulysses, repeats, device, group)))
        received = torch.empty_like(slab)
        after, before = (rank + 1) % size, (rank - 1) % size

        def neighbours():
            send_receive([(slab, after)], [(received, before)], moves)

        point_to_point.append((slab.numel() * element, _slowest(neighbours, repeats, device, group)))
    where = source or f"{size} ranks, {device.type}, measured by natsim.distributed.calibrate_link"
    return Link(fit_rate(all_to_all), fit_rate(point_to_point), where)


def fit_rate(points: Sequence[tuple[int, float]]) -> Rate:
    """`seconds = latency + bytes / rate` through (bytes, seconds) points by least squares; a negative latency
    (noise at small sizes) is refitted as a line through the origin. A slope of zero or less (times that do not
    grow with bytes) is refused: the sizes are too small to measure a rate."""
    moved = np.array([float(b) for b, _ in points])
    seconds = np.array([float(s) for _, s in points])
    if len(points) >= 2 and np.ptp(moved) > 0:
        slope, latency = np.polyfit(moved, seconds, 1)
        if latency < 0:
            slope, latency = float(moved @ seconds / (moved @ moved)), 0.0
    else:
        slope, latency = float(seconds.sum() / moved.sum()), 0.0
    if not slope > 0:
        raise ValueError(f"the measured times do not grow with the bytes moved ({list(points)}): measure larger "
                         "sizes.")
    return Rate(1.0 / slope, float(latency))


def _slowest(move: Callable[[], object], repeats: int, device: torch.device, group) -> float:
    """The median over `repeats` of the slowest rank's seconds for `move`, after one warm-up call."""
    move()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        move()
        _synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(float(elapsed.item()))
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
