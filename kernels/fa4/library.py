"""FlashAttention-4 as an optional dependency: whether it is installed here, in the version natsim is built
against, on a GPU it runs on, and the one sentence that says why not.

natsim calls `flash_attn.cute.interface`'s forward and backward functions (`_flash_attn_fwd`,
`_flash_attn_bwd`) rather than its autograd wrapper, so that natsim's own registered operators own autograd,
torch.compile and CUDA graphs; those functions are not public API, hence the pinned version (`pip install
'natsim[fa4]'`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from types import ModuleType
from typing import Optional

import torch

DISTRIBUTION = "flash-attn-4"
VERSION = "4.0.0b36"
INSTALL = "pip install 'natsim[fa4]'"
# Compute capabilities whose FlashAttention-4 kernels natsim has checked: Hopper (sm_90).
CAPABILITIES = ((9, 0),)


@functools.lru_cache(maxsize=1)
def installed() -> Optional[str]:
    """None when FlashAttention-4 of the pinned version imports here, else why not (a sentence)."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"FlashAttention-4 is not installed ({INSTALL})."
    if version != VERSION:
        return (f"natsim runs FlashAttention-4 {VERSION}, but {DISTRIBUTION} {version} is installed "
                f"({INSTALL} installs the version natsim is built against).")
    try:
        importlib.import_module("flash_attn.cute.interface")
    except Exception as error:  # a broken CUDA toolchain raises anything from its import
        return f"FlashAttention-4 is installed but does not import: {type(error).__name__}: {error}."
    return None


def unavailable(device: torch.device) -> Optional[str]:
    """None when FlashAttention-4 runs on `device`, else why not (a sentence)."""
    if device.type != "cuda":
        return f"FlashAttention-4 runs on CUDA GPUs, got tensors on {device}."
    capability = torch.cuda.get_device_capability(device)
    if capability not in CAPABILITIES:
        return (f"natsim runs FlashAttention-4 on Hopper GPUs (compute capability 9.0), the ones it has been checked "
                f"on, got {torch.cuda.get_device_name(device)} ({capability[0]}.{capability[1]}).")
    return installed()


def interface() -> ModuleType:
    """`flash_attn.cute.interface`, after `installed()` said yes."""
    reason = installed()
    if reason is not None:
        raise RuntimeError(reason)
    return importlib.import_module("flash_attn.cute.interface")


def block_sparse_type():
    """FlashAttention-4's `BlockSparseTensorsTorch` (the lists' container)."""
    return importlib.import_module("flash_attn.cute.block_sparsity").BlockSparseTensorsTorch
