"""natsim.kernels on small problems: Triton kernels (interpreter on CPU, CUDA on a GPU) vs references.

Every kernel output is checked against the float64 torch reference, every kernel tile count against
natsim's simulator, and the permutation against the brute-force layout of tests/bruteforce.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import natsim
from natsim.window import group_length as natsim_group_length
from natsim.window import window_bounds as natsim_window_bounds
from natsim.kernels import (
    gna_attention,
    gna_attention_permuted,
    gna_tile_counts,
    permute,
    permute_reference,
    reference_attention,
    unpermute,
    unpermute_reference,
)
from natsim.kernels.gna import dispatch, launch
from natsim.kernels.gna.geometry import window_bounds

from bruteforce import attention_mask, multi_d_layout, window_1d

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
FAST = settings(max_examples=10, deadline=None)
# Triton 3.9's interpreter multiplies bfloat16 matrices wrongly in tl.dot (a 16x16 product of random bf16
# values comes back off by 1e10), so bfloat16 cases run on the GPU only and fall back to float16 here.
BF16 = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# --------------------------------------------------------------------------------------------------------
# The window helper


@triton.jit
def _window_probe(START, END, n, length, window, stride, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    start, end = window_bounds(i, length, window, stride, CAUSAL)
    tl.store(START + i, start, mask=i < n)
    tl.store(END + i, end, mask=i < n)


def test_window_helper_matches_natsim_and_brute_force():
    for length, window, stride in [(1, 1, 1), (9, 4, 1), (9, 4, 4), (10, 7, 3), (16, 16, 5), (13, 8, 2)]:
        for causal in (False, True):
            start = torch.empty(length, dtype=torch.int32, device=DEVICE)
            end = torch.empty(length, dtype=torch.int32, device=DEVICE)
            _window_probe[(1,)](start, end, length, length, window, stride, CAUSAL=causal, BLOCK=16)
            i = np.arange(length)
            want_start, want_end = natsim_window_bounds(i, length, window, stride, causal)
            np.testing.assert_array_equal(start.cpu().numpy(), want_start)
            np.testing.assert_array_equal(end.cpu().numpy(), want_end)
            brute = [window_1d(int(x), length, window, stride, causal) for x in i]
            assert brute == list(zip(want_start.tolist(), want_end.tolist()))


# --------------------------------------------------------------------------------------------------------
# Token permutation


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7 if ndim == 3 else 12)) for _ in range(ndim))
    tile = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    dilation = tuple(draw(st.integers(1, max(1, L))) for L in shape)
    return shape, tile, dilation


@FAST
@given(layouts())
def test_permute_places_tokens_as_the_brute_force_layout(layout):
    shape, tile, dilation = layout
    problem = natsim.Problem(shape, 1, 1, dilation)
    _, slot_of, num_tiles = multi_d_layout(problem, tile)
    ids = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32, device=DEVICE)
    x = ids.reshape(1, *shape, 1, 1).expand(2, *shape, 3, 2).contiguous()
    y = permute(x, tile, dilation)
    assert y.shape == (2, num_tiles * math.prod(tile), 3, 2)
    expected = torch.zeros(y.shape[1], device=DEVICE)
    expected[torch.as_tensor(slot_of, device=DEVICE)] = ids
    assert torch.equal(y[1, :, 2, 1], expected)
    assert torch.equal(permute_reference(x, tile, dilation), y)
    assert torch.equal(unpermute(y, shape, tile, dilation), x)
    assert torch.equal(unpermute_reference(y, shape, tile, dilation), x)


def test_permute_round_trip_is_exact_for_every_dtype():
    """Padded tiles and three dilation groups, every value's bits kept (one batch of one head: the placement of
    batches and heads is the test above's)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.randn(1, 5, 6, 7, 1, 8, device=DEVICE).to(dtype)
        y = permute(x, (2, 4, 2), (1, 2, 3))
        assert torch.equal(unpermute(y, (5, 6, 7), (2, 4, 2), (1, 2, 3)), x)


# --------------------------------------------------------------------------------------------------------
# Attention output vs the float64 reference

