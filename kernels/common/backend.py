"""Where a call runs: Triton on CUDA tensors (or anywhere under TRITON_INTERPRET=1), torch otherwise; and how
the public entry points (gna_attention, sparse_attention) decide between their eager fast path and their
registered operator."""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .fp8 import FLOAT8_DTYPES


def interpreting() -> bool:
    """True when Triton runs its kernels in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Run the Triton kernels for `tensor`: it lives on a CUDA device, or the interpreter is on."""
    return tensor.is_cuda or interpreting()


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Inside an autocast region, floating inputs of another dtype are cast to the region's dtype; float8 inputs
    stay as they are (they come with their scales, kernels/common/fp8.py)."""
    device = q.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, *FLOAT8_DTYPES) else t
                   for t in (q, k, v))
    return q, k, v


Reference = TypeVar("Reference", bound=Callable)


def outside_autocast(reference: Reference) -> Reference:
    """A torch reference that computes in the dtypes it chooses (float32 or float64 products over the inputs'
    dtype): autocast, which would cast its products to the region's dtype (and fail its float32 buffers), is
    off while it runs. The entry points cast the inputs first (`autocast_inputs`), as for the kernels."""

    @functools.wraps(reference)
    def run(*args, **kwargs):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))  # q's (or a mask's) device
        with torch.autocast(device, enabled=False):
            return reference(*args, **kwargs)

    return run  # type: ignore[return-value]


def runs_eagerly(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """A plain eager call that needs no operator: plain tensors, no dispatch mode, no gradient to track, not
    under torch.compile; the entry point then calls its implementation without PyTorch's dispatcher."""
    return (
        type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and _get_current_dispatch_mode() is None
        and (q.is_cuda or q.is_cpu)
    )


def refuse_untracked(name: str, *tensors: torch.Tensor) -> None:
    """Entry points that launch Triton directly (no operator, no autograd formula) refuse what they would get
    silently wrong: inputs that require grad under grad mode (the output would carry no gradient), and
    torch.compile (Dynamo would trace into the launch). `name` is the entry point, for the sentence."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{name} launches a Triton kernel with no backward pass, and its input requires grad: the output "
            "would silently carry no gradient. Call it under torch.no_grad(), or use gna_attention, whose torch "
            "reference on CPU tensors is differentiable."
        )
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{name} is an eager entry point (tuning, benchmarks, debugging), not a registered operator: under "
            "torch.compile call gna_attention or sparse_attention instead."
        )
