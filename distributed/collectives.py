"""The process group and the collectives natsim.distributed moves tokens with: world size and rank, the frames
each rank holds, exact-size `all_to_all_single` and batched point-to-point exchanges (PyTorch's own collectives:
NCCL on GPUs, gloo on CPUs), and the moves the strategies make with them, each with its adjoint (what the
backward moves):

- `start_heads_chunk` / `start_frames_chunk` (Ulysses, for a group of heads): frame-sharded slabs to
  head-sharded whole sequences and back, a permutation of the data over the ranks, so each one's adjoint is the
  other; left in flight (`Pending`) so that attention on the heads already here overlaps the rest (pipeline.py
  makes them one differentiable operator with the attention between).
- `gather_halo` (the halo exchange): a copy of frames to the ranks that read them; its adjoint `return_halo`
  sends the gradient of every halo frame back to the rank that holds that frame, which adds it to its own
  (ops.py makes the pair differentiable operators).

Exchanges that go out at the same point (a group's q, k and v; its dq, dk and dv) are launched together, as one NCCL
group (`launched_together`). The moves run on `transfer_group(group)`: for NCCL, a twin of the caller's group whose
streams have the GPU's higher priority, so that a transfer in flight beside an attention kernel gets SMs as they
free up instead of waiting for the kernel's last blocks to be placed (docs/performance.md has the GPU timelines). An
exchange issued at an `IssuePoint` waits for the work enqueued before that point only, not for kernels enqueued
since.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from natsim.kernels import place_head_blocks
from natsim.partition import check_split, offsets


def world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("natsim.distributed needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group, e.g. under torchrun).")
    return dist.get_world_size(group), dist.get_rank(group)


HIGH_PRIORITY_VALUES = ("1", "true", "yes", "y")
_twins: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}  # per group name: the group and its twin


def high_priority_transfers() -> bool:
    """Whether natsim moves tokens on a high-priority twin of an NCCL group: yes unless `NATSIM_NCCL_HIGH_PRIORITY`
    is 0 (a twin is one more NCCL communicator, with its buffers, per group), or unless every NCCL stream is
    high-priority already (`TORCH_NCCL_HIGH_PRIORITY`)."""
    if os.environ.get("NATSIM_NCCL_HIGH_PRIORITY", "1").strip().lower() not in HIGH_PRIORITY_VALUES:
        return False
    return os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "0").strip().lower() not in HIGH_PRIORITY_VALUES


def transfer_group(group: Union[dist.ProcessGroup, str, None]) -> dist.ProcessGroup:
    """The group natsim's moves between `group`'s ranks (a group, its name as operators carry it, or None: the
    world) run on: the group itself, or, for an NCCL group where `high_priority_transfers()`, its twin over the
    same ranks with high-priority streams, made on the first move by every rank of the group (only they
    synchronise) and kept while the group lives."""
    if isinstance(group, str):
        group = _resolve_process_group(group)
    group = dist.group.WORLD if group is None else group
    if not high_priority_transfers() or dist.get_backend(group) != "nccl":
        return group
    name = group.group_name
    if name not in _twins or _twins[name][0] is not group:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        twin = dist.new_group(dist.get_process_group_ranks(group), backend="nccl", pg_options=options,
                              use_local_synchronization=True, group_desc=f"natsim_transfers_{name}")
        _twins[name] = (group, twin)
    return _twins[name][1]


def frame_split(local_frames: int, device: torch.device, group=None) -> tuple[int, ...]:
    """Frames held by every rank of `group`, all-gathered from each rank's `local_frames` (one collective;
    `device` is where the collective's tensors live: the GPU for NCCL)."""
    size, _ = world(group)
    mine = torch.tensor([local_frames], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(sizes, mine, group=group)
    return tuple(int(s.item()) for s in sizes)


SPLIT_UNDER_COMPILE_REFUSAL = (
    "under torch.compile, give split=... (the frames of each rank, the same on every rank): without it each call "
    "all-gathers the ranks' frames and reads them on the host, which a graph cannot hold, and a graph compiled on "
    "one rank could not tell when another rank's frames change."
)


def resolve_split(q: torch.Tensor, split: Optional[Sequence[int]], group) -> tuple[int, ...]:
    """The frames of every rank: `split` checked against the group and this rank's `q`, or all-gathered (eager
    calls only: `SPLIT_UNDER_COMPILE_REFUSAL`)."""
    size, rank = world(group)
    if split is None:
        if torch.compiler.is_compiling():
            raise ValueError(SPLIT_UNDER_COMPILE_REFUSAL)
        split = frame_split(q.shape[1], q.device, group)
    else:
        if len(split) != size:
            raise ValueError(f"split must give the frames of each of the {size} ranks, got split={tuple(split)}.")
        split = check_split(split, sum(int(n) for n in split))
    if split[rank] != q.shape[1]:
        raise ValueError(f"rank {rank} holds {q.shape[1]} frames (q.shape[1]) but split gives it {split[rank]}, "
                         f"got split={tuple(split)}.")
    return tuple(split)


class Waitable(Protocol):
    def wait(self) -> object: ...


@dataclass
class Pending:
    """An exchange in flight (`start_exchange`). `wait()` returns what every rank sent here, one piece per rank
    shaped as asked (views of the flat buffer `received`), in rank order; on a GPU it orders the current stream
    after the exchange without blocking the host, so that work enqueued before it overlaps the transfer. `work`
    may be shared by exchanges launched together (`launched_together`)."""

    received: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]
    work: Optional[Waitable]
    allocated_on: Optional[torch.cuda.Stream] = None  # the stream `received` was allocated on (None: CPU)

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.allocated_on is not None:
                current = torch.cuda.current_stream(self.received.device)
                if current != self.allocated_on:  # not reused before this stream's kernels reading it have run
                    self.received.record_stream(current)
        sizes = [math.prod(shape) for shape in self.shapes]
        return [piece.view(shape) for piece, shape in zip(self.received.split(sizes), self.shapes)]


