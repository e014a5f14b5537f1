"""Tiny diffusers transformers of every class natsim.integrations.diffusers routes, built from their configs with
random weights (nothing is downloaded), and random inputs whose latent has a given token layout (frames x height
x width after patching; height x width for the image classes). Two heads of 32 channels, one or two layers:
small enough for Triton's interpreter and the torch reference.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

TEXT_TOKENS = 6
IMAGES = ("FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel", "SD3Transformer2DModel",
          "PixArtTransformer2DModel", "CogView4Transformer2DModel")
HEADS = dict(num_attention_heads=2, attention_head_dim=32)


def _configs(layers: int, frames: int) -> dict:
    """Each class's tiny config (`frames`: Latte's video length, which its temporal embedding is sized for)."""
    wan = dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
               num_layers=layers, rope_max_seq_len=32, **HEADS)
    return {
        "WanTransformer3DModel": wan,
        "ChronoEditTransformer3DModel": {**wan, "num_layers": 1},
        "SkyReelsV2Transformer3DModel": {**wan, "num_layers": 1},
        "WanVACETransformer3DModel": {**wan, "num_layers": 1, "vace_layers": [0], "vace_in_channels": 4},
        "WanAnimateTransformer3DModel": {
            **wan, "num_layers": 1, "in_channels": 12, "latent_channels": 4, "image_dim": None,
            "motion_encoder_channel_sizes": {"8": 8, "4": 8}, "motion_encoder_size": 8, "motion_style_dim": 16,
            "motion_dim": 4, "motion_encoder_dim": 16, "face_encoder_hidden_dim": 32, "face_encoder_num_heads": 2,
            "inject_face_latents_blocks": 1},
        "HunyuanVideoTransformer3DModel": dict(
            in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
            patch_size_t=1, text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(8, 12, 12),
            guidance_embeds=True, **HEADS),
        "HunyuanVideo15Transformer3DModel": dict(
            in_channels=4, out_channels=4, num_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
            text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(8, 12, 12), **HEADS),
        "CogVideoXTransformer3DModel": dict(
            in_channels=4, out_channels=4, time_embed_dim=32, text_embed_dim=32, num_layers=2, patch_size=2,
            max_text_seq_length=TEXT_TOKENS, use_rotary_positional_embeddings=True, sample_width=16,
            sample_height=16, sample_frames=13, **HEADS),
        "LTXVideoTransformer3DModel": dict(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, cross_attention_dim=64, num_layers=2,
            caption_channels=32, **HEADS),
        "LTX2VideoTransformer3DModel": dict(
            in_channels=8, out_channels=8, cross_attention_dim=64, audio_in_channels=8, audio_out_channels=8,
            audio_num_attention_heads=2, audio_attention_head_dim=32, audio_cross_attention_dim=64,
            num_layers=1, caption_channels=32, **HEADS),
        "MochiTransformer3DModel": dict(
            patch_size=2, num_layers=1, pooled_projection_dim=16, in_channels=4, text_embed_dim=32,
            time_embed_dim=32, max_sequence_length=TEXT_TOKENS, **HEADS),
        "AllegroTransformer3DModel": dict(
            patch_size=2, patch_size_t=1, in_channels=4, out_channels=4, num_layers=1, cross_attention_dim=64,
            sample_height=16, sample_width=16, sample_frames=4, caption_channels=32, **HEADS),
        "CosmosTransformer3DModel": dict(
            in_channels=4, out_channels=4, num_layers=1, mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=16,
            max_size=(8, 32, 32), patch_size=(1, 2, 2), concat_padding_mask=False, extra_pos_embed_type=None,
            **HEADS),
        "MotifVideoTransformer3DModel": dict(
            in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, patch_size=2,
            patch_size_t=1, text_embed_dim=32, rope_axes_dim=(8, 12, 12), **HEADS),
        "LatteTransformer3DModel": dict(
            in_channels=4, out_channels=8, num_layers=1, cross_attention_dim=64, sample_size=16, patch_size=2,
            norm_type="ada_norm_single", caption_channels=32, video_length=frames, **HEADS),
        "FluxTransformer2DModel": dict(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=32,
            pooled_projection_dim=16, axes_dims_rope=(8, 12, 12), **HEADS),
        "Flux2Transformer2DModel": dict(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=32,
            timestep_guidance_channels=32, axes_dims_rope=(8, 8, 8, 8), **HEADS),
        "QwenImageTransformer2DModel": dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=1, joint_attention_dim=32,
            axes_dims_rope=(8, 12, 12), **HEADS),
        "SD3Transformer2DModel": dict(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, joint_attention_dim=32,
            caption_projection_dim=64, pooled_projection_dim=16, pos_embed_max_size=16, dual_attention_layers=(0,),
            **HEADS),
        "PixArtTransformer2DModel": dict(
            in_channels=4, out_channels=8, num_layers=1, cross_attention_dim=64, sample_size=16, patch_size=2,
            caption_channels=32, **HEADS),
        "CogView4Transformer2DModel": dict(
            patch_size=2, in_channels=4, out_channels=4, num_layers=1, text_embed_dim=32, time_embed_dim=32,
            condition_dim=16, pos_embed_max_size=16, sample_size=16, rope_axes_dim=(16, 16), **HEADS),
    }


def build(name: str, seed: int = 0, layers: int = 2, frames: int = 2, **config):
    """A tiny model of class `name` in eval mode (`layers`: Wan's block count; `frames`: Latte's frame count;
    `config`: entries of the class's config to change, such as another class's `num_layers`)."""
    import diffusers

    configs = _configs(layers, frames)
    if name not in configs:
        raise ValueError(f"no tiny model for {name}")
    torch.manual_seed(seed)
    return getattr(diffusers, name)(**{**configs[name], **config}).eval()


def _patch_bounds(batch: int, layouts: list[tuple[int, int, int]]) -> torch.Tensor:
    """LTX's `video_coords` for tokens in row-major (frames, height, width) layouts one after the other: each
    token's `[start, end)` along the three axes, `[batch, 3, tokens, 2]`."""
    starts = torch.cat([torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in layout),
                                                   indexing="ij")).flatten(1) for layout in layouts], dim=1)
    return torch.stack([starts, starts + 1], dim=-1).expand(batch, -1, -1, -1)


