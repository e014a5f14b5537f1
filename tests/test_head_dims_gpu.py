"""Head dims 16 to 256 on a CUDA GPU: `pytest -m gpu tests/test_head_dims_gpu.py`.

natsim's Triton kernels (named as the backend, so that FlashAttention-4 never takes a call) at widths that are
powers of two, split into two column chunks and padded (kernels/common/headdim.py), each width both ways where
they differ (`strategy`: the width's default, or every width padded): the GNA forward on the in-place layout
(rank-4 and 1-D descriptors), on permuted tokens (dilation) and with dynamic KV tiling against the float64
reference; GNA gradients against the float32 reference; block masks forward and backward; FP8, which pads.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graphs import replayed_on_new_inputs
from natsim.kernels import gna_attention, reference_attention, sparse_attention, sparse_reference
from natsim.kernels.common import headdim
from natsim.kernels.common.fp8 import FP8_HEAD_DIMS
from natsim.kernels.gna import dispatch
from natsim.kernels.gna.reference import fp8_reference_attention, reference_gradients

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
GRADIENT_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
# Split by default (40, 72, 88, 96, 136, 192), padded by default (24, 112), powers of two (16, 256): bfloat16 at
# every width, float16 at two; each width padded too where its default splits. About 130 calls, each its own
# compiled kernel: `-n 4` keeps the run to a few minutes on an H100.
WIDTHS = (16, 24, 40, 72, 88, 96, 112, 136, 192, 256)
SPLIT_WIDTHS = tuple(d for d in WIDTHS if headdim.head_split(d).b)  # those whose default differs from padding
CASES = [(d, torch.bfloat16) for d in WIDTHS] + [(72, torch.float16), (136, torch.float16)]

LAYOUTS = {
    # shape, window, stride, dilation, causal, kv_tiling: the data paths of kernels/gna/tile_io.py
    "in-place-3d": ((12, 20, 24), (5, 7, 9), (1, 2, 3), 1, False, "static"),
    "in-place-block-sparse": ((16, 32, 32), (8, 16, 16), (8, 8, 8), 1, False, "static"),
    "dense-1d": ((3000,), 3000, 1, 1, False, None),
    "permuted-dilated": ((13, 21, 35), (5, 8, 7), (2, 3, 1), (2, 1, 3), (True, False, False), "static"),
    "dynamic-in-place": ((12, 20, 24), (5, 7, 9), (1, 1, 1), 1, False, "dynamic"),
    "dynamic-permuted": ((10, 18, 20), (4, 5, 6), 1, (2, 1, 2), (False, True, False), "dynamic"),
}

PADDED_LAYOUTS = ("in-place-3d", "dense-1d", "permuted-dilated")  # the paths the forward also runs padded


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(params=["default", "pad"])
def strategy(request, monkeypatch):
    """The width's default chunks, or every width padded to its next power of two (a fresh call cache)."""
    if request.param == "pad":
        monkeypatch.setattr(headdim, "PADDED_WIDTHS", frozenset(headdim.HEAD_DIMS))
    monkeypatch.setattr(dispatch, "_calls", {})
    return request.param


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("head_dim, dtype", CASES, ids=lambda x: str(x).removeprefix("torch."))
def test_gna_forward_matches_float64(head_dim, dtype, layout, strategy):
    if strategy == "pad" and (head_dim not in SPLIT_WIDTHS or layout not in PADDED_LAYOUTS):
        pytest.skip("padding is this width's default, or this data path is checked padded elsewhere")
    shape, window, stride, dilation, causal, kv_tiling = LAYOUTS[layout]
    torch.manual_seed(head_dim)
    q, k, v = (torch.randn(1, *shape, 2, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    out, lse = gna_attention(q, k, v, window, stride, dilation, causal, kv_tiling=kv_tiling, return_lse=True,
                             backend="triton")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), window, stride, dilation, causal,
                                       return_lse=True)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < TOLERANCE[dtype], rel(out, ref)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


