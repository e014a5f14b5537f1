"""The attention natsim computes inside a diffusers transformer, per call of a routed attention module.

`Router.attend` takes what the model's processor hands to its attention function, `[B, N, heads, head_dim]`
query, key and value, and decides by their lengths, against the token layout of the current forward call
(`Router.layout`, `prod(layout) = N_video` tokens):

- N == N_video (self-attention over the video tokens): GNA with the plan for the layout (`AutoPlan`), or a
  content-adaptive mask (masks.py).
- N == N_video + N_text (joint attention, text tokens before or after the video tokens):
  - a video query attends the keys in its GNA window (or its content-adaptive mask) and every (unmasked) text
    key: the sparse output and the dense attention over the text keys are merged through their log-sum-exps,
    which is exact softmax attention over the union of the two key sets;
  - a text query attends every key, video and text (unmasked), densely, as in the model.
  A key mask (`[B or 1, 1, 1, N]`, boolean or additive, as HunyuanVideo passes for text padding) masks text
  keys; video keys are never masked.
- anything else (cross-attention to text, a text-only refiner, a call outside a forward): the model's own
  attention, untouched.

q, k and v go to the kernel in `dtype` (the model's when it is float16 or bfloat16; bfloat16 for a float32
model unless told otherwise) and the output comes back in the model's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from natsim.kernels import attention_resolved
from natsim.planner import AutoPlan

from .dense import attention_with_lse
from .masks import MaskedAttention

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class Router:
    """One model's attention routing; `layout` is set by the model's forward pre-hook on every call. The video
    tokens' own attention is GNA with `auto`'s plan for the layout, or, with `masked`, a content-adaptive mask
    (natsim.integrations.diffusers.masks) through the operator `natsim::attention_resolved`."""

    def __init__(self, auto: Optional[AutoPlan], text_first: bool, dtype: Optional[torch.dtype] = None,
                 masked: Optional[MaskedAttention] = None):
        if dtype is not None and dtype not in KERNEL_DTYPES:
            raise ValueError(f"dtype must be None, torch.float16 or torch.bfloat16, got dtype={dtype!r}.")
        self.auto = auto
        self.text_first = text_first
        self.dtype = dtype
        self.masked = masked
        self.layout: Optional[tuple[int, ...]] = None

    def set_layout(self, layout: tuple[int, ...]) -> None:
        self.layout = tuple(layout)

    # -- routing --------------------------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
               scale: Optional[float]) -> Optional[torch.Tensor]:
        """`[B, N, heads, head_dim]` attention through natsim, or None when the call is not one natsim serves."""
        if self.layout is None or q.dim() != 4 or q.shape[1] != k.shape[1] or k.shape != v.shape:
            return None
        video = math.prod(self.layout)
        if q.shape[1] == video and key_mask is None:
            return self._video(q, k, v, scale)
        if q.shape[1] > video:
            return self._joint(q, k, v, video, key_mask, scale)
        return None

    def _kernel_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        return x.dtype if x.dtype in KERNEL_DTYPES else torch.bfloat16

    def _gna(self, q, k, v, scale, return_lse: bool):
        """The video tokens' own attention of `[B, N_video, heads, head_dim]` tokens: GNA over the layout (or the
        content-adaptive mask): the output (and LSE) per token."""
        if self.masked is not None:
            out, lse = attention_resolved(q, k, v, self.masked.id, scale, return_lse)
            return (out, lse) if return_lse else out
        batch, tokens, heads, head_dim = q.shape
        dtype = self._kernel_dtype(q)
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
        text = tokens - video
        first, rest = (text, video) if self.text_first else (video, text)
        qa, qb = q.split([first, rest], dim=1)
        ka, kb = k.split([first, rest], dim=1)
        va, vb = v.split([first, rest], dim=1)
        (qv, kv, vv), (qt, kt, vt) = ((qb, kb, vb), (qa, ka, va)) if self.text_first else ((qa, ka, va), (qb, kb, vb))
        keep = _key_mask(key_mask, batch, tokens, q.device)
        text_keep = None if keep is None else (keep[:, :text] if self.text_first else keep[:, video:])
        scale = head_dim**-0.5 if scale is None else scale

        # Video queries: their GNA window over the video keys, merged with every text key.
        out_window, lse_window = self._gna(qv, kv, vv, scale, return_lse=True)
        out_text, lse_text = attention_with_lse(qv, kt, vt, text_keep, scale)
        lse = torch.logaddexp(lse_window, lse_text)
        video_out = (out_window.float() * torch.exp(lse_window - lse)[..., None]
                     + out_text * torch.exp(lse_text - lse)[..., None]).to(q.dtype)

        # Text queries: every key, as the model attends them.
        mask = None if keep is None else keep[:, None, None, :]
        text_out = F.scaled_dot_product_attention(qt.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=mask, scale=scale).transpose(1, 2)
        parts = (text_out, video_out) if self.text_first else (video_out, text_out)
        return torch.cat(parts, dim=1)


def _key_mask(mask: Optional[torch.Tensor], batch: int, tokens: int, device) -> Optional[torch.Tensor]:
    """A `[B, N]` boolean key mask from a boolean or additive `[B or 1, 1, 1, N]` mask (None without one)."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != tokens:
        raise ValueError(
            "natsim's joint attention takes a key mask of shape [batch, 1, 1, tokens] (boolean, or additive with "
            f"-inf at masked keys), got attn_mask.shape={tuple(mask.shape)}."
        )
    keep = mask[:, 0, 0, :] if mask.dtype == torch.bool else mask[:, 0, 0, :] > float("-inf")
    return keep.to(device).expand(batch, tokens)
