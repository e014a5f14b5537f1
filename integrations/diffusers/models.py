"""What natsim needs to know of each supported diffusers transformer: which attention modules carry the
video (or image) tokens, whether text tokens come before them in joint attention, and the token layout of a
forward call (the latent's frames, height and width after patching).

Tokens are the patches of the latent in row-major (frames, height, width) order in every supported model,
which is natsim's token layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

LayoutOf = Callable[[nn.Module, tuple, dict], tuple[int, ...]]


@dataclass(frozen=True)
class ModelSpec:
    """One supported transformer class: `attentions(model)` lists the attention modules natsim routes
    (self-attention over the video tokens, or joint attention over video and text tokens), `text_first`
    says where text tokens sit in joint attention, `layout(model, args, kwargs)` gives the token layout of a
    forward call from its arguments and the model's patch sizes, `timestep(args, kwargs)` its timestep."""

    attentions: Callable[[nn.Module], list[nn.Module]]
    text_first: bool
    layout: LayoutOf
    timestep_index: int  # the forward's timestep argument: its position (it is also accepted by name)

    def timestep(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return _argument(args, kwargs, self.timestep_index, "timestep")


def _argument(args: tuple, kwargs: dict, index: int, name: str):
    """A forward argument given by position or by name (None when absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _patched(sizes: tuple, patches: tuple) -> tuple[int, ...]:
    return tuple(size // patch for size, patch in zip(sizes, patches))


def _wan_layout(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...]:
    latent = _argument(args, kwargs, 0, "hidden_states")  # [B, C, F, H, W]
    return _patched(tuple(latent.shape[2:]), tuple(model.config.patch_size))


def _hunyuan_layout(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...]:
    latent = _argument(args, kwargs, 0, "hidden_states")  # [B, C, F, H, W]
    p, pt = model.config.patch_size, model.config.patch_size_t
    return _patched(tuple(latent.shape[2:]), (pt, p, p))


def _cogvideox_layout(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...]:
    latent = _argument(args, kwargs, 0, "hidden_states")  # [B, F, C, H, W]
    p, pt = model.config.patch_size, model.config.patch_size_t or 1
    return _patched((latent.shape[1], latent.shape[3], latent.shape[4]), (pt, p, p))


def _ltx_layout(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...]:
    sizes = tuple(_argument(args, kwargs, index, name) for index, name in ((4, "num_frames"), (5, "height"),
                                                                          (6, "width")))
    if any(size is None for size in sizes):
        raise ValueError("LTXVideoTransformer3DModel must be called with num_frames, height and width (the latent's "
                         "sizes) for natsim to know its token layout, as its pipeline does.")
    p, pt = model.config.patch_size, model.config.patch_size_t
    return _patched(sizes, (pt, p, p))


def _flux_layout(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...]:
    ids = _argument(args, kwargs, 4, "img_ids")  # [N, 3]: (0, row, column) of each packed latent patch
    if ids is None:
        raise ValueError("FluxTransformer2DModel must be called with img_ids for natsim to know its token layout.")
    if torch.compiler.is_compiling():
        raise ValueError(
            "natsim reads FluxTransformer2DModel's token layout from img_ids, which a compiled graph cannot read: "
            "pass layout=(height // 16, width // 16) to apply(), or compile the blocks "
            "(transformer.compile_repeated_blocks(fullgraph=True)) so that the layout is read before them."
        )
    ids = ids[0] if ids.dim() == 3 else ids
    return int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1


def _blocks(*names: str) -> Callable[[nn.Module], list[nn.Module]]:
    """The attention modules named `block_list.attention` (e.g. "blocks.attn1") of every block."""
    def attentions(model: nn.Module) -> list[nn.Module]:
        found = []
        for name in names:
            blocks, attention = name.split(".")
            found += [getattr(block, attention) for block in getattr(model, blocks)]
        return found
    return attentions


SPECS: dict[str, ModelSpec] = {
    "WanTransformer3DModel": ModelSpec(_blocks("blocks.attn1"), False, _wan_layout, 1),
    "HunyuanVideoTransformer3DModel": ModelSpec(
        _blocks("transformer_blocks.attn", "single_transformer_blocks.attn"), False, _hunyuan_layout, 1),
    "CogVideoXTransformer3DModel": ModelSpec(_blocks("transformer_blocks.attn1"), True, _cogvideox_layout, 2),
    "LTXVideoTransformer3DModel": ModelSpec(_blocks("transformer_blocks.attn1"), False, _ltx_layout, 2),
    "FluxTransformer2DModel": ModelSpec(
        _blocks("transformer_blocks.attn", "single_transformer_blocks.attn"), True, _flux_layout, 3),
}


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec of `model`'s class, or a sentence naming the supported ones."""
    spec: Optional[ModelSpec] = SPECS.get(type(model).__name__)
    if spec is None:
        raise TypeError(f"natsim supports the diffusers transformers {', '.join(SPECS)}, got "
                        f"{type(model).__name__}.")
    return spec
