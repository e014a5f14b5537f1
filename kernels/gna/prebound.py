"""Launching a compiled Triton kernel without Triton's JIT dispatch, for calls whose arguments repeat.

Triton's dispatch binds and specialises every argument of a kernel on each call (the GNA forward kernel has 70);
a `PreboundKernel` does that once and afterwards hands the arguments straight to the compiled launcher.
"""

from __future__ import annotations

import inspect

import torch

from ..common.launch import aligned, install_allocator

try:  # Triton >= 3.4 keeps its launch hooks here; without it every launch goes through the JIT dispatch.
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None

TENSOR_ARGUMENTS = ("Q", "K", "V", "O", "LSE", "COUNTS", "SQ", "SK", "SV")  # the last three: FP8 scales


class PreboundKernel:
    """One Triton kernel with a fixed grid and every argument fixed but its tensors.

    The first call goes through `kernel[grid](...)`, which compiles (or finds) the kernel specialised for
    these arguments. Later calls hand the arguments straight to the compiled kernel's launcher, as Triton's
    dispatch would after binding, specialising and hashing them: valid because every scalar argument is the
    same by construction and the tensors are 16-byte aligned as on the first call (checked; an unaligned
    call takes the dispatch, which specialises for it). The interpreter always takes the dispatch.
    """

    def __init__(self, fn, grid: tuple[int, int, int], arguments: dict, options: dict, check_alignment: bool):
        self.fn = fn
        self.grid = grid
        self.arguments = arguments
        self.options = options
        self.check_alignment = check_alignment
        parameters = inspect.signature(fn.fn).parameters
        self.template = [arguments.get(name, parameters[name].default) for name in fn.arg_names]
        self.names = [name for name in TENSOR_ARGUMENTS if name in fn.arg_names]
        self.slots = [fn.arg_names.index(name) for name in self.names]
        self.descriptors = bool(arguments.get("USE_TMA"))  # in-kernel descriptors: the allocator, per thread
        self.compiled = None

    def __call__(self, *tensors: torch.Tensor) -> None:
        """Launch on `tensors` (Q, K, V, O, LSE, COUNTS, and for FP8 SQ, SK, SV). Without `check_alignment` the caller guarantees
        16-byte aligned tensors (its key includes their alignment, and it allocates the rest)."""
        index = tensors[0].get_device()  # -1 for CPU tensors (the interpreter)
        if index >= 0 and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                self._launch(tensors, index)
        else:
            self._launch(tensors, index)

    def _launch(self, tensors: tuple[torch.Tensor, ...], index: int) -> None:
        if self.descriptors:
            install_allocator()
        kernel = self.compiled
        if kernel is None or (self.check_alignment and not aligned(*tensors)):
            compiled = self.fn[self.grid](**self.arguments, **dict(zip(self.names, tensors)), **self.options)
            if _knobs is not None and hasattr(compiled, "packed_metadata") and aligned(*tensors):
                self.compiled = compiled
            return
        args = self.template.copy()
        for slot, tensor in zip(self.slots, tensors):
            args[slot] = tensor
        stream = torch._C._cuda_getCurrentRawStream(index)
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        if _hooked(enter) or _hooked(leave):  # a profiler listens: give it what Triton's dispatch would
            kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata,
                       kernel.launch_metadata(self.grid, stream, *args), enter, leave, *args)
        else:
            kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook has anything to call (a HookChain with calls, or a plain function)."""
    return hook is not None and bool(getattr(hook, "calls", True))
