"""Ulysses with its all-to-alls overlapped with attention: `natsim::cp_ulysses`, one operator for the whole
strategy, forward and backward.

Ulysses moves q, k and v to head-sharded whole sequences, attends, and moves the output back. Done in one piece,
every transfer waits for the one before it and for the attention (the moves cost 1-1.5 ms a layer of Wan 720p on 2-4
H200s, the whole gap between its measured and ideal scaling). This operator splits each rank's `ceil(H / P)` heads
(`heads_per_rank`: padded with zero heads where P does not divide H) into groups (`natsim.partition.head_groups`: by
default up to three of two heads or more, as even as they divide) and keeps the transfers in flight. The first group
is packed (one launch for its q, k and v) and its exchanges issued (one per tensor, so that with batch 1 each
arrives as the whole sequence, no copy; launched as one NCCL group, one kernel); the other groups are packed while
it travels; its attention is enqueued, and the other groups' exchanges are issued while it runs. The host spends
about 0.1 ms issuing one NCCL exchange, three a group: issued before the first attention, they would delay it by as
much; issued after it from the compute stream, they would wait for it, since NCCL's stream waits for the stream a
collective comes from. They wait for their packing only (`collectives.IssuePoint`). A group attends as soon as it
has arrived (while the next travels), its output leaves while the next group attends, and it is placed into its
heads while the one after that attends. What stays exposed: the packing, the first group's arrival, the last group's
return and placement. On a GPU the transfers run on NCCL's stream; waiting orders the compute stream, not the host.
NCCL's kernels need SMs: beside an attention kernel they keep pace only when their streams have the higher priority,
which is why the moves run on the group's high-priority twin (`collectives.transfer_group`; docs/performance.md has
the GPU timelines).

What attends is a Python callable registered with `register_attend` (the operator's schema carries its id):
`attend(q, k, v, extras, scale, span)` on `[B, L, *rest, c, D]` head-sharded whole sequences of the heads
`span = (lo, hi)` of this rank's `ceil(H / P)` (`c = hi - lo`), which must treat heads independently (any
attention does) and return q's dtype and shape; `extras` are the call's other tensors, the same for every group (a
key mask, a block mask's tensors, which the callable cuts to the group's heads where they have a head dimension:
callers with such extras give them this rank's `ceil(H / P)` heads, zero heads' included). With `keep`, the forward
runs each group's attention under autograd and hands the graphs to the backward by handle
(`natsim.kernels.hold`); `natsim::cp_ulysses_backward` then pipelines the mirror image: the output gradient's
groups travel in, each group's graph is differentiated as it arrives, and dq, dk, dv travel back while the next
group runs. Nothing is recomputed.

`planning(heads)` (optional, registered with `attend`): a context the forward and backward run each group
under, given the heads of the whole call on this rank's frames (`H`): a planner that plans per head count plans
for the whole call, not for a group of it, so that the groups run the plan one process would.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, ContextManager, Hashable, Optional, Sequence

import torch

from natsim.kernels import (autograd_inside_an_operator, constants_when_compiled, fake_handle, held, hold,
                            pack_head_blocks, refuse_second_order)
from natsim.partition import head_groups, heads_per_rank

from .collectives import (IssuePoint, Pending, group_name, launched_together, place_heads, start_frames_chunk,
                          start_heads_chunk, transfer_group, whole_sequence)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], Optional[float], tuple[int, int]],
                  torch.Tensor]
Planning = Callable[[int], ContextManager]
_attends: dict[int, tuple[Attend, Optional[Planning]]] = {}
_ids: dict[Hashable, int] = {}


def register_attend(attend: Attend, planning: Optional[Planning] = None, key: Optional[Hashable] = None) -> int:
    """Register `attend` (module docstring) and the optional `planning(heads)` context; return the id
    `natsim::cp_ulysses` takes. With `key` (the plain values `attend` is made of), once per key: a later call
    with the same key returns the first id."""
    if key is not None and key in _ids:
        return _ids[key]
    number = len(_attends)
    _attends[number] = (attend, planning)
    if key is not None:
        _ids[key] = number
    return number


def _registered(attend: int) -> tuple[Attend, Planning]:
    if attend not in _attends:
        raise ValueError(f"attend must be an id from register_attend, got attend={attend!r}.")
    run, planning = _attends[attend]
    return run, planning or (lambda heads: contextlib.nullcontext())


def heads_of(t: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """The heads `span` of a tensor whose dimension 1 holds this rank's heads, or the tensor as it is where that
    dimension is 1 (one for every head)."""
    return t if t.shape[1] == 1 else t[:, span[0]:span[1]]


def head_spans(groups: Sequence[int], heads: int) -> list[tuple[int, int]]:
    """`[lo, hi)` of each group of `groups` (head counts in order), which must add up to `heads`."""
    if not groups or min(groups) < 1 or sum(groups) != heads:
        raise ValueError(f"groups must be head counts >= 1 adding up to the {heads} heads each rank attends, got "
                         f"groups={tuple(groups)}.")
    bounds = [0, *itertools.accumulate(groups)]
    return list(zip(bounds[:-1], bounds[1:]))


def _send_first_group(tensors: Sequence[torch.Tensor], spans: list[tuple[int, int]], split: Sequence[int], group
                      ) -> tuple[list[Pending], list[torch.Tensor], IssuePoint]:
    """The first group packed and its exchanges issued; then the other groups packed (while that transfer runs),
    returned with the point their exchanges are to be issued at (once the first attention is enqueued), so that
    they wait for their packing only."""
    first = pack_head_blocks(tensors, len(split), spans[0])
    sent = start_heads_chunk(first, split, group, IssuePoint(first.device))
    later = [pack_head_blocks(tensors, len(split), span) for span in spans[1:]]
    return sent, later, IssuePoint(first.device)


CAPTURE_REFUSAL = (
    "natsim's context-parallel attention does not run under CUDA graph capture: its all-to-alls are left in flight "
    "on NCCL's stream while attention runs, which has not been checked inside a captured graph. Capture the model "
    "on one GPU, or run context parallelism without CUDA graphs (torch.compile without mode='reduce-overhead')."
)


def refuse_capture() -> None:
    """A sentence instead of a captured graph whose collectives no one has checked."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(CAPTURE_REFUSAL)


