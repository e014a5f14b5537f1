"""The attention natsim computes inside a diffusers transformer, per call of a routed attention module.

`Router.attend` takes what the model's processor hands to its attention function, `[B, N, heads, head_dim]`
query, key and value, and decides by their lengths, against the token layout of the current forward call
(`Router.layout`, `prod(layout) = N_video` tokens):

- N == N_video (self-attention over the video tokens): GNA with the plan for the layout (`AutoPlan`), or a
  content-adaptive mask (masks.py).
- N > N_video (joint attention): the tokens outside the layout (text; reference images or keyframe tokens) sit
  before the video tokens (`text_first`; `trailing` of them after it, told per forward call) or after them:
  - a video query attends the keys in its GNA window (or its content-adaptive mask) and every (unmasked) other
    key: the sparse output and the dense attention over the other keys are merged through their log-sum-exps,
    which is exact softmax attention over the union of the two key sets;
  - any other query attends every key, video and other (unmasked), densely, as in the model.
  A key mask (`[B or 1, 1, 1, N]`, boolean or additive, as HunyuanVideo passes for text padding) masks keys
  outside the layout. An additive mask masks a key with -inf or any value at or below `MASKED_AT_OR_BELOW`
  (diffusers' models write -10000 or the dtype's lowest value) and keeps it with 0; other values, a bias the
  kernels cannot add, and a mask over video keys, which GNA does not take, fail an assertion on the device (no
  host sync: on a GPU a device-side assert). A `[B or 1, 1, N, N]` mask (HunyuanVideo 1.5's
  `keep[query] & keep[key]`) masks the other queries' rows as given, and the video queries' keys as its first
  video query's row does: it must mask keys alike for every video query.
- N < N_video, or N beyond N_video and the call's other tokens (`outside`: the spec's joint arguments and the
  layout's trailing tokens; checked in eager calls, where it needs no guard): refused with a sentence, the layout
  is not this call's latent.
- anything else (cross-attention to text, a call outside a forward, a layout the model keeps): the model's own
  attention, untouched.

A layout on which natsim's call is predicted slower than the model's own (`AutoPlan.verdict`: an image model's few
thousand tokens, where the host's time to issue each call decides) keeps the model's own attention for every
call, with a warning saying so once per layout, unless `keep_own` is False. The verdict is made by the forward
pre-hook (`decide`) outside a compiled graph: a compiled block reads it as a constant. A whole-model
`torch.compile` traces the hook, so a layout whose first call is compiled is served by natsim until an eager call
of that layout decides it.

Models that split their attention over the latent (Latte: over (H, W) per frame, then over (F,) per position)
route each split through a `RouterView` over some dims of the layout (the others fold into the batch), with
GNA planned for those dims.

q, k and v go to the kernel in `dtype` (the model's when it is float16 or bfloat16; bfloat16 for a float32
model unless told otherwise) and the output comes back in the model's dtype.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true
import torch.nn.functional as F

from natsim.kernels import TileOrder, resolved_attention
from natsim.kernels.backends.triton import tile_pairs
from natsim.planner import AutoPlan, Verdict

from .dense import attention_with_lse
from .masks import MaskedAttention

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# An additive mask's value at or below this masks its key (exp of it is 0 beside any score a model makes);
# diffusers' models write -10000, the dtype's lowest value or -inf.
MASKED_AT_OR_BELOW = -1e3
ADDITIVE_REFUSAL = ("natsim's joint attention takes a key mask that keeps or drops keys: boolean, or additive with 0 "
                    f"at kept keys and -inf (or a value at or below {MASKED_AT_OR_BELOW:g}) at masked ones; this "
                    "mask holds other values, a bias natsim's kernels cannot add")
VIDEO_KEYS_REFUSAL = ("natsim's joint attention masks only the keys outside the token layout (text padding); this "
                      "mask masks video keys, which the GNA kernels attend by their window: keep such calls the "
                      "model's own (do not route the attention)")


class Router:
    """One model's attention routing; `layout` is set by the model's forward pre-hook on every call. The video
    tokens' own attention is GNA with `auto`'s plan for the layout, or, with `masked`, a content-adaptive mask
    (natsim.integrations.diffusers.masks) through the operator `natsim::attention_resolved` (its twin without
    autograd where no gradient is needed: `natsim.kernels.resolved_attention`)."""

    def __init__(self, auto: Optional[AutoPlan], text_first: bool, dtype: Optional[torch.dtype] = None,
                 masked: Optional[MaskedAttention] = None, keep_own: bool = True):
        if dtype is not None and dtype not in KERNEL_DTYPES:
            raise ValueError(f"dtype must be None, torch.float16 or torch.bfloat16, got dtype={dtype!r}.")
        self.auto = auto
        self.text_first = text_first
        self.dtype = dtype
        self.masked = masked
        self.keep_own = keep_own
        self.verdicts: dict[tuple, Verdict] = {}  # per (layout, joint tokens, heads, head_dim, dtype, device)
        self.tileless: dict[tuple, bool] = {}  # per (layout, head_dim): shorter than any tile (left to the model)
        self.serving = True  # whether natsim serves the current forward call's layout (decide)
        self.whole = True  # whether modules attend over the whole layout through this router (not only its views)
        self.layout: Optional[tuple[int, ...]] = None
        self.trailing = 0  # text-first joint attention: tokens after the video tokens (reference images)
        self.outside = 0  # the most tokens a routed call may hold beside the layout's (joint arguments, trailing)
        self.order: Optional[TileOrder] = None  # the video tokens' order when the model keeps a tile order
        self.views: list[RouterView] = []
        self.folded = 1  # layouts one call attends at once (a view's: the dims it folds into the batch)
        self.ulysses = None  # diffusers' context parallelism where it is on (parallel.py: Ulysses)
        self.sequence_attend: Optional[int] = None  # its attention under Ulysses, registered by parallel.py

    def set_layout(self, layout: tuple[int, ...], trailing: int = 0, joint: int = 0) -> None:
        """The token layout of the forward call beginning, the tokens outside it that follow the video tokens in
        text-first joint attention (reference images), and the tokens of the call's joint arguments (the spec's
        `joint`: text): a routed self-attention call holds the layout's tokens and at most these beside them
        (`attend` refuses any other count); the views follow."""
        self.layout = tuple(layout)
        self.trailing = trailing
        self.outside = joint + trailing
        for view in self.views:
            view.set_layout(view.select(self.layout), trailing)

    def decide(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, text: int = 0) -> None:
        """Whether natsim serves the forward call beginning (`serving`), for attention of `heads` heads of
        `head_dim` in `dtype` on `device`, with `text` tokens beside the layout in its joint attention (the
        spec's `joint` arguments and the trailing tokens): the verdict for the layout and that many tokens, made on
        its first call outside a compiled graph and kept (module docstring); the views, which hold the latent
        alone, decide for their own layouts."""
        verdict = None
        if self.keep_own and self.whole and self.layout is not None and self._too_small(head_dim):
            verdict = Verdict(self.layout, False)
        elif self.keep_own and self.whole and self.auto is not None and self.masked is None:
            key = (self.layout, text, heads, head_dim, dtype, device)
            if key not in self.verdicts and not torch.compiler.is_compiling():
                self.verdicts[key] = self.auto.verdict(self.layout, heads=heads, head_dim=head_dim, dtype=dtype,
                                                       device=device, batch=self.folded, text=text)
                if not self.verdicts[key].serves:
                    warnings.warn(self.verdicts[key].explain(), stacklevel=2)
            verdict = self.verdicts.get(key)
        self.serving = verdict is None or verdict.serves
        for view in self.views:
            view.decide(heads, head_dim, dtype, device)

    def _too_small(self, head_dim: int) -> bool:
        """Whether the layout is shorter than every tile natsim plans for `head_dim` (one tile would be the whole
        sequence: nothing to skip), found once per layout and then warned of: the model's own attention runs it."""
        key = (self.layout, head_dim)
        if key not in self.tileless:
            self.tileless[key] = not tile_pairs(self.layout, head_dim)
            if self.tileless[key] and not torch.compiler.is_compiling():
                warnings.warn(f"natsim keeps the model's own attention on layout {self.layout} "
                              f"({math.prod(self.layout)} tokens): it is shorter than every tile natsim plans for "
                              f"head_dim {head_dim}, so one tile would be the whole sequence and nothing could be "
                              "skipped (apply(..., keep_own=False) refuses such a layout instead).", stacklevel=3)
        return self.tileless[key]

    # -- attention over part of the layout --------------------------------------------------------------------

    def view(self, axes: tuple[int, ...]) -> RouterView:
        """A router for attention modules that attend over the dims `axes` of every forward call's layout, the
        other dims folded into their batch (Latte's spatial and temporal attention)."""
        if self.masked is not None:
            raise ValueError(
                "content-adaptive masks need every routed attention to attend over the whole token layout, but this "
                f"model splits its attention over the latent (dims {axes} in some of its blocks): use GNA "
                "(apply(transformer, sparsity=...)) instead."
            )
        view = RouterView(self, axes)
        self.views.append(view)
        return view

    @property
    def plans(self) -> dict:
        """The GNA plans made so far, this router's and its views': per (layout, heads, head_dim, dtype, device)."""
        plans = dict(self.auto.plans) if self.auto is not None else {}
        for view in self.views:
            plans.update(view.auto.plans)
        return plans

    # -- routing --------------------------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
               scale: Optional[float]) -> Optional[torch.Tensor]:
        """`[B, N, heads, head_dim]` attention through natsim, or None when the call is not one natsim serves."""
        if not self.serving or self.layout is None or q.dim() != 4 or q.shape[1] != k.shape[1] or k.shape != v.shape:
            return None
        video = math.prod(self.layout)
        # A class that drops a sample's padding text tokens (Mochi) gives a token count that is data-dependent
        # under torch.compile: undecidable comparisons take the joint route, which serves any count past video.
        # The bound above reads the call's text count, which a compiled block would guard on (a graph per prompt
        # length): eager calls check it, compiled ones the layout's own count, a constant of their graph already.
        if guard_or_false(q.shape[1] < video) or (not torch.compiler.is_compiling()
                                                   and guard_or_false(q.shape[1] > video + self.outside)):
            raise ValueError(self._miscounted(q.shape[1]))
        if guard_or_false(q.shape[1] == video) and key_mask is None:
            return self._video(q, k, v, scale)
        if guard_or_true(q.shape[1] > video):
            return self._joint(q, k, v, video, key_mask, scale)
        return None

    def _miscounted(self, tokens: int) -> str:
        """The refusal of a routed self-attention call whose token count the layout does not explain."""
        video = math.prod(self.layout)
        return (f"a routed attention call holds {tokens} tokens, but the token layout {self.layout} holds {video} and "
                f"the call's other tokens number at most {self.outside} (the spec's joint arguments and the layout's "
                "trailing tokens): the layout is not this call's latent. Check apply(..., layout=...) or the spec's "
                "layout function (the latent's sizes divided by the patch sizes), and name the arguments whose tokens "
                "join the latent's in ModelSpec(joint=...) or return nd.Tokens(layout, trailing).")

    def kernel_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype natsim's kernels take `x`'s values in (module docstring)."""
        if self.dtype is not None:
            return self.dtype
        return x.dtype if x.dtype in KERNEL_DTYPES else torch.bfloat16

    def _gna(self, q, k, v, scale, return_lse: bool):
        """The video tokens' own attention of `[B, N_video, heads, head_dim]` tokens: GNA over the layout (or the
        content-adaptive mask): the output (and LSE) per token."""
        if self.masked is not None:
            out, lse = resolved_attention(q, k, v, self.masked.id, scale, return_lse)
            return (out, lse) if return_lse else out
        batch, tokens, heads, head_dim = q.shape
        dtype = self.kernel_dtype(q)
        if self.order is not None:  # the model keeps its video tokens in the plan's tile order (order.py)
            return self.auto(*(t.to(dtype) for t in (q, k, v)), scale=scale, return_lse=return_lse, order=self.order)
        q, k, v = (t.reshape(batch, *self.layout, heads, head_dim).to(dtype) for t in (q, k, v))
        result = self.auto(q, k, v, scale=scale, return_lse=return_lse)
        if not return_lse:
            return result.reshape(batch, tokens, heads, head_dim)
        out, lse = result
        return out.reshape(batch, tokens, heads, head_dim), lse.reshape(batch, tokens, heads)

    def _video(self, q, k, v, scale):
        return self._gna(q, k, v, scale, return_lse=False).to(q.dtype)

    def _joint(self, q, k, v, video: int, key_mask, scale):
        batch, tokens, heads, head_dim = q.shape
        after = self.trailing if self.text_first else tokens - video
        before = tokens - video - after
        if before < 0:
            raise ValueError(f"natsim's joint attention got {tokens} tokens, fewer than the {video} video tokens of "
                             f"layout={self.layout} and the {after} tokens told to follow them.")
        sizes = [before, video, after]
        (qb, qv, qa), (kb, kv, ka), (vb, vv, va) = (t.split(sizes, dim=1) for t in (q, k, v))
        qo, ko, vo = (_other(x, y) for x, y in ((qb, qa), (kb, ka), (vb, va)))  # the tokens outside the layout
        keep, other_rows = _masks(key_mask, batch, tokens, before, video)
        other_keep = None if keep is None else _other(keep[:, :before], keep[:, before + video:])
        scale = head_dim**-0.5 if scale is None else scale

        # Video queries: their GNA window over the video keys, merged with every other key.
        out_window, lse_window = self._gna(qv, kv, vv, scale, return_lse=True)
        out_other, lse_other = attention_with_lse(qv, ko, vo, other_keep, scale)
        lse = torch.logaddexp(lse_window, lse_other)
        video_out = (out_window.float() * torch.exp(lse_window - lse)[..., None]
                     + out_other * torch.exp(lse_other - lse)[..., None]).to(q.dtype)

        # Other queries: every key, as the model attends them.
        if other_rows is not None:
            mask = _other(other_rows[:, :, :before], other_rows[:, :, before + video:], dim=2)
        else:
            mask = None if keep is None else keep[:, None, None, :]
        other_out = _every_key(qo, k, v, mask, scale)
        return torch.cat([other_out[:, :before], video_out, other_out[:, before:]], dim=1)


def _every_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               scale: float) -> torch.Tensor:
    """`[B, Nq, heads, D]` queries attending every key as the model does (SDPA). A query count that is
    data-dependent under torch.compile (padding text dropped, Mochi) may be 0, which SDPA cannot take: one
    query row more (and its mask row, masked) is attended and dropped; and since SDPA's choice of kernel for
    CUDA tensors guards on the query count, such queries under a key mask (or none) go to the memory-efficient
    kernel directly (dense.py), which takes any count."""
    rows = q.shape[1]
    if not guard_or_false(rows > 0):
        q = F.pad(q, (0, 0, 0, 0, 0, 1))
        if mask is not None and mask.shape[2] != 1:
            mask = F.pad(mask, (0, 0, 0, 1), value=False if mask.dtype == torch.bool else float("-inf"))
        if mask is None or mask.shape[2] == 1:
            keep = None if mask is None else _key_mask(mask)
            return attention_with_lse(q, k, v, keep, scale, known_queries=False)[0][:, :rows].to(q.dtype)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale).transpose(1, 2)
    return out[:, :rows]


def _kept(values: torch.Tensor) -> torch.Tensor:
    """Which keys a boolean or additive mask's `values` keep (additive: 0 kept, at or below `MASKED_AT_OR_BELOW`
    masked, anything else asserted against on the device)."""
    if values.dtype == torch.bool:
        return values
    torch._assert_async(((values == 0) | (values <= MASKED_AT_OR_BELOW)).all(), ADDITIVE_REFUSAL)
    return values > MASKED_AT_OR_BELOW


def _key_mask(mask: torch.Tensor) -> torch.Tensor:
    """A `[B, 1, 1, N]` key mask (boolean, or additive: `_kept`) as the `[B, N]` boolean one."""
    return _kept(mask[:, 0, 0, :])


def _other(before: torch.Tensor, after: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The tokens outside the layout, those before the video tokens then those after them."""
    if guard_or_false(after.shape[dim] == 0):
        return before
    return after if guard_or_false(before.shape[dim] == 0) else torch.cat([before, after], dim=dim)


