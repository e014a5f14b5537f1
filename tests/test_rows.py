"""Head rows on 128-byte boundaries (kernels/common/rows.py): the copy keeps every value and aligns every head's
row, which tensors count as aligned, and the GNA forward on the launches that copy, against float64 in Triton's
interpreter (float16, as tests/test_head_dims.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim.kernels import gna_attention, reference_attention
from natsim.kernels.common import rows
from natsim.kernels.common.headdim import HEAD_DIMS
from natsim.kernels.gna import dispatch

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
    width = rows.aligned_width(head_dim, dtype)
    assert width >= head_dim and (width * t.element_size()) % rows.ROW_BYTES == 0
    assert width - head_dim < rows.ROW_BYTES // t.element_size()  # the least padding that aligns


@pytest.mark.parametrize("head_dim, aligned", [(64, True), (128, True), (192, True), (40, False), (72, False),
                                               (96, False), (112, False)])
def test_which_rows_count_as_aligned(head_dim, aligned):
    """bf16 rows of 128, 256 or 384 bytes start every head on a line; 80, 144, 192 and 224 bytes do not, unless
    they are views of wider rows that do."""
    t = _aligned_start((1, 3, 5, 4, head_dim), torch.bfloat16)
    assert rows.rows_aligned(t) is aligned
    wide = _aligned_start((1, 3, 5, 4, rows.aligned_width(head_dim, torch.bfloat16)), torch.bfloat16)
    assert rows.rows_aligned(wide[..., :head_dim])
    assert not rows.rows_aligned(wide.view(-1)[8:].as_strided(t.shape, wide.stride()))  # starts 16 bytes off
    assert rows.rows_aligned(_aligned_start((1, 1, 1, 1, head_dim), torch.bfloat16))  # one row: its start alone


def test_only_listed_launches_copy_and_only_misaligned_rows(monkeypatch):
    monkeypatch.setattr(rows, "ALIGNED_ROW_LAUNCHES", frozenset({("dynamic", 64)}))
    misaligned = _aligned_start((1, 4, 8, 3, 72), torch.bfloat16)
    aligned = _aligned_start((1, 4, 8, 3, 64), torch.bfloat16)
    assert rows.copies_rows(("dynamic", 64), misaligned)
    assert not rows.copies_rows(("dynamic", 64), aligned)
    assert not rows.copies_rows(("static", 64), misaligned)
    assert not rows.copies_rows(("dynamic", 128), misaligned)


@settings(max_examples=6, deadline=None)
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
    assert len(copied) == (6 if in_place else 0)  # at preparation, then at the run
    assert all(_head_offsets(t) == {0} for t in copied)