CASES = [
    # shape, window, stride, dilation, causal, q_tile, kv_tile, head_dim, dtype
    ((40,), 8, 1, 1, False, 16, 16, 32, torch.float16),  # even window
    ((37,), 7, 3, 2, True, 16, 32, 64, BF16),  # causal, dilation, padding
    ((9, 11), (4, 5), (2, 1), (2, 1), (False, True), (4, 4), (4, 8), 32, torch.float16),
    ((8, 12), (8, 4), (8, 4), 1, False, (4, 4), (4, 4), 32, BF16),  # stride = window
    ((5, 6, 7), (3, 4, 2), (1, 2, 2), (1, 1, 3), (True, False, False), (2, 4, 2), (4, 2, 2), 32, torch.float16),
    ((4, 5, 6), (4, 5, 6), 1, 1, False, (2, 2, 4), (2, 4, 2), 32, torch.float16),  # dense, padding
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_attention_matches_float64_reference(case, monkeypatch):
    shape, window, stride, dilation, causal, q_tile, kv_tile, head_dim, dtype = case
    torch.manual_seed(hash(shape) % 1000)
    q, k, v = (torch.randn(1, *shape, 2, head_dim, device=DEVICE).to(dtype) for _ in range(3))
    poisoned = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)  # noqa: E731
    monkeypatch.setattr(launch, "new_output", poisoned)
    out, lse = gna_attention(q, k, v, window, stride, dilation, causal, q_tile=q_tile, kv_tile=kv_tile,
                             return_lse=True)
    monkeypatch.undo()
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), window, stride, dilation, causal,
                                       return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]
    assert torch.allclose(lse.double(), ref_lse, atol=1e-2)


def test_fused_path_equals_permute_kernel_unpermute():
    shape, window, stride, dilation, tile = (6, 10), (3, 4), (1, 2), (2, 1), (2, 8)
    q, k, v = (torch.randn(1, *shape, 2, 32, device=DEVICE).half() for _ in range(3))
    fused = gna_attention(q, k, v, window, stride, dilation, q_tile=tile, kv_tile=tile)
    problem = natsim.Problem(shape, window, stride, dilation)
    qp, kp, vp = (permute(t, tile, dilation) for t in (q, k, v))
    manual = unpermute(gna_attention_permuted(qp, kp, vp, problem, tile, tile), shape, tile, dilation)
    assert torch.equal(fused, manual)


def test_reference_mask_is_the_brute_force_mask():
    problem = natsim.Problem((5, 6), (3, 4), (1, 3), (1, 1), (True, False))
    n = problem.num_tokens
    q = torch.zeros(1, 5, 6, 1, 1, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).reshape(n, 5, 6, 1, 1).permute(1, 2, 3, 0, 4).reshape(1, 5, 6, 1, n)
    # with equal scores the output row of a query is uniform over the keys it attends
    out = reference_attention(q.expand(1, 5, 6, 1, n), q.expand(1, 5, 6, 1, n), v, (3, 4), (1, 3), 1,
                              (True, False))
    assert np.array_equal(out.reshape(n, n).numpy() > 0, attention_mask(problem))


# --------------------------------------------------------------------------------------------------------
# Kernel tile counts vs the simulator


@st.composite
def kernel_problems(draw):
    """A problem of at most ~128 tokens and tiles of 16 to 64 tokens the kernel can run: still several tiles
    along a dimension, padded ones and partial windows. (Up to 200 tokens, 14x14 and 6x6x6, an example cost
    the interpreter a third more on average and up to three times as much at the tail.)"""
    ndim = draw(st.integers(1, 3))
    budget = {1: 128, 2: 10, 3: 5}[ndim]
    shape = tuple(draw(st.integers(1, budget)) for _ in range(ndim))
    dims = []
    for L in shape:
        d = draw(st.integers(1, min(L, 3)))
        w = draw(st.integers(1, L // d))
        s = draw(st.integers(1, w))
        dims.append((w, s, d, draw(st.booleans())))
    w, s, d, c = zip(*dims)
    problem = natsim.Problem(shape, w, s, d, c)
    tiles = []
    for _ in range(2):
        exps = [0] * ndim
        for _ in range(draw(st.integers(4, 6))):
            exps[draw(st.integers(0, ndim - 1))] += 1
        tiles.append(tuple(2**e for e in exps))
    return problem, tiles[0], tiles[1]


@FAST
@given(kernel_problems())
def test_kernel_tile_counts_equal_simulator(case):
    problem, q_tile, kv_tile = case
    visited, unmasked = gna_tile_counts(problem.shape, problem.window, problem.stride, problem.dilation,
                                        problem.causal, q_tile, kv_tile, device=DEVICE)
    sim = natsim.simulate(problem, natsim.TileConfig(q_tile, kv_tile), per_q_tile=True)
    np.testing.assert_array_equal(visited, sim.per_q_tile_visited)
    np.testing.assert_array_equal(unmasked, sim.per_q_tile_full)


@FAST
@given(kernel_problems())
def test_needs_mask_is_false_exactly_when_every_visited_tile_is_full_and_unpadded(case):
    problem, q_tile, kv_tile = case
    sim = natsim.simulate(problem, natsim.TileConfig(q_tile, kv_tile))
    padded = any(natsim_group_length(L, d, g) % t
                 for L, d, t in zip(problem.shape, problem.dilation, kv_tile) for g in range(d))
    assert launch.needs_mask(problem, q_tile, kv_tile) == (not sim.block_sparse or padded)


@settings(max_examples=8, deadline=None)  # not 12: CASES above run the edges (padding, dilation, causal...) every time
@given(kernel_problems(), st.integers(0, 2**16))
def test_kernel_output_matches_reference_on_random_problems(case, seed):
    """Both KV loops (full box, then the six slabs of partial tiles) on random shapes, windows and tiles."""
    problem, q_tile, kv_tile = case
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, *problem.shape, 1, 32, device=DEVICE).half() for _ in range(3))
    out = gna_attention(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal,
                        q_tile=q_tile, kv_tile=kv_tile)
    ref = reference_attention(q.double(), k.double(), v.double(), problem.window, problem.stride,
                              problem.dilation, problem.causal)
    assert rel_error(out, ref) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("options", [dict(USE_TMA=False), dict(USE_TMA=True), dict(USE_TMA=True, MASKED=True)],
                         ids=["pointers", "descriptors", "descriptors-masked"])
