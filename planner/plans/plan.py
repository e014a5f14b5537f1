"""`Plan`: one chosen GNA configuration, what the planner predicted for it, and a way to run it.

A plan is plain data (window, stride, tiles, predictions, runners-up) that round-trips through JSON, so it
can be computed once per layer shape and reused; calling it runs `natsim.kernels.gna_attention` with
exactly its settings, on the kernel backend it was planned for (natsim's Triton kernels or FlashAttention-4).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional

import torch
from rich.console import Group

from natsim import Problem, SimResult, TileConfig, simulate
from natsim.kernels import gna_attention
from natsim.kernels.backends.triton import check_precision
from natsim.simulate import FIGURES

from ..catalog import as_dtype
from ..cost.backward_features import backward_work
from .candidates import Candidate, Search, check_backend
from .explain import explain_plan
from .ranking import BASIS_COST_MODEL
from .reading import JsonRecord, check_basis, check_record, required_keys

FORMAT = "natsim-plan/1"
# What ParallelPlan.to_dict adds to its single-GPU plan's record (a record with them is a parallel plan's).
PARALLEL_KEYS = ("world_size", "strategy", "split", "parallel_predicted_s", "link", "notes", "strategies")


@dataclass(frozen=True)
class Plan(JsonRecord):
    """A GNA configuration chosen by `natsim.planner.best`, runnable on q, k, v.

    `basis` says how configurations were ranked: "cost model" (predicted seconds on `gpu`) or
    "simulated tiles" (no coefficients for the GPU at hand: tile work only, no time prediction).
    `score` / `dense_score` are in the basis' unit: seconds, or token pairs of tile work; the dense
    reference is self attention as `gna_attention` runs it: 1-D over the flattened layout, 128-token tiles.
    A `training` plan was ranked by forward + backward (`best(..., training=True)`): `score` and `dense_score`
    are sums, `backward_score` / `dense_backward_score` their backward parts (the backward runs its own tiles,
    `backward_tiles`); otherwise those are None. `precision` is "fp8" for a plan of the FP8 inference kernel
    (`best(..., precision="fp8")`: it runs quantized, without gradients), else None. `backend` is the kernel
    backend it runs on: "triton" (natsim's kernels), "fa4" (FlashAttention-4) or "gluon" (natsim's Gluon FP8
    kernel; planner.backends).
    """

    JSON_DOCUMENT = f"a plan JSON document (format {FORMAT!r}, as written by Plan.to_json)"

    problem: Problem
    tiles: TileConfig
    target_sparsity: float
    head_dim: int
    dtype: str
    heads: Optional[int]
    gpu: Optional[str]
    basis: str
    score: float
    dense_score: float
    breakdown: Mapping[str, float]
    runners_up: tuple[Candidate, ...]
    search: Search
    training: bool = False
    backward_score: Optional[float] = None
    dense_backward_score: Optional[float] = None
    precision: Optional[str] = None
    backend: str = "triton"

    @cached_property
    def simulation(self) -> SimResult:
        """Every simulated figure of the chosen configuration (natsim.simulate)."""
        return simulate(self.problem, self.tiles)

    # -- what was predicted ------------------------------------------------------------------------

    @property
    def calibrated(self) -> bool:
        """True when a cost model fitted on `gpu` ranked the configurations."""
        return self.basis == BASIS_COST_MODEL

    @property
    def predicted_time_s(self) -> Optional[float]:
        """Predicted seconds per call (any permutation included) for `heads` heads (one head when None),
        batch 1; None without a cost model."""
        return self.score if self.calibrated else None

    @property
    def forward_score(self) -> float:
        """The forward's part of `score`, in the basis' unit."""
        return self.score - (self.backward_score or 0.0)

    @property
    def predicted_forward_time_s(self) -> Optional[float]:
        """Predicted seconds of the forward call alone; None without a cost model."""
        return self.forward_score if self.calibrated else None

    @property
    def predicted_backward_time_s(self) -> Optional[float]:
        """Predicted seconds of the backward call (training plans under a cost model), else None."""
        return self.backward_score if self.calibrated else None

    @property
    def backward_tiles(self) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(Q tile, KV tile) the backward runs for this plan (training plans), else None: FlashAttention-4's runs
        the forward's blocks, natsim's backward kernels tiles of their own."""
        if not self.training:
            return None
        if self.backend == "fa4":
            return self.tiles.q_tile, self.tiles.kv_tile
        work = backward_work(self.problem, self.head_dim)
        return work.q_tile, work.kv_tile

    @property
    def predicted_speedup(self) -> float:
        """Dense reference over this plan, in the basis' unit (time, or tile work without a cost model)."""
        return self.dense_score / self.score

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the plan was made for, as a torch dtype (q, k, v should have it)."""
        return as_dtype(self.dtype)

    @property
    def sparsity(self) -> float:
        return self.simulation.sparsity

    @property
    def tile_speedup(self) -> float:
        return self.simulation.tile_speedup

    # -- running ------------------------------------------------------------------------------------

    def kernel_arguments(self) -> dict:
        """The keyword arguments of `natsim.kernels.gna_attention` that this plan runs with."""
        arguments = {
            "window": self.problem.window,
            "stride": self.problem.stride,
            "dilation": self.problem.dilation,
            "causal": self.problem.causal,
            "q_tile": self.tiles.q_tile,
            "kv_tile": self.tiles.kv_tile,
            "kv_tiling": self.tiles.kv_tiling,
            "backend": self.backend,
        }
        if self.precision is not None:
            arguments["precision"] = self.precision
        return arguments

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None, return_lse: bool = False
    ):
        """GNA of `[B, *shape, heads, head_dim]` tensors with this plan's window, stride, tiles, KV tiling mode,
        precision and backend (returns what `gna_attention` returns: the output, and with `return_lse` its log-sum-exp)."""
        if isinstance(q, torch.Tensor) and tuple(q.shape[1:-2]) != self.problem.shape:
            raise ValueError(
                f"this plan is for token layout shape={self.problem.shape}, got q with spatial shape "
                f"{tuple(q.shape[1:-2])} (q must be [batch, *shape, heads, head_dim])."
            )
        return gna_attention(q, k, v, scale=scale, return_lse=return_lse, **self.kernel_arguments())

    # -- reporting and storage ---------------------------------------------------------------------

    def explain(self) -> Group:
        """A rich renderable report: the choice, the runners-up, and why (print it with rich.print)."""
        return explain_plan(self)

    def to_dict(self) -> dict:
        record = self.simulation.to_dict()
        return {
            "format": FORMAT,
            "problem": self.problem.to_dict(),
            "tiles": self.tiles.to_dict(),
            "target_sparsity": self.target_sparsity,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "heads": self.heads,
            "gpu": self.gpu,
            "basis": self.basis,
            "score": self.score,
            "dense_score": self.dense_score,
            "predicted_time_s": self.predicted_time_s,
            "predicted_speedup": self.predicted_speedup,
            "breakdown": dict(self.breakdown),
            "figures": {name: record[name] for name in FIGURES},
            "runners_up": [c.to_dict() for c in self.runners_up],
            "search": self.search.to_dict(),
            "training": self.training,
            "backward_score": self.backward_score,
            "dense_backward_score": self.dense_backward_score,
            "predicted_forward_time_s": self.predicted_forward_time_s,
            "predicted_backward_time_s": self.predicted_backward_time_s,
            "precision": self.precision,
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Plan":
        """Rebuild a plan from `to_dict` output; its figures are re-simulated (exact and cheap)."""
        needed = (  # what is read back; the figures that to_dict also writes are re-simulated instead
            "problem", "tiles", "target_sparsity", "head_dim", "dtype", "heads", "gpu", "basis", "score",
            "dense_score", "breakdown", "runners_up", "search",
        )
        check_record(data, "a plan", FORMAT, needed, "Plan.to_dict")
        if "world_size" in data:
            raise ValueError(f"this record is a plan over world_size={data['world_size']} ranks (ParallelPlan.to_dict): "
                             "read it with ParallelPlan.from_dict or ParallelPlan.from_json, which keep its strategy "
                             "and frame split.")
        check_basis(data["basis"])
        if data.get("training") and data.get("backward_score") is None:
            raise ValueError("a training plan (training=true) must have a numeric 'backward_score', got None.")
        with required_keys("a plan's 'problem'"):
            p = data["problem"]
            problem = Problem(p["shape"], p["window"], p["stride"], p["dilation"], p["causal"])
        with required_keys("a plan's 'tiles'"):
            t = data["tiles"]
            tiles = TileConfig(t["q_tile"], t["kv_tile"], t["tiling"], t["kv_tiling"])
        with required_keys("a plan's 'runners_up'"):
            runners_up = tuple(Candidate.from_dict(c) for c in data["runners_up"])
        with required_keys("a plan's 'search'"):
            search = Search.from_dict(data["search"])
        return cls(
            problem=problem,
            tiles=tiles,
            target_sparsity=float(data["target_sparsity"]),
            head_dim=int(data["head_dim"]),
            dtype=str(data["dtype"]),
            heads=None if data["heads"] is None else int(data["heads"]),
            gpu=data["gpu"],
            basis=data["basis"],
            score=float(data["score"]),
            dense_score=float(data["dense_score"]),
            breakdown={k: float(v) for k, v in data["breakdown"].items()},
            runners_up=runners_up,
            search=search,
            training=bool(data.get("training", False)),  # plans written before training plans: forward only
            backward_score=None if data.get("backward_score") is None else float(data["backward_score"]),
            dense_backward_score=(None if data.get("dense_backward_score") is None
                                  else float(data["dense_backward_score"])),
            precision=check_precision(data.get("precision")),  # plans written before FP8: the inputs' dtype
            backend=check_backend(data.get("backend", "triton")),  # plans written before backends: Triton
        )

