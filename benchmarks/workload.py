"""A synthetic video-attention workload: q, k, v whose attention looks like a video DiT's, without weights.

Real video DiTs attend mostly to nearby tokens and to tokens of similar content, with heads that differ in
sharpness, and a few tokens that every query attends (attention sinks, text-like global tokens). This module
builds q, k, v with those properties from seeded random numbers, at any layout, head count and head_dim, on
the CPU (small layouts) or the GPU (Wan 2.1 480p: 21x30x52 = 32,760 tokens; HunyuanVideo: 30x48x80 = 115,200):

1. Content. Per head, a shared field `c` over frames x height x width: Gaussian noise low-pass filtered by a
   separable Gaussian blur (standard deviation `smoothness` tokens along height and width, `smoothness_t`
   along frames; edges replicate), each channel normalised to zero mean and unit variance. Nearby tokens have
   similar content, far ones nearly independent content.
2. q and k are the content plus independent white noise of relative weight `noise`:
   `q = (c + noise * n_q) / sqrt(1 + noise^2)`, `k` likewise with its own noise, so q_i . k_j is large where
   the content at i and j is alike: a smooth, mostly local, content-dependent attention pattern.
3. 3-D rotary position embedding as Wan applies it: head_dim split into frame, height and width parts
   (`head_dim - 4 * (head_dim // 6)`, `2 * (head_dim // 6)`, `2 * (head_dim // 6)` channels), each rotating
   consecutive channel pairs by the token's coordinate times the frequencies `10000^(-2i / part)`.
4. Per-head temperature: q of head h is scaled by `temperature[h]`, drawn log-uniformly from
   `temperatures` (sharp heads attend a few blocks, soft heads many).
5. Global tokens: `global_tokens` positions drawn at random; their keys are replaced by the head's mean query
   direction at `global_strength` times the typical key norm, so every query gives them weight.
6. v: a second smooth field (same recipe, independent noise), so the attention output is smooth too and
   errors from dropped blocks show.

Tokens are in row-major (frame, height, width) order, `[batch, N, heads, head_dim]`, as `sparse_attention`
takes them; `natsim.masks.hilbert_order(shape)` reorders them so that blocks are compact in the layout.
Everything is drawn from one `torch.Generator` seeded with `seed` on the target device: the same seed gives
the same tensors on the same device type (CPU and CUDA streams differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

LAYOUTS = {
    "small": (4, 8, 12),  # CPU tests and --small runs
    "wan480p": (21, 30, 52),  # Wan 2.1 480p latent after (1, 2, 2) patching
    "hunyuan": (30, 48, 80),  # HunyuanVideo 720p latent after patching
}
HEADS = {"small": 2, "wan480p": 12, "hunyuan": 24}  # Wan 2.1 1.3B has 12 heads, HunyuanVideo 24


@dataclass(frozen=True)
class VideoAttention:
    """q, k, v `[batch, N, heads, head_dim]` of one synthetic layer, and how they were made."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    shape: tuple[int, int, int]
    temperature: torch.Tensor  # [heads], float32
    global_tokens: torch.Tensor  # int64 token indices (row-major) whose keys every query attends
    seed: int

    @property
    def seq_len(self) -> int:
        return math.prod(self.shape)


