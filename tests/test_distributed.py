"""Context parallelism: natsim.partition against brute force, the GNA kernel on frame ranges against the
float64 reference and its debug counters against the simulator, and natsim.distributed in gloo process groups
of 2 and 3 processes against single-process reference_attention / sparse_reference: outputs, gradients (eager
and compiled) and the bytes every collective moves, forward and backward.

Starting processes costs seconds each (importing torch), so one start of three processes runs every world: many
cases in a world of 3, then in a world of 2 of two of them, then examples/distributed.py as torchrun runs it,
with a deadline that fails the test instead of hanging; the three fork from a server that imported torch, natsim
and these modules once; hypothesis draws the worlds' cases in the parent, one example.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import runpy
import socket
import time
import warnings
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from natsim import Problem, TileConfig, simulate
from natsim.partition import (Link, Rate, check_split, even_split, head_groups, key_frames, offsets, pipeline_seconds,
                              rank_tiles, strategy_cost)
from natsim.kernels import gna_attention, gna_tile_counts, reference_attention

from bruteforce import attention_mask, coordinates, dim_mask, multi_d_layout, problems, static_counts

FAST = settings(max_examples=25, deadline=None)
KERNEL = settings(max_examples=6, deadline=None)
WORLD_DEADLINE_S = 240
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# -- the simulator's side: numpy against brute force -------------------------------------------------------


@st.composite
def frame_ranges(draw, problem):
    """Query frames [q0, q1) and key frames [k0, k1) of dimension 0 that hold every frame the queries reach,
    sometimes a few more."""
    L = problem.shape[0]
    q0 = draw(st.integers(0, L - 1))
    q1 = draw(st.integers(q0 + 1, L))
    k0, k1 = key_frames(problem, q0, q1)
    k0 -= draw(st.integers(0, k0))
    k1 += draw(st.integers(0, L - k1))
    return q0, q1, k0, k1


@FAST
@given(st.data())
def test_key_frames_are_the_hull_of_the_brute_force_mask(data):
    problem = data.draw(problems(max_tokens=300))
    L, w, s, d, c = (problem.shape[0], problem.window[0], problem.stride[0], problem.dilation[0],
                     problem.causal[0])
    q0 = data.draw(st.integers(0, L - 1))
    q1 = data.draw(st.integers(q0 + 1, L))
    attended = np.flatnonzero(dim_mask(L, w, s, d, c)[q0:q1].any(axis=0))
    assert key_frames(problem, q0, q1) == (attended.min(), attended.max() + 1)


def brute_rank_counts(problem, tiles, frames):
    """Per-Q-tile (visited, full) of queries in frames [q0, q1) against keys in [k0, k1), tiles cut from the
    local first frames, from the exact mask (tests/bruteforce.py)."""
    q0, q1, k0, k1 = frames
    q_tile, kv_tile = tiles.dims(problem)
    coords = coordinates(problem.shape)
    mask = attention_mask(problem)[np.ix_((coords[:, 0] >= q0) & (coords[:, 0] < q1),
                                          (coords[:, 0] >= k0) & (coords[:, 0] < k1))]
    q_problem, kv_problem = (SimpleNamespace(shape=(n, *problem.shape[1:]), window=1, stride=1,
                                             dilation=problem.dilation, causal=False) for n in (q1 - q0, k1 - k0))
    q_of, _, num_q = multi_d_layout(q_problem, q_tile)
    kv_of, _, num_kv = multi_d_layout(kv_problem, kv_tile)
    visited, full = static_counts(mask, q_of, num_q, kv_of, num_kv)
    return visited.sum(1), full.sum(1)


@FAST
@given(st.data())
def test_rank_tiles_equal_brute_force(data):
    problem = data.draw(problems(max_tokens=240))
    frames = data.draw(frame_ranges(problem))
    tiles = TileConfig(tuple(data.draw(st.integers(1, 4)) for _ in problem.shape),
                       tuple(data.draw(st.integers(1, 4)) for _ in problem.shape))
    counts = rank_tiles(problem, tiles, frames[:2], frames[2:])
    visited, full = brute_rank_counts(problem, tiles, frames)
    np.testing.assert_array_equal(counts.per_q_tile_visited, visited)
    np.testing.assert_array_equal(counts.per_q_tile_full, full)
    assert (counts.visited, counts.full) == (visited.sum(), full.sum())


def test_rank_tiles_of_the_whole_layout_are_the_simulators():
    from natsim import simulate

    problem = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    tiles = TileConfig((4, 8, 8), (2, 8, 8))
    whole = rank_tiles(problem, tiles, (0, 30))
    sim = simulate(problem, tiles)
    assert (whole.visited, whole.full, whole.most) == (sim.visited_tiles, sim.full_tiles, sim.max_kv_tiles)


def test_strategy_bytes_by_hand():
    # 30 frames split 16 / 14, window 18 stride 16 along frames: rank 0 (frames 0-15) reads keys 0-17, rank 1
    # (16-29) keys 12-29; a frame of 48 x 80 tokens, 24 heads of 128 bf16 values.
    problem = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    tiles = TileConfig((4, 8, 8), (2, 8, 8))
    frame = 48 * 80 * 24 * 128 * 2
    halo = strategy_cost(problem, tiles, (16, 14), "halo", batch=1, heads=24, head_dim=128, element_bytes=2)
    assert [r.key_frames for r in halo.ranks] == [(0, 18), (12, 30)]
    assert [(r.bytes_sent, r.bytes_received) for r in halo.ranks] == [(2 * 4 * frame, 2 * 2 * frame),
                                                                      (2 * 2 * frame, 2 * 4 * frame)]
    ulysses = strategy_cost(problem, tiles, (16, 14), "ulysses", batch=1, heads=24, head_dim=128, element_bytes=2)
    # rank 0 sends half the heads of its 16 frames of q, k, v and gets back the other rank's 14 frames of out
    assert ulysses.ranks[0].bytes_sent == (3 * 16 + 14) * frame // 2
    assert ulysses.ranks[0].bytes_received == (3 * 14 + 16) * frame // 2
    assert halo.bytes_moved * 3 <= ulysses.bytes_moved
    # 16 heads over 3 ranks: padded to 18, 6 a rank; every move carries the zero heads too
    padded = strategy_cost(problem, tiles, (10, 10, 10), "ulysses", batch=1, heads=16, head_dim=128,
                           element_bytes=2)
    slice_bytes = 48 * 80 * 6 * 128 * 2  # one frame of a rank's 6 heads
    assert padded.ranks[0].bytes_sent == (3 * 10 * 2 + 20) * slice_bytes
    assert padded.ranks[0].bytes_received == (3 * 20 + 10 * 2) * slice_bytes
    assert padded.ranks[0].heads == 6 and padded.ranks[0].visited_tiles == simulate(problem, tiles).visited_tiles * 6
    with pytest.raises(ValueError, match="add up to the 30 frames"):
        check_split((10, 10), 30)
    assert even_split(10, 3) == (4, 3, 3) and offsets((4, 3, 3)) == (0, 4, 7, 10)


def test_training_bytes_and_seconds_by_hand():
    # The backward moves the forward's bytes with the directions swapped: the halo's gradients of the key and
    # value frames a rank received go back to their owners; Ulysses' output gradient goes out to head-sharded
    # sequences (P - 1 of P head slices of own frames) and the gradients of q, k and v come back.
    problem = Problem((30, 48, 80), (18, 24, 24), (16, 8, 8))
    tiles = TileConfig((4, 8, 8), (2, 8, 8))
    frame = 48 * 80 * 24 * 128 * 2
    options = dict(batch=1, heads=24, head_dim=128, element_bytes=2, tile_seconds=1e-6, link=Link.uniform(1e11))
    for strategy in ("halo", "ulysses"):  # Ulysses with its heads in one group: its moves one after the other
        forward = strategy_cost(problem, tiles, (16, 14), strategy, chunks=1, **options)
        training = strategy_cost(problem, tiles, (16, 14), strategy, chunks=1, training=True, **options)
        for f, r in zip(forward.ranks, training.ranks):
            assert (f.backward_bytes_sent, f.backward_bytes_received) == (0, 0)
            assert (r.backward_bytes_sent, r.backward_bytes_received) == (f.bytes_received, f.bytes_sent)
            # the halo's one move; Ulysses' two, each the larger way (24 and 8 half-frames, test_link.py)
            wire = max(f.bytes_sent, f.bytes_received) / 1e11 if strategy == "halo" else 32 * frame / 1e11
            assert r.seconds == pytest.approx(f.seconds + r.visited_tiles * 3.5e-6 + wire, rel=1e-12)
        assert training.bytes_moved == 2 * forward.bytes_moved
    ulysses = strategy_cost(problem, tiles, (16, 14), "ulysses", training=True, **options)
    assert ulysses.ranks[0].backward_bytes_sent == (16 + 3 * 14) * frame // 2
    assert ulysses.ranks[0].backward_bytes_received == (14 + 3 * 16) * frame // 2
    assert ulysses.to_dict()["ranks"][0]["backward_bytes_sent"] == (16 + 3 * 14) * frame // 2


# -- the kernel on a frame range ---------------------------------------------------------------------------


@FAST
@given(st.data())
def test_reference_on_frames_is_the_slice_of_the_whole(data):
    problem = data.draw(problems(max_tokens=200))
    q0, q1, k0, k1 = data.draw(frame_ranges(problem))
    q, k, v = (torch.randn(1, *problem.shape, 2, 8, dtype=torch.float64) for _ in range(3))
    args = (problem.window, problem.stride, problem.dilation, problem.causal)
    whole = reference_attention(q, k, v, *args)
    part = reference_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], *args,
                               frame_offsets=(q0, k0, problem.shape[0]))
    torch.testing.assert_close(part, whole[:, q0:q1], rtol=1e-12, atol=1e-12)


@st.composite
def kernel_cases(draw):
    """A small problem whose kernel tiles hold 16 to 256 tokens, frame ranges and tiles."""
    problem = draw(problems(max_tokens=160))
    assume(problem.num_tokens >= 16)
    frames = draw(frame_ranges(problem))
    tile = draw(st.sampled_from([16, 32, 64]))
    shapes = [t for t in _boxes(tile, problem.ndim) if all(a <= 2 * L for a, L in zip(t, problem.shape))]
    assume(shapes)
    q_tile = draw(st.sampled_from(shapes))
    kv_tile = draw(st.sampled_from(shapes))
    return problem, frames, q_tile, kv_tile


def _boxes(tokens: int, ndim: int) -> list[tuple[int, ...]]:
    e = tokens.bit_length() - 1
    out = []
    for parts in np.ndindex(*(e + 1,) * ndim):
        if sum(parts) == e:
            out.append(tuple(1 << p for p in parts))
    return out


@KERNEL
@given(kernel_cases())
def test_kernel_counts_on_frames_equal_the_simulators(case):
    problem, frames, q_tile, kv_tile = case
    visited, unmasked = gna_tile_counts(problem.shape, problem.window, problem.stride, problem.dilation,
                                        problem.causal, q_tile, kv_tile, device="cpu", frames=frames)
    counts = rank_tiles(problem, TileConfig(q_tile, kv_tile), frames[:2], frames[2:])
    np.testing.assert_array_equal(visited, counts.per_q_tile_visited)
    np.testing.assert_array_equal(unmasked, counts.per_q_tile_full)


@KERNEL
@given(kernel_cases(), st.sampled_from([1, 2]))
def test_kernel_on_frames_matches_the_reference(case, heads):
    problem, (q0, q1, k0, k1), q_tile, kv_tile = case
    # One head or two: the interpreter's time grows with heads (the gloo worlds below run frame ranges on the
    # torch reference).
    q, k, v = (torch.randn(1, *problem.shape, heads, 32, dtype=torch.float16) for _ in range(3))
    args = (problem.window, problem.stride, problem.dilation, problem.causal)
    expected = reference_attention(q.double(), k.double(), v.double(), *args)[:, q0:q1]
    out = gna_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], *args, q_tile=q_tile, kv_tile=kv_tile,
                        frame_offsets=(q0, k0, problem.shape[0]))
    assert ((out.double() - expected).norm() / expected.norm()).item() < 5e-3


def test_frame_offsets_compile_fullgraph_and_reference_gradients(reference_path):
    """The operator with frame offsets under torch.compile(fullgraph=True), and the reference path's
    gradients (CPU) equal autograd through the reference on the whole layout, restricted to the frames."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 9, 6, 2, 32, dtype=torch.float64, requires_grad=True) for _ in range(3))
    args = dict(window=(5, 3), stride=(2, 1))

    def model(q, k, v):
        return gna_attention(q[:, 3:7], k[:, 1:9], v[:, 1:9], **args, frame_offsets=(3, 1, 9)) * 2.0

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # Inductor: tests/test_ops.py
    out = compiled(q, k, v)
    expected = reference_attention(q, k, v, **args)[:, 3:7] * 2.0
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dilation", [1, 2])
def test_kernel_on_frames_gpu(dilation):
    """HunyuanVideo-like frame ranges on the GPU in bf16: layout path (dilation 1) and permuted path."""
    shape, window, stride = (30, 24, 40), (9, 12, 12), (4, 4, 4)
    problem = Problem(shape, window, stride, (dilation, 1, 1))
    q, k, v = (torch.randn(1, *shape, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    whole = gna_attention(q, k, v, window, stride, (dilation, 1, 1))
    for q0, q1 in ((0, 15), (15, 30), (7, 19)):
        k0, k1 = key_frames(problem, q0, q1)
        out = gna_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], window, stride, (dilation, 1, 1),
                            frame_offsets=(q0, k0, 30))
        expected = reference_attention(q[:, q0:q1].double(), k[:, k0:k1].double(), v[:, k0:k1].double(), window,
                                       stride, (dilation, 1, 1), frame_offsets=(q0, k0, 30))
        assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2
        assert ((out.float() - whole[:, q0:q1].float()).norm() / whole[:, q0:q1].float().norm()).item() < 1e-2


