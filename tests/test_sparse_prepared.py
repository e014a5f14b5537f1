"""A prepared block mask (`SparseWork` from `prepare_sparse`): the backward's tile lists against a brute-force
element mask, prepared calls against calls with the boolean mask (bit for bit, forward and gradients) and against
float64 gradients, one compiled graph for masks of one size, the refusals, and the Triton list builders (the
forward's union lists, the backward's tile lists) against the torch ones.

The kernels run in the CPU interpreter (tests/conftest.py): tiny problems, fp16, 16-token backward tiles.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from natsim.kernels import prepare_sparse, sparse_attention, sparse_reference
from natsim.kernels.sparse.backward import BackwardTiles, tile_lists

LISTS = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
BUILDER = settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))  # interpreted kernels
KERNEL = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
POWERS = (1, 2, 4, 8, 16, 32, 64, 128)


def element_mask(mask: torch.Tensor, q_block: int, kv_block: int, seq_len: int) -> torch.Tensor:
    """`[B|1, H|1, N, N]`: query i attends key j exactly when mask[..., i // q_block, j // kv_block]."""
    return mask.repeat_interleave(q_block, 2).repeat_interleave(kv_block, 3)[:, :, :seq_len, :seq_len]


def brute_force_tiles(element: torch.Tensor, tile_q: int, tile_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed, full) per tile pair, pair by pair from the element mask: listed when any query of the pair
    attends any key of it, full when every query (before N) attends every key and every key is before N."""
    batch, heads, seq_len, _ = element.shape
    rows, cols = -(-seq_len // tile_q), -(-seq_len // tile_k)
    listed = torch.zeros(batch, heads, rows, cols, dtype=torch.bool)
    full = torch.zeros_like(listed)
    for a in range(rows):
        for b in range(cols):
            pair = element[:, :, a * tile_q:(a + 1) * tile_q, b * tile_k:(b + 1) * tile_k]
            listed[:, :, a, b] = pair.flatten(2).any(-1)
            full[:, :, a, b] = pair.flatten(2).all(-1) & ((b + 1) * tile_k <= seq_len)
    return listed, full


def check_list(lists, listed: torch.Tensor, full: torch.Tensor) -> None:
    """Per row: the count of listed and of full tiles, the full columns first, then the partial ones, each run
    ascending."""
    assert torch.equal(lists.count.long(), listed.sum(-1))
    assert torch.equal(lists.full.long(), full.sum(-1))
    for index in torch.cartesian_prod(*(torch.arange(n) for n in listed.shape[:3])):
        b, h, r = index.tolist()
        got = lists.index[b, h, r, :lists.count[b, h, r]].tolist()
        fulls = torch.nonzero(full[b, h, r]).flatten().tolist()
        partial = torch.nonzero(listed[b, h, r] & ~full[b, h, r]).flatten().tolist()
        assert got == fulls + partial


@LISTS
@given(
    st.sampled_from(POWERS[3:]), st.sampled_from(POWERS), st.integers(1, 200),
    st.sampled_from([(16, 16, 16, 16), (16, 32, 32, 16), (32, 16, 64, 16), (64, 128, 128, 64)]),
    st.sampled_from([0.0, 0.3, 0.8, 1.0]), st.integers(1, 2), st.integers(0, 2**16),
)
def test_backward_tile_lists_equal_the_brute_force_element_mask(q_block, kv_block, seq_len, tiles, density, heads,
                                                                seed):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, heads, -(-seq_len // q_block), -(-seq_len // kv_block), generator=generator) < density
    tiles = BackwardTiles(*tiles)
    columns, rows = tile_lists(mask, tiles, q_block, kv_block, seq_len)
    element = element_mask(mask, q_block, kv_block, seq_len)
    listed, full = brute_force_tiles(element, tiles.dkdv_queries, tiles.dkdv_keys)
    check_list(columns, listed.transpose(2, 3), full.transpose(2, 3))  # per KV tile, its Q tiles
    listed, full = brute_force_tiles(element, tiles.dq_queries, tiles.dq_keys)
    check_list(rows, listed, full)


def random_problem(seed: int, seq_len: int, q_block: int, kv_block: int, density: float, heads: int = 2):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, heads, -(-seq_len // q_block), -(-seq_len // kv_block), generator=generator) < density
    mask[0, 0, -1] = False  # a query block that attends nothing
    q, k, v, g = (torch.randn(1, seq_len, heads, 32, generator=generator).half() for _ in range(4))
    return mask, (q, k, v), g


def gradients(q, k, v, mask, g, *args, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = sparse_attention(*leaves, mask, *args, return_lse=True, **kwargs)
    return (out, lse) + torch.autograd.grad(out, leaves, g)


@KERNEL
@given(st.sampled_from([(8, 4), (16, 32), (32, 16), (64, 64)]), st.integers(20, 90),
       st.sampled_from([None, "consecutive", "xor"]), st.sampled_from([0.3, 1.0]), st.integers(0, 2**16))
def test_prepared_mask_runs_bit_for_bit_like_the_boolean_mask_with_float64_gradients(blocks, seq_len, merge,
                                                                                     density, seed):
    q_block, kv_block = blocks
    mask, (q, k, v), g = random_problem(seed, seq_len, q_block, kv_block, density)
    want = gradients(q, k, v, mask, g, q_block, kv_block, merge=merge)
    work = prepare_sparse(mask, q_block, kv_block, seq_len, merge=merge)
    got = gradients(q, k, v, work, g)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    reference = torch.autograd.grad(sparse_reference(*inputs, mask, q_block, kv_block), inputs, g.double())
    for name, a, b in zip(("dq", "dk", "dv"), got[2:], reference):
        assert (a.double() - b).norm() <= 1e-2 * b.norm() + 1e-3, name


def test_prepared_masks_of_one_size_share_one_compiled_graph():
    """Masks of one size and different densities (lists of different lengths) run one compiled graph, forward
    and backward, with the eager gradients."""
    torch._dynamo.reset()
    seq_len, block = 48, 16

    def loss(q, k, v, work):
        return sparse_attention(q, k, v, work).float().square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")  # the guards are Dynamo's, whatever backend
    for step, density in enumerate((0.3, 0.7, 1.0)):
        mask, (q, k, v), _ = random_problem(step, seq_len, block, block, density)
        work = prepare_sparse(mask, block, block, seq_len)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            got = torch.autograd.grad(compiled(*leaves, work), leaves)
        want = torch.autograd.grad(loss(*leaves, work), leaves)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_prepared_masks_train_under_a_compile_with_dynamic_shapes(reference_path):
    """Compiled with dynamic shapes (symbolic from the first call), the backward's work sizes reach it symbolic; on
    the CPU path it rebuilds the work from them (its blocks were refused as "not an int"): the gradients are the
    eager ones (without dynamic shapes: test_prepared_masks_of_one_size_share_one_compiled_graph)."""
    torch._dynamo.reset()

    def loss(q, k, v, work):
        return sparse_attention(q, k, v, work).float().square().sum()

    mask, (q, k, v), _ = random_problem(0, 48, 16, 16, 0.6)
    work = prepare_sparse(mask, 16, 16, 48)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")(*leaves, work),
                              leaves)
    want = torch.autograd.grad(loss(*leaves, work), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_prepared_mask_on_the_reference_path_has_the_references_gradients(reference_path):
    mask, (q, k, v), g = random_problem(3, 40, 8, 16, 0.5)
    got = gradients(q.float(), k.float(), v.float(), prepare_sparse(mask, 8, 16, 40), g.float())
    want = gradients(q.float(), k.float(), v.float(), mask, g.float(), 8, 16)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_prepared_mask_refusals_are_sentences():
    mask, (q, k, v), _ = random_problem(4, 32, 16, 16, 1.0)
    work = prepare_sparse(mask, 16, 16, 32)
    with pytest.raises(ValueError, match="the SparseWork's own"):
        sparse_attention(q, k, v, work, 16, 16)
    with pytest.raises(ValueError, match="pv_threshold"):
        sparse_attention(q.requires_grad_(), k, v, work, pv_threshold=-2.0)
    with pytest.raises(ValueError, match="seq_len=32"):
        sparse_attention(q[:, :16], k[:, :16], v[:, :16], work)


@BUILDER
@given(st.integers(1, 20), st.integers(1, 1100), st.sampled_from([1, 2, 3, 8, 16]),
       st.sampled_from(["consecutive", "xor"]), st.sampled_from([0.0, 0.1, 0.5, 1.0]), st.integers(0, 2**16))
def test_gpu_list_builder_equals_the_torch_builder(num_q, num_kv, group, merge, density, seed):
    """The Triton builder of the forward's union lists (the GPU's) against the torch one (the CPU's), bit for bit:
    groups of 1 to 16 query blocks, short last groups, several chunks of KV blocks, N not a multiple of them."""
    from natsim.kernels.sparse.lists import build_lists
    from natsim.kernels.sparse.work import _lists, _members

    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, 2, num_q, num_kv, generator=generator) < density
    members = _members(mask, group, merge)
    kv_block, per_tile = 4, 2
    seq_len = num_kv * kv_block - seed % kv_block
    want = _lists(mask, members, seq_len, kv_block, per_tile)
    for a, b in zip(want, build_lists(mask, members, seq_len, kv_block, per_tile)):
        assert torch.equal(a, b)
    # Work for one call: the lists sized for every pair, equal up to the total.
    offsets, full_tiles, kv_list, member_bits = build_lists(mask, members, seq_len, kv_block, per_tile, exact=False)
    total = int(want[0][-1])
    assert torch.equal(offsets, want[0]) and torch.equal(full_tiles, want[1])
    assert kv_list.numel() == members.shape[0] * members.shape[1] * members.shape[2] * num_kv
    assert torch.equal(kv_list[:total], want[2][:total]) and torch.equal(member_bits[:total], want[3][:total])


def torch_tile_lists(mask: torch.Tensor, tile_q: int, tile_k: int, q_block: int, kv_block: int, seq_len: int,
                     by_keys: bool):
    """The torch builder's lists of one backward kernel: per Q tile its KV tiles, or per KV tile its Q tiles."""
    from natsim.kernels.sparse.backward import _ordered, _tile_flags

    listed, full = _tile_flags(mask, tile_q, tile_k, q_block, kv_block, seq_len)
    return _ordered(listed.transpose(2, 3), full.transpose(2, 3)) if by_keys else _ordered(listed, full)


def assert_same_tile_lists(got: tuple[torch.Tensor, torch.Tensor, torch.Tensor], want) -> None:
    """The counts bit for bit, and each row's listed columns (entries past the count carry no meaning)."""
    count, full, index = got
    assert count.is_contiguous() and full.is_contiguous() and index.is_contiguous()
    assert torch.equal(count, want.count) and torch.equal(full, want.full)
    assert index.shape == want.index.shape and index.dtype == torch.int32
    for row in torch.cartesian_prod(*(torch.arange(n) for n in count.shape)).tolist():
        valid = int(count[tuple(row)])
        assert torch.equal(index[tuple(row)][:valid], want.index[tuple(row)][:valid]), row


@BUILDER
@given(
    st.sampled_from(POWERS[3:]), st.sampled_from(POWERS), st.integers(1, 200),
    st.sampled_from([(16, 16, 16, 16), (16, 32, 32, 16), (32, 16, 64, 16), (64, 128, 128, 64)]),
    st.sampled_from([0.0, 0.3, 0.8, 1.0]), st.integers(1, 2), st.integers(1, 2), st.integers(0, 2**16),
)
def test_gpu_tile_list_builder_equals_the_torch_builder(q_block, kv_block, seq_len, tiles, density, batch, heads,
                                                        seed):
    """The Triton builder of the backward's tile lists against the torch one, both kernels' lists: tiles smaller
    than, equal to and larger than the blocks, N not a multiple of them."""
    from natsim.kernels.sparse.lists import build_tile_lists

    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, heads, -(-seq_len // q_block), -(-seq_len // kv_block), generator=generator) < density
    tiles = BackwardTiles(*tiles)
    for tile_q, tile_k, by_keys in ((tiles.dkdv_queries, tiles.dkdv_keys, True),
                                    (tiles.dq_queries, tiles.dq_keys, False)):
        want = torch_tile_lists(mask, tile_q, tile_k, q_block, kv_block, seq_len, by_keys)
        assert_same_tile_lists(build_tile_lists(mask, tile_q, tile_k, q_block, kv_block, seq_len, by_keys), want)


@pytest.mark.parametrize("by_keys, tile_q, tile_k", [(True, 16, 128), (False, 32, 16)])
def test_gpu_tile_list_builder_places_columns_across_chunks(monkeypatch, by_keys, tile_q, tile_k):
    """Rows of 37 columns walked 16 at a time, full and partial runs both crossing chunks: a causal mask of
    one-token KV blocks with a few holes, N = 585 (a short last key tile, and a last 32-query tile whose last two
    query blocks lie past the mask, which must not make its pairs partial)."""
    from natsim.kernels.sparse import lists

    monkeypatch.setattr(lists, "CHUNK", 16)
    seq_len, q_block, kv_block = 585, 8, 1
    generator = torch.Generator().manual_seed(0)
    queries = torch.arange(-(-seq_len // q_block))[:, None] * q_block + q_block - 1
    causal = torch.arange(seq_len)[None, :] <= queries
    mask = (causal & (torch.rand(2, 1, *causal.shape, generator=generator) > 0.002)).contiguous()
    want = torch_tile_lists(mask, tile_q, tile_k, q_block, kv_block, seq_len, by_keys)
    assert want.index.shape[-1] == 37 and int(want.full.max()) > 16 and int((want.count - want.full).sum()) > 0
    assert_same_tile_lists(lists.build_tile_lists(mask, tile_q, tile_k, q_block, kv_block, seq_len, by_keys), want)


@LISTS
@given(st.sampled_from(POWERS[4:]), st.sampled_from(POWERS[4:]), st.integers(0, 3), st.integers(0, 3),
       st.integers(1, 12), st.sampled_from([0.0, 0.3, 0.8, 1.0]), st.integers(0, 2**16))
def test_tiles_inside_blocks_hold_no_partial_pairs(q_block, kv_block, q_halvings, kv_halvings, key_tiles, density,
                                                   seed):
    """Where the backward builds its kernel without the masked loop (`_may_hold_partial_pairs` False: every tile
    inside one mask block, N a multiple of the key tiles), no listed pair is partial, so none is left out."""
    from natsim.kernels.sparse.backward import _may_hold_partial_pairs

    tile_q, tile_k = max(q_block >> q_halvings, 16), max(kv_block >> kv_halvings, 16)
    seq_len = key_tiles * max(tile_k, tile_q)
    assert not _may_hold_partial_pairs(tile_q, tile_k, q_block, kv_block, seq_len)
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, 2, -(-seq_len // q_block), -(-seq_len // kv_block), generator=generator) < density
    columns, rows = tile_lists(mask, BackwardTiles(tile_q, tile_k, tile_q, tile_k), q_block, kv_block, seq_len)
    assert torch.equal(columns.count, columns.full) and torch.equal(rows.count, rows.full)
    listed, _ = brute_force_tiles(element_mask(mask, q_block, kv_block, seq_len), tile_q, tile_k)
    assert torch.equal(rows.count.long(), listed.sum(-1))
