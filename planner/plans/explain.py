"""The plan report: the choice, how it was ranked, why it won, and the runners-up, as rich renderables.

`Plan.explain()` calls `explain_plan(self)`, so this module cannot import the plan's: it reads a plan through
`ExplainedPlan`, the plan's attributes that the report uses. Where the search priced several kernel backends, the
report shows the best plan of each; where one could not run here (FlashAttention-4 not installed, another GPU),
how much faster the cost model predicts it, and what makes it run (`backend_lines`, shared with mask plans).
"""

from __future__ import annotations

import math
from typing import Collection, Mapping, NamedTuple, Optional, Protocol, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text

from natsim import Problem, SimResult, TileConfig

from ..backends import NAMES
from ..cost.backward_features import FORWARD_TILE_PRODUCTS
from ..cost.files import gpu_file_name, known_gpus, user_coefficients_dir
from ..cost.gpus import describe_gpus
from .candidates import Candidate, Search


class ExplainedPlan(Protocol):
    """What the report reads of a GNA plan (planner.plans.plan.Plan has it all)."""

    @property
    def problem(self) -> Problem: ...
    @property
    def tiles(self) -> TileConfig: ...
    @property
    def simulation(self) -> SimResult: ...
    @property
    def target_sparsity(self) -> float: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def heads(self) -> Optional[int]: ...
    @property
    def gpu(self) -> Optional[str]: ...
    @property
    def training(self) -> bool: ...
    @property
    def precision(self) -> Optional[str]: ...
    @property
    def backend(self) -> str: ...
    @property
    def calibrated(self) -> bool: ...
    @property
    def score(self) -> float: ...
    @property
    def forward_score(self) -> float: ...
    @property
    def backward_score(self) -> Optional[float]: ...
    @property
    def predicted_time_s(self) -> Optional[float]: ...
    @property
    def predicted_speedup(self) -> float: ...
    @property
    def backward_tiles(self) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]: ...
    @property
    def breakdown(self) -> Mapping[str, float]: ...
    @property
    def runners_up(self) -> tuple[Candidate, ...]: ...
    @property
    def search(self) -> Search: ...


def _dims(values) -> str:
    return "x".join(str(int(v)) for v in values)


def _product(values) -> int:
    return math.prod(int(v) for v in values)


def _score(plan: ExplainedPlan, value: float) -> str:
    if plan.calibrated:
        return f"{value * 1e3:.4g} ms"
    return f"{value:.4g} pairs"


def _kv_tiling(mode: str) -> str:
    return "dynamic (box per Q tile)" if mode == "dynamic" else "static (fixed grid)"


def _choice_table(plan: ExplainedPlan) -> Table:
    sim, problem = plan.simulation, plan.problem
    table = Table(title=f"GNA plan for shape {_dims(problem.shape)}", title_justify="left", show_header=False)
    table.add_column("setting")
    table.add_column("value", justify="right")
    rows = [
        ("window", _dims(problem.window)),
        ("stride", _dims(problem.stride)),
        ("Q tile / KV tile", f"{_dims(plan.tiles.q_tile)} / {_dims(plan.tiles.kv_tile)}"),
        ("KV tiling", _kv_tiling(plan.tiles.kv_tiling)),
        ("backend", backend_label(plan.backend)),
        ("sparsity (target)", f"{sim.sparsity:.4f} ({plan.target_sparsity:g})"),
        ("FLOP-wise speedup", f"{sim.flop_speedup:.2f}x"),
        ("tile speedup", f"{sim.tile_speedup:.2f}x"),
        ("block-sparse", "yes" if sim.block_sparse else f"no: {sim.visited_tiles - sim.full_tiles:,} masked tiles"),
        ("visited / full tiles", f"{sim.visited_tiles:,} / {sim.full_tiles:,}"),
        ("head_dim, dtype, heads", f"{plan.head_dim}, {plan.dtype}, {plan.heads if plan.heads else '1 (per head)'}"),
    ]
    if plan.precision is not None:
        rows.append(("precision", f"{plan.precision} (inference only)"))
    if any(problem.causal):
        rows.insert(2, ("causal", _dims(problem.causal)))
    if plan.training:
        q_tile, kv_tile = plan.backward_tiles
        rows.append(("backward Q tile / KV tile", f"{_dims(q_tile)} / {_dims(kv_tile)}"))
        unit = f"on {plan.gpu}" if plan.calibrated else "tile work (forward-equivalent pairs)"
        rows.append(("forward + backward", f"{_score(plan, plan.forward_score)} + {_score(plan, plan.backward_score)}"
                                           f" = {_score(plan, plan.score)} {unit}"))
        rows.append(("speedup over dense (fwd + bwd)", f"{plan.predicted_speedup:.2f}x"))
    elif plan.calibrated:
        rows.append(("predicted time", f"{plan.predicted_time_s * 1e3:.4g} ms on {plan.gpu}"))
        rows.append(("predicted speedup over dense", f"{plan.predicted_speedup:.2f}x"))
    else:
        rows.append(("predicted time", "none (no cost model)"))
        rows.append(("tile-work speedup over dense", f"{plan.predicted_speedup:.2f}x"))
    for row in rows:
        table.add_row(*row)
    return table