def test_frame_offsets_errors():
    q = torch.randn(1, 4, 6, 2, 32, dtype=torch.float16)
    k = torch.randn(1, 5, 6, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"must hold every frame that q's frames \[4, 8\) attend"):
        gna_attention(q, k, k, (5, 3), frame_offsets=(4, 4, 12))
    with pytest.raises(ValueError, match="within the 7 frames"):
        gna_attention(q, k, k, (5, 3), frame_offsets=(4, 2, 7))
    with pytest.raises(ValueError, match="three non-negative ints"):
        gna_attention(q, k, k, (5, 3), frame_offsets=(4, -1, 12))
    with pytest.raises(ValueError, match="along dimension 0 of the layout"):
        gna_attention(q, k[:, :, :5], k[:, :, :5], (5, 3), frame_offsets=(0, 0, 12))
    with pytest.raises(ValueError, match="frames must be"):
        gna_tile_counts((12, 6), (5, 3), q_tile=(4, 4), frames=(4, 8, 5, 9), device="cpu")
    k8 = torch.randn(1, 8, 6, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="static KV tiling only"):
        gna_attention(q, k8, k8, (5, 3), frame_offsets=(4, 2, 12), kv_tiling="dynamic")
    with pytest.raises(ValueError, match="static KV tiling only"):
        gna_tile_counts((12, 6), (5, 3), q_tile=(4, 4), frames=(4, 8, 3, 12), device="cpu", kv_tiling="dynamic")


