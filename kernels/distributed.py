"""Context parallelism over torch.distributed: GNA and sparse attention on tokens sharded across ranks.

Each rank of a process group holds a slab of frames of the token layout, `[B, T_r, *rest, heads, head_dim]`
with rank r holding frames `[t_r, t_{r+1})` of dimension 0 (uneven slabs allowed; the split is all-gathered
from the group or given), and gets back its frames of the output. Everything moves through PyTorch's own
collectives (NCCL on GPUs, gloo on CPUs): `all_to_all_single` and batched point-to-point with exact per-peer
sizes, nothing home-made.

- `"ulysses"` (DeepSpeed-Ulysses): all-to-all from frame-sharded to head-sharded full sequences, the
  single-GPU kernel on `heads / P` heads of the whole layout, all-to-all back. Heads must divide by P.
- `"halo"`: every rank keeps its heads and receives point-to-point (`batch_isend_irecv`), from the ranks that
  hold them, the key/value frames its queries' windows reach (natsim.partition.key_frames: GNA window bounds
  with stride, dilation and causal), then runs the kernel on its queries against that frame range
  (`gna_attention(..., frame_offsets=...)`: global window bounds). Under dilation along dimension 0 the frames received are the hull over the rank's
  dilation groups (exact, a few extra frames may travel).
- `"auto"`: the strategy whose slowest rank is predicted fastest by natsim.partition (per-rank tile work of
  the kernel's tiles, bytes moved, default rates); `natsim.planner.best(..., world_size=P)` ranks with a
  GPU's calibrated cost model instead.

`sparse_attention` shards heads the same way (Ulysses): head-parallel attention composes with any per-head
block mask, so each rank runs its heads of the mask over the whole sequence.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from natsim import Problem, TileConfig
from natsim.partition import STRATEGIES, check_split, choose_strategy, key_frames, offsets, strategy_cost

from .attention import gna_attention as _gna_attention
from .checks import BoolOrBools, IntOrInts, check_qkv
from .sparse import sparse_attention as _sparse_attention
from .sparsemask import SparseMask
from .tiles import TILE_TOKENS, default_tiles

__all__ = ["gna_attention", "sparse_attention", "choose", "frame_split", "STRATEGIES"]


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("natsim.distributed needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group, e.g. under torchrun).")
    return dist.get_world_size(group), dist.get_rank(group)


def frame_split(local_frames: int, device: torch.device, group=None) -> tuple[int, ...]:
    """Frames held by every rank of `group`, all-gathered from each rank's `local_frames` (one collective;
    `device` is where the collective's tensors live: the GPU for NCCL)."""
    size, _ = _world(group)
    mine = torch.tensor([local_frames], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(sizes, mine, group=group)
    return tuple(int(s.item()) for s in sizes)


def _resolve_split(q: torch.Tensor, split: Optional[Sequence[int]], group) -> tuple[int, ...]:
    size, rank = _world(group)
    if split is None:
        split = frame_split(q.shape[1], q.device, group)
    else:
        if len(split) != size:
            raise ValueError(f"split must give the frames of each of the {size} ranks, got split={tuple(split)}.")
        split = check_split(split, sum(int(n) for n in split))
    if split[rank] != q.shape[1]:
        raise ValueError(f"rank {rank} holds {q.shape[1]} frames (q.shape[1]) but split gives it {split[rank]}, "
                         f"got split={tuple(split)}.")
    return tuple(split)


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
    size, rank = _world(group)
    split = _resolve_split(q, split, group)
    problem = Problem((sum(split), *shape[1:]), window, stride, dilation, causal)
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if strategy == "auto":
        strategy = choose(problem, _tiles(problem, head_dim, q_tile, kv_tile), split, batch, heads, head_dim,
                          q.element_size())
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES + ('auto',)}, got strategy={strategy!r}.")
    kernel = functools.partial(_gna_attention, window=problem.window, stride=problem.stride,
                               dilation=problem.dilation, causal=problem.causal, scale=scale, q_tile=q_tile,
                               kv_tile=kv_tile)
    if strategy == "ulysses":
        check_heads(heads, size)
        return _ulysses(lambda q, k, v: kernel(q, k, v, kv_tiling=kv_tiling), q, k, v, split, group)
    if kv_tiling == "dynamic":
        raise ValueError("the halo strategy runs frame ranges with static KV tiling only, got kv_tiling='dynamic'; "
                         "use strategy='ulysses' or kv_tiling=None.")
    return _halo(kernel, problem, q, k, v, split, rank, group)


