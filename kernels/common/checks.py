"""Tensor checks every kernel family's public boundary shares, with NATTEN-style sentence errors, and what the
Triton kernels can run (dtypes, head dims)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .headdim import HEAD_DIMS

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
BACKENDS = ("triton", "fa4", "gluon")  # what a call may name: natsim's Triton kernels, FlashAttention-4, natsim's
# Gluon FP8 kernel (kernels/backends/)
KERNEL_HEAD_DIMS = HEAD_DIMS  # 16 to 256 in steps of 8, computed in power-of-two column chunks (headdim.py)


def check_tensors(q: object, k: object, v: object) -> None:
    """q, k and v are torch tensors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")


def check_interpretable(q: torch.Tensor) -> None:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, the only way natsim's kernels take CPU tensors) loads, stores
    and multiplies bfloat16 wrongly (Triton 3.9: a stored value comes back as another, a 16 x 16 product off by
    1e10), so bfloat16 CPU tensors are refused there rather than answered wrongly."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError(
            "Triton's CPU interpreter (TRITON_INTERPRET=1) computes bfloat16 wrongly, so natsim's kernels do not "
            "take bfloat16 CPU tensors there: run bfloat16 on a GPU, pass float16 tensors to the interpreter, or "
            "unset TRITON_INTERPRET to run the torch reference."
        )


def check_matching(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k and v share one dtype and one device."""
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            "q, k and v must share dtype and device, got "
            f"dtypes ({q.dtype}, {k.dtype}, {v.dtype}), devices ({q.device}, {k.device}, {v.device})."
        )


def check_head_dim(q: torch.Tensor) -> None:
    """q's last dimension (head_dim) holds at least one channel."""
    if q.shape[-1] < 1:
        raise ValueError(f"q, k and v need a head_dim of at least 1, got q.shape={tuple(q.shape)}.")


def check_backend(backend: object) -> None:
    """`backend` is one of BACKENDS or None (natsim chooses)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be 'triton', 'fa4', 'gluon' or None (natsim chooses), got backend={backend!r}.")


def check_scale(scale: object) -> Optional[float]:
    """The score scale as a float: None (natsim takes head_dim ** -0.5) or a positive finite number. The kernels'
    online softmax takes the row maximum of the unscaled scores, which is the scaled scores' only for a positive
    scale: a zero, negative or non-finite one is refused rather than answered with NaN."""
    if scale is None:
        return None
    try:
        value = float(scale)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(scale, (bool, str, bytes)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a positive finite number (None: head_dim ** -0.5), got scale={scale!r}.")
    return value