def test_frame_offsets_refuse_gradients_on_the_triton_path():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU (conftest)
    q = torch.randn(1, 4, 6, 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    k = torch.randn(1, 8, 6, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(RuntimeError, match="frame_offsets .* has no backward kernel yet"):
        gna_attention(q, k, k, (5, 3), frame_offsets=(4, 2, 12))
    with torch.no_grad():
        assert gna_attention(q, k, k, (5, 3), frame_offsets=(4, 2, 12)).shape == q.shape


def test_not_initialised():
    import natsim.distributed as nd

    q = torch.randn(1, 4, 6, 2, 32)
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        nd.gna_attention(q, q, q, 3)


def test_what_auto_chooses_among():
    from natsim.distributed import gna as distributed_gna

    assert distributed_gna._runnable(distributed_gna.HALO_GRADIENT_REFUSAL) == ("ulysses",)
    assert distributed_gna._runnable(distributed_gna.HALO_DYNAMIC_REFUSAL) == ("ulysses",)
    assert distributed_gna._runnable(None) == ("ulysses", "halo")  # ulysses for any heads: padded where needed


def test_each_strategy_is_priced_with_the_tiles_it_runs():
    """Ulysses runs the whole layout with natsim's KV tiling choice (the single-GPU dispatcher's), the halo
    exchange frame ranges with static tiling: auto prices each with those tiles. On Wan 720p's 7x21x35 window at
    2 ranks, priced alike (static), halo looked faster; with each its own tiles, Ulysses is, as measured."""
    from natsim.distributed import gna as distributed_gna
    from natsim.kernels.backends.triton import choose_tiles
    from natsim.partition import even_split

    problem = Problem((21, 45, 80), (7, 21, 35))
    tiles = distributed_gna.strategy_tiles(problem, 128)
    assert tiles.halo.kv_tiling == "static"
    assert (tiles.ulysses.q_tile, tiles.ulysses.kv_tile, tiles.ulysses.kv_tiling) == choose_tiles(
        problem, 128, ("static", "dynamic"))
    assert (tiles.halo.q_tile, tiles.halo.kv_tile) == choose_tiles(problem, 128)[:2]
    assert tiles.ulysses.kv_tiling == "dynamic"  # fewer tiles than static here: the case this guards
    given = distributed_gna.strategy_tiles(problem, 128, (1, 8, 8), None, "static")
    assert given.ulysses == given.halo == TileConfig((1, 8, 8), (1, 8, 8))
    link = Link(Rate(235.6e9, 3.1e-4), Rate(312.8e9, 1.6e-4))  # two H200s, measured (natsim/links)
    split = even_split(21, 2)
    assert distributed_gna.choose(problem, tiles, split, 1, 40, 128, 2, link=link) == "ulysses"
    for strategy in ("ulysses", "halo"):  # each priced with its own tiles
        assert strategy_cost(problem, getattr(tiles, strategy), split, strategy, batch=1, heads=40, head_dim=128,
                             element_bytes=2, link=link).seconds > 0
    alike = distributed_gna.StrategyTiles(tiles.halo, tiles.halo)
    assert distributed_gna.choose(problem, alike, split, 1, 40, 128, 2, link=link) == "halo"


def test_a_ranks_heads_of_a_block_mask_pad_with_the_last_heads_mask():
    """Five heads over two ranks, three a rank: the second rank gets heads 3 and 4 and, for its zero head, head
    4's mask again, from a boolean mask and a SparseMask alike; a broadcast mask stays as it is."""
    from natsim.distributed.sparse import _mask_heads
    from natsim.kernels import SparseMask

    dense = torch.rand(1, 5, 4, 4, generator=torch.Generator().manual_seed(3)) < 0.5
    assert torch.equal(_mask_heads(dense, 5, 0, 3), dense[:, :3])
    assert torch.equal(_mask_heads(dense, 5, 3, 6), dense[:, [3, 4, 4]])
    sparse = SparseMask.from_dense(dense, 16, 16, 64)
    padded = _mask_heads(sparse, 5, 3, 6)
    assert torch.equal(padded.kv_num_blocks, sparse.kv_num_blocks[:, [3, 4, 4]])
    assert torch.equal(padded.kv_indices, sparse.kv_indices[:, [3, 4, 4]])
    one = dense[:, :1]
    assert _mask_heads(one, 5, 3, 6) is one


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone (no spawn), for refusals that need an initialised group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ulysses", "halo", "auto"])
def test_compiled_calls_whose_window_changes_specialise_on_each_value(one_rank_group, strategy, reference_path):
    """natsim.distributed's GNA compiled once and called with another window and stride each time (Dynamo makes
    such ints symbolic when it recompiles): each call is the single-process call's, in a group of one."""
    import natsim.distributed as nd

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 8, 6, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    gna = torch.compile(lambda q, k, v, window, stride: nd.gna_attention(q, k, v, window, stride, strategy=strategy,
                                                                         split=(8,)),
                        fullgraph=True, backend="eager")
    for window, stride in (((3, 3), 1), ((7, 5), (7, 1))):
        assert torch.equal(gna(q, k, v, window, stride), gna_attention(q, k, v, window, stride)), (window, stride)


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("strategy", ["ulysses", "halo", "auto"])
def test_compiled_calls_whose_layout_changes_run_each_layout(one_rank_group, strategy, dynamic, reference_path):
    """natsim.distributed's GNA compiled once and called on other frame counts, heads and sides (Dynamo makes such
    sizes symbolic on the second call, or from the first with dynamic=True): each call is the single-process
    call's, in a group of one (the halo strategy's frame ranges included)."""
    import natsim.distributed as nd

    torch._dynamo.reset()
    gna = torch.compile(lambda q, k, v, split: nd.gna_attention(q, k, v, (3, 3), strategy=strategy, split=split),
                        fullgraph=True, dynamic=dynamic, backend="eager")
    for frames, side, heads in ((5, 4, 2), (7, 4, 2), (9, 6, 3)):
        q, k, v = (torch.randn(1, frames, side, heads, 16, generator=torch.Generator().manual_seed(i))
                   for i in range(3))
        assert torch.equal(gna(q, k, v, (frames,)), gna_attention(q, k, v, (3, 3))), (frames, side, heads)


@pytest.mark.parametrize("call", ["gna", "mask"])
def test_a_compiled_call_without_split_is_refused_with_a_sentence(one_rank_group, call, reference_path):
    """Without split= a call all-gathers the ranks' frames and reads them on the host: eagerly that is one small
    collective, but a graph cannot hold it (tracing it hung, or failed on a data-dependent guard under
    dynamic=True), so a compiled call says to give split."""
    import natsim.distributed as nd

    torch._dynamo.reset()
    x = torch.randn(1, 4, 6, 2, 16, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 2, 2, 2, dtype=torch.bool)
    from natsim.kernels import sparse_attention

    flat = x.flatten(1, 2)
    attend, alone = (((lambda x: nd.gna_attention(x, x, x, (3, 3))), gna_attention(x, x, x, (3, 3))) if call == "gna"
                     else ((lambda x: nd.sparse_attention(x, x, x, mask, 16, 16)), sparse_attention(flat, flat, flat,
                                                                                                   mask, 16, 16)))
    x = x if call == "gna" else flat
    assert torch.equal(attend(x), alone)  # eagerly: one collective in a group of one
    with pytest.raises(Exception, match=r"under torch.compile, give split=\.\.\. \(the frames of each rank"):
        torch.compile(attend, fullgraph=True, backend="eager")(x)


def test_splits_and_block_counts_are_refused_as_given(one_rank_group):
    """A fractional split is refused (int() truncated 3.5 to 3 and ran), and a mask whose block counts do not fit
    the whole sequence is refused naming the shape given (the single-GPU check named this rank's cut of it)."""
    import natsim.distributed as nd

    x = torch.randn(1, 6, 4, 2, 16)
    with pytest.raises(ValueError, match=r"split must be whole frame counts, got split=\(6.0,\)"):
        nd.gna_attention(x, x, x, (3, 3), split=(6.0,))
    flat = x.flatten(1, 2)  # 24 tokens: 2 x 2 blocks of 16
    mask = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"= \[\*, \*, 2, 2\] for the N = 24 tokens of all ranks, got "
                                         r"mask.shape=\(1, 2, 3, 3\)"):
        nd.sparse_attention(flat, flat, flat, mask, 16, 16, split=(24,))


def test_compiled_block_mask_calls_whose_blocks_change_specialise_on_each_value(one_rank_group, reference_path):
    """natsim.distributed's block-mask attention compiled once and called with other block sizes: each call is the
    single-process call's, in a group of one."""
    import natsim.distributed as nd
    from natsim.kernels import sparse_attention

    torch._dynamo.reset()
    x = torch.randn(1, 48, 2, 16, generator=torch.Generator().manual_seed(0))
    blocks = torch.compile(lambda x, mask, q_block, kv_block: nd.sparse_attention(x, x, x, mask, q_block, kv_block,
                                                                                  split=(48,)),
                           fullgraph=True, backend="eager")
    for q_block, kv_block in ((16, 16), (32, 8)):
        mask = torch.rand(1, 2, -(-48 // q_block), -(-48 // kv_block), generator=torch.Generator().manual_seed(5)) < 0.6
        assert torch.equal(blocks(x, mask, q_block, kv_block), sparse_attention(x, x, x, mask, q_block, kv_block)), \
            (q_block, kv_block)


def test_collective_operators(one_rank_group):
    """The halo exchange's operators against torch.library.opcheck in a group of one: fake implementations against
    the real outputs, the schemas, and the backward formulas (each move's adjoint, itself an operator) under
    autograd and AOTAutograd."""
    from natsim.distributed.collectives import HaloRoutes, group_name

    group = group_name(None)
    x = torch.randn(2, 3, 4, 2, 8, dtype=torch.float64)
    halo = HaloRoutes((0, 3), (0, 3), (), ()).as_ints()
    for op in (torch.ops.natsim.cp_gather_halo, torch.ops.natsim.cp_return_halo):
        torch.library.opcheck(op, (x, x.flip(1), halo, group))
    routes = HaloRoutes((4, 9), (2, 11), ((0, 4, 6), (2, 7, 9)), ((0, 2, 4), (2, 9, 11)))
    assert HaloRoutes.from_ints(routes.as_ints()) == routes


def test_transfers_run_on_a_high_priority_twin_of_an_nccl_group(one_rank_group, monkeypatch):
    """A gloo group moves on itself; an NCCL group on one twin over its ranks, made once with high-priority
    streams and synchronising only its ranks; none where the environment says so (NCCL faked: the CPU build has
    none)."""
    from natsim.distributed import collectives

    world = dist.group.WORLD
    assert collectives.transfer_group(None) is world
    assert collectives.transfer_group(collectives.group_name(None)) is world

    made = []

    class Options:
        def __init__(self, is_high_priority_stream=False):
            self.is_high_priority_stream = is_high_priority_stream

    def new_group(ranks, **options):
        made.append((ranks, options))
        return object()

    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("ProcessGroupNCCL", (), {"Options": Options}), raising=False)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(collectives, "_twins", {})
    for name in ("NATSIM_NCCL_HIGH_PRIORITY", "TORCH_NCCL_HIGH_PRIORITY"):
        monkeypatch.delenv(name, raising=False)
    twin = collectives.transfer_group(world)
    assert twin is not world and collectives.transfer_group(None) is twin and len(made) == 1
    ranks, options = made[0]
    assert ranks == [0] and options["backend"] == "nccl" and options["use_local_synchronization"]
    assert options["pg_options"].is_high_priority_stream
    for name, value in (("NATSIM_NCCL_HIGH_PRIORITY", "0"), ("TORCH_NCCL_HIGH_PRIORITY", "1")):
        with monkeypatch.context() as scoped:
            scoped.setenv(name, value)
            assert collectives.transfer_group(world) is world
    assert len(made) == 1


def test_exchanges_launched_together_share_one_wait(one_rank_group, monkeypatch):
    """`launched_together`: where the backend does not coalesce (gloo) each exchange keeps its own work; where it
    does (NCCL; faked here, with CUDA tensors' device type), the exchanges started inside go out under PyTorch's
    coalescing manager, once, and each waits on its one work; what arrives is what was sent either way."""
    from natsim.distributed import collectives

    group = dist.group.WORLD
    x = torch.arange(24.0).view(1, 2, 3, 4)
    with collectives.launched_together(group, x.device) as started:
        started += [collectives.start_exchange([t], [tuple(t.shape)], group, packed=t) for t in (x, 2 * x)]
    assert started[0].work is not started[1].work
    assert [torch.equal(p.wait()[0], t) for p, t in zip(started, (x, 2 * x))] == [True, True]

    entered = []

    class Manager:
        waited = 0

        def wait(self):
            Manager.waited += 1

    @contextlib.contextmanager
    def coalescing(group_, device, async_ops):
        entered.append((group_, device.type, async_ops))
        yield Manager()

    backend = type("Backend", (), {"supports_coalescing": True})()
    exchange = dist.all_to_all_single
    monkeypatch.setattr(type(group), "_get_backend", lambda self, device: backend)
    monkeypatch.setattr(dist, "_coalescing_manager", coalescing)
    monkeypatch.setattr(dist, "all_to_all_single",  # done on return: the fake manager's wait waits for nothing
                        lambda *args, async_op, **kwargs: exchange(*args, async_op=False, **kwargs))
    cuda = type("Device", (), {"type": "cuda"})()
    with collectives.launched_together(group, cuda) as started:
        started += [collectives.start_exchange([t], [tuple(t.shape)], group, packed=t) for t in (x, 2 * x)]
    assert entered == [(group, "cuda", True)]
    assert isinstance(started[0].work, Manager) and started[0].work is started[1].work
    assert [torch.equal(p.wait()[0], t) for p, t in zip(started, (x, 2 * x))] == [True, True]
    assert Manager.waited == 2


def test_ulysses_pipeline_operator(one_rank_group):
    """natsim::cp_ulysses in a group of one: torch.library.opcheck's schema, fake and autograd-registration checks
    (its handle output differs from run to run, which the AOTAutograd check compares), with and without the graphs
    kept, in groups of heads of any sizes; then its gradients eager and under AOTAutograd against the float64
    reference's."""
    from natsim.distributed.collectives import group_name
    from natsim.distributed.pipeline import register_attend, ulysses_attention

    attend = register_attend(lambda q, k, v, extras, scale, span: reference_attention(q, k, v, (3, 2), scale=scale))
    x = torch.randn(2, 5, 4, 3, 8, dtype=torch.float64)
    for groups, keep in (([3], False), ([2, 1], True), ([1, 1, 1], True), ([1, 2], True)):
        args = (x, x.flip(1), x.flip(2), [], attend, 0.5, groups, [5], 0, group_name(None), keep)
        torch.library.opcheck(torch.ops.natsim.cp_ulysses, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    for groups in ([2, 2], [3, 0], []):
        with pytest.raises(ValueError, match="adding up to the 3 heads each rank attends"):
            torch.ops.natsim.cp_ulysses(x, x, x, [], attend, None, groups, [5], 0, group_name(None), False)
    with pytest.raises(ValueError, match="chunks must be between 1 and the 3 heads"):
        ulysses_attention(attend, x, x, x, (5,), 0, None, chunks=4)

    inputs = [torch.randn(2, 5, 4, 3, 8, dtype=torch.float64) for _ in range(4)]
    want = _gradients(lambda q, k, v: reference_attention(q, k, v, (3, 2)), inputs[:3], inputs[3])
    run = functools.partial(ulysses_attention, attend, split=(5,), rank=0, group=None, chunks=2)
    torch._dynamo.reset()
    for fn in (run, torch.compile(run, fullgraph=True, backend="aot_eager")):
        _assert_gradients(_gradients(fn, inputs[:3], inputs[3]), want, 1e-10, "natsim::cp_ulysses")
    # the graphs handed to the backward live as long as the forward's graph, and none are kept without gradients
    from natsim.kernels.common import handles

    held = len(handles._held)
    with torch.no_grad():
        run(*inputs[:3])
    assert len(handles._held) == held
    leaves = [x.detach().requires_grad_() for x in inputs[:3]]
    out = run(*leaves)
    assert len(handles._held) == held + 1
    del out
    assert len(handles._held) == held


@pytest.mark.gpu
def test_an_exchange_issued_at_a_point_waits_for_the_work_before_it_only(one_rank_group):
    """What the Ulysses pipeline relies on to issue its later groups after the first attention: an exchange issued
    at an IssuePoint does not wait for a kernel enqueued on the current stream after the point (a sleep of about a
    second here), and delivers what was there before it; issued without a point, it waits for that kernel."""
    from natsim.distributed.collectives import IssuePoint, start_exchange

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    group = dist.new_group([0], backend="nccl")
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)

    def done_within(pending, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not pending.work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)
        return pending.work.is_completed()

    start_exchange([x], [tuple(x.shape)], group, packed=x).wait()  # the communicator made before anything is timed
    torch.cuda.synchronize()
    point = IssuePoint(x.device)
    torch.cuda._sleep(2_000_000_000)
    pending = start_exchange([x], [tuple(x.shape)], group, packed=x, issue=point)
    assert done_within(pending, 0.3) and not torch.cuda.current_stream().query()  # the sleep still runs
    (received,) = pending.wait()
    assert torch.equal(received, x)
    torch.cuda._sleep(2_000_000_000)
    pending = start_exchange([x], [tuple(x.shape)], group, packed=x)
    assert not done_within(pending, 0.3)
    pending.wait()
    torch.cuda.synchronize()
    dist.destroy_process_group(group)


def test_ulysses_pipeline_refuses_cuda_graph_capture(one_rank_group, monkeypatch):
    from natsim.distributed.collectives import group_name
    from natsim.distributed.pipeline import register_attend

    attend = register_attend(lambda q, k, v, extras, scale, span: q)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = torch.randn(1, 2, 3, 2, 8)
    with pytest.raises(RuntimeError, match="does not run under CUDA graph capture"):
        torch.ops.natsim.cp_ulysses(x, x, x, [], attend, None, [2], [2], 0, group_name(None), False)


@given(heads=st.integers(1, 64), data=st.data())
def test_head_groups_cover_the_heads(heads, data):
    """`chunks` groups (by default up to MAX_DEFAULT_CHUNKS of at least MIN_DEFAULT_GROUP_HEADS heads, one group
    below that), as even as they divide, the larger first; the spans the pipeline cuts from any sizes tile the heads
    in order."""
    from natsim.distributed.pipeline import head_spans
    from natsim.partition import MAX_DEFAULT_CHUNKS, MIN_DEFAULT_GROUP_HEADS, head_groups

    chunks = data.draw(st.integers(1, heads))
    sizes = data.draw(st.one_of(st.just(head_groups(heads, chunks)), st.just(head_groups(heads)),
                                st.lists(st.integers(1, 4), min_size=1).map(tuple)))
    if sizes == head_groups(heads, chunks):
        assert len(sizes) == chunks and sum(sizes) == heads and max(sizes) - min(sizes) <= 1
        assert list(sizes) == sorted(sizes, reverse=True)
    default = head_groups(heads)
    assert sum(default) == heads and max(default) - min(default) <= 1
    assert len(default) == min(MAX_DEFAULT_CHUNKS, max(1, heads // MIN_DEFAULT_GROUP_HEADS))
    assert min(default) >= MIN_DEFAULT_GROUP_HEADS or len(default) == 1
    if sum(sizes) != heads:
        with pytest.raises(ValueError, match=f"adding up to the {heads} heads"):
            head_spans(sizes, heads)
        return
    spans = head_spans(sizes, heads)
    assert spans[0][0] == 0 and spans[-1][1] == heads and [hi - lo for lo, hi in spans] == list(sizes)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="chunks must be between 1 and"):
        head_groups(heads, heads + 1)


def test_halo_refuses_gradients_on_the_triton_path_where_gathered_frames_differ(one_rank_group):
    """A stride or a causal window along the frames: the gathered frames as a layout of their own would give
    other windows, and frame ranges have no backward kernel."""
    import natsim.distributed as nd

    q = torch.randn(1, 4, 6, 2, 32, dtype=torch.float16, requires_grad=True)
    for options in (dict(stride=(2, 1)), dict(causal=(True, False))):
        with pytest.raises(RuntimeError, match=r"only where a rank's gathered frames can run as a layout of their"):
            nd.gna_attention(q, q.detach(), q.detach(), 3, strategy="halo", split=(4,), **options)


def test_halo_trains_on_the_triton_path_on_its_gathered_frames(monkeypatch):
    """The halo strategy's training path on the kernels (the interpreter here), two ranks in one process: each
    rank's call of `strategies.halo` on its gathered frames, the exchange replaced by slices of the whole k and v
    (what it delivers; the gloo worlds hold the real exchange and its adjoint), and the summed gradients against
    the single-GPU call's, outputs too; stride along the other dims, an even window and a window wider than a
    rank's frames."""
    from natsim.distributed import strategies

    problem, split = Problem((7, 4, 8), (4, 3, 5), (1, 2, 1)), (3, 4)
    args = dict(window=problem.window, stride=problem.stride)
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(1, *problem.shape, 2, 32, generator=generator).half() for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    monkeypatch.setattr(strategies, "gather_halo",
                        lambda k_, v_, routes, group: tuple(x[:, slice(*routes.keys)] for x in leaves[1:]))
    kernel = functools.partial(gna_attention, **args)
    t = offsets(split)
    outs = [strategies.halo(kernel, problem, leaves[0][:, t[r]:t[r + 1]], None, None, split, r, None,
                            on_gathered_frames=True) for r in range(2)]
    out = torch.cat(outs, dim=1)
    got = torch.autograd.grad(out, leaves, grad)
    expected = gna_attention(*whole, **args)
    want = torch.autograd.grad(expected, whole, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), (expected, *want)):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m: f"{name}: {m}")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_gathered_frames_as_a_layout_give_each_rank_its_queries_windows(data):
    """Where `trains_on_gathered_frames` (stride 1, dilation 1, no causal window along dimension 0), GNA on a
    rank's gathered frames taken as a layout of their own, zeros on the other frames' queries, equals the whole
    layout's GNA on the rank's queries (float64 reference); and the halo strategy prices that layout's tiles."""
    from natsim.distributed.strategies import halo_routes, trains_on_gathered_frames

    drawn = data.draw(problems(max_tokens=200).filter(lambda p: p.shape[0] >= 2))
    problem = Problem(drawn.shape, drawn.window, (1, *drawn.stride[1:]), (1, *drawn.dilation[1:]),
                      (False, *drawn.causal[1:]))  # along the frames what trains on gathered frames
    assert trains_on_gathered_frames(problem)
    split = data.draw(st.sampled_from([s for s in ((problem.shape[0] // 2, problem.shape[0] - problem.shape[0] // 2),
                                                   (1, problem.shape[0] - 1))]))
    rank = data.draw(st.integers(0, 1))
    routes = halo_routes(problem, split, rank)
    (own, own_end), (first, last) = routes.own, routes.keys
    args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(1, *problem.shape, 2, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    whole = reference_attention(q, k, v, **args)[:, own:own_end]
    rows = torch.zeros_like(k[:, first:last])
    rows[:, own - first:own_end - first] = q[:, own:own_end]
    gathered = reference_attention(rows, k[:, first:last], v[:, first:last], **args)[:, own - first:own_end - first]
    torch.testing.assert_close(gathered, whole, rtol=1e-12, atol=1e-12)
    tiles = TileConfig(1, 1)
    local = Problem((last - first, *problem.shape[1:]), problem.window, problem.stride, problem.dilation,
                    problem.causal)
    cost = strategy_cost(problem, tiles, split, "halo", batch=1, heads=2, head_dim=8, element_bytes=8,
                         halo_on_gathered=True)
    assert cost.ranks[rank].visited_tiles == simulate(local, tiles).visited_tiles * 2


# -- process groups ----------------------------------------------------------------------------------------

# (shape, window, stride, dilation, causal, split per world size): windows wider than a slab, stride, dilation
# and causal along the sharded dimension, uneven splits, a rank with one frame and one with none. Few cases
# and few calls per world: every kernel call runs in the interpreter. The batch-2 case (the dearest: a third
# of a rank's time) runs in the world of 2 only; in the world of 3 the 1-D case below holds a middle rank
# receiving dilated halos from both sides.
GNA_CASES = [
    ((9, 4, 4), (5, 3, 3), 1, 1, False, {2: (5, 4)}),
    ((9, 4, 4), (7, 3, 3), (3, 1, 1), 1, False, {2: (6, 3), 3: (1, 6, 2)}),
    ((10, 4, 4), (4, 3, 3), (2, 1, 1), (2, 1, 1), False, {2: (3, 7)}),
    ((10, 4, 4), (4, 4, 3), (3, 2, 1), (2, 1, 1), (True, False, False), {2: (5, 5), 3: (2, 5, 3)}),
    ((11, 16), (6, 5), (2, 1), 1, (True, False), {2: (4, 7), 3: (6, 0, 5)}),
    ((20,), (9,), (2,), (2,), False, {2: (11, 9), 3: (7, 7, 6)}),
]
AUTO_CASES = (0, 4)  # "auto" with the split all-gathered from the group (the others pass split=)
HEADS_PER_RANK, HEAD_DIM = 2, 32  # Ulysses gives each rank two heads: 4 in a world of 2, 6 in one of 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_outputs(rank: int, world: int) -> None:
    """Every case, every strategy, against the single-process reference (fresh inputs, one seed for all ranks);
    bytes moved against natsim.partition; sparse attention under a per-head mask."""
    heads = HEADS_PER_RANK * world
    import natsim.distributed as nd
    from natsim.kernels import SparseMask, sparse_reference

    with _bytes_sent(rank) as sent:
        for index, (shape, window, stride, dilation, causal, splits) in enumerate(GNA_CASES):
            if world not in splits:
                continue
            split = splits[world]
            t = offsets(split)
            generator = torch.Generator().manual_seed(index)
            batch = 2 if index == 2 else 1
            q, k, v = (torch.randn(batch, *shape, heads, HEAD_DIM, generator=generator, dtype=torch.float16)
                       for _ in range(3))
            args = dict(window=window, stride=stride, dilation=dilation, causal=causal)
            expected = reference_attention(q.double(), k.double(), v.double(), **args)[:, t[rank]:t[rank + 1]]
            mine = slice(t[rank], t[rank + 1])
            problem = Problem(shape, window, stride, dilation, causal)
            for strategy in ("ulysses", "halo", "auto") if index in AUTO_CASES else ("ulysses", "halo"):
                sent.clear()
                # one group of heads (the groups are checked below, with gradients)
                out = nd.gna_attention(q[:, mine], k[:, mine], v[:, mine], strategy=strategy,
                                       split=split if strategy != "auto" else None, chunks=1, **args)
                assert out.shape == expected.shape, (index, strategy, out.shape)
                if expected.numel():
                    error = ((out.double() - expected).norm() / expected.norm()).item()
                    assert error < 5e-3, f"case {index} {strategy} rank {rank}/{world}: error {error}"
                if strategy != "auto":
                    cost = strategy_cost(problem, TileConfig(1, 1), split, strategy, batch=batch, heads=heads,
                                         head_dim=HEAD_DIM, element_bytes=2)
                    assert sum(sent) == cost.ranks[rank].bytes_sent, (index, strategy, sent, cost.ranks[rank])
    # Sparse attention, head-parallel: a random block mask per head over the whole sequence, one head more than
    # the ranks divide (Ulysses pads it with zero heads, which take the last head's mask).
    split = {2: (40, 24), 3: (16, 32, 16)}[world]
    t = offsets(split)
    generator = torch.Generator().manual_seed(99)
    n = sum(split)
    q, k, v = (torch.randn(1, n, heads + 1, HEAD_DIM, generator=generator, dtype=torch.float16) for _ in range(3))
    mask = torch.rand(1, heads + 1, n // 16, n // 16, generator=generator) < 0.5
    mask[..., 0] = True
    expected = sparse_reference(q.double(), k.double(), v.double(), mask, 16, 16)[:, t[rank]:t[rank + 1]]
    mine = slice(t[rank], t[rank + 1])
    for blocks in (mask,) if world == 2 else (SparseMask.from_dense(mask, 16, 16, n),):
        out = nd.sparse_attention(q[:, mine], k[:, mine], v[:, mine], blocks, 16, 16, chunks=1)
        error = ((out.double() - expected).norm() / expected.norm()).item()
        assert error < 5e-3, f"sparse ({type(blocks).__name__}) rank {rank}/{world}: error {error}"


@contextlib.contextmanager
def _bytes_sent(rank: int):
    """Count what this rank's collectives send to other ranks (natsim.distributed.collectives' exchanges,
    wrapped while the block runs; torch.compile would refuse the wrappers' side effect): yields the list every
    exchange appends its bytes to."""
    from natsim.distributed import collectives

    sent = []
    start_exchange, send_receive = collectives.start_exchange, collectives.send_receive

    def counting_exchange(send, shapes, group, **options):
        sent.append(sum(t.numel() * t.element_size() for j, t in enumerate(send) if j != rank))
        return start_exchange(send, shapes, group, **options)

    def counting_send_receive(sends, receives, group):
        sent.append(sum(t.numel() * t.element_size() for t, _ in sends))
        return send_receive(sends, receives, group)

    collectives.start_exchange, collectives.send_receive = counting_exchange, counting_send_receive
    try:
        yield sent
    finally:
        collectives.start_exchange, collectives.send_receive = start_exchange, send_receive


def _run_world(processes: int, worker, *args, preload: tuple[str, ...] = ()) -> None:
    """Start `worker(rank, processes, *args)` in `processes` fresh processes; fail past the deadline.

    Without `preload` they are spawned. With it they fork from multiprocessing's forkserver, a fresh process that
    imports the `preload` modules once (the tests' folder on its path) and runs nothing else: each spawned process
    imported torch, natsim, diffusers and the tests' modules again (about 6 s of CPU time each on 2 cores), a fork
    starts with what they would have imported. The server starts with this process's environment at its first
    use. Worlds on GPUs spawn."""
    if preload:
        forkserver.set_forkserver_preload(list(preload))
        path = os.pathsep.join(filter(None, (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH"))))
        with mock.patch.dict(os.environ, PYTHONPATH=path):
            context = mp.start_processes(worker, args=(processes, *args), nprocs=processes, join=False,
                                         start_method="forkserver")
    else:
        context = mp.spawn(worker, args=(processes, *args), nprocs=processes, join=False)
    deadline = time.monotonic() + WORLD_DEADLINE_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"a spawn of {processes} processes did not finish within {WORLD_DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()




# -- gradients in process groups ---------------------------------------------------------------------------

# (problem, split per world size, batch), beside the drawn cases: windows wider than a slab with stride, dilation
# and causal along the sharded frames, an even window, a rank with one frame and one with none.
GRADIENT_CASES = [
    (Problem((9, 4, 4), (7, 3, 3), (3, 1, 1)), {2: (6, 3), 3: (1, 6, 2)}, 1),
    (Problem((9, 4, 4), (4, 3, 3), (1, 1, 2)), {2: (3, 6), 3: (4, 0, 5)}, 1),  # trains on gathered frames
    (Problem((10, 4, 4), (4, 4, 3), (3, 2, 1), (2, 1, 1), (True, False, False)), {2: (5, 5), 3: (2, 5, 3)}, 2),
    (Problem((11, 16), (6, 5), (2, 1), 1, (True, False)), {2: (4, 7), 3: (6, 0, 5)}, 1),
]
GRADIENT_HEAD_DIM = 16
GRADIENT_WORLD = settings(max_examples=1, deadline=None, phases=(Phase.explicit, Phase.generate))


def _frames_split(draw, frames: int, world: int) -> tuple[int, ...]:
    """Frames per rank: `world` non-negative counts adding up to `frames` (uneven, now and then zero)."""
    cuts = sorted(draw(st.lists(st.integers(0, frames), min_size=world - 1, max_size=world - 1)))
    return tuple(b - a for a, b in zip((0, *cuts), (*cuts, frames)))


@st.composite
def sharded_problems(draw, world: int):
    """A GNA problem of at most 96 tokens with at least `world` frames, its frames split over the ranks, a
    batch."""
    problem = draw(problems(max_tokens=96).filter(lambda p: p.shape[0] >= world))
    return problem, {world: _frames_split(draw, problem.shape[0], world)}, draw(st.sampled_from([1, 2]))


@st.composite
def sharded_masks(draw, world: int):
    """A sequence split over the ranks with a random block mask: `(tokens, split, q_block, kv_block, one mask
    per head, density, as a SparseMask, seed)`."""
    tokens = draw(st.integers(world, 80))
    return (tokens, _frames_split(draw, tokens, world), draw(st.sampled_from([8, 16])),
            draw(st.sampled_from([8, 16])), draw(st.booleans()), draw(st.sampled_from([0.3, 0.6, 1.0])),
            draw(st.booleans()), draw(st.integers(0, 2**16)))


def _gradients(fn, inputs, grad):
    """dq, dk, dv of `fn(q, k, v)` against the output gradient `grad`, at fresh leaves of `inputs`."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, grad)


def _assert_gradients(got, want, tolerance: float, what: str) -> None:
    for name, a, b in zip("qkvqkv", got, want):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=lambda m: f"d{name} of {what}: {m}")


def _local_gradients(rank: int, sent: list[int], call, inputs, grad, split, byte_model):
    """Gradients of `call` on this rank's part of `inputs`; with `byte_model` (float64 runs) the bytes `sent`
    forward and backward are checked against it."""
    mine = slice(*offsets(split)[rank:rank + 2])
    sent.clear()
    leaves = [x[:, mine].detach().requires_grad_() for x in inputs]
    out = call(*leaves)
    forward = sum(sent)
    sent.clear()
    grads = torch.autograd.grad(out, leaves, grad[:, mine])
    if byte_model is not None:
        cost = byte_model.ranks[rank]
        assert (forward, sum(sent)) == (cost.bytes_sent, cost.backward_bytes_sent), (forward, sum(sent), cost)
    return grads


def _single_process(rank: int, split, reference, single, inputs) -> list:
    """The single-process gradients on this rank's frames of the whole `inputs` (q, k, v and the output's
    gradient, float64): `(tensors, gradients, tolerance)` of the float64 `reference` and of `single` in float32."""
    mine = slice(*offsets(split)[rank:rank + 2])
    runs = []
    for fn, tensors, tolerance in ((reference, inputs, 1e-10), (single, [x.float() for x in inputs], 1e-5)):
        runs.append((tensors, [g[:, mine] for g in _gradients(fn, tensors[:3], tensors[3])], tolerance))
    return runs


def _check_against(rank: int, sent: list[int], call, expected: list, split, byte_model, what: str) -> None:
    """`call`'s gradients on this rank equal the `expected` single-process ones, in both precisions; the bytes
    of the float64 run equal `byte_model`'s."""
    for (tensors, want, tolerance), model in zip(expected, (byte_model, None)):
        got = _local_gradients(rank, sent, call, tensors[:3], tensors[3], split, model)
        _assert_gradients(got, want, tolerance, f"{what}, {tensors[0].dtype}")


def _check_gna_gradients(rank: int, world: int, sent: list[int], index: int, case) -> None:
    """One GNA case under each strategy ("auto" too for the first case), and the halo strategy on gathered frames
    where it trains that way."""
    import natsim.distributed as nd
    from natsim.distributed.strategies import halo, trains_on_gathered_frames

    problem, splits, batch = case
    split, heads = splits[world], HEADS_PER_RANK * world
    args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal)
    generator = torch.Generator().manual_seed(index)
    inputs = [torch.randn(batch, *problem.shape, heads, GRADIENT_HEAD_DIM, generator=generator, dtype=torch.float64)
              for _ in range(4)]
    expected = _single_process(rank, split, lambda *x: reference_attention(*x, **args),
                               lambda *x: gna_attention(*x, **args), inputs)
    for strategy in ("ulysses", "halo", "auto") if index == 0 else ("ulysses", "halo"):
        model = None if strategy == "auto" else strategy_cost(
            problem, TileConfig(1, 1), split, strategy, batch=batch, heads=heads, head_dim=GRADIENT_HEAD_DIM,
            element_bytes=8, training=True)
        _check_against(rank, sent, functools.partial(nd.gna_attention, strategy=strategy, split=split, **args),
                       expected, split, model,
                       f"GNA case {index} ({problem}, split {split}, batch {batch}), {strategy}, rank {rank}")
    if trains_on_gathered_frames(problem):  # the halo strategy as it trains on the GPU kernels
        kernel = functools.partial(gna_attention, **args)
        model = strategy_cost(problem, TileConfig(1, 1), split, "halo", batch=batch, heads=heads,
                              head_dim=GRADIENT_HEAD_DIM, element_bytes=8, training=True)
        _check_against(rank, sent, lambda *x: halo(kernel, problem, *x, split, rank, None, on_gathered_frames=True),
                       expected, split, model,
                       f"GNA case {index} ({problem}, split {split}, batch {batch}), halo on gathered frames, "
                       f"rank {rank}")


def _check_mask_gradients(rank: int, world: int, sent: list[int], index: int, case,
                          heads: Optional[int] = None) -> None:
    """One block mask case (Ulysses), over `heads` heads (default two a rank; others are padded)."""
    import natsim.distributed as nd
    from natsim.kernels import SparseMask, sparse_attention, sparse_reference

    tokens, split, q_block, kv_block, per_head, density, as_csr, seed = case
    heads = heads or HEADS_PER_RANK * world
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, tokens, heads, GRADIENT_HEAD_DIM, generator=generator, dtype=torch.float64)
              for _ in range(4)]
    dense = torch.rand(1, heads if per_head else 1, -(-tokens // q_block), -(-tokens // kv_block),
                       generator=generator) < density
    mask = SparseMask.from_dense(dense, q_block, kv_block, tokens) if as_csr else dense
    expected = _single_process(rank, split, lambda *x: sparse_reference(*x, dense, q_block, kv_block),
                               lambda *x: sparse_attention(*x, mask, q_block, kv_block), inputs)
    model = strategy_cost(Problem((tokens,), 1), TileConfig(1, 1), split, "ulysses", batch=1, heads=heads,
                          head_dim=GRADIENT_HEAD_DIM, element_bytes=8, training=True)
    _check_against(rank, sent, functools.partial(nd.sparse_attention, mask=mask, q_block=q_block, kv_block=kv_block,
                                                 split=split),
                   expected, split, model, f"mask case {index} ({tokens} tokens, split {split}, blocks "
                                           f"{q_block}x{kv_block}, {type(mask).__name__}), rank {rank}")


def _check_ulysses_in_groups(rank: int, world: int, sent: list[int], case: int, heads: int, chunks: Optional[int],
                             seed: int, what: str) -> None:
    """Ulysses on GRADIENT_CASES[case] with `heads` heads in groups (`chunks`; None: the default ones): outputs and
    gradients against the float64 reference on one process's tensors, the bytes forward and backward against
    natsim.partition. Five heads a rank (5 P) in the default groups: 2, 2 and 1 heads, moving what one piece
    moves. 2 P + 1 heads in two groups: padded with zero heads to 3 P, the last rank's second group all zeros,
    the zero heads' bytes counted too."""
    import natsim.distributed as nd

    problem, splits, _ = GRADIENT_CASES[case]
    split = splits[world]
    args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal)
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, *problem.shape, heads, GRADIENT_HEAD_DIM, generator=generator, dtype=torch.float64)
              for _ in range(4)]
    expected = _single_process(rank, split, lambda *x: reference_attention(*x, **args),
                               lambda *x: gna_attention(*x, **args), inputs)
    model = strategy_cost(problem, TileConfig(1, 1), split, "ulysses", batch=1, heads=heads,
                          head_dim=GRADIENT_HEAD_DIM, element_bytes=8, training=True)
    _check_against(rank, sent, functools.partial(nd.gna_attention, strategy="ulysses", split=split, chunks=chunks,
                                                 **args), expected, split, model, f"{what}, rank {rank}/{world}")


def _check_gradients(rank: int, world: int, gna_cases, mask_cases) -> None:
    """dq, dk, dv of every GNA case under each strategy and of every block mask (Ulysses) against the
    single-process gradients on the whole tensors: float64 against the torch reference, float32 against
    natsim.kernels' entry points; the bytes each collective sends, forward and backward, against
    natsim.partition; in the world of 2, under torch.compile(fullgraph=True) too."""
    with _bytes_sent(rank) as sent:
        for index, case in enumerate(gna_cases):
            _check_gna_gradients(rank, world, sent, index, case)
        for index, case in enumerate(mask_cases):
            _check_mask_gradients(rank, world, sent, index, case)
        _check_ulysses_in_groups(rank, world, sent, 0, 5 * world, None, 11,
                                 "Ulysses in its default groups of 3 and 2 heads")
        if world == 3:  # 7 heads, 3 a rank: the last rank's second group is all zero heads
            _check_ulysses_in_groups(rank, world, sent, 1, 7, 2, 13, "Ulysses over 7 heads padded to 9")
            per_head = (*mask_cases[0][:4], True, *mask_cases[0][5:])  # a mask per head, the pads' the last one's
            _check_mask_gradients(rank, world, sent, len(mask_cases), per_head, heads=7)
    if world == 2:
        _check_compiled(rank, gna_cases[0], mask_cases[0])


def _check_training_example() -> None:
    """examples/distributed_training.py's loop, two steps, in this world (its `main` adds only the process group
    torchrun sets up): its first step's gradients equal one process's."""
    spec = importlib.util.spec_from_file_location("distributed_training", EXAMPLES / "distributed_training.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with contextlib.redirect_stdout(io.StringIO()):
        error = example.train(example.arguments(["--device", "cpu", "--steps", "2"]))
    assert error < 1e-5, error


# What the gloo world's processes import, once, in the forkserver they fork from (`_run_world`).
GLOO_PRELOAD = ("torch", "natsim.kernels", "natsim.distributed", "test_distributed", "test_diffusers_parallel")


def _worker(rank: int, processes: int, ports: tuple[int, int, int], cases: dict) -> None:
    """One process of the spawn of three: rank `rank` of a gloo world of 3, then (processes 0 and 1) of a world
    of 2, then of examples/distributed.py's world of 2; `cases[world]`: that world's GNA and block mask cases
    for the gradients. A world torn down and another set up in the same processes is a world as a fresh spawn
    is: natsim.distributed keeps nothing per process group (its caches are keyed by split and rank)."""
    # One thread per rank: the ranks share the machine's cores, and torch's pools at full size each made every
    # small operator wait on the others' threads (the gradient checks ran 9x slower on 2 cores).
    torch.set_num_threads(1)
    for world, port in zip((3, 2), ports):
        if rank < world:
            _check_world(rank, world, port, *cases[world])
    if rank < 2:
        _run_distributed_example(rank, ports[2])
        if importlib.util.find_spec("diffusers") is not None:
            from test_diffusers_parallel import run_world as diffusers_world

            diffusers_world(rank, 2, ports[3])


def _check_world(rank: int, world: int, port: int, gna_cases, mask_cases) -> None:
    """One rank of a gloo world: outputs, then gradients, on the torch reference path (float64 there, and
    differentiable on frame ranges): what a world checks is natsim.distributed's splits, exchanges and merges; the
    kernels on frame ranges are checked in the interpreter in one process (test_kernel_on_frames_matches_the_
    reference) and on GPUs."""
    os.environ["TRITON_INTERPRET"] = "0"  # read per call (kernels/common/backend.py)
    warnings.simplefilter("ignore")  # the reference path's one-time CPU warnings
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        _check_outputs(rank, world)
        _check_gradients(rank, world, gna_cases, mask_cases)
        _check_training_example()
        # Every rank's last messages are through before any rank tears gloo down: a rank that destroyed its group
        # while a peer still sent to it aborted now and then ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_compiled(rank: int, gna_case, mask_case) -> None:
    """torch.compile(fullgraph=True) of one loss through natsim.distributed's GNA under each strategy ("auto"
    decides while tracing; heads the ranks do not divide, which Ulysses pads) and its block-mask attention, one
    after the other: one graph, and the eager gradients through it. The "eager" backend runs what Dynamo captures
    as it is: AOTAutograd took 11 s more here, mostly tracing the CPU path's backward (the torch reference);
    test_collective_operators holds the operators' fake implementations and backward formulas against AOTAutograd
    instead."""
    import natsim.distributed as nd

    world, heads = 2, 2 * HEADS_PER_RANK
    problem, splits, batch = gna_case
    gna = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation, causal=problem.causal,
               split=splits[world])
    tokens, split, q_block, kv_block, *_ = mask_case
    generator = torch.Generator().manual_seed(7)
    mask = torch.rand(1, heads, -(-tokens // q_block), -(-tokens // kv_block), generator=generator) < 0.5
    masked = dict(mask=mask, q_block=q_block, kv_block=kv_block, split=split)
    inputs, grads = [], []
    # GNA over one head more than the ranks divide: Ulysses pads it with a zero head inside the graph
    for shape, frames, count in (((batch, *problem.shape), splits[world], heads + 1), ((1, tokens), split, heads)):
        mine = slice(*offsets(frames)[rank:rank + 2])
        inputs += [torch.randn(*shape, count, GRADIENT_HEAD_DIM, generator=generator)[:, mine] for _ in range(3)]
        grads.append(torch.randn(*shape, count, GRADIENT_HEAD_DIM, generator=generator)[:, mine])

    def loss(*x):  # each call's q, k and v depend on the call before, as a model's layers do (ops.py says why)
        q, k, v = x[:3]
        total = 0
        for strategy in ("ulysses", "halo", "auto"):
            out = nd.gna_attention(q, k, v, strategy=strategy, **gna)
            total = total + (out * grads[0]).sum()
            q, k, v = q + out, k + out, v + out
        masked_out = nd.sparse_attention(*(y + out.mean() for y in x[3:]), **masked)
        return total + (masked_out * grads[1]).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    _assert_gradients(_gradients(compiled, inputs, None), _gradients(loss, inputs, None), 1e-6,
                      f"compiled GNA and block mask, rank {rank}")


def _run_distributed_example(rank: int, port: int) -> None:
    """examples/distributed.py as `torchrun --nproc-per-node 2` runs it (the README's command): the script as
    `__main__`, its process group set up from the variables torchrun sets (env://), on the reference path; the
    error it prints under 1e-5."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRITON_INTERPRET="0")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(EXAMPLES / "distributed.py"), run_name="__main__")
    lines = [line for line in printed.getvalue().splitlines() if line.startswith(f"rank {rank}/2")]
    assert len(lines) == 1 and float(lines[0].rsplit(" ", 1)[1]) < 1e-5, printed.getvalue()


@GRADIENT_WORLD
@given(data=st.data())
def test_gloo_worlds(data):
    """natsim.distributed in gloo worlds of 3 and of 2 processes: outputs, then gradients of the fixed cases and a
    few drawn ones; then examples/distributed.py under torchrun's environment; then, in a world of 2, natsim inside
    diffusers' context parallelism (tests/test_diffusers_parallel.py's `run_world`). One start of three processes
    for all: the two worlds and torchrun apart (eight processes, each importing torch) took 85 s of CPU time here,
    one spawn of three 56 s, and the three forked from a server that imported everything once 45 s. GPUs are
    hidden from it, as on the README's CPU run."""
    cases = {}
    for world in (3, 2):
        gna = [case for case in GRADIENT_CASES if world in case[1]]
        gna += data.draw(st.lists(sharded_problems(world), min_size=1, max_size=1), label=f"GNA cases, {world}")
        masks = data.draw(st.lists(sharded_masks(world), min_size=1, max_size=1), label=f"mask cases, {world}")
        cases[world] = gna, masks
    with mock.patch.dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1"):
        _run_world(3, _worker, tuple(_free_port() for _ in range(4)), cases, preload=GLOO_PRELOAD)


# -- gradients on GPUs (NCCL) --------------------------------------------------------------------------------

# (problem, split): uneven splits, a window wider than a slab, stride, dilation and causal along the frames.
NCCL_CASES = [
    (Problem((16, 16, 16), (7, 7, 7), (2, 2, 2)), (9, 7)),
    (Problem((18, 12, 20), (6, 5, 8), (3, 1, 4), (2, 1, 1), (True, False, False)), (10, 8)),
    (Problem((16, 16, 16), (7, 7, 7), (1, 2, 2)), (9, 7)),  # the halo strategy trains on its gathered frames
]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _nccl_worker(rank: int, world: int, port: int) -> None:
    """One GPU of a world of 2: bf16 gradients of GNA ("ulysses" and "auto", and "halo" where it trains on its
    gathered frames) and of a block mask through natsim.distributed against natsim.kernels on the whole tensors
    (this GPU) and the float64 reference; the halo strategy's refusal elsewhere; the same calls one after the
    other under torch.compile(fullgraph=True)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast on shared machines
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=device)
    import natsim.distributed as nd
    from natsim.distributed.strategies import trains_on_gathered_frames
    from natsim.kernels import sparse_attention, sparse_reference

    heads = 2 * world
    try:
        for index, (problem, split) in enumerate(NCCL_CASES):
            mine = slice(*offsets(split)[rank:rank + 2])
            args = dict(window=problem.window, stride=problem.stride, dilation=problem.dilation,
                        causal=problem.causal)
            generator = torch.Generator(device).manual_seed(index)
            q, k, v, grad = (torch.randn(1, *problem.shape, heads, 64, device=device, dtype=torch.bfloat16,
                                         generator=generator) for _ in range(4))
            single = _gradients(lambda *x: gna_attention(*x, **args), (q, k, v), grad)
            exact = _gradients(lambda *x: reference_attention(*x, **args), (q.double(), k.double(), v.double()),
                               grad.double())
            gathered = trains_on_gathered_frames(problem)
            for strategy in ("ulysses", "auto", "halo") if gathered else ("ulysses", "auto"):
                call = functools.partial(nd.gna_attention, strategy=strategy, split=split, **args)
                got = _gradients(call, [x[:, mine] for x in (q, k, v)], grad[:, mine])
                for name, a, b, c in zip("qkv", got, single, exact):
                    errors = (_relative(a, b[:, mine]), _relative(a, c[:, mine]))
                    assert max(errors) < 2e-2, f"d{name}, case {index}, {strategy}, rank {rank}: {errors}"
            if not gathered:
                local = [x[:, mine].detach().requires_grad_() for x in (q, k, v)]
                try:
                    nd.gna_attention(*local, strategy="halo", split=split, **args)
                    raise AssertionError("the halo strategy trained on the GPU")
                except RuntimeError as error:
                    assert "gathered frames can run as a layout" in str(error), error
        tokens, token_split = 4096, (2176, 1920)
        mine = slice(*offsets(token_split)[rank:rank + 2])
        generator = torch.Generator(device).manual_seed(99)
        q, k, v, grad = (torch.randn(1, tokens, heads, 64, device=device, dtype=torch.bfloat16,
                                     generator=generator) for _ in range(4))
        mask = torch.rand(1, heads, tokens // 64, tokens // 64, device=device, generator=generator) < 0.5
        single = _gradients(lambda *x: sparse_attention(*x, mask, 64, 64), (q, k, v), grad)
        exact = _gradients(lambda *x: sparse_reference(*x, mask, 64, 64), (q.double(), k.double(), v.double()),
                           grad.double())
        call = functools.partial(nd.sparse_attention, mask=mask, q_block=64, kv_block=64, split=token_split)
        got = _gradients(call, [x[:, mine] for x in (q, k, v)], grad[:, mine])
        for name, a, b, c in zip("qkv", got, single, exact):
            errors = (_relative(a, b[:, mine]), _relative(a, c[:, mine]))
            assert max(errors) < 2e-2, f"d{name}, block mask, rank {rank}: {errors}"

        inputs = [x[:, mine] for x in (q, k, v)]
        problem, split = NCCL_CASES[0]
        mine = slice(*offsets(split)[rank:rank + 2])
        gna = dict(window=problem.window, stride=problem.stride, split=split)
        inputs = [torch.randn(1, *problem.shape, heads, 64, device=device, dtype=torch.bfloat16,
                              generator=generator)[:, mine] for _ in range(3)] + inputs

        def loss(*x):  # each call's inputs depend on the call before, as a model's layers do
            out = nd.gna_attention(*x[:3], strategy="ulysses", **gna)
            out = nd.gna_attention(*(y + out for y in x[:3]), **gna)
            masked = nd.sparse_attention(*(y + out.float().mean().to(y.dtype) for y in x[3:]), mask, 64, 64,
                                         split=token_split)
            return out.float().square().mean() + masked.float().square().mean()

        eager = _gradients(loss, inputs, None)
        compiled = _gradients(torch.compile(loss, fullgraph=True), inputs, None)
        for a, b in zip(compiled, eager):
            assert _relative(a, b) < 2e-2, f"compiled, rank {rank}: {_relative(a, b)}"
        from natsim.distributed.collectives import transfer_group

        twin = transfer_group(None)  # the group the moves above ran on
        assert twin is not dist.group.WORLD and dist.get_process_group_ranks(twin) == list(range(world))
        assert twin._get_backend(device).options.is_high_priority_stream
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_world_gradients():
    """natsim.distributed's gradients on two GPUs of one host (NCCL), eager and compiled (Inductor)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _run_world(2, _nccl_worker, _free_port())


# -- planner and CLI ---------------------------------------------------------------------------------------


def test_best_with_world_size_knows_its_strategy():
    from natsim.planner import best

    # several ranks run natsim's Triton kernels, so the single-GPU plan to compare with is the Triton one
    single = best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), device="h100", backends="triton")
    parallel = best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), device="h100", world_size=2)
    assert parallel.plan == single and parallel.problem == single.problem  # attributes fall through to the plan
    assert parallel.strategy in ("ulysses", "halo") and sum(parallel.split) == 30
    chosen = parallel.costs[parallel.strategy]
    assert all(chosen.seconds <= other.seconds for other in parallel.costs.values())
    # compute priced from the plan's own prediction: ulysses halves the heads, so half the single-GPU time, its
    # 12 heads a rank attended in the default groups between the moves (q, k and v in, the output back)
    ulysses, (first, _) = parallel.costs["ulysses"], parallel.split
    frame = 48 * 80 * 24 * 128 * 2 // 2  # a frame of a rank's half of the heads
    inbound, outbound = 3 * max(first, 30 - first) * frame, max(first, 30 - first) * frame
    assert ulysses.ranks[0].seconds == pytest.approx(
        pipeline_seconds(single.score / 2, parallel.link.all_to_all, inbound, outbound, head_groups(12)), rel=1e-9)
    record = parallel.to_dict()
    assert record["strategy"] == parallel.strategy and len(record["strategies"][parallel.strategy]["ranks"]) == 2
    # it round-trips as a parallel plan, and reading it as a single-GPU plan (which would drop the ranks) refuses
    from natsim.planner.plans import ParallelPlan, Plan

    again = ParallelPlan.from_json(parallel.to_json())
    assert again == parallel and again.to_dict() == record
    with pytest.raises(ValueError, match="read it with ParallelPlan.from_dict or ParallelPlan.from_json"):
        Plan.from_json(parallel.to_json())
    with pytest.raises(ValueError, match="must have the keys 'world_size'"):
        ParallelPlan.from_json(single.to_json())
    with pytest.raises(ValueError, match="cannot exceed the 30 frames"):
        best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), world_size=31)
    # 5 heads do not divide over 2 ranks: ulysses pads them to 6, priced with 3 a rank, and says so
    five = best((30, 48, 80), 0.9, heads=5, window=(18, 24, 24), world_size=2)
    assert five.costs["ulysses"].ranks[0].heads == 3 and "ulysses pads heads=5 with 1 zero head" in five.notes[0]
    assert sum(note.startswith("ulysses pads") for note in five.notes) == 1  # said once, whatever was priced


