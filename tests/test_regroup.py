"""Ulysses' head regrouping copies (kernels/common/regroup.py) against indexing, one head at a time: the Triton
kernel (the interpreter on CPU, the GPU where marked) and the torch path, for 1-3 tensors, uneven spans, rows
that are strided views (a slice of a fused q/k/v projection) and tensors whose rows are not contiguous (torch)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim.kernels import pack_head_blocks, place_head_blocks
from natsim.kernels.common import regroup
from natsim.kernels.common.backend import use_triton


@contextlib.contextmanager
def counted_launches():
    """The kernel's launches while inside, as a list of their `TO_BLOCKS` switches (the kernel still runs)."""
    kernel, launches = regroup._regroup_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append(kwargs["TO_BLOCKS"])
                return kernel[grid](*args, **kwargs)
            return run

    regroup._regroup_kernel = Spy()
    try:
        yield launches
    finally:
        regroup._regroup_kernel = kernel


def _kernel_runs(tensor: torch.Tensor, layout: str) -> bool:
    """Whether the Triton kernel (not the torch copy) takes this tensor: rows of contiguous heads, where Triton
    runs (a GPU or the interpreter)."""
    return use_triton(tensor) and layout != "transposed"


@st.composite
def regroupings(draw):
    parts = draw(st.integers(1, 4))
    per_rank = draw(st.integers(1, 4))
    lo = draw(st.integers(0, per_rank - 1))
    hi = draw(st.integers(lo + 1, per_rank))
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    head_dim = draw(st.sampled_from([8, 16, 24, 64]))
    count = draw(st.integers(1, 3))
    layout = draw(st.sampled_from(["contiguous", "fused", "transposed", "mixed"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    heads = parts * per_rank - draw(st.integers(0, parts - 1))  # padded up to parts * per_rank when short
    return parts, per_rank, heads, (lo, hi), lead, head_dim, count, layout, dtype


def _tensors(lead, heads, head_dim, count, layout, dtype, device="cpu", seed=0):
    """`count` tensors `[*lead, heads, head_dim]` laid out as asked: contiguous, slices of a fused
    `[*lead, 3, heads, head_dim]` tensor (rows strided), a contiguous one and fused slices ("mixed"), or with
    their last two dimensions' storage transposed."""
    generator = torch.Generator(device).manual_seed(seed)
    if layout == "mixed":  # one contiguous tensor beside slices of a fused one: rows of different strides
        rest = _tensors(lead, heads, head_dim, count - 1, "fused", dtype, device, seed + 1)
        return [torch.randn(*lead, heads, head_dim, generator=generator, device=device).to(dtype), *rest]
    if layout == "fused":
        fused = torch.randn(*lead, 3, heads, head_dim, generator=generator, device=device).to(dtype)
        return [fused[..., i, :, :] for i in range(count)]
    if layout == "transposed":
        return [torch.randn(*lead, head_dim, heads, generator=generator, device=device).to(dtype).transpose(-1, -2)
                for _ in range(count)]
    return [torch.randn(*lead, heads, head_dim, generator=generator, device=device).to(dtype) for _ in range(count)]


def _expected_blocks(tensors, parts, per_rank, span):
    """Each rank's heads of the span, one head at a time; heads past the tensors' own as zeros."""
    lo, hi = span
    heads = tensors[0].shape[-2]

    def head(x, index):
        return x[..., index, :] if index < heads else torch.zeros_like(x[..., 0, :])

    return torch.stack([torch.stack([torch.stack([head(x, j * per_rank + i) for i in range(lo, hi)], dim=-2)
                                     for j in range(parts)]) for x in tensors])


@settings(max_examples=30, deadline=None)
@given(regroupings())
def test_pack_equals_indexing(case):
    parts, per_rank, heads, span, lead, head_dim, count, layout, dtype = case
    tensors = _tensors(lead, heads, head_dim, count, layout, dtype)
    with counted_launches() as launches:
        packed = pack_head_blocks(tensors, parts, span)
    assert launches == ([True] if _kernel_runs(tensors[0], layout) else [])
    assert packed.shape == (count, parts, *lead, span[1] - span[0], head_dim)
    assert packed[0, 0].is_contiguous()
    assert torch.equal(packed, _expected_blocks(tensors, parts, per_rank, span))


@settings(max_examples=30, deadline=None)
@given(regroupings())
def test_place_inverts_pack_and_leaves_other_heads(case):
    parts, per_rank, heads, span, lead, head_dim, _, layout, dtype = case
    (out,) = _tensors(lead, heads, head_dim, 1, layout, dtype, seed=1)
    before = out.clone()
    blocks = torch.randn(parts, *lead, span[1] - span[0], head_dim).to(dtype)
    with counted_launches() as launches:
        place_head_blocks(blocks, out, parts, span)
    assert launches == ([False] if _kernel_runs(out, layout) else [])
    lo, hi = span
    for j in range(parts):
        for i in range(lo, hi):
            if j * per_rank + i < heads:  # padded heads are not placed
                assert torch.equal(out[..., j * per_rank + i, :], blocks[j][..., i - lo, :])
                before[..., j * per_rank + i, :] = blocks[j][..., i - lo, :]
    assert torch.equal(out, before)
    repacked = pack_head_blocks([out], parts, span)[0]
    assert torch.equal(repacked, _expected_blocks([out], parts, per_rank, span)[0])


def test_refusals_name_the_problem():
    x = torch.randn(2, 6, 8)
    with pytest.raises(ValueError, match="parts must be at least 1"):
        pack_head_blocks([x], 0, (0, 1))
    with pytest.raises(ValueError, match=r"heads \[lo, hi\) of the 3"):
        pack_head_blocks([x], 2, (1, 4))
    with pytest.raises(ValueError, match="share shape, dtype and device"):
        pack_head_blocks([x, torch.randn(2, 6, 16)], 2, (0, 1))
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        pack_head_blocks([x] * 4, 2, (0, 1))
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        place_head_blocks(torch.randn(2, 2, 2, 8), x, 2, (0, 1))
    with pytest.raises(ValueError, match="do not record gradients"):
        pack_head_blocks([x.requires_grad_()], 2, (0, 1))
    with torch.no_grad():
        assert pack_head_blocks([x], 2, (0, 1)).shape == (1, 2, 2, 1, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "fused", "mixed"])
@pytest.mark.parametrize("parts,heads,span", [(2, 12, (0, 2)), (4, 40, (3, 7)), (8, 40, (4, 5)), (8, 12, (0, 2)),
                                              (3, 5, (1, 2))])
def test_regroup_on_the_gpu_equals_indexing(layout, parts, heads, span):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    per_rank = -(-heads // parts)
    tensors = _tensors((1, 4, 45, 80), heads, 128, 3, layout, torch.bfloat16, device="cuda")
    packed = pack_head_blocks(tensors, parts, span)
    assert torch.equal(packed, _expected_blocks(tensors, parts, per_rank, span))
    out = torch.zeros_like(tensors[0])
    place_head_blocks(packed[0], out, parts, span)
    assert torch.equal(pack_head_blocks([out], parts, span)[0], packed[0])
