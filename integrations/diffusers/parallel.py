"""natsim inside diffusers' context parallelism (`transformer.enable_parallelism(config=ContextParallelConfig(
ulysses_degree=P))`), in either order with `apply`.

Under diffusers' context parallelism each rank's blocks hold an equal share of the tokens (the model's `_cp_plan`
splits its inputs), and every attention call gets `parallel_config`: diffusers' own attention then runs Ulysses
(all-to-all to all tokens of `heads / P` heads, attention, all-to-all back) or ring attention. natsim takes the
calls it serves (the video tokens' self-attention and joint attention, attention.py) itself:

1. q, k and v go from this rank's tokens of every head to every token of its `heads / P` heads through
   natsim.distributed's Ulysses pipeline (`natsim::cp_ulysses`: one differentiable operator, opaque to
   torch.compile, which attends the heads in groups while the other groups travel; one group under a
   content-adaptive mask, which decides once per call);
2. the ranks' shares arrive in rank order, each holding its share of the tokens outside the layout (text) and of
   the image tokens, in the order the processor concatenated them; they are put into the order one process
   sees (`Shares`), so that the video tokens form the layout again;
3. the router attends as on one GPU (GNA over the whole layout, or content-adaptive masks), and the output goes
   back by the same way.

Under `ulysses_anything=True` diffusers cuts each sharded input with `torch.tensor_split` (shares may differ by a
token) and pads heads that `ulysses_degree` does not divide: natsim serves self-attention over the image tokens,
whose shares every rank computes from the layout (natsim.distributed's Ulysses takes uneven shares and pads the
heads alike), and refuses joint attention and key masks there with a sentence, on every rank alike.

A key mask (text padding) is all-gathered and ordered alike. Calls natsim does not serve (cross-attention to
text) go to diffusers' own context-parallel attention.

What natsim cannot run under context parallelism is refused with a sentence, at `apply` when parallelism is
already on and at `enable_parallelism` when natsim is already applied (natsim wraps the method of the model
while applied): ring attention (`ring_degree > 1`: GNA's halo exchange lives in natsim.distributed), split
attention over the latent (Latte), and `tile_order=True` (diffusers splits
the rotary tables before a block could put them in tile order). A call that reaches natsim's attention under a
parallel configuration natsim was not told of raises rather than attend on this rank's tokens alone, and so does
joint attention under a `cp_plan` other than the class's own (HunyuanVideo and CogVideoX declare none), where
natsim cannot know which of a rank's tokens are text.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from natsim.distributed.pipeline import register_attend, ulysses_attention


@dataclass(frozen=True)
class Ulysses:
    """The Ulysses process group of a diffusers context-parallel configuration: this rank's place in it and its
    size."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int
    own_plan: bool = True  # the shares follow diffusers' own context-parallel plan of the class
    anything: bool = False  # ulysses_anything: shares as torch.tensor_split cuts them, heads padded by diffusers


def context_parallel(config: Any) -> Optional[Any]:
    """The `ContextParallelConfig` of a diffusers `ParallelConfig` or `ContextParallelConfig` (None: tensor
    parallelism only, under which every rank attends over all tokens of its own heads, as natsim does as is)."""
    if config is None:
        return None
    return getattr(config, "context_parallel_config", config)


def refusal(config: Any, router, tile_order: Optional[bool]) -> Optional[str]:
    """Why natsim cannot run under the context-parallel `config` (a `ContextParallelConfig`), or None."""
    ring = int(config.ring_degree or 1)
    if ring > 1:
        return (f"diffusers' ring attention (ring_degree={ring}) passes every rank's keys around a ring, which GNA "
                "does not need: use ulysses_degree instead (each rank then runs natsim's attention on its heads "
                "over the whole layout), or natsim.distributed.gna_attention(strategy='halo') in your own model.")
    if router.views:
        return ("this model splits its attention over the latent (spatial and temporal attention), which diffusers "
                "does not shard as one sequence.")
    if tile_order:
        return ("tile_order=True: diffusers splits the rotary tables before a block could put them in the tile "
                "order (leave tile_order=None; natsim attends in row-major order under context parallelism).")
    return None


def ulysses_of(config: Any, own_plan: bool) -> Ulysses:
    """The Ulysses group of a set-up `ContextParallelConfig` (diffusers made its mesh); `own_plan`: whether the
    model was split by its class's own `_cp_plan`."""
    return Ulysses(config._ulysses_mesh.get_group(), int(config._ulysses_local_rank), int(config.ulysses_degree),
                   own_plan, bool(getattr(config, "ulysses_anything", False)))


