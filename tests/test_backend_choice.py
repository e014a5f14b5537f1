"""Which backend natsim picks for a call, on the CPU: GNA calls on fake CUDA tensors (no GPU needed) with
FlashAttention-4 made available or not, the sentences when a named backend cannot run a call, the backward's
backend, the backend as part of a call's spec, and prepared block masks with FlashAttention-4's lists."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import natsim.kernels.gna.choice as choice
import natsim.kernels.sparse.work as work_module
from natsim.kernels import GnaSpec, chosen_backend, gna_attention, prepare_sparse, sparse_attention

SHAPE = (8, 16, 16)


@pytest.fixture(autouse=True)
def _fresh_choices():
    """natsim decides once per distinct call and keeps the answer: each test decides afresh."""
    choice._choose.cache_clear()
    yield
    choice._choose.cache_clear()


@pytest.fixture
def fa4_here(monkeypatch):
    """FlashAttention-4 installed and on a GPU it runs on, as far as natsim's checks go."""
    monkeypatch.setattr(choice, "device_refusal", lambda device: None)


@pytest.fixture
def fa4_missing(monkeypatch):
    monkeypatch.setattr(choice, "device_refusal", lambda device: "FlashAttention-4 is not installed (pip ...).")


def picked(window, stride=1, head_dim=128, dtype=torch.bfloat16, **options):
    """(backend, FlashAttention-4's (q_tile, kv_tile) or None) that natsim picks for a GNA call on fake CUDA
    tensors of SHAPE."""
    spec = GnaSpec.of(3, window, stride, **options)
    with FakeTensorMode():
        q = torch.empty(1, *SHAPE, 2, head_dim, dtype=dtype, device="cuda")
        result = choice.choose(spec, spec.problem(SHAPE), q)
    return result.backend, None if result.fa4 is None else (result.fa4.q_tile, result.fa4.kv_tile)


def test_natsim_picks_fa4_where_every_block_is_full(fa4_here):
    assert picked(SHAPE) == ("fa4", None)  # dense: one sequence, no permutation
    backend, tiles = picked((4, 8, 8), (4, 8, 8))  # block-sparse on natsim's catalog tiles
    assert backend == "fa4" and tiles == ((2, 8, 8), (2, 8, 8))
    assert picked((4, 8, 8), (4, 8, 8), q_tile=(4, 8, 8), kv_tile=(2, 8, 8)) == ("fa4", ((4, 8, 8), (2, 8, 8)))


def test_dense_attention_over_one_dimension_is_fa4s_dense_call(fa4_here):
    """A 1-D layout whose window covers it (`gna_attention(q, k, v, N)`, dense attention) runs FlashAttention-4
    without block lists, as dense layouts of more dimensions do; a window short of the sequence gets lists."""
    spec = GnaSpec.of(1, 4096)
    with FakeTensorMode():
        q = torch.empty(1, 4096, 2, 72, dtype=torch.bfloat16, device="cuda")
        assert choice.choose(spec, spec.problem((4096,)), q) == choice.Choice("fa4", None)
        sparse = GnaSpec.of(1, 1024, 1024)
        assert choice.choose(sparse, sparse.problem((4096,)), q).fa4 is not None


def test_natsim_keeps_partial_tiles_on_triton_unless_triton_cannot_run_the_head_dim(fa4_here):
    assert picked((3, 5, 7)) == ("triton", None)
    assert picked((3, 5, 7), q_tile=(2, 8, 8), kv_tile=(2, 8, 8)) == ("triton", None)
    assert picked((3, 5, 7), head_dim=96) == ("triton", None)  # natsim's kernels run 16 to 256 in steps of 8
    backend, tiles = picked((3, 5, 7), head_dim=8)  # FlashAttention-4 runs 8 too
    assert backend == "fa4" and tiles is not None


@pytest.fixture
def hopper(monkeypatch):
    """Fake CUDA tensors on a Hopper GPU, as far as the FP8 choice asks."""
    monkeypatch.setattr(choice, "gpu_capability", lambda device: (9, 0))


def picked_fp8(window, stride=1, head_dim=128, **options):
    """(backend, the Gluon kernel's tile or None) that natsim picks for an FP8 GNA call on fake CUDA tensors."""
    spec = GnaSpec.of(3, window, stride, precision="fp8", **options)
    with FakeTensorMode():
        q = torch.empty(1, *SHAPE, 2, head_dim, dtype=torch.bfloat16, device="cuda")
        result = choice.choose(spec, spec.problem(SHAPE), q)
    return result.backend, None if result.gluon is None else (result.gluon.q_tile, result.gluon.kv_tile)


