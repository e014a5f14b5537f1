"""Tokens kept in tile order (kernels/gna/ordered.py): the order is the permuted layout's, and GNA on tokens in it
equals GNA on the row-major layout, forward and backward, eager and compiled (CPU: the torch reference in bfloat16,
the dtype plans are made for)."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from natsim.kernels import TileOrder, gna_attention, permute_reference, tile_order_refusal
from natsim.planner import AutoPlan


@st.composite
def orders(draw):
    ndim = draw(st.integers(1, 3))
    tile = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(ndim))
    shape = tuple(t * d * draw(st.integers(1, 3)) for t, d in zip(tile, dilation))
    return TileOrder.of(shape, tile, dilation)


@settings(max_examples=25, deadline=None)
@given(orders(), st.integers(0, 2), st.integers(0, 2**16))
def test_the_tile_order_is_the_permuted_layouts_and_is_undone(order, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, *order.shape, 3, 2, generator=gen)
    want = permute_reference(x, order.tile, order.dilation).reshape(2, order.tokens, 6)
    assert torch.equal(order.to_order(x.reshape(2, order.tokens, 6)), want)
    # any token dimension: leading and trailing dimensions ride along
    moved = x.reshape(2, order.tokens, 6).movedim(1, dim).contiguous()
    ordered = order.to_order(moved, dim=dim)
    assert torch.equal(ordered.movedim(dim, 1), want)
    assert torch.equal(order.from_order(ordered, dim=dim), moved)


def test_only_layouts_the_tile_divides_have_a_tile_order():
    assert tile_order_refusal((8, 12), (4, 4), (1, 1)) is None
    assert "does not divide the layout (8, 10)" in tile_order_refusal((8, 10), (4, 4), (1, 1))
    assert "does not divide" in tile_order_refusal((8, 8), (4, 4), (1, 3))
    with pytest.raises(ValueError, match="would hold padding tokens"):
        TileOrder.of((6, 10), (4, 4))
    with pytest.raises(ValueError, match="must hold the layout's 48 tokens"):
        TileOrder.of((6, 8), (2, 4)).to_order(torch.zeros(1, 47, 2))


@pytest.mark.parametrize("shape, window, stride, dilation, causal", [
    ((8, 16), (3, 5), (1, 1), (1, 1), (False, False)),
    ((4, 4, 8), (3, 3, 5), (2, 2, 1), (1, 1, 2), (True, False, False)),
    ((128,), (15,), (4,), (2,), (False,)),
])
def test_gna_in_tile_order_equals_gna_on_the_layout_forward_and_backward(shape, window, stride, dilation, causal,
                                                                         monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch reference: the interpreter computes bfloat16 wrongly
    auto = AutoPlan(0.0, window=window, max_stride=stride, causal=causal, device="cpu")
    heads, head_dim = 2, 32
    plan = auto.plan_for(shape, heads=heads, head_dim=head_dim, dtype=torch.bfloat16, device="cpu")
    order = auto.tile_order(shape, heads=heads, head_dim=head_dim, dtype=torch.bfloat16, device="cpu", force=True)
    if order is None:
        pytest.skip(f"the plan's tile {plan.tiles.q_tile} does not divide {shape}")
    assert auto.tile_order(shape, heads=heads, head_dim=head_dim, dtype=torch.bfloat16, device="cpu") is None
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(1, *shape, heads, head_dim, generator=gen, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    args = plan.kernel_arguments()
    want, want_lse = gna_attention(*leaves, **{n: a for n, a in args.items() if n != "backend"}, return_lse=True)
    want_grads = torch.autograd.grad(want, leaves, g)

    def ordered(t):
        return order.to_order(t.reshape(1, math.prod(shape), heads, head_dim))

    ordered_leaves = [ordered(t).detach().requires_grad_() for t in (q, k, v)]
    for run in (auto, torch.compile(auto, fullgraph=True, backend="aot_eager")):
        out, lse = run(*ordered_leaves, return_lse=True, order=order)
        # the same reference computation on the same values, in another token order: equal
        assert torch.equal(out, ordered(want))
        assert torch.equal(lse, order.to_order(want_lse.reshape(1, -1, heads)))
        grads = torch.autograd.grad(out, ordered_leaves, ordered(g))
        for got, expected in zip(grads, want_grads):
            assert torch.equal(got, ordered(expected))


@settings(max_examples=40, deadline=None)
@example(([2], [1], [2]))  # each dilation group one token: the identity
@example(([1, 3], [2, 1], [1, 1]))  # a dimension of one token in tiles of two: padding
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(st.lists(st.integers(1, 6), min_size=n, max_size=n),
                                                      st.lists(st.integers(1, 6), min_size=n, max_size=n),
                                                      st.lists(st.integers(1, 2), min_size=n, max_size=n))))
def test_a_tile_order_is_known_to_be_row_major_exactly_when_permuting_moves_nothing(sizes):
    """FlashAttention-4's calls and a model's tile order skip the permutation where it is the identity (a 1-D tile
    of a sequence, tiles of whole rows): `row_major` against the permutation itself."""
    from natsim.kernels.gna.layout import TileLayout

    shape, tile, dilation = (tuple(v) for v in sizes)
    tokens = math.prod(shape)
    x = torch.arange(tokens, dtype=torch.float32).reshape(1, *shape, 1, 1)
    permuted = permute_reference(x, tile, dilation).reshape(-1)
    moves_nothing = permuted.numel() == tokens and torch.equal(permuted, torch.arange(tokens, dtype=torch.float32))
    assert TileLayout(shape, tile, dilation).row_major == moves_nothing
