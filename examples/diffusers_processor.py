"""Run every self-attention of a diffusers video transformer through a natsim Plan.

    pip install diffusers
    python examples/diffusers_processor.py

`GNAWanAttnProcessor` is a drop-in attention processor for the self-attention (`attn1`) of diffusers'
`WanTransformer3DModel`: it does what the model's own processor does (projections, RMS norms, rotary
embedding, output projection) but computes attention with `plan(q, k, v)`. Video tokens in Wan are the
patches of the latent in row-major (frames, height, width) order, which is natsim's token layout.

The demo builds a tiny Wan transformer from its config with random weights (nothing is downloaded),
checks that with a window covering the whole layout the GNA processor reproduces the model's own dense
attention, then runs it with a sparse plan. It needs diffusers and says so when it is missing.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import torch

from natsim.planner import Plan, best


class GNAWanAttnProcessor:
    """Wan self-attention with GNA: the model's projections and rotary embedding, then `plan(q, k, v)`.

    One plan serves one token layout (latent frames x height x width after patching); q, k, v are cast
    to the plan's dtype for the kernel and the output back to the model's dtype.
    """

    def __init__(self, plan: Plan):
        self.plan = plan
        self.calls = 0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("GNAWanAttnProcessor serves self-attention only (no encoder states, no mask).")
        batch, tokens, _ = hidden_states.shape
        shape = self.plan.problem.shape
        if tokens != math.prod(shape):
            raise ValueError(
                f"the plan is for a layout of {math.prod(shape)} tokens {shape}, got {tokens} tokens; "
                "make one plan per latent size."
            )
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        q, k, v = (t.reshape(batch, *shape, attn.heads, -1).to(self.plan.torch_dtype) for t in (query, key, value))
        out = self.plan(q, k, v).reshape(batch, tokens, -1).type_as(hidden_states)
        self.calls += 1
        return attn.to_out[1](attn.to_out[0](out))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on `[B, tokens, heads, head_dim]` (interleaved pairs), as the model applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def use_gna(model, plan: Plan) -> list[GNAWanAttnProcessor]:
    """Give every block's self-attention of a `WanTransformer3DModel` a GNA processor running `plan`."""
    processors = []
    for block in model.blocks:
        processor = GNAWanAttnProcessor(plan)
        block.attn1.set_processor(processor)
        processors.append(processor)
    return processors


def tiny_wan(seed: int = 0):
    """A two-layer Wan transformer (2 heads of 32 channels) with random weights, built from its config."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    )
    return model.eval()


def tiny_inputs(frames: int = 4, height: int = 16, width: int = 16, seed: int = 1) -> dict:
    """Random latents, timestep and text states for `tiny_wan`; the token layout is (frames, h / 2, w / 2)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn((1, 4, frames, height, width), generator=generator),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn((1, 8, 32), generator=generator),
        "return_dict": False,
    }


def compare_dense(model, inputs: dict, dtype: torch.dtype = torch.float16) -> float:
    """Relative difference between the model with GNA covering the whole layout and the model as it is."""
    layout = (inputs["hidden_states"].shape[2], inputs["hidden_states"].shape[3] // 2, inputs["hidden_states"].shape[4] // 2)
    with torch.no_grad():
        own = model(**inputs)[0]
        dense = best(layout, 0.0, window=layout, heads=2, head_dim=32, dtype=dtype)
        processors = use_gna(model, dense)
        ours = model(**inputs)[0]
    if any(p.calls != 1 for p in processors):
        raise RuntimeError(f"every self-attention should run once through its plan, got {[p.calls for p in processors]}.")
    return float((ours - own).norm() / own.norm())


def main() -> int:
    if importlib.util.find_spec("diffusers") is None:
        print("This example needs diffusers: pip install diffusers", file=sys.stderr)
        return 0
    dtype = torch.float16
    inputs = tiny_inputs()
    layout = (4, 8, 8)
    print(f"window = whole layout: relative difference to the model's own attention {compare_dense(tiny_wan(), inputs, dtype):.2e}")

    model = tiny_wan()
    with torch.no_grad():
        own = model(**inputs)[0]
        plan = best(layout, 0.5, heads=2, head_dim=32, dtype=dtype)
        use_gna(model, plan)
        sparse = model(**inputs)[0]
    print(
        f"GNA window {plan.problem.window}, stride {plan.problem.stride} (sparsity {plan.sparsity:.2f}): "
        f"output differs from dense attention by {float((sparse - own).norm() / own.norm()):.2e} (random weights)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
