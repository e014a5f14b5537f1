"""What the Ulysses benchmarks (ulysses_host.py, ulysses_timeline.py) time: Wan 1.3B's 720p token layout, natsim's
plan for it at 0.9 sparsity, and one rank's share of random q, k and v (imported as a sibling module)."""

from __future__ import annotations

import torch

from natsim.partition import even_split

SHAPE = (21, 45, 80)  # Wan 720p's tokens: frames x height x width
PLAN = dict(window=(10, 23, 32), stride=(1, 8, 16), q_tile=(1, 8, 16), kv_tile=(1, 8, 16), kv_tiling="dynamic")
HEAD_DIM = 128


def rank_shards(heads: int, rank: int, world: int) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """The frames split over `world` ranks, and this rank's frames of q, k and v (`[1, T_r, 45, 80, heads, 128]`,
    bf16, on the current GPU, seeded by the rank)."""
    split = even_split(SHAPE[0], world)
    generator = torch.Generator("cuda").manual_seed(rank)
    return split, [torch.randn(1, split[rank], *SHAPE[1:], heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                               generator=generator) for _ in range(3)]
