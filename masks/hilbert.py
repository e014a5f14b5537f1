"""A Hilbert-curve token order for 2-D and 3-D layouts of any size, so that the tokens of one block are near
each other in the layout and a block mask can be sparse (DFSAttn, SpargeAttn). The order itself is numpy only;
`to_order` / `from_order` move `[B, N, H, D]` tokens into it and back.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np
import torch


def _hilbert_index(coords: np.ndarray, bits: int) -> np.ndarray:
    """The position along the Hilbert curve of the `2**bits`-sided cube of each point of `coords` ([ndim, M]).

    Skilling's "AxesToTranspose" (Programming the Hilbert curve, AIP Conf. Proc. 707, 2004), vectorised over
    points, then the transposed bits interleaved into one integer. The curve starts at the origin and
    consecutive positions are grid neighbours.
    """
    x = [row.copy() for row in coords]
    ndim = len(x)
    q = 1 << (bits - 1)
    while q > 1:  # inverse undo of the curve's rotations and reflections
        low = q - 1
        for i in range(ndim):
            hit = (x[i] & q) != 0
            t = np.where(hit, 0, (x[0] ^ x[i]) & low)
            x[0] = np.where(hit, x[0] ^ low, x[0] ^ t)
            x[i] ^= t
        q >>= 1
    for i in range(1, ndim):  # Gray encode
        x[i] ^= x[i - 1]
    t = np.zeros_like(x[0])
    q = 1 << (bits - 1)
    while q > 1:
        t = np.where((x[ndim - 1] & q) != 0, t ^ (q - 1), t)
        q >>= 1
    for i in range(ndim):
        x[i] ^= t
    index = np.zeros_like(x[0])
    for b in range(bits - 1, -1, -1):
        for i in range(ndim):
            index = (index << 1) | ((x[i] >> b) & 1)
    return index


def hilbert_order(shape: Sequence[int]) -> np.ndarray:
    """The row-major token indices of a 2-D or 3-D layout `shape` in Hilbert-curve order (int64, length N).

    `x[:, order]` puts tokens in curve order, so the tokens of a block of consecutive positions are close in
    the layout. Any sizes work: the curve is that of the enclosing power-of-two square or cube, and the
    in-bounds points keep their order along it. On power-of-two squares and cubes consecutive tokens are
    grid neighbours; elsewhere the curve leaves the layout and comes back, so a few consecutive tokens are
    farther apart (on 30 x 48 x 80, 99.6% of steps are to a neighbour).
    """
    if isinstance(shape, (int, np.integer)) or not isinstance(shape, Sequence) or len(shape) not in (2, 3):
        raise ValueError(f"shape must be a 2-D or 3-D layout (a sequence of 2 or 3 sizes), got shape={shape!r}.")
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in shape):
        raise ValueError(f"shape must hold positive ints, got shape={tuple(shape)!r}.")
    shape = tuple(int(s) for s in shape)
    bits = max(1, math.ceil(math.log2(max(shape))))
    coords = np.indices(shape, dtype=np.int64).reshape(len(shape), -1)
    return np.argsort(_hilbert_index(coords, bits), kind="stable").astype(np.int64)


def hilbert_inverse(order: np.ndarray) -> np.ndarray:
    """The inverse permutation of `order`: the curve position of each row-major token (`inverse[order] = arange`)."""
    order = np.asarray(order)
    if order.ndim != 1 or not np.issubdtype(order.dtype, np.integer) \
            or not np.array_equal(np.sort(order), np.arange(order.size)):
        raise ValueError(
            f"order must be a 1-D integer permutation of 0..N-1, got an array of shape {order.shape} and "
            f"dtype {order.dtype} that is not one."
        )
    inverse = np.empty(order.size, dtype=np.int64)
    inverse[order] = np.arange(order.size, dtype=np.int64)
    return inverse


def _order_tensor(order: Union[np.ndarray, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, tokens, heads, head_dim], got x.shape={tuple(x.shape)}.")
    order = torch.as_tensor(order)
    if order.dim() != 1 or order.numel() != x.shape[1]:
        raise ValueError(
            f"order must be a permutation of the {x.shape[1]} tokens of x, got order of shape {tuple(order.shape)}."
        )
    if order.device.type == "cpu" and not torch.compiler.is_compiling():  # host data: checked without a sync
        if order.is_floating_point() or order.is_complex() or not torch.equal(
                torch.sort(order.to(torch.int64)).values, torch.arange(order.numel())):
            raise ValueError(f"order must be a permutation of the {x.shape[1]} tokens of x (each index once), got "
                             "repeated, missing or out-of-range indices.")
    return order.to(device=x.device, dtype=torch.int64)


def to_order(x: torch.Tensor, order: Union[np.ndarray, torch.Tensor]) -> torch.Tensor:
    """`[B, N, H, D]` tokens from row-major order into `order` (e.g. `hilbert_order(shape)`): `x[:, order]`."""
    return x.index_select(1, _order_tensor(order, x))


def from_order(y: torch.Tensor, order: Union[np.ndarray, torch.Tensor]) -> torch.Tensor:
    """The inverse of `to_order`: `[B, N, H, D]` tokens in `order` back to row-major order."""
    index = _order_tensor(order, y)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return y.index_select(1, inverse)
