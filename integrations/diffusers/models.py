"""natsim's specs of diffusers 0.42's video transformers: which attention modules carry the latent's tokens, where
text sits in their joint attention, and the token layout of a forward call (images.py: the image
transformers). docs/diffusers.md tables what each one routes.

Every class here patches its latent into tokens in row-major (frames, height, width) order, which is natsim's
token layout; the layout is the latent's sizes divided by the patch sizes of the model's config.
"""

from __future__ import annotations

import math

from torch import nn

from .spec import Call, ModelSpec, Tokens, patched

WAN_ATTENTIONS = ("WanAttention", "SkyReelsV2Attention")  # diffusers' Wan attention and its copies
TEXT = ("encoder_hidden_states",)  # the text a joint attention's latent tokens are joined with


def latent_layout(call: Call, patch: tuple[int, ...]) -> tuple[int, ...]:
    """The layout of a `[B, C, F, H, W]` (or `[B, C, H, W]`) `hidden_states` cut into patches of `patch`."""
    return patched(tuple(call.required("hidden_states").shape[2:]), patch)


def refuse(call: Call, name: str, what: str) -> None:
    """Refuse a forward call that gives the argument `name` (`what` it does, which natsim does not run)."""
    if call.argument(name) is not None:
        raise ValueError(f"natsim does not run {type(call.model).__name__} called with {name} ({what}): call it "
                         "without, as its pipeline does, or remove natsim (remove(transformer)).")


def _temporal_spatial(call: Call) -> tuple[int, ...]:
    """HunyuanVideo, HunyuanVideo 1.5, Motif-Video, Allegro: patch_size_t x patch_size x patch_size."""
    config = call.model.config
    return latent_layout(call, (config.patch_size_t, config.patch_size, config.patch_size))


def _per_frame(call: Call) -> tuple[int, ...]:
    """Mochi, Latte: each frame patched alone, patch_size x patch_size."""
    patch = call.model.config.patch_size
    return latent_layout(call, (1, patch, patch))


def _config_patch(call: Call) -> tuple[int, ...]:
    """Cosmos: its config's (t, h, w) patch_size."""
    return latent_layout(call, tuple(call.model.config.patch_size))


def _wan_layout(call: Call) -> tuple[int, ...]:
    """Every Wan-derived class; SkyReels-V2's diffusion forcing (a block-causal mask over frames) refused."""
    frames_per_block = getattr(call.model.config, "num_frame_per_block", 1)
    if frames_per_block > 1:
        raise ValueError(
            f"natsim does not run {type(call.model).__name__} with num_frame_per_block={frames_per_block} (diffusion "
            "forcing: a block-causal mask over frames, which GNA's causal window does not reproduce): use "
            "causal_block_size=1, or remove natsim (remove(transformer))."
        )
    return latent_layout(call, tuple(call.model.config.patch_size))


def _allegro_layout(call: Call) -> tuple[int, ...]:
    refuse(call, "attention_mask", "a mask over the video tokens' self-attention")
    return _temporal_spatial(call)


def _cogvideox_layout(call: Call) -> tuple[int, ...]:
    latent = call.required("hidden_states")  # [B, F, C, H, W]
    config = call.model.config
    return patched((latent.shape[1], latent.shape[3], latent.shape[4]),
                   (config.patch_size_t or 1, config.patch_size, config.patch_size))


def _ltx_layout(call: Call) -> tuple[int, ...]:
    """LTX-Video and LTX-2: the latent's sizes are arguments (its tokens come patched)."""
    config = call.model.config
    sizes = tuple(call.required(name) for name in ("num_frames", "height", "width"))
    return patched(sizes, (config.patch_size_t, config.patch_size, config.patch_size))


