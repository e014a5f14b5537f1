"""The GNA problem: a token layout and its per-dimension attention parameters.

Arguments are normalised and validated here, once. Every other part of natsim receives a `Problem`
and trusts its per-dimension tuples (see shared/design/gna-semantics.md, section 1).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence, Union

IntOrInts = Union[int, Sequence[int]]
BoolOrBools = Union[bool, Sequence[bool]]

MAX_DIMS = 3


def _is_int(value: object) -> bool:
    # `type(...) is int` first: the ABC check is slow, and the simulator validates many small tuples.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _is_numpy_bool(value: object) -> bool:
    # numpy's booleans (numpy.bool_, numpy.bool in numpy 2) are neither bool nor Integral; named without importing
    # numpy, which the problem's module does not need.
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def _reject_text(value: object, name: str, kind: str) -> None:
    # A string is a sequence of characters, never a sequence of sizes or flags.
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be {kind}, got {name}={value!r}.")


def as_sizes(value: IntOrInts, name: str) -> tuple[int, ...]:
    """Normalise per-dimension sizes (a token layout, a tile shape) to a tuple of 1 to 3 positive ints; an int
    is one dimension."""
    if type(value) is tuple and 1 <= len(value) <= MAX_DIMS and all(type(v) is int and v >= 1 for v in value):
        return value  # already normalised: the common case, checked without the general path's conversions
    _reject_text(value, name, "an int or a sequence of ints")
    items = (value,) if _is_int(value) else value
    try:
        items = tuple(items)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {name}={value!r}.") from None
    if not 1 <= len(items) <= MAX_DIMS:
        raise ValueError(f"{name} must have 1, 2 or 3 dimensions, got {name}={value!r}.")
    if not all(_is_int(v) for v in items):
        raise TypeError(f"{name} must hold integers only, got {name}={value!r}.")
    if any(v < 1 for v in items):
        raise ValueError(f"every dimension of {name} must be at least 1, got {name}={value!r}.")
    return tuple(int(v) for v in items)


def as_shape(value: IntOrInts, name: str = "shape") -> tuple[int, ...]:
    """Normalise a token layout to a tuple of 1 to 3 positive ints."""
    return as_sizes(value, name)


def as_ints(value: IntOrInts, ndim: int, name: str) -> tuple[int, ...]:
    """Broadcast a scalar to `ndim` ints, or check that a sequence has exactly `ndim` ints."""
    if _is_int(value):
        return (int(value),) * ndim
    _reject_text(value, name, "an int or a sequence of ints")
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {name}={value!r}.") from None
    if not all(_is_int(v) for v in items):
        raise TypeError(f"{name} must hold integers only, got {name}={value!r}.")
    if len(items) != ndim:
        raise ValueError(
            f"{name} must have one value per dimension ({ndim}), got {name}={value!r}."
        )
    return tuple(int(v) for v in items)


def as_bools(value: BoolOrBools, ndim: int, name: str) -> tuple[bool, ...]:
    """Broadcast a bool to `ndim` bools, or check a sequence of bools (0 and 1, and numpy's booleans, are
    accepted)."""

    def to_bool(v: object) -> bool:
        if isinstance(v, bool):
            return v
        if _is_numpy_bool(v) or (_is_int(v) and v in (0, 1)):
            return bool(v)
        raise TypeError(f"{name} must hold booleans (or 0/1), got {name}={value!r}.")

    if isinstance(value, bool) or _is_int(value) or _is_numpy_bool(value):
        return (to_bool(value),) * ndim
    _reject_text(value, name, "a bool or a sequence of bools")
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be a bool or a sequence of bools, got {name}={value!r}.") from None
    if len(items) != ndim:
        raise ValueError(
            f"{name} must have one value per dimension ({ndim}), got {name}={value!r}."
        )
    return tuple(to_bool(v) for v in items)


@dataclass(frozen=True)
class Problem:
    """A token layout `shape` (L_1, ..., L_n) with GNA parameters per dimension.

    `window` is the paper's kernel size, `stride` groups queries that share one window
    (1 = neighborhood attention, window = blocked attention), `dilation` splits a dimension into
    independent groups, `causal` restricts a query to keys at or before it. Scalars broadcast to
    every dimension.

    >>> Problem((30, 48, 80), window=(18, 24, 24), stride=(1, 8, 8)).num_tokens
    115200
    """

    shape: tuple[int, ...]
    window: tuple[int, ...]
    stride: tuple[int, ...] = 1  # type: ignore[assignment]
    dilation: tuple[int, ...] = 1  # type: ignore[assignment]
    causal: tuple[bool, ...] = False  # type: ignore[assignment]

    def __post_init__(self) -> None:
        shape = as_shape(self.shape)
        ndim = len(shape)
        window = as_ints(self.window, ndim, "window")
        stride = as_ints(self.stride, ndim, "stride")
        dilation = as_ints(self.dilation, ndim, "dilation")
        causal = as_bools(self.causal, ndim, "causal")
        if any(w < 1 for w in window):
            raise ValueError(f"window must be at least 1 along every dimension, got {window=}.")
        if any(d < 1 for d in dilation):
            raise ValueError(f"dilation must be at least 1 along every dimension, got {dilation=}.")
        if any(w * d > length for w, d, length in zip(window, dilation, shape)):
            raise ValueError(
                "window * dilation cannot be larger than the layout along any dimension, "
                f"got {shape=}, {window=}, {dilation=}."
            )
        if any(s < 1 for s in stride):
            raise ValueError(f"stride must be at least 1 along every dimension, got {stride=}.")
        if any(s > w for s, w in zip(stride, window)):
            raise ValueError(
                "stride cannot be larger than window along any dimension, "
                f"got {window=}, {stride=}."
            )
        for name, value in zip(
            ("shape", "window", "stride", "dilation", "causal"),
            (shape, window, stride, dilation, causal),
        ):
            object.__setattr__(self, name, value)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.shape)

    def with_stride(self, stride: IntOrInts) -> "Problem":
        """The same problem with another stride."""
        return Problem(self.shape, self.window, stride, self.dilation, self.causal)

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape),
            "window": list(self.window),
            "stride": list(self.stride),
            "dilation": list(self.dilation),
            "causal": list(self.causal),
        }

    def __str__(self) -> str:
        def fmt(values: tuple) -> str:
            return "x".join(str(int(v)) for v in values)

        text = f"shape {fmt(self.shape)}, window {fmt(self.window)}, stride {fmt(self.stride)}"
        if any(d > 1 for d in self.dilation):
            text += f", dilation {fmt(self.dilation)}"
        if any(self.causal):
            text += f", causal {fmt(self.causal)}"
        return text
