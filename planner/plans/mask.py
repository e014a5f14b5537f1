"""`MaskPlan`: the block granularity and query merging chosen for a predicted mask, and a way to run it.

A content-adaptive predictor (natsim.masks: topp, sparge, hierarchical, or a GNA window) gives a block mask at
its finest granularity, say 16 x 16 tokens. The sparse kernel can run it there, or OR-pooled to coarser blocks
(`or_pool`: 32, 64, 128 tokens along queries and keys; a coarse block is attended when any of its fine blocks
is, so pooling never drops a block the predictor kept), with small query blocks merged into 128-query programs
or not (`natsim.merge`: consecutive, or FG-Attn's XOR greedy). `best_mask` (planner.search.mask) scores those
ways and returns the fastest as a `MaskPlan`, with every candidate it scored (`MaskCandidate`).

A mask plan is plain data that round-trips through JSON (the mask itself is not stored there), `explain()`, and
`plan(q, k, v)` / `plan(q, k, v, mask=fine_mask)` running `sparse_attention` at the chosen granularity and
merge, on the kernel backend it was planned for (natsim's Triton kernels, FlashAttention-4 for unmerged blocks
it runs, or natsim's Gluon kernel for unmerged 128 x 128 blocks in FP8 or, for inference, in 16 bits). A plan
made for one mask serves the next masks of the same layer and shape (the next diffusion steps), which is how the
diffusers example uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Union

import numpy as np
import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from natsim.kernels import SparseMask, SparseWork, prepare_sparse, sparse_attention
from natsim.kernels.backends.triton import (MIN_Q_BLOCK, check_block, check_dense_mask, check_precision, check_seq_len,
                                           runs_eagerly, use_triton)

from ..catalog import as_dtype
from .candidates import check_backend
from .explain import Gain, backend_label, backend_lines, versus
from .ranking import BASIS_COST_MODEL, TIE_TOLERANCE
from .reading import JsonRecord, check_basis, check_record, required_keys

FORMAT = "natsim-mask-plan/1"
MERGES = ("none", "consecutive", "xor")  # "none" is sparse_attention's merge=None

MaskLike = Union[torch.Tensor, SparseMask, np.ndarray]


# -- the masks a plan takes: checked in any of their forms, OR-pooled to its blocks ------------------------------


def or_pool(mask: torch.Tensor, q_factor: int, kv_factor: int) -> torch.Tensor:
    """A boolean `[B, H, nQ, nKV]` block mask pooled by `q_factor` x `kv_factor` blocks: coarse block (i, j) is
    True when any fine block of it is, so pooling never drops an attended block. Fine blocks past the end count
    as False: `ceil(nQ / q_factor)` x `ceil(nKV / kv_factor)` blocks, which are those of the coarser block sizes
    on the same N (ceil(ceil(N / a) / f) = ceil(N / (a f)))."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(f"mask must be a boolean [B, H, nQ, nKV] tensor, got {_describe(mask)}.")
    for name, value in (("q_factor", q_factor), ("kv_factor", kv_factor)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}.")
    if q_factor == 1 and kv_factor == 1:
        return mask
    batch, heads, num_q, num_kv = mask.shape
    rows, cols = -(-num_q // q_factor), -(-num_kv // kv_factor)
    padded = torch.zeros((batch, heads, rows * q_factor, cols * kv_factor), dtype=torch.bool, device=mask.device)
    padded[..., :num_q, :num_kv] = mask
    return padded.view(batch, heads, rows, q_factor, cols, kv_factor).any(5).any(3)


def fine_mask(mask: MaskLike, q_block: Optional[int], kv_block: Optional[int], seq_len: Optional[int]) -> torch.Tensor:
    """The boolean `[B|1, H|1, nQ, nKV]` tensor of a mask given as a tensor, numpy array or SparseMask, checked
    against its blocks and N."""
    if isinstance(mask, SparseMask):
        for name, given, own in (("q_block", q_block, mask.q_block), ("kv_block", kv_block, mask.kv_block),
                                 ("seq_len", seq_len, mask.seq_len)):
            if given is not None and given != own:
                raise ValueError(f"{name} must match the SparseMask's {name}={own}, got {name}={given}.")
        return mask.to_dense()
    if isinstance(mask, np.ndarray):
        if mask.dtype != np.bool_:
            raise ValueError(f"mask must be a boolean array, got {_describe(mask)}.")
        mask = torch.from_numpy(mask)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a boolean torch.Tensor, numpy array or SparseMask, got {_describe(mask)}.")
    if q_block is None or kv_block is None or seq_len is None:
        raise ValueError(
            "q_block, kv_block and seq_len must be given with a mask tensor or array (tokens per mask row and "
            f"column, and N), got q_block={q_block}, kv_block={kv_block}, seq_len={seq_len}."
        )
    q_block, kv_block = check_block("q_block", q_block, MIN_Q_BLOCK), check_block("kv_block", kv_block)
    seq_len = check_seq_len(seq_len)
    return check_dense_mask(mask, -(-seq_len // q_block), -(-seq_len // kv_block))


def _flag(value, name: str) -> bool:
    """A JSON record's boolean field, or a sentence error."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {name}={value!r}.")
    return value


def _describe(value) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"a {type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


# -- what a plan holds --------------------------------------------------------------------------------------------


def _ratio(dense: float, score: float) -> float:
    return dense / score if score > 0 else math.inf


@dataclass(frozen=True)
class MaskCandidate:
    """One scored way to run the mask: its blocks and merge, and the figures that explain its score.

    `density`: token pairs the pooled mask attends (share of N^2, mean over batch and heads). `work`: token
    pairs the kernel computes (KV tiles x program queries x tile keys: padding, masked pairs and the union
    of merged groups included), as a share of N^2 per head. `tiles`: KV tile iterations of the call (all
    heads and batch). `score`: predicted seconds (basis "cost model") or computed token pairs of the call
    (basis "simulated tiles"). `merge_s`: host seconds the XOR grouping took while planning (the greedy and
    the group counts, every head: natsim.merging.merged_counts), not part of the score; a call's
    `prepare_sparse` runs natsim.merge head by head and builds its lists, which takes longer
    (`SparseWork.merge_seconds`). `backend` is the kernel backend it was scored on: "triton", "fa4"
    (FlashAttention-4, unmerged, on its own blocks: `block_m` x `block_n` are the mask's blocks there) or "gluon"
    (natsim's Gluon kernel, in FP8 or its 16-bit variant, unmerged 128 x 128 blocks).
    """

    q_block: int
    kv_block: int
    merge: str
    block_m: int
    block_n: int
    density: float
    work: float
    tiles: int
    programs: int
    score: float
    merge_s: float
    backend: str = "triton"

    @property
    def key(self) -> tuple[int, int, str, str]:
        """What tells candidates apart: (q_block, kv_block, merge, backend)."""
        return self.q_block, self.kv_block, self.merge, self.backend

    @property
    def kernel_merge(self) -> Optional[str]:
        """The `merge` argument of sparse_attention (None for "none")."""
        return None if self.merge == "none" else self.merge

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: Mapping) -> "MaskCandidate":
        with required_keys("a mask-plan candidate"):
            return cls(
                q_block=int(data["q_block"]), kv_block=int(data["kv_block"]), merge=str(data["merge"]),
                block_m=int(data["block_m"]), block_n=int(data["block_n"]), density=float(data["density"]),
                work=float(data["work"]), tiles=int(data["tiles"]), programs=int(data["programs"]),
                score=float(data["score"]), merge_s=float(data["merge_s"]),
                backend=check_backend(data.get("backend", "triton")),  # plans written before backends: Triton
            )


@dataclass(frozen=True)
class MaskPlan(JsonRecord):
    """The granularity and merge chosen by `best_mask` for a predicted mask, runnable on q, k, v.

    - `seq_len`, `fine_q_block`, `fine_kv_block`: the sequence and the blocks of the masks it takes.
    - `q_block`, `kv_block`, `merge`: how it runs (the mask OR-pooled to these blocks; merge "none",
      "consecutive" or "xor").
    - `batch`, `heads`, `head_dim`, `dtype`: the call it was scored for.
    - `gpu`, `basis`: "cost model" (scores are predicted seconds on `gpu`) or "simulated tiles" (no
      coefficients: computed token pairs). `score` / `dense_score`: the chosen candidate and dense attention
      (every 128 x 128 block) in that unit; `breakdown`: the chosen candidate's predicted seconds per feature.
    - `candidates`: every candidate scored, best score first (those of a backend priced but not runnable here
      included).
    - `mask`: the pooled mask `plan(q, k, v)` runs when no mask is passed (None after `from_json`; not stored
      in JSON and not compared).
    - `precision`: "fp8" for a plan of the FP8 inference kernel (`best_mask(..., precision="fp8")`), else None.
    - `backend`: the kernel backend it runs on ("triton", "fa4", "gluon"); `backends` those it could be picked from;
      `would_pick` the pick had every priced backend run here (None when each did); `backend_notes` why a
      backend a report mentions could not be picked, per backend (planner.backends).
    - `training`: planned for calls that need gradients (`best_mask(..., training=True)`: backends with a
      backward only); a plan for inference on a backend without one refuses inputs that require grad.
    """

    JSON_DOCUMENT = f"a mask-plan JSON document (format {FORMAT!r})"

    seq_len: int
    fine_q_block: int
    fine_kv_block: int
    q_block: int
    kv_block: int
    merge: str
    batch: int
    heads: int
    head_dim: int
    dtype: str
    gpu: Optional[str]
    basis: str
    score: float
    dense_score: float
    breakdown: Mapping[str, float]
    candidates: tuple[MaskCandidate, ...]
    tie_tolerance: float = TIE_TOLERANCE
    mask: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    precision: Optional[str] = None
    backend: str = "triton"
    backends: tuple[str, ...] = ("triton",)
    would_pick: Optional[MaskCandidate] = None
    backend_notes: tuple[tuple[str, str], ...] = ()
    training: bool = False
    _works: dict = field(default_factory=dict, compare=False, repr=False)

    # -- what was predicted -----------------------------------------------------------------------------

    @property
    def chosen(self) -> MaskCandidate:
        """The candidate this plan runs."""
        for c in self.candidates:
            if c.key == self._key:
                return c
        raise ValueError(
            f"the plan's choice (q_block={self.q_block}, kv_block={self.kv_block}, merge={self.merge!r}, "
            f"backend={self.backend!r}) is not among its candidates."
        )

    @property
    def _key(self) -> tuple[int, int, str, str]:
        return self.q_block, self.kv_block, self.merge, self.backend

    @property
    def calibrated(self) -> bool:
        return self.basis == BASIS_COST_MODEL

    @property
    def predicted_time_s(self) -> Optional[float]:
        """Predicted kernel seconds per call (`batch` x `heads`), None without a cost model."""
        return self.score if self.calibrated else None

    @property
    def predicted_speedup(self) -> float:
        """Dense attention (the same kernel, every 128 x 128 block) over this plan, in the basis' unit (infinite
        for an empty mask counted in tile work)."""
        return _ratio(self.dense_score, self.score)

    @property
    def torch_dtype(self) -> torch.dtype:
        return as_dtype(self.dtype)

    @property
    def kernel_merge(self) -> Optional[str]:
        return None if self.merge == "none" else self.merge

    # -- running ----------------------------------------------------------------------------------------

    def pool(self, mask: MaskLike) -> torch.Tensor:
        """A mask at the plan's fine blocks (bool `[B|1, H|1, ceil(N / fine_q_block), ceil(N / fine_kv_block)]`,
        a SparseMask with those blocks, or a numpy array), OR-pooled to the blocks the plan runs."""
        dense = fine_mask(mask, self.fine_q_block, self.fine_kv_block, self.seq_len)
        return or_pool(dense, self.q_block // self.fine_q_block, self.kv_block // self.fine_kv_block)

    def with_mask(self, mask: MaskLike) -> "MaskPlan":
        """This plan holding another fine mask (e.g. the next diffusion step's), pooled once, for `plan(q, k, v)`."""
        return replace(self, mask=self.pool(mask), _works={})

    def prepared(self, device: Union[str, torch.device]) -> SparseWork:
        """The kernel's host work for the plan's own mask on `device` (`prepare_sparse` at the plan's blocks and
        merge; the forward's lists only), done on the first request and kept: `plan(q, k, v)` reuses it on plain
        eager Triton calls (calls that need gradients pass the pooled mask), and its `prepare_seconds` /
        `merge_seconds` say what it cost."""
        if self.mask is None:
            raise ValueError("this plan holds no mask to prepare: use plan.with_mask(mask) first.")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        work = self._works.get(device)
        if work is None:
            work = prepare_sparse(self.mask, self.q_block, self.kv_block, self.seq_len, merge=self.kernel_merge,
                                  device=device, backward=False, backend=self.backend)
            self._works[device] = work
        return work

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[MaskLike] = None, *,
                 scale: Optional[float] = None, return_lse: bool = False, schedule: Optional[str] = None):
        """`sparse_attention` of `[B, N, heads, head_dim]` q, k, v under `mask` (at the plan's fine blocks,
        pooled here) or, without one, the plan's own pooled mask, at the plan's blocks and merge. With the
        plan's own mask the kernel's host work (`prepare_sparse`) is done once per device and reused. An FP8
        plan runs in FP8 (inference only); every plan runs on its backend. A plan on the 16-bit Gluon kernel
        (made for inference: it has no backward) refuses inputs that require grad, with a sentence."""
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != self.seq_len:
            raise ValueError(f"this plan is for seq_len={self.seq_len} tokens, got q.shape={tuple(q.shape)}.")
        if (self.backend == "gluon" and self.precision is None and torch.is_grad_enabled()
                and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))):
            raise ValueError("this plan runs natsim's Gluon kernel in 16 bits, which has no backward pass, and an "
                             "input requires grad: plan for gradients (best_mask(..., training=True); in the diffusers "
                             "integration apply(..., training=True)), or call under torch.no_grad().")
        if mask is not None:
            pooled = self.pool(mask)
        elif self.mask is None:
            raise ValueError(
                "this plan holds no mask (plans read from JSON do not): pass mask= (at the plan's fine blocks "
                f"{self.fine_q_block} x {self.fine_kv_block}) or use plan.with_mask(mask)."
            )
        else:
            pooled = self.mask
            if isinstance(q, torch.Tensor) and use_triton(q) and runs_eagerly(q, k, v):
                return sparse_attention(q, k, v, self.prepared(q.device), scale=scale, return_lse=return_lse,
                                        schedule=schedule, precision=self.precision, backend=self.backend)
        return sparse_attention(q, k, v, pooled.to(q.device), self.q_block, self.kv_block, merge=self.kernel_merge,
                                scale=scale, return_lse=return_lse, schedule=schedule, precision=self.precision,
                                backend=self.backend)

    # -- reporting and storage ----------------------------------------------------------------------------

    def candidates_table(self, title: Optional[str] = None, limit: int = 0) -> Table:
        """The candidates, best score first (the first `limit`, all for 0; the chosen one always): blocks,
        merge, backend, density, computed work, tiles, predicted time (or tile work) and speedup over dense."""
        table = Table(title=title, title_justify="left")
        for name in ("Q x KV block", "merge", "backend", "density", "work", "tiles", "predicted ms" if self.calibrated
                     else "tile work", "speedup", "merge ms", ""):
            table.add_column(name, justify="right")
        for i, c in enumerate(self.candidates):
            chosen = c.key == self._key
            if 0 < limit <= i and not chosen:
                continue
            table.add_row(
                f"{c.q_block}x{c.kv_block}", c.merge,
                c.backend if c.backend in self.backends else f"{c.backend} (not here)",
                f"{c.density:.1%}", f"{c.work:.1%}", f"{c.tiles:,}",
                f"{c.score * 1e3:.4g}" if self.calibrated else f"{c.score:.4g}",
                f"{_ratio(self.dense_score, c.score):.2f}x", f"{c.merge_s * 1e3:.3g}" if c.merge == "xor" else "",
                "[green]chosen[/green]" if chosen else "",
            )
        return table

    def explain(self) -> Group:
        """A rich report: the choice, how candidates were ranked, why this one, and every candidate."""
        c = self.chosen
        fine = next((x for x in self.candidates
                     if (x.q_block, x.kv_block) == (self.fine_q_block, self.fine_kv_block)), None)
        lines = [
            f"Mask plan for N={self.seq_len:,} tokens, {self.batch} x {self.heads} heads, head_dim {self.head_dim}, "
            f"{self.dtype}{', FP8 kernel' if self.precision else ''}{', for training' if self.training else ''}: run "
            f"at {self.q_block} x {self.kv_block} blocks, "
            f"merge {self.merge}, on {backend_label(self.backend)}.",
            f"The mask was given at {self.fine_q_block} x {self.fine_kv_block}"
            + (f" (density {fine.density:.1%})" if fine is not None else "")
            + f"; pooled it attends {c.density:.1%} of token pairs and the kernel computes {c.work:.1%}.",
        ]
        if self.calibrated:
            coefficients = "FP8 sparse coefficients" if self.precision else "sparse coefficients"
            kernel = "the same kernel"
            if self.backend == "fa4":
                coefficients, kernel = "FlashAttention-4 coefficients", "natsim's sparse kernel"
            elif self.backend == "gluon":
                coefficients = f"Gluon {'FP8' if self.precision else '16-bit'} coefficients"
                kernel = "natsim's sparse kernel"
            lines.append(f"Predicted {self.score * 1e3:.4g} ms on {self.gpu}, {self.predicted_speedup:.2f}x faster "
                         f"than dense attention through {kernel} (cost model, {coefficients}).")
            basis = Text(lines.pop())
        else:
            where = self.gpu if self.gpu else "this machine (no CUDA GPU)"
            kernel = "sparse-fp8" if self.precision else "sparse"
            basis = Text(
                f"No {kernel}-kernel coefficients for {where}: candidates were ranked by the token pairs the kernel "
                f"computes (tile work), {self.predicted_speedup:.2f}x less than dense; no time is predicted. Name a "
                f"GPU with coefficients (device='h100') or run `natsim calibrate --kernels gna,{kernel}` on yours.",
                style="yellow",
            )
        runnable = [c for c in self.candidates if c.backend in self.backends]
        best = runnable[0]
        if best.key == self._key:
            why = f"It has the best score of {len(runnable)} candidates."
        else:
            on = f", on {best.backend}" if best.backend != self.backend else ""
            why = (f"The best score is {best.q_block} x {best.kv_block}, merge {best.merge}{on}; this one is "
                   f"{self.score / best.score - 1.0:.1%} behind, within {self.tie_tolerance:.0%}, and needs less "
                   "host work (no merge before consecutive before xor, then coarser blocks).")
        parts = [Text(line) for line in lines] + [basis, Text(f"Why: {why}")]
        parts += self._best_by_backend()
        would = self.would_pick
        gain = None if would is None else Gain(
            would.backend, f"{would.q_block} x {would.kv_block} blocks, merge {would.merge}", would.score)
        parts += backend_lines(self.backend_notes, {c.backend for c in self.candidates}, gain, self.score)
        if self.breakdown:
            table = Table(title="predicted time by feature", title_justify="left")
            table.add_column("feature")
            table.add_column("ms", justify="right")
            for name, seconds in self.breakdown.items():
                table.add_row(name, f"{seconds * 1e3:.4g}")
            parts.append(table)
        parts.append(self.candidates_table("candidates, best score first"))
        return Group(*parts)

    def _best_by_backend(self) -> list[Text]:
        """One line per backend priced, when there were several: its best candidate against the plan."""
        backends = dict.fromkeys(c.backend for c in self.candidates)
        if len(backends) < 2:
            return []
        lines = []
        for backend in backends:
            c = next(c for c in self.candidates if c.backend == backend)  # best score first
            here = "" if backend in self.backends else "; it does not run here"
            lines.append(Text(f"Best on {backend_label(backend)}: {c.q_block} x {c.kv_block} blocks, merge {c.merge}, "
                              f"{c.score * 1e3:.4g} ms ({versus(c.score, self.score)}{here})."))
        return lines

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            **{name: getattr(self, name) for name in (
                "seq_len", "fine_q_block", "fine_kv_block", "q_block", "kv_block", "merge", "batch", "heads",
                "head_dim", "dtype", "gpu", "basis", "score", "dense_score", "tie_tolerance", "precision", "backend",
                "training")},
            "predicted_time_s": self.predicted_time_s,
            "predicted_speedup": self.predicted_speedup if math.isfinite(self.predicted_speedup) else None,  # JSON
            "breakdown": dict(self.breakdown),
            "candidates": [c.to_dict() for c in self.candidates],
            "backends": list(self.backends),
            "would_pick": None if self.would_pick is None else self.would_pick.to_dict(),
            "backend_notes": dict(self.backend_notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "MaskPlan":
        """Rebuild a plan from `to_dict` output (without a mask: pass one when calling it)."""
        ints = ("seq_len", "fine_q_block", "fine_kv_block", "q_block", "kv_block", "batch", "heads", "head_dim")
        floats = ("score", "dense_score", "tie_tolerance")
        keys = (*ints, *floats, "merge", "dtype", "gpu", "basis", "breakdown", "candidates")
        check_record(data, "a mask plan", FORMAT, keys, "MaskPlan.to_dict")
        check_basis(data["basis"])
        if data["merge"] not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got merge={data['merge']!r}.")
        plan = cls(
            **{k: int(data[k]) for k in ints}, **{k: float(data[k]) for k in floats},
            merge=str(data["merge"]), dtype=str(data["dtype"]), gpu=data["gpu"], basis=data["basis"],
            breakdown={k: float(v) for k, v in data["breakdown"].items()},
            candidates=tuple(MaskCandidate.from_dict(c) for c in data["candidates"]),
            precision=check_precision(data.get("precision")),  # plans written before FP8: the inputs' dtype
            # plans written before backends: natsim's Triton kernels, the only one priced
            backend=check_backend(data.get("backend", "triton")),
            backends=tuple(check_backend(b) for b in data.get("backends", ("triton",))),
            would_pick=None if data.get("would_pick") is None else MaskCandidate.from_dict(data["would_pick"]),
            backend_notes=tuple((check_backend(b), str(note)) for b, note in data.get("backend_notes", {}).items()),
            training=_flag(data.get("training", False), "training"),  # plans written before training plans: inference
        )
        plan.chosen  # noqa: B018 (raises when the choice is not a candidate)
        if plan.training and plan.backend == "gluon":
            raise ValueError("a mask plan for training runs on a backend with a backward, got training=true with "
                             "backend='gluon' (natsim's Gluon kernel has none).")
        if plan.training and plan.precision is not None:
            raise ValueError(f"a mask plan for training runs in bfloat16 or float16, got training=true with "
                             f"precision={plan.precision!r} (FP8 is for inference).")
        return plan

