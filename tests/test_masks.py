"""natsim.masks (masks/): the Hilbert order, mask combination and the GNA window as a block
mask (the predictors and the mask cache: tests/test_predictors.py).

The references here are written from the definitions: the GNA mask from tests/bruteforce.py's exact N x N
mask OR-pooled over blocks, combinations as numpy booleans.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import natsim
from natsim.masks import (
    from_order,
    gna_block_mask,
    hilbert_inverse,
    hilbert_order,
    intersection,
    keep_global,
    to_order,
    topp,
    union,
)

sys.path.insert(0, str(Path(__file__).parent))
import bruteforce  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VIDEO_SHAPES = [(30, 48, 80), (21, 30, 52), (13, 24, 40), (60, 104), (90, 160)]


def walk(shape) -> np.ndarray:
    """`[N, ndim]` coordinates of the tokens in Hilbert order."""
    return bruteforce.coordinates(shape)[hilbert_order(shape)]


def steps(shape) -> np.ndarray:
    """Manhattan distance between consecutive tokens of the Hilbert order."""
    return np.abs(np.diff(walk(shape), axis=0)).sum(1)


def mean_tile_extent(coords: np.ndarray, tile: int = 64) -> float:
    """Mean over full tiles of `tile` consecutive tokens of the longest side of the tile's bounding box."""
    n = len(coords) // tile * tile
    tiles = coords[:n].reshape(-1, tile, coords.shape[1])
    return float((tiles.max(1) - tiles.min(1) + 1).max(1).mean())


# -- Hilbert order ----------------------------------------------------------------------------------------------


def test_import_natsim_leaves_torch_out():
    code = "import sys, natsim; assert 'torch' not in sys.modules and 'natsim.masks' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@SETTINGS
@given(st.lists(st.integers(1, 40), min_size=2, max_size=3))
def test_hilbert_order_is_a_permutation_and_inverts(shape):
    order = hilbert_order(shape)
    n = int(np.prod(shape))
    assert order.dtype == np.int64 and order.shape == (n,)
    assert np.array_equal(np.sort(order), np.arange(n))
    inverse = hilbert_inverse(order)
    assert np.array_equal(inverse[order], np.arange(n)) and np.array_equal(order[inverse], np.arange(n))


@pytest.mark.parametrize("shape", [(2, 2), (8, 8), (64, 64), (2, 2, 2), (4, 4, 4), (16, 16, 16)])
def test_hilbert_steps_to_neighbours_on_power_of_two_cubes(shape):
    assert (steps(shape) == 1).all()
    assert (walk(shape)[0] == 0).all()


@SETTINGS
@given(st.lists(st.integers(4, 40), min_size=2, max_size=3))
def test_hilbert_order_is_local_on_any_shape(shape):
    assert steps(shape).mean() < 1.5


@pytest.mark.parametrize("shape", VIDEO_SHAPES)
def test_hilbert_tiles_are_compact_on_video_layouts(shape):
    """64 consecutive tokens span at most a quarter of the row-major tiles' longest side, and almost every
    step is to a neighbour."""
    hilbert, row_major = mean_tile_extent(walk(shape)), mean_tile_extent(bruteforce.coordinates(shape))
    assert hilbert <= row_major / 4, (hilbert, row_major)
    assert (steps(shape) == 1).mean() > 0.98


def test_hilbert_order_is_fast():
    import time

    start = time.perf_counter()
    hilbert_order((30, 48, 80))
    assert time.perf_counter() - start < 0.5


def test_to_order_and_back():
    shape = (3, 5, 6)
    x = torch.randn(2, 90, 3, 8)
    order = hilbert_order(shape)
    y = to_order(x, order)
    assert torch.equal(y, x[:, torch.from_numpy(order)])
    assert torch.equal(from_order(y, order), x)
    assert torch.equal(from_order(to_order(x, torch.from_numpy(order)), torch.from_numpy(order)), x)
    # an order that is not a permutation (a token twice, another missing, or out of range) is refused
    for bad in (np.array([0, 0, *range(1, 89)]), np.arange(1, 91), np.arange(90) * 1.0):
        for move in (to_order, from_order):
            with pytest.raises(ValueError, match="order must be a permutation of the 90 tokens"):
                move(x, bad)


# -- combining masks and the GNA window ------------------------------------------------------------------------


def test_union_and_intersection_broadcast_like_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.random((2, 1, 5, 7)) < 0.4, rng.random((1, 3, 5, 7)) < 0.4
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert np.array_equal(union(ta, tb).numpy(), a | b) and union(ta, tb).shape == (2, 3, 5, 7)
    assert np.array_equal(intersection(ta, tb).numpy(), a & b)


