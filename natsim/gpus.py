"""GPU names without torch: the Hopper boards users plan for, with the aliases `device=` and `--device` take, and
the GPUs that have cost-model coefficient files here, read from the files alone (what the CLI's help lists, which
would otherwise import the planner, and torch with it, to show a line).

GPUs are known by the name `torch.cuda.get_device_name()` reports, which also names their coefficient file
(`gpu_file_name`). `KNOWN_GPUS` lists the boards with their aliases (`"h100"`, `"h200-nvl"`): an alias
always means the same board, whichever coefficient files are installed. Any other GPU with a coefficient file (one
calibrated here, say an A100) is named by its full name or by a run of its name's words that no other GPU has.
Which GPU a torch device is, and whether a GPU's coefficients load as a cost model, are the planner's questions
(planner/cost/gpus.py, planner/cost/files.py).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .stored import gpu_file_name, gpu_slug, json_files, user_coefficients_dir


@dataclass(frozen=True)
class KnownGpu:
    """A GPU by the name torch reports for it, and the aliases that name it (lower case, words joined by '-')."""

    name: str
    aliases: tuple[str, ...]


# Names as `torch.cuda.get_device_name()` reports them (the same as nvidia-smi's). Boards of one chip differ
# in clocks, power and memory bandwidth, so each has its own coefficients: none borrows another's.
KNOWN_GPUS = (
    KnownGpu("NVIDIA H100 80GB HBM3", ("h100", "h100-sxm", "h100-sxm5")),
    KnownGpu("NVIDIA H100 PCIe", ("h100-pcie",)),
    KnownGpu("NVIDIA H100 NVL", ("h100-nvl",)),
    KnownGpu("NVIDIA H200", ("h200", "h200-sxm")),
    KnownGpu("NVIDIA H200 NVL", ("h200-nvl",)),
    KnownGpu("NVIDIA GH200 480GB", ("gh200", "gh200-480gb")),
    KnownGpu("NVIDIA GH200 144G HBM3e", ("gh200-144g",)),
)


def words_of(alias: str, gpu: str) -> bool:
    """True when `alias` (slugged) is a run of whole words of `gpu`'s name: 'h100-80gb' names
    'NVIDIA H100 80GB HBM3'."""
    return bool(alias) and f"-{alias}-" in f"-{gpu_slug(gpu)}-"


def _known(gpu: str) -> Optional[KnownGpu]:
    """The entry of KNOWN_GPUS for `gpu`'s name (any case and punctuation), or None."""
    key = gpu_slug(gpu)
    return next((entry for entry in KNOWN_GPUS if gpu_slug(entry.name) == key), None)


def alias_owner(alias: str) -> Optional[str]:
    """The known GPU whose alias is `alias` (slugged), or None."""
    return next((entry.name for entry in KNOWN_GPUS if alias in entry.aliases), None)


def gpu_alias(gpu: str, gpus: Sequence[str]) -> str:
    """The alias that `--device` takes for `gpu`: its first alias in KNOWN_GPUS, else the shortest run of its
    name's words from the first one with a digit (the model) that picks it alone among `gpus` and the known
    GPUs, else its full name in lower case."""
    entry = _known(gpu)
    if entry is not None:
        return entry.aliases[0]
    everyone = [*gpus, *(entry.name for entry in KNOWN_GPUS)]
    words = gpu_slug(gpu).split("-")
    start = next((i for i, word in enumerate(words) if any(c.isdigit() for c in word)), 0)
    for end in range(start + 1, len(words) + 1):
        alias = "-".join(words[start:end])
        if {gpu_slug(g) for g in everyone if words_of(alias, g)} == {gpu_slug(gpu)} and not alias_owner(alias):
            return alias
    return gpu_slug(gpu)


def describe_gpus(gpus: Sequence[str], everyone: Optional[Sequence[str]] = None) -> str:
    """'NVIDIA H100 80GB HBM3 (--device h100)' for each GPU, aliases unique among `everyone` (default: `gpus`)."""
    everyone = gpus if everyone is None else everyone
    if not gpus:
        return "none"
    return ", ".join(f"{gpu} (--device {gpu_alias(gpu, everyone)})" for gpu in gpus)


def shipped_coefficients_dir() -> Path:
    """The coefficient files natsim ships (planner/cost/coefficients), found without running the planner's
    package (which imports torch)."""
    spec = importlib.util.find_spec("natsim.planner")
    return Path(next(iter(spec.submodule_search_locations))) / "cost" / "coefficients"


def coefficient_gpus() -> list[str]:
    """The GPUs with a coefficient file here (the user's folder first, then natsim's), by the name each file gives
    for its GPU, where the file is named after it; other files are passed over. The planner's `known_gpus` lists
    the same files where each also loads as a cost model."""
    found: dict[str, str] = {}
    for path in json_files((user_coefficients_dir(), shipped_coefficients_dir())):
        try:
            gpu = json.loads(path.read_text())["gpu"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(gpu, str) and path.name == gpu_file_name(gpu):
            found.setdefault(path.name, gpu)
    return sorted(found.values())
