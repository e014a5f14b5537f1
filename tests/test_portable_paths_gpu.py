"""The paths of GPUs without tensor descriptors (Ampere, Ada: A100, L40S, RTX 4090), forced on a Hopper GPU:
`pytest -m gpu tests/test_portable_paths_gpu.py`.

`set_tensor_descriptors(False)` (kernels/common/launch.py; NATSIM_NO_TMA=1 does the same at import) makes every
launch decide as `has_tensor_descriptors` answers on a GPU before Hopper: GNA's forward permutes its tokens and
loads through pointers (`LAYOUT` 0, `USE_TMA` off), its backward and the block-mask kernels gather through
pointers. The kernels are the same Triton source an A100 compiles (only the lowering differs), and every test
checks through a spy on the kernels' launches (tests/launch_spy.py) that no launch took descriptors, so that none
can pass on the Hopper path. natsim's Triton kernels are named as the backend: FlashAttention-4 never takes a call.

Against the float64 reference (forward) and float32 gradients: GNA with static and dynamic KV tiling in 1-D,
2-D and 3-D, dilated, causal, padded borders, block-sparse and dense; block masks prepared and not, forward and
backward; head dims 64, 128 and 96 (two column chunks, 64 + 32) in bfloat16 and float16; FP8 where the GPU has
FP8 tensor cores (compute capability 8.9: Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launch_spy import no_descriptors, relative_error as rel, spies  # noqa: E402,F401

from natsim import Problem  # noqa: E402
from natsim.kernels import (gna_attention, prepare_sparse, reference_attention, set_tensor_descriptors,  # noqa: E402
                            sparse_attention, sparse_reference, tensor_descriptors_enabled)
from natsim.kernels.gna.backward import backward_tiles  # noqa: E402
from natsim.kernels.gna.launch import dense_as_1d, needs_mask  # noqa: E402
from natsim.kernels.gna.reference import fp8_reference_attention, reference_gradients  # noqa: E402
from natsim.kernels.sparse.reference import fp8_sparse_reference  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
GRADIENT_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
CASES = [(d, dtype) for dtype in (torch.bfloat16, torch.float16) for d in (64, 128, 96)]
CASE_IDS = [f"{d}-{str(dtype).removeprefix('torch.')}" for d, dtype in CASES]

LAYOUTS = {
    # shape, window, stride, dilation, causal, kv_tiling
    "1d-causal-padded": ((1000,), 257, 1, 1, True, "static"),
    "2d-dilated-padded": ((45, 61), (9, 12), (2, 3), (2, 1), False, "static"),
    "3d-causal-padded": ((12, 20, 24), (5, 7, 9), (1, 2, 3), 1, (True, False, False), "static"),
    "3d-block-sparse": ((16, 32, 32), (8, 16, 16), (8, 8, 8), 1, False, "static"),
    "3d-dense": ((8, 16, 16), (8, 16, 16), 1, 1, False, None),  # as 1-D over the flattened layout
    "2d-dynamic-padded": ((30, 41), (7, 9), 1, 1, False, "dynamic"),
    "3d-dynamic-dilated": ((10, 18, 20), (4, 5, 6), 1, (2, 1, 2), (False, True, False), "dynamic"),
}
BACKWARD_LAYOUTS = ("1d-causal-padded", "2d-dilated-padded", "3d-causal-padded", "3d-block-sparse", "3d-dense")


def _pointer_launches_only(launches) -> None:
    assert launches, "no kernel launch was seen"
    assert all(launch["USE_TMA"] is False for launch in launches), launches


def _qkv(shape, head_dim, dtype, count=3, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, *shape, 2, head_dim, device="cuda", generator=generator).to(dtype) for _ in range(count)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the descriptor path this checks against needs Hopper (compute capability 9.0) or newer")
def test_this_gpu_takes_descriptors_unless_they_are_turned_off(spies):
    """What makes the spies' evidence count: the same call runs in place through descriptors, then, with them
    off, on permuted tokens through pointers."""
    q, k, v = _qkv((12, 20, 24), 128, torch.bfloat16)
    before = tensor_descriptors_enabled()
    try:
        set_tensor_descriptors(True)
        gna_attention(q, k, v, (5, 7, 9), kv_tiling="static", backend="triton")
        set_tensor_descriptors(False)
        gna_attention(q, k, v, (5, 7, 9), kv_tiling="static", backend="triton")
    finally:
        set_tensor_descriptors(before)
    assert [(launch["LAYOUT"], launch["USE_TMA"]) for launch in spies.launches("gna_static")] == [
        (1, True), (0, False)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("head_dim, dtype", CASES, ids=CASE_IDS)
def test_gna_forward_without_descriptors_matches_float64(head_dim, dtype, layout, spies, no_descriptors):
    shape, window, stride, dilation, causal, kv_tiling = LAYOUTS[layout]
    q, k, v = _qkv(shape, head_dim, dtype, seed=head_dim)
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q, k, v, *args, kv_tiling=kv_tiling, return_lse=True, backend="triton")
    launches = spies.launches("gna_static", "gna_dynamic")
    _pointer_launches_only(launches)
    assert all(launch["LAYOUT"] == 0 for launch in launches)
    if kv_tiling is not None:
        assert spies.launches(f"gna_{kv_tiling}")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args, return_lse=True)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < TOLERANCE[dtype], rel(out, ref)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


@pytest.mark.parametrize("layout", BACKWARD_LAYOUTS)
@pytest.mark.parametrize("head_dim, dtype", CASES, ids=CASE_IDS)
def test_gna_gradients_without_descriptors_match_float32(head_dim, dtype, layout, spies, no_descriptors):
    """The backward kernels read in place either way; descriptors would step their tiles where they hold no
    mask (block-sparse, dense: `uses_descriptors`), pointer gathers do here."""
    shape, window, stride, dilation, causal, _ = LAYOUTS[layout]
    if layout in ("3d-block-sparse", "3d-dense"):  # where the backward would otherwise take descriptors
        problem = Problem(shape, window, stride, dilation, causal)
        problem = dense_as_1d(problem) or problem
        q_tile, kv_tile = backward_tiles(problem, head_dim)
        assert not (needs_mask(problem, q_tile, kv_tile) or needs_mask(problem, kv_tile, q_tile))
    q, k, v, g = _qkv(shape, head_dim, dtype, count=4, seed=head_dim)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = gna_attention(q, k, v, window, stride, dilation, causal, backend="triton")
    got = torch.autograd.grad(out, (q, k, v), g)
    _pointer_launches_only(spies.launches("gna_dkdv", "gna_dq"))
    want = reference_gradients(q.detach(), k.detach(), v.detach(), g, window, stride, dilation, causal)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < GRADIENT_TOLERANCE[dtype], (name, rel(a, b))


@pytest.mark.parametrize("prepared", [False, True], ids=["mask", "prepared"])
@pytest.mark.parametrize("head_dim, dtype", CASES, ids=CASE_IDS)
def test_block_masks_without_descriptors_forward_and_backward(head_dim, dtype, prepared, spies, no_descriptors):
    """64 x 64 blocks, unmerged: the GPU's KV tile is one block, which the forward reads through a descriptor
    unless they are off; N = 2000 pads the last blocks."""
    n, q_block, kv_block = 2000, 64, 64
    generator = torch.Generator().manual_seed(head_dim)
    mask = (torch.rand(1, 2, -(-n // q_block), -(-n // kv_block), generator=generator) < 0.4).cuda()
    mask[..., 0] = True
    q, k, v, g = (torch.randn(1, n, 2, head_dim, generator=generator).to("cuda", dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    work = prepare_sparse(mask, q_block, kv_block, n, backend="triton", backward=prepared)
    assert work.block_n == work.kv_block
    if prepared:
        out, lse = sparse_attention(q, k, v, work, return_lse=True, backend="triton")
    else:
        out, lse = sparse_attention(q, k, v, mask, q_block, kv_block, return_lse=True, backend="triton")
    got = torch.autograd.grad(out, (q, k, v), g)
    _pointer_launches_only(spies.launches("sparse_forward"))
    _pointer_launches_only(spies.launches("sparse_backward"))
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = sparse_reference(*inputs, mask, q_block, kv_block, return_lse=True)
    assert rel(out, ref) < TOLERANCE[dtype], rel(out, ref)
    finite = torch.isfinite(ref_lse)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2
    want = torch.autograd.grad(ref, inputs, g.double())  # float64 gradients, tighter than float32's
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < GRADIENT_TOLERANCE[dtype], (name, rel(a, b))


FP8_SKIP = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                              reason="precision='fp8' needs FP8 tensor cores: compute capability 8.9 or newer "
                                     "(Ada, Hopper, Blackwell)")


@FP8_SKIP
@pytest.mark.parametrize("layout", ["1d-causal-padded", "2d-dilated-padded", "3d-causal-padded", "3d-dense"])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_gna_fp8_without_descriptors_follows_its_rule(head_dim, layout, spies, no_descriptors):
    """FP8 reads a 1-D layout in place through descriptors where it can; without them every layout is permuted
    and its tiles, V transposed, load through pointers. 96 pads to 128 columns."""
    shape, window, stride, dilation, causal, _ = LAYOUTS[layout]
    q, k, v = _qkv(shape, head_dim, torch.bfloat16, seed=head_dim)
    k = k + 2.0  # keys with a common component, as models' (what FP8's smoothing is for)
    args = (window, stride, dilation, causal)
    with torch.no_grad():
        out, lse = gna_attention(q, k, v, *args, return_lse=True, precision="fp8")
    launches = spies.launches("gna_static")
    _pointer_launches_only(launches)
    assert all(launch["LAYOUT"] == 0 and launch["FP8"] for launch in launches)
    rule, rule_lse = fp8_reference_attention(q, k, v, *args, return_lse=True)
    exact = reference_attention(q.double(), k.double(), v.double(), *args)
    assert rel(out, rule) < 3e-2, rel(out, rule)
    assert rel(out, exact) < 6e-2, rel(out, exact)
    assert (lse - rule_lse).abs().max().item() < 2e-2


@FP8_SKIP
@pytest.mark.parametrize("prepared", [False, True], ids=["mask", "prepared"])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_sparse_fp8_without_descriptors_follows_its_rule(head_dim, prepared, spies, no_descriptors):
    n, q_block, kv_block = 4000, 64, 64
    q, k, v = _qkv((n,), head_dim, torch.bfloat16, seed=head_dim)  # [1, N, 2, head_dim]
    generator = torch.Generator(device="cuda").manual_seed(1)
    mask = torch.rand(1, 2, -(-n // q_block), -(-n // kv_block), device="cuda", generator=generator) < 0.3
    mask[..., 0] = True
    given = prepare_sparse(mask, q_block, kv_block, n, backend="triton", backward=False) if prepared else mask
    blocks = {} if prepared else dict(q_block=q_block, kv_block=kv_block)
    with torch.no_grad():
        out, lse = sparse_attention(q, k, v, given, **blocks, return_lse=True, precision="fp8")
    _pointer_launches_only(spies.launches("sparse_forward"))
    assert all(launch["FP8"] for launch in spies.launches("sparse_forward"))
    rule, rule_lse = fp8_sparse_reference(q, k, v, mask, q_block, kv_block, return_lse=True)
    assert rel(out, rule) < 3e-2, rel(out, rule)
    finite = torch.isfinite(rule_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[finite] - rule_lse[finite]).abs().max().item() < 2e-2