def start_exchange(send: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]], group,
                   packed: Optional[torch.Tensor] = None, issue: Optional["IssuePoint"] = None) -> Pending:
    """Start sending `send[j]` to rank j and receiving pieces shaped `recv_shapes[j]` from it: one
    `all_to_all_single` with exact per-peer sizes (gloo's list all_to_all needs equal shapes; this takes any).
    `packed`: the send pieces already laid out one after the other in rank order in this contiguous tensor (no
    copy). `issue`: the work the transfer waits for (`IssuePoint`), rather than everything enqueued on the
    current stream so far."""
    sizes_out = [t.numel() for t in send]
    sizes_in = [math.prod(shape) for shape in recv_shapes]
    if packed is None:
        packed = send[0].new_empty(sum(sizes_out))
        for piece, t in zip(packed.split(sizes_out), send):
            piece.view(t.shape).copy_(t)
    with issue or contextlib.nullcontext():
        # allocated on the stream the transfer waits for: a block the current stream freed may still be read by
        # a kernel enqueued after the issue point
        received = send[0].new_empty(sum(sizes_in))
        stream = torch.cuda.current_stream(received.device) if received.is_cuda else None
        work = dist.all_to_all_single(received, packed.reshape(-1), sizes_in, sizes_out, group=group,
                                      async_op=True)
    return Pending(received, tuple(tuple(shape) for shape in recv_shapes), work, stream)


@contextlib.contextmanager
def launched_together(group, device: torch.device) -> Iterator[list[Pending]]:
    """The exchanges started inside, appended by the caller to the list this yields, go out as one NCCL group: one
    kernel and one launch instead of one each (a Ulysses group's three exchanges took 0.17, 0.19 and 0.23 ms one
    after the other on 2 H200s, each paying NCCL's launch and latency, and 0.30 ms as one group); they share one
    `work`. Where the backend does not coalesce (gloo), or torch lacks the (private) coalescing manager, they run
    one by one as started."""
    started: list[Pending] = []
    coalescing = getattr(dist, "_coalescing_manager", None)
    if coalescing is None or device.type != "cuda" or not group._get_backend(device).supports_coalescing:
        yield started
        return
    with coalescing(group, device, async_ops=True) as together:
        yield started
    for pending in started:
        pending.work = together


_side_streams: dict[int, torch.cuda.Stream] = {}


