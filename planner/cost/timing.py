"""Timing one kernel call on a GPU for calibration: the median of enough calls that it means something.

Shared by every calibration set (planner.cost.calibrate, planner.cost.fa4_calibrate).
"""

from __future__ import annotations

from typing import Callable

import torch

MIN_REPEATS = 20


def median_seconds(run: Callable[[], object], device: torch.device, min_repeats: int = MIN_REPEATS) -> float:
    """Median seconds of `run()` on a CUDA `device`, by `triton.testing.do_bench`.

    do_bench times as many calls as fit in its `rep` budget, which for a 100 ms call is one; the budget is
    stretched here to at least `min_repeats` calls so that the median means something (single calls of one
    configuration varied by 10 % on an H100).
    """
    import triton.testing

    run()  # compile, and keep the first call's start-up out of the estimate
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize(device)
    estimate_ms = start.elapsed_time(end)
    budget_ms = max(100.0, 1.25 * min_repeats * estimate_ms)
    return triton.testing.do_bench(run, warmup=max(25.0, 2 * estimate_ms), rep=budget_ms, return_mode="median") * 1e-3
