"""End-to-end speedup estimate of a diffusion model whose attention is sped up (gna-semantics.md, section 3)."""

from __future__ import annotations

import numbers


def end_to_end_speedup(
    attention_share: float, attention_speedup: float, dense_steps: int = 0, steps: int = 1
) -> float:
    """Speedup of the whole model when attention, a fraction `attention_share` of its time, runs
    `attention_speedup` times faster in all but `dense_steps` of its `steps` diffusion steps.

    `1 / ((1 - f) + f * k / n + f * (1 - k / n) / S)`, as in the GNA paper's Tables 2-4.

    >>> round(end_to_end_speedup(0.5, 2.0), 3)
    1.333
    """
    if not 0.0 <= attention_share <= 1.0:
        raise ValueError(f"attention_share must lie in [0, 1], got {attention_share=}.")
    if not attention_speedup > 0:
        raise ValueError(f"attention_speedup must be positive, got {attention_speedup=}.")
    for name, value in (("dense_steps", dense_steps), ("steps", steps)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {name}={value!r}.")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps=}.")
    if not 0 <= dense_steps <= steps:
        raise ValueError(f"dense_steps must lie in [0, steps], got {dense_steps=}, {steps=}.")
    f, kept = attention_share, dense_steps / steps
    return 1.0 / ((1.0 - f) + f * kept + f * (1.0 - kept) / attention_speedup)
