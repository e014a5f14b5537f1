"""natsim's specs of diffusers 0.42's image transformers (models.py: the video ones): a 2-D layout, the latent's
height and width after patching, in row-major order; edits' reference images follow the image's tokens and are
attended like text (`Tokens.trailing`).
"""

from __future__ import annotations

import math

import torch

from .models import latent_layout, refuse
from .spec import Call, ModelSpec, Tokens


def _square_patch(call: Call) -> tuple[int, ...]:
    """SD3, PixArt, CogView4: a `[B, C, H, W]` latent in patch_size x patch_size patches."""
    patch = call.model.config.patch_size
    return latent_layout(call, (patch, patch))


def _pixart_layout(call: Call) -> tuple[int, ...]:
    refuse(call, "attention_mask", "a mask over the image tokens' self-attention")
    return _square_patch(call)


def _cogview4_layout(call: Call) -> tuple[int, ...]:
    refuse(call, "attention_mask", "a text mask its processor adds to the scores as 1 and 0, not as -inf")
    return _square_patch(call)


def ids_tokens(call: Call, columns: tuple[int, int]) -> Tokens:
    """FLUX and FLUX.2: the layout from `img_ids`, one row of position ids per image token, the image's rows
    first (`columns`: where row and column sit); the rows after them (reference images, another first id) are
    trailing tokens."""
    name = type(call.model).__name__
    if torch.compiler.is_compiling():
        raise ValueError(
            f"natsim reads {name}'s token layout from img_ids, which a compiled graph cannot read: pass "
            "layout=(height // 16, width // 16) to apply(), or compile the blocks "
            "(transformer.compile_repeated_blocks(fullgraph=True)) so that the layout is read before them."
        )
    ids = call.required("img_ids")
    ids = (ids[0] if ids.dim() == 3 else ids).detach().cpu()
    image = int((ids[:, 0] == ids[0, 0]).sum())
    rows, cols = (int(ids[:image, column].max()) + 1 for column in columns)
    tokens = call.required("hidden_states").shape[1]
    if rows * cols != image or ids.shape[0] != tokens:
        raise ValueError(f"natsim reads {name}'s token layout from img_ids, whose first {image} rows (the image's) "
                         f"must cover a {rows} x {cols} grid and whose {ids.shape[0]} rows must number the "
                         f"{tokens} tokens of hidden_states.")
    return Tokens((rows, cols), tokens - image)


def _flux_layout(call: Call) -> Tokens:
    return ids_tokens(call, (1, 2))  # (index, row, column)


def _flux2_layout(call: Call) -> Tokens:
    refuse(call, "kv_cache_mode", "reference images' keys and values cached and attended apart")
    return ids_tokens(call, (1, 2))  # (time, row, column, layer)


def _qwenimage_layout(call: Call) -> Tokens:
    """QwenImage: `img_shapes` lists each sample's images as (frames, height, width) after patching, the
    generated image first and an edit's reference images after it."""
    shapes = call.required("img_shapes")[0]
    shapes = [shapes] if isinstance(shapes[0], int) else list(shapes)
    frames, height, width = shapes[0]
    layout = (height, width) if frames == 1 else (frames, height, width)
    trailing = sum(math.prod(shape) for shape in shapes[1:])
    tokens = call.required("hidden_states").shape[1]
    if math.prod(layout) + trailing != tokens:
        raise ValueError(f"natsim reads QwenImageTransformer2DModel's token layout from img_shapes {shapes}, which "
                         f"must number the {tokens} tokens of hidden_states.")
    return Tokens(layout, trailing)


DOUBLE_AND_SINGLE = ("transformer_blocks.attn", "single_transformer_blocks.attn")

TEXT = ("encoder_hidden_states",)  # the text a joint attention's image tokens are joined with

IMAGE_SPECS: dict[str, ModelSpec] = {
    "FluxTransformer2DModel": ModelSpec(DOUBLE_AND_SINGLE, _flux_layout, "before", joint=TEXT),
    "Flux2Transformer2DModel": ModelSpec(DOUBLE_AND_SINGLE, _flux2_layout, "before", joint=TEXT),
    "QwenImageTransformer2DModel": ModelSpec("transformer_blocks.attn", _qwenimage_layout, "before", joint=TEXT),
    # SD3.5's dual layers (attn2) attend the image alone; the verdict prices its layouts by the joint calls
    "SD3Transformer2DModel": ModelSpec(("transformer_blocks.attn", "transformer_blocks.attn2"), _square_patch,
                                       "after", joint=TEXT),
    "PixArtTransformer2DModel": ModelSpec("transformer_blocks.attn1", _pixart_layout),
    "CogView4Transformer2DModel": ModelSpec("transformer_blocks.attn1", _cogview4_layout, "before", joint=TEXT),
}