def calibration_advice(gpu: Optional[str], kernels: str) -> str:
    """What to run for coefficients of `kernels` (`natsim calibrate --kernels`): on `gpu`, the GPU at hand that
    has none (an uncalibrated GPU, said so), or with no GPU here, on the one that will run the plan."""
    command = f"`natsim calibrate --kernels {kernels}`"
    if gpu is None:
        return f"Run {command} on the GPU that will run the plan to fit its coefficients."
    return (f"{gpu} is uncalibrated for this plan: run {command} on it (a few minutes), which writes "
            f"{gpu_file_name(gpu)} to {user_coefficients_dir()}, then plan again to rank by predicted time.")


def _training_basis(plan: ExplainedPlan) -> Text:
    if plan.calibrated:
        return Text(f"Ranked for training by forward + backward time: the cost model fitted on {plan.gpu}, its "
                    "backward coefficients for the backward kernels (their own tiles, in place).")
    where = plan.gpu if plan.gpu else "this machine (no CUDA GPU)"
    return Text(
        f"No backward coefficients for {where} (no cost model, or one fitted without them): configurations were ranked "
        "for training by simulated tile work, forward + backward (Q x KV tokens over visited tiles, each backward "
        f"kernel's pair counted by its tile products over the forward's {FORWARD_TILE_PRODUCTS}), and no "
        f"time is predicted. {calibration_advice(plan.gpu, 'gna,backward')}",
        style="yellow",
    )


def _fixed_modes(plan: ExplainedPlan) -> Optional[str]:
    """Why the search scored one KV tiling mode, when it was narrowed to it (`Search.kv_tiling_fixed`)."""
    mode = plan.search.kv_tilings[0]
    return {"kv_tiling": f"{mode} KV tiling only, as asked (kv_tiling={mode!r})",
            "halo": "static KV tiling only, which the halo strategy over several ranks runs",
            "precision": "static KV tiling only, the only kind FP8 runs"}.get(
        plan.search.kv_tiling_fixed)


def _fp8_basis(plan: ExplainedPlan) -> Text:
    if plan.calibrated:
        return Text(f"Ranked for FP8 inference by the cost model fitted on {plan.gpu}, its FP8 coefficients (the "
                    "same tile counts, FP8's cost per tile, the quantization pass and FP8's permutation of 2-D and "
                    "3-D layouts); static KV tiling and KV tiles of 32 tokens or more, what FP8 runs.")
    where = plan.gpu if plan.gpu else "this machine (no CUDA GPU)"
    return Text(
        f"No FP8 coefficients for {where} (no cost model, or one fitted without them): configurations were ranked "
        "by simulated tile work alone (static KV tiling, KV tiles of 32 tokens or more: what FP8 runs), and no time "
        f"is predicted. {calibration_advice(plan.gpu, 'gna,gna-fp8')}",
        style="yellow",
    )


