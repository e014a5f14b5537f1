"""The value lists capability tables are built from, computed from a kernel's own bounds so that a table
follows its kernel when a bound moves."""

from __future__ import annotations


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """Every power of two from `low` to `high`, both powers of two (the bounds a kernel's checks accept)."""
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a positive power of two, got {name}={value!r}.")
    if low > high:
        raise ValueError(f"low must not exceed high, got low={low}, high={high}.")
    return tuple(1 << exponent for exponent in range(low.bit_length() - 1, high.bit_length()))
