"""GNA on a token layout sharded along dimension 0 over a process group: Ulysses, halo or natsim's choice,
differentiable wherever the single-GPU call it runs is. GNA on frame ranges has no backward kernel, so on
tensors that run the Triton kernels the halo strategy trains by running a rank's gathered frames as a layout of
their own (strategies.py), where that is exact; elsewhere it is refused with `HALO_GRADIENT_REFUSAL` and left
out by `"auto"`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from natsim import Problem, TileConfig
from natsim.kernels import autocast_inputs, constant_of_the_graph, constants_when_compiled
from natsim.kernels import gna_attention as single_gpu_gna_attention
from natsim.kernels.backends.triton import check_qkv, choose_tiles, kernel_tiles, use_triton
from natsim.partition import DEFAULT_LINK, STRATEGIES, Link, Rate, choose_strategy, strategy_cost
from natsim.stored import link_for
from natsim.problem import BoolOrBools, IntOrInts

from .collectives import resolve_split, world
from .pipeline import register_attend, ulysses_attention
from .strategies import halo, trains_on_gathered_frames

HALO_GRADIENT_REFUSAL = (
    "the halo strategy trains on natsim's GPU kernels only where a rank's gathered frames can run as a layout of "
    "their own (stride 1, dilation 1 and no causal window along dimension 0: GNA on frame ranges has no backward "
    "kernel), and q, k or v requires grad: train with strategy='ulysses' or "
    "'auto', call it under torch.no_grad() for inference, or use CPU tensors (the torch reference's gradients)."
)


@dataclass(frozen=True)
class StrategyTiles:
    """The tiles each strategy's kernel runs, as natsim's single-GPU call picks them (given ones kept), for the
    cost estimate: Ulysses attends the whole layout, where natsim chooses static or dynamic KV tiling (or runs the
    `kv_tiling` given); the halo exchange runs frame ranges, which take static KV tiling only. Priced at one
    tiling, the halo exchange looked cheaper than it runs by the tiles dynamic tiling saves Ulysses (18% of them
    on Wan 720p with a 7x21x35 window)."""

    ulysses: TileConfig
    halo: TileConfig


@functools.lru_cache(maxsize=256)
def strategy_tiles(problem: Problem, head_dim: int, q_tile=None, kv_tile=None,
                   kv_tiling: Optional[str] = None) -> StrategyTiles:
    """`StrategyTiles` for `problem` at `head_dim`, with the call's `q_tile`, `kv_tile` (ints or tuples, None
    for natsim's choice) and `kv_tiling`."""
    given = (None, None) if q_tile is None and kv_tile is None else kernel_tiles(problem, q_tile, kv_tile)
    modes = ("static", "dynamic") if kv_tiling is None else (kv_tiling,)
    ulysses = choose_tiles(problem, head_dim, modes, *given)
    q_dims, kv_dims, _ = choose_tiles(problem, head_dim, ("static",), *given)
    return StrategyTiles(TileConfig(ulysses[0], ulysses[1], kv_tiling=ulysses[2]), TileConfig(q_dims, kv_dims))


@functools.lru_cache(maxsize=256)
def choose(problem: Problem, tiles: StrategyTiles, split: tuple[int, ...], batch: int, heads: int, head_dim: int,
           element_bytes: int, training: bool = False, strategies: tuple[str, ...] = STRATEGIES,
           link: Link = DEFAULT_LINK, chunks: Optional[int] = None, halo_on_gathered: bool = False) -> str:
    """The one of `strategies` natsim.partition predicts faster, each priced with the tiles it runs (`tiles`)
    and its bytes at `link`'s rates: the forward and, when `training`, the backward too (its tile work and the
    gradients' bytes); Ulysses with its heads in groups (natsim.partition.head_groups(heads, chunks));
    the halo exchange on a rank's gathered frames as a layout of their own where `halo_on_gathered` (how it
    trains on the GPU kernels). Ulysses pads heads that do not divide over the ranks (natsim.partition.heads_per_rank) and
    is priced so."""
    costs = [strategy_cost(problem, getattr(tiles, s), split, s, batch=batch, heads=heads, head_dim=head_dim,
                           element_bytes=element_bytes, training=training, link=link, chunks=chunks,
                           halo_on_gathered=halo_on_gathered)
             for s in strategies]
    return choose_strategy(costs).strategy


@constant_of_the_graph
def _auto(shape: tuple[int, ...], parameters: tuple, tiles: tuple, split: tuple[int, ...], sizes: tuple[int, ...],
          training: bool, strategies: tuple[str, ...], rates: Optional[tuple[float, float, float, float]],
          chunks: Optional[int], gpu_index: int, halo_on_gathered: bool = False) -> str:
    """`"auto"`'s pick from plain values (`rates`: the link's all-to-all and point-to-point bytes per second and
    latencies; None: the link measured for GPU `gpu_index`'s kind and this many ranks, natsim.stored.link_for,
    -1 for CPU tensors, whose link is the CPUs' that `natsim calibrate-link` writes under gloo): host arithmetic (numpy) that torch.compile runs once while tracing, its result a
    constant of the graph, instead of tracing it."""
    problem = Problem(shape, *parameters)
    if rates is None:
        link = link_for(torch.cuda.get_device_name(gpu_index) if gpu_index >= 0 else "cpu", len(split))
    else:
        link = Link(Rate(rates[0], rates[1]), Rate(rates[2], rates[3]))
    return choose(problem, strategy_tiles(problem, sizes[2], *tiles), split, *sizes, training, strategies, link, chunks,
                  halo_on_gathered)


