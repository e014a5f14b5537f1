"""The Gluon FP8 kernel's host side on the CPU (kernels/gluon/forward.py): K's scales shared by key blocks in
the quantization rule (Triton's interpreter against torch), block lists from a block mask and back, the CPU
path (the rule's reference) against float32 attention, and the refusals. The kernel itself runs on Hopper only:
tests/test_gluon_fp8_gpu.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, event, given, settings, strategies as st

from bruteforce import attention_mask, problems
from natsim.kernels.common import fp8
from natsim.kernels.gluon.forward import BLOCK_N, BlockLists, launch
from natsim.kernels.gluon.ops import fp8_block_attention
from natsim.kernels.gluon.tile_mask import gna_block_lists, gna_tile_mask
from natsim.kernels.gna.layout import TileLayout
from natsim.kernels.gna.tiles import tile_pairs
from test_fa4 import source_tokens
from natsim.kernels.sparse.reference import sparse_reference


@pytest.mark.parametrize("rows, block", [(300, 128), (128, 128), (77, 64), (200, 1)])
def test_block_scales_are_shared_and_the_interpreter_rounds_like_torch(rows, block, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(2, rows, 3, 64, generator=gen) * 3 for _ in range(3))
    statistics = fp8.column_statistics(k, v)  # one K mean for both: the two paths sum it in different orders
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = fp8.quantize_rows(q, k, v, *statistics, k_block=block)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    eager = fp8.quantize_rows(q, k, v, *statistics, k_block=block)
    assert torch.equal(interpreted.k_scale, eager.k_scale)
    assert torch.equal(interpreted.k.float(), eager.k.float())
    centred = k - k.mean(1, keepdim=True)
    for first in range(0, rows, block):
        scales = eager.k_scale[:, first:first + block]
        assert torch.equal(scales, scales[:, :1].expand_as(scales))  # one scale per block and head
        amax = centred[:, first:first + block].abs().amax((1, 3))
        torch.testing.assert_close(scales[:, 0], amax / 448.0)
    _, dequantized, _ = eager.dequantized()
    assert float((dequantized - centred).norm() / centred.norm()) < 3e-2


@settings(max_examples=20, deadline=None)
@given(batch=st.sampled_from([1, 2]), heads=st.sampled_from([1, 3]), q_blocks=st.integers(1, 5),
       kv_blocks=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_block_lists_name_exactly_the_mask(batch, heads, q_blocks, kv_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, heads, q_blocks, kv_blocks, generator=gen) < 0.4
    lists = BlockLists.from_blocks(mask)
    assert torch.equal(lists.counts, mask.sum(-1).int())
    for index in torch.cartesian_prod(*(torch.arange(n) for n in mask.shape[:3])).tolist():
        row = lists.indices[tuple(index)][:lists.counts[tuple(index)]]
        assert torch.equal(row, torch.nonzero(mask[tuple(index)]).flatten().int())  # ascending, visited only
    assert torch.equal(lists.mask(), mask)


@pytest.mark.parametrize("rows, density", [(256, 1.0), (300, 0.5), (130, 0.3)])
def test_cpu_path_is_the_rule_against_float32_attention(rows, density):
    gen = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(2, rows, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    blocks = -(-rows // BLOCK_N)
    mask = torch.rand(2, 2, blocks, blocks, generator=gen) < density
    mask |= torch.eye(blocks, dtype=torch.bool)
    out, lse = fp8_block_attention(q, k, v, None if density == 1.0 else mask, return_lse=True)
    ref, ref_lse = sparse_reference(q.float(), k.float(), v.float(), torch.ones_like(mask) if density == 1.0 else mask,
                                    128, 128, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == q.shape[:-1]
    assert float((out.float() - ref).norm() / ref.norm()) < 6e-2
    assert float((lse - ref_lse).abs().max()) < 5e-2
    compiled = torch.compile(fp8_block_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, None if density == 1.0 else mask), out)


def test_empty_rows_give_zeros_and_an_lse_of_minus_infinity():
    q, k, v = (torch.randn(1, 256, 1, 64).to(torch.bfloat16) for _ in range(3))
    mask = torch.tensor([[[[True, False], [False, False]]]])
    out, lse = fp8_block_attention(q, k, v, mask, return_lse=True)
    assert torch.all(out[:, 128:] == 0) and torch.all(lse[:, 128:] == float("-inf"))
    assert torch.all(torch.isfinite(lse[:, :128]))


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q, k, v[..., :32]), "k and v alike"),
    (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), "runs head_dim 64 or 128, got head_dim=48"),
    (lambda q, k, v: (q.float(), k.float(), v.float()), "quantizes bfloat16 or float16 inputs"),
])
def test_refusals_are_sentences(change, message):
    q, k, v = (torch.randn(1, 128, 1, 64).to(torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match=message):
        fp8_block_attention(*change(q, k, v))
    with pytest.raises(RuntimeError, match="for inference and has no backward pass"):
        fp8_block_attention(q.requires_grad_(), k, v)


def test_the_kernel_refuses_v_in_natural_key_order():
    """The kernel stores P key-major and reads V in that order: tensors quantized for the Triton kernels would
    pair each probability with another key's value, so they are refused before anything is launched."""
    q, k, v = (torch.randn(1, 128, 1, 64).to(torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="v_key_major=True"):
        launch(fp8.quantize(q, k, v, k_block=BLOCK_N), None, 0.125, torch.bfloat16, False)


def test_the_cpu_path_divides_by_the_sum_of_the_rounded_weights():
    """The kernel's row sums are P @ 1 over P as rounded: its CPU path (the rule's reference) takes the same
    sum, and so differs from the exact-sum rule by the rounding errors' mean only."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 384, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    out = fp8_block_attention(q, k, v).float()
    x = fp8.quantize(q, k, v, k_block=BLOCK_N, v_key_major=True)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    rounded = sparse_reference(*x.dequantized(), mask, 128, 128, quantized_probs=True, p_sum="rounded")
    exact = sparse_reference(*x.dequantized(), mask, 128, 128, quantized_probs=True)
    assert torch.equal(out, rounded.to(torch.bfloat16).float())
    assert not torch.equal(out, exact.to(torch.bfloat16).float())
    assert float((out - exact.float()).norm() / exact.float().norm()) < 1e-2


def test_lists_that_do_not_fit_the_call_are_refused():
    q, k, v = (torch.randn(1, 256, 2, 64).to(torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_block_attention(q, k, v, torch.ones(1, 2, 3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="boolean"):
        BlockLists.from_blocks(torch.ones(1, 2, 2, 2))


@pytest.mark.parametrize("call, message", [
    (dict(head_dim=96), "runs head_dim 64 or 128, got head_dim=96"),
    (dict(q_block=64), "runs Q tiles of 128 tokens, got 64"),
    (dict(kv_block=64), "runs KV tiles of 128 tokens, got 64"),
    (dict(capability=(8, 0)), "does not run on a GPU of compute capability 8.0"),
    (dict(capability=(10, 0)), "does not run on a GPU of compute capability 10.0"),
    (dict(dtype=torch.float32), "runs dtypes"),
    (dict(needs=("backward",)), "has no backward"),
    (dict(needs=("partial_tiles",)), "has no partial tiles"),
])
def test_the_backend_table_says_what_the_kernel_does_not_run(call, message):
    from natsim.kernels.backends import capabilities

    table = capabilities("gluon", "masks")
    assert table.refusal(dtype=torch.bfloat16, head_dim=128, q_block=128, kv_block=128, capability=(9, 0),
                         needs=("fp8",)) is None
    assert message in table.refusal(**{**dict(dtype=torch.bfloat16, head_dim=128, q_block=128, kv_block=128,
                                              capability=(9, 0)), **call})


# -- calls that name the backend ------------------------------------------------------------------------------

GNA_LAYOUTS = [  # (shape, window, stride, tile): every visited block a whole 128-token tile
    ((4, 16, 16), (2, 8, 16), (2, 8, 16), (1, 8, 16)),
    ((1024,), (512,), (256,), (128,)),
    ((2, 16, 16), (2, 16, 16), (1, 1, 1), (1, 8, 16)),  # dense, in tile order
]


@settings(max_examples=3, deadline=None)
@given(layout=st.sampled_from(GNA_LAYOUTS), head_dim=st.sampled_from([64, 128]), seed=st.integers(0, 2**16))
def test_gna_naming_gluon_runs_the_rule_on_cpu_tensors_against_float64(layout, head_dim, seed):
    from natsim.kernels import gna_attention
    from natsim.kernels.gna.reference import reference_attention

    shape, window, stride, tile = layout
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, *shape, 1, head_dim, generator=gen).to(torch.bfloat16) for _ in range(3))  # one head
    reference = reference_attention(q.double(), k.double(), v.double(), window, stride)
    for tiles in ({"q_tile": tile, "kv_tile": tile}, {}):  # named tiles, and the kernel's own choice
        out = gna_attention(q, k, v, window, stride, precision="fp8", backend="gluon", **tiles)
        error = float((out.double() - reference).norm() / reference.norm())
        cosine = torch.nn.functional.cosine_similarity(out.double().flatten(), reference.flatten(), dim=0)
        assert error < 6e-2 and cosine > 0.998, (layout, error, float(cosine))


@pytest.mark.parametrize("arguments, message", [
    (dict(precision=None), r"backend='gluon' runs GNA in precision='fp8' only"),
    (dict(q_tile=(1, 4, 16), kv_tile=(1, 4, 16)), r"runs GNA on one tile of 128 tokens .* got q_tile=\(1, 4, 16\)"),
    (dict(q_tile=(1, 8, 16), kv_tile=(1, 4, 16)), r"runs GNA on one tile of 128 tokens for queries and keys, got"),
    (dict(layout=(2, 3, 5), window=(2, 3, 3), stride=(1, 1, 1)),
     r"none of natsim's tiles of the layout \(2, 3, 5\) holds 128 tokens\.$"),
])
def test_gna_naming_gluon_refuses_what_it_cannot_run_in_a_sentence(arguments, message):
    from natsim.kernels import gna_attention

    arguments = dict(arguments)
    q = torch.randn(1, *arguments.pop("layout", (4, 16, 16)), 2, 64, dtype=torch.bfloat16)
    call = {"window": (2, 8, 16), "stride": (2, 8, 16), "precision": "fp8", "backend": "gluon", **arguments}
    with pytest.raises(ValueError, match=message):
        gna_attention(q, q, q, **call)


def test_sparse_naming_gluon_runs_its_cpu_path_and_refuses_other_blocks():
    from natsim.kernels import prepare_sparse, sparse_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 300, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    mask = torch.rand(1, 2, 3, 3, generator=gen) < 0.6
    mask |= torch.eye(3, dtype=torch.bool)
    expected = fp8_block_attention(q, k, v, mask)
    assert torch.equal(sparse_attention(q, k, v, mask, 128, 128, precision="fp8", backend="gluon"), expected)
    work = prepare_sparse(mask, 128, 128, 300, backward=False, backend="gluon")
    assert torch.equal(sparse_attention(q, k, v, work, precision="fp8"), expected)  # the work names it
    with pytest.raises(ValueError, match=r"runs blocks of 128 x 128 tokens, got 64 x 128"):
        sparse_attention(q, k, v, mask.repeat_interleave(2, 2)[:, :, :5], 64, 128, precision="fp8", backend="gluon")
    # in 16 bits the call runs the kernel's 16-bit variant (tests/test_gluon_16bit.py)
    from natsim.kernels.gluon.ops import gluon_block_attention
    sixteen_bits = sparse_attention(q, k, v, mask, 128, 128, backend="gluon")
    assert torch.equal(sixteen_bits, gluon_block_attention(q, k, v, mask))


def test_gna_naming_gluon_on_tokens_in_tile_order_equals_the_row_major_call():
    from natsim.kernels import TileOrder, gna_attention
    from natsim.kernels.gna.ordered import run_ordered
    from natsim.kernels.gna.spec import GnaSpec

    shape, window, stride, tile = GNA_LAYOUTS[0]
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, *shape, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    order = TileOrder(shape, tile, (1,) * len(shape))
    ordered = [order.to_order(t.reshape(1, -1, 2, 64)) for t in (q, k, v)]
    spec = GnaSpec.of(len(shape), window, stride, q_tile=tile, kv_tile=tile, precision="fp8", backend="gluon",
                      return_lse=True)
    out, lse = run_ordered(*ordered, order, spec)
    expected, expected_lse = gna_attention(q, k, v, window, stride, q_tile=tile, kv_tile=tile, precision="fp8",
                                           backend="gluon", return_lse=True)
    assert torch.equal(order.from_order(out).reshape(q.shape), expected)
    assert torch.equal(order.from_order(lse[..., None])[..., 0].reshape(expected_lse.shape), expected_lse)


def test_the_operator_reads_a_layout_in_tile_order_and_its_fake_has_the_real_strides():
    """natsim::gluon_fp8_forward given a tile order (`rows`: kernels/gna/permute.py's source_rows, padding rows
    included) attends the layout's row-major tokens in that order: the output and the LSE have the order's rows,
    natsim's GNA naming the Gluon kernel gives the output back on the layout, the operator's fake has the real
    outputs' shapes and strides, and an order it cannot read is refused with a sentence."""
    from natsim import Problem
    from natsim.kernels import gna_attention
    from natsim.kernels.gluon.ops import gluon_fp8_forward
    from natsim.kernels.gna.permute import source_rows, unpermute

    shape, window, tile = (2, 10, 24), (2, 5, 9), (1, 8, 16)  # 10 and 24 pad to 16 and 32: the order holds padding
    problem = Problem(shape, window)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, *shape, 1, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    flat = [t.reshape(1, -1, 1, 64) for t in (q, k, v)]
    rows = source_rows(shape, tile, (1, 1, 1), q.device)
    assert bool((rows < 0).any()) and sorted(rows[rows >= 0].tolist()) == list(range(math.prod(shape)))
    lists, partial = gna_block_lists(problem, tile, q.device)
    masked = gna_tile_mask(problem, tile, q.device)
    arguments = (lists.counts, lists.indices, 0.125, True, masked.bounds, masked.bases, list(tile), rows)
    out, lse = gluon_fp8_forward(*flat, *arguments)
    assert partial and out.shape == (1, rows.shape[0], 1, 64) and lse.shape == (1, rows.shape[0], 1)
    expected = gna_attention(q, k, v, window, q_tile=tile, kv_tile=tile, scale=0.125, precision="fp8",
                             backend="gluon")
    assert torch.equal(unpermute(out, shape, tile), expected)
    # its fake gives the real outputs' shapes and strides (what Inductor asserts in a compiled graph)
    torch.library.opcheck(gluon_fp8_forward, (*flat, *arguments), test_utils=("test_faketensor",))
    with pytest.raises(ValueError, match="rows must be an int32"):
        gluon_fp8_forward(*flat, *arguments[:-1], rows.long())
    with pytest.raises(ValueError, match="must hold as many tokens"):
        gluon_fp8_forward(flat[0], flat[1][:, :-1], flat[2][:, :-1], *arguments)


# -- partial tiles ------------------------------------------------------------------------------------------------


@st.composite
def tiled_problems(draw, max_padded: int = 1024):
    """A GNA problem (1-D to 3-D: borders, padding, even windows, stride, dilation, causal) with one of natsim's
    128-token tiles of its layout, on which it pads to at most `max_padded` tokens (the references' n^2)."""
    problem = draw(problems(max_tokens=600))
    pairs = [q for q, kv in tile_pairs(problem.shape, 64) if q == kv and math.prod(q) == 128
             and TileLayout(problem.shape, q, problem.dilation).num_tokens <= max_padded]
    assume(pairs)
    return problem, draw(st.sampled_from(pairs))


@settings(max_examples=25, deadline=None)
@given(tiled_problems())
def test_the_tile_mask_is_the_brute_force_mask_in_tile_order(case):
    """What the kernel tests inside a partial tile (each row's window bounds, each key tile's first coordinate)
    gives the brute-force GNA mask on the layout's tokens, and no row attends a padding key."""
    problem, tile = case
    mask = gna_tile_mask(problem, tile, torch.device("cpu")).dense().numpy()
    tokens = source_tokens(problem, tile)
    real = tokens >= 0
    assert mask.shape == (len(tokens), len(tokens))
    assert np.array_equal(mask[np.ix_(real, real)], attention_mask(problem)[np.ix_(tokens[real], tokens[real])])
    assert not mask[:, ~real].any()


@settings(max_examples=20, deadline=None)
@given(tiled_problems())
def test_the_lists_mark_the_partial_tiles_and_name_every_visited_one(case):
    """The kernel's lists name the blocks the brute-force mask visits in tile order, those whose every element
    (and key) is attended as whole and the others as partial."""
    problem, tile = case
    lists, any_partial = gna_block_lists(problem, tile, torch.device("cpu"))
    tokens = source_tokens(problem, tile)
    blocks = len(tokens) // 128
    elements = np.zeros((len(tokens), len(tokens)), dtype=bool)
    real = tokens >= 0
    elements[np.ix_(real, real)] = attention_mask(problem)[np.ix_(tokens[real], tokens[real])]
    per_block = elements.reshape(blocks, 128, blocks, 128)
    visited = per_block.any((1, 3))
    # a whole block: every query attends every key (the padding queries' rows are dropped, so they do not count)
    whole = (per_block | ~real.reshape(blocks, 128)[:, :, None, None]).all((1, 3))
    assert np.array_equal(lists.mask()[0, 0].numpy(), visited)
    partial = lists.mask(partial=True)[0, 0].numpy()
    assert not (partial & ~visited).any() and not (visited & ~partial & ~whole).any()
    assert any_partial == bool(partial.any())
    # along the dimensions a partial block's bits leave out, every row's window holds the whole key tile: on the
    # layout's rows the brute-force mask equals the window test along the marked dimensions alone
    tile_mask = gna_tile_mask(problem, tile, torch.device("cpu"))
    bits = lists.dims()[0, 0]
    for q_block, kv_block in zip(*np.nonzero(partial)):
        rows, keys = slice(q_block * 128, (q_block + 1) * 128), slice(kv_block * 128, (kv_block + 1) * 128)
        marked = np.ones((128, 128), dtype=bool)
        for d in range(problem.ndim):
            if int(bits[q_block, kv_block]) >> d & 1:
                marked &= window_test(tile_mask, d, rows, kv_block)
        real_rows = real[rows]  # padding rows attend their clamped windows; their outputs are dropped
        assert np.array_equal(marked[real_rows], elements[rows, keys][real_rows]), (q_block, kv_block)


def window_test(mask, d: int, rows: slice, kv_block: int) -> np.ndarray:
    """`[128, 128]`: whether each row's window along dimension `d` holds each key of the key tile `kv_block`."""
    inner = np.arange(128) // math.prod(mask.tile[d + 1:]) % mask.tile[d]
    coordinate = int(mask.bases[d, kv_block]) + inner
    lo, hi = mask.bounds[2 * d, rows].numpy(), mask.bounds[2 * d + 1, rows].numpy()
    return (lo[:, None] <= coordinate[None, :]) & (coordinate[None, :] < hi[:, None])


def test_the_gna_table_runs_partial_tiles_and_the_mask_table_does_not():
    from natsim.kernels.backends import capabilities

    assert capabilities("gluon", "gna").partial_tiles and not capabilities("gluon", "masks").partial_tiles


def test_block_lists_encode_partial_blocks_as_complements():
    blocks = torch.tensor([[True, False, True, True], [False, False, False, False]])[None, None]
    partial = torch.tensor([[False, False, True, False], [False, False, False, False]])[None, None]
    lists = BlockLists.from_blocks(blocks, partial)  # every dimension masked where no bits are given
    assert lists.counts.tolist() == [[[3, 0]]]
    assert lists.indices[0, 0, 0, :3].tolist() == [0, ~(2 | 0b111 << 24), 3]
    assert torch.equal(lists.mask(), blocks) and torch.equal(lists.mask(partial=True), partial)
    dims = torch.zeros(blocks.shape, dtype=torch.long).index_put_((torch.tensor(0),) * 3 + (torch.tensor(2),),
                                                                   torch.tensor(0b010))
    marked = BlockLists.from_blocks(blocks, partial, dims)
    assert marked.indices[0, 0, 0, 1] == ~(2 | 0b010 << 24) and torch.equal(marked.dims(), dims)
    with pytest.raises(ValueError, match="partial must be a boolean mask of the blocks' shape"):
        BlockLists.from_blocks(blocks, partial[..., :2])


@settings(max_examples=3, deadline=None)
@given(case=tiled_problems(max_padded=640), head_dim=st.sampled_from([64, 128]), seed=st.integers(0, 2**16))
def test_gna_on_partial_tiles_runs_the_rule_on_cpu_tensors_against_float64(case, head_dim, seed):
    """A call naming the Gluon kernel on a tile with partial blocks runs (CPU tensors: the rule's reference under
    the element mask) and stays within FP8's error of float64 attention; the LSE too."""
    from natsim.kernels import gna_attention
    from natsim.kernels.gna.reference import reference_attention

    problem, tile = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, *problem.shape, 2, head_dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal)
    out, lse = gna_attention(q, k, v, **args, q_tile=tile, kv_tile=tile, precision="fp8", backend="gluon",
                             return_lse=True)
    reference, reference_lse = reference_attention(q.double(), k.double(), v.double(), **args, return_lse=True)
    error = float((out.double() - reference).norm() / reference.norm())
    assert error < 6e-2, error
    assert float((lse.double() - reference_lse).abs().max()) < 0.2  # tests/test_fp8.py's bound for the rule's LSE


