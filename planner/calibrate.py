"""Calibration: time a fixed set of GNA configurations on the GPU at hand and fit the cost model to them.

The set (`calibration_cases`) spans what the features separate: masked-heavy (stride 1), block-sparse and
dense configurations, 1-D, 2-D and 3-D layouts, the catalog's three tile sizes, head_dim 64 and 128, and
very sparse ones where per-program work shows. Every case has the 24 heads of the video and image DiTs
natsim is for, so that each call keeps the GPU busy for a millisecond or more: the cost model predicts GPU
work, and a call shorter than the Python and launch overhead on the host (0.4 to 0.8 ms per call on the
H100 machine, varying from run to run) takes the host's time instead, max(host, GPU) rather than a sum.
Such host-bound measurements (under HOST_BOUND_S) are left out of the fit; a faster GPU may produce some.
Features come from the simulator (CPU); times from `time_case` (permutation included, as plans run it);
the fit is `planner.fit.fit_coefficients`, a pure function tested on CPU against known coefficients.
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from natsim import Problem, TileConfig, simulate

from natsim.kernels.gna_launch import has_tensor_descriptors, permutes

from .catalog import as_dtype, dtype_name, element_bytes
from .costmodel import CostModel, gpu_file_name, gpu_of, user_coefficients_dir
from .features import FEATURES, features_of
from .fit import fit_coefficients, relative_errors

# Tile shapes per number of dimensions, one per (Q tokens, KV tokens) pair of the catalog.
TILES = {
    1: (((128,), (128,)), ((128,), (64,)), ((64,), (64,))),
    2: (((16, 8), (16, 8)), ((16, 8), (8, 8)), ((8, 8), (8, 8))),
    3: (((2, 8, 8), (2, 8, 8)), ((4, 8, 4), (2, 8, 4)), ((1, 8, 8), (1, 8, 8))),
}

HEADS = 24
HOST_BOUND_S = 1e-3

# (shape, window, stride, causal, head dims)
LAYOUTS = (
    ((30, 48, 80), (18, 24, 24), (1, 1, 1), False, (128,)),
    ((30, 48, 80), (18, 24, 24), (16, 8, 8), False, (64, 128)),
    ((30, 48, 80), (30, 48, 80), (1, 1, 1), False, (128,)),
    ((16, 44, 80), (8, 20, 40), (1, 4, 8), True, (128,)),
    ((30, 48, 80), (2, 8, 8), (2, 8, 8), False, (64,)),
    ((256, 256), (80, 80), (1, 1), False, (128,)),
    ((256, 256), (80, 80), (16, 16), False, (64, 128)),
    ((32768,), (2048,), (1,), False, (64, 128)),
    ((32768,), (2048,), (256,), False, (128,)),
    ((32768,), (128,), (128,), False, (128,)),
    ((32768,), (32768,), (1,), True, (128,)),
)

# Configurations of the kind the planner picks, on layouts the planner benchmark does not use: tiles that
# are long along one dimension, 64-token KV tiles in 3-D, and masked (not block-sparse) ones with large
# strides, where the fixed grid above says little; the last three are masked calls whose tiles are nearly all
# full (windows close to the layout along a stride-1 dimension), which separate the masked kernel's cost for
# full tiles from the mask-free kernel's. (shape, window, stride, q_tile, kv_tile); head_dim 128.
PLANNER_LIKE = (
    ((24, 40, 64), (18, 28, 40), (2, 16, 1), (2, 16, 4), (2, 16, 4)),
    ((24, 40, 64), (18, 28, 40), (1, 1, 1), (1, 16, 8), (1, 16, 8)),
    ((24, 40, 64), (21, 24, 48), (1, 8, 16), (1, 8, 16), (1, 8, 16)),
    ((20, 36, 72), (12, 22, 48), (4, 2, 16), (4, 2, 8), (4, 2, 8)),
    ((20, 36, 72), (12, 22, 48), (1, 2, 4), (4, 2, 8), (4, 2, 8)),
    ((16, 40, 64), (8, 21, 32), (8, 1, 32), (8, 1, 16), (8, 1, 8)),
    ((16, 40, 64), (8, 21, 32), (8, 2, 32), (4, 2, 16), (4, 1, 16)),
    ((16, 40, 64), (8, 21, 32), (2, 1, 2), (8, 1, 16), (8, 1, 16)),
    ((128, 192), (64, 74), (64, 2), (64, 2), (32, 2)),
    ((192, 160), (128, 92), (4, 4), (32, 4), (16, 4)),
    ((32, 32, 48), (24, 16, 40), (8, 16, 1), (8, 4, 4), (8, 4, 4)),
    ((20, 40, 80), (16, 24, 72), (2, 24, 1), (2, 8, 8), (2, 8, 8)),
    ((256, 192), (160, 184), (32, 1), (32, 4), (32, 4)),
)


# Dilated configurations: the only calls that still permute tokens on GPUs with tensor descriptors, so the
# only ones that show the permutation's cost. (shape, window, stride, dilation, q_tile, kv_tile); head_dim 128.
DILATED = (
    ((30, 48, 80), (9, 12, 12), (1, 4, 4), (1, 2, 2), (2, 8, 8), (2, 8, 8)),
    ((256, 256), (40, 40), (1, 1), (2, 2), (16, 8), (16, 8)),
    ((16, 44, 80), (8, 11, 20), (8, 1, 4), (2, 4, 4), (2, 4, 16), (2, 4, 16)),
)


@dataclass(frozen=True)
class Case:
    """One configuration to time: a GNA problem, its tiles, and the tensor sizes (batch 1)."""

    problem: Problem
    tiles: TileConfig
    heads: int
    head_dim: int


def calibration_cases() -> list[Case]:
    """The configurations `natsim calibrate` times (a few dozen; minutes on an H100, most of it compiling)."""
    cases = []
    for shape, window, stride, causal, head_dims in LAYOUTS:
        problem = Problem(shape, window, stride, causal=causal)
        for head_dim in head_dims:
            for q_tile, kv_tile in TILES[len(shape)]:
                cases.append(Case(problem, TileConfig(q_tile, kv_tile), HEADS, head_dim))
    for shape, window, stride, q_tile, kv_tile in PLANNER_LIKE:
        cases.append(Case(Problem(shape, window, stride), TileConfig(q_tile, kv_tile), HEADS, 128))
    for shape, window, stride, dilation, q_tile, kv_tile in DILATED:
        cases.append(Case(Problem(shape, window, stride, dilation), TileConfig(q_tile, kv_tile), HEADS, 128))
    return cases


def case_features(cases: Sequence[Case], dtype: torch.dtype, descriptors: bool = True) -> np.ndarray:
    """The feature matrix of `cases` (rows in order), from the simulator. `descriptors`: the GPU has tensor
    descriptors, so only dilated calls permute tokens (natsim.kernels.gna_launch.permutes)."""
    size = element_bytes(dtype)
    return np.stack(
        [
            features_of(simulate(c.problem, c.tiles), batch_heads=c.heads, head_dim=c.head_dim, element_bytes=size,
                        permutation=permutes(c.problem, descriptors))
            for c in cases
        ]
    )


MIN_REPEATS = 20


def time_case(case: Case, dtype: torch.dtype, device: torch.device, min_repeats: int = MIN_REPEATS) -> float:
    """Median seconds of one `gna_attention` call for `case` (random inputs) on a CUDA `device`.

    `triton.testing.do_bench` times as many calls as fit in its `rep` budget, which for a 100 ms call is
    one; the budget is stretched here to at least `min_repeats` calls so that the median means something
    (single calls of one configuration varied by 10 % on an H100).
    """
    import triton.testing

    from natsim.kernels import gna_attention

    p = case.problem
    q, k, v = (
        torch.randn((1, *p.shape, case.heads, case.head_dim), device=device, dtype=dtype) for _ in range(3)
    )

    def run():
        return gna_attention(
            q, k, v, p.window, p.stride, p.dilation, p.causal, q_tile=case.tiles.q_tile, kv_tile=case.tiles.kv_tile
        )

    run()  # compile, and keep the first call's start-up out of the estimate
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize(device)
    estimate_ms = start.elapsed_time(end)
    budget_ms = max(100.0, 1.25 * min_repeats * estimate_ms)
    return triton.testing.do_bench(run, warmup=max(25.0, 2 * estimate_ms), rep=budget_ms, return_mode="median") * 1e-3


@dataclass(frozen=True)
class Calibration:
    """A fitted cost model with the measurements behind it.

    `fitted[i]` says whether case i entered the fit (False: host-bound, under HOST_BOUND_S); `errors` are
    (predicted - measured) / measured for every case.
    """

    model: CostModel
    cases: tuple[Case, ...]
    features: np.ndarray
    times: np.ndarray
    errors: np.ndarray
    fitted: np.ndarray


def calibrate(
    device: Union[None, str, torch.device] = None,
    dtype: Union[torch.dtype, str] = torch.bfloat16,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Calibration:
    """Time `calibration_cases()` with natsim.kernels on a CUDA GPU and fit the cost model to them."""
    dtype = as_dtype(dtype)
    gpu = gpu_of(device)
    if gpu is None:
        raise ValueError(
            f"calibration times the Triton kernels on a CUDA GPU, got device={device!r} "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()})."
        )
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    cases = calibration_cases()
    features = case_features(cases, dtype, has_tensor_descriptors(device))
    times = []
    for i, case in enumerate(cases):
        times.append(time_case(case, dtype, device))
        if progress is not None:
            progress(i + 1, len(cases))
    times = np.array(times)
    fitted = times >= HOST_BOUND_S
    if fitted.sum() < len(FEATURES):
        raise ValueError(
            f"only {fitted.sum()} of {len(cases)} calibration cases kept this GPU busy for {HOST_BOUND_S * 1e3:g} ms "
            f"or more; the cost model needs at least {len(FEATURES)} that are not host-bound."
        )
    coefficients = fit_coefficients(features[fitted], times[fitted])
    errors = relative_errors(features, times, coefficients)
    import triton

    model = CostModel(
        gpu=gpu,
        coefficients=coefficients,
        info={
            "date": datetime.date.today().isoformat(),
            "dtype": dtype_name(dtype),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "cases": int(fitted.sum()),
            "host_bound_cases_left_out": int((~fitted).sum()),
            "median_abs_relative_error": float(np.median(np.abs(errors[fitted]))),
            "max_abs_relative_error": float(np.max(np.abs(errors[fitted]))),
        },
    )
    return Calibration(model, tuple(cases), features, times, errors, fitted)


def default_path(gpu: str) -> Path:
    """Where `natsim calibrate` writes `gpu`'s coefficients unless told otherwise: the user's coefficient
    folder (costmodel.user_coefficients_dir), where the planner looks before natsim's shipped files."""
    return user_coefficients_dir() / gpu_file_name(gpu)
