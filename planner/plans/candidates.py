"""What a GNA plan records of its search: the scored configurations and how the choice was made.

`Candidate` is one scored (window, stride, tiles, KV tiling, backend) configuration; `Search` the windows tried, how
many configurations were scored, the best of them, and the best of each backend priced. Both are plain data that
round-trip through JSON inside a plan (plans written before backends read as natsim's Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ..backends import PLANNED


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True)
class Candidate:
    """One scored configuration: its settings, its score and the figures that explain the score.

    `score` is predicted seconds under a cost model, otherwise tile work (token pairs computed, padding
    and masked pairs included: the sum over visited tiles of Q tokens x KV tokens). In a training plan it is
    forward + backward, and `backward_score` the backward's part (None otherwise). `backend` is the kernel backend
    it was scored on (planner.backends.PLANNED).
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
    backend: str = "triton"

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
            "backend": self.backend,
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
            backend=check_backend(data.get("backend", "triton")),  # plans written before backends: Triton
        )


def check_backend(backend: object) -> str:
    """`backend` when it is one a search plans for (planner.backends.PLANNED), else a sentence error."""
    if backend not in PLANNED:
        raise ValueError(f"backend must be one of {PLANNED}, got backend={backend!r}.")
    return backend


@dataclass(frozen=True)
class Search:
    """How the choice was made: the windows tried, the KV tiling modes scored, how many configurations were
    scored, and the best-scored configurations, best first (`top[0]` is the best score, which the tie rule
    may have passed over for a smaller stride); `top` is what a benchmark times to check the cost model.
    `kv_tiling_fixed` says why the modes were narrowed, if they were: "kv_tiling" (asked for with
    `kv_tiling=`), "halo" (static only, for the halo strategy over several ranks) or "precision" (static only,
    what FP8 runs); None means every mode
    the cost model was calibrated on (both without one).

    `backends` are the backends the plan could be picked from (planner.backends); `best_by_backend` holds the
    best candidate (by the tie rule) of every backend priced, those that could not be picked here included;
    `would_pick` is the pick had every priced backend run here (None when each did), and `backend_notes` says, per
    backend a report mentions, why it could not be picked (a sentence). `precisions` holds, for a plan made with
    `precision="auto"`, each precision's best plan as (precision, backend, predicted seconds), or why FP8 was not
    priced as ("fp8", "", nan) with the reason in `backend_notes`' place: `precision_note`."""

    windows: tuple[tuple[int, ...], ...]
    window_given: bool
    band: Optional[tuple[float, float]]
    scored: int
    top: tuple[Candidate, ...]
    tie_tolerance: float
    kv_tilings: tuple[str, ...] = ("static",)
    kv_tiling_fixed: Optional[str] = None
    backends: tuple[str, ...] = ("triton",)
    best_by_backend: tuple[Candidate, ...] = ()
    would_pick: Optional[Candidate] = None
    backend_notes: tuple[tuple[str, str], ...] = ()
    precisions: tuple[tuple[str, str, float], ...] = ()
    precision_note: Optional[str] = None

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
            "kv_tiling_fixed": self.kv_tiling_fixed,
            "backends": list(self.backends),
            "best_by_backend": [c.to_dict() for c in self.best_by_backend],
            "would_pick": None if self.would_pick is None else self.would_pick.to_dict(),
            "backend_notes": dict(self.backend_notes),
            "precisions": [list(p) for p in self.precisions],
            "precision_note": self.precision_note,
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
            kv_tiling_fixed=data.get("kv_tiling_fixed"),
            # plans written before backends: natsim's Triton kernels, the only one priced
            backends=tuple(check_backend(b) for b in data.get("backends", ("triton",))),
            best_by_backend=tuple(Candidate.from_dict(c) for c in data.get("best_by_backend", ())),
            would_pick=None if data.get("would_pick") is None else Candidate.from_dict(data["would_pick"]),
            backend_notes=tuple((check_backend(b), str(note)) for b, note in data.get("backend_notes", {}).items()),
            precisions=tuple((str(p), str(b), float(s)) for p, b, s in data.get("precisions", ())),
            precision_note=data.get("precision_note"),
        )
