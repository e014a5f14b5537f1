"""natsim.integrations.diffusers: natsim's attention inside a diffusers transformer, in one call. `apply(transformer,
sparsity=0.9)` routes its video (or image) attention through GNA planned once per latent size, `apply(transformer,
masks=Masks(steps=50))` through content-adaptive masks; `remove(transformer)` restores the model's own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from natsim.kernels import unregister_attention
from natsim.planner import AutoPlan, CostModel
from natsim.problem import BoolOrBools, IntOrInts

from . import parallel
from .attention import Router
from .masks import MaskedAttention, Masks
from .order import ModelOrder, check_tile_order
from .processors import release, routed_processor
from .registry import SPECS, register, spec_of, unregister
from .spec import Call, ModelSpec, Tokens, set_processor

__all__ = ["apply", "remove", "Masks", "SUPPORTED_MODELS", "Applied", "register", "unregister", "ModelSpec", "Call",
           "Tokens"]

SUPPORTED_MODELS = tuple(SPECS)


@dataclass
class Applied:
    """What `apply` did to one model: the router (its `auto.plans` holds a plan per layout met so far), the
    model's own processors, the forward pre-hook that tells the router each call's layout, and the whole-model
    tile order's state where the model may keep one (`order.decided`: the order per layout, None where none)."""

    router: Router
    originals: dict
    hook: torch.utils.hooks.RemovableHandle
    order: Optional[ModelOrder] = None

    @property
    def plans(self) -> dict:
        """The plans made so far: GNA plans per (layout, heads, head_dim, dtype, device), or with masks the mask
        plans per (layout, batch, heads, head_dim, dtype, device)."""
        return self.router.plans if self.router.masked is None else self.router.masked.plans

    @property
    def verdicts(self) -> dict:
        """natsim's call against the model's own, per (layout, heads, head_dim, dtype, device) met so far
        (`natsim.planner.Verdict`: `serves`, the priced seconds, `explain()`); a split attention's in its view's."""
        verdicts = dict(self.router.verdicts)
        for view in self.router.views:
            verdicts.update(view.verdicts)
        return verdicts

    @property
    def masked(self) -> Optional[MaskedAttention]:
        """The content-adaptive masks' run-time state (`stats`, `cache`, `reset()`), or None for GNA."""
        return self.router.masked


