"""Run every self-attention of a diffusers video transformer through natsim: a GNA Plan, or a content-adaptive
mask predicted per layer and step.

    pip install diffusers
    python examples/diffusers_processor.py

Both processors are drop-in attention processors for the self-attention (`attn1`) of diffusers'
`WanTransformer3DModel`, with diffusers' call convention `processor(attn, hidden_states,
encoder_hidden_states=None, attention_mask=None, rotary_emb=None)`: they do what the model's own processor
does (projections, RMS norms, rotary embedding, output projection) and compute the attention differently.
Video tokens in Wan are the patches of the latent in row-major (frames, height, width) order, which is
natsim's token layout.

- `GNAWanAttnProcessor`: attention with `plan(q, k, v)`, a GNA plan from `natsim.planner.best`.
- `MaskedWanAttnProcessor`: per layer and diffusion step, a mask predictor (e.g. natsim.masks.topp on
  Hilbert-ordered tokens) gives a block mask; `natsim.masks.MaskCache` decides when to predict again and
  keeps the first steps dense (its `dense_fraction`); the layer's first mask is planned with
  `natsim.planner.best_mask` (granularity and merge), and every later mask of that layer runs with that plan.
  A `StepClock` shared by the processors tells them the step (the denoising loop sets it).

The demo builds a tiny Wan transformer from its config with random weights (nothing is downloaded),
checks that with a window covering the whole layout the GNA processor reproduces the model's own dense
attention, then runs it with a sparse plan, and with masks predicted by topp. It needs diffusers and says so
when it is missing.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from natsim.planner import MaskPlan, Plan, best, best_mask


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


class StepClock:
    """The diffusion step the mask processors of one model read: the denoising loop sets `clock.step = i`
    before each forward pass (classifier-free guidance passes of one step share it)."""

    def __init__(self, step: int = 0):
        self.step = step


Predictor = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def mask_cache(num_steps: int, **options):
    """`natsim.masks.MaskCache(num_steps, **options)`: when each layer predicts its mask again."""
    import natsim.masks

    return natsim.masks.MaskCache(num_steps, **options)


class MaskedWanAttnProcessor:
    """Wan self-attention under a predicted block mask: the model's projections, norms and rotary embedding,
    then, per call (one layer, one step):

    1. tokens into `order` (default: `natsim.masks.hilbert_order(shape)`, so that a block of tokens is compact
       in the video; None keeps row-major order), only when a mask is predicted or run: dense steps attend the
       row-major tokens, since dense attention does not depend on their order;
    2. the mask: `cache.mask(key, clock.step, lambda budget: predictor(q, k, budget))` with a MaskCache (None
       means a dense step: `scaled_dot_product_attention`, as the model itself computes it), or without a
       cache `predictor(q, k, budget)` at every step. `predictor` returns a bool `[B|1, heads|1, ceil(N /
       block), ceil(N / block)]` mask of the ordered tokens;
    3. the layer's first mask is planned (`best_mask(mask, block, block, N, ..., **plan_options)`, on
       `plan_device`'s cost model) and every mask of the layer runs with that plan (pooled to its blocks, its
       host work prepared once per new mask); when that plan predicts no gain over dense attention through
       the kernel (`plan.predicted_speedup <= min_speedup`, default 1: the pooled mask keeps nearly every block),
       the layer runs dense attention instead (`fallbacks` counts those calls; `min_speedup=0` always runs
       the plan);
    4. tokens back to row-major order (after a sparse step) and the output projection.

    q, k, v go to the kernel in `dtype` (default: the model's when it is fp16 or bf16, else fp16); counts of
    the calls, the dense steps and the predictions, and the planning time, are kept for reports.
    """

    def __init__(self, shape, predictor: Predictor, *, key=0, clock: Optional[StepClock] = None, cache=None,
                 budget: float = 0.3, block: int = 16, order="hilbert", dtype: Optional[torch.dtype] = None,
                 plan_device=None, plan_options: Optional[dict] = None, min_speedup: float = 1.0):
        import natsim.masks

        self.shape = tuple(int(s) for s in shape)
        self.predictor, self.key, self.cache, self.budget, self.block = predictor, key, cache, budget, block
        self.clock = clock if clock is not None else StepClock()
        self.order = natsim.masks.hilbert_order(self.shape) if isinstance(order, str) and order == "hilbert" else order
        self._orders: dict = {}  # device -> (order, its inverse) as index tensors there, made once
        self.dtype, self.plan_device, self.plan_options = dtype, plan_device, dict(plan_options or {})
        self.min_speedup = float(min_speedup)
        self.plan: Optional[MaskPlan] = None
        self.plan_seconds = 0.0
        self._running: Optional[MaskPlan] = None  # the plan holding the mask in use
        self._mask: Optional[torch.Tensor] = None
        self.calls = self.dense_calls = self.predictions = self.fallbacks = 0

    def _predict(self, q: torch.Tensor, k: torch.Tensor, budget: float) -> torch.Tensor:
        self.predictions += 1
        return self.predictor(q, k, budget)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention of row-major `[B, N, heads, head_dim]` tensors in the model's dtype: dense steps as the model
        computes them (on row-major tokens: dense attention does not depend on their order), sparse ones on
        tokens in `order`, in the kernel's dtype. Tokens are reordered only when a mask is predicted or run."""
        import natsim.masks

        dtype = self.dtype or (query.dtype if query.dtype in (torch.float16, torch.bfloat16) else torch.float16)
        order, inverse = self._device_orders(query.device)
        ordered: dict = {}

        def in_order(name: str, t: torch.Tensor) -> torch.Tensor:  # each tensor reordered once per call
            if name not in ordered:
                ordered[name] = (t if order is None else natsim.masks.to_order(t, order)).to(dtype)
            return ordered[name]

        def predict(budget: float) -> torch.Tensor:
            return self._predict(in_order("q", query), in_order("k", key), budget)

        mask = predict(self.budget) if self.cache is None else self.cache.mask(self.key, self.clock.step, predict)
        if mask is not None and self.plan is None:
            start = time.perf_counter()
            kernel_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16  # recorded only
            self.plan = best_mask(mask, self.block, self.block, query.shape[1], heads=query.shape[2],
                                  batch=query.shape[0], head_dim=query.shape[3], dtype=kernel_dtype,
                                  device=self.plan_device, keep_mask=False, **self.plan_options)
            self.plan_seconds = time.perf_counter() - start
        if mask is None or self.plan.predicted_speedup <= self.min_speedup:  # a dense step, or no gain
            self.dense_calls += 1
            self.fallbacks += mask is not None
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)))
            return out.transpose(1, 2)
        if mask is not self._mask:  # a new mask: pool it once, its host work is prepared on first use
            self._running, self._mask = self.plan.with_mask(mask), mask
        out = self._running(in_order("q", query), in_order("k", key), in_order("v", value))
        return out if inverse is None else natsim.masks.to_order(out, inverse)  # back to row-major order

    def _device_orders(self, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The token order and its inverse as index tensors on `device` (copied there once, not per call);
        None, None without an order."""
        import natsim.masks

        if self.order is None:
            return None, None
        if device not in self._orders:
            order = torch.as_tensor(self.order, dtype=torch.int64).cpu()
            self._orders[device] = (order.to(device), torch.as_tensor(natsim.masks.hilbert_inverse(order.numpy()),
                                                                      dtype=torch.int64).to(device))
        return self._orders[device]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("MaskedWanAttnProcessor serves self-attention only (no encoder states, no mask).")
        batch, tokens, _ = hidden_states.shape
        if tokens != math.prod(self.shape):
            raise ValueError(
                f"the processor is for a layout of {math.prod(self.shape)} tokens {self.shape}, got {tokens} "
                "tokens; make one per latent size."
            )
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        out = self._attend(query, key, value)
        self.calls += 1
        out = out.reshape(batch, tokens, -1).type_as(hidden_states)
        return attn.to_out[1](attn.to_out[0](out))


def use_masks(model, shape, predictor: Predictor, *, cache=None, clock: Optional[StepClock] = None,
              **options) -> list[MaskedWanAttnProcessor]:
    """Give every block's self-attention of a Wan transformer a MaskedWanAttnProcessor (key = the block's index),
    all sharing `cache` and `clock`; `options` go to each processor."""
    clock = clock if clock is not None else StepClock()
    processors = []
    for index, block in enumerate(model.blocks):
        processor = MaskedWanAttnProcessor(shape, predictor, key=index, clock=clock, cache=cache, **options)
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

    import natsim.masks

    model = tiny_wan()
    topp = lambda q, k, budget: natsim.masks.topp(q, k, 16, 16, 0.9)  # noqa: E731 (p fixed; budget unused)
    processors = use_masks(model, layout, topp, dtype=dtype)
    with torch.no_grad():
        masked = model(**inputs)[0]
    print(
        f"topp masks (p 0.9, Hilbert order), planned at {processors[0].plan.q_block}x{processors[0].plan.kv_block} "
        f"merge {processors[0].plan.merge}: output differs from dense attention by "
        f"{float((masked - own).norm() / own.norm()):.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
