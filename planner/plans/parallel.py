"""`ParallelPlan`: a GNA plan run over several GPUs, with its context-parallel strategy and frame split.

A parallel plan holds a single-GPU `Plan` (window, stride, tiles), the strategy and the split of frames along
dimension 0 chosen for it (planner.search.parallel), and every strategy's per-rank costs for that split. It runs
itself through `natsim.distributed.gna_attention` and reports its per-rank table (`rows()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from natsim.partition import StrategyCost

from .plan import Plan


@dataclass(frozen=True)
class ParallelPlan:
    """A single-GPU `plan` run over `world_size` ranks with `strategy` and frames `split` along dimension 0.

    `costs` holds every strategy's per-rank costs for the chosen split (what `rows()` and `--world-size`
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