def _basis(plan: ExplainedPlan) -> Text:
    if plan.training:
        return _training_basis(plan)
    if plan.precision == "fp8":
        return _fp8_basis(plan)
    fixed = _fixed_modes(plan)
    if plan.calibrated:
        modes = plan.search.kv_tilings
        scope = fixed or ("both KV tiling modes, scored with the same features (the dynamic kernel's per-tile work "
                          "on the in-place path equals the static one's; its calibration cases are in the fit)"
                          if "dynamic" in modes else
                          "static KV tiling only: these coefficients were not calibrated on the dynamic kernel (run "
                          "`natsim calibrate` to include it)")
        return Text(f"Ranked by the cost model fitted on {plan.gpu} (predicted kernel time; plans read q, k, v in "
                    f"place, no permutation); {scope}.")
    where = plan.gpu if plan.gpu else "this machine (no CUDA GPU)"
    gpus = known_gpus()
    others = (
        f" Coefficients exist for {describe_gpus(gpus)}: they were fitted on another GPU, so they are not used "
        "unless named with --device (device= in Python)."
        if gpus
        else ""
    )
    return Text(
        f"No cost-model coefficients for {where}: configurations were ranked by simulated tile work alone "
        f"(Q x KV tokens summed over visited tiles, {fixed or 'static and dynamic KV tiling alike'}), and no time is "
        f"predicted.{others} {calibration_advice(plan.gpu, 'gna,sparse')}",
        style="yellow",
    )


def _same(candidate: Candidate, plan: ExplainedPlan) -> bool:
    return (
        candidate.window == plan.problem.window
        and candidate.stride == plan.problem.stride
        and candidate.q_tile == plan.tiles.q_tile
        and candidate.kv_tile == plan.tiles.kv_tile
        and candidate.kv_tiling == plan.tiles.kv_tiling
        and candidate.backend == plan.backend
    )


def _reasons(plan: ExplainedPlan) -> list[str]:
    search, sim = plan.search, plan.simulation
    reasons = []
    if search.window_given:
        reasons.append(f"The window {_dims(plan.problem.window)} was given and kept.")
    else:
        low, high = search.band
        reasons.append(
            f"{len(search.windows)} candidate windows with sparsity in [{low:.4f}, {high:.4f}] at stride 1, shaped "
            "like the layout, those made of whole KV tiles first."
        )
    if len(search.backends) > 1:
        names = " and ".join(NAMES[b] for b in search.backends)
        reasons.append(f"{search.scored:,} (window, stride, tile, backend) configurations scored, on {names}; a "
                       "configuration's score is its faster backend's.")
    else:
        reasons.append(f"{search.scored:,} (window, stride, tile) configurations scored.")
    if plan.predicted_speedup < 1.0:
        reasons.append(
            f"Even this plan is predicted {1.0 / plan.predicted_speedup:.2f}x slower than dense attention on this "
            "layout (overheads outweigh the skipped work): consider dense attention here."
        )
    if sim.block_sparse:
        reasons.append("Block-sparse: every visited tile is full, so no tile pays for the window mask.")
    fastest = search.fastest
    if _same(fastest, plan):
        reasons.append(
            f"It has the best score; no configuration within {search.tie_tolerance:.0%} of it has a smaller "
            "stride product."
        )
    else:
        gap = plan.score / fastest.score - 1.0
        standing = "ties with it" if gap <= 1e-9 else f"is {gap:.1%} behind, within {search.tie_tolerance:.0%}"
        on = f", on {NAMES[fastest.backend]}" if fastest.backend != plan.backend else ""
        reasons.append(
            f"The best score belongs to stride {_dims(fastest.stride)} (window {_dims(fastest.window)}, tiles "
            f"{_dims(fastest.q_tile)}/{_dims(fastest.kv_tile)}{on}); this plan {standing}, and its stride product "
            f"({_product(plan.problem.stride)} vs {_product(fastest.stride)}) is smaller, which keeps more "
            "translational equivariance."
        )
    return reasons


def _runners_up(plan: ExplainedPlan) -> Table:
    table = Table(title="runners-up: the best of each other window, and stride 1", title_justify="left")
    for name in ("window", "stride", "Q tile", "KV tile", "KV tiling", "backend", "score", "vs plan",
                 "tile speedup", "block-sparse"):
        table.add_column(name, justify="right")
    for c in plan.runners_up:
        table.add_row(
            _dims(c.window),
            _dims(c.stride),
            _dims(c.q_tile),
            _dims(c.kv_tile),
            c.kv_tiling,
            c.backend,
            _score(plan, c.score),
            f"{c.score / plan.score - 1.0:+.1%}",
            f"{c.tile_speedup:.2f}x",
            "yes" if c.block_sparse else "",
        )
    return table


def backend_label(backend: str) -> str:
    """A backend's name with what it is: 'fa4 (FlashAttention-4)'."""
    return f"{backend} ({NAMES[backend]})"


