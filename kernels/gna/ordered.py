"""GNA on tokens a model keeps in tile order: no permutation per call.

FlashAttention-4 runs GNA on q, k and v in the Q tile's token order (kernels/gna/layout.py: dilation groups,
then tiles, then tokens inside a tile), so a call on a row-major layout pays a permutation of q, k, v and the
output (about 2 ms of a 25 ms HunyuanVideo call on an H100). A model whose other layers work token by token can
instead keep its hidden states in that order from its first block to its last: `TileOrder` moves any tensor's
token dimension into the order and back (torch view, permute and reshape: differentiable, and fused by
torch.compile into its neighbours), and `run_ordered` runs a GNA spec on tensors already in it. Only layouts
the tile divides have such an order: a padded tile would put padding tokens among the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from natsim.problem import as_sizes

from ..gluon.ops import gna_fp8_ordered
from .choice import backward_refusal, choose
from .dispatch import Output, run_spec
from .layout import TileLayout
from .spec import GnaSpec


def tile_order_refusal(shape: tuple[int, ...], tile: tuple[int, ...], dilation: tuple[int, ...]) -> Optional[str]:
    """None when `tile` (per dilation group) divides the layout `shape`, so that its tile order is a permutation
    of the layout's tokens with no padding; else why not (a sentence)."""
    if not len(shape) == len(tile) == len(dilation):
        return f"shape, tile and dilation must have one entry per dimension, got {shape}, {tile} and {dilation}."
    if any(L % (t * d) for L, t, d in zip(shape, tile, dilation)):
        return (f"the tile {tile} (times the dilation {dilation}) does not divide the layout {shape}, so its tile "
                "order would hold padding tokens.")
    return None


