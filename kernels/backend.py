"""Where a call runs: Triton on CUDA tensors (or anywhere under TRITON_INTERPRET=1), torch otherwise."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs its kernels in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Run the Triton kernels for `tensor`: it lives on a CUDA device, or the interpreter is on."""
    return tensor.is_cuda or interpreting()
