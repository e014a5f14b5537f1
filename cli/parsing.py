"""Parsing of the CLI's compact per-dimension notation ("30x48x80", "0x0x1", "all")."""

from __future__ import annotations

from typing import Optional, Sequence

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


class CliInputError(ValueError):
    """Bad command-line input: printed as one red line, exit code 2."""


# The largest size one dimension may take (16,777,216): the simulator keeps arrays as long as a dimension (a 1-D
# layout of 2e9 tokens exhausted 24 GiB), and larger values only reach numpy's and numba's integer limits.
MAX_DIM = 2**24


def parse_dims(text: str, option: str) -> tuple[int, ...]:
    """'30x48x80' -> (30, 48, 80); '7' -> (7,)."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise CliInputError(
            f"{option} takes integers joined by 'x' (like 30x48x80), got {option} {text!r}."
        ) from None
    if any(abs(v) > MAX_DIM for v in values):
        raise CliInputError(f"{option} takes sizes up to {MAX_DIM:,} per dimension, got {option} {text!r}.")
    return values


def parse_flags(text: str, option: str) -> tuple[bool, ...]:
    """'0x0x1' -> (False, False, True); 'true' -> (True,)."""
    flags = []
    for part in text.lower().split("x"):
        if part in TRUE_WORDS:
            flags.append(True)
        elif part in FALSE_WORDS:
            flags.append(False)
        else:
            raise CliInputError(
                f"{option} takes 0/1 per dimension joined by 'x' (like 0x0x1), got {option} {text!r}."
            )
    return tuple(flags)


def broadcast(values: tuple, ndim: int, option: str) -> tuple:
    """A single value applies to every dimension; otherwise there must be one per dimension."""
    if len(values) == 1:
        return values * ndim
    if len(values) != ndim:
        raise CliInputError(
            f"{option} needs one value per dimension of --shape ({ndim}), got {len(values)}: "
            f"{'x'.join(str(int(v)) for v in values)}."
        )
    return values


def parse_strides(texts: Optional[list[str]], option: str = "--stride") -> Optional[list[tuple[int, ...]]]:
    """Repeated --stride values, or None for 'all' (every stride up to the window)."""
    if not texts or any(t.lower() == "all" for t in texts):
        if texts and len(texts) > 1:
            raise CliInputError(f"{option} all cannot be combined with other strides, got {texts}.")
        return None
    return [parse_dims(t, option) for t in texts]


def parse_backends(values: Optional[Sequence[str]]) -> Optional[tuple[str, ...]]:
    """--backend, repeatable or a comma list ('triton,fa4'): the backends' names, or None (every one available
    here) when it is not given; the planner checks the names."""
    if not values:
        return None
    names = tuple(name.strip().lower() for value in values for name in value.split(","))
    if not all(names):
        raise CliInputError(f"--backend takes backend names (triton, fa4, gluon), repeated or joined by ',', got "
                            f"{' '.join('--backend ' + repr(value) for value in values)}.")
    return names


def parse_precision(text: Optional[str], auto: bool = False) -> Optional[str]:
    """--precision: None (compute in --dtype), 'fp8' (natsim's FP8 inference kernels) or, where the command takes
    it (`auto`), 'auto' (FP8 where it is predicted faster)."""
    if text is None:
        return None
    value = text.strip().lower()
    allowed = ("fp8", "auto") if auto else ("fp8",)
    if value not in allowed:
        raise CliInputError(f"--precision takes {' or '.join(allowed)} (leave it out to compute in --dtype), got "
                            f"--precision {text!r}.")
    return value
