"""Head dims that are not powers of two (kernels/common/headdim.py): how a width is split into column chunks, and
the GNA and block-mask kernels, forward and backward, at widths 16 to 256 against float64 references: named
widths on every data path, and widths drawn from all of them on random problems and masks.

On this CPU machine the kernels run in Triton's interpreter (tests/conftest.py), in float16 (the interpreter's
bfloat16 products are wrong), on tiny problems with one head: each width runs one data path, the paths taking
turns over the widths, so that every path meets a split width and a padded one.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import natsim
from natsim.kernels import (gna_attention, gna_attention_permuted, permute, reference_attention, sparse_attention,
                            sparse_reference, unpermute)
from natsim.kernels.common.fp8 import FP8_HEAD_DIMS, fp8_head_split
from natsim.kernels.common.headdim import HEAD_DIMS, PADDED_LAUNCHES, PADDED_WIDTHS, HeadSplit, head_split
from natsim.kernels.gna import dispatch, launch
from natsim.kernels.gna.backward import backward_tiles, gna_backward
from natsim.kernels.gna.reference import fp8_reference_attention
from natsim.kernels.gna.tiles import TILE_TOKENS, WIDE_TILE_TOKENS, catalog
from natsim.kernels.sparse.backward import sparse_backward

from bruteforce import attention_mask
from test_kernels import kernel_problems

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 5e-3  # float16 against float64
GRADIENT_TOLERANCE = 1e-2
# Widths the kernels run split (40 = 32 + 16, 72 = 64 + 16, 96 = 64 + 32, 136 = 128 + 16) or padded (24 to 32,
# 112 to 128), and powers of two at both ends.
WIDTHS = (16, 24, 40, 72, 96, 112, 136, 256)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def gradient_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """As tests/test_backward.py: a floor of 1e-2 per element under the norm (gradients of order one)."""
    floor = 1e-2 * math.sqrt(want.numel())
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(floor)).item()


def qkv(shape, head_dim, seed, heads=1, count=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, *shape, heads, head_dim, generator=generator).half().to(DEVICE) for _ in range(count)]


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# -- the column chunks ------------------------------------------------------------------------------------------


def test_every_width_runs_in_power_of_two_chunks_that_cover_it():
    assert HEAD_DIMS == tuple(range(16, 257, 8))
    for head_dim in HEAD_DIMS:
        for strategy in (None, "pad", "split"):
            split = head_split(head_dim, strategy)
            assert split.head_dim == head_dim and split.a + split.b >= head_dim
            assert all(c == 0 or (c >= 16 and c & (c - 1) == 0) for c in (split.a, split.b))
            assert split.b == 0 or split.a < head_dim  # a second chunk starts inside the head
            padded = 1 << (head_dim - 1).bit_length()
            assert split.width <= padded
        assert head_split(head_dim, "pad") == HeadSplit(head_dim, 1 << (head_dim - 1).bit_length())
        # the default splits exactly where that computes fewer columns than padding
        default, pad = head_split(head_dim), head_split(head_dim, "pad")
        assert (default.b > 0) == (head_split(head_dim, "split").width < pad.width and head_dim not in PADDED_WIDTHS)
        # launches measured faster padded pad every width; the others keep the width's default
        for launch in PADDED_LAUNCHES:  # up to 128 columns: padding past them (to 256) was not measured
            assert head_split(head_dim, launch=launch) == (pad if pad.width <= 128 else default)
        assert head_split(head_dim, launch=("dynamic", 64)) == head_split(head_dim, launch=("static", 128)) == default
        assert head_split(head_dim, "split", launch=("dynamic", 128)) == head_split(head_dim, "split")


@pytest.mark.parametrize("head_dim, chunks", [(72, (64, 16)), (96, (64, 32)), (40, (32, 16)), (136, (128, 16)),
                                              (88, (64, 32)), (112, (128, 0)), (24, (32, 0)), (128, (128, 0))])
def test_default_chunks_of_named_widths(head_dim, chunks):
    assert (head_split(head_dim).a, head_split(head_dim).b) == chunks


def test_catalog_of_a_width_is_that_of_its_computed_width():
    entries = [TILE_TOKENS[32], TILE_TOKENS[32], TILE_TOKENS[64], *[TILE_TOKENS[128]] * 3, *[WIDE_TILE_TOKENS] * 2]
    assert [catalog(d) for d in (16, 24, 40, 72, 96, 112, 136, 256)] == entries
    assert catalog(8) == TILE_TOKENS[32] and set(TILE_TOKENS) == {32, 64, 128}  # the planner's widths
    assert all(q <= 128 and kv <= 64 for q, kv in WIDE_TILE_TOKENS)  # 64-key tiles over 128 columns
    problem = natsim.Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    assert math.prod(backward_tiles(problem, 256)[1]) == 64 and math.prod(backward_tiles(problem, 72)[1]) == 128


def test_unsupported_widths_and_chunks_are_refused_with_sentences():
    q = torch.zeros(1, 8, 8, 1, 20, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 16 to 256 in steps of 8, got head_dim=20"):
        gna_attention(q, q, q, 3)
    q = torch.zeros(1, 32, 1, 264, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="sparse kernel supports head_dim 16 to 256 in steps of 8"):
        sparse_attention(q, q, q, torch.ones(1, 1, 2, 2, dtype=torch.bool), 16, 16)
    with pytest.raises(ValueError, match="must cover head_dim=72"):
        HeadSplit(72, 64)
    with pytest.raises(ValueError, match="power of two"):
        HeadSplit(72, 64, 24)
    with pytest.raises(ValueError, match="strategy must be"):
        head_split(72, "halve")
    assert FP8_HEAD_DIMS == tuple(range(24, 257, 8)) and fp8_head_split(72) == HeadSplit(72, 128)
    q = torch.zeros(1, 8, 8, 1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"FP8 kernel \(precision='fp8'\) supports head_dim 24 to 256"):
        with torch.no_grad():
            gna_attention(q, q, q, 3, precision="fp8")


# -- the GNA forward ----------------------------------------------------------------------------------------------

# One data path per width (kernels/gna/tile_io.py's LAYOUT): the layout in place through rank-4 descriptors,
# permuted tokens (dilation), a 1-D layout in place, the dynamic kernel in place and permuted (gathers).
PATHS = {
    "in-place": ((5, 7), (3, 4), (1, 2), 1, (False, True), (2, 8), (1, 16), "static"),
    "permuted": ((6, 9), (3, 4), (2, 1), (1, 2), (True, False), (4, 4), (4, 4), "static"),
    "1-d": ((37,), 9, 2, 1, True, (16,), (16,), "static"),
    "dynamic": ((5, 7), (3, 5), (1, 3), 1, False, (2, 8), (2, 8), "dynamic"),
    "dynamic-permuted": ((7, 6), (3, 3), 1, (2, 1), (False, True), (4, 4), (2, 8), "dynamic"),
}
FORWARD = [(width, path) for width, path in zip(WIDTHS, [*PATHS, *PATHS])]


@pytest.mark.parametrize("head_dim, path", FORWARD, ids=[f"{w}-{p}" for w, p in FORWARD])
def test_gna_forward_matches_float64_at_every_width(head_dim, path, monkeypatch):
    shape, window, stride, dilation, causal, q_tile, kv_tile, kv_tiling = PATHS[path]
    q, k, v = qkv(shape, head_dim, seed=head_dim)
    monkeypatch.setattr(launch, "new_output", _poisoned)
    out, lse = gna_attention(q, k, v, window, stride, dilation, causal, q_tile=q_tile, kv_tile=kv_tile,
                             kv_tiling=kv_tiling, return_lse=True)
    monkeypatch.undo()
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), window, stride, dilation, causal,
                                       return_lse=True)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE
    assert torch.allclose(lse.double(), ref_lse, atol=1e-2)


def test_the_dynamic_kernel_pads_a_split_width_on_128_query_tiles(monkeypatch):
    """Dynamic KV tiling on 128-query tiles runs 72 padded (`PADDED_LAUNCHES`), on 64-query tiles split; both
    against the float64 reference, with partial tiles at the borders."""
    chunks = []
    make_call = launch.make_call

    def recording(*args, **kwargs):
        call = make_call(*args, **kwargs)
        chunks.append((call.spec.q_tile, call.kernel.arguments["CHUNK_A"], call.kernel.arguments["CHUNK_B"]))
        return call

    monkeypatch.setattr(dispatch, "make_call", recording)
    monkeypatch.setattr(dispatch, "_calls", {})
    shape, window, stride = (3, 9, 20), (2, 5, 9), (1, 1, 2)
    q, k, v = qkv(shape, 72, seed=11)
    ref = reference_attention(q.double(), k.double(), v.double(), window, stride)
    for tile in ((1, 8, 16), (1, 4, 16)):
        out = gna_attention(q, k, v, window, stride, q_tile=tile, kv_tile=tile, kv_tiling="dynamic")
        assert rel_error(out, ref) < TOLERANCE, tile
    assert chunks == [((1, 8, 16), 128, 0), ((1, 4, 16), 64, 16)]


def test_padded_split_and_pointer_loads_agree():
    """The same call padded (one 128-column chunk) and split (64 + 16), through descriptors and through pointer
    loads, on permuted tokens: the strategies are a compile-time choice, not a different result."""
    head_dim = 72
    shape, window, stride, tile = (6, 8), (3, 5), (1, 2), (4, 4)
    problem = natsim.Problem(shape, window, stride)
    q, k, v = (permute(t, tile) for t in qkv(shape, head_dim, seed=3))
    ref = reference_attention(*(unpermute(t, shape, tile).double() for t in (q, k, v)), window, stride)
    for strategy, use_tma in (("pad", True), ("split", False)):
        split = head_split(head_dim, strategy)
        out = gna_attention_permuted(q, k, v, problem, tile, tile,
                                     config={"CHUNK_A": split.a, "CHUNK_B": split.b, "USE_TMA": use_tma})
        assert rel_error(unpermute(out, shape, tile), ref) < TOLERANCE, strategy


@settings(max_examples=3, deadline=None)  # the widths above run every data path's edges every time
@given(kernel_problems(), st.sampled_from([40, 72]), st.sampled_from(["static", "dynamic"]), st.integers(0, 2**16))
def test_gna_forward_at_split_widths_on_random_problems(case, head_dim, kv_tiling, seed):
    """Random 1-D to 3-D geometries (windows, strides, dilation, causal, padding at the borders) and tiles."""
    problem, q_tile, kv_tile = case
    q, k, v = qkv(problem.shape, head_dim, seed)
    out = gna_attention(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal,
                        q_tile=q_tile, kv_tile=kv_tile, kv_tiling=kv_tiling)
    ref = reference_attention(q.double(), k.double(), v.double(), problem.window, problem.stride,
                              problem.dilation, problem.causal)
    assert rel_error(out, ref) < TOLERANCE


def test_the_reference_mask_holds_at_a_split_width():
    """Equal scores make each output row uniform over the keys the kernel let through: the brute-force mask."""
    problem = natsim.Problem((5, 6), (3, 4), (1, 3), (1, 1), (True, False))
    n = problem.num_tokens
    v = torch.zeros(1, 5, 6, 1, 72, dtype=torch.float16, device=DEVICE)
    v.view(n, 72)[:, :n] = torch.eye(n, dtype=torch.float16, device=DEVICE)
    q = torch.zeros_like(v)
    out = gna_attention(q, q, v, problem.window, problem.stride, causal=problem.causal, q_tile=(2, 8), kv_tile=(2, 8))
    assert torch.equal(out.reshape(n, 72)[:, :n].cpu() > 0, torch.as_tensor(attention_mask(problem)))
    assert not out.reshape(n, 72)[:, n:].any()


def test_fp8_pads_a_split_width_and_follows_its_rule():
    q, k, v = qkv((4, 5, 7), 72, seed=7)
    args = ((3, 4, 5), (1, 2, 1))
    with torch.no_grad():
        out = gna_attention(q, k, v, *args, q_tile=(2, 2, 4), kv_tile=(2, 2, 4), precision="fp8")
    rule = fp8_reference_attention(q, k, v, *args)
    assert rel_error(out, rule) < 3e-2


# -- the GNA backward --------------------------------------------------------------------------------------------

BACKWARD = [
    # head_dim, problem, q_tile, kv_tile: masked with dilation and padding (split), dense (no mask code,
    # descriptors; split over 128 columns), masked and padded at 256
    (72, natsim.Problem((8, 6), (4, 3), 1, (2, 1), (True, False)), (4, 4), (4, 8)),
    (136, natsim.Problem((40,), 40), (16,), (32,)),
    (256, natsim.Problem((5, 6), (3, 3), (1, 3)), (4, 4), (4, 8)),
]


@pytest.mark.parametrize("head_dim, problem, q_tile, kv_tile", BACKWARD, ids=[str(c[0]) for c in BACKWARD])
def test_gna_backward_matches_float64_gradients(head_dim, problem, q_tile, kv_tile):
    q, k, v, g = qkv(problem.shape, head_dim, seed=head_dim, count=4)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*inputs, problem.window, problem.stride, problem.dilation, problem.causal,
                                   return_lse=True)
    want = torch.autograd.grad([out], inputs, [g.double()])
    got = gna_backward(q, k, v, out.detach().half(), lse.detach().float(), g, None, problem, None, q_tile, kv_tile)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert gradient_error(a, b) < GRADIENT_TOLERANCE, name


# -- block masks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, merge", [(24, None), (96, "consecutive"), (136, None)])
def test_block_mask_forward_and_backward_match_float64(head_dim, merge):
    n, q_block, kv_block = 70, 16, 32
    generator = torch.Generator().manual_seed(head_dim)
    mask = torch.rand(1, 1, -(-n // q_block), -(-n // kv_block), generator=generator) < 0.5
    mask[..., -1, :] = False  # a query block that attends nothing
    q, k, v, g = (t.reshape(1, n, 1, head_dim) for t in qkv((n,), head_dim, seed=head_dim, count=4))
    out, lse = sparse_attention(q, k, v, mask.to(DEVICE), q_block, kv_block, return_lse=True, merge=merge)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = sparse_reference(*inputs, mask, q_block, kv_block, return_lse=True)
    assert rel_error(out, ref.detach()) < TOLERANCE
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    want = torch.autograd.grad([ref], inputs, [g.double()])
    got = sparse_backward(q, k, v, ref.detach().half(), ref_lse.detach().float(), g, None, mask, q_block, kv_block)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert gradient_error(a, b) < GRADIENT_TOLERANCE, name


# -- any width, drawn ------------------------------------------------------------------------------------------


@settings(max_examples=4, deadline=None)
@given(kernel_problems(), st.sampled_from(HEAD_DIMS), st.integers(0, 2**16))
def test_gna_forward_and_backward_at_any_width_on_random_problems(case, head_dim, seed):
    """Any head dim of 16 to 256 on a random 1-D to 3-D geometry (windows, strides, dilation, causal, padding) and
    its tiles: the forward's output and LSE, and the backward's gradients, against float64."""
    problem, q_tile, kv_tile = case
    q, k, v, g = qkv(problem.shape, head_dim, seed, count=4)
    parameters = (problem.window, problem.stride, problem.dilation, problem.causal)
    out, lse = gna_attention(q, k, v, *parameters, q_tile=q_tile, kv_tile=kv_tile, return_lse=True)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*inputs, *parameters, return_lse=True)
    assert rel_error(out, ref.detach()) < TOLERANCE
    assert torch.allclose(lse.double(), ref_lse.detach(), atol=1e-2)
    want = torch.autograd.grad([ref], inputs, [g.double()])
    got = gna_backward(q, k, v, ref.detach().half(), ref_lse.detach().float(), g, None, problem, None, q_tile,
                       kv_tile)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert gradient_error(a, b) < GRADIENT_TOLERANCE, name


@settings(max_examples=3, deadline=None)
@given(st.sampled_from(HEAD_DIMS), st.integers(17, 90), st.sampled_from([16, 32]), st.sampled_from([16, 32]),
       st.integers(0, 2**16))
def test_block_masks_at_any_width(head_dim, n, q_block, kv_block, seed):
    """Any head dim on a random block mask of a sequence that is not whole blocks: forward and backward against
    float64."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, 1, -(-n // q_block), -(-n // kv_block), generator=generator) < 0.6
    q, k, v, g = (t.reshape(1, n, 1, head_dim) for t in qkv((n,), head_dim, seed=seed, count=4))
    out, lse = sparse_attention(q, k, v, mask.to(DEVICE), q_block, kv_block, return_lse=True)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = sparse_reference(*inputs, mask, q_block, kv_block, return_lse=True)
    assert rel_error(out, ref.detach()) < TOLERANCE if ref.detach().norm() > 0 else out.abs().max() == 0
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    want = torch.autograd.grad([ref], inputs, [g.double()])
    got = sparse_backward(q, k, v, ref.detach().half(), ref_lse.detach().float(), g, None, mask, q_block, kv_block)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert gradient_error(a, b) < GRADIENT_TOLERANCE, name