def _hopper_choice(monkeypatch):
    """natsim.kernels.gna.choice as on a Hopper GPU (no interpreter)."""
    from natsim.kernels.gna import choice

    monkeypatch.setattr(choice, "gpu_capability", lambda device: (9, 0))
    monkeypatch.setattr(choice, "interpreting", lambda: False)
    return choice


def test_an_fp8_call_left_to_natsim_takes_the_gluon_kernel_on_whole_tiles_and_on_partial_ones_that_pay(monkeypatch):
    """Unnamed FP8 calls go to the Gluon kernel where every visited block is whole; on partial tiles where the
    call is large enough (visited blocks times batch and heads) and the tiles waste few pairs, else to the Triton
    FP8 kernel; a call naming the Gluon kernel takes it on partial tiles at any size."""
    from natsim.kernels.gna.spec import GnaSpec

    choice = _hopper_choice(monkeypatch)
    device = torch.device("cuda")
    whole = GnaSpec.of(3, (2, 8, 16), (2, 8, 16), precision="fp8")
    assert choice._choose(whole, whole.problem((4, 16, 16)), device, torch.bfloat16, 64, 1, False).backend == "gluon"
    partial = GnaSpec.of(3, (3, 9, 9), (1, 1, 1), precision="fp8")
    problem = partial.problem((4, 16, 16))
    few = choice._choose(partial, problem, device, torch.bfloat16, 64, 2, False)
    many = choice._choose(partial, problem, device, torch.bfloat16, 64, 1 << 16, False)
    assert few.backend == "triton"
    assert many.backend == "gluon" and math.prod(many.gluon.q_tile) == 128
    named = GnaSpec.of(3, (3, 9, 9), (1, 1, 1), precision="fp8", backend="gluon")
    picked = choice._choose(named, problem, device, torch.bfloat16, 64, 2, False)
    assert picked.backend == "gluon" and picked.gluon == many.gluon