def inputs(name: str, layout: tuple[int, ...], batch: int = 1, seed: int = 1,
           reference: Optional[tuple[int, int]] = None) -> dict:
    """Random forward arguments for `build(name)` whose latent patches into `layout`; `batch=2` is a
    classifier-free guidance batch, whose last prompt ends in two padding tokens where the class takes a text
    mask. `reference`: the token layout of a reference image appended to the image's tokens (FLUX, FLUX.2,
    QwenImage edits), or of a keyframe appended to the video's (LTX-2's condition pipeline, placed at the first
    frame by `video_coords`)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g)

    text = randn(batch, TEXT_TOKENS, 32)
    mask = torch.ones(batch, TEXT_TOKENS, dtype=torch.long)
    mask[-1, -2:] = 0
    timestep = torch.full((batch,), 500.0)
    if name in IMAGES:
        height, width = layout
        if name in ("FluxTransformer2DModel", "Flux2Transformer2DModel"):
            return _flux_inputs(name, layout, batch, text, timestep, reference, randn)
        if name == "QwenImageTransformer2DModel":
            shapes = [(1, height, width)] + ([(1, *reference)] if reference else [])
            tokens = sum(h * w for _, h, w in shapes)
            return dict(hidden_states=randn(batch, tokens, 16), encoder_hidden_states=text,
                        encoder_hidden_states_mask=mask, timestep=timestep / 1000, img_shapes=[shapes] * batch,
                        return_dict=False)
        latent = randn(batch, 4, height * 2, width * 2)
        if name == "SD3Transformer2DModel":
            return dict(hidden_states=latent, encoder_hidden_states=text, pooled_projections=randn(batch, 16),
                        timestep=timestep, return_dict=False)
        if name == "PixArtTransformer2DModel":
            return dict(hidden_states=latent, encoder_hidden_states=text, timestep=timestep.long(),
                        added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
        sizes = torch.tensor([[height * 16, width * 16]] * batch, dtype=torch.float32)
        return dict(hidden_states=latent, encoder_hidden_states=text, timestep=timestep.long(), original_size=sizes,
                    target_size=sizes, crop_coords=torch.zeros(batch, 2), return_dict=False)
    frames, height, width = layout
    if name in ("LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel"):
        video = randn(batch, frames * height * width, 8)
        if name == "LTXVideoTransformer3DModel":
            return dict(hidden_states=video, encoder_hidden_states=text, timestep=timestep.long(),
                        encoder_attention_mask=torch.ones(batch, TEXT_TOKENS, dtype=torch.long),
                        num_frames=frames, height=height, width=width, return_dict=False)
        arguments = dict(hidden_states=video, audio_hidden_states=randn(batch, 5, 8), encoder_hidden_states=text,
                         audio_encoder_hidden_states=randn(batch, TEXT_TOKENS, 32), timestep=timestep / 1000,
                         encoder_attention_mask=torch.ones(batch, TEXT_TOKENS, dtype=torch.long), num_frames=frames,
                         height=height, width=width, audio_num_frames=5, return_dict=False)
        if reference:
            keyframe = randn(batch, math.prod(reference), 8)
            arguments.update(hidden_states=torch.cat([video, keyframe], dim=1),
                             video_coords=_patch_bounds(batch, [layout, (1, *reference)]))
        return arguments
    if name == "CogVideoXTransformer3DModel":
        return dict(hidden_states=randn(batch, frames, 4, height * 2, width * 2), timestep=timestep.long(),
                    encoder_hidden_states=text, return_dict=False)
    latent = randn(batch, 4, frames, height * 2, width * 2)
    common = dict(hidden_states=latent, timestep=timestep.long(), encoder_hidden_states=text, return_dict=False)
    if name in ("WanTransformer3DModel", "ChronoEditTransformer3DModel", "SkyReelsV2Transformer3DModel"):
        return common
    if name == "WanVACETransformer3DModel":
        return dict(common, control_hidden_states=randn(batch, 4, frames, height * 2, width * 2))
    if name == "WanAnimateTransformer3DModel":  # its first frame is the reference image's; 4 face frames a frame
        return dict(common, hidden_states=randn(batch, 12, frames, height * 2, width * 2),
                    pose_hidden_states=randn(batch, 4, frames - 1, height * 2, width * 2),
                    face_pixel_values=randn(batch, 3, 4 * (frames - 1), 8, 8))
    if name == "HunyuanVideoTransformer3DModel":
        return dict(common, encoder_attention_mask=mask, pooled_projections=randn(batch, 16),
                    guidance=torch.full((batch,), 3500.0))
    if name == "HunyuanVideo15Transformer3DModel":
        return dict(common, timestep=timestep, encoder_attention_mask=mask, encoder_hidden_states_2=randn(batch, 4, 16),
                    encoder_attention_mask_2=torch.ones(batch, 4, dtype=torch.long),
                    image_embeds=torch.zeros(batch, 3, 16))
    if name == "MochiTransformer3DModel":
        return dict(common, encoder_attention_mask=mask.bool())
    if name == "MotifVideoTransformer3DModel":
        return dict(common, encoder_attention_mask=mask)
    if name == "CosmosTransformer3DModel":
        return dict(common, timestep=timestep)
    return common  # Allegro, Latte


def _flux_inputs(name, layout, batch, text, timestep, reference, randn) -> dict:
    """FLUX and FLUX.2: packed latent tokens with their position ids, a reference image's after the image's."""
    def ids(index: int, height: int, width: int) -> torch.Tensor:
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        first = torch.full_like(rows, index)
        columns = [first, rows, cols] + ([torch.zeros_like(rows)] if name == "Flux2Transformer2DModel" else [])
        return torch.stack(columns, dim=-1).reshape(-1, len(columns)).float()

    first_id = 1 if name == "FluxTransformer2DModel" else 10  # FLUX Kontext's; FLUX.2's time coordinate
    img_ids = torch.cat([ids(0, *layout)] + ([ids(first_id, *reference)] if reference else []))
    args = dict(hidden_states=randn(batch, img_ids.shape[0], 16), encoder_hidden_states=text, timestep=timestep / 1000,
                img_ids=img_ids, txt_ids=torch.zeros(TEXT_TOKENS, img_ids.shape[1]), return_dict=False)
    if name == "FluxTransformer2DModel":
        return dict(args, pooled_projections=randn(batch, 16))
    return dict(args, guidance=torch.full((batch,), 3.5))
