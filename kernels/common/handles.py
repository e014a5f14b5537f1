"""Python objects that cross an operator boundary by handle, and autograd inside an operator's body.

An operator's schema carries tensors and plain values only. A forward that must hand its backward something else
(the attention it decided on, the autograd graphs it built) keeps it under a key and returns the key as an output,
a CPU int64 scalar (the handle); autograd (or a compiled graph's backward) saves the handle with the other saved
tensors, and the backward finds the object by it. A kept object lives as long as its handle: a forward run
without gradients drops it at once, a backward graph once it is freed.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch

_held: dict[int, Any] = {}
_keys = itertools.count()


def hold(value: Any) -> torch.Tensor:
    """The handle of `value`: a CPU int64 scalar holding its key, which keeps `value` while the handle lives."""
    key = next(_keys)
    handle = torch.tensor(key, dtype=torch.int64)
    _held[key] = value
    weakref.finalize(handle, _held.pop, key, None)
    return handle


def held(handle: torch.Tensor, what: str) -> Any:
    """The value `handle` keeps; a sentence naming `what` (the operator whose backward asks) when it is gone."""
    value = _held.get(int(handle))
    if value is None:
        raise RuntimeError(f"{what} got the handle of a value no longer kept: its forward's graph was freed before "
                           "this backward ran.")
    return value


def fake_handle() -> torch.Tensor:
    """What a fake implementation returns for a handle."""
    return torch.empty((), dtype=torch.int64)


@contextmanager
def autograd_inside_an_operator() -> Iterator[None]:
    """Autograd back on inside an operator's body, which runs below autograd: for work whose gradients only
    Python known at run time can give (a decision made per call, graphs built by the forward), which cannot be
    traced into a compiled graph."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False):
        with torch.enable_grad():
            yield