@settings(max_examples=25, deadline=None)
@given(problem=problems(max_tokens=1024), heads=st.sampled_from([1, 3, 40, 700, 5000, 1 << 16]),
       head_dim=st.sampled_from([64, 128]), data=st.data())
def test_partial_tiles_pay_by_brute_force_counts_of_visited_pairs(problem, heads, head_dim, data):
    """The rule for partial Gluon tiles against brute-force counts (tests/bruteforce.py) on random GNA problems:
    at least PARTIAL_MIN_BLOCKS visited 128 x 128 blocks over the call's heads, and at most PARTIAL_PAIRS_RATIO
    times the query-key pairs of the tiles the Triton FP8 kernel runs (its own choice, or the call's tiles)."""
    from bruteforce import reference
    from natsim.kernels.gna import choice
    from natsim.kernels.gna.choice import Fa4Gna
    from natsim.kernels.gna.spec import GnaSpec

    tiles = [q for q, kv in tile_pairs(problem.shape, head_dim) if q == kv and math.prod(q) == BLOCK_N]
    assume(tiles)
    tile = data.draw(st.sampled_from(tiles), label="Gluon tile")
    named = data.draw(st.booleans(), label="call names the tiles")
    spec = GnaSpec.of(problem.ndim, problem.window, problem.stride, problem.dilation, problem.causal,
                      q_tile=tile if named else None, kv_tile=tile if named else None, precision="fp8")
    q_tile, kv_tile = choice._triton_fp8_tiles(spec, problem, head_dim)
    if named:
        assert (q_tile, kv_tile) == (tile, tile)
    mask = attention_mask(problem)
    blocks = reference(problem, tile, tile, mask=mask).visited_tiles
    triton_pairs = reference(problem, q_tile, kv_tile, mask=mask).visited_tiles * math.prod(q_tile) * math.prod(kv_tile)
    expected = (blocks * heads >= choice.PARTIAL_MIN_BLOCKS
                and blocks * BLOCK_N * BLOCK_N <= choice.PARTIAL_PAIRS_RATIO * triton_pairs)
    event(f"partial tiles pay: {expected}")
    assert choice._partial_tiles_pay(spec, problem, Fa4Gna(problem, tile, tile), head_dim, heads) == expected