"""The paths a GPU without tensor descriptors (Ampere, Ada) runs, in Triton's CPU interpreter: the process-wide
switch (`set_tensor_descriptors`, NATSIM_NO_TMA=1; kernels/common/launch.py) turns descriptors off in the
interpreter as on a Hopper GPU, every kernel then launches with `USE_TMA` off (GNA's forward on permuted tokens,
`LAYOUT` 0), a call made before the switch is not reused after it, and the kernels still equal the float64 /
float32 references. Tiny shapes, one or two heads: tests/test_portable_paths_gpu.py runs the same paths at size on
a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launch_spy import no_descriptors, relative_error as rel, spies  # noqa: E402,F401

from natsim import Problem  # noqa: E402
from natsim.kernels import (gna_attention, gna_attention_permuted, permute, prepare_sparse,  # noqa: E402
                            reference_attention, set_tensor_descriptors, sparse_attention, sparse_reference,
                            tensor_descriptors_enabled, unpermute)
from natsim.kernels.common.launch import NO_TMA_VARIABLE, descriptors_fit, has_tensor_descriptors  # noqa: E402
from natsim.kernels.gna.backward import backward_tiles  # noqa: E402
from natsim.kernels.gna.launch import needs_mask  # noqa: E402
from natsim.kernels.gna.reference import fp8_reference_attention, reference_gradients  # noqa: E402
from natsim.kernels.sparse.reference import fp8_sparse_reference  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter's paths (tests/test_portable_paths_gpu.py runs them on a GPU)",
                allow_module_level=True)

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
GRADIENT_TOLERANCE = 2e-2


@pytest.fixture
def descriptors():
    """Tensor descriptors on at the start of the test (whatever NATSIM_NO_TMA says); the setting back after."""
    before = tensor_descriptors_enabled()
    set_tensor_descriptors(True)
    yield
    set_tensor_descriptors(before)


def _pointer_launches_only(launches) -> None:
    assert launches, "no kernel launch was seen"
    assert all(launch["USE_TMA"] is False for launch in launches), launches


def test_the_switch_turns_descriptors_off_and_on_in_the_interpreter(descriptors):
    cpu = torch.device("cpu")
    t = torch.zeros(2, 16, 2, 32)
    assert tensor_descriptors_enabled() and has_tensor_descriptors(cpu) and descriptors_fit(t)
    set_tensor_descriptors(False)
    try:
        assert not tensor_descriptors_enabled() and not has_tensor_descriptors(cpu) and not descriptors_fit(t)
    finally:
        set_tensor_descriptors(True)
    assert has_tensor_descriptors(cpu)
    with pytest.raises(TypeError, match="True or False"):
        set_tensor_descriptors("0")


def test_the_environment_variable_turns_descriptors_off_at_import(monkeypatch):
    """kernels/common/launch.py run again as a module of its own (its package's other modules shared) under
    NATSIM_NO_TMA: what importing natsim does in a process started with it (a subprocess would spend seconds
    importing torch)."""
    from natsim.kernels.common import launch

    for value, enabled in (("1", False), ("0", True)):
        monkeypatch.setenv(NO_TMA_VARIABLE, value)
        spec = importlib.util.spec_from_file_location("natsim.kernels.common._launch_under_test", launch.__file__)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # where its dataclasses look their module up
        spec.loader.exec_module(module)
        assert module.tensor_descriptors_enabled() is enabled
        assert module.has_tensor_descriptors(torch.device("cpu")) is enabled


# shape, window, stride, dilation, causal, q_tile, kv_tile, kv_tiling, head_dim: 1-D/2-D/3-D, padded borders
# (sizes not multiples of the tiles), a dilated and a causal case, static and dynamic KV tiling; head_dim 40 runs
# in two column chunks (32 + 8, the second masked past head_dim).
GNA_CASES = {
    "1d-causal-padded-40": ((37,), 9, 1, 1, True, (16,), (16,), "static", 40),
    "2d-dilated-padded": ((6, 7), (3, 4), (1, 2), (2, 1), False, (4, 4), (4, 4), "static", 16),
    "3d-padded": ((2, 3, 5), (2, 3, 4), (1, 2, 1), 1, (False, True, False), (1, 4, 4), (2, 2, 4), "static", 16),
    "2d-dynamic": ((6, 7), (3, 5), 1, 1, False, (4, 4), (4, 4), "dynamic", 16),
    "3d-dynamic-dilated": ((2, 4, 6), (2, 3, 3), 1, (1, 1, 2), False, (2, 2, 4), (2, 2, 4), "dynamic", 16),
}


@pytest.mark.parametrize("case", list(GNA_CASES))
def test_gna_forward_without_descriptors_runs_permuted_pointer_loads_and_equals_float64(case, spies, no_descriptors):
    shape, window, stride, dilation, causal, q_tile, kv_tile, kv_tiling, head_dim = GNA_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    q, k, v = (torch.randn(1, *shape, 1, head_dim, generator=generator).half() for _ in range(3))
    args = (window, stride, dilation, causal)
    out, lse = gna_attention(q, k, v, *args, q_tile=q_tile, kv_tile=kv_tile, kv_tiling=kv_tiling, return_lse=True)
    launches = spies.launches(f"gna_{kv_tiling}")
    _pointer_launches_only(launches)
    assert all(launch["LAYOUT"] == 0 for launch in launches)
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args, return_lse=True)
    assert rel(out, ref) < TOLERANCE[torch.float16]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


def test_a_call_made_with_descriptors_is_made_again_without_them(spies, descriptors):
    """The dispatcher keys its calls on the switch: the same call runs in place, then permuted, then in place."""
    q, k, v = (torch.randn(1, 8, 8, 1, 16).half() for _ in range(3))
    arguments = dict(q_tile=(2, 8), kv_tile=(2, 8), kv_tiling="static")
    first = gna_attention(q, k, v, (3, 5), **arguments)
    set_tensor_descriptors(False)
    try:
        second = gna_attention(q, k, v, (3, 5), **arguments)
    finally:
        set_tensor_descriptors(True)
    third = gna_attention(q, k, v, (3, 5), **arguments)
    assert [(launch["LAYOUT"], launch["USE_TMA"]) for launch in spies.launches("gna_static")] == [
        (1, True), (0, False), (1, True)]
    assert torch.equal(first, third)
    assert rel(second, reference_attention(q.double(), k.double(), v.double(), (3, 5))) < TOLERANCE[torch.float16]


def test_gna_attention_permuted_loads_through_pointers_without_descriptors(spies, no_descriptors):
    tile = (4, 8)
    q, k, v = (permute(torch.randn(1, 8, 16, 1, 16).half(), tile) for _ in range(3))
    out = gna_attention_permuted(q, k, v, Problem((8, 16), (4, 8), (4, 8)), tile, tile)
    _pointer_launches_only(spies.launches("gna_static"))
    ref = reference_attention(*(unpermute(t, (8, 16), tile).double() for t in (q, k, v)), (4, 8), (4, 8))
    assert rel(unpermute(out, (8, 16), tile), ref) < TOLERANCE[torch.float16]


def test_gna_backward_without_descriptors_gathers_and_equals_float32(spies, no_descriptors):
    """Dense attention over 128 tokens: its backward tiles (64 queries, 128 keys) hold no mask and no padding, so
    both backward kernels step through descriptors unless they are off."""
    n, head_dim = 128, 16
    problem = Problem((n,), (n,))
    q_tile, kv_tile = backward_tiles(problem, head_dim)
    assert not (needs_mask(problem, q_tile, kv_tile) or needs_mask(problem, kv_tile, q_tile))
    generator = torch.Generator().manual_seed(1)
    q, k, v, g = (torch.randn(1, n, 1, head_dim, generator=generator) for _ in range(4))
    leaves = [t.half().requires_grad_() for t in (q, k, v)]
    gna_attention(*leaves, n, backend="triton").backward(g.half())
    _pointer_launches_only(spies.launches("gna_dkdv", "gna_dq"))
    want = reference_gradients(*(t.detach().float() for t in leaves), g.half().float(), n)
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, want):
        assert rel(leaf.grad, ref) < GRADIENT_TOLERANCE, name


@pytest.mark.parametrize("prepared", [False, True], ids=["mask", "prepared"])
def test_sparse_forward_and_backward_without_descriptors_equal_the_reference(prepared, spies, no_descriptors):
    """KV blocks of 32 keys, the interpreter's KV tile: the forward reads such blocks through descriptors unless
    they are off, and the backward always does."""
    n, q_block, kv_block = 40, 16, 32
    generator = torch.Generator().manual_seed(n)
    mask = torch.rand(1, 1, 3, 2, generator=generator) < 0.6
    mask[..., 0] = True
    q, k, v, g = (torch.randn(1, n, 1, 16, generator=generator) for _ in range(4))
    leaves = [t.half().requires_grad_() for t in (q, k, v)]
    if prepared:
        work = prepare_sparse(mask, q_block, kv_block, n, backend="triton")
        out, lse = sparse_attention(*leaves, work, return_lse=True, backend="triton")
    else:
        work = prepare_sparse(mask, q_block, kv_block, n, backend="triton", backward=False)
        out, lse = sparse_attention(*leaves, mask, q_block, kv_block, return_lse=True, backend="triton")
    assert work.block_n == work.kv_block
    out.backward(g.half())
    _pointer_launches_only(spies.launches("sparse_forward"))
    _pointer_launches_only(spies.launches("sparse_backward"))
    exact = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse = sparse_reference(*exact, mask, q_block, kv_block, return_lse=True)
    ref.backward(g.double())
    assert rel(out, ref) < TOLERANCE[torch.float16]
    finite = torch.isfinite(ref_lse)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, exact):
        assert rel(leaf.grad, want.grad) < GRADIENT_TOLERANCE, name


def test_fp8_without_descriptors_runs_pointer_loads_and_follows_the_rule(spies, no_descriptors):
    """FP8 (compute capability 8.9+ on a GPU: Ada runs it without descriptors): GNA's 1-D layout, which it reads in
    place through descriptors, is permuted instead; the sparse kernel gathers its blocks."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 37, 1, 32, generator=generator).half() for _ in range(3))
    out = gna_attention(q, k, v, 9, causal=True, q_tile=16, kv_tile=16, precision="fp8")
    launches = spies.launches("gna_static")
    _pointer_launches_only(launches)
    assert all(launch["LAYOUT"] == 0 and launch["FP8"] for launch in launches)
    assert rel(out, fp8_reference_attention(q, k, v, 9, causal=True)) < 3e-2
    mask = torch.tensor([[True, False], [True, True], [False, True]]).expand(1, 1, 3, 2)
    out = sparse_attention(q, k, v, mask, 16, 32, precision="fp8")
    _pointer_launches_only(spies.launches("sparse_forward"))
    assert rel(out, fp8_sparse_reference(q, k, v, mask, 16, 32)) < 3e-2
