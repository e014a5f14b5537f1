"""Planning for several GPUs: which context-parallel strategy and frame split run a GNA plan fastest.

`parallel_plan(plan, world_size)` takes a single-GPU `Plan` (window, stride, tiles from `best`) and ranks every
(strategy, split) pair by its slowest rank (natsim.partition.strategy_cost): the rank's tile work, priced per
visited tile from the plan's own prediction when a cost model ranked it (its predicted seconds spread evenly
over its visited tiles, every head), else at natsim.partition's default rate, plus the bytes it sends or receives
at `bytes_per_second`. Splits tried: even, and aligned to stride groups along frames. The result,
`ParallelPlan`, runs itself through `natsim.distributed.gna_attention` and reports its per-rank table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from natsim.partition import (LINK_BYTES_PER_SECOND, STRATEGIES, StrategyCost, aligned_split, even_split,
                              strategy_cost)

from .catalog import element_bytes
from .plan import Plan


@dataclass(frozen=True)
class ParallelPlan:
    """A single-GPU `plan` run over `world_size` ranks with `strategy` and frames `split` along dimension 0.

    `costs` holds every strategy's per-rank costs for the chosen split (what `table()` and `--world-size`
    show); `seconds` is the slowest rank's predicted time of the choice. Attributes not defined here are the
    single-GPU plan's (window, tiles, figures).
    """

    plan: Plan
    world_size: int
    strategy: str
    split: tuple[int, ...]
    costs: Mapping[str, StrategyCost]
    bytes_per_second: float

    def __getattr__(self, name: str):
        if name == "plan":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.plan, name)

    @property
    def chosen(self) -> StrategyCost:
        return self.costs[self.strategy]

    @property
    def seconds(self) -> float:
        return self.chosen.seconds

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                 scale: Optional[float] = None) -> torch.Tensor:
        """This rank's output frames of `[B, T_r, *rest, heads, head_dim]` q, k, v sharded as `split`."""
        from natsim.distributed import gna_attention

        args = self.plan.kernel_arguments()
        if self.strategy == "halo":  # frame ranges run static KV tiling only
            args.pop("kv_tiling", None)
        return gna_attention(q, k, v, args.pop("window"), args.pop("stride"), args.pop("dilation"),
                             args.pop("causal"), group=group, strategy=self.strategy, split=self.split,
                             scale=scale, **args)

    def rows(self) -> list[dict]:
        """One row per (strategy, rank): frames, heads, tiles, bytes, predicted seconds."""
        return [{"strategy": name, **rank.to_dict()} for name, cost in self.costs.items() for rank in cost.ranks]

    def to_dict(self) -> dict:
        return {**self.plan.to_dict(), "world_size": self.world_size, "strategy": self.strategy,
                "split": list(self.split), "parallel_predicted_s": self.seconds,
                "bytes_per_second": self.bytes_per_second,
                "strategies": {name: cost.to_dict() for name, cost in self.costs.items()}}


def parallel_plan(plan: Plan, world_size: int, *, bytes_per_second: float = LINK_BYTES_PER_SECOND,
                  batch: int = 1) -> ParallelPlan:
    """The fastest (strategy, split) for `plan` on `world_size` ranks (module docstring)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got world_size={world_size!r}.")
    problem, heads = plan.problem, plan.heads or 1
    if world_size > problem.shape[0]:
        raise ValueError(f"world_size cannot exceed the {problem.shape[0]} frames of dimension 0 (each rank "
                         f"holds whole frames), got world_size={world_size}.")
    tile_seconds = None
    if plan.calibrated:
        tile_seconds = plan.score / max(1, plan.simulation.visited_tiles * heads)
    options = []
    for split in dict.fromkeys((even_split(problem.shape[0], world_size), aligned_split(problem, world_size))):
        costs = {s: strategy_cost(problem, plan.tiles, split, s, batch=batch, heads=heads, head_dim=plan.head_dim,
                                  element_bytes=element_bytes(plan.torch_dtype), tile_seconds=tile_seconds,
                                  bytes_per_second=bytes_per_second)
                 for s in STRATEGIES if s != "ulysses" or heads % world_size == 0}
        options.append((split, costs))
    split, costs, strategy = min(((split, costs, name) for split, costs in options for name in costs),
                                 key=lambda option: option[1][option[2]].seconds)
    return ParallelPlan(plan, world_size, strategy, split, costs, bytes_per_second)
