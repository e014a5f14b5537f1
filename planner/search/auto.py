"""`AutoPlan`: GNA planned once per token layout, run on whatever layout it is called with.

A model meets several latent sizes (resolutions, frame counts) and, under `torch.compile`, must not retrace
for planning: an `AutoPlan` holds the planning options (`natsim.planner.best`'s), plans on the first call
of each layout (shape, heads, head_dim, dtype, GPU) and keeps the plan. Calls go through the registered
operator `natsim::gna_resolved`, whose resolver is this object: the plan is looked up when the operator
runs, never while a graph is traced, so a compiled model holds one opaque call per attention whatever the
layout, and a CUDA graph replays the kernels of a plan made during warm-up. Calls that need no gradient go
through the operator's twin without autograd (`natsim.kernels.resolved_operators`), which costs the host less.
Plain eager calls skip the dispatcher and run the plan directly. Gradients flow as through `gna_attention`.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional, Union

import torch

from natsim.kernels import (TileOrder, autocast_inputs, check_qkv, check_tensors, needs_gradient, refuse_gradients,
                            register_resolver, resolved_operators, runs_eagerly, tile_order_refusal)
from natsim.problem import BoolOrBools, IntOrInts

from ..catalog import element_bytes
from ..cost.gpus import names_a_gpu
from ..cost.model import OWN_ATTENTION
from ..cost.resolve import CostModelLike, DeviceLike, resolve_cost_model
from ..plans.plan import Plan
from ..plans.verdict import Verdict
from .gna import AUTO, best, dense_seconds, ranking

PlanKey = tuple[tuple[int, ...], int, int, torch.dtype, str]


class AutoPlan:
    """Plans GNA for each token layout it is called on, with `natsim.planner.best`'s options (one GPU: no
    `world_size`); with `precision="fp8"` it runs the FP8 inference kernel, with `precision="auto"` FP8 on the
    layouts where it is predicted faster and bf16 elsewhere (inputs that require grad are refused with either).

    >>> auto = AutoPlan(0.9)              # doctest: +SKIP
    >>> out = auto(q, k, v)               # q: [B, *shape, heads, head_dim]; plans `shape` once   # doctest: +SKIP
    """

    def __init__(
        self,
        target_sparsity: float,
        *,
        causal: BoolOrBools = False,
        window: Optional[IntOrInts] = None,
        max_stride: Optional[IntOrInts] = None,
        device: DeviceLike = None,
        cost_model: Optional[CostModelLike] = None,
        training: bool = False,
        kv_tiling: Optional[str] = None,
        precision: Optional[str] = None,
    ):
        if precision not in (None, "fp8", AUTO):
            raise ValueError(f"precision must be None (the inputs' dtype), 'fp8' or 'auto' (FP8 where it is "
                             f"predicted faster), got precision={precision!r}.")
        if precision == AUTO and training:
            raise ValueError("precision='auto' chooses between bf16 and FP8 for inference, so training must be False; "
                             "pass precision=None to train.")
        if cost_model is not None or names_a_gpu(device) or precision is not None:
            # refuse what no layout can plan now, not at a call
            ranking(device, cost_model, training, kv_tiling, None if precision == AUTO else precision)
        self.options = dict(causal=causal, window=window, max_stride=max_stride, device=device,
                            cost_model=cost_model, training=training, kv_tiling=kv_tiling, precision=precision)
        self.target_sparsity = target_sparsity
        self.plans: dict[PlanKey, Plan] = {}
        self._lock = threading.Lock()
        self._planning = threading.local()
        self._resolver = register_resolver(self._kernel_arguments)

    @contextmanager
    def planning_heads(self, heads: int) -> Iterator[None]:
        """Inside, every layout is planned as for a call of `heads` heads, whatever the heads of the call: a caller
        that runs a call's heads in groups (natsim.distributed's Ulysses pipeline) runs the plan of the whole
        call on each group, the plan one process runs (a plan's window and stride may depend on the heads it is
        priced for). Per thread."""
        previous = getattr(self._planning, "heads", None)
        self._planning.heads = int(heads)
        try:
            yield
        finally:
            self._planning.heads = previous

    def plan_for(self, shape: tuple[int, ...], *, heads: int, head_dim: int, dtype: torch.dtype,
                 device: Union[str, torch.device]) -> Plan:
        """The plan for a layout (made on first use, then kept): `best(shape, target_sparsity, ...)` with this
        object's options; `device` names the GPU whose cost model ranks (unless the options name one)."""
        device = torch.device(device)
        heads = getattr(self._planning, "heads", None) or heads
        key = (tuple(shape), int(heads), int(head_dim), dtype, str(device))
        plan = self.plans.get(key)
        if plan is None:
            with self._lock:
                plan = self.plans.get(key)
                if plan is None:
                    options = dict(self.options)
                    if options["device"] is None and options["cost_model"] is None and device.type == "cuda":
                        options["device"] = device
                    plan = best(tuple(shape), self.target_sparsity, heads=heads, head_dim=head_dim,
                                      dtype=dtype, **options)
                    self.plans[key] = plan
        return plan

    def verdict(self, shape: tuple[int, ...], *, heads: int, head_dim: int, dtype: torch.dtype,
                device: Union[str, torch.device], batch: int = 1, text: int = 0) -> Verdict:
        """Whether this layout's plan is predicted to beat a model's own dense attention (SDPA) on calls of
        `batch` layouts, the host's time to issue each call included (planner.plans.verdict): the diffusers
        integration keeps the model's own attention where it is not. `text`: tokens beside the layout in a joint
        call (text, reference images), which natsim attends densely beside its plan: two dense calls (SDPA) and the
        merge through their log-sum-exps (one fused Triton kernel under torch.compile) on its host's side. natsim
        serves wherever no cost model prices the GPU."""
        plan = self.plan_for(shape, heads=heads, head_dim=head_dim, dtype=dtype, device=device)
        if not plan.calibrated:
            return Verdict.of(plan, 0.0, 0.0, text=text)
        _, model = resolve_cost_model(self.options["device"] or torch.device(device), self.options["cost_model"])
        own_call = None
        if plan.precision is not None:  # an FP8 plan (inference): the model attends unquantized, in the inputs' dtype
            dense = dense_seconds(math.prod(shape), model, heads, head_dim, element_bytes(dtype))
            own_call = float(model.at_least_host(dense, "triton"))
        text_host = 2 * model.host(OWN_ATTENTION) + model.host("triton")
        return Verdict.of(plan, model.host(plan.backend), model.host(OWN_ATTENTION), own_call, batch, text, text_host)

    def _kernel_arguments(self, shape, heads, head_dim, dtype, device) -> Mapping[str, object]:
        return self.plan_for(shape, heads=heads, head_dim=head_dim, dtype=dtype, device=device).kernel_arguments()

    def tile_order(self, shape: tuple[int, ...], *, heads: int, head_dim: int, dtype: torch.dtype,
                   device: Union[str, torch.device], force: bool = False) -> Optional[TileOrder]:
        """The token order a model can keep its hidden states in for the plan of a layout (its Q tile's order):
        where the plan runs on FlashAttention-4 or the Gluon FP8 kernel, which then need no permutation per call,
        or with `force` on any backend; None where the tile does not divide the layout (or, without `force`, the
        plan runs elsewhere)."""
        plan = self.plan_for(shape, heads=heads, head_dim=head_dim, dtype=dtype, device=device)
        if not force and plan.backend not in ("fa4", "gluon"):
            return None
        if tile_order_refusal(plan.problem.shape, plan.tiles.q_tile, plan.problem.dilation) is not None:
            return None
        return TileOrder(plan.problem.shape, plan.tiles.q_tile, plan.problem.dilation)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                 return_lse: bool = False, order: Optional[TileOrder] = None):
        """GNA of `[B, *shape, heads, head_dim]` tensors with the plan for `shape` (returns what
        `gna_attention` returns: the output, and with `return_lse` its log-sum-exp); with `order` (from
        `tile_order`), of `[B, N, heads, head_dim]` tensors whose tokens are in that order, output and LSE in it."""
        check_tensors(q, k, v)
        q, k, v = autocast_inputs(q, k, v)
        if order is None and runs_eagerly(q, k, v):
            shape = check_qkv(q, k, v)
            plan = self.plan_for(shape, heads=q.shape[-2], head_dim=q.shape[-1], dtype=q.dtype, device=q.device)
            return plan(q, k, v, scale=scale, return_lse=return_lse)
        if self.options["precision"] is not None:
            refuse_gradients("AutoPlan", q, k, v)
        tracked = needs_gradient(q, k, v)
        resolved, resolved_ordered = resolved_operators(tracked)
        scale = None if scale is None else float(scale)
        if order is None:
            out, lse = resolved(q, k, v, self._resolver, scale, return_lse or tracked)
        else:
            out, lse = resolved_ordered(q, k, v, list(order.shape), list(order.tile), list(order.dilation),
                                        self._resolver, scale, return_lse or tracked)
        return (out, lse) if return_lse else out

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={value!r}" for name, value in self.options.items() if value not in (None, False))
        return f"AutoPlan({self.target_sparsity!r}{', ' + options if options else ''}; {len(self.plans)} plans)"