@constant_of_the_graph
def _attend(window: tuple, stride: tuple, dilation: tuple, causal: tuple, q_tile, kv_tile,
            kv_tiling: Optional[str]) -> int:
    """The id of the single-GPU GNA call with these arguments as Ulysses' attention (pipeline.py), registered
    once per distinct arguments: host work torch.compile runs while tracing (not traces), its result a constant
    of the graph."""

    def attend(q, k, v, extras, scale, span):
        return single_gpu_gna_attention(q, k, v, window, stride, dilation, causal, scale=scale, q_tile=q_tile,
                                        kv_tile=kv_tile, kv_tiling=kv_tiling)

    return register_attend(attend, key=("gna", window, stride, dilation, causal, q_tile, kv_tile, kv_tiling))


HALO_DYNAMIC_REFUSAL = ("the halo strategy runs frame ranges with static KV tiling only, got kv_tiling='dynamic'; "
                        "use strategy='ulysses' or kv_tiling=None.")


def _runnable(halo_refusal: Optional[str]) -> tuple[str, ...]:
    """The strategies `"auto"` chooses among: ulysses (any heads: padded where the ranks do not divide them), and
    halo unless the call is one it cannot run here (`halo_refusal`, the sentence saying why)."""
    return tuple(s for s in STRATEGIES if s != "halo" or halo_refusal is None)


def gna_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    *,
    group=None,
    strategy: str = "auto",
    split: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    q_tile: Optional[IntOrInts] = None,
    kv_tile: Optional[IntOrInts] = None,
    kv_tiling: Optional[str] = None,
    link: Optional[Link] = None,
    chunks: Optional[int] = None,
) -> torch.Tensor:
    """GNA on a layout sharded along dimension 0 over `group` (default: the world): this rank's output frames.

    q, k, v are this rank's `[B, T_r, *rest, heads, head_dim]`; window, stride, dilation and causal are the
    whole layout's (`natsim.kernels.gna_attention`). `split` (frames per rank) skips the all-gather of slab
    sizes (give it under torch.compile). `strategy`: `"ulysses"`, `"halo"` or `"auto"` (module docstring of
    strategies.py). `kv_tiling` as in `natsim.kernels.gna_attention` for Ulysses; the halo path's frame ranges
    run static KV tiling only (None there means static). `link`: the interconnect `"auto"` prices bytes with
    (natsim.partition.Link); None takes the one `natsim calibrate-link` measured for these GPUs and this many
    ranks (natsim.stored.link_for: the user's file, else natsim's shipped one), else natsim.partition's default
    rate. `chunks`: Ulysses attends each rank's heads in this many
    even groups, each group's transfers overlapped with the attention of another (pipeline.py); None: up to
    three of two heads or more (natsim.partition.head_groups).
    Every rank must make the same call, with the same `requires_grad`.

    Differentiable with respect to q, k and v: the single-GPU backward between the forward's collectives
    mirrored (ops.py), eager or under torch.compile(fullgraph=True). On tensors that run the Triton kernels the
    halo strategy trains on its gathered frames as a layout of their own, with stride 1, dilation 1 and no causal
    window along dimension 0, and is refused elsewhere (module docstring); `"auto"` picks among the strategies
    that can, and prices a call that needs gradients by its forward and backward.
    """
    shape = constants_when_compiled(*check_qkv(q, k, v))  # the layout as values under a dynamic-shape trace too
    q, k, v = autocast_inputs(q, k, v)  # as natsim.kernels does: the inputs in an autocast region's dtype
    window, stride, dilation, split, q_tile, kv_tile, chunks = constants_when_compiled(
        window, stride, dilation, split, q_tile, kv_tile, chunks)
    size, rank = world(group)
    split = resolve_split(q, split, group)
    problem = Problem((sum(split), *shape[1:]), window, stride, dilation, causal)
    batch, heads, head_dim = constants_when_compiled(q.shape[0], q.shape[-2], q.shape[-1])  # priced as values
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    on_gathered_frames = training and use_triton(q)  # frame ranges have no backward kernel (strategies.py)
    untrainable = on_gathered_frames and not trains_on_gathered_frames(problem)
    halo_refusal = HALO_GRADIENT_REFUSAL if untrainable else HALO_DYNAMIC_REFUSAL if kv_tiling == "dynamic" else None
    tiles = tuple(tuple(t) if isinstance(t, list) else t for t in (q_tile, kv_tile))  # hashable, as given
    if strategy == "auto":
        strategy = _auto(problem.shape, (problem.window, problem.stride, problem.dilation, problem.causal),
                         (*tiles, kv_tiling), split, (batch, heads, head_dim, q.element_size()), training,
                         _runnable(halo_refusal),
                         None if link is None else (link.all_to_all.bytes_per_second, link.all_to_all.latency_seconds,
                                                    link.point_to_point.bytes_per_second,
                                                    link.point_to_point.latency_seconds),
                         chunks, q.device.index if q.is_cuda else -1, on_gathered_frames)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES + ('auto',)}, got strategy={strategy!r}.")
    if strategy == "ulysses":
        attend = _attend(problem.window, problem.stride, problem.dilation, problem.causal, *tiles, kv_tiling)
        return ulysses_attention(attend, q, k, v, split, rank, group, scale=scale, chunks=chunks)
    kernel = functools.partial(single_gpu_gna_attention, window=problem.window, stride=problem.stride,
                               dilation=problem.dilation, causal=problem.causal, scale=scale, q_tile=q_tile,
                               kv_tile=kv_tile)
    if untrainable:
        raise RuntimeError(HALO_GRADIENT_REFUSAL)
    if halo_refusal is not None:
        raise ValueError(halo_refusal)
    return halo(kernel, problem, q, k, v, split, rank, group, on_gathered_frames)
