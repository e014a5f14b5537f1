"""Which GPU a device names: the GPU at hand, a torch device, or a GPU named by its full name or an alias.

The names, `KNOWN_GPUS` and their aliases are natsim.gpus' (torch-free, re-exported here). A named GPU need not be
present: that is how a machine plans for another GPU. Whether it has coefficients is the planner's question
(planner.cost.resolve).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from natsim.gpus import KNOWN_GPUS, KnownGpu, alias_owner, describe_gpus, gpu_alias, words_of

from .files import gpu_slug, known_gpus

__all__ = ["KNOWN_GPUS", "KnownGpu", "describe_gpus", "gpu_alias", "gpu_named", "names_a_gpu", "gpu_of"]


def gpu_named(name: str) -> str:
    """The GPU that `name` means: a known GPU or one with coefficients, by its full name (any case), an alias
    of KNOWN_GPUS ('h100', 'h200-nvl'), or a run of its name's words that no other such GPU has ('h100 80gb')."""
    key = gpu_slug(name)
    calibrated = known_gpus()
    everyone = list(dict.fromkeys([*(entry.name for entry in KNOWN_GPUS), *calibrated]))
    exact = [gpu for gpu in everyone if gpu_slug(gpu) == key]
    if exact:
        return exact[0]
    owner = alias_owner(key)
    if owner is not None:
        return owner
    matches = [gpu for gpu in everyone if words_of(key, gpu)]
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
