"""Context parallelism: natsim.partition against brute force, the GNA kernel on frame ranges against the
float64 reference and its debug counters against the simulator, and natsim.distributed in gloo process groups
of 2 and 3 processes against single-process reference_attention / sparse_reference.

Spawned processes cost seconds each (importing torch), so each world runs many cases in one spawn, with a
deadline that fails the test instead of hanging.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from natsim import Problem, TileConfig
from natsim.partition import (check_split, even_split, key_frames, offsets, rank_tiles, strategy_cost)
from natsim.kernels import gna_attention, gna_tile_counts, reference_attention

from bruteforce import attention_mask, coordinates, dim_mask, multi_d_layout, problems, static_counts
from interpreter_options import skip_discarded_overflow_checks

FAST = settings(max_examples=25, deadline=None)
KERNEL = settings(max_examples=6, deadline=None)
WORLD_DEADLINE_S = 240


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
    with pytest.raises(ValueError, match="heads must be divisible"):
        strategy_cost(problem, tiles, (10, 10, 10), "ulysses", batch=1, heads=16, head_dim=128, element_bytes=2)
    with pytest.raises(ValueError, match="add up to the 30 frames"):
        check_split((10, 10), 30)
    assert even_split(10, 3) == (4, 3, 3) and offsets((4, 3, 3)) == (0, 4, 7, 10)


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
@given(kernel_cases())
def test_kernel_on_frames_matches_the_reference(case):
    problem, (q0, q1, k0, k1), q_tile, kv_tile = case
    # One head: the interpreter's time grows with heads, and the gloo worlds below run frame ranges (halo) with
    # several.
    q, k, v = (torch.randn(1, *problem.shape, 1, 32, dtype=torch.float16) for _ in range(3))
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

    compiled = torch.compile(model, fullgraph=True)
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


def test_distributed_entry_points_refuse_gradients():
    import natsim.distributed as nd

    q = torch.randn(1, 4, 6, 2, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="collectives, which autograd does not track"):
        nd.gna_attention(q, q.detach(), q.detach(), 3)
    t = torch.randn(1, 64, 2, 32)
    with pytest.raises(RuntimeError, match="collectives, which autograd does not track"):
        nd.sparse_attention(t, t.requires_grad_(), t, torch.ones(1, 1, 4, 4, dtype=torch.bool), 16, 16)


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


def _worker(rank: int, world: int, port: int) -> None:
    """One rank: every case, every strategy, against the single-process reference (fresh inputs, one seed
    for all ranks); bytes moved against natsim.partition; sparse attention under a per-head mask."""
    os.environ["TRITON_INTERPRET"] = "1"
    skip_discarded_overflow_checks()  # as tests/conftest.py does in pytest's processes
    heads = HEADS_PER_RANK * world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    import natsim.distributed as nd
    from natsim.distributed import strategies
    from natsim.kernels import SparseMask, sparse_reference

    sent = []
    exchange, send_receive = strategies.exchange, strategies.send_receive

    def counting_exchange(send, shapes, group, **options):
        sent.append(sum(t.numel() * t.element_size() for j, t in enumerate(send) if j != rank))
        return exchange(send, shapes, group, **options)

    def counting_send_receive(sends, receives, group):
        sent.append(sum(t.numel() * t.element_size() for t, _ in sends))
        return send_receive(sends, receives, group)

    strategies.exchange, strategies.send_receive = counting_exchange, counting_send_receive
    try:
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
                out = nd.gna_attention(q[:, mine], k[:, mine], v[:, mine], strategy=strategy,
                                       split=split if strategy != "auto" else None, **args)
                assert out.shape == expected.shape, (index, strategy, out.shape)
                if expected.numel():
                    error = ((out.double() - expected).norm() / expected.norm()).item()
                    assert error < 5e-3, f"case {index} {strategy} rank {rank}/{world}: error {error}"
                if strategy != "auto":
                    cost = strategy_cost(problem, TileConfig(1, 1), split, strategy, batch=batch, heads=heads,
                                         head_dim=HEAD_DIM, element_bytes=2)
                    assert sum(sent) == cost.ranks[rank].bytes_sent, (index, strategy, sent, cost.ranks[rank])
        # Ulysses needs heads divisible by the world size.
        q = torch.randn(1, 3, 4, 4, 5, 32, dtype=torch.float16)
        try:
            nd.gna_attention(q, q, q, 3, strategy="ulysses", split=(3,) * world)
            raise AssertionError("heads=5 was not refused")
        except ValueError as error:
            assert "divisible by the world size" in str(error)
        # Sparse attention, head-parallel: a random block mask per head over the whole sequence.
        split = {2: (40, 24), 3: (16, 32, 16)}[world]
        t = offsets(split)
        generator = torch.Generator().manual_seed(99)
        n = sum(split)
        q, k, v = (torch.randn(1, n, heads, HEAD_DIM, generator=generator, dtype=torch.float16) for _ in range(3))
        mask = torch.rand(1, heads, n // 16, n // 16, generator=generator) < 0.5
        mask[..., 0] = True
        expected = sparse_reference(q.double(), k.double(), v.double(), mask, 16, 16)[:, t[rank]:t[rank + 1]]
        mine = slice(t[rank], t[rank + 1])
        for given in (mask,) if world == 2 else (SparseMask.from_dense(mask, 16, 16, n),):
            out = nd.sparse_attention(q[:, mine], k[:, mine], v[:, mine], given, 16, 16)
            error = ((out.double() - expected).norm() / expected.norm()).item()
            assert error < 5e-3, f"sparse ({type(given).__name__}) rank {rank}/{world}: error {error}"
        # Every rank's last messages are through before any rank tears gloo down: a rank that destroyed its group
        # while a peer still sent to it aborted now and then ("terminate called without an active exception").
        dist.barrier()
    finally:
        strategies.exchange, strategies.send_receive = exchange, send_receive
        dist.destroy_process_group()


def _run_world(world: int) -> None:
    context = mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=False)
    deadline = time.monotonic() + WORLD_DEADLINE_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"a gloo world of {world} processes did not finish within {WORLD_DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_world(world):
    _run_world(world)


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
    # compute priced from the plan's own prediction: ulysses halves the heads, so half the single-GPU time
    ulysses = parallel.costs["ulysses"]
    assert ulysses.ranks[0].seconds - ulysses.ranks[0].bytes_sent / parallel.bytes_per_second == pytest.approx(
        single.score / 2, rel=1e-9)
    record = parallel.to_dict()
    assert record["strategy"] == parallel.strategy and len(record["strategies"][parallel.strategy]["ranks"]) == 2
    with pytest.raises(ValueError, match="cannot exceed the 30 frames"):
        best((30, 48, 80), 0.9, heads=24, window=(18, 24, 24), world_size=31)
    # 5 heads do not divide over 2 ranks: halo is the only strategy
    assert best((30, 48, 80), 0.9, heads=5, window=(18, 24, 24), world_size=2).strategy == "halo"


def test_cli_plan_world_size():
    from typer.testing import CliRunner

    from natsim.cli.main import app

    result = CliRunner().invoke(app, ["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--heads", "24",
                                      "--window", "18x24x24", "--world-size", "2"])
    assert result.exit_code == 0, result.output
    assert "key frames" in result.output and "halo" in result.output and "ulysses" in result.output
    bad = CliRunner().invoke(app, ["plan", "--shape", "30x48x80", "--sparsity", "0.9", "--world-size", "0"])
    assert bad.exit_code == 2 and "world_size must be a positive int" in bad.output


def test_example_runs_under_torchrun(tmp_path):
    """examples/distributed.py as the README runs it: two gloo processes under torchrun (the reference path)."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "distributed.py"
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(_free_port()), str(example)], capture_output=True, text=True,
                            timeout=WORLD_DEADLINE_S, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2
    assert all(float(line.rsplit(" ", 1)[1]) < 1e-5 for line in lines), lines