@torch.library.custom_op("natsim::cp_ulysses", mutates_args=())
def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: Sequence[torch.Tensor], attend: int,
             scale: Optional[float], groups: Sequence[int], split: Sequence[int], rank: int, group: str, keep: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    run, planning = _registered(attend)
    refuse_capture()
    resolved, heads = transfer_group(group), q.shape[-2]
    spans = head_spans(groups, heads_per_rank(heads, len(split)))
    first, later, ready = _send_first_group((q, k, v), spans, split, resolved)
    inbound = [first]
    outbound, graphs, result = [], [], torch.empty_like(q)
    with planning(heads):
        for index, span in enumerate(spans):
            qc, kc, vc = (whole_sequence(part) for part in inbound[index])
            if keep:
                leaves = [t.detach().requires_grad_() for t in (qc, kc, vc)]
                with autograd_inside_an_operator():
                    out = run(*leaves, list(extras), scale, span)
                graphs.append((leaves, out))
                out = out.detach()
            else:
                out = run(qc, kc, vc, list(extras), scale, span)
            if index == 0:  # the first attention is enqueued: the other groups are issued while it runs
                inbound += [start_heads_chunk(blocks, split, resolved, ready) for blocks in later]
            outbound.append(start_frames_chunk(out.to(q.dtype).contiguous(), split, rank, resolved))
            if index:  # the previous group came back during this attention
                place_heads(outbound[index - 1], result, spans[index - 1])
    place_heads(outbound[-1], result, spans[-1])
    return result, (hold(graphs) if keep else fake_handle())


@_ulysses.register_fake
def _ulysses_fake(q, k, v, extras, attend, scale, groups, split, rank, group, keep):
    _registered(attend)
    if isinstance(q.shape[-2], int):  # not symbolic under a dynamic-shape trace: refuse now what the run would
        head_spans(groups, heads_per_rank(q.shape[-2], len(split)))
    return torch.empty_like(q), fake_handle()


