"""Timing and comparison helpers shared by the GPU benchmark scripts (imported as a sibling module)."""

from __future__ import annotations

import time
from typing import Callable

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


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference ||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
