"""Where each GPU's cost model is stored: one JSON file per GPU, named after the GPU.

A file is named after `torch.cuda.get_device_name()` (`gpu_file_name`). The planner looks in the user's
folder first (`user_coefficients_dir()`, where `natsim calibrate` writes), then in the files shipped with
natsim (planner/cost/coefficients/). Without a file for the GPU at hand there is no cost model, and the
planner ranks by simulated tiles alone. The user's folder, GPU names as file names and the interconnect files
(`link_for`) are natsim.stored's, re-exported here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

from natsim.stored import gpu_slug, link_file_name, link_for, user_coefficients_dir

from .model import CostModel

__all__ = ["COEFFICIENTS_DIR", "gpu_slug", "gpu_file_name", "user_coefficients_dir", "load_stored", "coefficient_dirs",
           "known_gpus", "cost_model_for", "link_file_name", "link_for"]

COEFFICIENTS_DIR = Path(__file__).resolve().parent / "coefficients"


def gpu_file_name(gpu: str) -> str:
    """The coefficient file of a GPU: its name in lower case, runs of other characters as '-'."""
    return gpu_slug(gpu) + ".json"


def load_stored(path: Path) -> CostModel:
    """The cost model in the file at `path`, read once per version of the file (its modification time and size):
    the planner looks its GPU's file up on every call, and lists every file for `device` names and reports."""
    stat = path.stat()
    return _load(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _load(path: Path, modified_ns: int, size: int) -> CostModel:
    return CostModel.load(path)


def coefficient_dirs() -> tuple[Path, Path]:
    """Where the planner looks for a GPU's coefficients, in order: the user's folder, then natsim's own."""
    return (user_coefficients_dir(), COEFFICIENTS_DIR)


def known_gpus() -> list[str]:
    """The GPUs that have cost-model coefficients here (the user's and those shipped with natsim), by name.

    Files that do not load as a cost model, or whose name is not their GPU's file name, are passed over.
    """
    found: dict[str, str] = {}
    for directory in coefficient_dirs():
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            try:
                gpu = load_stored(path).gpu
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if path.name == gpu_file_name(gpu):
                found.setdefault(path.name, gpu)
    return sorted(found.values())


def cost_model_for(gpu: Optional[str], directory: Optional[Path] = None) -> Optional[CostModel]:
    """The stored cost model of `gpu`, or None when there is no GPU or no coefficients for it.

    Looks in `directory` if given, else in the user's folder and then in the coefficients shipped with natsim.
    """
    if gpu is None:
        return None
    for folder in coefficient_dirs() if directory is None else (Path(directory),):
        path = folder / gpu_file_name(gpu)
        if path.is_file():
            return load_stored(path)
    return None