def test_fp8_calls_of_whole_128_token_tiles_run_on_the_gluon_kernel(hopper):
    assert picked_fp8(SHAPE) == ("gluon", None)  # dense: one sequence
    assert picked_fp8((4, 8, 8), (4, 8, 8)) == ("gluon", ((2, 8, 8), (2, 8, 8)))  # the catalog's 128-token tile
    assert picked_fp8((4, 8, 8), (4, 8, 8), head_dim=64) == ("gluon", ((2, 8, 8), (2, 8, 8)))
    assert picked_fp8((4, 8, 8), (4, 8, 8), q_tile=(2, 8, 8), kv_tile=(2, 8, 8)) == ("gluon", ((2, 8, 8),) * 2)


def test_fp8_calls_the_gluon_kernel_does_not_take_stay_on_triton(hopper, monkeypatch):
    assert picked_fp8((3, 5, 7)) == ("triton", None)  # partial tiles
    assert picked_fp8((4, 8, 8), (4, 8, 8), q_tile=(4, 8, 8), kv_tile=(4, 8, 8)) == ("triton", None)  # 256 tokens
    assert picked_fp8((4, 8, 8), (4, 8, 8), head_dim=96) == ("triton", None)
    assert picked_fp8((4, 8, 8), (4, 8, 8), backend="triton") == ("triton", None)
    monkeypatch.setattr(choice, "gpu_capability", lambda device: (8, 9))  # Ada: FP8 without wgmma
    choice._choose.cache_clear()
    assert picked_fp8(SHAPE) == ("triton", None)


def test_calls_fa4_does_not_take_stay_on_triton(fa4_here, monkeypatch):
    monkeypatch.setattr(choice, "gpu_capability", lambda device: (8, 9))
    assert picked((4, 8, 8), (4, 8, 8), precision="fp8") == ("triton", None)
    assert picked((4, 8, 8), (4, 8, 8), kv_tiling="dynamic") == ("triton", None)
    assert picked((4, 8, 8), (4, 8, 8), dtype=torch.float32) == ("triton", None)
    assert picked((4, 8, 8), (4, 8, 8), backend="triton") == ("triton", None)


@pytest.mark.parametrize("options, sentence", [
    (dict(precision="fp8"), "not precision='fp8', frame_offsets or kv_tiling='dynamic'"),
    (dict(q_tile=(4, 8, 8), kv_tile=(4, 8, 4)), "the KV tile must be the Q tile or a slab of it"),
    (dict(q_tile=(1, 4, 8), kv_tile=(1, 4, 8)), "query blocks of a multiple of 64 tokens, got 32"),
    (dict(head_dim=100), "head_dim 8 to 256 in steps of 8, got head_dim=100"),
])
def test_a_call_naming_fa4_that_it_cannot_run_is_refused_with_the_reason(fa4_here, options, sentence):
    with pytest.raises(ValueError, match=r"backend='fa4' cannot run this call: .*" + sentence.replace("(", r"\(")
                       .replace(")", r"\)")):
        picked((4, 8, 8), (4, 8, 8), backend="fa4", **options)


def test_without_fa4_natsim_runs_triton_and_refuses_fa4_by_name(fa4_missing):
    assert picked(SHAPE) == ("triton", None)
    with pytest.raises(ValueError, match="backend='fa4' cannot run this call: FlashAttention-4 is not installed"):
        picked(SHAPE, backend="fa4")