def _masks(mask: Optional[torch.Tensor], batch: int, tokens: int, first_video: int, video: int):
    """From the model's mask: the `[B, N]` boolean key mask of the video queries (which must keep the `video`
    keys from `first_video` on), and, for a pairwise `[B or 1, 1, N, N]` mask, its rows `[B or 1, 1, N, N]` for
    the other queries (None, None without a mask)."""
    if mask is None:
        return None, None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] not in (1, tokens) or mask.shape[3] != tokens:
        raise ValueError(
            "natsim's joint attention takes a key mask of shape [batch, 1, 1, tokens] or a mask of shape [batch, 1, "
            "tokens, tokens] (boolean, or additive with 0 at kept keys and -inf at masked ones), got "
            f"attn_mask.shape={tuple(mask.shape)}."
        )
    keep = _kept(mask[:, 0, first_video if mask.shape[2] == tokens else 0, :])
    torch._assert_async(keep[:, first_video:first_video + video].all(), VIDEO_KEYS_REFUSAL)
    return keep.expand(batch, tokens), (mask if mask.shape[2] == tokens else None)


class RouterView(Router):
    """A router for attention modules that attend over the dims `axes` of the forward call's layout, the other
    dims folded into the batch: GNA planned for those dims (the window, stride and causal options of `axes`),
    sharing its parent's dtype. A view over fewer tokens than the smallest tile the planner has for the head
    dim (Latte's temporal attention over 16 frames: one tile holds the whole sequence, nothing to skip) is left
    to the model."""

    def __init__(self, parent: Router, axes: tuple[int, ...]):
        if not axes or len(set(axes)) != len(axes) or min(axes) < 0:
            raise ValueError(f"axes must name distinct dims of the token layout, got axes={axes!r}.")
        super().__init__(_narrowed(parent.auto, axes), parent.text_first, parent.dtype, keep_own=parent.keep_own)
        self.axes = tuple(axes)

    def select(self, layout: tuple[int, ...]) -> tuple[int, ...]:
        """This view's layout: the dims `axes` of the forward call's `layout` (the others' product is `folded`)."""
        if max(self.axes) >= len(layout):
            raise ValueError(f"a split attention over dims {self.axes} needs a token layout of more than "
                             f"{max(self.axes)} dims, got layout={layout}.")
        folded = 1
        for axis, n in enumerate(layout):
            if axis not in self.axes:
                folded *= n
        self.folded = folded
        return tuple(layout[axis] for axis in self.axes)

    def decide(self, heads, head_dim, dtype, device, text: int = 0) -> None:
        """As Router.decide (a view's attention holds the latent alone); a layout too short for any tile is left to
        the model, with no verdict."""
        if self.layout is not None and not tile_pairs(self.layout, head_dim):
            self.serving = False
            return
        super().decide(heads, head_dim, dtype, device)



def _narrowed(auto: AutoPlan, axes: tuple[int, ...]) -> AutoPlan:
    """An AutoPlan with `auto`'s options, its per-dim ones (window, stride, causal) kept for the dims `axes`."""
    options = dict(auto.options)
    for name in ("window", "max_stride", "causal"):
        value = options[name]
        if isinstance(value, (tuple, list)):
            if max(axes) >= len(value):
                raise ValueError(f"{name}={tuple(value)} names {len(value)} dims, but a split attention of this model "
                                 f"attends over dims {axes} of its layout: give one value per layout dim.")
            options[name] = tuple(value[axis] for axis in axes)
    return AutoPlan(auto.target_sparsity, **options)
