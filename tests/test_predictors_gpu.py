"""The mask predictors, the PV skip and mask plans on a CUDA GPU: `pytest -m gpu tests/test_predictors_gpu.py`.

SpargeAttn's PV skip in the compiled sparse kernel (descriptor loads with one KV block per tile, pointer
gathers with several, fp16 and bf16, both schedules, query merging) against the torch reference of the rule
(kernels/pvskip.py), its debug count against the reference's, and the predictors on CUDA tensors against the
same predictors on the CPU, at video sizes.
"""

from __future__ import annotations

import pytest
import torch

from natsim.kernels import prepare_sparse, sparse_attention, sparse_tile_counts
from natsim.kernels.sparse.reference import sparse_pv_reference
from natsim.masks import MaskCache, hierarchical, sparge, topp

pytestmark = pytest.mark.gpu

PV_CASES = [
    # n, q_block, kv_block, merge, schedule, head_dim, dtype, density
    (2000, 64, 128, None, "grid", 128, torch.bfloat16, 0.5),  # one KV block per tile: descriptor loads
    (2000, 128, 128, None, "lpt", 64, torch.float16, 0.8),
    (3001, 16, 16, "xor", "lpt", 128, torch.float16, 0.3),  # 8 blocks gathered per tile, 8 members
    (1500, 32, 64, "consecutive", "grid", 64, torch.bfloat16, 0.6),
    (777, 8, 4, None, "grid", 32, torch.float16, 0.5),
]


def integer_inputs(n, heads, head_dim, dtype, seed):
    """q, k in {-1, 0, 1} with the first keys of every 512 tripled and v random: exact scores in both dtypes,
    tiles that fall well below earlier ones."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randint(-1, 2, (1, n, heads, head_dim), generator=gen).float() for _ in range(2))
    k[:, torch.arange(n) % 512 < 64] *= 3
    v = torch.randn(1, n, heads, head_dim, generator=gen)
    return [t.cuda().to(dtype) for t in (q, k, v)]


@pytest.mark.parametrize("case", PV_CASES, ids=lambda c: "-".join(map(str, c[:6])))
@pytest.mark.parametrize("pv_threshold", [-0.625, -3.125])
def test_pv_skip_kernel_equals_the_reference_on_cuda(case, pv_threshold):
    n, q_block, kv_block, merge, schedule, head_dim, dtype, density = case
    q, k, v = integer_inputs(n, 2, head_dim, dtype, seed=n)
    gen = torch.Generator().manual_seed(n + 1)
    mask = (torch.rand(1, 2, -(-n // q_block), -(-n // kv_block), generator=gen) < density).cuda()
    scale = 0.25 if head_dim != 128 else 0.125  # exact in every dtype; thresholds sit between multiples
    work = prepare_sparse(mask, q_block, kv_block, n, merge=merge)
    out, lse = sparse_attention(q, k, v, work, scale=scale, return_lse=True, schedule=schedule,
                                pv_threshold=pv_threshold * scale / 0.25)
    ref_out, ref_lse, ref_skipped = sparse_pv_reference(work, q.float(), k.float(), v.float(),
                                                        pv_threshold * scale / 0.25, scale)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float(), ref_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    counts = sparse_tile_counts(mask, q_block, kv_block, seq_len=n, merge=merge, schedule=schedule,
                                pv_threshold=pv_threshold * scale / 0.25, inputs=(q, k, v), scale=scale)
    assert counts.pv_skipped.reshape(-1).tolist() == ref_skipped.tolist()
    assert counts.pv_skipped.sum() <= int(mask.sum())


def test_pv_skip_compiles_on_cuda():
    q, k, v = integer_inputs(1024, 2, 64, torch.float16, seed=1)
    mask = torch.ones(1, 1, 16, 8, dtype=torch.bool, device="cuda")
    eager = sparse_attention(q, k, v, mask, 64, 128, pv_threshold=-2.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: sparse_attention(q, k, v, mask, 64, 128, pv_threshold=-2.0),
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


def test_predictors_on_cuda_equal_the_cpu_at_video_sizes():
    """Wan 480p's 21 x 30 x 52 tokens, two heads: the masks from CUDA tensors are the CPU's (well-separated
    scores, so float32 order of summation does not flip a block), and the mask cache drives them."""
    gen = torch.Generator().manual_seed(0)
    n, heads, dim, block = 21 * 30 * 52, 2, 128, 128
    num_kv = -(-n // block)
    centres = torch.randn(num_kv, heads, dim, generator=gen)
    k = centres.repeat_interleave(block, 0)[:n][None] + 0.1 * torch.randn(1, n, heads, dim, generator=gen)
    q = 4 * centres[torch.randperm(num_kv, generator=gen)].repeat_interleave(block, 0)[:n][None]
    q = q + 0.1 * torch.randn(1, n, heads, dim, generator=gen)
    calls = {
        "topp": lambda q, k: topp(q, k, 64, 128, 0.9),
        "sparge": lambda q, k: sparge(q, k, 64, 128, cdf=0.9),
        "hierarchical": lambda q, k: hierarchical(q, k, 64, 128, keep=0.05),
    }
    for name, call in calls.items():
        on_gpu = call(q.cuda().half(), k.cuda().half()).cpu()
        on_cpu = call(q.half(), k.half())
        agree = (on_gpu == on_cpu).float().mean().item()
        assert agree > 0.999, (name, agree)
    cache = MaskCache(10)
    masks = [cache.mask("layer", step, lambda b: hierarchical(q.cuda(), k.cuda(), 64, 128, keep=b))
             for step in range(10)]
    assert [r.step for r in cache.refreshes] == [3, 4, 6, 8] and masks[5] is masks[4]
    assert masks[9].is_cuda and masks[9].sum(-1).max().item() == -(-num_kv // 10)  # ceil(0.1 * 256)
