"""A Wan 2.1 1.3B-sized video transformer with random weights over 10 denoising steps: SDPA against predicted
masks (end to end), one run, one JSON:

    python benchmarks/video_model.py --out benchmarks/results [--steps 10] [--layers 30] [--predictor topp --p 0.8]
    python benchmarks/video_model.py --small --no-cache        # CPU, seconds

The model is built here, not loaded (no weights are downloaded, and diffusers need not be installed): Wan 2.1's
block stack at the 1.3B size (30 blocks, width 1536, 12 heads of 128, FFN 8960, 512 text tokens of width 4096)
with PyTorch's default random initialisation, on a 480p latent (16 x 21 x 60 x 104, patches 1 x 2 x 2: 21 x 30 x
52 = 32,760 tokens). A block is Wan's: adaptive LayerNorm modulation from the timestep (6 x width per block),
self-attention with RMS-normalised q and k and a 3-D rotary embedding, cross-attention to the text, a GELU FFN.
Its self-attention modules have the attributes diffusers' attention processors use (`to_q`, `to_k`, `to_v`,
`norm_q`, `norm_k`, `to_out`, `heads`, `set_processor`), so the processors of examples/diffusers_processor.py
run on it unchanged:
- dense: the model's own processor, `scaled_dot_product_attention` (the cuDNN backend on the GPU);
- masked: `MaskedWanAttnProcessor`: the predictor (natsim.masks; default topp p=0.8 at 16-token blocks of
  Hilbert-ordered tokens) per layer, `natsim.masks.MaskCache(steps)` (dense warm-up steps, mask reuse, the
  budget per step; `--no-cache` predicts at every step instead), one `best_mask` plan per layer.
The denoising loop is a plain Euler flow-matching loop over `steps` timesteps from the same noise and text.
Figures: time per step (wall clock around each step's forward pass, synchronised), the planning time, the
relative difference of the final latent and of the first masked step's prediction to the dense run, and what
the processors did (dense steps, predictions, plans chosen).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WAN_1_3B = dict(dim=1536, heads=12, ffn_dim=8960, layers=30, text_dim=4096, text_tokens=512, channels=16)
SMALL = dict(dim=256, heads=2, ffn_dim=512, layers=2, text_dim=64, text_tokens=16, channels=16)
LATENT_480P = (21, 60, 104)  # latent frames, height, width (patched by 1 x 2 x 2)
LATENT_SMALL = (4, 16, 16)
PATCH = (1, 2, 2)


def load_example():
    """examples/diffusers_processor.py as a module (its processors; diffusers is imported only by its demo)."""
    spec = importlib.util.spec_from_file_location("diffusers_processor", ROOT / "examples" / "diffusers_processor.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -- the model ------------------------------------------------------------------------------------------------


class SdpaProcessor:
    """The model's own self-attention: projections, RMS norms, rotary embedding, scaled_dot_product_attention
    (cuDNN on the GPU), output projection."""

    def __init__(self, rotate):
        self.rotate = rotate

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        q, k = self.rotate(q, *rotary_emb), self.rotate(k, *rotary_emb)
        args = [t.transpose(1, 2) for t in (q, k, v)]
        if q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(*args)
        else:
            out = F.scaled_dot_product_attention(*args)
        out = out.transpose(1, 2).flatten(2)
        return attn.to_out[1](attn.to_out[0](out))


class SelfAttention(nn.Module):
    """Wan's self-attention module, with the attributes diffusers' processors read."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.processor = None

    def set_processor(self, processor) -> None:
        self.processor = processor

    def forward(self, x: torch.Tensor, rotary_emb) -> torch.Tensor:
        return self.processor(self, x, rotary_emb=rotary_emb)


class CrossAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        q = self.norm_q(self.to_q(x)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        k = self.norm_k(self.to_k(text)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        v = self.to_v(text).unflatten(2, (self.heads, -1)).transpose(1, 2)
        return self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Block(nn.Module):
    """One Wan block: modulated self-attention, cross-attention to the text, modulated FFN."""

    def __init__(self, dim: int, heads: int, ffn_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attn1 = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn2 = CrossAttention(dim, heads)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x, text, temb, rotary_emb):
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + temb).chunk(6, dim=1)
        h = (self.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        x = x + (self.attn1(h, rotary_emb) * gate).type_as(x)
        x = x + self.attn2(self.norm2(x), text)
        h = (self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return x + (self.ffn(h) * c_gate).type_as(x)


class VideoDiT(nn.Module):
    """Patch embedding, timestep and text embeddings, the blocks, and the output head of Wan 2.1."""

    def __init__(self, dim, heads, ffn_dim, layers, text_dim, text_tokens, channels):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.patch = nn.Conv3d(channels, dim, PATCH, stride=PATCH)
        self.time_mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.text_mlp = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, ffn_dim) for _ in range(layers))
        self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, channels * math.prod(PATCH))
        self.channels = channels

    def rotary(self, layout, device):
        """Wan's (cos, sin) `[1, N, 1, head_dim]`: each channel pair's angle repeated on both of its channels."""
        head_dim = self.dim // self.heads
        hw = 2 * (head_dim // 6)
        parts = (head_dim - 2 * hw, hw, hw)
        coords = torch.stack(torch.meshgrid(*(torch.arange(s, device=device) for s in layout), indexing="ij"))
        coords = coords.reshape(3, -1).float()
        angles = torch.cat([coords[a][:, None] * 10000.0 ** (-torch.arange(0, p, 2, device=device).float() / p)
                            for a, p in enumerate(parts)], dim=-1).repeat_interleave(2, dim=-1)
        return angles.cos()[None, :, None], angles.sin()[None, :, None]

    def forward(self, latent, t, text):
        batch, _, frames, height, width = latent.shape
        layout = (frames // PATCH[0], height // PATCH[1], width // PATCH[2])
        x = self.patch(latent).flatten(2).transpose(1, 2)
        half = 128
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=latent.device) / half)
        sinusoid = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=-1).to(x.dtype)
        temb = self.time_mlp(sinusoid)
        modulation = self.time_proj(temb).unflatten(1, (6, self.dim)).float()
        context = self.text_mlp(text)
        rotary = self.rotary(layout, latent.device)
        for block in self.blocks:
            x = block(x, context, modulation, rotary)
        x = self.proj_out(self.norm_out(x.float()).type_as(x))
        x = x.view(batch, *layout, self.channels, *PATCH).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(batch, self.channels, frames, height, width)


# -- the runs -----------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def denoise(model, noise, text, steps: int, clock=None):
    """Euler flow matching from t = 1000 to 0: the final latent, each step's seconds, the first prediction of
    each step."""
    x = noise
    times, predictions = [], []
    grid = torch.linspace(1000.0, 0.0, steps + 1, device=noise.device)
    with torch.no_grad():
        for i in range(steps):
            if clock is not None:
                clock.step = i
            sync(noise.device)
            start = time.perf_counter()
            velocity = model(x, grid[i : i + 1], text)
            sync(noise.device)
            times.append(time.perf_counter() - start)
            predictions.append(velocity)
            x = x + (grid[i + 1] - grid[i]) / 1000.0 * velocity
    return x, times, predictions


