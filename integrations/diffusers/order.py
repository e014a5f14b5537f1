"""Whole-model tile order: a transformer keeps its video tokens in its GNA plan's tile order from its first block
to its last, so that no attention layer permutes q, k, v and its output.

FlashAttention-4 runs GNA on tokens in the plan's Q tile order (kernels/gna/ordered.py); a call on the model's
row-major tokens permutes four tensors in and out (about 2 ms of a 25 ms HunyuanVideo 720p call on an H100, 60
layers a step). Everything else in a DiT block works token by token, except what carries a position: the rotary
tables, and in some models a modulation per token. So natsim permutes, on each forward call where the plan allows
it, the video hidden states as the first block receives them, every block's per-token tables as it receives them
(a permutation that torch.compile fuses into the rotary arithmetic), and the video hidden states back as the last
block returns them; the routed attention then runs on the tokens as they come (`Router.order`).

`ORDER_POINTS` says where each model's tokens enter and leave its blocks. The order is taken where the plan runs
on FlashAttention-4 or the Gluon FP8 kernel (which read tokens in that order too) and its Q tile divides the layout (`tile_order=None`, the default), always where the tile
divides the layout (`True`: on any backend, for testing or where the permutations pay for other reasons), or never
(`False`). A layout's decision is made on its first forward call outside a compiled graph (a whole-model
`torch.compile` traces the decision made before it; its first trace of a new layout runs without the order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from natsim.kernels import TileOrder

from .attention import Router

Refusal = Callable[[nn.Module], Optional[str]]


def _no_refusal(model: nn.Module) -> Optional[str]:
    return None


def _hunyuan_refusal(model: nn.Module) -> Optional[str]:
    if getattr(model.config, "image_condition_type", None) == "token_replace":
        return ("HunyuanVideo's token_replace image conditioning treats the first frame's tokens by their row-major "
                "position, which a tile order moves.")
    return None


@dataclass(frozen=True)
class Table:
    """A block forward argument holding per-token tables (a tensor, or a tuple of them such as rotary (cos, sin)):
    its names (the argument's name in each block class), its position when passed positionally, and the dimension
    of its tokens. A tensor whose size there is not the layout's token count (a modulation broadcast over tokens)
    is left as it is."""

    names: tuple[str, ...]
    position: int
    dim: int


@dataclass(frozen=True)
class OrderPoints:
    """Where a model's video tokens enter and leave its blocks: `blocks` are its block lists in call order (the
    first block's first argument is the video hidden states), `tables` its blocks' per-token arguments, `output`
    the index of the video hidden states in a block's output tuple (None: the output is them), `refusal` what of a
    model's configuration rules the order out."""

    blocks: tuple[str, ...]
    tables: tuple[Table, ...]
    output: Optional[int]
    refusal: Refusal = _no_refusal


ORDER_POINTS: dict[str, OrderPoints] = {
    # temb is [B, 6, C], or [B, N, 6, C] per token (Wan 2.2 TI2V); rotary (cos, sin) are [1, N, 1, D]
    "WanTransformer3DModel": OrderPoints(("blocks",), (Table(("temb",), 2, 1), Table(("rotary_emb",), 3, 1)), None),
    # rotary (cos, sin) are [N, D] over the video tokens (text attends without)
    "HunyuanVideoTransformer3DModel": OrderPoints(
        ("transformer_blocks", "single_transformer_blocks"), (Table(("freqs_cis", "image_rotary_emb"), 4, 0),), 0,
        _hunyuan_refusal),
    "CogVideoXTransformer3DModel": OrderPoints(("transformer_blocks",), (Table(("image_rotary_emb",), 3, 0),), 0),
    # temb is [B, 1, C] or [B, N, C] per token; rotary (cos, sin) are [B, N, D]
    "LTXVideoTransformer3DModel": OrderPoints(
        ("transformer_blocks",), (Table(("temb",), 2, 1), Table(("image_rotary_emb",), 3, 1)), None),
}
TILE_ORDERS = (None, True, False)


def check_tile_order(tile_order: object, model: nn.Module, masked: bool) -> Optional[OrderPoints]:
    """The model's order points when `tile_order` may put it in tile order, None when it stays row-major; a
    sentence error where `tile_order=True` asks for what cannot be."""
    if tile_order not in TILE_ORDERS or not isinstance(tile_order, (bool, type(None))):
        raise ValueError(f"tile_order must be None (where it pays), True or False, got tile_order={tile_order!r}.")
    if tile_order is False:
        return None
    name = type(model).__name__
    points = ORDER_POINTS.get(name)
    refusal = None
    if masked:
        refusal = "content-adaptive masks attend in token orders of their own."
    elif points is None:
        refusal = (f"natsim knows where the video tokens enter and leave the blocks of {', '.join(ORDER_POINTS)}, "
                   f"not of {name}.")
    else:
        refusal = points.refusal(model)
    if refusal is None:
        return points
    if tile_order:
        raise ValueError(f"tile_order=True cannot keep this model in tile order: {refusal}")
    return None


class ModelOrder:
    """One model's whole-model tile order: the decision per forward call (`begin`) and the block hooks that
    move its tokens into the order and back."""

    def __init__(self, model: nn.Module, points: OrderPoints, router: Router, heads: int, head_dim: int,
                 force: bool):
        self.points = points
        self.router = router
        self.force = force
        self.heads = heads
        self.head_dim = head_dim
        self.decided: dict[tuple, Optional[TileOrder]] = {}
        blocks = [block for name in points.blocks for block in getattr(model, name)]
        self.hooks = [block.register_forward_pre_hook(functools.partial(self._enter, first=i == 0), with_kwargs=True)
                      for i, block in enumerate(blocks)]
        self.hooks.append(blocks[-1].register_forward_hook(self._leave))

    def begin(self, dtype: torch.dtype, device: torch.device) -> None:
        """Decide the order of the forward call beginning (its layout is the router's), whose attention runs in
        `dtype` on `device`."""
        if not self.router.serving:  # the model's own attention runs this layout: its tokens stay in place
            self.router.order = None
            return
        key = (self.router.layout, self.router.trailing, dtype, device)
        if key not in self.decided and not torch.compiler.is_compiling():
            order = None
            if self.router.trailing == 0 and self.router.ulysses is None:  # row-major under context parallelism
                order = self.router.auto.tile_order(self.router.layout, heads=self.heads, head_dim=self.head_dim,
                                                    dtype=dtype, device=device, force=self.force)
            self.decided[key] = order
        self.router.order = self.decided.get(key)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.router.order = None

    def _enter(self, block: nn.Module, args: tuple, kwargs: dict, first: bool):
        order = self.router.order
        if order is None:
            return None
        args = list(args)
        if first:
            if args:
                args[0] = order.to_order(args[0])
            else:
                kwargs["hidden_states"] = order.to_order(kwargs["hidden_states"])
        for table in self.points.tables:
            for name in table.names:
                if name in kwargs:
                    kwargs[name] = _tables_to_order(kwargs[name], order, table.dim)
            if len(args) > table.position:
                args[table.position] = _tables_to_order(args[table.position], order, table.dim)
        return tuple(args), kwargs

    def _leave(self, block: nn.Module, args: tuple, output: Any):
        order = self.router.order
        if order is None:
            return None
        if self.points.output is None:
            return order.from_order(output)
        output = list(output)
        output[self.points.output] = order.from_order(output[self.points.output])
        return tuple(output)


def _tables_to_order(value: Any, order: TileOrder, dim: int) -> Any:
    """Per-token tables (a tensor, a tuple or list of them, or None) with their tokens along `dim` put in `order`;
    a tensor without the layout's token count there is left as it is."""
    if isinstance(value, (tuple, list)):
        return type(value)(_tables_to_order(v, order, dim) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] == order.tokens:
        return order.to_order(value, dim)
    return value
