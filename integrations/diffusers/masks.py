"""Content-adaptive block masks inside a diffusers transformer: `apply(transformer, masks=Masks(steps=50))`.

Per routed attention call (one layer of one forward pass), at run time, inside the registered operator
`natsim::attention_resolved` (so that none of these decisions becomes a guard of a compiled graph):

1. the step: forward passes with the same timestep are one denoising step (the two passes of classifier-free
   guidance), read by the model's forward pre-hook; the layer: the call's place in the forward pass;
2. `natsim.masks.MaskCache` (DFSAttn's Algorithm 1) decides: a dense warm-up step runs the attention densely
   (PyTorch's SDPA, what the model itself runs); otherwise the layer's cached mask, predicted again when due by
   `natsim.masks.hierarchical` (DFSAttn's predictor) on the tokens in Hilbert order at `block`-token blocks;
3. the first mask of a layout is planned once (`natsim.planner.best_mask`: granularity and merge) and that plan
   serves every layer of that layout: the layers' masks differ, their best granularity hardly does, and one
   plan keeps planning off every later step; each new mask is pooled and prepared once
   (`MaskPlan.with_mask`), then reused at the steps the cache keeps it;
4. sparse attention of the ordered tokens under the mask, and the output back in row-major order.

The masks path runs under eager execution or regional compilation (`compile_repeated_blocks`): reading the
timestep is a host read that a whole-model compiled graph cannot hold, and a CUDA graph would freeze the
per-step decisions, so both are refused with a sentence.

Training (`training=True`): the operator's backward recomputes the attention each call decided on (the same
mask, the same dense or sparse choice, the same token order; kernels/common/resolved.py) and differentiates it
(the sparse kernels' backward, or torch's through dense attention), so gradients reach q, k and v, and through
the LSE where joint attention merges by it. The masks themselves are predicted from q and k under no_grad: the
prediction is a discrete choice, not differentiated. Each forward pass of training is a fresh sample, never one
denoising step's second pass, so the timestep is not read: every forward pass is one step of the cache's
schedule (the steps cycle through `steps`: dense warm-up passes, then sparse ones with the shrinking budget),
and on every sparse pass each layer's mask is predicted from that sample's q and k (no mask is reused for another
sample; `cache.refreshes` stays empty).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from natsim.kernels import check_precision, register_attention
from natsim.masks import MaskCache, hierarchical, hilbert_inverse, hilbert_order, to_order
from natsim.planner import MaskPlan, best_mask
from natsim.planner.backends import check_backends

from .dense import attention_with_lse

MASK_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Masks:
    """What content-adaptive masking to run: DFSAttn's setup by default.

    `steps`: denoising steps of a run (the cache's schedule). `block`: tokens per mask block of the predictor,
    scored from `sub_block`-token sub-blocks. `dense_fraction`, `initial_budget`, `budget_decay`,
    `min_budget`, `interval`: natsim.masks.MaskCache's. `order`: "hilbert" (blocks of tokens compact in the
    video) or None (row-major). `merges`: the query merges `best_mask` may choose ("xor" runs natsim.merge on
    the CPU, slow at video sizes). `min_speedup`: a plan predicted to gain no more than this over dense
    attention runs dense attention instead. `backends`: the kernel backends the plans may run on ("triton",
    "fa4", "gluon"; a name alone is one), None for every one available here (natsim.planner.best_mask).
    """

    steps: int
    block: int = 64
    sub_block: int = 16
    dense_fraction: float = 0.25
    initial_budget: float = 0.3
    budget_decay: float = 0.1
    min_budget: float = 0.1
    interval: Optional[int] = None
    order: Optional[str] = "hilbert"
    merges: Sequence[str] = ("none", "consecutive")
    min_speedup: float = 1.0
    backends: Union[None, str, Sequence[str]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", check_backends(self.backends))  # a sentence for a name it does not know

    def cache(self) -> MaskCache:
        options = dict(dense_fraction=self.dense_fraction, initial_budget=self.initial_budget,
                       budget_decay=self.budget_decay, min_budget=self.min_budget)
        if self.interval is not None:
            options["interval"] = self.interval
        return MaskCache(self.steps, **options)


@dataclass
class MaskStats:
    """What the masked attention did: calls, dense calls (warm-up steps and plans with no gain), predictions,
    and the planning time of each layout."""

    calls: int = 0
    dense_calls: int = 0
    predictions: int = 0
    plan_seconds: dict = field(default_factory=dict)


class MaskedAttention:
    """The run-time side of `Masks` for one model (module docstring); registered as a natsim operator."""

    def __init__(self, masks: Masks, dtype: Optional[torch.dtype] = None, precision: Optional[str] = None,
                 training: bool = False):
        if not isinstance(masks, Masks):
            raise TypeError(f"masks must be a natsim.integrations.diffusers.Masks, got {type(masks).__name__}.")
        self.masks = masks
        self.dtype = dtype
        self.precision = check_precision(precision)
        if training and self.precision is not None:
            raise ValueError("masks=... with precision='fp8' is for inference (its kernels have no backward pass), so "
                             "training must be False; train in bfloat16 (precision=None).")
        self.training = training
        for name, why in (("gluon", "has no backward pass" if training else None),
                          ("fa4", "runs no FP8" if self.precision is not None else None)):
            if why is not None and masks.backends is not None and name in masks.backends:
                raise ValueError(f"Masks(backends={masks.backends!r}) names {name!r}, which {why}: leave it out "
                                 f"(training={training}, precision={self.precision!r}).")
        self.cache = masks.cache()
        self.stats = MaskStats()
        self.plans: dict[tuple, MaskPlan] = {}
        self.layout: Optional[tuple[int, ...]] = None
        self._step = -1
        self._timestep: Optional[float] = None
        self._layer = 0
        self._running: dict[int, tuple[torch.Tensor, MaskPlan]] = {}  # layer -> (its mask, its pooled plan)
        self._orders: dict = {}
        self.id = register_attention(self)

    # -- told by the forward pre-hook ------------------------------------------------------------------------

    def begin_forward(self, layout: tuple[int, ...], timestep: torch.Tensor) -> None:
        """A forward pass begins: its layout, and its timestep (a new value is a new denoising step; in training,
        every forward pass is the next step, cycling through the schedule, and the timestep is not read)."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "natsim's content-adaptive masks read each forward pass's timestep on the host, which a compiled "
                "graph of the whole transformer cannot do: compile its blocks instead "
                "(transformer.compile_repeated_blocks(fullgraph=True)), or run it eagerly."
            )
        if self.training:
            self._step = (self._step + 1) % self.masks.steps
        else:
            value = float(timestep.flatten()[0])
            if value != self._timestep:
                self._step += 1
                self._timestep = value
        if self.layout is not None and tuple(layout) != self.layout:
            self._running.clear()
        self.layout = tuple(layout)
        self._layer = 0

    @property
    def step(self) -> int:
        return max(self._step, 0)

    def reset(self) -> None:
        """A new denoising run: step 0 again, no cached masks (the plans per layout are kept)."""
        self._step, self._timestep = -1, None
        self.cache.reset()
        self._running.clear()

    # -- one call, at run time ---------------------------------------------------------------------------------

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                 return_lse: bool):
        """One routed call (module docstring): the output, the LSE (or None) and the attention decided on as a
        function of q, k and v, which the operator's backward recomputes."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "natsim's content-adaptive masks decide on the host at every step, which a CUDA graph would freeze: "
                "run the model without CUDA graphs (no mode='reduce-overhead'), or use GNA (apply(..., sparsity=...))."
            )
        layer, self._layer = self._layer, self._layer + 1
        self.stats.calls += 1
        dtype = self.dtype or (q.dtype if q.dtype in MASK_DTYPES else torch.bfloat16)
        order, inverse = self._device_orders(q.device)
        ordered: dict = {}

        def in_order(name: str, t: torch.Tensor) -> torch.Tensor:  # each tensor reordered once per call
            if name not in ordered:
                ordered[name] = _in_order(t, order, dtype)
            return ordered[name]

        def predict(budget: float) -> torch.Tensor:
            self.stats.predictions += 1
            with torch.no_grad():  # a discrete choice: never differentiated
                return hierarchical(in_order("q", q), in_order("k", k), self.masks.block, self.masks.block,
                                    keep=budget, sub_block=self.masks.sub_block, scale=scale)

        mask = self._mask(layer, predict)
        plan = None if mask is None else self._plan(mask, q, dtype)
        if plan is None or plan.predicted_speedup <= self.masks.min_speedup:
            self.stats.dense_calls += 1
            dense = _Dense(scale, return_lse)
            return (*dense(q, k, v), dense)
        running = self._running.get(layer)
        if running is None or running[0] is not mask:  # a new mask: pooled and prepared once, then reused
            running = (mask, plan.with_mask(mask))
            self._running[layer] = running
        sparse = _Sparse(running[1], order, inverse, dtype, scale, return_lse)
        return (*sparse.on_ordered(in_order("q", q), in_order("k", k), in_order("v", v), q.dtype), sparse)

    def _mask(self, layer: int, predict) -> Optional[torch.Tensor]:
        """The layer's mask at this step, None at a dense step: the cache's (reused across steps) in inference,
        predicted for this forward pass's sample on every sparse step in training (module docstring)."""
        if not self.training:
            return self.cache.mask(layer, self.step, predict)
        return None if self.cache.is_dense(self.step) else predict(self.cache.budget(self.step))

    def _plan(self, mask: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> MaskPlan:
        """The plan of this layout, made from its first mask (module docstring)."""
        key = (self.layout, q.shape[0], q.shape[2], q.shape[3], dtype, str(q.device))
        plan = self.plans.get(key)
        if plan is None:
            start = time.perf_counter()
            plan = best_mask(mask, self.masks.block, self.masks.block, q.shape[1], heads=q.shape[2], batch=q.shape[0],
                             head_dim=q.shape[3], dtype=dtype, merges=tuple(self.masks.merges), keep_mask=False,
                             precision=self.precision, training=self.training, backends=self.masks.backends)
            self.stats.plan_seconds[key] = time.perf_counter() - start
            self.plans[key] = plan
        return plan

    def _device_orders(self, device: torch.device):
        """The layout's token order and its inverse as index tensors on `device` (made once each); None, None
        for row-major tokens or a 1-D layout."""
        if self.masks.order is None or len(self.layout) < 2:
            return None, None
        key = (self.layout, device)
        if key not in self._orders:
            order = hilbert_order(self.layout)
            self._orders[key] = (torch.as_tensor(order, device=device),
                                 torch.as_tensor(hilbert_inverse(order), device=device))
        return self._orders[key]


def _in_order(t: torch.Tensor, order: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """`t`'s tokens in `order` (as they are for None), in the kernel's `dtype`."""
    return (t if order is None else to_order(t, order)).to(dtype)


@dataclass(frozen=True)
class _Dense:
    """A dense call's attention as the model runs it (SDPA); with the LSE through `attention_with_lse`."""

    scale: Optional[float]
    return_lse: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if not self.return_lse:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 scale=self.scale)
            return out.transpose(1, 2), None
        out, lse = attention_with_lse(q, k, v, None, q.shape[-1] ** -0.5 if self.scale is None else self.scale)
        return out.to(q.dtype), lse


@dataclass(frozen=True)
class _Sparse:
    """A sparse call's attention: its prepared plan (the mask pooled at the plan's blocks) on the tokens in
    `order` in the kernel's `dtype`, the output (and LSE) back in row-major order and the model's dtype."""

    plan: MaskPlan
    order: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]
    dtype: torch.dtype
    scale: Optional[float]
    return_lse: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return self.on_ordered(*(_in_order(t, self.order, self.dtype) for t in (q, k, v)), q.dtype)

    def on_ordered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype):
        """The same on q, k, v already in the order and dtype (the forward reuses the predictor's)."""
        result = self.plan(q, k, v, scale=self.scale, return_lse=self.return_lse)
        out, lse = result if self.return_lse else (result, None)
        if self.inverse is not None:
            out = to_order(out, self.inverse)
            lse = None if lse is None else to_order(lse[..., None], self.inverse)[..., 0]
        return out.to(out_dtype), lse
