"""Tiny diffusers transformers of every class natsim.integrations.diffusers supports, built from their configs
with random weights (nothing is downloaded), and random inputs whose latent has a given token layout (frames x
height x width after patching; height x width for FLUX). Two heads of 32 channels, one or two layers: small
enough for Triton's interpreter.
"""

from __future__ import annotations

import torch

TEXT_TOKENS = 6


def build(name: str, seed: int = 0, layers: int = 2):
    """A tiny model of class `name` in eval mode (`layers`: Wan's block count)."""
    import diffusers

    torch.manual_seed(seed)
    if name == "WanTransformer3DModel":
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=64, num_layers=layers, rope_max_seq_len=32)
    elif name == "HunyuanVideoTransformer3DModel":
        model = diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32,
            pooled_projection_dim=16, rope_axes_dim=(8, 12, 12), guidance_embeds=True)
    elif name == "CogVideoXTransformer3DModel":
        model = diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4, time_embed_dim=32,
            text_embed_dim=32, num_layers=2, patch_size=2, max_text_seq_length=TEXT_TOKENS,
            use_rotary_positional_embeddings=True, sample_width=16, sample_height=16, sample_frames=13)
    elif name == "LTXVideoTransformer3DModel":
        model = diffusers.LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=32,
            cross_attention_dim=64, num_layers=2, caption_channels=32)
    elif name == "FluxTransformer2DModel":
        model = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 12, 12))
    else:
        raise ValueError(f"no tiny model for {name}")
    return model.eval()


def inputs(name: str, layout: tuple[int, ...], batch: int = 1, seed: int = 1) -> dict:
    """Random forward arguments for `build(name)` whose latent patches into `layout`; `batch=2` is a
    classifier-free guidance batch."""
    g = torch.Generator().manual_seed(seed)
    if name == "FluxTransformer2DModel":
        height, width = layout
    elif name == "LTXVideoTransformer3DModel":
        frames, height, width = layout
    else:
        frames, height, width = layout[0], layout[1] * 2, layout[2] * 2

    def randn(*shape):
        return torch.randn(shape, generator=g)

    timestep = torch.full((batch,), 500.0)
    if name == "WanTransformer3DModel":
        return dict(hidden_states=randn(batch, 4, frames, height, width), timestep=timestep.long(),
                    encoder_hidden_states=randn(batch, TEXT_TOKENS, 32), return_dict=False)
    if name == "HunyuanVideoTransformer3DModel":
        mask = torch.ones(batch, TEXT_TOKENS, dtype=torch.long)
        mask[-1, -2:] = 0  # padding in the last prompt: masked text keys
        return dict(hidden_states=randn(batch, 4, frames, height, width), timestep=timestep.long(),
                    encoder_hidden_states=randn(batch, TEXT_TOKENS, 32), encoder_attention_mask=mask,
                    pooled_projections=randn(batch, 16), guidance=torch.full((batch,), 3500.0), return_dict=False)
    if name == "CogVideoXTransformer3DModel":
        return dict(hidden_states=randn(batch, frames, 4, height, width), timestep=timestep.long(),
                    encoder_hidden_states=randn(batch, TEXT_TOKENS, 32), return_dict=False)
    if name == "LTXVideoTransformer3DModel":
        return dict(hidden_states=randn(batch, frames * height * width, 8), timestep=timestep.long(),
                    encoder_hidden_states=randn(batch, TEXT_TOKENS, 32),
                    encoder_attention_mask=torch.ones(batch, TEXT_TOKENS, dtype=torch.long),
                    num_frames=frames, height=height, width=width, return_dict=False)
    if name == "FluxTransformer2DModel":
        h, w = height, width
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
        return dict(hidden_states=randn(batch, h * w, 16), encoder_hidden_states=randn(batch, TEXT_TOKENS, 32),
                    pooled_projections=randn(batch, 16), timestep=timestep / 1000, img_ids=img_ids,
                    txt_ids=torch.zeros(TEXT_TOKENS, 3), return_dict=False)
    raise ValueError(f"no inputs for {name}")
