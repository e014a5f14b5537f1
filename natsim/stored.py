"""Where natsim keeps what it measured on a machine, by GPU name: the user's data folder (`natsim calibrate` and
`natsim calibrate-link` write there) and the files natsim ships. The interconnect files live here, below the
rooms that read them: natsim.distributed prices its `"auto"` strategy with the link of the GPUs at hand, and the
planner its `world_size` plans, from one lookup (`link_for`). The planner keeps its cost-model files
(planner/cost/files.py) beside the user's in the same folder.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Iterable, Optional

from .partition import DEFAULT_LINK, Link

LINKS_DIR = Path(__file__).resolve().parent / "links"
DATA_DIR_ENV = "NATSIM_DATA_DIR"


def gpu_slug(name: str) -> str:
    """A GPU name in lower case, runs of other characters as '-': 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def gpu_file_name(gpu: str) -> str:
    """The coefficient file of a GPU: its name in lower case, runs of other characters as '-'."""
    return gpu_slug(gpu) + ".json"


def json_files(folders: Iterable[Path]) -> list[Path]:
    """The JSON files of `folders`, folder by folder, each sorted (a folder that does not exist has none)."""
    return [path for folder in folders if folder.is_dir() for path in sorted(folder.glob("*.json"))]


def user_coefficients_dir() -> Path:
    """The user's folder of measurements, where `natsim calibrate` and `natsim calibrate-link` write and natsim
    looks first: `$NATSIM_DATA_DIR/coefficients`, else `$XDG_DATA_HOME/natsim/coefficients`, else
    `~/.local/share/natsim/coefficients`."""
    root = os.environ.get(DATA_DIR_ENV)
    if root:
        return Path(root).expanduser() / "coefficients"
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "natsim" / "coefficients"


def link_file_name(gpu: str, world_size: int) -> str:
    """The interconnect file of `world_size` GPUs of a kind on one host (`natsim calibrate-link`)."""
    return f"link-{gpu_slug(gpu)}-x{world_size}.json"


def link_for(gpu: Optional[str], world_size: int, directory: Optional[Path] = None) -> Link:
    """The calibrated interconnect of `world_size` GPUs named `gpu`: from `directory`, else the user's folder, else
    those shipped with natsim; natsim.partition's default link where none was measured (or `gpu` is None)."""
    if gpu is None:
        return DEFAULT_LINK
    name = link_file_name(gpu, world_size)
    folders = (directory,) if directory is not None else (user_coefficients_dir(), LINKS_DIR)
    path = next((folder / name for folder in folders if (folder / name).is_file()), None)
    if path is None:
        return DEFAULT_LINK
    stat = path.stat()
    return _load_link(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _load_link(path: Path, modified_ns: int, size: int) -> Link:
    """The link in the file at `path`, read once per version of the file: natsim.distributed's `"auto"` looks it
    up on every eager call."""
    try:
        return Link.from_dict(json.loads(path.read_text()))
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} is not a readable interconnect calibration: {error}") from None
