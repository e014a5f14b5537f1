"""Planning for several GPUs: which context-parallel strategy and frame split run a GNA plan fastest.

`parallel_plan(plan, world_size)` takes a single-GPU `Plan` (window, stride, tiles from `best`) and ranks every
(strategy, split) pair that can run it by its slowest rank (natsim.partition.strategy_cost): the rank's tile
work, priced per visited tile from the plan's own prediction when a cost model ranked it (its predicted seconds
spread evenly over its visited tiles, every head), else at natsim.partition's default rate, plus the bytes it
sends or receives at the interconnect's rate for the strategy's move (`link`: calibrated on the machine by
`natsim calibrate --link`, else natsim.partition's default). Splits tried: even, and aligned to stride groups along frames.

Not every strategy runs every plan: ulysses shards heads, so the heads must divide by the world size, and the
halo strategy runs its frame ranges with static KV tiling only (natsim.distributed). A plan that tiles KV
dynamically therefore runs only under ulysses; `best` passes the best configuration with static KV tiling as
well (`static_plan`), both are priced, and the faster over the ranks is the plan. Each strategy left out, and
that comparison, is said in one sentence in the result's `notes` (`ParallelPlan.explain()`).
"""

from __future__ import annotations

from typing import Optional

from natsim.partition import DEFAULT_LINK, STRATEGIES, Link, aligned_split, even_split, strategy_cost

from ..catalog import element_bytes
from ..plans.parallel import ParallelPlan
from ..plans.plan import Plan


def check_world_size(world_size: object, frames: int) -> int:
    """`world_size` when it is a positive int no larger than the `frames` of dimension 0 (each rank holds whole
    frames), else a sentence error."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got world_size={world_size!r}.")
    if world_size > frames:
        raise ValueError(f"world_size cannot exceed the {frames} frames of dimension 0 (each rank holds whole "
                         f"frames), got world_size={world_size}.")
    return world_size


def _describe(plan: Plan) -> str:
    dims = lambda values: "x".join(map(str, values))  # noqa: E731
    return (f"window {dims(plan.problem.window)}, stride {dims(plan.problem.stride)}, tiles "
            f"{dims(plan.tiles.q_tile)} / {dims(plan.tiles.kv_tile)}, {plan.tiles.kv_tiling} KV tiling")


def strategies_for(plan: Plan, world_size: int) -> tuple[list[str], list[str]]:
    """The strategies that can run `plan` over `world_size` ranks, and one sentence for each that cannot."""
    heads = plan.heads or 1
    runnable, notes = [], []
    for name in STRATEGIES:
        if name == "ulysses" and heads % world_size:
            notes.append(f"ulysses cannot run {_describe(plan)}: it shards heads over the ranks, and heads={heads} "
                         f"cannot be split evenly over {world_size} ranks.")
        elif name == "halo" and plan.tiles.kv_tiling != "static":
            notes.append(f"halo cannot run {_describe(plan)}: its frame ranges run static KV tiling only.")
        else:
            runnable.append(name)
    return runnable, notes


def _priced(plan: Plan, world_size: int, strategies: list[str], link: Link, batch: int):
    """`(split, costs, strategy)`: every runnable strategy's per-rank costs for the split whose best strategy is
    fastest, and that strategy."""
    problem, heads = plan.problem, plan.heads or 1
    tile_seconds = None
    if plan.calibrated:
        tile_seconds = plan.score / max(1, plan.simulation.visited_tiles * heads)
    options = []
    for split in dict.fromkeys((even_split(problem.shape[0], world_size), aligned_split(problem, world_size))):
        costs = {s: strategy_cost(problem, plan.tiles, split, s, batch=batch, heads=heads, head_dim=plan.head_dim,
                                  element_bytes=element_bytes(plan.torch_dtype), tile_seconds=tile_seconds,
                                  link=link)
                 for s in strategies}
        options.append((split, costs))
    return min(((split, costs, name) for split, costs in options for name in costs),
               key=lambda option: option[1][option[2]].seconds)


def parallel_plan(plan: Plan, world_size: int, *, static_plan: Optional[Plan] = None,
                  link: Link = DEFAULT_LINK, batch: int = 1) -> ParallelPlan:
    """The fastest (strategy, split) for `plan` on `world_size` ranks, or for `static_plan` (the best
    configuration with static KV tiling, for a `plan` that tiles KV dynamically) when that is faster
    (module docstring)."""
    check_world_size(world_size, plan.problem.shape[0])
    priced, refusals = [], []
    for candidate in (plan,) if static_plan is None else (plan, static_plan):
        runnable, notes = strategies_for(candidate, world_size)
        refusals += notes
        if runnable:
            priced.append((candidate, *_priced(candidate, world_size, runnable, link, batch)))
    if not priced:
        raise ValueError(f"no context-parallel strategy can run this plan over {world_size} ranks: "
                         + " ".join(refusals))
    chosen, split, costs, strategy = min(priced, key=lambda option: option[2][option[3]].seconds)
    notes = refusals if static_plan is None else [*refusals, _comparison(plan, static_plan, chosen, priced, world_size)]
    return ParallelPlan(chosen, world_size, strategy, split, costs, link, tuple(notes))


def _comparison(plan: Plan, static_plan: Plan, chosen: Plan, priced: list, world_size: int) -> str:
    """The sentence saying why the plan over the ranks is the single-GPU pick or the best static one."""
    seconds = {id(option[0]): option[2][option[3]].seconds for option in priced}
    if id(plan) not in seconds:
        return ("The single-GPU pick runs under no strategy here, so the plan is the best configuration with static "
                "KV tiling.")
    priced_too = (f"The single-GPU pick tiles KV dynamically, which only ulysses runs over several ranks, so the "
                  f"best configuration with static KV tiling ({_describe(static_plan)}) was priced as well: ")
    if chosen is plan:
        return (priced_too + f"the single-GPU pick is faster over {world_size} ranks ({seconds[id(plan)] * 1e3:.4g} "
                f"ms vs {seconds[id(static_plan)] * 1e3:.4g} ms, slowest rank).")
    return (priced_too + f"it is faster over {world_size} ranks ({seconds[id(static_plan)] * 1e3:.4g} ms vs "
            f"{seconds[id(plan)] * 1e3:.4g} ms, slowest rank), so the plan runs it.")
