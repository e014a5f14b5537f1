"""What the families' call specs share (kernels/gna/spec.py, kernels/sparse/spec.py): a spec is made once per
distinct arguments. Eager calls repeat theirs, and checking them and building a frozen dataclass of a dozen fields
costs microseconds, a fifth of an eager call's host time; a lookup costs a fraction of one.

Under torch.compile the arguments are made concrete first (`concrete`): Dynamo turns an int argument whose value
changed between calls into a symbolic one (its automatic dynamic shapes), and a kernel's geometry cannot be
symbolic. Taking the value makes Dynamo guard on it: one graph per distinct window, stride or block, as for the
ints it specialises itself.
"""

from __future__ import annotations

import functools
import operator
import sys
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
F = TypeVar("F", bound=Callable)

MAX_SPECS = 1024  # distinct argument sets kept (a model has a handful of attention calls)


def kept(build: Callable[..., T]) -> Callable[..., T]:
    """`build(*arguments)` with its results kept per distinct (positional) arguments, told apart by type too
    (not inside tuples: telling those apart cost 5 us a call; a tuple holding 3.0 where a kept one held 3 takes
    its spec). Arguments that cannot be hashed (lists, as the operators' schemas pass them) build afresh; so do
    failures (nothing is kept of a call that raised: `build` checks every argument it keeps)."""
    cached = functools.lru_cache(maxsize=MAX_SPECS, typed=True)(build)  # True and 1.0 are not 1

    @functools.wraps(build)
    def made(*arguments: object) -> T:
        arguments = constants_when_compiled(*arguments)
        try:
            return cached(*arguments)
        except TypeError:  # an unhashable argument; or `build`'s own TypeError, which building again raises
            return build(*arguments)

    return made


def concrete(value: object) -> object:
    """`value` with every int in it, inside tuples and lists too, made a constant of the graph being compiled:
    Dynamo takes `operator.index` of a symbolic int as its value, guarding on it (`int()` keeps it symbolic).
    Outside a compiled region, torch's symbolic ints are specialised the same way; other values pass as they
    are."""
    if type(value) is bool:
        return value
    if isinstance(value, (int, torch.SymInt)):
        return operator.index(value)
    if isinstance(value, (tuple, list)):
        return type(value)([concrete(item) for item in value])
    return value


def constants_when_compiled(*values: object) -> tuple:
    """`values` made `concrete` while torch.compile traces the caller; as they are in eager calls."""
    return concrete(values) if torch.compiler.is_compiling() else values


# What torch.compiler.assume_constant_result sets on a function (torch 2.4 to 2.13); tests/test_ops.py checks it.
_CONSTANT_MARKER = "_dynamo_marked_constant"


def constant_of_the_graph(fn: F) -> F:
    """`fn` marked as `torch.compiler.assume_constant_result` marks it (torch.compile calls it while tracing and
    takes its result as a constant of the graph), without importing torch._dynamo for it: that import took about
    1.5 s, paid by every `import natsim.planner` (the CLI's `natsim plan` among them) for a mark read only when
    something compiles. Where torch._dynamo is already imported, torch's own function marks it."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    setattr(fn, _CONSTANT_MARKER, True)
    return fn