@pytest.mark.parametrize("layout", ["in-place-3d", "dense-1d"])
@pytest.mark.parametrize("head_dim, dtype", CASES, ids=lambda x: str(x).removeprefix("torch."))
def test_gna_gradients_match_float32(head_dim, dtype, layout, strategy):
    if strategy == "pad" and head_dim not in SPLIT_WIDTHS:
        pytest.skip("padding is this width's default")
    shape, window, stride, dilation, causal, _ = LAYOUTS[layout]
    torch.manual_seed(head_dim)
    q, k, v, g = (torch.randn(1, *shape, 2, head_dim, device="cuda", dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = gna_attention(q, k, v, window, stride, dilation, causal, backend="triton")
    got = torch.autograd.grad(out, (q, k, v), g)
    want = reference_gradients(q.detach(), k.detach(), v.detach(), g, window, stride, dilation, causal)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < GRADIENT_TOLERANCE[dtype], (name, rel(a, b))


@pytest.mark.parametrize("blocks, merge", [((64, 64), None), ((16, 32), "xor")])
@pytest.mark.parametrize("head_dim, dtype", CASES, ids=lambda x: str(x).removeprefix("torch."))
def test_block_masks_forward_and_backward(head_dim, dtype, blocks, merge, strategy):
    """The block-mask kernels run the width's default chunks (pad: `head_split` reads `PADDED_WIDTHS`)."""
    if strategy == "pad" and head_dim not in SPLIT_WIDTHS:
        pytest.skip("padding is this width's default")
    q_block, kv_block = blocks
    n = 2000
    generator = torch.Generator().manual_seed(head_dim)
    mask = (torch.rand(1, 2, -(-n // q_block), -(-n // kv_block), generator=generator) < 0.4).cuda()
    mask[..., 0] = True
    q, k, v, g = (torch.randn(1, n, 2, head_dim, generator=generator).to("cuda", dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = sparse_attention(q, k, v, mask, q_block, kv_block, merge=merge, backend="triton")
    got = torch.autograd.grad(out, (q, k, v), g)
    inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = sparse_reference(*inputs, mask, q_block, kv_block)
    want = torch.autograd.grad(ref, inputs, g.float())
    assert rel(out, ref) < TOLERANCE[dtype], rel(out, ref)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < GRADIENT_TOLERANCE[dtype], (name, rel(a, b))


@pytest.mark.parametrize("layout", ["permuted-dilated", "dense-1d"])
@pytest.mark.parametrize("head_dim", [24, 72, 136, 256])
def test_fp8_pads_and_follows_its_rule(head_dim, layout):
    assert head_dim in FP8_HEAD_DIMS
    shape, window, stride, dilation, causal, _ = LAYOUTS[layout]
    torch.manual_seed(head_dim)
    q, k, v = (torch.randn(1, *shape, 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        out = gna_attention(q, k, v, window, stride, dilation, causal, precision="fp8")
    rule = fp8_reference_attention(q, k, v, window, stride, dilation, causal)
    assert rel(out, rule) < 3e-2, rel(out, rule)


def test_a_row_copying_launch_compiles_fullgraph_and_replays_under_cuda_graphs():
    """At head_dim 72 in bf16 (rows 16 bytes off 128-byte lines) the dynamic kernel's 64-token tiles copy q, k, v
    into aligned rows before the launch (kernels/common/rows.py): that call compiled with fullgraph, under
    `reduce-overhead` and captured in a CUDA graph, replayed with new inputs, equals eager, and eager equals float64."""
    from natsim.kernels.common import rows

    shape, window, stride, tile = (12, 20, 24), (5, 7, 9), (1, 1, 1), (1, 8, 8)
    assert rows.copies_layout_rows(("dynamic", 64), 72, 2)

    def attend(q, k, v):
        return gna_attention(q, k, v, window, stride, q_tile=tile, kv_tile=tile, kv_tiling="dynamic",
                             backend="triton")

    torch.manual_seed(7)
    q, k, v = (torch.randn(1, *shape, 3, 72, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    copied = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "in_aligned_rows", lambda t: copied.append(t.shape) or rows.in_aligned_rows(t))
        eager = attend(q, k, v)
    assert len(copied) == 3  # the launch ran on copies of q, k and v
    ref = reference_attention(q.double(), k.double(), v.double(), window, stride)
    assert ((eager.double() - ref).norm() / ref.norm()).item() < TOLERANCE[torch.bfloat16]
    torch._dynamo.reset()
    assert torch.equal(torch.compile(attend, fullgraph=True)(q, k, v), eager)
    graphed = torch.compile(attend, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        assert torch.equal(graphed(q, k, v), eager)
    captured, fresh = replayed_on_new_inputs(attend, q, k, v)
    assert torch.equal(captured, fresh)