@dataclass(frozen=True)
class TileOrder:
    """The Q tile's token order of a layout `shape` that `tile` divides (with `dilation`): `to_order` and
    `from_order` move the tokens of any tensor with `prod(shape)` tokens along one dimension."""

    shape: tuple[int, ...]
    tile: tuple[int, ...]
    dilation: tuple[int, ...]

    @classmethod
    def of(cls, shape, tile, dilation=1) -> "TileOrder":
        shape, tile = as_sizes(shape, "shape"), as_sizes(tile, "tile")
        dilation = (dilation,) * len(shape) if isinstance(dilation, int) else as_sizes(dilation, "dilation")
        refusal = tile_order_refusal(shape, tile, dilation)
        if refusal is not None:
            raise ValueError(refusal)
        return cls(shape, tile, dilation)

    @property
    def tokens(self) -> int:
        return math.prod(self.shape)

    def _grid(self) -> list[int]:
        """Each dimension of length `tiles * tile * dilation` split as (tiles, tile, dilation group): coordinate
        `(t * tile + r) * dilation + g` is indexed `(t, r, g)`."""
        grid = []
        for L, t, d in zip(self.shape, self.tile, self.dilation):
            grid += [L // (t * d), t, d]
        return grid

    def _axes(self) -> list[int]:
        """The grid's axes in tile order: dilation groups, then tiles, then positions inside a tile."""
        n = len(self.shape)
        return [3 * i + 2 for i in range(n)] + [3 * i for i in range(n)] + [3 * i + 1 for i in range(n)]

    def _split(self, x: torch.Tensor, dim: int) -> tuple[int, int, int]:
        dim = dim % x.dim()
        if x.shape[dim] != self.tokens:
            raise ValueError(f"dimension {dim} of a tensor of shape {tuple(x.shape)} must hold the layout's "
                             f"{self.tokens} tokens ({'x'.join(map(str, self.shape))}).")
        return math.prod(x.shape[:dim]), dim, math.prod(x.shape[dim + 1:])

    @property
    def row_major(self) -> bool:
        """Whether the tile order is the layout's own row-major order (then moving tokens changes nothing)."""
        return TileLayout(self.shape, self.tile, self.dilation).row_major

    def to_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """`x` with its row-major tokens along `dim` put into tile order."""
        before, dim, after = self._split(x, dim)
        if self.row_major:
            return x
        axes = [0, *(a + 1 for a in self._axes()), 3 * len(self.shape) + 1]
        return x.reshape(before, *self._grid(), after).permute(axes).reshape(x.shape)

    def from_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """`x` with its tokens along `dim` in tile order put back into row-major order."""
        before, dim, after = self._split(x, dim)
        if self.row_major:
            return x
        grid = self._grid()
        axes = self._axes()
        ordered = [before, *(grid[a] for a in axes), after]
        inverse = [0] * len(axes)
        for position, axis in enumerate(axes):
            inverse[axis] = position
        return x.reshape(ordered).permute([0, *(p + 1 for p in inverse), len(axes) + 1]).reshape(x.shape)


def layout_views(order: TileOrder, *tensors: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """`[B, N, ...]` tensors in tile order as `[B, *shape, ...]` in row-major order (None and empty tensors, an
    LSE not asked for, pass as they are)."""
    return [t if t is None or not t.numel() else order.from_order(t).reshape(t.shape[0], *order.shape, *t.shape[2:])
            for t in tensors]


def ordered_like(order: TileOrder, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`[B, *shape, ...]` in row-major order as `[B, N, ...]` in tile order (None and empty tensors as they are)."""
    if x is None or not x.numel():
        return x
    return order.to_order(x.reshape(x.shape[0], order.tokens, *x.shape[1 + len(order.shape):]))


def _choice(q: torch.Tensor, order: TileOrder, spec: GnaSpec):
    """natsim's choice of backend for a call on tokens in `order` (kernels/gna/choice.py)."""
    if spec.q_tile is None or tuple(spec.q_tile) != order.tile:
        raise ValueError(f"tokens in the order of the tile {order.tile} need a GNA call with that Q tile, got "
                         f"q_tile={spec.q_tile}.")
    if q.dim() != 4 or q.shape[1] != order.tokens:
        raise ValueError(f"q, k and v in tile order must be [batch, {order.tokens} tokens, heads, head_dim], got "
                         f"q.shape={tuple(q.shape)}.")
    return choose(spec, spec.problem(order.shape), q)


def run_ordered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: TileOrder, spec: GnaSpec) -> Output:
    """GNA of `spec` on `[B, N, heads, head_dim]` q, k, v whose tokens are in `order` (the spec's Q tile):
    `(out, lse)` in that order, `lse` None unless `spec.return_lse`. FlashAttention-4 and the Gluon FP8 kernel run
    them as they are; any other backend runs the call on the row-major layout, between one permutation out of the
    order and one back."""
    choice = _choice(q, order, spec)
    if choice.fa4 is not None:
        return choice.fa4.forward_ordered(q, k, v, _scale(q, spec), spec.return_lse)
    if choice.gluon is not None:
        out, lse = gna_fp8_ordered(q, k, v, choice.gluon.problem, choice.gluon.q_tile, _scale(q, spec),
                                   spec.return_lse)
        return out, lse if spec.return_lse else None
    out, lse = run_spec(*layout_views(order, q, k, v), spec)
    return ordered_like(order, out), ordered_like(order, lse)


def fa4_backward_ordered(q, k, v, out, lse, grad_out, grad_lse, order: TileOrder,
                         spec: GnaSpec) -> Optional[tuple[torch.Tensor, ...]]:
    """dq, dk, dv of `run_ordered` on FlashAttention-4, on tensors in `order` as they are, where it ran the
    forward and its backward runs the tiles; None otherwise (the caller differentiates the row-major call)."""
    choice = _choice(q, order, spec)
    if choice.fa4 is None or backward_refusal(choice, q.shape[-1]) is not None:
        return None
    scale = _scale(q, spec)
    if not lse.numel():
        out, lse = choice.fa4.forward_ordered(q, k, v, scale, True)
    return tuple(choice.fa4.backward_ordered(q, k, v, out, lse, grad_out, grad_lse, scale))


def _scale(q: torch.Tensor, spec: GnaSpec) -> float:
    return q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