def test_keep_global_marks_rows_and_columns():
    rng = np.random.default_rng(1)
    a = rng.random((1, 2, 6, 9)) < 0.2
    out = keep_global(torch.from_numpy(a), rows=[0, 5], cols=range(2)).numpy()
    expected = a.copy()
    expected[:, :, [0, 5], :] = True
    expected[:, :, :, [0, 1]] = True
    assert np.array_equal(out, expected)
    assert np.array_equal(keep_global(torch.from_numpy(a)).numpy(), a)


def block_pool(mask: np.ndarray, q_block: int, kv_block: int) -> np.ndarray:
    """OR-pool an `[N, N]` token mask over blocks of q_block rows and kv_block columns."""
    n = mask.shape[0]
    num_q, num_kv = -(-n // q_block), -(-n // kv_block)
    out = np.zeros((num_q, num_kv), dtype=bool)
    for i in range(num_q):
        for j in range(num_kv):
            out[i, j] = mask[i * q_block:(i + 1) * q_block, j * kv_block:(j + 1) * kv_block].any()
    return out


@SETTINGS
@given(problem=bruteforce.problems(max_tokens=300), q_block=st.sampled_from([8, 16, 32]),
       kv_block=st.sampled_from([1, 4, 16, 32]))
def test_gna_block_mask_matches_the_window_formula(problem, q_block, kv_block):
    mask = gna_block_mask(problem.shape, problem.window, problem.stride, problem.dilation, problem.causal,
                          q_block=q_block, kv_block=kv_block)
    expected = block_pool(bruteforce.attention_mask(problem), q_block, kv_block)
    assert mask.dtype == torch.bool and mask.shape == (1, 1) + expected.shape
    assert np.array_equal(mask[0, 0].numpy(), expected)


def test_topp_with_a_gna_window_runs_sparse_attention():
    from natsim.kernels import sparse_attention, sparse_reference

    shape, q_block, kv_block = (4, 6, 8), 16, 16
    n = int(np.prod(shape))
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, 2, 32, generator=gen, dtype=torch.float16) for _ in range(3))
    mask = union(topp(q, k, q_block, kv_block, 0.5), gna_block_mask(shape, (3, 3, 3), q_block=q_block,
                                                                     kv_block=kv_block))
    out = sparse_attention(q, k, v, mask, q_block, kv_block)
    expected = sparse_reference(q.float(), k.float(), v.float(), mask, q_block, kv_block)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


# -- bad inputs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, match", [
    ((5,), "shape must be a 2-D or 3-D layout"),
    ((2, 3, 4, 5), "shape must be a 2-D or 3-D layout"),
    (7, "shape must be a 2-D or 3-D layout"),
    ((4, 0), "shape must hold positive ints"),
    ((4, 2.5), "shape must hold positive ints"),
])
def test_hilbert_order_refuses_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        hilbert_order(shape)


def test_bad_inputs_raise_sentences():
    q = torch.randn(1, 64, 2, 16)
    with pytest.raises(ValueError, match=r"order must be a 1-D integer permutation"):
        hilbert_inverse(np.array([0, 0, 1]))
    with pytest.raises(ValueError, match=r"order must be a permutation of the 64 tokens"):
        to_order(q, np.arange(10))
    with pytest.raises(ValueError, match=r"p must be a probability in \(0, 1\], got p=0"):
        topp(q, q, 16, 16, 0)
    with pytest.raises(ValueError, match=r"p must be a probability in \(0, 1\], got p=1.5"):
        topp(q, q, 16, 16, 1.5)
    with pytest.raises(ValueError, match=r"q_block must be a power of two between 8 and 128, got q_block=12"):
        topp(q, q, 12, 16, 0.5)
    with pytest.raises(ValueError, match=r"q and k must be \[batch, tokens, heads, head_dim\] tensors of one"):
        topp(q, q[:, :32], 16, 16, 0.5)
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got ndarray"):
        topp(q, q.numpy(), 16, 16, 0.5)
    a = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"a and b must be masks over one block grid"):
        union(a, torch.ones(1, 1, 4, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"a and b must have batch and head dimensions that are equal or 1"):
        intersection(torch.ones(2, 1, 4, 4, dtype=torch.bool), torch.ones(3, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"b must be a boolean \[B or 1, H or 1, q blocks, kv blocks\] tensor"):
        union(a, a.float())
    with pytest.raises(ValueError, match=r"rows must be block indices in \[0, 4\), got rows holding \[4\]"):
        keep_global(a, rows=[1, 4])
    with pytest.raises(ValueError, match=r"window \* dilation cannot be larger than the layout"):
        gna_block_mask((4, 4), 5, q_block=16, kv_block=16)
    with pytest.raises(ValueError, match=r"kv_block must be a power of two between 1 and 128, got kv_block=256"):
        gna_block_mask((4, 4), 3, q_block=16, kv_block=256)


def test_natsim_masks_exports_every_public_name():
    import natsim.masks as masks

    assert all(callable(getattr(masks, name)) for name in masks.__all__)
    assert natsim.masks is masks
