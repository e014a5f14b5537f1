"""Planning for several GPUs: which context-parallel strategy and frame split run a GNA plan fastest.

`parallel_plan(plan, world_size)` takes a single-GPU `Plan` (window, stride, tiles from `best`) and ranks every
(strategy, split) pair by its slowest rank (natsim.partition.strategy_cost): the rank's tile work, priced per
visited tile from the plan's own prediction when a cost model ranked it (its predicted seconds spread evenly
over its visited tiles, every head), else at natsim.partition's default rate, plus the bytes it sends or receives
at `bytes_per_second`. Splits tried: even, and aligned to stride groups along frames. The result is a
`ParallelPlan` (planner.plans.parallel).
"""

from __future__ import annotations

from natsim.partition import LINK_BYTES_PER_SECOND, STRATEGIES, aligned_split, even_split, strategy_cost

from ..catalog import element_bytes
from ..plans.parallel import ParallelPlan
from ..plans.plan import Plan


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
