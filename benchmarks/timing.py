"""Timing and comparison helpers shared by the GPU benchmark scripts (imported as a sibling module)."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Callable, Hashable, Iterable

import torch
import triton


def bench(fn: Callable, min_calls: int = 10, min_rep_ms: float = 200.0) -> float:
    """Median milliseconds of `fn` after warm-up, over at least `min_calls` timed calls: do_bench's time
    budget is stretched for slow calls, which it would otherwise time once or twice."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - start) * 1e3
    return float(triton.testing.do_bench(fn, warmup=max(25, 2 * once_ms), rep=max(min_rep_ms, min_calls * once_ms),
                                         return_mode="median"))


def write_json(out: Path, stem: str, record: dict) -> Path:
    """`record` as `<stem>.json` in the folder `out` (made if missing, spaces in the stem as underscores), its
    path printed."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem.replace(' ', '_')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return path


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference ||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def interleaved(timers: dict[Hashable, Callable], rounds: int, min_ms: float,
                sync: Callable[[], None], seed: int = 0) -> dict[Hashable, list[float]]:
    """Milliseconds per call of each of `timers` (already warmed up), one figure per round: every round runs
    each timer once, in an order shuffled per round (seeded), `calls` back-to-back calls between two `sync()`s
    (wall clock, so host work counts), `calls` set once per timer from one timed call to last at least `min_ms`.
    Interleaving puts clock and thermal drift on every timer alike, and the shuffle keeps a timer from always
    following the same neighbour, whose load can leave the clocks higher or lower (H100, a fixed order: two
    identical kernels 12% apart, benchmarks/results/training-*-2026-11-25-fused.json); report the median over
    rounds."""
    calls = {}
    for key, fn in timers.items():
        sync()
        start = time.perf_counter()
        fn()
        sync()
        once_ms = (time.perf_counter() - start) * 1e3
        calls[key] = max(1, math.ceil(min_ms / max(once_ms, 1e-3)))
    per_round: dict[Hashable, list[float]] = {key: [] for key in timers}
    order = list(timers)
    shuffle = random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        for key in order:
            fn = timers[key]
            sync()
            start = time.perf_counter()
            for _ in range(calls[key]):
                fn()
            sync()
            per_round[key].append((time.perf_counter() - start) * 1e3 / calls[key])
    return per_round


# Kinds of GPU kernel by what their names hold (lower case), first match wins; the rest are "other".
KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("regroup", ("_regroup_kernel",)),
    ("attention", ("gna_", "attention", "flash", "fmha", "sdpa")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "matmul")),
)


def _union_us(spans: list[tuple[float, float]]) -> float:
    """The time covered by at least one of `spans`."""
    covered, reached = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return covered


def kernel_breakdown(kernels: Iterable[tuple[str, float, float]]) -> dict[str, float]:
    """Where a GPU's time went, from `(name, start_us, end_us)` per kernel (a profiler's kernel events):
    milliseconds summed per kind (`KERNEL_KINDS`, else "other"; kernels on different streams overlap, so the
    kinds may add up to more than the wall time); "busy": the time at least one kernel ran (their union), which
    against the wall time says how long the GPU waited; and "nccl_alone": the part of it in which only NCCL's
    kernels ran, the transfers no computation hid (an NCCL kernel waiting for its peer counts as running)."""
    totals = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    spans, computing = [], []
    for name, start, end in kernels:
        lowered = name.lower()
        kind = next((kind for kind, keys in KERNEL_KINDS if any(key in lowered for key in keys)), "other")
        totals[kind] += (end - start) / 1e3
        spans.append((start, end))
        if kind != "nccl":
            computing.append((start, end))
    busy = _union_us(spans)
    return {**totals, "busy": busy / 1e3, "nccl_alone": (busy - _union_us(computing)) / 1e3}


def heaviest_kernels(kernels: Iterable[tuple[str, float, float]], count: int = 25) -> list[tuple[str, int, float]]:
    """The `count` kernel names with the most GPU time, from `(name, start_us, end_us)` per kernel: `(name,
    launches, milliseconds)`, heaviest first; what a comparison of two profiles (one GPU against P) lines up."""
    launches: dict[str, int] = {}
    total: dict[str, float] = {}
    for name, start, end in kernels:
        launches[name] = launches.get(name, 0) + 1
        total[name] = total.get(name, 0.0) + (end - start) / 1e3
    return sorted(((name, launches[name], total[name]) for name in total), key=lambda row: -row[2])[:count]
