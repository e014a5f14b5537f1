"""What the families' call specs share (kernels/gna/spec.py, kernels/sparse/spec.py): a spec is made once per
distinct arguments. Eager calls repeat theirs, and checking them and building a frozen dataclass of a dozen fields
costs microseconds, a fifth of an eager call's host time; a lookup costs a fraction of one.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

T = TypeVar("T")

MAX_SPECS = 1024  # distinct argument sets kept (a model has a handful of attention calls)


def kept(build: Callable[..., T]) -> Callable[..., T]:
    """`build(*arguments)` with its results kept per distinct (positional) arguments. Arguments that cannot be
    hashed (lists, as the operators' schemas pass them) build afresh; so do failures (nothing is kept of a call
    that raised)."""
    cached = functools.lru_cache(maxsize=MAX_SPECS)(build)

    @functools.wraps(build)
    def made(*arguments: object) -> T:
        try:
            return cached(*arguments)
        except TypeError:  # an unhashable argument; or `build`'s own TypeError, which building again raises
            return build(*arguments)

    return made
