"""One GNA geometry on FlashAttention-4: tokens in the Q tile's order, the simulator's lists, GNA's mask_mod.

`Fa4Gna` holds what a call needs besides its tensors: the problem and the tiles. q, k and v go into the Q tile's
token order (kernels/gna/permute.py; the output and the LSE come back out of it), FlashAttention-4 runs the
lists of `gna_lists` and, where any visited block is partial, `gna_mask_mod`; `forward_ordered` /
`backward_ordered` run tensors already in that order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from natsim import Problem

from ..gna.layout import TileLayout
from ..gna.permute import permute, source_rows, unpermute
from . import run
from .gna_mask import GnaMask
from .lists import Fa4Lists, gna_lists
from .mask_mod import gna_mask_mod


@dataclass(frozen=True)
class Fa4Gna:
    """GNA of `problem` on FlashAttention-4 with `q_tile` / `kv_tile` (`gna_tile_refusal` said yes)."""

    problem: Problem
    q_tile: tuple[int, ...]
    kv_tile: tuple[int, ...]

    def lists(self, device: torch.device) -> Fa4Lists:
        return gna_lists(self.problem, self.q_tile, self.kv_tile, device)

    def mask_mod(self, lists: Fa4Lists) -> Optional[Callable]:
        """GNA's mask_mod where a visited block is partial; None for block-sparse geometries."""
        return gna_mask_mod(GnaMask(self.problem, self.q_tile)) if lists.masked else None

    @functools.cached_property
    def _row_major(self) -> bool:
        return TileLayout(self.problem.shape, self.q_tile, self.problem.dilation).row_major

    def to_order(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, *shape, H, D]` -> `[B, tokens, H, D]` in the Q tile's order (zeros at padding); a reshape where that
        order is the layout's own (a 1-D tile of a sequence)."""
        if self._row_major:
            return x.reshape(x.shape[0], -1, *x.shape[-2:])
        return permute(x, self.q_tile, self.problem.dilation)

    def order_rows(self, device: torch.device) -> Optional[torch.Tensor]:
        """The Q tile's order as the row-major token each position reads (kernels/gna/permute.py's `source_rows`),
        for kernels that gather as they read; None where that order is the layout's own."""
        if self._row_major:
            return None
        return source_rows(self.problem.shape, self.q_tile, self.problem.dilation, device)

    def from_order(self, y: torch.Tensor) -> torch.Tensor:
        """`[B, tokens, H, D]` in the Q tile's order -> `[B, *shape, H, D]` (padding dropped)."""
        if self._row_major:
            return y.reshape(y.shape[0], *self.problem.shape, *y.shape[2:])
        return unpermute(y, self.problem.shape, self.q_tile, self.problem.dilation)

    def lse_from_order(self, lse: torch.Tensor) -> torch.Tensor:
        """`[B, tokens, H]` in the Q tile's order -> `[B, *shape, H]`."""
        return self.from_order(lse[..., None])[..., 0]

    def forward_ordered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        return_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`(out, lse or None)` of q, k, v in the Q tile's order, in that order."""
        lists = self.lists(q.device)
        return run.forward(q, k, v, scale, lists, self.mask_mod(lists), return_lse)

    def backward_ordered(self, q, k, v, out, lse, grad_out, grad_lse, scale):
        """dq, dk, dv of q, k, v in the Q tile's order, from the forward's output and LSE in that order."""
        lists = self.lists(q.device)
        return run.backward(q, k, v, out, grad_out, lse, grad_lse, scale, lists, self.mask_mod(lists))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                return_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`(out, lse or None)` of `[B, *shape, H, D]` tensors, in that layout."""
        out, lse = self.forward_ordered(self.to_order(q), self.to_order(k), self.to_order(v), scale, return_lse)
        return self.from_order(out), None if lse is None else self.lse_from_order(lse)

    def backward(self, q, k, v, out, lse, grad_out, grad_lse, scale):
        """dq, dk, dv of `[B, *shape, H, D]` tensors from the forward's output and LSE `[B, *shape, H]`."""
        as_order = lambda t: None if t is None else self.to_order(t[..., None])[..., 0]  # noqa: E731
        grads = self.backward_ordered(self.to_order(q), self.to_order(k), self.to_order(v), self.to_order(out),
                                      as_order(lse), self.to_order(grad_out), as_order(grad_lse), scale)
        return tuple(self.from_order(g) for g in grads)
