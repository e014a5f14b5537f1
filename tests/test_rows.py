"""Head rows on 128-byte boundaries (kernels/common/rows.py): the copy keeps every value and aligns every head's
row, which tensors count as aligned, and the GNA forward on the launches that copy, against float64 in Triton's
interpreter (float16, as tests/test_head_dims.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim import TileConfig
from natsim.kernels import gna_attention, reference_attention
from natsim.kernels.common import rows
from natsim.kernels.common.headdim import HEAD_DIMS
from natsim.kernels.gna import dispatch
from natsim.planner.cost.features import FEATURES, copies_rows_of, feature_matrix

from test_head_dims import TOLERANCE, qkv, rel_error
from test_kernels import kernel_problems

def _head_offsets(t: torch.Tensor) -> set[int]:
    """Byte offsets, modulo 128, of every head row's start from the tensor's first element."""
    strides, size = t.stride()[:-1], t.element_size()
    return {sum(i * s for i, s in zip(index, strides)) * size % rows.ROW_BYTES
            for index in itertools.product(*(range(n) for n in t.shape[:-1]))}


def _aligned_start(shape, dtype) -> torch.Tensor:
    """A tensor of `shape` whose first element sits on a 128-byte boundary (CPU allocations promise 64)."""
    count = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    buffer = torch.zeros(count + rows.ROW_BYTES // size, dtype=dtype)
    skip = (-buffer.data_ptr() % rows.ROW_BYTES) // size
    return buffer[skip:skip + count].view(shape)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(HEAD_DIMS), st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(1, 5))
def test_the_copy_keeps_the_values_and_starts_every_head_row_on_a_line(head_dim, dtype, shape, heads):
    t = torch.randn(1, *shape, heads, head_dim).to(dtype)
    copy = rows.in_aligned_rows(t)
    assert copy.shape == t.shape and torch.equal(copy, t)
    assert _head_offsets(copy) == {0}
    width = rows.aligned_width(head_dim, t.element_size())
    assert width >= head_dim and (width * t.element_size()) % rows.ROW_BYTES == 0
    assert width - head_dim < rows.ROW_BYTES // t.element_size()  # the least padding that aligns


@pytest.mark.parametrize("head_dim, expected", [(64, 128), (128, 128), (192, 128), (40, 16), (72, 16), (88, 16),
                                                (96, 64), (112, 32)])
def test_the_alignment_of_head_rows(head_dim, expected):
    """bf16 rows of 128, 256 or 384 bytes start every head on a line; 80, 144 and 176 bytes on 16-byte
    boundaries, 192 on 64, 224 on 32; views of wider rows on lines, wherever they start."""
    t = _aligned_start((1, 3, 5, 4, head_dim), torch.bfloat16)
    assert rows.alignment(t) == expected == rows.layout_alignment(head_dim, 2)
    wide = _aligned_start((1, 3, 5, 4, rows.aligned_width(head_dim, 2)), torch.bfloat16)
    assert rows.alignment(wide[..., :head_dim]) == rows.ROW_BYTES
    assert rows.alignment(wide.view(-1)[8:].as_strided(t.shape, wide.stride())) == 16  # starts 16 bytes off
    assert rows.alignment(_aligned_start((1, 1, 1, 1, head_dim), torch.bfloat16)) == rows.ROW_BYTES  # one row


def test_only_listed_launches_copy_and_only_rows_below_64_bytes(monkeypatch):
    monkeypatch.setattr(rows, "ALIGNED_ROW_LAUNCHES", frozenset({("dynamic", 64)}))
    for head_dim, copies in ((40, True), (72, True), (112, True), (96, False), (64, False), (128, False)):
        t = _aligned_start((1, 4, 8, 3, head_dim), torch.bfloat16)
        assert rows.copies_rows(("dynamic", 64), t) is copies == rows.copies_layout_rows(("dynamic", 64), head_dim, 2)
        assert not rows.copies_rows(("static", 64), t) and not rows.copies_rows(("dynamic", 128), t)
        assert not rows.copies_layout_rows(("static", 128), head_dim, 2)
    assert rows.copies_layout_rows(("dynamic", 64), 72, 4)  # float32 rows of 288 bytes: on 32-byte boundaries
    assert not rows.copies_layout_rows(("dynamic", 64), 96, 4)  # 384 bytes: on lines


@settings(max_examples=4, deadline=None)
@given(kernel_problems(), st.sampled_from([24, 40, 72, 96]), st.sampled_from(["static", "dynamic"]),
       st.integers(0, 2**16))
def test_gna_forward_on_copied_rows_matches_float64(case, head_dim, kv_tiling, seed):
    """Random 1-D to 3-D geometries (windows, strides, dilation, causal, padding at the borders) and tiles, every
    launch copying: a call in place runs on the copies (checked), a permuted one copies nothing more, and both
    agree with the float64 reference."""
    problem, q_tile, kv_tile = case
    q, k, v = qkv(problem.shape, head_dim, seed, heads=2)
    launches, copied = [], []

    def copying(launch, t):
        launches.append(launch)
        return True

    def recording(t):
        copied.append(rows.in_aligned_rows(t))
        return copied[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "copies_rows", copying)
        patch.setattr(dispatch, "in_aligned_rows", recording)
        patch.setattr(dispatch, "_calls", {})
        out, lse = gna_attention(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal,
                                 q_tile=q_tile, kv_tile=kv_tile, kv_tiling=kv_tiling, return_lse=True)
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), problem.window, problem.stride,
                                       problem.dilation, problem.causal, return_lse=True)
    assert out.shape == q.shape and rel_error(out, ref) < TOLERANCE
    assert torch.allclose(lse.double(), ref_lse, atol=1e-2)
    in_place = all(d == 1 for d in problem.dilation)  # dilation takes the permuted path, which copies anyway
    assert launches == ([(kv_tiling, math.prod(q_tile))] if in_place else [])
    assert len(copied) == (3 if in_place else 0)  # at the run: the preparation takes the copies' strides alone
    assert all(_head_offsets(t) == {0} for t in copied)


def test_the_planner_prices_the_copy_where_a_launch_makes_it():
    """In place, the dynamic kernel's 64-token tiles at 72 bf16 channels copy q, k, v (read at 72 channels,
    written at 128); at 96, on the static kernel, in FP8 or on the permuted path nothing is copied."""
    tiles = [TileConfig((2, 8, 4), (2, 8, 4), kv_tiling="dynamic"), TileConfig((2, 8, 4), (2, 8, 4)),
             TileConfig((2, 8, 8), (2, 8, 8), kv_tiling="dynamic")]
    assert copies_rows_of(tiles, head_dim=72, element_bytes=2, permutation=False).tolist() == [True, False, False]
    assert not copies_rows_of(tiles, head_dim=96, element_bytes=2, permutation=False).any()
    assert not copies_rows_of(tiles, head_dim=72, element_bytes=2, permutation=True).any()
    assert not copies_rows_of(tiles, head_dim=72, element_bytes=2, permutation=False, quantized=True).any()
    common = dict(full_tiles=np.array([10.0]), visited_tiles=np.array([20.0]), q_tokens=np.array([64]),
                  kv_tokens=np.array([64]), q_padded=np.array([4096]), kv_padded=np.array([4096]), tokens=4000,
                  batch_heads=6, head_dim=72, element_bytes=2, permutation=False)
    index = FEATURES.index("permute_bytes")
    plain, copied = (feature_matrix(**common, copied_rows=np.array([c]))[0, index] for c in (False, True))
    assert plain == 0.0 and copied == 3 * 4000 * 6 * (72 + 128) * 2


def test_copying_calls_compile_whole_and_differentiate_like_float64():
    """A call that copies its rows (every launch copying), compiled with fullgraph and differentiated: output and
    gradients against float64 (the backward reads the rows as given)."""
    shape, window, stride = (6, 10), (3, 5), (1, 2)
    q, k, v, g = qkv(shape, 40, seed=5, heads=2, count=4)
    for t in (q, k, v):
        t.requires_grad_()

    def loss(q, k, v):
        return (gna_attention(q, k, v, window, stride, kv_tiling="dynamic").float() * g.float()).sum()

    copied = []

    def recording(t):
        copied.append(t.shape)
        return rows.in_aligned_rows(t)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "copies_rows", lambda launch, t: True)
        patch.setattr(dispatch, "in_aligned_rows", recording)
        patch.setattr(dispatch, "_calls", {})
        torch._dynamo.reset()
        value = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v)
        got = torch.autograd.grad(value, (q, k, v))
    assert len(copied) >= 3  # the forward ran on copies
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_value = (reference_attention(*inputs, window, stride) * g.double()).sum()
    want = torch.autograd.grad(want_value, inputs)
    assert abs(value.item() - want_value.item()) < 1e-2 * max(1.0, abs(want_value.item()))
    for a, b in zip(got, want):
        assert rel_error(a, b) < 1e-2
    torch._dynamo.reset()