def test_best_with_world_size_prices_the_training_step():
    """Training over ranks: ulysses' price is its forward and its backward pipelines, each from the plan's own
    forward and backward predictions (the backward's moves mirrored); the halo strategy trains a configuration with
    stride 1 along the frames, priced on each rank's gathered layout; with a causal window along the frames it
    cannot, which a note says."""
    from natsim.planner import best

    options = dict(heads=24, window=(18, 24, 24), device="h100", training=True)
    single = best((30, 48, 80), 0.9, backends="triton", **options)
    parallel = best((30, 48, 80), 0.9, world_size=2, **options)
    assert single.training and parallel.plan == single and single.problem.stride[0] > 1
    ulysses, (first, _) = parallel.costs["ulysses"], parallel.split
    frame = 48 * 80 * 24 * 128 * 2 // 2  # a frame of a rank's half of the heads
    inbound, outbound = 3 * max(first, 30 - first) * frame, max(first, 30 - first) * frame
    link = parallel.link.all_to_all
    forward = pipeline_seconds(single.forward_score / 2, link, inbound, outbound, head_groups(12))
    backward = pipeline_seconds(single.backward_score / 2, link, outbound, inbound, head_groups(12))
    assert ulysses.ranks[0].seconds == pytest.approx(forward + backward, rel=1e-9)
    # the pick's stride along the frames keeps the halo strategy from training it: stride 1 there was priced too
    assert parallel.notes[-1].startswith("The single-GPU pick has stride 2 along the frames")
    assert "forward + backward" in " ".join(str(part) for part in parallel.explain().renderables[1:2])

    # the halo strategy trains a configuration with stride 1 along the frames, priced on each rank's gathered layout
    halo = best((30, 48, 80), 0.9, world_size=2, kv_tiling="static", max_stride=(1, 24, 24), **options)
    assert halo.problem.stride[0] == 1 and "halo" in halo.costs
    for rank, start in zip(halo.costs["halo"].ranks, (0, halo.split[0])):
        lo, hi = key_frames(halo.problem, start, start + halo.split[rank.rank])
        gathered = Problem((hi - lo, 48, 80), halo.problem.window, halo.problem.stride)
        assert rank.visited_tiles == simulate(gathered, halo.tiles).visited_tiles * 24
    inference = best((30, 48, 80), 0.9, world_size=2, kv_tiling="static", max_stride=(1, 24, 24),
                     **{**options, "training": False})
    assert halo.costs["halo"].seconds > inference.costs["halo"].seconds  # the backward's work and moves on top
    # a causal window along the frames: the halo strategy cannot train it, and says why
    causal = best((30, 48, 80), 0.9, world_size=2, causal=(True, False, False), **options)
    assert causal.strategy == "ulysses" and any(note.startswith("halo cannot train") for note in causal.notes)


