"""`Plan`: one chosen GNA configuration, what the planner predicted for it, and a way to run it.

A plan is plain data (window, stride, tiles, predictions, runners-up) that round-trips through JSON, so it
can be computed once per layer shape and reused; calling it runs `natsim.kernels.gna_attention` with
exactly its settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional

import torch
from rich.console import Group

from natsim import Problem, SimResult, TileConfig, simulate
from natsim.kernels import gna_attention
from natsim.simulate import FIGURES

from .catalog import as_dtype
from .explain import explain_plan

FORMAT = "natsim-plan/1"
BASIS_COST_MODEL = "cost model"
BASIS_TILES = "simulated tiles"


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True)
class Candidate:
    """One scored configuration: its settings, its score and the figures that explain the score.

    `score` is predicted seconds under a cost model, otherwise tile work (token pairs computed, padding
    and masked pairs included: the sum over visited tiles of Q tokens x KV tokens). In a training plan it is
    forward + backward, and `backward_score` the backward's part (None otherwise).
    """

    window: tuple[int, ...]
    stride: tuple[int, ...]
    q_tile: tuple[int, ...]
    kv_tile: tuple[int, ...]
    score: float
    sparsity: float
    tile_speedup: float
    block_sparse: bool
    kv_tiling: str = "static"
    backward_score: Optional[float] = None

    def to_dict(self) -> dict:
        extra = {} if self.backward_score is None else {"backward_score": self.backward_score}
        return {
            "window": list(self.window),
            "stride": list(self.stride),
            "q_tile": list(self.q_tile),
            "kv_tile": list(self.kv_tile),
            "kv_tiling": self.kv_tiling,
            "score": self.score,
            "sparsity": self.sparsity,
            "tile_speedup": self.tile_speedup,
            "block_sparse": self.block_sparse,
            **extra,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Candidate":
        return cls(
            window=_ints(data["window"]),
            stride=_ints(data["stride"]),
            q_tile=_ints(data["q_tile"]),
            kv_tile=_ints(data["kv_tile"]),
            score=float(data["score"]),
            sparsity=float(data["sparsity"]),
            tile_speedup=float(data["tile_speedup"]),
            block_sparse=bool(data["block_sparse"]),
            kv_tiling=str(data.get("kv_tiling", "static")),  # plans written before dynamic KV tiling: static
            backward_score=None if data.get("backward_score") is None else float(data["backward_score"]),
        )


@dataclass(frozen=True)
class Search:
    """How the choice was made: the windows tried, the KV tiling modes scored, how many configurations were
    scored, and the best-scored configurations, best first (`top[0]` is the best score, which the tie rule
    may have passed over for a smaller stride); `top` is what a benchmark times to check the cost model."""

    windows: tuple[tuple[int, ...], ...]
    window_given: bool
    band: Optional[tuple[float, float]]
    scored: int
    top: tuple[Candidate, ...]
    tie_tolerance: float
    kv_tilings: tuple[str, ...] = ("static",)

    @property
    def fastest(self) -> Candidate:
        return self.top[0]

    def to_dict(self) -> dict:
        return {
            "windows": [list(w) for w in self.windows],
            "window_given": self.window_given,
            "band": None if self.band is None else list(self.band),
            "scored": self.scored,
            "top": [c.to_dict() for c in self.top],
            "tie_tolerance": self.tie_tolerance,
            "kv_tilings": list(self.kv_tilings),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Search":
        return cls(
            windows=tuple(_ints(w) for w in data["windows"]),
            window_given=bool(data["window_given"]),
            band=None if data["band"] is None else (float(data["band"][0]), float(data["band"][1])),
            scored=int(data["scored"]),
            top=tuple(Candidate.from_dict(c) for c in data["top"]),
            tie_tolerance=float(data["tie_tolerance"]),
            kv_tilings=tuple(str(m) for m in data.get("kv_tilings", ("static",))),  # older plans: static only
        )


@dataclass(frozen=True)
class Plan:
    """A GNA configuration chosen by `natsim.planner.best`, runnable on q, k, v.

    `basis` says how configurations were ranked: "cost model" (predicted seconds on `gpu`) or
    "simulated tiles" (no coefficients for the GPU at hand: tile work only, no time prediction).
    `score` / `dense_score` are in the basis' unit: seconds, or token pairs of tile work; the dense
    reference is self attention as `gna_attention` runs it: 1-D over the flattened layout, 128-token tiles.
    A `training` plan was ranked by forward + backward (`best(..., training=True)`): `score` and `dense_score`
    are sums, `backward_score` / `dense_backward_score` their backward parts (the backward runs its own tiles,
    `backward_tiles`); otherwise those are None.
    """

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
        """(Q tile, KV tile) the backward runs for this plan (training plans), else None."""
        if not self.training:
            return None
        from .backward_features import backward_work

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
        return {
            "window": self.problem.window,
            "stride": self.problem.stride,
            "dilation": self.problem.dilation,
            "causal": self.problem.causal,
            "q_tile": self.tiles.q_tile,
            "kv_tile": self.tiles.kv_tile,
            "kv_tiling": self.tiles.kv_tiling,
        }

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None, return_lse: bool = False
    ):
        """GNA of `[B, *shape, heads, head_dim]` tensors with this plan's window, stride, tiles and KV tiling
        mode (returns what `gna_attention` returns: the output, and with `return_lse` its log-sum-exp)."""
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
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Plan":
        """Rebuild a plan from `to_dict` output; its figures are re-simulated (exact and cheap)."""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"a plan must be a JSON object with format {FORMAT!r} (as Plan.to_dict writes it), got a value "
                f"of type {type(data).__name__}."
            )
        if data.get("format") != FORMAT:
            raise ValueError(f"a plan must have format {FORMAT!r}, got format={data.get('format')!r}.")
        needed = (  # what is read back; the figures that to_dict also writes are re-simulated instead
            "problem", "tiles", "target_sparsity", "head_dim", "dtype", "heads", "gpu", "basis", "score",
            "dense_score", "breakdown", "runners_up", "search",
        )
        missing = [key for key in needed if key not in data]
        if missing:
            keys = ", ".join(repr(key) for key in missing)
            raise ValueError(
                f"a plan with format {FORMAT!r} must have the key{'s' if len(missing) > 1 else ''} {keys}, "
                f"which {'are' if len(missing) > 1 else 'is'} missing."
            )
        if data["basis"] not in (BASIS_COST_MODEL, BASIS_TILES):
            raise ValueError(
                f"basis must be {BASIS_COST_MODEL!r} or {BASIS_TILES!r}, got basis={data['basis']!r}."
            )
        if data.get("training") and data.get("backward_score") is None:
            raise ValueError("a training plan (training=true) must have a numeric 'backward_score', got None.")
        section = "problem"
        try:
            p = data["problem"]
            problem = Problem(p["shape"], p["window"], p["stride"], p["dilation"], p["causal"])
            section, t = "tiles", data["tiles"]
            tiles = TileConfig(t["q_tile"], t["kv_tile"], t["tiling"], t["kv_tiling"])
            section = "runners_up"
            runners_up = tuple(Candidate.from_dict(c) for c in data["runners_up"])
            section = "search"
            search = Search.from_dict(data["search"])
        except KeyError as error:
            raise ValueError(f"a plan's {section!r} must have the key {error.args[0]!r}, which is missing.") from None
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
        )

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Rebuild a plan from `to_json` output."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"Plan.from_json expects a plan JSON document (format {FORMAT!r}, as written by Plan.to_json), "
                f"but parsing failed at line {error.lineno}, column {error.colno}: {error.msg}."
            ) from None
        return cls.from_dict(data)
