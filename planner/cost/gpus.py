"""Which GPU a device names: the GPU at hand, a torch device, or a GPU with coefficients named by its alias.

A GPU with coefficients can be named (`device="h100"`) without being present, so that a machine without it
plans for it; an alias is the shortest run of the GPU name's words that no other GPU with coefficients has.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .files import gpu_slug, known_gpus


def _words_of(alias: str, gpu: str) -> bool:
    """True when `alias` (slugged) is a run of whole words of `gpu`'s name: 'h100' names 'NVIDIA H100 80GB HBM3'."""
    return bool(alias) and f"-{alias}-" in f"-{gpu_slug(gpu)}-"


def gpu_alias(gpu: str, gpus: Sequence[str]) -> str:
    """The shortest name that picks `gpu` alone among `gpus`: its words from the first one with a digit
    (the model, 'h100'), as many as it takes; else its full name in lower case."""
    words = gpu_slug(gpu).split("-")
    start = next((i for i, word in enumerate(words) if any(c.isdigit() for c in word)), 0)
    for end in range(start + 1, len(words) + 1):
        alias = "-".join(words[start:end])
        if [g for g in gpus if _words_of(alias, g)] == [gpu]:
            return alias
    return gpu_slug(gpu)


def describe_gpus(gpus: Sequence[str], everyone: Optional[Sequence[str]] = None) -> str:
    """'NVIDIA H100 80GB HBM3 (--device h100)' for each GPU, aliases unique among `everyone` (default: `gpus`)."""
    everyone = gpus if everyone is None else everyone
    if not gpus:
        return "none"
    return ", ".join(f"{gpu} (--device {gpu_alias(gpu, everyone)})" for gpu in gpus)


def gpu_named(name: str) -> str:
    """The GPU with coefficients that `name` means: its full name (any case) or a run of its name's words
    that no other such GPU has ('h100' for 'NVIDIA H100 80GB HBM3')."""
    gpus = known_gpus()
    key = gpu_slug(name)
    exact = [gpu for gpu in gpus if gpu_slug(gpu) == key]
    if exact:
        return exact[0]
    matches = [gpu for gpu in gpus if _words_of(key, gpu)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(
            f"device={name!r} matches more than one GPU with cost-model coefficients: "
            f"{describe_gpus(matches, gpus)}; name one of them by its full name or its alias."
        )
    raise ValueError(
        "device must name a torch device like 'cuda:0' or 'cpu', or a GPU with cost-model coefficients "
        f"({describe_gpus(gpus)}), got device={name!r}."
    )


def gpu_of(device: Union[None, str, torch.device]) -> Optional[str]:
    """The name of the GPU that `device` means, or None for no GPU.

    `device` is None (the current CUDA device, if any), a torch device or device string ('cuda:0', 'cpu'),
    or the name or alias of a GPU with cost-model coefficients ('NVIDIA H100 80GB HBM3', 'h100'), which
    need not be present: that is how a machine plans for another GPU.
    """
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        if isinstance(device, str):
            return gpu_named(device)
        raise ValueError(f"device must name a torch device like 'cuda:0' or 'cpu', got {device=}.") from None
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} names a CUDA device, but torch sees no CUDA GPU.")
    return torch.cuda.get_device_name(device)