@pytest.mark.parametrize("stride", [(1, 2), (4, 8)], ids=["partial-tiles", "block-sparse"])
def test_kernel_load_paths_and_mask_switch_agree(options, stride):
    """Pointer loads and tensor descriptors, and the masked loops forced on a block-sparse problem."""
    problem, tile = natsim.Problem((8, 16), (4, 8), stride), (4, 8)
    q, k, v = (permute(torch.randn(1, 8, 16, 2, 32, device=DEVICE).half(), tile) for _ in range(3))
    out = gna_attention_permuted(q, k, v, problem, tile, tile, config=options)
    ref = reference_attention(*(unpermute(t, (8, 16), tile).double() for t in (q, k, v)), (4, 8), stride)
    assert rel_error(unpermute(out, (8, 16), tile), ref) < TOLERANCE[torch.float16]


# --------------------------------------------------------------------------------------------------------
# Boundary checks and the CPU fallback


def _qkv(*shape, dtype=torch.float16):
    return [torch.randn(*shape, device=DEVICE).to(dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda q, k, v: (q, k[:, :-1], v, {}), ValueError, "same shape"),
        (lambda q, k, v: (q, k.float(), v, {}), ValueError, "same dtype"),
        (lambda q, k, v: (q.float(), k.float(), v.float(), {}), ValueError, "float16 and bfloat16"),
        (lambda q, k, v: (q[..., :20], k[..., :20], v[..., :20], {}), ValueError, "head_dim 16 to 256 in steps of 8"),
        (lambda q, k, v: (q, k, v, {"window": 9}), ValueError, "window \\* dilation"),
        (lambda q, k, v: (q, k, v, {"stride": 5}), ValueError, "stride cannot be larger"),
        (lambda q, k, v: (q, k, v, {"q_tile": (2, 3)}), ValueError, "power-of-two"),
        (lambda q, k, v: (q, k, v, {"kv_tile": (32, 32)}), ValueError, "between 16 and 256"),
        (lambda q, k, v: (q, k, v, {"q_tile": (4, 4, 4), "kv_tile": (4, 4, 4)}), ValueError, "one size per dimension"),
        (lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0], {}), ValueError, "batch, \\*spatial, heads"),
        (lambda q, k, v: (q.numpy(), k, v, {}), TypeError, "torch.Tensor"),
    ],
)
def test_bad_arguments_raise_sentences(change, error, message):
    q, k, v = _qkv(1, 8, 8, 2, 32)
    q, k, v, kwargs = change(q.cpu() if DEVICE == "cpu" else q, k, v)
    kwargs = {"window": 4, **kwargs}
    with pytest.raises(error, match=message):
        gna_attention(q, k, v, **kwargs)


def test_cpu_tensors_run_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "_warned_cpu", False)
    q, k, v = (torch.randn(1, 6, 7, 2, 16, dtype=torch.float32) for _ in range(3))
    with pytest.warns(UserWarning, match="torch reference"):
        out = gna_attention(q, k, v, (3, 4))
    assert torch.equal(out, reference_attention(q, k, v, (3, 4)))
    with _no_warning():
        gna_attention(q, k, v, (3, 4))


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not self.records, [str(r.message) for r in self.records]