def enable(model: nn.Module, router, tile_order: Optional[bool]) -> None:
    """Tell `router` of the model's context parallelism where it is already on (sentence error where natsim cannot
    run under it), and wrap the model's `enable_parallelism` to do the same when it is switched on later."""
    config = context_parallel(getattr(model, "_parallel_config", None))
    if config is not None:
        reason = refusal(config, router, tile_order)
        if reason is not None:
            raise ValueError(f"natsim cannot run inside this model's context parallelism: {reason}")
        _serve(router, ulysses_of(config, getattr(type(model), "_cp_plan", None) is not None))
    if hasattr(type(model), "enable_parallelism"):
        model.enable_parallelism = functools.partial(_enable_parallelism, model, router, tile_order)


def disable(model: nn.Module) -> None:
    """Undo `enable`'s wrapper (the model keeps whatever parallelism it has)."""
    model.__dict__.pop("enable_parallelism", None)


def _enable_parallelism(model: nn.Module, router, tile_order: Optional[bool], *, config: Any,
                        cp_plan: Optional[dict] = None) -> None:
    """diffusers' `enable_parallelism`, refused before anything changes where natsim cannot run under `config`."""
    cp = context_parallel(config)
    if cp is not None:
        reason = refusal(cp, router, tile_order)
        if reason is not None:
            raise ValueError(f"natsim is applied to this model and cannot run inside this context parallelism: "
                             f"{reason} Call natsim.integrations.diffusers.remove(transformer) first to run the "
                             "model's own attention.")
    type(model).enable_parallelism(model, config=config, cp_plan=cp_plan)
    cp = context_parallel(model._parallel_config)
    if cp is not None:
        _serve(router, ulysses_of(cp, cp_plan is None and getattr(type(model), "_cp_plan", None) is not None))


