"""A denoising step of diffusers video and image transformers with natsim, against the model's own attention,
eager and compiled, one run, one JSON:

    python benchmarks/diffusers_step.py --out DIR --group wan-14b           # a group of cases: GROUPS below
    python benchmarks/diffusers_step.py --out DIR [--cases wan-480p,sd3-1024,...] [--steps 5]
    python benchmarks/diffusers_step.py --out /tmp/x --small      # CPU smoke test: tiny models, every case

A case per class natsim.integrations.diffusers routes (`CASES`: Wan 1.3B, Wan VACE, Wan Animate, ChronoEdit,
SkyReels-V2, HunyuanVideo, HunyuanVideo 1.5, CogVideoX, LTX-Video, LTX-2, Mochi, Allegro, Cosmos, Motif-Video,
Latte, FLUX, FLUX.2, QwenImage, SD3, PixArt-Sigma, CogView4). Each model is built from its released checkpoint's
configuration with random weights (nothing is downloaded; most with fewer layers, which leaves each layer's share
of the step as it is), on the GPU in bf16, batch 1, with random forward arguments shaped as its pipeline passes
them (`inputs`: a latent at the case's native token layout, the prompt's tokens, and what else the class takes).
Per case, side by side in one process:
- the step (one forward pass) with the model's own attention (diffusers' default: torch's SDPA), eager and
  under `compile_repeated_blocks(fullgraph=True)` (the whole model under `torch.compile(fullgraph=True)` for the
  classes that declare no repeated blocks: CogVideoX, Mochi, Allegro, Cosmos, Latte, SD3, PixArt, CogView4);
  where Dynamo cannot trace a step whole (a graph break, a data-dependent shape), it is compiled again with graph
  breaks allowed and the JSON says why (`own_graph_break`, `natsim_graph_break`; the table's "graph");
- the same with `natsim.integrations.diffusers.apply(model, ..., keep_own=False)`, natsim's route on every layout
  (benchmarks/keep_own.py measures the default, which keeps the model's attention where natsim's is predicted
  slower): eager and compiled;
- the attention alone at the case's layout: the model's own (SDPA over the q, k, v and mask of the first call
  natsim serves over a whole layout, captured from the step: Latte's over a frame) against natsim's (the router's
  call on them), its speedup `s`;
- the attention share of the step, `a = calls x the model's own attention / the model's own step` (calls: the
  attention calls natsim serves in a step; Latte's temporal and Motif-Video's decoder attention stay the
  model's and are not counted), and Amdahl's ceiling for the step, `1 / ((1 - a) + a / s)`, and the fraction of
  it the step reaches;
- the relative difference of natsim's step output to the model's own, and the plan natsim made (its backend);
- where the model keeps the plan's tile order (integrations/diffusers/order.py: FlashAttention-4 plans), the
  compiled step again with `tile_order=False` (every attention call permuting its tokens), beside it.
Medians of `--steps` timed steps after warm-up (synchronised wall clock). Each case starts from a reset Dynamo
(it compiles as in a fresh process). Writes `diffusers-step[-GROUP]-<device>-<date>.json` after each case; the
table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from natsim.integrations import diffusers as nd

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
HUNYUAN = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
               num_single_layers=40, num_refiner_layers=2, patch_size=2, patch_size_t=1, text_embed_dim=4096,
               pooled_projection_dim=768, rope_axes_dim=(16, 56, 56), guidance_embeds=True)
FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
COGVIDEOX_5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
                    text_embed_dim=4096, num_layers=42, patch_size=2, use_rotary_positional_embeddings=True,
                    sample_width=90, sample_height=60, sample_frames=49)
LTX = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32, attention_head_dim=64,
           cross_attention_dim=2048, num_layers=28, caption_channels=4096)
# The released checkpoints' transformer configurations (their config.json, as diffusers' conversion scripts
# write them; what a config does not name is the class default). Wan 2.1 14B's transformer, which the 14B
# Wan-derived models below share:
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
WAN_I2V_14B = dict(WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)  # Wan2.1-I2V-14B
# Wan-AI/Wan2.1-VACE-14B-diffusers: a control block (over the control video) beside every fifth block
WAN_VACE_14B = dict(WAN_14B, vace_layers=[0, 5, 10, 15, 20, 25, 30, 35], vace_in_channels=96)
# Wan-AI/Wan2.2-Animate-14B-Diffusers: a face adapter after every fifth block, fed by the motion encoder
WAN_ANIMATE_14B = dict(WAN_I2V_14B, latent_channels=16, motion_encoder_size=512, motion_style_dim=512, motion_dim=20,
                       motion_encoder_dim=512, face_encoder_hidden_dim=1024, face_encoder_num_heads=4,
                       inject_face_latents_blocks=5)
CHRONOEDIT_14B = dict(WAN_I2V_14B, rope_temporal_skip_len=8)  # nvidia/ChronoEdit-14B-Diffusers
SKYREELS_V2_14B = dict(WAN_14B, inject_sample_info=False)  # Skywork/SkyReels-V2-T2V-14B-540P-Diffusers
# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v
HUNYUAN_VIDEO_15 = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                        num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                        text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                        rope_axes_dim=(16, 56, 56), target_size=960, task_type="t2v")
LTX_2 = dict(  # Lightricks/LTX-2: video and audio streams
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32, attention_head_dim=128,
    cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20, base_height=2048, base_width=2048,
    gated_attn=False, cross_attn_mod=False, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
    audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
    audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
    audio_gated_attn=False, audio_cross_attn_mod=False, num_layers=48, activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
    attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
    timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
    use_prompt_embeddings=True, perturbed_attn=False)
MOCHI = dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48, pooled_projection_dim=1536,
             in_channels=12, qk_norm="rms_norm", text_embed_dim=4096, time_embed_dim=256, activation_fn="swiglu",
             max_sequence_length=256)  # genmo/mochi-1-preview
ALLEGRO = dict(patch_size=2, patch_size_t=1, num_attention_heads=24, attention_head_dim=96, in_channels=4,
               out_channels=4, num_layers=32, cross_attention_dim=2304, sample_height=90, sample_width=160,
               sample_frames=22, caption_channels=4096, interpolation_scale_h=2.0, interpolation_scale_w=2.0,
               interpolation_scale_t=2.2)  # rhymes-ai/Allegro
# nvidia/Cosmos-1.0-Diffusion-7B-Text2World, whose concat_padding_mask appends the pipeline's padding mask (zeros)
# to the latent as a 17th channel after resizing it with torchvision: here the latent comes with that channel
# (in_channels 16 + 1, the same patch embedding), and no torchvision is needed.
COSMOS_7B = dict(in_channels=16 + 1, out_channels=16, num_attention_heads=32, attention_head_dim=128, num_layers=28,
                 mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
                 rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable")
# Motif-Technologies/Motif-Video-2B (its model card: 1536 wide, 12 heads of 128, 12 dual-stream, 16 single-stream
# and 8 decoder layers, the decoder's counted among the single-stream blocks here; shared cross-attention in the
# single-stream encoder blocks). text_embed_dim is the class default: the card does not give T5Gemma2's width,
# which sizes only the text projection.
MOTIF_VIDEO_2B = dict(in_channels=33, out_channels=16, num_attention_heads=12, attention_head_dim=128, num_layers=12,
                      num_single_layers=24, num_decoder_layers=8, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
                      text_embed_dim=4096, rope_axes_dim=(16, 56, 56), enable_text_cross_attention_single=True)
LATTE_1 = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
               cross_attention_dim=1152, attention_bias=True, sample_size=64, patch_size=2,
               activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
               norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096, video_length=16)  # maxin-cn/Latte-1
FLUX_2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                  num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                  axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6)  # black-forest-labs/FLUX.2-dev
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                  axes_dims_rope=(16, 56, 56))  # Qwen/Qwen-Image
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                  num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                  pooled_projection_dim=2048, out_channels=16,
                  pos_embed_max_size=192)  # stabilityai/stable-diffusion-3-medium-diffusers
PIXART_SIGMA = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                    cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
                    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                    norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096, interpolation_scale=2,
                    use_additional_conditions=False)  # PixArt-alpha/PixArt-Sigma-XL-2-1024-MS
COGVIEW4_6B = dict(patch_size=2, in_channels=16, out_channels=16, num_layers=28, attention_head_dim=128,
                   num_attention_heads=32, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                   pos_embed_max_size=128, sample_size=128, rope_axes_dim=(256, 256))  # THUDM/CogView4-6B
# name: class, configuration (layers cut where one H100 cannot hold a full step or would take minutes: each layer's
# share of the step stays as it is), token layout (the latent after patching at a native size), text tokens (as
# the pipeline passes them: its padded prompt length where it pads), natsim's options.
CASES = {
    "wan-480p": ("WanTransformer3DModel", WAN_1_3B, (21, 30, 52), 512, dict(sparsity=0.9)),
    "wan-720p": ("WanTransformer3DModel", WAN_1_3B, (21, 45, 80), 512, dict(sparsity=0.9)),
    "hunyuan-720p": ("HunyuanVideoTransformer3DModel", {**HUNYUAN, "num_layers": 4, "num_single_layers": 8},
                     (30, 48, 80), 256, dict(window=(18, 24, 24))),
    "flux-2048": ("FluxTransformer2DModel", {**FLUX, "num_layers": 4, "num_single_layers": 8}, (128, 128), 512,
                  dict(sparsity=0.9)),
    "cogvideox-5b": ("CogVideoXTransformer3DModel", {**COGVIDEOX_5B, "num_layers": 10}, (13, 30, 45), 226,
                     dict(sparsity=0.9)),
    "ltx-video": ("LTXVideoTransformer3DModel", {**LTX, "num_layers": 10}, (33, 22, 38), 128, dict(sparsity=0.9)),
    # 720p, 81 frames; 5 blocks and the control block beside the first
    "wan-vace-720p": ("WanVACETransformer3DModel", {**WAN_VACE_14B, "num_layers": 5, "vace_layers": [0]},
                      (21, 45, 80), 512, dict(sparsity=0.9)),
    # 720p, a 77-frame segment and its reference frame; 5 blocks and one face adapter
    "wan-animate-720p": ("WanAnimateTransformer3DModel", {**WAN_ANIMATE_14B, "num_layers": 5}, (21, 45, 80), 512,
                         dict(sparsity=0.9)),
    "chronoedit-480p": ("ChronoEditTransformer3DModel", {**CHRONOEDIT_14B, "num_layers": 12}, (21, 30, 52), 512,
                        dict(sparsity=0.9)),  # 480x832, 81 frames (temporal reasoning)
    "skyreels-v2-540p": ("SkyReelsV2Transformer3DModel", {**SKYREELS_V2_14B, "num_layers": 6}, (25, 34, 60), 512,
                         dict(sparsity=0.9)),  # 544x960, 97 frames
    # 720p, 121 frames; the prompt's 1000 tokens less one, so that the joint sequence (video, image, ByT5 and
    # prompt tokens) is a multiple of 16 and SDPA need not pad the N x N mask the model builds (a third 26 GB copy)
    "hunyuanvideo15-720p": ("HunyuanVideo15Transformer3DModel", {**HUNYUAN_VIDEO_15, "num_layers": 4},
                            (31, 45, 80), 999, dict(sparsity=0.9)),
    "ltx2-512p": ("LTX2VideoTransformer3DModel", {**LTX_2, "num_layers": 16}, (16, 16, 24), 1024,
                  dict(sparsity=0.9)),  # 512x768, 121 frames
    "mochi-480p": ("MochiTransformer3DModel", {**MOCHI, "num_layers": 8}, (28, 30, 53), 256,
                   dict(sparsity=0.9)),  # 480x848, 163 frames
    "allegro-720p": ("AllegroTransformer3DModel", {**ALLEGRO, "num_layers": 6}, (22, 45, 80), 512,
                     dict(sparsity=0.9)),  # 720x1280, 88 frames
    "cosmos-704p": ("CosmosTransformer3DModel", {**COSMOS_7B, "num_layers": 6}, (16, 44, 80), 512,
                    dict(sparsity=0.9)),  # 704x1280, 121 frames
    # 736x1280, 121 frames; 3 dual-stream, 4 single-stream and 2 decoder layers
    "motif-video-736p": ("MotifVideoTransformer3DModel",
                         {**MOTIF_VIDEO_2B, "num_layers": 3, "num_single_layers": 6, "num_decoder_layers": 2},
                         (31, 46, 80), 512, dict(sparsity=0.9)),
    # 512x512, 16 frames: attention over each frame's 32x32 and over the 16 frames (shorter than a tile: the model's)
    "latte-512": ("LatteTransformer3DModel", {**LATTE_1, "num_layers": 8}, (16, 32, 32), 120, dict(sparsity=0.9)),
    "flux2-1024": ("Flux2Transformer2DModel", {**FLUX_2_DEV, "num_layers": 2, "num_single_layers": 12}, (64, 64),
                   512, dict(sparsity=0.9)),
    # the pipeline passes the prompt's tokens unpadded: a long prompt's 256
    "qwenimage-1024": ("QwenImageTransformer2DModel", {**QWEN_IMAGE, "num_layers": 20}, (64, 64), 256,
                       dict(sparsity=0.9)),
    "sd3-1024": ("SD3Transformer2DModel", {**SD3_MEDIUM, "num_layers": 12}, (64, 64), 77 + 256,
                 dict(sparsity=0.9)),  # CLIP's 77 tokens and T5's 256
    "pixart-sigma-1024": ("PixArtTransformer2DModel", {**PIXART_SIGMA, "num_layers": 14}, (64, 64), 300,
                          dict(sparsity=0.9)),
    # the pipeline passes the prompt's tokens padded to a multiple of 16: a long prompt's 256
    "cogview4-1024": ("CogView4Transformer2DModel", {**COGVIEW4_6B, "num_layers": 12}, (64, 64), 256,
                      dict(sparsity=0.9)),
}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
CLIP_IMAGE_TOKENS = 257  # CLIP ViT-H/14's image tokens, which Wan's image-to-video models attend with the text
BYT5_TOKENS, SIGLIP_TOKENS = 256, 729  # HunyuanVideo 1.5's glyph text and image tokens, as its pipeline pads them
LTX_2_FPS, COSMOS_FPS = 24, 30  # the pipelines' default frame rates
SMALL_TEXT = 6
SMALL = {
    "WanTransformer3DModel": dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32,
                                  ffn_dim=64, num_layers=2, rope_max_seq_len=32),
    "HunyuanVideoTransformer3DModel": dict(HUNYUAN, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                           num_single_layers=1, num_refiner_layers=1, text_embed_dim=32,
                                           pooled_projection_dim=16, rope_axes_dim=(8, 12, 12)),
    "FluxTransformer2DModel": dict(FLUX, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                                   axes_dims_rope=(8, 12, 12)),
    "CogVideoXTransformer3DModel": dict(COGVIDEOX_5B, num_attention_heads=2, attention_head_dim=32, in_channels=4,
                                        out_channels=4, time_embed_dim=32, text_embed_dim=32, num_layers=2,
                                        sample_width=16, sample_height=16, sample_frames=13),
    "LTXVideoTransformer3DModel": dict(LTX, in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=32,
                                       cross_attention_dim=64, num_layers=2, caption_channels=32),
    **{name: dict(config, num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32, ffn_dim=64,
                  num_layers=1, rope_max_seq_len=32, image_dim=None, added_kv_proj_dim=None)
       for name, config in (("WanVACETransformer3DModel", dict(WAN_VACE_14B, vace_layers=[0])),
                            ("ChronoEditTransformer3DModel", CHRONOEDIT_14B),
                            ("SkyReelsV2Transformer3DModel", SKYREELS_V2_14B))},
    "WanAnimateTransformer3DModel": dict(
        WAN_ANIMATE_14B, num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32, ffn_dim=64,
        num_layers=1, rope_max_seq_len=32, image_dim=None, added_kv_proj_dim=None,
        motion_encoder_channel_sizes={"8": 8, "4": 8}, motion_encoder_size=8, motion_style_dim=16, motion_dim=4,
        motion_encoder_dim=16, face_encoder_hidden_dim=32, face_encoder_num_heads=2, inject_face_latents_blocks=1),
    "HunyuanVideo15Transformer3DModel": dict(HUNYUAN_VIDEO_15, num_attention_heads=2, attention_head_dim=32,
                                             num_layers=1, num_refiner_layers=1, text_embed_dim=32,
                                             text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(8, 12, 12)),
    "LTX2VideoTransformer3DModel": dict(LTX_2, num_attention_heads=2, attention_head_dim=32, cross_attention_dim=64,
                                        audio_num_attention_heads=2, audio_attention_head_dim=32,
                                        audio_cross_attention_dim=64, num_layers=1, caption_channels=32),
    "MochiTransformer3DModel": dict(MOCHI, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                    pooled_projection_dim=16, text_embed_dim=32, time_embed_dim=32,
                                    max_sequence_length=SMALL_TEXT),
    # Allegro's rotary embedding splits the head dim in three
    "AllegroTransformer3DModel": dict(ALLEGRO, num_attention_heads=2, attention_head_dim=48, num_layers=1,
                                      cross_attention_dim=96, sample_height=16, sample_width=16, sample_frames=4,
                                      caption_channels=32),
    "CosmosTransformer3DModel": dict(COSMOS_7B, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                     mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=16, max_size=(8, 32, 32)),
    "MotifVideoTransformer3DModel": dict(MOTIF_VIDEO_2B, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                         num_single_layers=2, num_decoder_layers=1, text_embed_dim=32,
                                         rope_axes_dim=(8, 12, 12)),
    "LatteTransformer3DModel": dict(LATTE_1, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                    cross_attention_dim=64, sample_size=16, caption_channels=32, video_length=2),
    "Flux2Transformer2DModel": dict(FLUX_2_DEV, in_channels=16, num_layers=1, num_single_layers=1,
                                    attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                    timestep_guidance_channels=32, axes_dims_rope=(8, 8, 8, 8)),
    "QwenImageTransformer2DModel": dict(QWEN_IMAGE, num_layers=1, attention_head_dim=32, num_attention_heads=2,
                                        joint_attention_dim=32, axes_dims_rope=(8, 12, 12)),
    "SD3Transformer2DModel": dict(SD3_MEDIUM, sample_size=16, num_layers=2, attention_head_dim=32,
                                  num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=64,
                                  pooled_projection_dim=16, pos_embed_max_size=16),
    "PixArtTransformer2DModel": dict(PIXART_SIGMA, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                     cross_attention_dim=64, sample_size=16, caption_channels=32),
    "CogView4Transformer2DModel": dict(COGVIEW4_6B, num_layers=1, attention_head_dim=32, num_attention_heads=2,
                                       text_embed_dim=32, time_embed_dim=32, condition_dim=16, pos_embed_max_size=16,
                                       sample_size=16, rope_axes_dim=(16, 16)),
}
# Latte's split attention over a frame's (height, width) needs a frame of at least one tile (64 tokens) to route
SMALL_LAYOUTS = {"LatteTransformer3DModel": (2, 8, 8)}


# Cases run in one process (--group), each group estimated at 8 minutes or less on one H100: per case the model's
# build, 4 configurations x (2 warm-up + 5 timed steps), the natsim kernels' first compile, and two compiles of
# the step (whole-model compiles take longest; a natsim step that breaks the graph compiles a third time).
GROUPS = {
    "wan": ("wan-480p", "wan-720p"),
    "hunyuan-flux": ("hunyuan-720p", "flux-2048"),
    "cogvideox-ltx": ("cogvideox-5b", "ltx-video"),
    "wan-14b": ("wan-vace-720p", "wan-animate-720p"),
    "video-wan-ltx2": ("chronoedit-480p", "skyreels-v2-540p", "ltx2-512p"),
    "video-joint": ("hunyuanvideo15-720p", "motif-video-736p"),
    "video-whole-a": ("mochi-480p", "latte-512"),
    "video-whole-b": ("allegro-720p", "cosmos-704p"),
    "image-a": ("flux2-1024", "qwenimage-1024", "sd3-1024"),
    "image-b": ("pixart-sigma-1024", "cogview4-1024"),
}


def small_case(name: str) -> tuple:
    """The case with a tiny model and layout (CPU smoke test in Triton's interpreter)."""
    cls_name, _, layout, _, options = CASES[name]
    small_layout = SMALL_LAYOUTS.get(cls_name, (8, 8) if len(layout) == 2 else (2, 4, 8))
    if "window" in options:
        options = dict(window=tuple(max(1, n // 2) for n in small_layout))
    return cls_name, SMALL[cls_name], small_layout, SMALL_TEXT, dict(options, dtype=torch.float16)


def build(cls_name: str, config: dict):
    """A model of class `cls_name` from `config` with random weights, on DEVICE in DTYPE, in eval mode."""
    import diffusers

    with torch.device(DEVICE):
        model = getattr(diffusers, cls_name)(**config)
    return model.to(DTYPE).eval()


@dataclass(frozen=True)
class Draw:
    """Random forward arguments for a model of `config` whose latent patches into the token `layout`, with
    `text` prompt tokens: batch 1, on DEVICE, in the model's dtype (bf16 on the GPU)."""

    config: dict
    layout: tuple
    text: int

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, device=DEVICE, dtype=DTYPE)

    def ones(self, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.ones(shape, device=DEVICE, dtype=dtype)

    def full(self, value: float) -> torch.Tensor:
        """A batch of one timestep (or guidance): int64 for an int `value`, float32 for a float."""
        return torch.full((1,), value, device=DEVICE)

    def sizes(self) -> tuple:
        """The latent's sizes before patching: the layout times the config's patch sizes (`patch_size`, a
        number or a (t, h, w) tuple, and `patch_size_t` for video)."""
        patch = self.config.get("patch_size", 1)
        if not isinstance(patch, (tuple, list)):
            patch = (patch, patch) if len(self.layout) == 2 else (self.config.get("patch_size_t") or 1, patch, patch)
        return tuple(n * p for n, p in zip(self.layout, patch))

    def latent(self, channels: int) -> torch.Tensor:
        """A `[1, channels, (F,) H, W]` latent."""
        return self.randn(1, channels, *self.sizes())

    def prompt(self, dim: int) -> torch.Tensor:
        """`[1, text, dim]` text encoder states."""
        return self.randn(1, self.text, dim)


def _wan(d: Draw) -> dict:
    """Wan and its derived classes; those made from Wan's image-to-video model take CLIP's image tokens too (their
    processors read the last 512 text tokens as the prompt)."""
    c = d.config
    args = dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(c["text_dim"]), return_dict=False)
    if c.get("image_dim"):
        args["encoder_hidden_states_image"] = d.randn(1, CLIP_IMAGE_TOKENS, c["image_dim"])
    return args


def _hunyuan(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(c["text_embed_dim"]), encoder_attention_mask=d.ones(1, d.text),
                pooled_projections=d.randn(1, c["pooled_projection_dim"]), guidance=d.full(6000.0), return_dict=False)


def _cogvideox(d: Draw) -> dict:
    frames, height, width = d.sizes()  # CogVideoX's latent is [B, F, C, H, W]
    return dict(hidden_states=d.randn(1, frames, d.config["in_channels"], height, width), timestep=d.full(500),
                encoder_hidden_states=d.prompt(d.config["text_embed_dim"]), return_dict=False)


def _ltx(d: Draw) -> dict:
    frames, height, width = d.sizes()  # LTX-Video's latent comes as tokens, its sizes as arguments
    return dict(hidden_states=d.randn(1, math.prod(d.layout), d.config["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(d.config["caption_channels"]), encoder_attention_mask=d.ones(1, d.text),
                num_frames=frames, height=height, width=width, return_dict=False)


def _image_ids(layout: tuple, columns: int) -> torch.Tensor:
    """FLUX's (index, row, column) or FLUX.2's (time, row, column, layer) position ids of an image's tokens,
    row-major, every other column zero."""
    rows, cols = torch.meshgrid(*(torch.arange(n, device=DEVICE) for n in layout), indexing="ij")
    zero = torch.zeros_like(rows)
    return torch.stack([zero, rows, cols] + [zero] * (columns - 3), dim=-1).reshape(-1, columns).float()


def _flux(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.randn(1, math.prod(d.layout), c["in_channels"]),
                encoder_hidden_states=d.prompt(c["joint_attention_dim"]),
                pooled_projections=d.randn(1, c["pooled_projection_dim"]), timestep=d.full(0.5),
                img_ids=_image_ids(d.layout, 3), txt_ids=torch.zeros(d.text, 3, device=DEVICE),
                guidance=d.full(3.5), return_dict=False)


def _wan_vace(d: Draw) -> dict:
    """The control video's latent (its frames, masks and reference: `vace_in_channels`) beside the video's."""
    return dict(_wan(d), control_hidden_states=d.latent(d.config["vace_in_channels"]))


def _wan_animate(d: Draw) -> dict:
    """The latent's first frame is the reference image's; the pose video's latent covers the other frames, the
    face video (pixels, at the motion encoder's size) the segment's 4 (F - 1) - 3 frames (77 for 21)."""
    c = d.config
    frames, height, width = d.sizes()
    size = c["motion_encoder_size"]
    return dict(_wan(d), pose_hidden_states=d.randn(1, c["latent_channels"], frames - 1, height, width),
                face_pixel_values=d.randn(1, 3, 4 * (frames - 1) - 3, size, size))


def _hunyuan15(d: Draw) -> dict:
    """Text-to-video as its pipeline calls it: the prompt's tokens, ByT5's 256 glyph tokens masked out (a prompt
    without quoted text) and SigLIP's 729 image tokens zero, which the model masks out."""
    c = d.config
    # the pipeline passes the timestep in the latent's dtype, which the time embedding's projection takes
    return dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500.0).to(DTYPE),
                encoder_hidden_states=d.prompt(c["text_embed_dim"]), encoder_attention_mask=d.ones(1, d.text),
                encoder_hidden_states_2=d.randn(1, BYT5_TOKENS, c["text_embed_2_dim"]),
                encoder_attention_mask_2=torch.zeros(1, BYT5_TOKENS, dtype=torch.long, device=DEVICE),
                image_embeds=torch.zeros(1, SIGLIP_TOKENS, c["image_embed_dim"], device=DEVICE, dtype=DTYPE),
                return_dict=False)


def _ltx2(d: Draw) -> dict:
    """The video's tokens and the audio's for as long (the pipeline's 24 fps), one prompt for both streams."""
    c = d.config
    frames, height, width = d.sizes()
    seconds = ((frames - 1) * c["vae_scale_factors"][0] + 1) / LTX_2_FPS
    audio = round(seconds * c["audio_sampling_rate"] / c["audio_hop_length"] / c["audio_scale_factor"])
    return dict(hidden_states=d.randn(1, math.prod(d.layout), c["in_channels"]),
                audio_hidden_states=d.randn(1, audio, c["audio_in_channels"]),
                encoder_hidden_states=d.prompt(c["caption_channels"]),
                audio_encoder_hidden_states=d.prompt(c["caption_channels"]), timestep=d.full(0.5),
                encoder_attention_mask=d.ones(1, d.text), audio_encoder_attention_mask=d.ones(1, d.text),
                num_frames=frames, height=height, width=width, fps=LTX_2_FPS, audio_num_frames=audio,
                return_dict=False)


def _mochi(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), encoder_hidden_states=d.prompt(c["text_embed_dim"]),
                timestep=d.full(500), encoder_attention_mask=d.ones(1, d.text, dtype=torch.bool), return_dict=False)


def _allegro_rotary(config: dict, layout: tuple) -> tuple:
    """The rotary tables and token positions Allegro's pipeline computes for its transformer
    (AllegroPipeline._prepare_rotary_positional_embeddings)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    frames, height, width = layout
    scale = tuple(config[f"interpolation_scale_{axis}"] for axis in "thw")
    *freqs, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=config["attention_head_dim"], crops_coords=((0, 0), (height, width)), grid_size=(height, width),
        temporal_size=frames, interpolation_scale=scale, device=DEVICE)
    positions = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())
    return tuple(freqs), tuple(positions.transpose(0, 1).reshape(3, 1, -1).contiguous())


def _allegro(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), encoder_hidden_states=d.prompt(c["caption_channels"]),
                encoder_attention_mask=d.ones(1, d.text), timestep=d.full(500),
                image_rotary_emb=_allegro_rotary(c, d.layout), return_dict=False)


def _cosmos(d: Draw) -> dict:
    c = d.config  # the latent's last channel stands for the padding mask (COSMOS_7B)
    return dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500.0),
                encoder_hidden_states=d.prompt(c["text_embed_dim"]), fps=COSMOS_FPS, return_dict=False)


def _motif(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(c["text_embed_dim"]), encoder_attention_mask=d.ones(1, d.text),
                return_dict=False)


def _latte(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(c["caption_channels"]), return_dict=False)


def _flux2(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.randn(1, math.prod(d.layout), c["in_channels"]),
                encoder_hidden_states=d.prompt(c["joint_attention_dim"]), timestep=d.full(0.5),
                img_ids=_image_ids(d.layout, 4), txt_ids=torch.zeros(d.text, 4, device=DEVICE), guidance=d.full(3.5),
                return_dict=False)


def _qwenimage(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.randn(1, math.prod(d.layout), c["in_channels"]),
                encoder_hidden_states=d.prompt(c["joint_attention_dim"]), encoder_hidden_states_mask=d.ones(1, d.text),
                timestep=d.full(0.5), img_shapes=[[(1, *d.layout)]], return_dict=False)


def _sd3(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), encoder_hidden_states=d.prompt(c["joint_attention_dim"]),
                pooled_projections=d.randn(1, c["pooled_projection_dim"]), timestep=d.full(500.0), return_dict=False)


def _pixart(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), encoder_hidden_states=d.prompt(c["caption_channels"]),
                encoder_attention_mask=d.ones(1, d.text), timestep=d.full(500),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)


def _cogview4(d: Draw) -> dict:
    """Its size conditions in pixels (the VAE's 8 per latent pixel), uncropped."""
    c = d.config
    pixels = torch.tensor([[8 * n for n in d.sizes()]], device=DEVICE, dtype=DTYPE)
    return dict(hidden_states=d.latent(c["in_channels"]), encoder_hidden_states=d.prompt(c["text_embed_dim"]),
                timestep=d.full(500), original_size=pixels, target_size=pixels,
                crop_coords=torch.zeros(1, 2, device=DEVICE, dtype=DTYPE), return_dict=False)


INPUTS = {
    "WanTransformer3DModel": _wan,
    "WanVACETransformer3DModel": _wan_vace,
    "WanAnimateTransformer3DModel": _wan_animate,
    "ChronoEditTransformer3DModel": _wan,
    "SkyReelsV2Transformer3DModel": _wan,
    "HunyuanVideoTransformer3DModel": _hunyuan,
    "HunyuanVideo15Transformer3DModel": _hunyuan15,
    "CogVideoXTransformer3DModel": _cogvideox,
    "LTXVideoTransformer3DModel": _ltx,
    "LTX2VideoTransformer3DModel": _ltx2,
    "MochiTransformer3DModel": _mochi,
    "AllegroTransformer3DModel": _allegro,
    "CosmosTransformer3DModel": _cosmos,
    "MotifVideoTransformer3DModel": _motif,
    "LatteTransformer3DModel": _latte,
    "FluxTransformer2DModel": _flux,
    "Flux2Transformer2DModel": _flux2,
    "QwenImageTransformer2DModel": _qwenimage,
    "SD3Transformer2DModel": _sd3,
    "PixArtTransformer2DModel": _pixart,
    "CogView4Transformer2DModel": _cogview4,
}


def inputs(cls_name: str, config: dict, layout: tuple, text: int) -> dict:
    """Random forward arguments for a model of class `cls_name` built from `config`, whose latent patches into
    `layout`, with `text` prompt tokens (batch 1, on DEVICE, bf16 on the GPU), as its pipeline passes them."""
    if cls_name not in INPUTS:
        raise ValueError(f"no inputs for {cls_name}")
    return INPUTS[cls_name](Draw(config, tuple(layout), text))


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


WARMUP = 2 if DEVICE == "cuda" else 1  # the CPU runs the scripts' smoke tests: its first call compiles, no more


def median_ms(fn, repeats: int, warmup: int = WARMUP) -> float:
    """Median milliseconds of `fn()` over `repeats` synchronised calls after `warmup` calls, Python's garbage
    collector run before and kept off while they are timed (as `timeit` does): a host-bound compiled step moves
    with every pause of the host's issue."""
    for _ in range(warmup):
        fn()
    synchronize()
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        if collecting:
            gc.enable()
    return statistics.median(times)


def step_ms(model, args: dict, steps: int, graphs: bool = False) -> tuple[float, torch.Tensor]:
    """Median milliseconds of a forward pass (after two warm-up passes) and its output (a copy: a CUDA graph's
    output is overwritten by its next replay). `graphs`: the model is compiled with CUDA graphs, each pass a new
    step of their trees."""

    def forward():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return model(**args)

    with torch.no_grad():
        return median_ms(forward, steps), forward()[0].clone()


@dataclass
class Captured:
    """The first attention call of a forward pass that natsim served over its router's whole layout (q, k, v and
    the mask as the model's processor hands them over), the router or split view that served it, and how many
    calls natsim served in the pass (the model's calls that natsim leaves to the model not counted)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    router: object
    calls: int


def captured_qkv(model, args: dict, applied) -> Captured:
    """What natsim replaces in a forward pass: its first call over a whole layout (Latte's: over a frame's
    (height, width), its temporal split being the model's), and the number of calls it serves."""
    routers = [applied.router, *applied.router.views]
    seen, calls = [], []

    def capturing(router):
        attend = router.attend

        def attend_and_capture(q, k, v, mask, scale):
            out = attend(q, k, v, mask, scale)
            if out is not None:
                calls.append(q.shape)
                if not seen and q.shape[1] >= math.prod(router.layout):
                    seen.append((q.clone(), k.clone(), v.clone(), mask, router))
            return out
        return attend_and_capture

    for router in routers:
        router.attend = capturing(router)
    try:  # eager even where the model's blocks were compiled before: a traced capture would recompile per call
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(**args)
    finally:
        for router in routers:
            del router.attend  # the class's method again
    if not seen:
        raise ValueError(f"natsim served no attention call of {type(model).__name__} over its layout.")
    return Captured(*seen[0], calls=len(calls))


def compile_step(model, fullgraph: bool = True, mode: Optional[str] = None):
    """The model compiled as the step is measured: `compile_repeated_blocks` where the class declares repeated
    blocks, else the whole model under `torch.compile`; `mode`: torch.compile's (None, or "reduce-overhead" for CUDA
    graphs). On the CPU, a smoke test of the scripts, Dynamo alone (backend "eager"): the graphs and their breaks
    are those Inductor would get, without its code generation."""
    backend = ({} if mode is None else {"mode": mode}) if DEVICE == "cuda" else {"backend": "eager"}
    if model._repeated_blocks:
        model.compile_repeated_blocks(fullgraph=fullgraph, **backend)
        return model
    return torch.compile(model, fullgraph=fullgraph, **backend)


def compiled_step_ms(model, args: dict, steps: int, mode: Optional[str] = None
                     ) -> tuple[float, torch.Tensor, Optional[str]]:
    """`step_ms` of the model compiled with `mode` under `fullgraph=True`, or, where Dynamo cannot trace the step
    whole (a graph break, a data-dependent shape), compiled again with graph breaks allowed; then with the
    reason."""
    graphs = mode == "reduce-overhead" and DEVICE == "cuda"
    try:
        return (*step_ms(compile_step(model, mode=mode), args, steps, graphs), None)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
        torch._dynamo.reset()
        return (*step_ms(compile_step(model, fullgraph=False, mode=mode), args, steps, graphs), break_reason(error))


def break_reason(error: Exception) -> str:
    """Dynamo's error in a line: its first, and the user code line it stopped at."""
    lines = str(error).splitlines()
    where = [line.strip() for line in lines if line.strip().startswith('File "')]
    return lines[0] + (f" ({where[-1]})" if where else "")


def run_case(name: str, steps: int, small: bool = False) -> dict:
    cls_name, config, layout, text, options = small_case(name) if small else CASES[name]
    torch.manual_seed(0)
    model = build(cls_name, config)
    args = inputs(cls_name, config, layout, text)
    record = dict(case=name, model=cls_name, layout=list(layout), text_tokens=text,
                  options={k: str(v) if isinstance(v, torch.dtype) else v for k, v in options.items()},
                  layers={k: v for k, v in config.items() if "layers" in k})
    own_ms, own_out = step_ms(model, args, steps)

    applied = nd.apply(model, **options, keep_own=False)
    with torch.no_grad():  # the first step of a layout: planning and the kernels' first compile
        start = time.perf_counter()
        model(**args)
        synchronize()
        record["first_step_ms"] = (time.perf_counter() - start) * 1e3
    natsim_ms, natsim_out = step_ms(model, args, steps)
    plan = next(iter(applied.plans.values()))
    record["plan"] = dict(window=list(plan.problem.window), stride=list(plan.problem.stride),
                          q_tile=list(plan.tiles.q_tile), kv_tile=list(plan.tiles.kv_tile),
                          kv_tiling=plan.tiles.kv_tiling, sparsity=plan.sparsity, tile_speedup=plan.tile_speedup,
                          backend=plan.backend)
    orders = [] if applied.order is None else [o for o in applied.order.decided.values() if o is not None]
    record["tile_order"] = list(orders[0].tile) if orders else None
    record["output_relative_difference"] = float((natsim_out.float() - own_out.float()).norm()
                                                 / own_out.float().norm())

    # The attention alone: the model's own over the routed q, k, v, against natsim's; its share of the steps.
    captured = captured_qkv(model, args, applied)
    q, k, v, mask = captured.q, captured.k, captured.v, captured.mask
    with torch.no_grad():
        own_attention = median_ms(lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask), 5)
        natsim_attention = median_ms(lambda: captured.router.attend(q, k, v, mask, None), 5)
    speedup = own_attention / natsim_attention
    calls = record["attention_calls"] = captured.calls
    del captured, q, k, v, mask

    nd.remove(model)
    record["compiled"] = "repeated blocks" if model._repeated_blocks else "whole model"
    own_compiled_ms, _, record["own_graph_break"] = compiled_step_ms(model, args, steps)
    nd.apply(model, **options, keep_own=False)
    natsim_compiled_ms, compiled_out, record["natsim_graph_break"] = compiled_step_ms(model, args, steps)
    if record["tile_order"] is not None:  # the same plan with every call permuting its tokens (no model order)
        nd.remove(model)
        nd.apply(model, **options, tile_order=False, keep_own=False)
        record["natsim_compiled_row_major_step_ms"], _, _ = compiled_step_ms(model, args, steps)
    share = min(1.0, calls * own_attention / own_ms)
    share_compiled = min(1.0, calls * own_attention / own_compiled_ms)

    def ceiling(a: float) -> float:
        return 1 / ((1 - a) + a / speedup)

    record.update(
        own_step_ms=own_ms, natsim_step_ms=natsim_ms, step_speedup=own_ms / natsim_ms,
        own_compiled_step_ms=own_compiled_ms, natsim_compiled_step_ms=natsim_compiled_ms,
        compiled_step_speedup=own_compiled_ms / natsim_compiled_ms,
        attention_share=share, attention_share_compiled=share_compiled,
        own_attention_ms=own_attention, natsim_attention_ms=natsim_attention, attention_speedup=speedup,
        ceiling=ceiling(share), ceiling_compiled=ceiling(share_compiled),
        compiled_output_relative_difference=float((compiled_out.float() - own_out.float()).norm()
                                                  / own_out.float().norm()),
    )
    record["fraction_of_ceiling"] = record["step_speedup"] / record["ceiling"]
    record["fraction_of_ceiling_compiled"] = record["compiled_step_speedup"] / record["ceiling_compiled"]
    return record


def fresh() -> None:
    """Forget the previous case: Dynamo's compiled code (each case compiles as in a fresh process, static
    shapes) and the GPU memory it held."""
    torch._dynamo.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def run_header(kind: str, out: Path) -> tuple[dict, Path]:
    """A diffusers benchmark's result record (device, versions, date, no records yet) and where it is written:
    `out/diffusers-<kind>-<device>-<date>.json`."""
    import diffusers
    import triton

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, diffusers=diffusers.__version__,
                  date=datetime.date.today().isoformat(), records=[])
    return result, out / f"diffusers-{kind}-{device.replace(' ', '_')}-{result['date']}.json"


def graph(record: dict) -> str:
    """How the compiled steps traced: "full" (fullgraph), else whose step broke the graph."""
    broken = [who for who in ("own", "natsim") if record[f"{who}_graph_break"]]
    return "full" if not broken else "+".join(broken) + " breaks"


def print_table(records: list) -> None:
    print(f"\n{'case':20s} {'share e/c':>10s} {'attn x':>7s} {'eager x':>8s} {'ceil':>6s} {'own c ms':>9s} "
          f"{'compiled x':>10s} {'ceil':>6s} {'of ceil':>8s} {'diff':>8s} {'backend':>8s} {'graph':>13s} "
          f"{'order ms / row-major ms':>24s}")
    for r in records:
        ordered = (f"{r['natsim_compiled_step_ms']:.1f} / {r['natsim_compiled_row_major_step_ms']:.1f}"
                   if r["tile_order"] is not None else "-")
        print(f"{r['case']:20s} {r['attention_share']:.2f}/{r['attention_share_compiled']:.2f} "
              f"{r['attention_speedup']:7.2f} {r['step_speedup']:8.2f} {r['ceiling']:6.2f} "
              f"{r['own_compiled_step_ms']:9.1f} {r['compiled_step_speedup']:10.2f} {r['ceiling_compiled']:6.2f} "
              f"{r['fraction_of_ceiling_compiled']:8.2f} {r['output_relative_difference']:8.1e} "
              f"{r['plan']['backend']:>8s} {graph(r):>13s} {ordered:>24s}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--cases", help=f"comma-separated, from {', '.join(CASES)} (default: all)")
    parser.add_argument("--group", choices=GROUPS, help="a group of cases that runs in about 8 minutes on one H100: "
                        + "; ".join(f"{name}: {', '.join(cases)}" for name, cases in GROUPS.items()))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU (a smoke test of the script)")
    args = parser.parse_args(argv)
    if args.cases and args.group:
        parser.error("give --cases or --group, not both")
    names = GROUPS[args.group] if args.group else args.cases.split(",") if args.cases else list(CASES)
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"no case {', '.join(unknown)}; the cases: {', '.join(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    result, path = run_header(f"step-{args.group}" if args.group else "step", args.out)
    for name in names:
        fresh()
        record = run_case(name, args.steps, args.small)
        print(json.dumps(record), flush=True)
        result["records"].append(record)
        path.write_text(json.dumps(result, indent=1))
    print_table(result["records"])


if __name__ == "__main__":
    main()
