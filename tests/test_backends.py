"""The backends' capability tables against the kernels' own checks, the tables' refusal sentences, the registry,
and the Triton face's timing entry points against the reference (CPU: Triton's interpreter, or the GPU).

A table is only worth reading if it says what the kernels do: every value it lists is one the kernel's checks
accept, and values just outside are refused by the checks (and by the table).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from natsim import Problem
from natsim.kernels import gna_attention, prepare_sparse, reference_attention, sparse_attention
from natsim.kernels.backends import BACKENDS, FAMILIES, FEATURES, Capabilities, capabilities, torch_reference, triton
from natsim.kernels.common.checks import KERNEL_DTYPES, KERNEL_HEAD_DIMS
from natsim.kernels.gna.checks import check_kernel_inputs, kernel_tiles
from natsim.kernels.gna.reference import reference_gradients
from natsim.kernels.gna.tiles import box_shapes
from natsim.kernels.sparse.checks import SPARSE_HEAD_DIMS, check_sparse_kernel

TRITON_GNA, TRITON_MASKS = capabilities("triton", "gna"), capabilities("triton", "masks")
REFERENCE_GNA, REFERENCE_MASKS = capabilities("reference", "gna"), capabilities("reference", "masks")
CHECKS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
RUNS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int32, torch.bool)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _refused(check, *args) -> bool:
    try:
        check(*args)
    except ValueError:
        return True
    return False


def _probe(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A shape-only `[1, 64, 1, head_dim]` tensor for the kernels' checks."""
    return torch.empty((1, 64, 1, head_dim), dtype=dtype, device="meta")


# -- the Triton tables say what the kernels' checks accept ---------------------------------------------------------


def test_the_triton_tables_hold_the_kernels_own_constants():
    assert TRITON_GNA.dtypes is KERNEL_DTYPES and TRITON_GNA.head_dims is KERNEL_HEAD_DIMS
    assert TRITON_MASKS.dtypes is KERNEL_DTYPES and TRITON_MASKS.head_dims is SPARSE_HEAD_DIMS
    assert (TRITON_GNA, TRITON_MASKS) == (triton.GNA, triton.MASKS)


@CHECKS
@given(st.integers(1, 1024))
def test_triton_head_dims_are_those_the_kernel_checks_accept(head_dim):
    for table, check in ((TRITON_GNA, check_kernel_inputs), (TRITON_MASKS, check_sparse_kernel)):
        listed = head_dim in table.head_dims
        assert _refused(check, _probe(head_dim)) is not listed
        assert (table.refusal(head_dim=head_dim) is None) is listed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_dtypes_are_those_the_kernel_checks_accept(dtype):
    for table, check in ((TRITON_GNA, check_kernel_inputs), (TRITON_MASKS, check_sparse_kernel)):
        listed = dtype in table.dtypes
        assert _refused(check, _probe(64, dtype)) is not listed
        assert (table.refusal(dtype=dtype) is None) is listed


@CHECKS
@given(st.integers(1, 1024), st.sampled_from(("q", "kv")))
def test_triton_gna_tile_tokens_are_those_kernel_tiles_accepts(tokens, which):
    """`kernel_tiles` (kernels/gna/checks.py) on a 1-D layout long enough for any tile, the other tile 64 tokens."""
    problem = Problem((2048,), 65)
    tiles = ((tokens,), (64,)) if which == "q" else ((64,), (tokens,))
    listed = tokens in (TRITON_GNA.q_blocks if which == "q" else TRITON_GNA.kv_blocks)
    assert _refused(kernel_tiles, problem, *tiles) is not listed


def test_triton_gna_tile_tokens_hold_for_boxes_of_a_3d_layout():
    problem = Problem((8, 16, 16), (3, 5, 5))
    for tokens in TRITON_GNA.q_blocks:
        for box in box_shapes(tokens, problem.shape):
            assert kernel_tiles(problem, box, box) == (box, box)


