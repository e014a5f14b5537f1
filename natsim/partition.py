"""Context parallelism in the simulator: a layout sharded along its first dimension over P ranks.

Rank r holds frames `[t_r, t_{r+1})` of dimension 0 (a "frame" is one index of dimension 0 with everything
behind it). Two ways to attend across ranks (natsim.distributed runs them):

- **ulysses**: all-to-all from frame-sharded to head-sharded tensors, every rank runs the whole layout for
  `ceil(heads / P)` heads (zero heads pad what P does not divide), all-to-all back. Per rank: the full problem's
  tiles times its heads. natsim.distributed attends a rank's heads in groups (`head_groups`), each group's
  transfers overlapping another group's attention (`pipeline_seconds`): only the first group's arrival and the
  last group's return are exposed when attention is the longer stage.
- **halo**: every rank keeps its heads and queries and receives the key/value frames its queries' windows
  reach (`key_frames`), then runs the kernel on its queries against that frame range. The kernel's tiles are
  cut from the rank's own first query frame and first key frame (`frame_dim_tiles`), so the per-rank counts
  are not a slice of the single-process counts; they are what the kernel's debug counters report.

Training adds each strategy's backward: its tile work, and the gradients moving back along the forward's routes
mirrored (natsim.distributed's adjoint collectives). Ulysses' backward moves the output's gradient to
head-sharded sequences and the gradients of q, k and v back: the forward's bytes with sent and received
swapped. The halo's sends the gradients of the key and value frames a rank received back to their owners: the
forward's bytes, swapped too.

Under dilation along dimension 0 a rank's frames fall into several dilation groups; each is a contiguous
run of its global group, and the key frames a rank receives are the hull over its groups (a few frames of
other groups may ride along; the kernel never reads them).

Numpy only, like the rest of the simulator.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Union

import numpy as np

from .dimension import DimTiles, ceil_div, dim_tiles, key_ranges
from .problem import Problem
from .simulate import outer_per_q_tile
from .tiles import TileConfig
from .window import window_bounds

STRATEGIES = ("ulysses", "halo")

# What a strategy costs, for choosing between them without a calibrated GPU (natsim.distributed's "auto"):
# seconds per FLOP of a visited tile pair (the H100 calibration's full-tile rate, kernels/tiles.py) and
# bytes per second a rank sends or receives (NVLink between two GPUs of one host, order of magnitude).
TILE_FLOP_SECONDS = 1.78e-15
LINK_BYTES_PER_SECOND = 150e9


@dataclass(frozen=True)
class Rate:
    """One kind of move between ranks: `seconds(bytes) = latency_seconds + bytes / bytes_per_second` for a rank
    moving `bytes` (the larger of what it sends and receives), nothing for no bytes."""

    bytes_per_second: float
    latency_seconds: float = 0.0

    def __post_init__(self):
        finite = all(isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
                     for value in (self.bytes_per_second, self.latency_seconds))
        if not finite or not self.bytes_per_second > 0 or not self.latency_seconds >= 0:
            raise ValueError("a Rate needs finite numbers, bytes_per_second > 0 and latency_seconds >= 0, got "
                             f"bytes_per_second={self.bytes_per_second!r}, latency_seconds={self.latency_seconds!r}.")

    def seconds(self, moved: int) -> float:
        return 0.0 if moved <= 0 else self.latency_seconds + moved / self.bytes_per_second


@dataclass(frozen=True)
class Link:
    """The interconnect as the strategies use it: Ulysses moves its tokens with all-to-alls, the halo exchange
    with point-to-point sends. `source` says where the rates come from: natsim's default (one rate for both,
    `LINK_BYTES_PER_SECOND`, no latency) or the calibration that measured them on a machine
    (natsim.distributed.calibrate_link, `natsim calibrate --link`)."""

    all_to_all: Rate = Rate(LINK_BYTES_PER_SECOND)
    point_to_point: Rate = Rate(LINK_BYTES_PER_SECOND)
    source: str = "default"

    @classmethod
    def uniform(cls, bytes_per_second: float) -> "Link":
        """Both moves at one rate, without latency (a rate given by hand)."""
        return cls(Rate(bytes_per_second), Rate(bytes_per_second), f"{bytes_per_second / 1e9:g} GB/s given")

    def rate(self, strategy: str) -> Rate:
        return self.all_to_all if strategy == "ulysses" else self.point_to_point

    def describe(self) -> str:
        def one(rate: Rate) -> str:
            return f"{rate.bytes_per_second / 1e9:.3g} GB/s + {rate.latency_seconds * 1e6:.3g} us"
        return f"all-to-all {one(self.all_to_all)}, point-to-point {one(self.point_to_point)} ({self.source})"

    def to_dict(self) -> dict:
        return {"all_to_all": [self.all_to_all.bytes_per_second, self.all_to_all.latency_seconds],
                "point_to_point": [self.point_to_point.bytes_per_second, self.point_to_point.latency_seconds],
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> "Link":
        if not isinstance(data, dict):
            raise ValueError(f"a link must be a JSON object with 'all_to_all' and 'point_to_point' rates, got a value "
                             f"of type {type(data).__name__}.")
        return cls(Rate(*data["all_to_all"]), Rate(*data["point_to_point"]), str(data.get("source", "")))


DEFAULT_LINK = Link()
# The backward's time per visited tile pair over the forward's, for the same default rates: its dK/dV and dQ
# kernels run seven tile products per pair against the forward's two (docs/training.md).
BACKWARD_TILE_WORK = 3.5


def even_split(frames: int, world_size: int) -> tuple[int, ...]:
    """Frames per rank, as even as possible, the first ranks one larger (torch.chunk-like but never empty
    while there are enough frames)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got world_size={world_size!r}.")
    base, extra = divmod(frames, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def aligned_split(problem: Problem, world_size: int) -> tuple[int, ...]:
    """`even_split` with its cuts moved to the nearest stride-group boundary along dimension 0, so that no
    stride group (which shares one window) straddles two ranks; `even_split` if a rank would be left empty."""
    s, frames = problem.stride[0] * problem.dilation[0], problem.shape[0]
    cuts = [round(frames * r / world_size / s) * s for r in range(1, world_size)]
    t = [0, *cuts, frames]
    split = tuple(b - a for a, b in zip(t, t[1:]))
    return split if all(n > 0 for n in split) else even_split(frames, world_size)


def check_split(split: Sequence[int], frames: int) -> tuple[int, ...]:
    """`split` as a tuple of non-negative ints summing to `frames` (sentence error otherwise: a fractional or
    boolean count too, which `int()` would have truncated)."""
    try:
        if any(isinstance(n, bool) for n in split):
            raise TypeError
        sizes = tuple(operator.index(n) for n in split)  # ints, numpy's, torch's symbolic ones; not 3.5
    except TypeError:
        raise ValueError(f"split must be whole frame counts, got split={tuple(split)}.") from None
    if any(n < 0 for n in sizes) or sum(sizes) != frames:
        raise ValueError(f"split must be non-negative frame counts that add up to the {frames} frames of "
                         f"dimension 0, got split={tuple(split)}.")
    return sizes


def offsets(split: Sequence[int]) -> tuple[int, ...]:
    """First frame of every rank, and the total at the end: `(t_0, ..., t_P)`. Plain Python ints (no numpy),
    so that torch.compile keeps them constants where natsim.distributed moves frames."""
    return tuple(itertools.accumulate((int(n) for n in split), initial=0))


@lru_cache(maxsize=4096)
def key_frames(problem: Problem, q_start: int, q_stop: int) -> tuple[int, int]:
    """The frames `[k_start, k_stop)` of dimension 0 that queries in frames `[q_start, q_stop)` attend (the
    hull over their dilation groups); `(q_start, q_start)` for no queries."""
    if q_stop <= q_start:
        return q_start, q_start
    L, w, s, d, c = problem.shape[0], problem.window[0], problem.stride[0], problem.dilation[0], problem.causal[0]
    start, end = key_ranges(L, w, s, d, c)
    x = np.arange(q_start, q_stop)
    group = x % d
    return int((group + d * start[x]).min()), int((group + d * (end[x] - 1)).max()) + 1


def frame_dim_tiles(problem: Problem, q_tile: int, kv_tile: int, q_start: int, q_len: int, k_start: int,
                    k_len: int) -> DimTiles:
    """Tile counts along dimension 0 for queries in frames `[q_start, q_start + q_len)` against keys in
    `[k_start, k_start + k_len)`, tiles cut from the local first frames, numbered like the kernel's (local
    dilation groups of the query frames; static KV tiling). The keys must cover every query's window."""
    L, w, s, d, c = problem.shape[0], problem.window[0], problem.stride[0], problem.dilation[0], problem.causal[0]
    nq = ceil_div(q_len, q_tile * d)
    gi = np.arange(d)[:, None]
    len_q = q_len // d + (gi < q_len % d)
    x0 = q_start + gi
    gg = x0 % d
    kg = (gg - k_start) % d
    q_off, k_off = x0 // d, (k_start + kg) // d
    glen = L // d + (gg < L % d)
    klen = k_len // d + (kg < k_len % d)
    first = np.arange(nq)[None, :] * q_tile
    real = first < len_q
    last = np.maximum(np.minimum(first + q_tile, len_q) - 1, 0)
    start_first, end_first = window_bounds(np.where(real, first, 0) + q_off, glen, w, s, c)
    start_last, end_last = window_bounds(last + q_off, glen, w, s, c)
    start_first, end_first, start_last, end_last = (a - k_off for a in (start_first, end_first, start_last,
                                                                         end_last))
    kv_first = start_first // kv_tile
    visited = np.where(real, ceil_div(end_last, kv_tile) - kv_first, 0)
    m = np.arange(max(int(visited.max(initial=0)), 1))[None, None, :]
    key_start = (kv_first * kv_tile)[..., None] + m * kv_tile
    key_end = np.minimum(key_start + kv_tile, klen[..., None])
    full_flags = (m < visited[..., None]) & (start_last[..., None] <= key_start) & (end_first[..., None] >= key_end)
    starts, ends = key_ranges(L, w, s, d, c)
    pairs = int((ends - starts)[q_start:q_start + q_len].sum())
    return DimTiles(groups=d, q_tiles_per_group=nq, kv_tiles_per_group=ceil_div(k_len, kv_tile * d),
                    visited=visited.astype(np.int64), full=full_flags.sum(axis=-1).astype(np.int64),
                    kv_first=kv_first.astype(np.int64), full_flags=full_flags, attended_pairs=pairs)


@dataclass(frozen=True)
class RankTiles:
    """One rank's tile work for one head: totals, the busiest Q tile, and per-Q-tile counts in the kernel's
    permuted order (as `natsim.kernels.gna_tile_counts(..., frames=...)` returns them)."""

    visited: int
    full: int
    most: int
    num_q_tiles: int
    per_q_tile_visited: np.ndarray
    per_q_tile_full: np.ndarray


def rank_tiles(problem: Problem, tiles: TileConfig, q_frames: tuple[int, int],
               k_frames: Optional[tuple[int, int]] = None) -> RankTiles:
    """Tile work of queries in frames `q_frames = (start, stop)` against keys in `k_frames` (default: exactly
    the frames they reach, `key_frames`), multi-D static tiling."""
    if tiles.tiling != "multi" or tiles.kv_tiling != "static":
        raise ValueError(f"per-rank tile counts need multi-D tiles with static KV tiling, got tiling="
                         f"{tiles.tiling!r}, kv_tiling={tiles.kv_tiling!r}.")
    q_start, q_stop = q_frames
    k_start, k_stop = key_frames(problem, q_start, q_stop) if k_frames is None else k_frames
    q_tile, kv_tile = tiles.dims(problem)
    dims = [frame_dim_tiles(problem, q_tile[0], kv_tile[0], q_start, q_stop - q_start, k_start, k_stop - k_start)]
    dims += [dim_tiles(L, w, s, d, c, tq, tk, False) for L, w, s, d, c, tq, tk in zip(
        problem.shape[1:], problem.window[1:], problem.stride[1:], problem.dilation[1:], problem.causal[1:],
        q_tile[1:], kv_tile[1:])]
    visited = outer_per_q_tile([d.visited for d in dims])
    full = outer_per_q_tile([d.full for d in dims])
    return RankTiles(int(visited.sum()), int(full.sum()), int(visited.max(initial=0)), visited.size, visited, full)


@dataclass(frozen=True)
class RankCost:
    """One rank under one strategy: heads it runs, tile work (all its heads, the forward's), frames received,
    the forward's bytes and, for a training step, the backward's (zero otherwise); `seconds` covers the
    forward and, when training, the backward."""

    rank: int
    frames: tuple[int, int]
    heads: int
    visited_tiles: int
    full_tiles: int
    key_frames: tuple[int, int]
    bytes_sent: int
    bytes_received: int
    seconds: float
    backward_bytes_sent: int = 0
    backward_bytes_received: int = 0

    def to_dict(self) -> dict:
        return {"rank": self.rank, "frames": list(self.frames), "heads": self.heads,
                "visited_tiles": self.visited_tiles, "full_tiles": self.full_tiles,
                "key_frames": list(self.key_frames), "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "backward_bytes_sent": self.backward_bytes_sent,
                "backward_bytes_received": self.backward_bytes_received, "predicted_s": self.seconds}

    @classmethod
    def from_dict(cls, data: dict) -> "RankCost":
        """The rank's cost from `to_dict` output."""
        return cls(int(data["rank"]), _pair(data["frames"]), int(data["heads"]), int(data["visited_tiles"]),
                   int(data["full_tiles"]), _pair(data["key_frames"]), int(data["bytes_sent"]),
                   int(data["bytes_received"]), float(data["predicted_s"]),
                   int(data.get("backward_bytes_sent", 0)), int(data.get("backward_bytes_received", 0)))


def _pair(values) -> tuple[int, int]:
    first, last = values
    return int(first), int(last)


@dataclass(frozen=True)
class StrategyCost:
    """Every rank's cost under one strategy; the call takes as long as the slowest rank."""

    strategy: str
    ranks: tuple[RankCost, ...]

    @property
    def seconds(self) -> float:
        return max(r.seconds for r in self.ranks)

    @property
    def bytes_moved(self) -> int:
        """Bytes sent by all ranks together, forward and (when priced for training) backward."""
        return sum(r.bytes_sent + r.backward_bytes_sent for r in self.ranks)

    @property
    def max_visited_tiles(self) -> int:
        return max(r.visited_tiles for r in self.ranks)

    @property
    def imbalance(self) -> float:
        """Busiest rank's tiles over the mean (1.0 is perfect balance)."""
        mean = sum(r.visited_tiles for r in self.ranks) / len(self.ranks)
        return self.max_visited_tiles / mean if mean else 1.0

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "predicted_s": self.seconds, "bytes_moved": self.bytes_moved,
                "imbalance": self.imbalance, "ranks": [r.to_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, data: dict) -> "StrategyCost":
        """Every rank's cost from `to_dict` output (the totals it also writes are derived again)."""
        return cls(str(data["strategy"]), tuple(RankCost.from_dict(rank) for rank in data["ranks"]))


def _tile_flops(tiles: TileConfig, problem: Problem, head_dim: int) -> float:
    q_tile, kv_tile = tiles.dims(problem)
    return 4.0 * head_dim * math.prod(q_tile) * math.prod(kv_tile)


def strategy_cost(problem: Problem, tiles: TileConfig, split: Sequence[int], strategy: str, *, batch: int,
                  heads: int, head_dim: int, element_bytes: int, tile_seconds: Optional[float] = None,
                  link: Link = DEFAULT_LINK, training: bool = False,
                  backward_tile_seconds: Optional[float] = None, chunks: Optional[int] = None,
                  halo_on_gathered: bool = False) -> StrategyCost:
    """Per-rank tile work and bytes of `strategy` with frames split `split` over the ranks.

    Seconds per rank = visited tiles (all its heads, batch included) x `tile_seconds` + the larger of bytes
    sent and received at `link`'s rate for the strategy's move. `tile_seconds` defaults to one tile pair's FLOPs at
    `TILE_FLOP_SECONDS`. Ulysses gives every rank `ceil(heads / P)` heads (padded with zero heads where P does
    not divide them: their work and bytes count). `training` adds the backward the
    same way: its bytes (module docstring) and visited tiles x `backward_tile_seconds` (default
    `BACKWARD_TILE_WORK` x `tile_seconds`); the gradients have the inputs' `element_bytes`. Ulysses attends
    each rank's heads in groups overlapped with the transfers (`pipeline_seconds`, forward and backward;
    `head_groups(heads, chunks)`); the halo exchange moves before the kernel runs.
    `halo_on_gathered`: the halo exchange runs a rank's gathered frames as a layout of their own (how
    natsim.distributed trains it on GPUs), its tile work that layout's, every gathered frame's queries included.
    """
    split = check_split(split, problem.shape[0])
    P = len(split)
    t = offsets(split)
    frame_bytes = math.prod(problem.shape[1:]) * heads * head_dim * element_bytes * batch  # one frame, all heads
    if tile_seconds is None:
        tile_seconds = _tile_flops(tiles, problem, head_dim) * TILE_FLOP_SECONDS
    if backward_tile_seconds is None:
        backward_tile_seconds = BACKWARD_TILE_WORK * tile_seconds

    def priced(r: int, heads_here: int, visited: int, full: int, frames: tuple[int, int], sent: int,
               received: int) -> RankCost:
        moving = link.rate(strategy).seconds(max(sent, received))
        seconds = visited * tile_seconds + moving
        if training:  # the backward's bytes are the forward's with the directions swapped
            seconds += visited * backward_tile_seconds + moving
        return RankCost(r, (t[r], t[r + 1]), heads_here, visited, full, frames, sent, received, seconds,
                        received if training else 0, sent if training else 0)

    ranks = []
    if strategy == "ulysses":
        from .simulate import simulate

        whole = simulate(problem, tiles)
        local = heads_per_rank(heads, P)  # padded with zero heads to P x local where P does not divide them
        slice_bytes = frame_bytes // heads * local  # one frame of one rank's heads
        rate = link.all_to_all
        groups = head_groups(local, chunks)
        for r in range(P):
            # q, k, v out: (P - 1) of P head slices of own frames; back: own heads of everyone else's frames.
            qkv_sent, out_received = 3 * split[r] * (P - 1) * slice_bytes, split[r] * (P - 1) * slice_bytes
            qkv_received, out_sent = 3 * (problem.shape[0] - split[r]) * slice_bytes, \
                (problem.shape[0] - split[r]) * slice_bytes
            inbound, outbound = max(qkv_sent, qkv_received), max(out_sent, out_received)
            visited = whole.visited_tiles * local * batch
            seconds = pipeline_seconds(visited * tile_seconds, rate, inbound, outbound, groups)
            if training:  # the output's gradient in, the gradients of q, k and v back
                seconds += pipeline_seconds(visited * backward_tile_seconds, rate, outbound, inbound, groups)
            sent, received = qkv_sent + out_sent, qkv_received + out_received
            ranks.append(RankCost(r, (t[r], t[r + 1]), local, visited, whole.full_tiles * local * batch,
                                  (0, problem.shape[0]), sent, received, seconds, received if training else 0,
                                  sent if training else 0))
    elif strategy == "halo":
        needs = [key_frames(problem, t[r], t[r + 1]) for r in range(P)]
        for r in range(P):
            own = (t[r], t[r + 1])
            received = 2 * (needs[r][1] - needs[r][0] - _overlap(needs[r], own)) * frame_bytes
            sent = 2 * sum(_overlap(needs[j], own) for j in range(P) if j != r) * frame_bytes
            visited = full = 0
            if split[r] and halo_on_gathered:
                from .simulate import simulate

                gathered = simulate(Problem((needs[r][1] - needs[r][0], *problem.shape[1:]), problem.window,
                                            problem.stride, problem.dilation, problem.causal), tiles)
                visited, full = gathered.visited_tiles * heads * batch, gathered.full_tiles * heads * batch
            elif split[r]:
                work = rank_tiles(problem, tiles, own, needs[r])
                visited, full = work.visited * heads * batch, work.full * heads * batch
            ranks.append(priced(r, heads, visited, full, needs[r], sent, received))
    else:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got strategy={strategy!r}.")
    return StrategyCost(strategy, tuple(ranks))


MAX_DEFAULT_CHUNKS = 3
MIN_DEFAULT_GROUP_HEADS = 2


def heads_per_rank(heads: int, ranks: int) -> int:
    """The heads each rank attends under Ulysses: `ceil(heads / ranks)`. Where the ranks do not divide the heads,
    natsim.distributed pads them with zero heads to `ranks` times that (`natsim.kernels.pack_head_blocks`): the
    last ranks attend some zero heads, whose outputs are not placed back, so every rank runs the same groups."""
    return -(-heads // ranks)


def head_groups(heads_per_rank: int, chunks: Optional[int] = None) -> tuple[int, ...]:
    """The sizes of the groups natsim.distributed's Ulysses attends a rank's heads in, in order: `chunks` groups
    (None: up to `MAX_DEFAULT_CHUNKS`, of at least `MIN_DEFAULT_GROUP_HEADS` heads each, so one group below four
    heads a rank), as even as they divide (the first ones one larger). The first group's arrival and the last one's
    return stay exposed, a third of the transfers each with three; every further group adds four NCCL exchanges
    in two launches (its q, k and v together, then its output), whose issue costs the host 0.1-0.2 ms each, a
    kernel's launch and tail, and an exchange's latency. One-head groups lose (docs/performance.md): a one-head
    attention ran a fifth slower per head on 2 H200s, and on 4 H200s three heads a rank in three groups took 5.0 ms
    a call against 3.7 ms in one (the host issuing the exchanges slower than the GPU ran the attentions), a Wan 720p
    step 203.9 ms against 190.2. With q, k and v launched together, 1 + 2 and 2 + 1 heads ran that step within 1.6%
    of one group (178.8 and 179.5 against 181.7 ms), inside its run-to-run spread: one group stays the default."""
    if heads_per_rank < 1:
        raise ValueError(f"heads_per_rank must be >= 1, got heads_per_rank={heads_per_rank}.")
    if chunks is None:
        chunks = max(1, min(heads_per_rank // MIN_DEFAULT_GROUP_HEADS, MAX_DEFAULT_CHUNKS))
    if not 1 <= chunks <= heads_per_rank:
        raise ValueError(f"chunks must be between 1 and the {heads_per_rank} heads each rank attends, got "
                         f"chunks={chunks}.")
    base, extra = divmod(heads_per_rank, chunks)
    return tuple(base + (index < extra) for index in range(chunks))


def pipeline_seconds(compute: float, rate: Rate, inbound: int, outbound: int,
                     groups: Union[int, Sequence[int]] = 1) -> float:
    """One rank's Ulysses call with its heads in groups (natsim.distributed's pipeline): `compute` seconds of
    attention and `inbound` / `outbound` bytes (the larger of sent and received) shared by the groups in
    proportion to their heads (`groups`: their head counts in order, or a number of equal groups). Every group's
    inbound transfer starts at once, one after the other on the link, a group attends once it has arrived and the
    one before it is done, and its outbound transfer follows on the link. The last outbound transfer's end. One
    group: the transfers and the attention one after the other."""
    sizes = (1,) * groups if isinstance(groups, int) else tuple(groups)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"groups must be a number >= 1 or head counts >= 1, got groups={groups}.")
    shares = [size / sum(sizes) for size in sizes]
    arrive, link_free = [], 0.0
    for share in shares:
        link_free += rate.seconds(inbound * share)
        arrive.append(link_free)
    attended = 0.0
    for share, arrived in zip(shares, arrive):
        attended = max(attended, arrived) + compute * share
        link_free = max(link_free, attended) + rate.seconds(outbound * share)
    return link_free


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def choose_strategy(costs: Sequence[StrategyCost]) -> StrategyCost:
    """The strategy whose slowest rank is fastest (first listed on ties)."""
    return min(costs, key=lambda c: c.seconds)


# -- a model's step under Ulysses ----------------------------------------------------------------------------


def ulysses_layer_bytes(tokens: int, channels: int, element_bytes: int, world_size: int) -> tuple[int, int]:
    """Bytes the busiest rank moves in one attention layer of a model under Ulysses (diffusers' context
    parallelism with natsim, or natsim.distributed): `(q, k and v to head-sharded sequences, the output back)`.
    Each of the four tensors is a rank's share of `tokens` (the largest, `ceil(tokens / P)`) of `channels`
    values (heads x head_dim), of which it keeps `1 / P` and sends (and receives) the rest."""
    if world_size < 2:
        return 0, 0
    share = -(-tokens // world_size) * channels * element_bytes
    moved = share * (world_size - 1) // world_size
    return 3 * moved, moved


def ulysses_step_seconds(one_gpu_seconds: float, layers: int, tokens: int, channels: int, element_bytes: int,
                         world_size: int, link: Link = DEFAULT_LINK, attention_seconds: float = 0.0,
                         groups: Union[int, Sequence[int]] = 1, heads: Optional[int] = None) -> float:
    """A model step over `world_size` GPUs under Ulysses, from the same step on one GPU: every rank computes `1 / P`
    of it outside attention (its tokens) and its heads' share inside, and each of the `layers` attention layers adds
    its two all-to-alls at `link`'s rate (`ulysses_layer_bytes`). With its heads in `groups` (head counts in
    order, or a number of equal groups: natsim.distributed's pipeline) the transfers overlap a rank's share of the
    layer's attention, `attention_seconds` on one GPU (`pipeline_seconds`); with one group they follow each
    other. `heads` (the
    `channels`' heads; None: P divides them): where P does not divide them each rank attends `ceil(heads / P)`,
    zero heads padding the rest, and moves them too. Checked against measured steps in docs/performance.md."""
    if world_size < 1 or layers < 0 or one_gpu_seconds < 0 or attention_seconds < 0:
        raise ValueError(f"world_size must be >= 1, layers, one_gpu_seconds and attention_seconds >= 0, got "
                         f"world_size={world_size}, layers={layers}, one_gpu_seconds={one_gpu_seconds}, "
                         f"attention_seconds={attention_seconds}.")
    if world_size == 1:
        return one_gpu_seconds
    share, moved = 1 / world_size, channels
    if heads is not None and heads % world_size:
        per_rank = heads_per_rank(heads, world_size)
        share, moved = per_rank / heads, channels // heads * per_rank * world_size
    attention = attention_seconds * share
    inbound, outbound = ulysses_layer_bytes(tokens, moved, element_bytes, world_size)
    layer = pipeline_seconds(attention, link.all_to_all, inbound, outbound, groups)
    return (one_gpu_seconds - layers * attention_seconds) / world_size + layers * layer
