"""`MaskCache`: DFSAttn's reuse of predicted masks across diffusion steps with its adaptive budget (DFSAttn
section 5.3, Algorithm 1 and section 6.1), public through `natsim.masks`.

A denoising run of `num_steps` steps goes through three regimes:
- dense warm-up: the first `dense_fraction` of the steps run dense attention (no mask);
- then the budget (the fraction of key blocks a query block keeps) starts at `initial_budget` and shrinks by
  `budget_decay` at the start of every further `phase_fraction` of the steps (never below `min_budget`):
  the paper's defaults give 0.3, 0.2, 0.1 over the last three quarters of the run;
- a layer's mask is predicted again only at steps `t` with `t % interval == 0` (Algorithm 1's `t = 0 mod
  Delta`; the paper's interval is 12 of 50 steps, a quarter) and at its first sparse step, and reused at the
  steps in between. The attention itself is recomputed at every step with the cached mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Hashable, Optional

import torch


@dataclass(frozen=True)
class Refresh:
    """One prediction: the mask of `key` was predicted at `step` with `budget`."""

    key: Hashable
    step: int
    budget: float


def _fraction(name: str, value, allow_zero: bool) -> Fraction:
    low_ok = (value >= 0.0) if allow_zero else (value > 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be a number in {interval}, got {name}={value!r}.")
    return Fraction(value).limit_denominator(10**6)  # 0.1 as 1/10, so that phase boundaries are exact


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}.")
    return value


class MaskCache:
    """Per-key (e.g. per layer) masks reused across the steps of one denoising run (module docstring).

    `mask(key, step, predict)` returns None at dense warm-up steps (run dense attention), else the mask of
    `key`, calling `predict(budget(step))` only when Algorithm 1 refreshes it: at the key's first sparse step,
    at every step that is a multiple of `interval`, and when `step` goes back below the step of the cached
    mask (a new run). Calls at one step share the mask (e.g. the two halves of classifier-free guidance).
    `refreshes` lists every prediction made, in order.
    """

    def __init__(
        self,
        num_steps: int,
        *,
        dense_fraction: float = 0.25,
        interval: Optional[int] = None,
        initial_budget: float = 0.3,
        budget_decay: float = 0.1,
        phase_fraction: float = 0.25,
        min_budget: float = 0.1,
    ) -> None:
        self.num_steps = _positive_int("num_steps", num_steps)
        self.dense_fraction = _fraction("dense_fraction", dense_fraction, allow_zero=True)
        self.interval = max(1, num_steps // 4) if interval is None else _positive_int("interval", interval)
        self.initial_budget = float(_fraction("initial_budget", initial_budget, allow_zero=False))
        self.budget_decay = float(_fraction("budget_decay", budget_decay, allow_zero=True))
        self.phase_fraction = _fraction("phase_fraction", phase_fraction, allow_zero=False)
        self.min_budget = float(_fraction("min_budget", min_budget, allow_zero=False))
        if self.min_budget > self.initial_budget:
            raise ValueError(
                "min_budget cannot be larger than initial_budget, got "
                f"min_budget={min_budget!r}, initial_budget={initial_budget!r}."
            )
        self.refreshes: list[Refresh] = []
        self._cached: dict = {}  # key -> (step, mask)

    def _check_step(self, step) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.num_steps:
            raise ValueError(f"step must be an int in [0, num_steps={self.num_steps}), got step={step!r}.")
        return step

    def is_dense(self, step: int) -> bool:
        """Whether `step` is a dense warm-up step: `step < dense_fraction * num_steps`."""
        return self._check_step(step) < self.dense_fraction * self.num_steps

    def budget(self, step: int) -> float:
        """The fraction of key blocks a query block keeps at `step`: 1.0 at dense steps, else `initial_budget`
        minus `budget_decay` per whole `phase_fraction * num_steps` steps since the warm-up ended, at least
        `min_budget`."""
        if self.is_dense(step):
            return 1.0
        since = step - self.dense_fraction * self.num_steps
        phase = int(since // (self.phase_fraction * self.num_steps))
        return max(self.min_budget, round(self.initial_budget - self.budget_decay * phase, 9))

    def mask(self, key: Hashable, step: int, predict: Callable[[float], torch.Tensor]) -> Optional[torch.Tensor]:
        """None at dense steps; else `key`'s cached mask, predicted again by `predict(budget)` when due."""
        if self.is_dense(step):
            return None
        cached = self._cached.get(key)
        if cached is None or step // self.interval != cached[0] // self.interval or step < cached[0]:
            budget = self.budget(step)
            mask = predict(budget)
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(
                    f"predict must return a boolean torch.Tensor block mask, got {type(mask).__name__}"
                    + (f" of dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else "") + "."
                )
            cached = (step, mask)
            self._cached[key] = cached
            self.refreshes.append(Refresh(key, step, budget))
        return cached[1]

    def reset(self) -> None:
        """Forget every cached mask and the list of refreshes (a new run that does not restart at step 0)."""
        self._cached.clear()
        self.refreshes.clear()