def _ltx2_layout(call: Call) -> Tokens:
    """LTX-2's latent layout, and the keyframe tokens its condition pipeline appends after the video's (placed by
    `video_coords`), which its self-attention attends like text: trailing tokens, priced by the verdict."""
    refuse(call, "video_self_attention_mask", "a mask over the video tokens' self-attention")
    layout = _ltx_layout(call)
    tokens, video = call.required("hidden_states").shape[1], math.prod(layout)
    if tokens < video:
        raise ValueError(f"LTX2VideoTransformer3DModel's hidden_states hold {tokens} tokens, fewer than the {video} "
                         f"of num_frames, height and width (the layout {layout}).")
    return Tokens(layout, tokens - video)


def wan_attentions(model: nn.Module) -> list[nn.Module]:
    """The self-attention of every block of a Wan-derived model, WanVACE's control blocks included."""
    return [block.attn1 for block in (*model.blocks, *(getattr(model, "vace_blocks", None) or ()))]


def is_wan(model: nn.Module) -> bool:
    """A Wan-derived class: blocks whose self-attention is diffusers' Wan attention, a (t, h, w) patch size."""
    blocks = getattr(model, "blocks", None)
    patch = getattr(getattr(model, "config", None), "patch_size", None)
    return (isinstance(blocks, nn.ModuleList) and len(blocks) > 0
            and type(getattr(blocks[0], "attn1", None)).__name__ in WAN_ATTENTIONS
            and isinstance(patch, (tuple, list)) and len(patch) == 3)


def _motif_attentions(model: nn.Module) -> list[nn.Module]:
    """Motif-Video's dual-stream blocks and its encoder's single-stream blocks; its decoder's single-stream
    blocks attend over the decoder's and the encoder's latent tokens (no text) and keep the model's attention."""
    singles = list(model.single_transformer_blocks)
    encoder = singles[:len(singles) - model.config.num_decoder_layers]
    return [block.attn for block in (*model.transformer_blocks, *encoder)]


WAN = ModelSpec(wan_attentions, _wan_layout)
WAN_FAMILY = ("WanTransformer3DModel", "WanVACETransformer3DModel", "WanAnimateTransformer3DModel",
              "ChronoEditTransformer3DModel", "SkyReelsV2Transformer3DModel")

VIDEO_SPECS: dict[str, ModelSpec] = {
    **{name: WAN for name in WAN_FAMILY},
    "HunyuanVideoTransformer3DModel": ModelSpec(
        ("transformer_blocks.attn", "single_transformer_blocks.attn"), _temporal_spatial, "after", joint=TEXT),
    "HunyuanVideo15Transformer3DModel": ModelSpec(
        "transformer_blocks.attn", _temporal_spatial, "after",
        joint=("encoder_hidden_states", "encoder_hidden_states_2", "image_embeds")),  # MLLM, ByT5, image tokens
    "CogVideoXTransformer3DModel": ModelSpec("transformer_blocks.attn1", _cogvideox_layout, "before", joint=TEXT),
    "LTXVideoTransformer3DModel": ModelSpec("transformer_blocks.attn1", _ltx_layout),
    "LTX2VideoTransformer3DModel": ModelSpec("transformer_blocks.attn1", _ltx2_layout, "after"),
    "MochiTransformer3DModel": ModelSpec("transformer_blocks.attn1", _per_frame, "after", joint=TEXT),
    "AllegroTransformer3DModel": ModelSpec("transformer_blocks.attn1", _allegro_layout),
    "CosmosTransformer3DModel": ModelSpec("transformer_blocks.attn1", _config_patch),
    "MotifVideoTransformer3DModel": ModelSpec(_motif_attentions, _temporal_spatial, "after",
                                              joint=("encoder_hidden_states", "image_embeds")),
    "LatteTransformer3DModel": ModelSpec(layout=_per_frame, split=(
        ("transformer_blocks.attn1", (1, 2)),  # spatial: (height, width) per frame
        ("temporal_transformer_blocks.attn1", (0,)),  # temporal: (frames,) per position
    )),
}
