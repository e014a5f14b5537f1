"""Planning for several GPUs: which context-parallel strategy and frame split run a GNA plan fastest.

`parallel_plan(plan, world_size)` takes a single-GPU `Plan` (window, stride, tiles from `best`) and ranks every
(strategy, split) pair that can run it by its slowest rank (natsim.partition.strategy_cost): the rank's tile
work, priced per visited tile from the plan's own prediction when a cost model ranked it (its predicted seconds
spread evenly over its visited tiles, every head), else at natsim.partition's default rate, plus the bytes it
sends or receives at the interconnect's rate for the strategy's move (`link`: calibrated on the machine by
`natsim calibrate --link`, else natsim.partition's default). Splits tried: even, and aligned to stride groups along frames.

A training plan (`best(..., training=True)`) is priced forward + backward: per visited tile its forward and
backward predictions apart, the backward's moves (the output's gradient in, those of q, k and v back for ulysses;
the halo frames' gradients back) at the same link. The halo strategy trains where a rank's gathered frames run
as a layout of their own (`natsim.distributed.strategies.trains_on_gathered_frames`: stride 1, dilation 1 and no
causal window along the frames), and is priced on that layout's tiles there.

Not every strategy runs every plan: ulysses shards heads (padded with zero heads where the world size does not
divide them, which the price counts), and the halo strategy runs its frame ranges with static KV tiling only
(natsim.distributed), and trains only with stride 1 along the frames. For a plan the halo strategy cannot run,
`best` passes the best configuration it can (`halo_plan`: static KV tiling, and for training stride 1 along the
frames), both are priced, and the faster over the ranks is the plan. Each strategy left out, and that comparison, is said in one sentence in the
result's `notes` (`ParallelPlan.explain()`).
"""

from __future__ import annotations

import numbers

from typing import Optional

from natsim.distributed.strategies import trains_on_gathered_frames
from natsim.partition import DEFAULT_LINK, STRATEGIES, Link, aligned_split, even_split, heads_per_rank, strategy_cost

from ..catalog import element_bytes
from ..plans.parallel import ParallelPlan
from ..plans.plan import Plan


def check_world_size(world_size: object, frames: int) -> int:
    """`world_size` when it is a positive int no larger than the `frames` of dimension 0 (each rank holds whole
    frames), else a sentence error."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got world_size={world_size!r}.")
    world_size = int(world_size)
    if world_size > frames:
        raise ValueError(f"world_size cannot exceed the {frames} frames of dimension 0 (each rank holds whole "
                         f"frames), got world_size={world_size}.")
    return world_size


def _describe(plan: Plan) -> str:
    dims = lambda values: "x".join(map(str, values))  # noqa: E731
    return (f"window {dims(plan.problem.window)}, stride {dims(plan.problem.stride)}, tiles "
            f"{dims(plan.tiles.q_tile)} / {dims(plan.tiles.kv_tile)}, {plan.tiles.kv_tiling} KV tiling")


def strategies_for(plan: Plan, world_size: int) -> tuple[list[str], list[str]]:
    """The strategies that can run `plan` over `world_size` ranks (ulysses always), and one sentence for each
    that cannot, and for ulysses' padding where it pads heads."""
    heads = plan.heads or 1
    runnable, notes = [], []
    for name in STRATEGIES:
        if name == "ulysses" and heads % world_size:
            per_rank = heads_per_rank(heads, world_size)
            notes.append(f"ulysses pads heads={heads} with {per_rank * world_size - heads} zero "
                         f"head{'s' if per_rank * world_size - heads > 1 else ''} to shard them over {world_size} "
                         f"ranks, {per_rank} a rank (priced with them).")
            runnable.append(name)
        elif name == "halo" and plan.training and not trains_on_gathered_frames(plan.problem):
            notes.append(f"halo cannot train {_describe(plan)}: its gradients run on a rank's gathered frames as a "
                         "layout of their own, which needs stride 1, dilation 1 and no causal window along the "
                         "frames (GNA on frame ranges has no backward kernel).")
        elif name == "halo" and plan.tiles.kv_tiling != "static":
            notes.append(f"halo cannot run {_describe(plan)}: its frame ranges run static KV tiling only.")
        else:
            runnable.append(name)
    return runnable, notes