def make_predictor(name: str, block: int, p: float, cdf: float):
    import natsim.masks

    function = getattr(natsim.masks, name, None)
    if function is None:
        raise SystemExit(f"natsim.masks has no {name!r} yet (it comes with the mask predictors' change); use --predictor topp.")
    if name == "topp":
        return lambda q, k, budget: function(q, k, block, block, p)
    if name == "sparge":
        return lambda q, k, budget: function(q, k, block, block, cdf=cdf)
    if name == "hierarchical":
        return lambda q, k, budget: function(q, k, block, block, keep=budget)
    raise SystemExit(f"--predictor must be topp, sparge or hierarchical, got {name!r}.")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for video_model.json")
    parser.add_argument("--small", action="store_true", help="a 2-block model on a small latent on the CPU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=None, help="blocks (default 30; --small 2)")
    parser.add_argument("--predictor", default="hierarchical",
                        help="hierarchical (keeps the cache's budget of KV blocks: DFSAttn's setup, the default), "
                             "topp (knob --p) or sparge (--cdf)")
    parser.add_argument("--p", type=float, default=0.8)
    parser.add_argument("--cdf", type=float, default=0.9)
    parser.add_argument("--block", type=int, default=64,
                        help="tokens per mask block of the predictor (hierarchical scores it from 16-token sub-blocks)")
    parser.add_argument("--no-cache", action="store_true", help="predict at every step, no dense steps (no MaskCache)")
    parser.add_argument("--dense-fraction", type=float, default=0.25, help="MaskCache's dense warm-up share of steps")
    parser.add_argument("--plan-merges", default="none,consecutive", help="merges best_mask scores per layer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    example = load_example()
    if args.small:
        config, latent_shape, device, dtype = dict(SMALL), LATENT_SMALL, torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/video_model.py needs a CUDA GPU; use --small for the CPU run.")
        config, latent_shape, device, dtype = dict(WAN_1_3B), LATENT_480P, torch.device("cuda"), torch.bfloat16
    if args.layers is not None:
        config["layers"] = args.layers
    layout = tuple(s // p for s, p in zip(latent_shape, PATCH))
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = VideoDiT(**config).to(dtype).eval()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    noise = torch.randn((1, config["channels"], *latent_shape), generator=generator, device=device, dtype=dtype)
    text = torch.randn((1, config["text_tokens"], config["text_dim"]), generator=generator, device=device, dtype=dtype)

    dense = SdpaProcessor(example.rotate)
    for block in model.blocks:
        block.attn1.set_processor(dense)
    with torch.no_grad():
        model(noise, torch.tensor([1000.0], device=device), text)  # warm-up: kernels chosen, memory allocated
    dense_out, dense_times, dense_predictions = denoise(model, noise, text, args.steps)

    predictor = make_predictor(args.predictor, args.block, args.p, args.cdf)
    cache = None if args.no_cache else example.mask_cache(args.steps, dense_fraction=args.dense_fraction)
    clock = example.StepClock()
    merges = [m.strip() for m in args.plan_merges.split(",") if m.strip()]
    processors = example.use_masks(model, layout, predictor, cache=cache, clock=clock, block=args.block,
                                   plan_device=None if device.type == "cuda" else "h100",
                                   dtype=None if device.type == "cuda" else torch.float32,
                                   plan_options={"merges": merges})
    masked_out, masked_times, masked_predictions = denoise(model, noise, text, args.steps, clock)

    planning = sum(p.plan_seconds for p in processors)
    plans = Counter(f"{p.plan.q_block}x{p.plan.kv_block} {p.plan.merge}" for p in processors if p.plan is not None)
    densities = [p.plan.chosen.density for p in processors if p.plan is not None]
    warm_up = processors[0].dense_calls - processors[0].fallbacks  # the cache's dense steps
    first_sparse = next((i for i in range(args.steps) if warm_up <= i), None)
    import triton

    record = {
        "benchmark": "video_model",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "model": {**config, "latent": list(latent_shape), "layout": list(layout),
                                                 "tokens": math.prod(layout), "dtype": str(dtype).replace("torch.", ""),
                                                 "weights": "random (PyTorch default init)"},
        "steps": args.steps, "predictor": args.predictor, "p": args.p, "cdf": args.cdf, "block": args.block,
        "cache": None if cache is None else {"class": type(cache).__name__, "dense_fraction": args.dense_fraction},
        "plan_merges": merges,
        "dense_step_s": dense_times, "masked_step_s": masked_times,
        "dense_total_s": sum(dense_times), "masked_total_s": sum(masked_times), "planning_s": planning,
        "speedup_total": sum(dense_times) / sum(masked_times),
        "speedup_total_without_planning": sum(dense_times) / max(sum(masked_times) - planning, 1e-12),
        "dense_calls": processors[0].dense_calls - processors[0].fallbacks,
        "dense_fallback_layers": sum(p.fallbacks > 0 for p in processors), "predictions_per_layer": processors[0].predictions,
        "plans": dict(plans), "planned_density_mean": statistics.fmean(densities) if densities else None,
        "final_latent_rel_diff": rel(masked_out, dense_out),
        "first_masked_step": first_sparse,
        "first_masked_prediction_rel_diff": None if first_sparse is None
        else rel(masked_predictions[first_sparse], dense_predictions[first_sparse]),
    }
    print(f"{'step':>4s} {'dense s':>9s} {'masked s':>9s}")
    for i, (a, b) in enumerate(zip(dense_times, masked_times)):
        print(f"{i:4d} {a:9.4f} {b:9.4f}")
    print(f"total: dense {record['dense_total_s']:.3f} s, masked {record['masked_total_s']:.3f} s "
          f"(planning {planning:.3f} s): {record['speedup_total']:.2f}x, {record['speedup_total_without_planning']:.2f}x "
          f"without planning; plans {dict(plans)}; final latent differs by {record['final_latent_rel_diff']:.3e}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / ("video_model_small.json" if args.small else "video_model.json")
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