def rope_parts(head_dim: int) -> tuple[int, int, int]:
    """Channels of head_dim rotated by frame, height and width position (Wan's split; each even)."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim must be even and at least 6 for a 3-D rotary embedding, got head_dim={head_dim}.")
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_3d(x: torch.Tensor, shape: Sequence[int], theta: float = 10000.0) -> torch.Tensor:
    """The 3-D rotary embedding of row-major tokens `x` `[B, N, H, D]` over layout `shape` (float32 math)."""
    parts = rope_parts(x.shape[-1])
    coords = torch.stack(torch.meshgrid(*(torch.arange(s, device=x.device) for s in shape), indexing="ij"))
    coords = coords.reshape(3, -1).to(torch.float32)  # [3, N]
    angles = []
    for axis, part in enumerate(parts):
        freqs = theta ** (-torch.arange(0, part, 2, device=x.device, dtype=torch.float32) / part)
        angles.append(coords[axis][:, None] * freqs[None, :])
    angle = torch.cat(angles, dim=-1)[None, :, None, :]  # [1, N, 1, D / 2]
    cos, sin = angle.cos(), angle.sin()
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def _gaussian_kernel(sigma: float, device) -> Optional[torch.Tensor]:
    if sigma <= 0:
        return None
    radius = max(1, int(math.ceil(3 * sigma)))
    t = torch.arange(-radius, radius + 1, device=device, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (t / sigma) ** 2)
    return (kernel / kernel.sum()).view(1, 1, -1)


def smooth_field(channels: int, shape: Sequence[int], sigmas: Sequence[float], generator: torch.Generator,
                 device) -> torch.Tensor:
    """`[N, channels]` float32: Gaussian noise over the layout blurred by a separable Gaussian of standard
    deviation `sigmas[axis]` tokens per axis (edges replicate), each channel normalised to mean 0, variance 1."""
    field = torch.randn((channels, *shape), generator=generator, device=device, dtype=torch.float32)
    for axis, sigma in enumerate(sigmas):
        kernel = _gaussian_kernel(sigma, device)
        if kernel is None:
            continue
        moved = field.movedim(axis + 1, -1)
        flat = moved.reshape(-1, 1, moved.shape[-1])
        pad = kernel.shape[-1] // 2
        flat = F.conv1d(F.pad(flat, (pad, pad), mode="replicate"), kernel)
        field = flat.reshape(moved.shape).movedim(-1, axis + 1)
    field = field.reshape(channels, -1)
    field = (field - field.mean(1, keepdim=True)) / field.std(1, keepdim=True).clamp(min=1e-6)
    return field.T.contiguous()


def video_qkv(
    shape: Union[str, Sequence[int]] = "small",
    heads: Optional[int] = None,
    head_dim: int = 128,
    *,
    batch: int = 1,
    smoothness: float = 3.0,
    smoothness_t: float = 1.5,
    noise: float = 0.5,
    temperatures: tuple[float, float] = (0.5, 3.0),
    global_tokens: int = 4,
    global_strength: float = 4.0,
    seed: int = 0,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> VideoAttention:
    """One synthetic attention layer over `shape` (a name of LAYOUTS or frames x height x width) with `heads`
    heads (default: HEADS of a named layout, else 2); the module docstring gives the recipe and knobs."""
    name = shape if isinstance(shape, str) else None
    if name is not None:
        if name not in LAYOUTS:
            raise ValueError(f"shape must be one of {sorted(LAYOUTS)} or frames x height x width, got shape={name!r}.")
        shape = LAYOUTS[name]
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"shape must be three positive sizes (frames, height, width), got shape={shape}.")
    heads = (HEADS.get(name, 2) if heads is None else int(heads))
    low, high = temperatures
    if not 0 < low <= high:
        raise ValueError(f"temperatures must be (low, high) with 0 < low <= high, got temperatures={temperatures}.")
    device = torch.device(device)
    n = math.prod(shape)
    generator = torch.Generator(device=device).manual_seed(seed)
    sigmas = (smoothness_t, smoothness, smoothness)
    log_t = torch.rand(heads, generator=generator, device=device) * math.log(high / low) + math.log(low)
    temperature = log_t.exp()
    picks = torch.randperm(n, generator=generator, device=device)[:global_tokens].sort().values
    q = torch.empty((batch, n, heads, head_dim), device=device, dtype=dtype)
    k, v = torch.empty_like(q), torch.empty_like(q)
    mix = 1.0 / math.sqrt(1.0 + noise * noise)
    for b in range(batch):
        for h in range(heads):  # one head at a time: the fp32 fields of one head are the peak memory
            content = smooth_field(head_dim, shape, sigmas, generator, device)
            qh = (content + noise * torch.randn(content.shape, generator=generator, device=device)) * mix
            kh = (content + noise * torch.randn(content.shape, generator=generator, device=device)) * mix
            qh = rope_3d(qh[None, :, None], shape)[0, :, 0] * temperature[h]
            kh = rope_3d(kh[None, :, None], shape)[0, :, 0]
            if global_tokens:
                direction = qh.mean(0)
                direction = direction / direction.norm().clamp(min=1e-6)
                kh[picks] = direction * (global_strength * kh.norm(dim=1).mean())
            q[b, :, h], k[b, :, h] = qh.to(dtype), kh.to(dtype)
            v[b, :, h] = smooth_field(head_dim, shape, sigmas, generator, device).to(dtype)
    return VideoAttention(q, k, v, shape, temperature.float().cpu(), picks.cpu(), seed)
