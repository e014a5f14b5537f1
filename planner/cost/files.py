"""Where each GPU's cost model is stored: one JSON file per GPU, named after the GPU.

A file is named after `torch.cuda.get_device_name()` (`gpu_file_name`). The planner looks in the user's
folder first (`user_coefficients_dir()`, where `natsim calibrate` writes), then in the files shipped with
natsim (planner/cost/coefficients/). Without a file for the GPU at hand there is no cost model, and the
planner ranks by simulated tiles alone.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Optional

from .model import CostModel

COEFFICIENTS_DIR = Path(__file__).resolve().parent / "coefficients"
DATA_DIR_ENV = "NATSIM_DATA_DIR"


def gpu_slug(name: str) -> str:
    """A GPU name in lower case, runs of other characters as '-': 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def gpu_file_name(gpu: str) -> str:
    """The coefficient file of a GPU: its name in lower case, runs of other characters as '-'."""
    return gpu_slug(gpu) + ".json"


def user_coefficients_dir() -> Path:
    """The user's coefficient folder, where `natsim calibrate` writes and the planner looks first:
    `$NATSIM_DATA_DIR/coefficients`, else `$XDG_DATA_HOME/natsim/coefficients`, else
    `~/.local/share/natsim/coefficients`."""
    root = os.environ.get(DATA_DIR_ENV)
    if root:
        return Path(root).expanduser() / "coefficients"
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "natsim" / "coefficients"


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


def link_file_name(gpu: str, world_size: int) -> str:
    """The interconnect file of `world_size` GPUs of a kind on one host (`natsim calibrate-link`)."""
    return f"link-{gpu_slug(gpu)}-x{world_size}.json"


def link_for(gpu: Optional[str], world_size: int, directory: Optional[Path] = None):
    """The calibrated interconnect (natsim.partition.Link) of `world_size` GPUs named `gpu`: from `directory`, else
    the user's folder, else those shipped with natsim; natsim.partition's default link where none was measured."""
    from natsim.partition import DEFAULT_LINK, Link

    if gpu is None:
        return DEFAULT_LINK
    folders = (directory,) if directory is not None else coefficient_dirs()
    path = next((folder / link_file_name(gpu, world_size) for folder in folders
                 if (folder / link_file_name(gpu, world_size)).is_file()), None)
    if path is None:
        return DEFAULT_LINK
    try:
        return Link.from_dict(json.loads(path.read_text()))
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} is not a readable interconnect calibration: {error}") from None
