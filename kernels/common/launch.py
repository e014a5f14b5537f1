"""Launching the Triton kernels: launch options (`LaunchOptions`) that fit in shared memory and a caller's checked
overrides of them, whether a device and a tensor can use tensor descriptors (Hopper's bulk tensor copies), and the
scratch allocator that in-kernel descriptors need.

Tensor descriptors can be turned off for the whole process: `NATSIM_NO_TMA=1` in the environment when natsim is
imported, or `set_tensor_descriptors(False)` at run time. Every kernel then takes the path a GPU without them
(Ampere, Ada) takes: GNA on permuted tokens, pointer loads everywhere. That is how a Hopper GPU runs those paths
(tests/test_portable_paths_gpu.py), and how a user rules descriptors out when debugging.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace
from typing import Mapping, Optional

import torch
import triton

from .backend import interpreting
from .fp8 import fp8_launch_config
from .headdim import HeadSplit, head_split

try:  # where Triton keeps the allocator of in-kernel tensor descriptors
    from triton.runtime._allocation import NullAllocator, _allocator
except ImportError:  # pragma: no cover - layout of triton's internals changed
    NullAllocator = _allocator = None

SHARED_MEMORY_BUDGET = 227 * 1024  # bytes: what one H100 thread block may use


@dataclass(frozen=True)
class LaunchOptions:
    """How a Triton kernel launches: Triton's own `num_warps` and `num_stages`, and the launch switches that the
    kernels take as constexprs of the same names. `MASKED` compiles the masked loop (tiles that can hold
    partial pairs need it), `USE_TMA` loads through tensor descriptors, `WARP_SPECIALIZE` warp-specializes the
    unmasked loop (Hopper), `HEAD_MAJOR` lays the GNA forward's grid over (batch * heads, Q tiles), `CHUNK_A` and
    `CHUNK_B` are head_dim's column chunks (kernels/common/headdim.py, `HeadSplit`; 0 where a kernel does not
    take them). A kernel reads the switches it has; `dataclasses.replace` (or `overridden`) makes a variant."""

    num_warps: int
    num_stages: int
    MASKED: bool = True
    USE_TMA: bool = False
    WARP_SPECIALIZE: bool = False
    HEAD_MAJOR: bool = False
    CHUNK_A: int = 0
    CHUNK_B: int = 0

    def overridden(self, overrides: Overrides) -> LaunchOptions:
        """These options with a caller's checked overrides (`launch_overrides`) in place."""
        return replace(self, **dict(overrides)) if overrides else self

    def triton_options(self) -> dict[str, int]:
        """What Triton's launcher takes beside the kernel's arguments."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# A caller's overrides of launch options, names checked: sorted (name, value) pairs, hashable for call caches.
Overrides = tuple[tuple[str, object], ...]
LAUNCH_OPTION_NAMES = tuple(field.name for field in fields(LaunchOptions))


def launch_overrides(overrides: Optional[Mapping[str, object]], argument: str,
                     known: tuple[str, ...] = LAUNCH_OPTION_NAMES) -> Overrides:
    """A caller's overrides of launch options (tuning, benchmarks), checked once at the public boundary: each
    name must be among `known`, the options the launch reads; `argument` names the overrides in the sentence
    that refuses another."""
    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise TypeError(f"{argument} must be a dict of launch options, got {type(overrides).__name__}.")
    for name in overrides:
        if name not in known:
            raise ValueError(f"{argument} names an unknown launch option, {name!r}: the known options are "
                             f"{', '.join(known)}.")
    return tuple(sorted(overrides.items()))


def launch_config(
    block_m: int, block_n: int, split: HeadSplit, masked: bool = True, tma: bool = False, specialize: bool = True
) -> LaunchOptions:
    """Launch options for a tile of `block_m` queries and `block_n` keys at head dim `split` (its column chunks,
    kernels/common/headdim.py; sizes below count its computed width, `split.width`), see kernels/gna/forward.py.

    A 128x128 tile without masks, with tensor descriptors, over more than 64 columns and at most 128, runs
    warp-specialized: `num_warps=4` asks for one consumer warpgroup per 64 query rows (Triton's Hopper pass makes
    two of them and adds a producer warpgroup for the K/V copies, 12 warps in all) and two K/V stages fill shared
    memory. Otherwise 8 warps where a Q tile holds more than 128 x 64 elements (queries times computed width; 4
    below) and three pipeline stages where they fit in shared memory (measured faster than two at 128x128x128 on
    the H100, benchmarks/results/gna-tune-*.json), else two, else one. Widths between 64 and 128 columns (72 or
    96 split) take 128's warps rather than 64's: their 128-query tiles hold too many scores and accumulators for
    four warps' registers.

    `specialize=False` keeps the single-partition loop: the launcher asks for it when the kernel writes the
    LSE or debug counts. Under Triton 3.6's Hopper warp specialization the LSE came out wrong (off by more
    than 1e-2 against float64 at HunyuanVideo 16x8x8) while the output was right (H100, 2026-11-22).
    """
    width = split.width
    q_bytes, kv_bytes = 2 * block_m * width, 2 * 2 * block_n * width
    large = block_m * width > 128 * 64
    chunks = dict(CHUNK_A=split.a, CHUNK_B=split.b)
    if (specialize and tma and not masked and large and not split.wide and block_m == 128 and block_n == 128):
        return LaunchOptions(num_warps=4, num_stages=2, MASKED=False, USE_TMA=True, WARP_SPECIALIZE=True, **chunks)
    stages = stages_that_fit(q_bytes, kv_bytes, 3)
    return LaunchOptions(num_warps=8 if large else 4, num_stages=stages, MASKED=masked, USE_TMA=tma,
                         WARP_SPECIALIZE=False, **chunks)


def stages_that_fit(q_bytes: int, kv_bytes: int, most: int) -> int:
    """The most pipeline stages, up to `most`, whose K/V tiles (`kv_bytes` each) fit in shared memory beside the
    Q tile (`q_bytes`); one at least."""
    return next((n for n in range(most, 1, -1) if q_bytes + n * kv_bytes <= SHARED_MEMORY_BUDGET), 1)


def with_fp8(launch: LaunchOptions, block_m: int, block_n: int, split: HeadSplit) -> LaunchOptions:
    """`launch` with the FP8 kernels' warps and stages (kernels/common/fp8.py, `fp8_launch_config`), the stages
    lowered where the tiles, one byte an element, do not fit in shared memory."""
    options = fp8_launch_config(block_m, block_n, split)
    options["num_stages"] = stages_that_fit(block_m * split.width, 2 * block_n * split.width, options["num_stages"])
    return replace(launch, **options)


def split_of(head_dim: int, overrides: Overrides, default: Optional[HeadSplit] = None) -> HeadSplit:
    """The column chunks a launch runs `head_dim` in: those its checked overrides name (`CHUNK_A`, and
    `CHUNK_B`, 0 unless given; a sentence where they do not cover head_dim), else `default` (None: the width's
    default, `head_split`)."""
    named = dict(overrides)
    if "CHUNK_A" not in named:
        if "CHUNK_B" in named:
            raise ValueError("CHUNK_B overrides a launch's second head-dim chunk only together with CHUNK_A.")
        return head_split(head_dim) if default is None else default
    return HeadSplit(head_dim, int(named["CHUNK_A"]), int(named.get("CHUNK_B", 0)))


NO_TMA_VARIABLE = "NATSIM_NO_TMA"  # "1" turns tensor descriptors off for the process (module docstring)
_descriptors_enabled = os.environ.get(NO_TMA_VARIABLE, "0") != "1"


def set_tensor_descriptors(enabled: bool) -> None:
    """Allow tensor descriptors (`enabled=True`, the default unless NATSIM_NO_TMA=1) or rule them out for every
    later call in this process, on any device. A call's launch decisions are kept per distinct call, keyed on this
    setting (kernels/gna/dispatch.py, kernels/gna/api.py); the other launchers ask `has_tensor_descriptors` on
    every call."""
    global _descriptors_enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_tensor_descriptors takes True or False, got {enabled!r}.")
    _descriptors_enabled = enabled


def tensor_descriptors_enabled() -> bool:
    """Whether tensor descriptors are allowed in this process (`set_tensor_descriptors`, NATSIM_NO_TMA)."""
    return _descriptors_enabled


def has_tensor_descriptors(device: torch.device) -> bool:
    """Whether launches on `device` move tiles through tensor descriptors: the device has them (Hopper or newer,
    or the interpreter) and they are not turned off (`set_tensor_descriptors`, NATSIM_NO_TMA=1)."""
    return _descriptors_enabled and _device_has_descriptors(device)


@functools.lru_cache(maxsize=16)
def _device_has_descriptors(device: torch.device) -> bool:
    """Tensor descriptors (the bulk tensor copy engine) need Hopper or newer; the interpreter has them too."""
    return interpreting() or torch.cuda.get_device_capability(device)[0] >= 9


def descriptor_strides_ok(t: torch.Tensor) -> bool:
    """Descriptors need a contiguous last dimension, every other stride a multiple of 16 bytes, and positive
    strides along the token dimensions (those between batch and heads: an expanded, stride-0 one is not a
    layout a descriptor can walk)."""
    size = t.element_size()
    return (t.stride(-1) == 1 and all(st * size % 16 == 0 for st in t.stride()[:-1])
            and all(st > 0 for st in t.stride()[1:-2]))


def aligned(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary (descriptors, and the kernel's pointer specialisation)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def descriptors_fit(*tensors: torch.Tensor) -> bool:
    """Whether `tensors` (on one device) can move through tensor descriptors: the device has them and they are not
    turned off (`has_tensor_descriptors`), their strides suit a descriptor and their starts are 16-byte aligned."""
    return (has_tensor_descriptors(tensors[0].device) and all(descriptor_strides_ok(t) for t in tensors)
            and aligned(*tensors))


def install_allocator() -> None:
    """In-kernel tensor descriptors need a scratch allocator; install a torch one unless the caller has one.
    Triton keeps the allocator in a context variable, one per thread: a launch from another thread (autograd's
    device threads recompute checkpointed forwards there) needs it installed again, so launchers call this
    before every descriptor launch (a context-variable read when it is there)."""
    if _allocator is not None and isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_torch_allocator)


_CPU, _CUDA = torch.device("cpu"), torch.device("cuda")


def _torch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device=_CPU if interpreting() else _CUDA)