@CHECKS
@given(st.integers(1, 512), st.sampled_from(("q", "kv")))
def test_triton_mask_blocks_are_those_prepare_sparse_accepts(block, which):
    """`prepare_sparse` (kernels/sparse/work.py) on an all-True mask, the other block 16 tokens."""
    seq_len = 256
    q_block, kv_block = (block, 16) if which == "q" else (16, block)
    mask = torch.ones((1, 1, -(-seq_len // q_block), -(-seq_len // kv_block)), dtype=torch.bool)
    listed = block in (TRITON_MASKS.q_blocks if which == "q" else TRITON_MASKS.kv_blocks)
    prepare = lambda: prepare_sparse(mask, q_block, kv_block, seq_len, backward=False)  # noqa: E731
    assert _refused(prepare) is not listed


def test_the_triton_features():
    assert TRITON_GNA.features() == FEATURES
    assert TRITON_MASKS.features() == ("partial_tiles", "backward", "fp8")


# -- the reference tables say what the references run (the entry points' CPU path) ------------------------------


@RUNS
@given(st.sampled_from(REFERENCE_GNA.head_dims), st.sampled_from(REFERENCE_GNA.dtypes),
       st.sampled_from(REFERENCE_GNA.q_blocks), st.sampled_from(("static", "dynamic")))
def test_the_gna_reference_runs_its_listed_head_dims_dtypes_and_any_tiles(reference_path, head_dim, dtype, tokens,
                                                                          kv_tiling):
    """The GNA reference has no tiles: any tile and KV tiling give the exact result."""
    q = torch.randn((1, 6, 1, head_dim), dtype=dtype)
    got = gna_attention(q, q, q, 3, q_tile=tokens, kv_tile=tokens, kv_tiling=kv_tiling)
    torch.testing.assert_close(got, reference_attention(q, q, q, 3))


@RUNS
@given(st.sampled_from(REFERENCE_MASKS.head_dims), st.sampled_from(REFERENCE_MASKS.dtypes),
       st.sampled_from(REFERENCE_MASKS.q_blocks), st.sampled_from(REFERENCE_MASKS.kv_blocks))
def test_the_mask_reference_runs_its_listed_head_dims_dtypes_and_blocks(reference_path, head_dim, dtype, q_block,
                                                                        kv_block):
    seq_len = 20
    q = torch.randn((1, seq_len, 1, head_dim), dtype=dtype)
    mask = torch.ones((1, 1, -(-seq_len // q_block), -(-seq_len // kv_block)), dtype=torch.bool)
    assert sparse_attention(q, q, q, mask, q_block, kv_block).shape == q.shape


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d not in REFERENCE_GNA.dtypes], ids=str)
def test_the_references_refuse_dtypes_they_do_not_list(reference_path, dtype):
    """Other floating dtypes than those listed are float8, which come as FP8 calls with their scales."""
    q = torch.zeros((1, 16, 1, 8), dtype=dtype)
    mask = torch.ones((1, 1, 2, 2), dtype=torch.bool)
    for run in (lambda: gna_attention(q, q, q, 3), lambda: sparse_attention(q, q, q, mask, 8, 8)):
        with pytest.raises((TypeError, ValueError)):
            run()


@pytest.mark.parametrize("block", [4, 256])
def test_the_mask_reference_refuses_blocks_it_does_not_list(reference_path, block):
    q = torch.zeros((1, 256, 1, 8))
    mask = torch.ones((1, 1, -(-256 // block), 32), dtype=torch.bool)
    assert block not in REFERENCE_MASKS.q_blocks
    with pytest.raises(ValueError, match="q_block must be a power of two"):
        sparse_attention(q, q, q, mask, block, 8)


def test_the_references_run_fp8_the_backward_and_gna_frame_ranges(reference_path):
    assert REFERENCE_GNA.features() == FEATURES
    assert REFERENCE_MASKS.features() == ("partial_tiles", "backward", "fp8")
    q = torch.randn((1, 12, 1, 8), requires_grad=True)
    gna_attention(q, q, q, 5).sum().backward()
    assert q.grad is not None
    mask = torch.ones((1, 1, 2, 2), dtype=torch.bool)
    sparse_attention(q, q, q, mask, 8, 8).sum().backward()
    frames = torch.randn((1, 4, 1, 8))
    assert gna_attention(frames[:, :2], frames, frames, 3, frame_offsets=(2, 1, 6)).shape == (1, 2, 1, 8)
    with torch.no_grad():
        assert gna_attention(q, q, q, 5, precision="fp8").shape == q.shape
        assert sparse_attention(q, q, q, mask, 8, 8, precision="fp8").shape == q.shape


# -- refusals, devices, the registry -------------------------------------------------------------------------------


def test_refusals_are_one_sentence_naming_the_first_mismatch():
    assert TRITON_GNA.refusal(dtype=torch.bfloat16, head_dim=64, q_block=128, kv_block=64, capability=(9, 0),
                              needs=("backward", "frame_ranges")) is None
    assert TRITON_GNA.refusal(head_dim=260) == (
        "the Triton GNA backend runs head_dim 16 to 256 in steps of 8, got head_dim=260.")
    assert TRITON_GNA.refusal(dtype=torch.float32) == (
        "the Triton GNA backend runs dtypes float16, bfloat16, got dtype=torch.float32.")
    assert TRITON_GNA.refusal(q_block=512) == (
        "the Triton GNA backend runs Q tiles of 16, 32, 64, 128 or 256 tokens, got 512.")
    assert TRITON_MASKS.refusal(q_block=4) == (
        "the Triton block-mask backend runs Q tiles of 8, 16, 32, 64 or 128 tokens, got 4.")
    assert TRITON_MASKS.refusal(needs=("dynamic_kv_tiling",)) == (
        "the Triton block-mask backend has no dynamic kv tiling.")
    assert TRITON_GNA.refusal(capability=None) == "the Triton GNA backend does not run on CPU tensors."
    assert REFERENCE_GNA.refusal(capability=(9, 0)) == (
        "the torch reference GNA backend does not run on a GPU of compute capability 9.0.")
    assert REFERENCE_GNA.refusal(head_dim=4096) == (
        "the torch reference GNA backend runs head_dim 1 to 1024 in steps of 1, got head_dim=4096.")
    assert TRITON_GNA.refusal(capability=None, head_dim=256).startswith("the Triton GNA backend does not run on")
    with pytest.raises(ValueError, match="needs must name features of"):
        TRITON_GNA.refusal(needs=("sliding",))


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0)])
def test_runs_on_a_gpu_or_the_cpu(capability):
    for table in (TRITON_GNA, TRITON_MASKS):
        assert table.runs_on(capability) and not table.runs_on(None)
    for table in (REFERENCE_GNA, REFERENCE_MASKS):
        assert table.runs_on(None) and not table.runs_on(capability)


def test_the_registry_has_every_family_of_every_backend():
    assert BACKENDS == ("triton", "fa4", "gluon", "reference") and FAMILIES == ("gna", "masks")
    for backend in BACKENDS:
        for family in FAMILIES:
            assert isinstance(capabilities(backend, family), Capabilities)
    assert (REFERENCE_GNA, REFERENCE_MASKS) == (torch_reference.GNA, torch_reference.MASKS)


@pytest.mark.parametrize("backend, family, message", [
    ("flex", "gna", r"backend must be one of \('triton', 'fa4', 'gluon', 'reference'\), got backend='flex'\."),
    ("Triton", "gna", "got backend='Triton'"),
    (None, "gna", "got backend=None"),
    ("triton", "sparse", r"family must be one of \('gna', 'masks'\), got family='sparse'\."),
    ("reference", 3, "got family=3"),
])
def test_the_registry_refuses_unknown_names_with_a_sentence(backend, family, message):
    with pytest.raises(ValueError, match=message):
        capabilities(backend, family)


# -- the Triton face's timing entry points ----------------------------------------------------------------------


def test_the_timing_entry_points_run_gna_forward_and_backward():
    """On the GPU or in the interpreter: the forward with its LSE and the backward kernels' gradients against
    the float32 reference."""
    if DEVICE == "cpu" and not triton.use_triton(torch.empty(0)):
        pytest.skip("the Triton kernels run on the GPU or in the interpreter")
    problem = Problem((32,), 9)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn((1, 32, 1, 32), generator=generator).to(DEVICE, torch.float16) for _ in range(4))
    out, lse = triton.gna_forward_for_timing(q, k, v, problem)
    want, want_lse = reference_attention(q.float(), k.float(), v.float(), 9, return_lse=True)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.float(), want_lse, atol=1e-2, rtol=1e-2)
    got = triton.gna_backward_for_timing(q, k, v, out, lse, grad, problem)
    wanted = reference_gradients(q, k, v, grad, problem.window, problem.stride, problem.dilation, problem.causal)
    for g, w in zip(got, wanted):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