def test_cpu_tensors_run_the_reference_or_the_interpreter_and_never_fa4(monkeypatch):
    q = torch.randn(1, *SHAPE, 2, 32, dtype=torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert chosen_backend(q, q, q, (3, 5, 7)) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert chosen_backend(q, q, q, (3, 5, 7)) == "triton"
    with pytest.raises(ValueError, match="backend='fa4' cannot run this call: FlashAttention-4 runs on CUDA GPUs"):
        chosen_backend(q, q, q, (3, 5, 7), backend="fa4")


@pytest.mark.parametrize("head_dim, dtype, options, why", [
    (16, torch.float16, dict(precision="fp8"), "FP8 pads head_dim"),
    (100, torch.float16, {}, "head_dim"),
    (64, torch.float32, {}, "float16 and bfloat16"),
    (64, torch.bfloat16, {}, "computes bfloat16 wrongly"),
    (64, torch.float16, dict(q_tile=(0, 8, 8)), "q_tile"),
])
def test_chosen_backend_refuses_what_the_call_refuses_with_its_sentence(monkeypatch, head_dim, dtype, options, why):
    """In the interpreter (the Triton kernels' CPU path) a call the Triton route refuses is refused by
    `chosen_backend` too, with the call's own sentence."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 4, 8, 8, 2, head_dim).to(dtype)
    with pytest.raises(ValueError) as call:
        gna_attention(q, q, q, (3, 5, 7), **options)
    with pytest.raises(ValueError) as chosen:
        chosen_backend(q, q, q, (3, 5, 7), **options)
    assert str(chosen.value) == str(call.value) and why in str(call.value)


def test_chosen_backend_reads_float8_inputs_as_precision_fp8(monkeypatch):
    from natsim.kernels import Fp8Scales

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 4, 8, 8, 2, 32).to(torch.float8_e4m3fn)
    one = torch.ones(())
    assert chosen_backend(q, q, q, (3, 5, 7), scales=Fp8Scales(one, one, one)) == "triton"


def _fp8_refusals():
    """(q, k, v, keyword arguments) of FP8 calls every path refuses: an input that requires grad, float8 e5m2,
    float8 e4m3 without its scales."""
    from natsim.kernels import Fp8Scales

    half = torch.randn(1, 16, 2, 32, dtype=torch.float16)
    e5m2, e4m3 = half.to(torch.float8_e5m2), half.to(torch.float8_e4m3fn)
    return [((half.clone().requires_grad_(), half, half), dict(precision="fp8")),
            ((e5m2, e5m2, e5m2), dict(scales=Fp8Scales(*[torch.ones(())] * 3))),
            ((e4m3, e4m3, e4m3), {})]


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("case", range(3))
def test_chosen_backend_refuses_the_fp8_calls_the_call_refuses(monkeypatch, interpret, case):
    """FP8's own refusals (gradients, the float8 format, missing scales) on the CPU path and in the interpreter:
    `chosen_backend` raises the call's exception with its sentence instead of naming a backend."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    (q, k, v), options = _fp8_refusals()[case]
    with pytest.raises((ValueError, RuntimeError)) as call:
        gna_attention(q, k, v, 5, **options)
    with pytest.raises(type(call.value)) as chosen:
        chosen_backend(q, k, v, 5, **options)
    assert str(chosen.value) == str(call.value)


def test_fa4s_backward_takes_what_it_runs_and_leaves_the_rest_to_triton(fa4_here):
    def refusal(q_tile, kv_tile, head_dim=128):
        geometry = choice.Fa4Gna(GnaSpec.of(3, (4, 8, 8), (4, 8, 8)).problem(SHAPE), q_tile, kv_tile)
        return choice.backward_refusal(choice.Choice("fa4", geometry), head_dim)

    assert refusal((2, 8, 8), (2, 8, 8)) is None
    assert "key blocks of 128 tokens" in refusal((2, 8, 4), (2, 8, 4))
    assert choice.backward_refusal(choice.Choice("fa4", None), 128) is None  # dense


def test_the_backend_is_part_of_a_calls_spec():
    spec = GnaSpec.of(3, (4, 8, 8), (4, 8, 8), backend="fa4")
    assert spec.backend == "fa4" and spec != GnaSpec.of(3, (4, 8, 8), (4, 8, 8))
    assert GnaSpec.from_operator(*spec.operator_arguments()[:11], backend=spec.operator_arguments()[-1]) == spec
    with pytest.raises(ValueError, match=r"backend must be 'triton', 'fa4', 'gluon' or None \(natsim chooses\), "
                                         r"got backend='flash'\."):
        GnaSpec.of(3, 4, backend="flash")


# -- prepared block masks ---------------------------------------------------------------------------------------


def test_a_mask_prepared_for_fa4_where_it_cannot_run_is_refused():
    mask = torch.rand(1, 2, 4, 4) < 0.5
    with pytest.raises(ValueError, match=r"backend='fa4'\) cannot run this mask: FlashAttention-4 runs on CUDA GPUs"):
        prepare_sparse(mask, 128, 128, 512, backend="fa4")
    with pytest.raises(ValueError, match="got backend='flex'"):
        prepare_sparse(mask, 128, 128, 512, backend="flex")
    assert prepare_sparse(mask, 128, 128, 512).backend == "triton"  # natsim's choice without FA4 here


def test_a_prepared_mask_carries_fa4s_lists_and_refuses_calls_fa4_cannot_take(monkeypatch, reference_path):
    monkeypatch.setattr(work_module, "device_refusal", lambda device: None)
    mask = torch.rand(1, 2, 4, 4, generator=torch.Generator().manual_seed(0)) < 0.5
    with pytest.raises(ValueError, match="runs a block mask unmerged"):
        prepare_sparse(mask, 128, 128, 512, merge="consecutive", backend="fa4")
    named = prepare_sparse(mask, 128, 128, 512, backend="fa4")
    chosen = prepare_sparse(mask, 128, 128, 512)
    assert named.backend == chosen.backend == "fa4" and named.requested == "fa4" and chosen.requested is None
    assert named.fa4.visited == int(mask.sum()) and not named.fa4.masked
    q = torch.randn(1, 512, 2, 32)
    with pytest.raises(ValueError, match="prepared for FlashAttention-4 \\(backend='fa4'\\), which cannot run this "
                                         "call: FlashAttention-4 runs on CUDA tensors"):
        sparse_attention(q, q, q, named)
    # natsim's own choice falls back to natsim's lists, which the work keeps
    assert torch.allclose(sparse_attention(q, q, q, chosen), sparse_attention(q, q, q, chosen, backend="triton"))
