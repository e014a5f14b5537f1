"""Launching on the tensors' own GPU. Triton and FlashAttention-4 launch on the current CUDA device and its
current stream, while torch's operators follow their tensors: q, k and v on `cuda:1` while `cuda:0` is current
(a pipeline moved with `.to("cuda:1")`, a model spread over GPUs) would be attended by kernels on the other GPU,
unordered with the work of their own stream. Every launcher makes its tensors' device current for the launch, as
torch's own operators do."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, TypeVar

import torch

Launcher = TypeVar("Launcher", bound=Callable)


def current_device_of(tensor: torch.Tensor) -> ContextManager:
    """A context in which `tensor`'s CUDA device is the current one: nothing to do for a CPU tensor, one on the
    current device, or inside a graph being compiled (its operators run through launchers, which do this)."""
    if tensor.is_cuda and not torch.compiler.is_compiling() and tensor.get_device() != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def on_their_device(launcher: Launcher) -> Launcher:
    """`launcher` run in `current_device_of` its first CUDA tensor argument."""

    @functools.wraps(launcher)
    def launch(*arguments, **keywords):
        tensor = next((a for a in (*arguments, *keywords.values()) if isinstance(a, torch.Tensor) and a.is_cuda),
                      None)
        if tensor is None:
            return launcher(*arguments, **keywords)
        with current_device_of(tensor):
            return launcher(*arguments, **keywords)

    return launch  # type: ignore[return-value]