class IssuePoint:
    """The work a later collective waits for: what the current stream holds when the point is made. NCCL's stream
    waits for the stream a collective is issued from, everything enqueued on it so far; a transfer of inputs
    packed long ago, issued after an attention kernel was enqueued, would wait for that kernel. Issued under
    `with point:` it waits for the work before the point only, through a side stream that waited for it then,
    so that the host can enqueue a kernel first and issue the transfers while the kernel runs. On CPU tensors
    (gloo) there is nothing to order: a no-op."""

    def __init__(self, device: torch.device):
        self.stream: Optional[torch.cuda.Stream] = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in _side_streams:
                _side_streams[index] = torch.cuda.Stream(device=index)
            self.stream = _side_streams[index]
            self.stream.wait_stream(torch.cuda.current_stream(index))
        self._context: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> "IssuePoint":
        if self.stream is not None:
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))


def send_receive(sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]],
                  group) -> None:
    """Point-to-point: every `(tensor, rank)` of `sends` to that rank of `group`, every one of `receives` filled
    from it, batched (`batch_isend_irecv`); each pair of ranks lists its messages in the same order."""
    ops = [dist.P2POp(dist.isend, t, global_rank(peer, group), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank(peer, group), group) for t, peer in receives]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def global_rank(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def group_name(group) -> str:
    """The name torch.distributed knows `group` by (None: the default group), which operators take."""
    return (dist.group.WORLD if group is None else group).group_name


# -- Ulysses: frame-sharded slabs <-> head-sharded whole sequences, a group of heads at a time ----------------


def start_heads_chunk(packed: torch.Tensor, split: Sequence[int], group, issue: Optional[IssuePoint] = None
                      ) -> list[Pending]:
    """Ulysses' first move for part of the heads: `packed`, `natsim.kernels.pack_head_blocks(tensors, P, span)`
    of `[B, T_r, *rest, H, D]` tensors (this rank's frames, every head; q, k and v alike), gives rank j its heads
    `[j h + lo, j h + hi)` (`span = (lo, hi)`, `h = ceil(H / P)`, heads past H as zeros), one exchange per tensor
    (so that each lands as a whole sequence), launched together (`launched_together`) and issued at `issue` (see
    `start_exchange`); `whole_sequence` waits for one and gives the whole sequence of those heads."""
    batch, _, *rest = packed.shape[2:]
    shapes = [(batch, n, *rest) for n in split]
    with issue or contextlib.nullcontext(), launched_together(group, packed.device) as started:
        started += [start_exchange(list(blocks.unbind(0)), shapes, group, packed=blocks) for blocks in packed]
    return started


def whole_sequence(pending: Pending) -> torch.Tensor:
    """What a `start_heads_chunk` exchange brings: `[B, L, *rest, hi - lo, D]`, every rank's frames in rank order
    (with batch 1 the received buffer as it landed, no copy)."""
    parts = pending.wait()
    batch, _, *rest = parts[0].shape
    if batch == 1:
        return pending.received.view(1, sum(part.shape[1] for part in parts), *rest)
    return torch.cat(parts, dim=1)


def start_frames_chunk(x: torch.Tensor, split: Sequence[int], rank: int, group) -> Pending:
    """Ulysses' second move for part of the heads: `[B, L, *rest, c, D]` (this rank's `c` heads of the whole
    sequence) sends rank j its frames (with batch 1 a contiguous `x` as it is, already in rank order);
    `place_heads` waits and puts what comes back into the heads it belongs to."""
    t = offsets(split)
    send = [x.narrow(1, t[j], split[j]) for j in range(len(split))]
    packed = x if x.shape[0] == 1 and x.is_contiguous() else None
    return start_exchange(send, [(x.shape[0], split[rank], *x.shape[2:])] * len(split), group, packed=packed)


def place_heads(pending: Pending, out: torch.Tensor, span: tuple[int, int]) -> None:
    """Wait for a `start_frames_chunk` exchange and copy what rank j sent into heads `[j h + lo, j h + hi)` of
    `out`, `[B, T_r, *rest, H, D]` (this rank's frames, every head; padded heads past H left out)."""
    pending.wait()
    size = len(pending.shapes)
    place_head_blocks(pending.received.view(size, *pending.shapes[0]), out, size, span)


# -- the halo exchange: key/value frames to the ranks whose queries read them ------------------------------


@dataclass(frozen=True)
class HaloRoutes:
    """The frames one rank's halo exchange moves, as global frames `[lo, hi)` of dimension 0: `own`, the frames
    it holds; `keys`, the frames it gathers (its queries' key frames, own frames among them); `sends`,
    `(peer, lo, hi)` of its own frames that a peer's queries read; `receives`, `(peer, lo, hi)` of a peer's
    frames in `keys`. At most one entry per peer in each, in rank order (how a pair of ranks pairs its
    messages). `as_ints` / `from_ints`: the flat int list an operator's schema carries."""

    own: tuple[int, int]
    keys: tuple[int, int]
    sends: tuple[tuple[int, int, int], ...]
    receives: tuple[tuple[int, int, int], ...]

    def as_ints(self) -> list[int]:
        return [*self.own, *self.keys, len(self.sends), *(n for route in self.sends for n in route),
                *(n for route in self.receives for n in route)]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> "HaloRoutes":
        values = [int(n) for n in values]
        routes = [tuple(values[i:i + 3]) for i in range(5, len(values), 3)]
        return cls(tuple(values[0:2]), tuple(values[2:4]), tuple(routes[:values[4]]), tuple(routes[values[4]:]))


def gather_halo(k: torch.Tensor, v: torch.Tensor, routes: HaloRoutes, group) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v `[B, T_r, ...]` of this rank's frames -> k and v of the frames `routes.keys`: own frames copied
    in while the peers' frames travel straight into place (a frame range of a batch-1 tensor is contiguous;
    otherwise through a staging copy)."""
    (own, _), (first, last) = routes.own, routes.keys
    sends = [(x[:, lo - own:hi - own].contiguous(), peer) for peer, lo, hi in routes.sends for x in (k, v)]
    gathered = [x.new_empty((x.shape[0], last - first, *x.shape[2:])) for x in (k, v)]
    receives, staged = [], []
    for peer, lo, hi in routes.receives:
        for keys in gathered:
            view = keys[:, lo - first:hi - first]
            buffer = view if view.is_contiguous() else torch.empty_like(view)
            receives.append((buffer, peer))
            staged.append((view, buffer))
    lo, hi = overlap(routes.keys, routes.own)
    for keys, x in zip(gathered, (k, v)):
        keys[:, lo - first:hi - first] = x[:, lo - own:hi - own]
    send_receive(sends, receives, group)
    for view, buffer in staged:
        if buffer is not view:
            view.copy_(buffer)
    return gathered[0], gathered[1]


def return_halo(grad_k: torch.Tensor, grad_v: torch.Tensor, routes: HaloRoutes, group
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The adjoint of `gather_halo`: the gradients of the gathered frames `[B, keys, ...]` sent back to the ranks
    that hold them; returns the gradients of this rank's own frames `[B, own, ...]`: what its own queries gave
    them plus what each peer's gave them, added in rank order."""
    (own, own_end), (first, _) = routes.own, routes.keys
    shape = (grad_k.shape[0], own_end - own, *grad_k.shape[2:])
    sends = [(g[:, lo - first:hi - first].contiguous(), peer) for peer, lo, hi in routes.receives
             for g in (grad_k, grad_v)]
    returned = [[grad_k.new_empty((shape[0], hi - lo, *shape[2:])) for _ in range(2)] for _, lo, hi in routes.sends]
    send_receive(sends, [(buffer, peer) for (peer, _, _), pair in zip(routes.sends, returned) for buffer in pair],
                 group)
    grads = [grad_k.new_zeros(shape), grad_v.new_zeros(shape)]
    lo, hi = overlap(routes.keys, routes.own)
    for grad, g in zip(grads, (grad_k, grad_v)):
        grad[:, lo - own:hi - own] = g[:, lo - first:hi - first]
    for (_, lo, hi), pair in zip(routes.sends, returned):
        for grad, buffer in zip(grads, pair):
            grad[:, lo - own:hi - own] += buffer
    return grads[0], grads[1]