@torch.library.custom_op("natsim::cp_ulysses_backward", mutates_args=())
def _ulysses_backward(grad_out: torch.Tensor, graphs: torch.Tensor, attend: int, groups: Sequence[int],
                      split: Sequence[int], rank: int, group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `natsim::cp_ulysses` (this rank's frames): the forward's graphs differentiated group by
    group as the output gradient's groups arrive, the gradients sent back while the next group runs."""
    _, planning = _registered(attend)
    refuse_capture()
    kept = held(graphs, "natsim::cp_ulysses_backward")
    resolved, heads = transfer_group(group), grad_out.shape[-2]
    spans = head_spans(groups, heads_per_rank(heads, len(split)))
    first, later, ready = _send_first_group((grad_out,), spans, split, resolved)
    inbound = [first[0]]
    outbound, result = [], [torch.empty_like(grad_out) for _ in range(3)]
    with planning(heads), autograd_inside_an_operator():
        for index, (leaves, out) in enumerate(kept):
            grad = whole_sequence(inbound[index])
            grads = torch.autograd.grad(out, leaves, grad.to(out.dtype), allow_unused=True)
            grads = [torch.zeros_like(x) if g is None else g.to(grad_out.dtype) for x, g in zip(leaves, grads)]
            if index == 0:
                inbound += [start_heads_chunk(blocks, split, resolved, ready)[0] for blocks in later]
            with launched_together(resolved, grad_out.device) as returning:
                returning += [start_frames_chunk(g.contiguous(), split, rank, resolved) for g in grads]
            outbound.append(returning)
            if index:
                _place_all(outbound[index - 1], result, spans[index - 1])
    kept.clear()  # the graphs' saved tensors go now, not when the handle does
    _place_all(outbound[-1], result, spans[-1])
    return tuple(result)


def _place_all(pending: Sequence[Pending], gradients: Sequence[torch.Tensor], span: tuple[int, int]) -> None:
    for part, gradient in zip(pending, gradients):
        place_heads(part, gradient, span)


@_ulysses_backward.register_fake
def _ulysses_backward_fake(grad_out, graphs, attend, groups, split, rank, group):
    return tuple(torch.empty_like(grad_out) for _ in range(3))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, extras, ctx.attend, _, ctx.groups, ctx.split, ctx.rank, ctx.group, ctx.keep = inputs
    ctx.extras = len(extras)
    ctx.save_for_backward(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out: Optional[torch.Tensor], _grad_handle):
    refuse_second_order()
    if not ctx.keep:
        raise RuntimeError("natsim::cp_ulysses ran with keep=False, so it kept no graphs to differentiate: call it "
                           "with keep=True where its output needs gradients.")
    (graphs,) = ctx.saved_tensors
    grads = (None,) * 3 if grad_out is None else _ulysses_backward(
        grad_out.contiguous(), graphs, ctx.attend, ctx.groups, ctx.split, ctx.rank, ctx.group)
    return (*grads, [None] * ctx.extras, *(None,) * 7)  # nothing for the extras and the plain arguments


_ulysses.register_autograd(_backward, setup_context=_setup_context)


def ulysses_attention(attend: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: tuple[int, ...],
                      rank: int, group, *, extras: Sequence[torch.Tensor] = (), scale: Optional[float] = None,
                      chunks: Optional[int] = None) -> torch.Tensor:
    """Ulysses on `[B, T_r, *rest, H, D]` (this rank's frames, every head) with the registered `attend`, its
    heads in `chunks` groups overlapped with the transfers (`natsim.partition.head_groups` unless given):
    this rank's frames of the output. Differentiable with respect to q, k and v when they require
    grad (the graphs are kept then)."""
    (heads,) = constants_when_compiled(q.shape[-2])  # a value under a dynamic-shape trace too
    groups = head_groups(heads_per_rank(heads, len(split)), None if chunks is None else int(chunks))
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    out, _ = _ulysses(q, k, v, list(extras), attend, scale, list(groups), list(split), rank, group_name(group), keep)
    return out
