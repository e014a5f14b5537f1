"""Which GPU a device names: the GPU at hand, a torch device, or a GPU named by its full name or an alias.

GPUs are known by the name `torch.cuda.get_device_name()` reports, which also names their coefficient file
(planner.cost.files). `KNOWN_GPUS` lists the Hopper boards users plan for, each with the aliases `device=` and
`--device` take (`"h100"`, `"h200-nvl"`): an alias always means the same board, whichever coefficient files
are installed. Any other GPU with a coefficient file (one calibrated here, say an A100) is named by its full
name or by a run of its name's words that no other GPU has. A named GPU need not be present: that is how a
machine plans for another GPU. Whether it has coefficients is the planner's question (planner.cost.resolve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .files import gpu_slug, known_gpus


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


def _words_of(alias: str, gpu: str) -> bool:
    """True when `alias` (slugged) is a run of whole words of `gpu`'s name: 'h100-80gb' names
    'NVIDIA H100 80GB HBM3'."""
    return bool(alias) and f"-{alias}-" in f"-{gpu_slug(gpu)}-"


def _known(gpu: str) -> Optional[KnownGpu]:
    """The entry of KNOWN_GPUS for `gpu`'s name (any case and punctuation), or None."""
    key = gpu_slug(gpu)
    return next((entry for entry in KNOWN_GPUS if gpu_slug(entry.name) == key), None)


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
        if {gpu_slug(g) for g in everyone if _words_of(alias, g)} == {gpu_slug(gpu)} and not _alias_owner(alias):
            return alias
    return gpu_slug(gpu)


def _alias_owner(alias: str) -> Optional[str]:
    """The known GPU whose alias is `alias` (slugged), or None."""
    return next((entry.name for entry in KNOWN_GPUS if alias in entry.aliases), None)


def describe_gpus(gpus: Sequence[str], everyone: Optional[Sequence[str]] = None) -> str:
    """'NVIDIA H100 80GB HBM3 (--device h100)' for each GPU, aliases unique among `everyone` (default: `gpus`)."""
    everyone = gpus if everyone is None else everyone
    if not gpus:
        return "none"
    return ", ".join(f"{gpu} (--device {gpu_alias(gpu, everyone)})" for gpu in gpus)


def gpu_named(name: str) -> str:
    """The GPU that `name` means: a known GPU or one with coefficients, by its full name (any case), an alias
    of KNOWN_GPUS ('h100', 'h200-nvl'), or a run of its name's words that no other such GPU has ('h100 80gb')."""
    key = gpu_slug(name)
    calibrated = known_gpus()
    everyone = list(dict.fromkeys([*(entry.name for entry in KNOWN_GPUS), *calibrated]))
    exact = [gpu for gpu in everyone if gpu_slug(gpu) == key]
    if exact:
        return exact[0]
    owner = _alias_owner(key)
    if owner is not None:
        return owner
    matches = [gpu for gpu in everyone if _words_of(key, gpu)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(
            f"device={name!r} matches more than one GPU: {describe_gpus(matches, everyone)}; name one of them by "
            "its full name or its alias."
        )
    raise ValueError(
        "device must name a torch device like 'cuda:0' or 'cpu', a known GPU "
        f"({describe_gpus([entry.name for entry in KNOWN_GPUS], everyone)}) or a GPU with cost-model coefficients "
        f"({describe_gpus(calibrated, everyone)}), got device={name!r}."
    )


def names_a_gpu(device: Union[None, str, torch.device]) -> bool:
    """True when `device` is a GPU's name or alias ('h100'), not a torch device ('cuda:1', 'cpu') or None."""
    if not isinstance(device, str):
        return False
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        return True
    return False


def gpu_of(device: Union[None, str, torch.device]) -> Optional[str]:
    """The name of the GPU that `device` means, or None for no GPU.

    `device` is None (the current CUDA device, if any), a torch device or device string ('cuda:0', 'cpu'),
    or the name or alias of a GPU (`gpu_named`: 'NVIDIA H100 80GB HBM3', 'h100', 'h200'), which need not be
    present: that is how a machine plans for another GPU.
    """
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if names_a_gpu(device):
        return gpu_named(device)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must name a torch device like 'cuda:0' or 'cpu', got {device=}.") from None
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} names a CUDA device, but torch sees no CUDA GPU.")
    return torch.cuda.get_device_name(device)