@dataclass(frozen=True)
class Shares:
    """How the ranks' shares of one attention call's tokens sit in the sequence Ulysses gathers: `size` shares of
    `share` tokens, each `other` tokens outside the image (text) and `share - other` image tokens (video, then
    trailing reference tokens), the other tokens first where `text_first`. `to_sequence` puts them in the order
    one process has (all other tokens, then the image tokens, or the reverse), `to_shares` back."""

    size: int
    share: int
    other: int
    text_first: bool
    split: Optional[tuple[int, ...]] = None  # tokens per rank under ulysses_anything (image tokens only)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens each rank holds, in rank order."""
        return self.split or (self.share,) * self.size

    def _parts(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        shares = x.unflatten(dim, (self.size, self.share))
        image = self.share - self.other
        sizes = [self.other, image] if self.text_first else [image, self.other]
        first, second = shares.split(sizes, dim=dim + 1)
        return first.flatten(dim, dim + 1), second.flatten(dim, dim + 1)

    def to_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        if self.other == 0:
            return x
        return torch.cat(self._parts(x, dim), dim=dim)

    def to_shares(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        if self.other == 0:
            return x
        image = self.size * (self.share - self.other)
        sizes = [self.size * self.other, image] if self.text_first else [image, self.size * self.other]
        first, second = (part.unflatten(dim, (self.size, -1)) for part in x.split(sizes, dim=dim))
        return torch.cat([first, second], dim=dim + 1).flatten(dim, dim + 1)


def shares(router, ulysses: Ulysses, local_tokens: int) -> Optional[Shares]:
    """The shares of a call of `local_tokens` tokens per rank, or None where natsim does not serve it (fewer
    tokens than the layout: cross-attention, text-only attention)."""
    if router.layout is None:
        return None
    tokens = local_tokens * ulysses.size
    video = math.prod(router.layout)
    image = video + (router.trailing if router.text_first else 0)
    if ulysses.anything:
        return _anything_shares(router, ulysses, local_tokens, image)
    if tokens < video:
        return None
    if image % ulysses.size:
        raise ValueError(f"natsim's attention under context parallelism needs each of the {ulysses.size} ranks to hold "
                         f"the same share of the image tokens, but the layout {router.layout} holds {image} image "
                         "tokens: choose a latent size whose token count divides by ulysses_degree.")
    other = local_tokens - image // ulysses.size
    if other and not ulysses.own_plan:
        raise ValueError("natsim's joint attention under context parallelism puts the ranks' shares together as "
                         "diffusers' own context-parallel plans cut them (each rank: its part of the text, then of "
                         "the image); this model runs a cp_plan of its own, so natsim cannot know where its text "
                         "tokens lie. Use the class's own plan, or remove natsim.")
    return Shares(ulysses.size, local_tokens, other, router.text_first)


def _anything_shares(router, ulysses: Ulysses, local_tokens: int, image: int) -> Optional[Shares]:
    """The shares of a call under ulysses_anything, where diffusers cuts each sharded input with
    `torch.tensor_split` (the first ranks one token more): natsim serves self-attention over the image tokens,
    whose shares every rank knows from the layout. A joint sequence's text shares are known to no other rank, so
    every rank refuses it alike (diffusers shards the text only when it has a token for every rank)."""
    split = tuple(image // ulysses.size + (rank < image % ulysses.size) for rank in range(ulysses.size))
    mine = split[ulysses.rank]
    if local_tokens < mine:
        return None
    if local_tokens > mine:
        raise ValueError(f"natsim's joint attention (text tokens with the {image} image tokens in one sequence) "
                         "does not run under ulysses_anything, which shares the text unevenly in a way no rank "
                         "knows of the others: use ulysses_anything=False with a latent whose token counts divide "
                         "by ulysses_degree.")
    return Shares(ulysses.size, local_tokens, 0, router.text_first, split)


def attend(router, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
           scale: Optional[float]) -> Optional[torch.Tensor]:
    """`router`'s attention of this rank's `[B, S, heads, head_dim]` tokens under Ulysses (module docstring), or
    None where natsim does not serve the call (diffusers' own context-parallel attention then runs it)."""
    ulysses: Optional[Ulysses] = router.ulysses
    if ulysses is None:
        raise RuntimeError(
            "this model runs diffusers' context parallelism, which natsim was not told of (enable it with "
            "transformer.enable_parallelism(...) while natsim is applied, or apply natsim after it): natsim would "
            "attend over this rank's tokens alone."
        )
    if not router.serving or q.dim() != 4 or q.shape[1] != k.shape[1] or k.shape != v.shape:
        return None
    layout = shares(router, ulysses, q.shape[1])
    if layout is None:
        return None
    heads = q.shape[2]
    if heads % ulysses.size and not ulysses.anything:
        raise ValueError(f"Ulysses shards the {heads} heads over ulysses_degree={ulysses.size} ranks: heads must divide "
                         "by it (natsim's own attention would pad them, but diffusers' attention of the model's other "
                         "calls splits heads evenly under Ulysses; natsim.distributed.gna_attention takes any heads).")
    split = layout.tokens
    chunks = 1 if router.masked is not None else None  # a content-adaptive mask is one decision per call
    key_mask = _gathered_key_mask(key_mask, layout, ulysses)
    return ulysses_attention(router.sequence_attend, q, k, v, split, ulysses.rank, ulysses.group,
                             extras=() if key_mask is None else (key_mask,), scale=scale, chunks=chunks)


def _serve(router, ulysses: Ulysses) -> None:
    """Tell `router` of its Ulysses group, and register (once per router, before any trace) its attention on
    head-sharded whole sequences in the ranks' shares for natsim.distributed's pipeline: the shares into one
    process's order, the router, and back; each group of heads planned as the whole call is
    (`AutoPlan.planning_heads`)."""
    router.ulysses = ulysses
    if router.sequence_attend is not None:
        return

    def run(q, k, v, extras, scale, span):  # extras: the key mask of every key, where the call has one
        ulysses = router.ulysses
        if ulysses.anything:  # image tokens only, already in one process's order
            layout = Shares(ulysses.size, q.shape[1], 0, router.text_first)
        else:
            layout = shares(router, ulysses, q.shape[1] // ulysses.size)
        out = router.attend(*(layout.to_sequence(t) for t in (q, k, v)), extras[0] if extras else None, scale)
        if out is None:
            raise RuntimeError(f"natsim's router declined a call of {q.shape[1]} tokens it serves under context "
                               "parallelism.")
        return layout.to_shares(out)

    def planning(heads: int):
        return router.auto.planning_heads(heads) if router.auto is not None else contextlib.nullcontext()

    router.sequence_attend = register_attend(run, planning)


def _gathered_key_mask(mask: Optional[torch.Tensor], layout: Shares, ulysses: Ulysses) -> Optional[torch.Tensor]:
    """A key mask `[B or 1, 1, 1, S]` of this rank's keys -> the mask of every key, in the order one process has.
    A mask per (query, key) pair is refused: its rows would have to travel too."""
    if mask is None:
        return None
    if layout.split is not None:
        raise ValueError("natsim's attention under ulysses_anything takes no key mask: its ranks hold unequal "
                         "shares of the tokens, which the mask of every key would have to follow.")
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != layout.share:
        raise ValueError("natsim's attention under context parallelism takes a key mask of shape [batch, 1, 1, "
                         f"tokens] (this rank's {layout.share} keys), got attn_mask.shape={tuple(mask.shape)}.")
    from torch.distributed._functional_collectives import all_gather_tensor

    boolean = mask.dtype == torch.bool
    sent = mask.to(torch.uint8) if boolean else mask
    gathered = all_gather_tensor(sent.contiguous(), gather_dim=3, group=ulysses.group)
    gathered = gathered.bool() if boolean else gathered
    return layout.to_sequence(gathered, dim=3)
