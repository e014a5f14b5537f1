"""Timing one kernel call on a GPU for calibration: the median of enough calls that it means something.

Shared by every calibration set (planner.cost.calibrate, fa4_calibrate, gluon_calibrate), with their cases' random
block masks.
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


def random_block_mask(seq_len: int, q_block: int, kv_block: int, heads: int, sparsity: float,
                      seed: int) -> torch.Tensor:
    """A calibration case's block mask `[1, heads, ceil(N / q_block), ceil(N / kv_block)]` on the CPU: each block
    kept with probability `1 - sparsity`, a mask per head, the same for the same `seed`."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, heads, -(-seq_len // q_block), -(-seq_len // kv_block))
    return torch.rand(shape, generator=generator) >= sparsity