def test_cli_plan_world_size():
    from typer.testing import CliRunner

    from natsim.cli.main import app

    result = CliRunner().invoke(app, ["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--heads", "24",
                                      "--window", "18x24x24", "--world-size", "2"])
    assert result.exit_code == 0, result.output
    assert "key frames" in result.output and "halo" in result.output and "ulysses" in result.output
    assert "ulysses attends each rank's 12 heads in groups of 4/4/4 heads" in " ".join(result.output.split())
    one = CliRunner().invoke(app, ["plan", "--shape", "21x45x80", "--sparsity", "0.9", "--heads", "12",
                                   "--world-size", "4"])
    assert one.exit_code == 0, one.output
    assert "ulysses attends each rank's 3 heads in one group" in " ".join(one.output.split()), one.output
    bad = CliRunner().invoke(app, ["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--world-size", "0"])
    assert bad.exit_code == 2 and "world_size must be a positive int" in bad.output


def test_sharded_calls_under_autocast_are_one_processs_call(one_rank_group, reference_path):
    """Under autocast a sharded call (GNA by Ulysses and by the halo exchange, a block mask by Ulysses) computes
    what natsim.kernels' call does there: the inputs in autocast's dtype, the output in it too."""
    from natsim.distributed import gna_attention as sharded

    from natsim.distributed import sparse_attention as sharded_sparse
    from natsim.kernels import sparse_attention

    q, k, v = (torch.randn(1, 6, 8, 4, 32) for _ in range(3))
    mask = torch.rand(1, 4, 3, 3, generator=torch.Generator().manual_seed(0)) < 0.6
    mask |= torch.eye(3, dtype=torch.bool)
    tokens = [t.flatten(1, 2) for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = gna_attention(q, k, v, (3, 5))
        calls = [sharded(q, k, v, (3, 5), strategy=strategy, split=(6,), chunks=2) for strategy in ("ulysses", "halo")]
        want_masked = sparse_attention(*tokens, mask, 16, 16)
        masked = sharded_sparse(*tokens, mask, 16, 16, split=(48,), chunks=2)
    assert want.dtype == want_masked.dtype == torch.bfloat16
    for got in calls:
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert masked.dtype == want_masked.dtype and torch.equal(masked, want_masked)