GRADIENT_REFUSAL = (
    "natsim.distributed moves tensors with torch.distributed collectives, which autograd does not track, and "
    "q, k or v requires grad: the gradients would silently stop here. Call it under torch.no_grad() (or "
    "torch.inference_mode()) for inference; for training, gather the sequence and call "
    "natsim.kernels.gna_attention / sparse_attention on one device."
)


def refuse_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise when autograd would want gradients of q, k or v (no distributed backward yet)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise RuntimeError(GRADIENT_REFUSAL)


def check_heads(heads: int, world_size: int) -> None:
    if heads % world_size:
        raise ValueError(f"the ulysses strategy shards heads over the {world_size} ranks: heads must be divisible "
                         f"by the world size, got heads={heads}, world_size={world_size}.")


def _exchange(send: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]], group,
              packed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rank j gets `send[j]`; returns what every rank sent here: one flat buffer and its pieces shaped
    `recv_shapes[j]` (views, in rank order). One `all_to_all_single` with exact per-peer sizes (gloo's list
    all_to_all needs equal shapes; this takes any). `packed`: the send pieces already laid out one after the
    other in rank order in this contiguous tensor (no copy)."""
    sizes_out = [t.numel() for t in send]
    sizes_in = [math.prod(shape) for shape in recv_shapes]
    if packed is None:
        packed = send[0].new_empty(sum(sizes_out))
        for piece, t in zip(packed.split(sizes_out), send):
            piece.view(t.shape).copy_(t)
    received = send[0].new_empty(sum(sizes_in))
    dist.all_to_all_single(received, packed.reshape(-1), sizes_in, sizes_out, group=group)
    return received, [piece.view(shape) for piece, shape in zip(received.split(sizes_in), recv_shapes)]


def _ulysses(attend, q, k, v, split: tuple[int, ...], group) -> torch.Tensor:
    """All-to-all to head-sharded full sequences, `attend`, all-to-all back (tokens along dimension 1).

    With batch 1 the frames received from the ranks, in rank order, are the whole sequence as they land, and
    the output's frames for the ranks, in rank order, are the output itself: no copies but the head slices."""
    size, rank = len(split), dist.get_rank(group)
    batch, rest, h, head_dim = q.shape[0], q.shape[2:-2], q.shape[-2] // size, q.shape[-1]
    shapes = [(batch, n, *rest, h, head_dim) for n in split]
    whole = []
    for x in (q, k, v):
        received, parts = _exchange([x[..., j * h:(j + 1) * h, :] for j in range(size)], shapes, group)
        whole.append(received.view(1, sum(split), *rest, h, head_dim) if batch == 1 else torch.cat(parts, dim=1))
    out = attend(*whole)  # [B, L, ..., h, D]
    t = offsets(split)
    send = [out.narrow(1, t[j], split[j]) for j in range(size)]
    packed = out if batch == 1 and out.is_contiguous() else None
    _, parts = _exchange(send, [(batch, split[rank], *rest, h, head_dim)] * size, group, packed=packed)
    return torch.cat(parts, dim=-2)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))


