"""Content-adaptive block masks for `sparse_attention` (issue 10), public as `natsim.masks`.

- `hilbert_order` / `hilbert_inverse`, `to_order` / `from_order`: a Hilbert-curve token order for 2-D and 3-D
  layouts of any size, so that the tokens of one block are near each other in the layout and a block mask
  can be sparse (DFSAttn, SpargeAttn). The order is numpy only.
- `topp`, `sparge`, `hierarchical` (kernels/predictors.py): FG-Attn's, SpargeAttn's and DFSAttn's mask
  predictors from q and k, torch ops only, so they run where q and k are.
- `MaskCache` (kernels/maskcache.py): DFSAttn's reuse of masks across diffusion steps, with dense warm-up
  steps and its shrinking budget (Algorithm 1).
- `union`, `intersection`, `keep_global`, `gna_block_mask`: combining masks, always-kept global rows and
  columns (text tokens, the first frame) and natsim's GNA window as a block mask, so that local attention is
  kept whatever a predictor says.

Every mask here is the boolean `[B or 1, H or 1, ceil(N / q_block), ceil(N / kv_block)]` tensor that
`natsim.kernels.sparse_attention` and `SparseMask.from_dense` take: True where a query block attends a key
block.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from .maskcache import MaskCache
from .predictors import hierarchical, sparge, topp
from .sparse import MIN_Q_BLOCK
from .sparsemask import check_block

__all__ = [
    "hilbert_order",
    "hilbert_inverse",
    "to_order",
    "from_order",
    "topp",
    "sparge",
    "hierarchical",
    "MaskCache",
    "union",
    "intersection",
    "keep_global",
    "gna_block_mask",
]

# -- Hilbert order ----------------------------------------------------------------------------------------------


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


# -- combining masks --------------------------------------------------------------------------------------------


def _check_mask(name: str, mask) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}.")
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(
            f"{name} must be a boolean [B or 1, H or 1, q blocks, kv blocks] tensor, got "
            f"{name}.dtype={mask.dtype}, {name}.shape={tuple(mask.shape)}."
        )
    return mask


def _check_pair(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _check_mask("a", a), _check_mask("b", b)
    if a.shape[2:] != b.shape[2:]:
        raise ValueError(
            "a and b must be masks over one block grid (the same q and kv blocks of one sequence), got "
            f"a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)}."
        )
    if any(x != y and 1 not in (x, y) for x, y in zip(a.shape[:2], b.shape[:2])):
        raise ValueError(
            "a and b must have batch and head dimensions that are equal or 1, got "
            f"a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)}."
        )
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}.")
    return a, b


def union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The blocks either mask attends (`a | b`, batch and head dimensions of 1 broadcast), after checking that
    both are masks over one block grid, e.g. a predicted mask and `gna_block_mask`'s local window."""
    a, b = _check_pair(a, b)
    return a | b


def intersection(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The blocks both masks attend (`a & b`, batch and head dimensions of 1 broadcast), after the checks of
    `union`."""
    a, b = _check_pair(a, b)
    return a & b


def _block_indices(name: str, indices: Iterable[int], blocks: int) -> torch.Tensor:
    values = list(indices)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < blocks]
    if bad:
        raise ValueError(f"{name} must be block indices in [0, {blocks}), got {name} holding {bad!r}.")
    return torch.tensor([int(v) for v in values], dtype=torch.int64)


def keep_global(mask: torch.Tensor, rows: Iterable[int] = (), cols: Iterable[int] = ()) -> torch.Tensor:
    """A copy of `mask` in which query blocks `rows` attend every key block and every query block attends the
    key blocks `cols`: global tokens such as text tokens or the first frame, which predictors may miss.

    `rows` and `cols` are block indices (the tokens `t` of a global span are blocks `t // q_block` and
    `t // kv_block`, e.g. `range(ceil(H * W / q_block))` for the first frame of a row-major video).
    """
    mask = _check_mask("mask", mask)
    rows = _block_indices("rows", rows, mask.shape[2]).to(mask.device)
    cols = _block_indices("cols", cols, mask.shape[3]).to(mask.device)
    out = mask.clone()
    out[:, :, rows, :] = True
    out[:, :, :, cols] = True
    return out


def gna_block_mask(
    shape: Sequence[int],
    window: Union[int, Sequence[int]],
    stride: Union[int, Sequence[int]] = 1,
    dilation: Union[int, Sequence[int]] = 1,
    causal: Union[bool, Sequence[bool]] = False,
    *,
    q_block: int,
    kv_block: int,
    device: Optional[Union[str, torch.device]] = None,
) -> torch.Tensor:
    """natsim's GNA window over the row-major layout `shape` as a bool `[1, 1, ceil(N / q_block),
    ceil(N / kv_block)]` block mask: a query block attends a key block when any of its queries' windows
    holds any of the block's keys (`natsim.block_mask` under 1-D tiling, partial and full blocks together).

    `union(predicted, gna_block_mask(...))` keeps local attention whatever the predictor says. The blocks are
    runs of row-major tokens, the order `sparse_attention` sees when q, k and v are not permuted.
    """
    from natsim import Problem, TileConfig, block_mask

    q_block = check_block("q_block", q_block, MIN_Q_BLOCK)
    kv_block = check_block("kv_block", kv_block)
    problem = Problem(tuple(shape), window, stride=stride, dilation=dilation, causal=causal)
    dense = block_mask(problem, TileConfig(q_block, kv_block, tiling="1d")).to_dense()
    return torch.from_numpy(dense).to(device)[None, None]
