"""Combining block masks: union, intersection, and always-kept global rows and columns (text tokens, the first
frame), so that what a predictor misses can be put back. Every mask is the boolean `[B or 1, H or 1, q blocks,
kv blocks]` tensor `sparse_attention` takes."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch


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