def apply(
    transformer: nn.Module,
    sparsity: Optional[float] = None,
    *,
    masks: Optional[Masks] = None,
    layout: Optional[IntOrInts] = None,
    dtype: Optional[torch.dtype] = None,
    window: Optional[IntOrInts] = None,
    max_stride: Optional[IntOrInts] = None,
    causal: BoolOrBools = False,
    device: Union[None, str, torch.device] = None,
    cost_model: Optional[CostModel] = None,
    training: bool = False,
    precision: Optional[str] = None,
    tile_order: Optional[bool] = None,
    keep_own: bool = True,
) -> Applied:
    """Route `transformer`'s video attention through GNA at `sparsity` (default 0.9, or any that `window`
    reaches when a window is given), or through content-adaptive `masks` (masks.py: eager or regional
    compilation); returns an `Applied`.

    The token layout of every call comes from the latent and the model's patch sizes (`layout` fixes it: FLUX
    under a whole-model `torch.compile`, which cannot read its img_ids). Each new layout is planned on its
    first call with `natsim.planner.best(layout, sparsity, window=..., max_stride=..., causal=..., device=...,
    cost_model=..., training=...)` and the plan is kept; calls go through the registered operator
    `natsim::gna_resolved`, so `torch.compile(transformer, fullgraph=True)` and `compile_repeated_blocks`
    compile once per latent size and CUDA graphs replay it. `dtype` is the kernel's dtype for a float32
    model (default bfloat16). Joint attention (HunyuanVideo, CogVideoX, FLUX): video queries attend their
    GNA window and every text key; text queries attend every key (natsim.integrations.diffusers.attention).
    `precision="fp8"` runs the video self-attention in FP8 (GNA plans made with `precision="fp8"`, mask plans
    likewise; inference only), while text attention, dense warm-up steps and joint attention's text part stay
    in the model's dtype. `training=True` with `masks` trains through the masks: each call's backward
    recomputes the attention its forward decided on (same mask, dense or sparse choice and token order) and
    differentiates it; the masks are predicted under no_grad (not differentiated), and every forward pass is a
    fresh sample: one step of the masks' schedule (cycling), its masks predicted for it, the timestep not read
    (masks.py). Refused with a sentence: `training=True` with FP8 (its kernels have no backward pass: train in
    bfloat16), and a precision other than None or "fp8" ("auto" too for GNA: FP8 on the layouts where its plan is
    predicted faster, natsim.planner.best).
    `tile_order`: whether the model keeps its video tokens in the GNA plan's tile order from its first block to
    its last (natsim.integrations.diffusers.order: no permutation per attention call): None where the plan runs
    on FlashAttention-4 or the Gluon FP8 kernel and its tile divides the layout, True wherever the tile divides
    the layout (refused with a sentence for models natsim does not know the blocks of), False never.
    `keep_own`: on a layout where natsim's call is predicted slower than the model's own dense attention, the
    host's time to issue each call included (`natsim.planner.AutoPlan.verdict`: an image model's few thousand
    tokens, where a compiled step waits on the host), the model keeps its own attention there and a warning says
    so once per layout (`Applied.verdicts`); False routes every layout through natsim. Nothing is kept where no
    cost model prices the GPU, nor for content-adaptive masks (their plans decide dense calls themselves).

    Under diffusers' context parallelism (`transformer.enable_parallelism(config=ContextParallelConfig(
    ulysses_degree=P))`, before or after `apply`), each rank runs natsim's attention on its `heads / P` heads over
    the whole layout (natsim.integrations.diffusers.parallel); what natsim cannot run there (ring attention,
    uneven shares, split attention, `tile_order=True`) is refused with a sentence at whichever call comes second.
    """
    transformer = _unwrapped(transformer)
    spec = spec_of(transformer)
    if hasattr(transformer, "_natsim"):
        raise ValueError("natsim is already applied to this transformer: call remove(transformer) first.")
    if layout is not None:
        layout = (layout,) if isinstance(layout, int) else tuple(int(n) for n in layout)
    masked = None
    if masks is not None:
        if sparsity is not None or window is not None:
            raise ValueError("masks replaces GNA: pass masks=... or sparsity / window, not both.")
        auto, masked = None, MaskedAttention(masks, dtype, precision, training)
    else:
        if sparsity is None:
            sparsity = 0.9 if window is None else 0.0
        auto = AutoPlan(sparsity, causal=causal, window=window, max_stride=max_stride, device=device,
                        cost_model=cost_model, training=training, precision=precision)
    points = check_tile_order(tile_order, transformer, masked is not None)
    router = Router(auto, spec.text_first, dtype, masked, keep_own)
    originals = {}
    routes = spec.routes(transformer, router)
    heads = int(routes[0][0].heads)  # the routed attention's, which the verdicts and the tile order plan for
    head_dim = int(routes[0][0].inner_dim) // heads
    parallel.enable(transformer, router, tile_order)  # refuses what it cannot run before the model changes
    for attention, attention_router in routes:
        originals[attention] = attention.processor
        set_processor(attention, routed_processor(attention.processor, attention_router))
    order = None if points is None else ModelOrder(transformer, points, router, heads, head_dim, bool(tile_order))

    def tell_layout(model, args, kwargs):
        router.set_layout(*spec.tokens(model, args, kwargs, layout), joint=spec.joint_tokens(args, kwargs))
        parameter = next(model.parameters())
        dtype, device = router.kernel_dtype(parameter), parameter.device
        router.decide(heads, head_dim, dtype, device, router.outside)
        if order is not None:
            order.begin(dtype, device)
        if masked is not None:
            masked.begin_forward(router.layout, spec.timestep(args, kwargs))

    hook = transformer.register_forward_pre_hook(tell_layout, with_kwargs=True)
    applied = Applied(router, originals, hook, order)
    transformer._natsim = applied
    return applied


def remove(transformer: nn.Module) -> None:
    """Give `transformer` its own attention processors back and forget its plans."""
    transformer = _unwrapped(transformer)
    applied: Optional[Applied] = getattr(transformer, "_natsim", None)
    if applied is None:
        raise ValueError("natsim is not applied to this transformer (apply(transformer, ...) was not called).")
    for attention, processor in applied.originals.items():
        routed = attention.processor
        release(routed)
        if "_parallel_config" in vars(routed):  # set by enable_parallelism while natsim was applied (the class has None)
            processor._parallel_config = routed._parallel_config
        set_processor(attention, processor)
    parallel.disable(transformer)
    if applied.masked is not None:
        unregister_attention(applied.masked.id)  # its masks and plans, on the model's device, go with it
    applied.hook.remove()
    if applied.order is not None:
        applied.order.remove()
    del transformer._natsim


def _unwrapped(transformer: nn.Module) -> nn.Module:
    """The model a `torch.compile` wrapper (`OptimizedModule`) holds, or `transformer` itself: natsim routes the
    model's modules and hooks its forward, which the wrapper's compiled calls run, so `apply` and `remove` take the
    wrapper or the model alike. (No wrapper exists before torch._dynamo is imported, which takes a second or two:
    it is not imported for this.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(transformer, eval_frame.OptimizedModule):
        return transformer._orig_mod
    return transformer