def _priced(plan: Plan, world_size: int, strategies: list[str], link: Link, batch: int):
    """`(split, costs, strategy)`: every runnable strategy's per-rank costs for the split whose best strategy is
    fastest, and that strategy."""
    problem, heads = plan.problem, plan.heads or 1
    tile_seconds = backward_tile_seconds = None
    if plan.calibrated:
        tiles = max(1, plan.simulation.visited_tiles * heads)
        tile_seconds = plan.forward_score / tiles
        if plan.training:
            backward_tile_seconds = plan.backward_score / tiles
    options = []
    for split in dict.fromkeys((even_split(problem.shape[0], world_size), aligned_split(problem, world_size))):
        costs = {s: strategy_cost(problem, plan.tiles, split, s, batch=batch, heads=heads, head_dim=plan.head_dim,
                                  element_bytes=element_bytes(plan.torch_dtype), tile_seconds=tile_seconds,
                                  link=link, training=plan.training, backward_tile_seconds=backward_tile_seconds,
                                  halo_on_gathered=plan.training)
                 for s in strategies}
        options.append((split, costs))
    return min(((split, costs, name) for split, costs in options for name in costs),
               key=lambda option: option[1][option[2]].seconds)


def parallel_plan(plan: Plan, world_size: int, *, halo_plan: Optional[Plan] = None,
                  link: Link = DEFAULT_LINK, batch: int = 1) -> ParallelPlan:
    """The fastest (strategy, split) for `plan` on `world_size` ranks, or for `halo_plan` (the best
    configuration the halo strategy runs, for a `plan` it cannot) when that is faster (module docstring)."""
    check_world_size(world_size, plan.problem.shape[0])
    priced, notes = [], []
    for candidate in (plan,) if halo_plan is None else (plan, halo_plan):
        runnable, said = strategies_for(candidate, world_size)  # ulysses among them: it runs every plan
        notes += [note for note in said if note not in notes]  # the padding's note is the same for both
        priced.append((candidate, *_priced(candidate, world_size, runnable, link, batch)))
    chosen, split, costs, strategy = min(priced, key=lambda option: option[2][option[3]].seconds)
    if halo_plan is not None:
        notes.append(_comparison(plan, halo_plan, chosen, priced, world_size))
    return ParallelPlan(chosen, world_size, strategy, split, costs, link, tuple(notes))


def halo_runs(plan: Plan) -> bool:
    """Whether the halo strategy runs `plan` (heads aside): static KV tiling, and to train, a rank's gathered
    frames as a layout of their own."""
    return plan.tiles.kv_tiling == "static" and (not plan.training or trains_on_gathered_frames(plan.problem))


def _comparison(plan: Plan, halo_plan: Plan, chosen: Plan, priced: list, world_size: int) -> str:
    """The sentence saying why the plan over the ranks is the single-GPU pick or the best one the halo strategy
    runs."""
    seconds = {id(option[0]): option[2][option[3]].seconds for option in priced}
    why = ("tiles KV dynamically, which only ulysses runs over several ranks" if plan.tiles.kv_tiling != "static"
           else f"has stride {plan.problem.stride[0]} along the frames, and the halo strategy trains only with "
                f"stride 1 there")
    priced_too = (f"The single-GPU pick {why}, so the best configuration the halo strategy runs "
                  f"({_describe(halo_plan)}) was priced as well: ")
    if chosen is plan:
        return (priced_too + f"the single-GPU pick is faster over {world_size} ranks ({seconds[id(plan)] * 1e3:.4g} "
                f"ms vs {seconds[id(halo_plan)] * 1e3:.4g} ms, slowest rank).")
    return (priced_too + f"it is faster over {world_size} ranks ({seconds[id(halo_plan)] * 1e3:.4g} ms vs "
            f"{seconds[id(plan)] * 1e3:.4g} ms, slowest rank), so the plan runs it.")