def _send_receive(sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]],
                  group) -> None:
    """Point-to-point: every `(tensor, rank)` of `sends` to that rank of `group`, every one of `receives` filled
    from it, batched (`batch_isend_irecv`); each pair of ranks lists its messages in the same order."""
    ops = [dist.P2POp(dist.isend, t, _global(peer, group), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, _global(peer, group), group) for t, peer in receives]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _halo(kernel, problem: Problem, q, k, v, split: tuple[int, ...], rank: int, group) -> torch.Tensor:
    """Receive exactly the key/value frames this rank's queries reach, run the kernel on that frame range.

    The frames land in one `[2, B, frames, ...]` buffer (k, v): halo frames straight from the peers (for batch
    1 a frame range is contiguous; otherwise through a staging copy), this rank's own frames copied in while
    they travel."""
    t = offsets(split)
    own = (t[rank], t[rank + 1])
    need = [key_frames(problem, t[j], t[j + 1]) for j in range(len(split))]
    first, last = need[rank]
    keys = k.new_empty((2, k.shape[0], last - first, *k.shape[2:])) if split[rank] else None
    sends, receives, staged = [], [], []
    for j in range(len(split)):
        if j == rank:
            continue
        give = _overlap(need[j], own)
        if give[1] > give[0]:
            sends += [(x[:, give[0] - own[0]:give[1] - own[0]].contiguous(), j) for x in (k, v)]
        take = _overlap(need[rank], (t[j], t[j + 1]))
        if take[1] > take[0] and keys is not None:
            for view in keys[:, :, take[0] - first:take[1] - first]:
                buffer = view if view.is_contiguous() else torch.empty_like(view)
                receives.append((buffer, j))
                staged.append((view, buffer))
    if keys is None:  # no frames here: only send
        _send_receive(sends, receives, group)
        return q.new_empty(q.shape)
    mine = _overlap(need[rank], own)
    keys[0, :, mine[0] - first:mine[1] - first] = k[:, mine[0] - own[0]:mine[1] - own[0]]
    keys[1, :, mine[0] - first:mine[1] - first] = v[:, mine[0] - own[0]:mine[1] - own[0]]
    _send_receive(sends, receives, group)
    for view, buffer in staged:
        if buffer is not view:
            view.copy_(buffer)
    return kernel(q, keys[0], keys[1], frame_offsets=(own[0], first, problem.shape[0]))


def _mask_heads(mask, heads: int, lo: int, hi: int):
    """Heads `[lo, hi)` of a per-head block mask (a tensor or SparseMask); a mask of one head broadcasts."""
    if isinstance(mask, SparseMask):
        count = mask.kv_num_blocks.shape[1]
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        count = mask.shape[1]
    else:
        return mask  # sparse_attention rejects it with its own sentence
    if count not in (1, heads):
        raise ValueError(f"mask must have 1 or heads={heads} heads (its dimension 1), got {count}.")
    if count == 1:
        return mask
    if isinstance(mask, SparseMask):
        return replace(mask, kv_num_blocks=mask.kv_num_blocks[:, lo:hi], kv_indices=mask.kv_indices[:, lo:hi])
    return mask[:, lo:hi]


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Union[torch.Tensor, SparseMask],
    q_block: Optional[int] = None,
    kv_block: Optional[int] = None,
    *,
    group=None,
    split: Optional[Sequence[int]] = None,
    merge: Optional[str] = None,
    scale: Optional[float] = None,
    schedule: Optional[str] = None,
) -> torch.Tensor:
    """`natsim.kernels.sparse_attention` on `[B, N_r, heads, head_dim]` tokens sharded over `group` (Ulysses).

    `mask` is the whole sequence's block mask (`[B or 1, heads or 1, nQ, nKV]` booleans or a `SparseMask`),
    the same on every rank; each rank runs its `heads / P` heads of it. Returns this rank's output tokens.
    """
    refuse_gradients(q, k, v)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a [batch, tokens, heads, head_dim] tensor, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
    size, rank = _world(group)
    split = _resolve_split(q, split, group)
    heads = q.shape[-2]
    check_heads(heads, size)
    h = heads // size
    mask = _mask_heads(mask, heads, rank * h, (rank + 1) * h)

    def attend(q, k, v):
        return _sparse_attention(q, k, v, mask, q_block, kv_block, merge=merge, scale=scale, schedule=schedule)

    return _ulysses(attend, q, k, v, split, group)
