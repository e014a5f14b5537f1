"""GNA on a token layout sharded along dimension 0 over a process group: Ulysses, halo or natsim's choice."""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from natsim import Problem, TileConfig
from natsim.kernels import gna_attention as single_gpu_gna_attention
from natsim.kernels.backends.triton import TILE_TOKENS, check_qkv, default_tiles
from natsim.partition import STRATEGIES, choose_strategy, strategy_cost
from natsim.problem import BoolOrBools, IntOrInts

from .collectives import check_heads, refuse_gradients, resolve_split, world
from .strategies import halo, ulysses


def _tiles(problem: Problem, head_dim: int, q_tile, kv_tile) -> TileConfig:
    """The tiles the kernel will run (its defaults unless given), for the cost estimate."""
    if q_tile is None and kv_tile is None:
        return TileConfig(*default_tiles(problem, head_dim if head_dim in TILE_TOKENS else 128))
    return TileConfig(kv_tile if q_tile is None else q_tile, q_tile if kv_tile is None else kv_tile)


@functools.lru_cache(maxsize=256)
def choose(problem: Problem, tiles: TileConfig, split: tuple[int, ...], batch: int, heads: int, head_dim: int,
           element_bytes: int) -> str:
    """`"ulysses"` or `"halo"`: the one natsim.partition predicts faster (ulysses only when heads divide)."""
    costs = [strategy_cost(problem, tiles, split, s, batch=batch, heads=heads, head_dim=head_dim,
                           element_bytes=element_bytes)
             for s in STRATEGIES if s != "ulysses" or heads % len(split) == 0]
    return choose_strategy(costs).strategy


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
) -> torch.Tensor:
    """GNA on a layout sharded along dimension 0 over `group` (default: the world): this rank's output frames.

    q, k, v are this rank's `[B, T_r, *rest, heads, head_dim]`; window, stride, dilation and causal are the
    whole layout's (`natsim.kernels.gna_attention`). `split` (frames per rank) skips the all-gather of slab
    sizes. `strategy`: `"ulysses"`, `"halo"` or `"auto"` (module docstring). `kv_tiling` as in
    `natsim.kernels.gna_attention` for Ulysses; the halo path's frame ranges run static KV tiling only (None
    there means static). Every rank must make the same call.
    """
    refuse_gradients(q, k, v)
    shape = check_qkv(q, k, v)
    size, rank = world(group)
    split = resolve_split(q, split, group)
    problem = Problem((sum(split), *shape[1:]), window, stride, dilation, causal)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if strategy == "auto":
        strategy = choose(problem, _tiles(problem, head_dim, q_tile, kv_tile), split, batch, heads, head_dim,
                          q.element_size())
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES + ('auto',)}, got strategy={strategy!r}.")
    kernel = functools.partial(single_gpu_gna_attention, window=problem.window, stride=problem.stride,
                               dilation=problem.dilation, causal=problem.causal, scale=scale, q_tile=q_tile,
                               kv_tile=kv_tile)
    if strategy == "ulysses":
        check_heads(heads, size)
        return ulysses(lambda q, k, v: kernel(q, k, v, kv_tiling=kv_tiling), q, k, v, split, group)
    if kv_tiling == "dynamic":
        raise ValueError("the halo strategy runs frame ranges with static KV tiling only, got kv_tiling='dynamic'; "
                         "use strategy='ulysses' or kv_tiling=None.")
    return halo(kernel, problem, q, k, v, split, rank, group)
