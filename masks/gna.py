"""natsim's GNA window as a block mask over row-major tokens, so that local attention is kept whatever a
predictor says (`union(predicted, gna_block_mask(...))`)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from natsim import Problem, TileConfig, block_mask
from natsim.problem import BoolOrBools, IntOrInts
from natsim.kernels.backends.triton import MIN_Q_BLOCK, check_block


def gna_block_mask(
    shape: Sequence[int],
    window: IntOrInts,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
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
    q_block = check_block("q_block", q_block, MIN_Q_BLOCK)
    kv_block = check_block("kv_block", kv_block)
    problem = Problem(tuple(shape), window, stride=stride, dilation=dilation, causal=causal)
    dense = block_mask(problem, TileConfig(q_block, kv_block, tiling="1d")).to_dense()
    return torch.from_numpy(dense).to(device)[None, None]
