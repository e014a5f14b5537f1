"""Which cost model a planning call uses: the one passed (a `CostModel` or its file), or the stored one of the GPU
that `device` means, or none.

The rules, the same for `best`, `best_mask`, `AutoPlan` and the command line:

- `cost_model=` (a CostModel, or the path of a file `natsim calibrate` wrote; `--coefficients` on the command
  line) is used as given; a `device=` that names another GPU as well is refused (which one was meant?).
- `device=` naming a GPU ('h100', 'NVIDIA H200') asks for that GPU's coefficients: without a file for it
  (planner.cost.files) the call is refused with the command that makes one, since a plan "for an H200"
  ranked without H200 coefficients would not be one.
- `device=None` or a torch device ('cuda:1', 'cpu') means the GPU at hand: without coefficients for it (or
  without a GPU) the planner ranks by simulated tile work and its plan says so, so that a model runs on
  any GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch

from .files import cost_model_for, gpu_file_name, known_gpus, user_coefficients_dir
from .gpus import describe_gpus, gpu_of, names_a_gpu
from .model import CostModel

CostModelLike = Union[CostModel, str, os.PathLike]
DeviceLike = Union[None, str, torch.device]


def load_cost_model(cost_model: CostModelLike) -> CostModel:
    """`cost_model` as a CostModel: itself, or the model in the file it names (sentence errors otherwise)."""
    if isinstance(cost_model, CostModel):
        return cost_model
    if not isinstance(cost_model, (str, os.PathLike)):
        raise TypeError("cost_model must be a natsim.planner.CostModel or the path of a coefficients file, got "
                        f"{type(cost_model).__name__}.")
    path = Path(cost_model)
    if not path.is_file():
        raise ValueError(f"cost_model={str(path)!r} names no file: it takes a CostModel or the path of a coefficients "
                         "file (a GPU's stored coefficients are asked for with device=, e.g. device='h100').")
    try:
        return CostModel.load(path)
    except (OSError, KeyError, ValueError, TypeError) as error:
        raise ValueError(f"cost_model={str(path)!r} is not a readable cost model: {error}") from None


def missing_coefficients(gpu: str, device: str) -> str:
    """The sentence refusing `device` (naming `gpu`) for want of coefficients, with how to make them."""
    return (
        f"device={device!r} names {gpu}, which has no cost-model coefficients here (those shipped with natsim and "
        f"those in {user_coefficients_dir()}; GPUs with coefficients: {describe_gpus(known_gpus())}); run "
        f"`natsim calibrate --kernels gna,sparse,backward` on that GPU, which writes {gpu_file_name(gpu)} there, "
        "or pass a coefficients file (cost_model=, --coefficients), or leave device out to rank by simulated "
        "tile work."
    )


def resolve_cost_model(device: DeviceLike,
                       cost_model: Optional[CostModelLike]) -> tuple[Optional[str], Optional[CostModel]]:
    """`(gpu, cost model)` for a planning call's `device` and `cost_model` (module docstring: the rules)."""
    if cost_model is not None:
        model = load_cost_model(cost_model)
        if names_a_gpu(device):
            named = gpu_of(device)
            if named != model.gpu:
                raise ValueError(f"device={device!r} names {named}, but cost_model was fitted on {model.gpu}: pass "
                                 "one of them.")
        return model.gpu, model
    gpu = gpu_of(device)
    model = cost_model_for(gpu)
    if model is None and names_a_gpu(device):
        raise ValueError(missing_coefficients(gpu, device))
    return gpu, model

