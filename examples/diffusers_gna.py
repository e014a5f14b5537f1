"""natsim inside a diffusers video transformer: GNA planned per latent size, or content-adaptive masks, one call.

    pip install diffusers
    python examples/diffusers_gna.py

A small Wan transformer is built from its config with random weights (nothing is downloaded); with your model,
`transformer = pipe.transformer` (or `WanTransformer3DModel.from_pretrained(...)`) is all that changes. Under
`transformer.compile_repeated_blocks(fullgraph=True)` or `torch.compile(transformer, fullgraph=True)` the same
lines compile once per latent size.
"""

from __future__ import annotations

import importlib.util
import sys

import torch


def tiny_wan():
    """A two-block Wan transformer with random weights (2 heads of 32 channels)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                                 rope_max_seq_len=32).eval()


def step(transformer, latent: torch.Tensor, timestep: float) -> torch.Tensor:
    """One denoising forward pass on a latent `[1, 4, frames, height, width]` with random text states."""
    text = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return transformer(hidden_states=latent, timestep=torch.tensor([int(timestep)]), encoder_hidden_states=text,
                           return_dict=False)[0]


def main() -> int:
    if importlib.util.find_spec("diffusers") is None:
        print("This example needs diffusers: pip install diffusers", file=sys.stderr)
        return 0
    from natsim.integrations import diffusers as nd

    transformer = tiny_wan()
    latent = torch.randn(1, 4, 4, 16, 16, generator=torch.Generator().manual_seed(0))  # tokens 4 x 8 x 8

    applied = nd.apply(transformer, sparsity=0.5, dtype=torch.float16)  # GNA: at least half the pairs skipped
    step(transformer, latent, 900)
    for (layout, heads, head_dim, dtype, device), plan in applied.plans.items():
        print(f"GNA on layout {layout}: window {plan.problem.window}, stride {plan.problem.stride}, "
              f"sparsity {plan.sparsity:.2f}")
    nd.remove(transformer)  # the model's own attention again

    applied = nd.apply(transformer, masks=nd.Masks(steps=4, block=16), dtype=torch.float16)
    for i, timestep in enumerate((900, 700, 500, 300)):  # a short denoising run
        latent = latent - step(transformer, latent, timestep) / 4
    stats = applied.masked.stats
    print(f"masks over 4 steps: {stats.calls} attention calls, {stats.dense_calls} dense (warm-up), "
          f"{stats.predictions} masks predicted")
    nd.remove(transformer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