def _setting(c: Candidate) -> str:
    return (f"window {_dims(c.window)}, stride {_dims(c.stride)}, tiles {_dims(c.q_tile)}/{_dims(c.kv_tile)}"
            f"{', dynamic KV tiling' if c.kv_tiling == 'dynamic' else ''}")


def _backends(plan: ExplainedPlan) -> list:
    """The best plan of each backend priced (when several were), and the lines about backends that could not be
    picked here (`backend_lines`)."""
    search, parts = plan.search, []
    if any(c.backend == "fa4" for c in search.best_by_backend):
        parts.append(Text(f"FlashAttention-4's calls were priced by its own coefficients on {plan.gpu} (its full "
                          "blocks, its masked blocks through the window mask, and q, k, v permuted into tile order "
                          "and back)."))
    if len(search.best_by_backend) > 1:
        table = Table(title="the best plan of each backend priced", title_justify="left")
        for name in ("backend", "window", "stride", "Q tile / KV tile", "predicted", "vs plan", "runs here"):
            table.add_column(name, justify="right")
        for c in search.best_by_backend:
            table.add_row(c.backend, _dims(c.window), _dims(c.stride), f"{_dims(c.q_tile)} / {_dims(c.kv_tile)}",
                          _score(plan, c.score), versus(c.score, plan.score),
                          "yes" if c.backend in search.backends else "no")
        parts.append(table)
    would = search.would_pick
    gain = None if would is None else Gain(would.backend, _setting(would), would.score)
    return parts + backend_lines(search.backend_notes, {c.backend for c in search.best_by_backend}, gain, plan.score)


def versus(score: float, plan_score: float) -> str:
    """A candidate's time against the plan's: 'this plan', '1.21x faster', '1.05x slower'."""
    if score == plan_score:
        return "this plan"
    return f"{plan_score / score:.2f}x faster" if score < plan_score else f"{score / plan_score:.2f}x slower"


class Gain(NamedTuple):
    """What a search would have picked had every backend it priced run here: the backend, its setting in words
    and its predicted seconds."""

    backend: str
    setting: str
    seconds: float


def backend_lines(notes: Sequence[tuple[str, str]], priced: Collection[str], gain: Optional[Gain],
                  plan_score: float) -> list[Text]:
    """Lines about the backends a search could not pick here, one per note (backend, why): for one that was
    `priced`, what it would have run and how much faster (`gain`), then why it did not; for one that was not
    priced, the note itself (why it could not be priced)."""
    lines = []
    for backend, why in notes:
        name = NAMES[backend]
        if backend not in priced:
            lines.append(Text(why, style="yellow"))
        elif gain is not None and gain.backend == backend and gain.seconds < plan_score:
            lines.append(Text(f"{name} would run this plan's best configuration ({gain.setting}) in "
                              f"{gain.seconds * 1e3:.4g} ms, {plan_score / gain.seconds:.2f}x faster: {why}",
                              style="yellow"))
        else:
            lines.append(Text(f"{name} would not make this plan faster, the cost model predicts; it does not run "
                              f"here: {why}"))
    return lines


def _breakdown(plan: ExplainedPlan) -> Table:
    table = Table(title="predicted time by feature", title_justify="left")
    table.add_column("feature")
    table.add_column("ms", justify="right")
    for name, seconds in plan.breakdown.items():
        table.add_row(name, f"{seconds * 1e3:.4g}")
    return table


def _precisions(plan: ExplainedPlan) -> list[Text]:
    """The line of a plan made with precision="auto": each precision's best plan and why this one runs."""
    search = plan.search
    if not search.precisions:
        return []
    priced = ", ".join(f"{name} {_score(plan, seconds)} on {backend}" for name, backend, seconds in search.precisions)
    return [Text(f"precision='auto': {priced}. {search.precision_note}.")]


def explain_plan(plan: ExplainedPlan) -> Group:
    """The report of `plan.explain()`."""
    parts = [_choice_table(plan), _basis(plan), *_precisions(plan), Text("Why:")]
    parts += [Text(f"  - {reason}") for reason in _reasons(plan)]
    parts += _backends(plan)
    if plan.breakdown:
        parts.append(_breakdown(plan))
    if plan.runners_up:
        parts.append(_runners_up(plan))
    return Group(*parts)
