"""`ParallelPlan`: a GNA plan run over several GPUs, with its context-parallel strategy and frame split.

A parallel plan holds a single-GPU `Plan` (window, stride, tiles), the strategy and the split of frames along
dimension 0 chosen for it (planner.search.parallel), every runnable strategy's per-rank costs for that split, and
`notes`: one sentence for each strategy that cannot run the plan (and for ulysses' zero heads where it pads
them) and, where the search compared the single-GPU pick with the best configuration the halo strategy runs,
why this one won.
It runs itself through `natsim.distributed.gna_attention`, reports its per-rank table (`rows()`,
`rank_table()`, `explain()`) and round-trips through JSON like a `Plan` (`to_json`, `ParallelPlan.from_json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from natsim.partition import Link, StrategyCost, head_groups, heads_per_rank

from .plan import FORMAT, PARALLEL_KEYS, Plan
from .reading import JsonRecord, check_record, required_keys


@dataclass(frozen=True)
class ParallelPlan(JsonRecord):
    """A single-GPU `plan` run over `world_size` ranks with `strategy` and frames `split` along dimension 0.

    `costs` holds every runnable strategy's per-rank costs for the chosen split (what `rows()` and
    `--world-size` show); `seconds` is the slowest rank's predicted time of the choice; `link` the interconnect its
bytes were priced at (calibrated, or natsim.partition's default); `notes` say what was left
    out and why (module docstring). Attributes not defined here are the single-GPU plan's (window, tiles,
    figures).
    """

    JSON_DOCUMENT = f"a parallel plan JSON document (format {FORMAT!r}, as written by ParallelPlan.to_json)"

    plan: Plan
    world_size: int
    strategy: str
    split: tuple[int, ...]
    costs: Mapping[str, StrategyCost]
    link: Link
    notes: tuple[str, ...] = ()

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
        args.pop("backend")  # natsim.distributed runs natsim's Triton kernels, what a plan over ranks is made for
        return gna_attention(q, k, v, args.pop("window"), args.pop("stride"), args.pop("dilation"),
                             args.pop("causal"), group=group, strategy=self.strategy, split=self.split,
                             scale=scale, **args)

    def rows(self) -> list[dict]:
        """One row per (strategy, rank): frames, heads, tiles, bytes, predicted seconds."""
        return [{"strategy": name, **rank.to_dict()} for name, cost in self.costs.items() for rank in cost.ranks]

    def rank_table(self) -> Table:
        """The per-rank table: every priced strategy's ranks, the chosen one marked with '*'."""
        table = Table(title=f"{self.world_size} ranks, frames split {'/'.join(map(str, self.split))}: "
                            f"{self.strategy} (predicted {self.seconds * 1e3:.2f} ms, slowest rank)",
                      title_justify="left")
        for column in ("strategy", "rank", "frames", "heads", "key frames", "visited tiles", "MB sent",
                       "MB received", "predicted ms"):
            table.add_column(column, justify="left" if column == "strategy" else "right")
        for row in self.rows():
            mark = " *" if row["strategy"] == self.strategy else ""
            table.add_row(row["strategy"] + mark, str(row["rank"]), "{}-{}".format(*row["frames"]),
                          str(row["heads"]), "{}-{}".format(*row["key_frames"]), f"{row['visited_tiles']:,}",
                          f"{row['bytes_sent'] / 1e6:,.1f}", f"{row['bytes_received'] / 1e6:,.1f}",
                          f"{row['predicted_s'] * 1e3:.2f}")
        return table

    def explain(self) -> Group:
        """The single-GPU plan's report, then the choice over the ranks, its notes and the per-rank table."""
        rate = ("its predicted time spread over its visited tiles" if self.plan.calibrated
                else "natsim.partition's default rate (no cost model)")
        step = "forward + backward" if self.plan.training else "forward"
        parts = [self.plan.explain(), Text(
            f"Over {self.world_size} ranks: {self.strategy}, frames split {'/'.join(map(str, self.split))}, "
            f"chosen by the slowest rank's predicted {step} time (tile work priced at {rate}, plus bytes moved at "
            f"{self.link.describe()}).")]
        if "ulysses" in self.costs:
            per_rank = heads_per_rank(self.plan.heads or 1, self.world_size)
            groups = head_groups(per_rank)
            how = (f"in groups of {'/'.join(map(str, groups))} heads, a group's all-to-alls overlapping another "
                   "group's attention (priced so: natsim.partition.pipeline_seconds)" if len(groups) > 1 else
                   "in one group, the all-to-alls before and after its attention (natsim.partition.head_groups: "
                   "one-head groups were measured slower)")
            parts.append(Text(
                f"  - ulysses attends each rank's {per_rank} heads {how}; natsim.distributed moves them on a "
                "high-priority twin of the process group."))
        if self.plan.training and "halo" in self.costs:
            parts.append(Text("  - halo trains on each rank's gathered frames run as a layout of their own, priced "
                              "on that layout's tiles."))
        parts += [Text(f"  - {note}") for note in self.notes]
        parts.append(self.rank_table())
        return Group(*parts)

    def to_dict(self) -> dict:
        return {**self.plan.to_dict(), "world_size": self.world_size, "strategy": self.strategy,
                "split": list(self.split), "parallel_predicted_s": self.seconds,
                "link": self.link.to_dict(), "notes": list(self.notes),
                "strategies": {name: cost.to_dict() for name, cost in self.costs.items()}}

    @classmethod
    def from_dict(cls, data: Mapping) -> "ParallelPlan":
        """Rebuild a parallel plan from `to_dict` output: its single-GPU plan (`Plan.from_dict` on the same
        record), then the ranks, strategy, split, link and notes as they were written."""
        needed = ("world_size", "strategy", "split", "link", "strategies")
        check_record(data, "a parallel plan", FORMAT, needed, "ParallelPlan.to_dict")
        plan = Plan.from_dict({key: value for key, value in data.items() if key not in PARALLEL_KEYS})
        with required_keys("a parallel plan's 'strategies' and 'link'"):
            try:
                costs = {str(name): StrategyCost.from_dict(cost) for name, cost in data["strategies"].items()}
                link = Link.from_dict(data["link"])
                strategy, split = str(data["strategy"]), tuple(int(frames) for frames in data["split"])
            except (AttributeError, TypeError) as error:
                raise ValueError(f"a parallel plan's 'strategies', 'link' and 'split' must be as "
                                 f"ParallelPlan.to_dict writes them: {error}.") from None
        frames, world_size = plan.problem.shape[0], data["world_size"]
        if strategy not in costs or sum(split) != frames or len(split) != world_size or min(split) < 1:
            raise ValueError(f"a parallel plan must run one of its priced strategies {sorted(costs)} over a split of "
                             f"the {frames} frames into world_size={world_size} parts of one frame or more, got "
                             f"strategy={strategy!r}, split={split}.")
        return cls(plan=plan, world_size=len(split), strategy=strategy, split=split, costs=costs,
                   link=link, notes=tuple(str(note) for note in data.get("notes", ())))

