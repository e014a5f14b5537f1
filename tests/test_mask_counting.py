"""The mask planner's counting paths against plain references: natsim.merge's XOR greedy on masks long enough for
several distance passes and compactions of its word-major rows (a numpy greedy), the packing of a mask in torch
ops (the CUDA path, run here on CPU tensors) against `pack_rows`, and the pooled rows and counts made at once on
threads, a mask or several per job (`PackedMask.prepare`, `merged_counts_many`), against those made on demand
in one pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from natsim.merging import merge, pack_rows
from natsim.planner.plans.mask import MERGES
from natsim.planner.search.mask import _grouping
from natsim.planner.search.mask_work import PackedMask, pack_rows_torch


BYTE_POPCOUNT = np.array([bin(byte).count("1") for byte in range(256)], np.int64)


def plain_greedy(mask: np.ndarray, group: int) -> list[int]:
    """FG-Attn's greedy in numpy: the first ungrouped row leads, with its group - 1 nearest ungrouped rows by
    (XOR distance, row); each group listed in ascending rows."""
    octets = np.packbits(mask, axis=1)
    left, order = np.arange(len(mask)), []
    while len(left):
        rest = left[1:]
        distance = BYTE_POPCOUNT[octets[rest] ^ octets[left[0]]].sum(axis=1)
        members = np.sort(np.concatenate([left[:1], rest[np.lexsort((rest, distance))[:group - 1]]]))
        order += members.tolist()
        left = left[~np.isin(left, members)]
    return order


def clustered(rng: np.random.Generator, rows: int, columns: int, density: float) -> np.ndarray:
    """4 x 4 blocks kept at `density` plus scattered ones, like a predictor's mask."""
    blocks = rng.random((-(-rows // 4), -(-columns // 4))) < density
    return np.kron(blocks, np.ones((4, 4), bool))[:rows, :columns] | (rng.random((rows, columns)) < density / 4)


@pytest.mark.parametrize("rows, columns, group, kind", [
    (1100, 2048, 8, "clustered"),   # 32 words, three passes of 512 per early leader, compactions
    (1300, 300, 4, "random"),       # 5 words: the single-word tail of the distance pass
    (1500, 64, 8, "prototypes"),    # rows repeated: R-1 exact copies end a leader's scan
    (1025, 130, 2, "dense"),        # a last group of one
    (700, 1, 16, "random"),         # one column: every distance ties
    (900, 700, 3, "zeros"),         # every row equal
])
def test_xor_greedy_on_long_masks_is_the_plain_greedy(rows, columns, group, kind):
    rng = np.random.default_rng(rows)
    if kind == "clustered":
        mask = clustered(rng, rows, columns, 0.1)
    elif kind == "prototypes":
        mask = (rng.random((5, columns)) < 0.3)[rng.integers(0, 5, rows)]
    elif kind == "zeros":
        mask = np.zeros((rows, columns), bool)
    else:
        mask = rng.random((rows, columns)) < (0.9 if kind == "dense" else 0.3)
    groups = merge(mask, group, "xor").groups
    assert groups[groups >= 0].tolist() == plain_greedy(mask, group)


@pytest.mark.parametrize("shape", [(1, 1), (3, 63), (2, 64), (5, 65), (4, 130), (2, 3, 7, 1000)])
def test_packing_in_torch_ops_is_pack_rows(shape):
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(shape[-1])) < 0.4
    words = pack_rows_torch(mask)
    assert words.dtype == torch.int64 and words.shape == (*shape[:-1], -(-shape[-1] // 64))
    assert np.array_equal(words.numpy().view(np.uint64), pack_rows(mask.numpy()))


@pytest.mark.parametrize("cores, job_words", [(1, 1 << 16), (3, 1), (3, 1000)])  # a mask or a few per job
@pytest.mark.parametrize("granularities", [
    [(q, kv) for q in (16, 32, 64, 128) for kv in (16, 32, 64, 128)],
    [(64, 32)],  # the poolings it starts from are made on the way
])
def test_prepared_pooling_and_counts_are_those_made_on_demand(monkeypatch, cores, job_words, granularities):
    from natsim import merging
    from natsim.planner.search import mask_work

    monkeypatch.setattr(merging.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(mask_work, "_JOB_WORDS", job_words)
    monkeypatch.setattr(merging, "_JOB_WORDS", job_words * 10)
    seq_len = 16 * 150 - 7  # partial last blocks at every granularity
    dense = torch.from_numpy(np.stack([clustered(np.random.default_rng(h), 150, 150, 0.2) for h in range(6)]))
    dense = dense.reshape(2, 3, 150, 150)
    prepared, on_demand = PackedMask(dense, 16, 16, seq_len), PackedMask(dense, 16, 16, seq_len)
    prepared.prepare(granularities)
    for q_block, kv_block in granularities:
        factors = (q_block // 16, kv_block // 16)
        assert np.array_equal(prepared.pooled(*factors), on_demand.pooled(*factors))
        assert np.array_equal(prepared.row_counts(q_block, kv_block), on_demand.row_counts(q_block, kv_block))
        assert prepared.density(q_block, kv_block) == on_demand.density(q_block, kv_block)
    keys = [_grouping(q, kv, merge_) for q, kv in granularities for merge_ in MERGES if merge_ == "none" or q < 128]
    prepared.count(keys)
    for key in keys:
        for a, b in zip(prepared.work(*key)[:2], on_demand.work(*key)[:2]):
            assert np.array_equal(a, b), key
