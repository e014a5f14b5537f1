"""natsim.masks' predictors (masks/predictors.py) and mask cache (masks/cache.py): FG-Attn's
top-p, SpargeAttn's selective compression + TopCdf, DFSAttn's hierarchical scoring and its Algorithm 1 cache.

The references here are written from the papers' definitions, one block at a time in float64 numpy (pairwise
cosine similarity matrices, per-block means, explicit sums over sub-block pairs); the planted inputs have
their attention in known key blocks; the cache's refresh steps are derived by hand from Algorithm 1 and the
paper's schedule (section 6.1), not from the code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from natsim.masks import MaskCache, hierarchical, sparge, topp

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# -- references and inputs --------------------------------------------------------------------------------------


def blocks_of(x: np.ndarray, block: int) -> list[np.ndarray]:
    """The token blocks `[B, n, H, D]` of `[B, N, H, D]` x (the last one partial)."""
    return [x[:, i:i + block] for i in range(0, x.shape[1], block)]


def pooled(x: torch.Tensor, block: int) -> np.ndarray:
    """float64 `[B, nBlocks, H, D]` block means."""
    return np.stack([b.mean(1) for b in blocks_of(x.double().cpu().numpy(), block)], axis=1)


def softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    top = np.where(finite.any(-1, keepdims=True), np.where(finite, x, -np.inf).max(-1, keepdims=True), 0.0)
    e = np.where(finite, np.exp(x - top), 0.0)
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def pooled_probs(q: torch.Tensor, k: torch.Tensor, q_block: int, kv_block: int, scale: float) -> np.ndarray:
    """float64 `[B, H, nQ, nKV]`: softmax over key blocks of mean-pooled q and k."""
    return softmax(np.einsum("bqhd,bkhd->bhqk", pooled(q, q_block), pooled(k, kv_block)) * scale)


def similarity(x: torch.Tensor, block: int) -> np.ndarray:
    """float64 `[B, H, nBlocks]`: the mean of the block's n x n matrix of token cosine similarities."""
    out = []
    for tokens in blocks_of(x.double().cpu().numpy(), block):  # [B, n, H, D]
        norms = np.linalg.norm(tokens, axis=-1, keepdims=True)
        unit = np.divide(tokens, norms, out=np.zeros_like(tokens), where=norms > 0)
        out.append(np.einsum("bihd,bjhd->bhij", unit, unit).mean((-1, -2)))
    return np.stack(out, axis=-1)


def assert_top_mass(mask: np.ndarray, probs: np.ndarray, p: float, rows: np.ndarray) -> None:
    """On the rows selected by `rows` (bool `[..., nQ]`): the kept probabilities reach `p`, dropping the least
    probable kept block would not, and no dropped block is more probable than a kept one."""
    kept = np.where(mask, probs, 0.0).sum(-1)
    smallest = np.where(mask, probs, np.inf).min(-1)
    dropped = np.where(mask, -np.inf, probs).max(-1)
    assert (kept[rows] >= p - 1e-5).all()
    assert (kept - smallest)[rows].max(initial=-1) < p + 1e-5
    assert (dropped <= smallest + 1e-6)[rows].all()


def planted(n: int, heads: int, dim: int, q_block: int, kv_block: int, per_row: int, strength: float, seed: int):
    """q and k whose attention lives in known key blocks: block-constant keys along orthonormal directions,
    each query block the sum of its planted blocks' directions times `strength`, plus small token noise.
    Returns q, k and the planted bool `[1, heads, nQ, nKV]` mask."""
    gen = torch.Generator().manual_seed(seed)
    num_q, num_kv = -(-n // q_block), -(-n // kv_block)
    assert num_kv <= dim
    plant = torch.zeros(1, heads, num_q, num_kv, dtype=torch.bool)
    q = torch.zeros(1, n, heads, dim)
    k = torch.zeros(1, n, heads, dim)
    for h in range(heads):
        basis = torch.linalg.qr(torch.randn(dim, dim, generator=gen))[0][:num_kv]  # orthonormal rows
        k[0, :, h] = basis.repeat_interleave(kv_block, 0)[:n]
        for i in range(num_q):
            cols = torch.randperm(num_kv, generator=gen)[:per_row]
            plant[0, h, i, cols] = True
            q[0, i * q_block:(i + 1) * q_block, h] = strength * basis[cols].sum(0)
    q += 0.05 * torch.randn(q.shape, generator=gen)
    k += 0.05 * torch.randn(k.shape, generator=gen)
    return q, k, plant


def attention_mass(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_block: int, kv_block: int) -> float:
    """The mean over queries of the exact (float64) attention probability inside the mask's blocks."""
    n, dim = q.shape[1], q.shape[-1]
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * dim ** -0.5, -1)
    tokens = mask.cpu().repeat_interleave(q_block, 2)[:, :, :n].repeat_interleave(kv_block, 3)[..., :n]
    return float((probs * tokens).sum(-1).mean())


def clustered(batch: int, n: int, heads: int, dim: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """Tokens around one random centre per block, the centre weighted 0, 1 or 4 against unit noise: blocks
    from scattered (self-similarity about 1 / n) to alike (near 1)."""
    blocks = -(-n // block)
    centres = torch.randn(batch, blocks, heads, dim, generator=gen)
    weight = torch.tensor([0.0, 1.0, 4.0])[torch.randint(0, 3, (batch, blocks, heads), generator=gen)]
    return (centres * weight[..., None]).repeat_interleave(block, 1)[:, :n] + torch.randn(batch, n, heads, dim,
                                                                                          generator=gen)


def keep_count(keep: float, num_kv: int) -> int:
    """DFSAttn's gamma * M key blocks, rounded up, at least one (written out here, not imported)."""
    count = math.ceil(keep * num_kv - 1e-9)
    return min(num_kv, max(1, count))


# -- planted structure: every predictor finds it ------------------------------------------------------------------


PREDICTORS = {
    "topp": lambda q, k, qb, kb, density: topp(q, k, qb, kb, 0.95),
    "sparge": lambda q, k, qb, kb, density: sparge(q, k, qb, kb, cdf=0.95),
    "hierarchical": lambda q, k, qb, kb, density: hierarchical(q, k, qb, kb, keep=density),
}


@pytest.mark.parametrize("name", sorted(PREDICTORS))
@pytest.mark.parametrize("n, q_block, kv_block", [(512, 16, 16), (500, 32, 16), (1000, 16, 32), (200, 64, 8)])
def test_predictors_recover_planted_blocks(name, n, q_block, kv_block):
    dim, per_row = 64, 3
    q, k, plant = planted(n, 2, dim, q_block, kv_block, per_row, strength=12.0 * dim ** 0.5, seed=n)
    density = per_row / plant.shape[-1]
    mask = PREDICTORS[name](q.to(DEVICE), k.to(DEVICE), q_block, kv_block, density).cpu()
    assert mask.shape == plant.shape and mask.dtype == torch.bool
    assert (mask & plant).sum() / plant.sum() >= 0.95  # block recall
    assert mask.float().mean() <= 1.1 * plant.float().mean()  # at the planted density, not by keeping more
    assert attention_mass(mask, q, k, q_block, kv_block) >= 0.95  # recall of the exact attention mass


@SETTINGS
@given(n=st.integers(16, 256), q_block=st.sampled_from([8, 16, 32]), kv_block=st.sampled_from([4, 8, 16]),
       per_row=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(n=175, q_block=32, kv_block=4, per_row=3, seed=249)  # top-p drops one planted block of little mass
def test_planted_recall_on_random_shapes(n, q_block, kv_block, per_row, seed):
    dim = 64  # one orthonormal direction per key block: n <= 256 keeps 4-token blocks within 64
    q, k, plant = planted(n, 1, dim, q_block, kv_block, min(per_row, -(-n // kv_block)), 12.0 * dim ** 0.5, seed)
    density = plant[0, 0, 0].sum().item() / plant.shape[-1]
    for name, predict in PREDICTORS.items():
        mask = predict(q, k, q_block, kv_block, density)
        # A few planted blocks on a small shape: top-p may drop one that holds under 1 - p of the mass (one of
        # 18 is 0.944 block recall), so a miss must be a block that little of the attention lives in.
        recall = (mask & plant).sum() / plant.sum()
        assert recall >= 0.95 or attention_mass(plant & ~mask, q, k, q_block, kv_block) < 0.05, name
        assert attention_mass(mask, q, k, q_block, kv_block) >= 0.95, name


def test_hierarchical_finds_a_key_block_whose_mean_hides_it():
    """DFSAttn's motivation (section 5.2): a key block holding two opposite kinds of keys pools to ~0, so mean
    pooling (topp) cannot see that the queries attend half of it; its sub-blocks can."""
    gen = torch.Generator().manual_seed(5)
    n, dim, block = 256, 32, 32
    direction = torch.nn.functional.normalize(torch.randn(dim, generator=gen), dim=0)
    k = 0.3 * torch.randn(1, n, 1, dim, generator=gen)
    k[0, 96:112, 0] += 6 * direction  # key block 3: first half +direction, second half -direction
    k[0, 112:128, 0] -= 6 * direction
    q = (6 * direction).expand(1, n, 1, dim) + 0.3 * torch.randn(1, n, 1, dim, generator=gen)
    exact = hierarchical(q, k, block, block, keep=1 / 8, sub_block=16)
    assert exact[0, 0, :, 3].all()
    assert attention_mass(exact, q, k, block, block) >= 0.9
    pooled_mask = topp(q, k, block, block, 0.2)
    assert not pooled_mask[0, 0, :, 3].any()


# -- FG-Attn's top-p against its definition ------------------------------------------------------------------------


@SETTINGS
@given(
    n=st.integers(1, 300),
    q_block=st.sampled_from([8, 16, 32]),
    kv_block=st.sampled_from([1, 4, 16, 64]),
    p=st.floats(0.05, 1.0),
    temperature=st.sampled_from([0.5, 2.0, 8.0]),
    seed=st.integers(0, 2**16),
)
def test_topp_keeps_the_smallest_set_reaching_p(n, q_block, kv_block, p, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    q = temperature * torch.randn(2, n, 2, 16, generator=gen)
    k = torch.randn(2, n, 2, 16, generator=gen)
    mask = topp(q, k, q_block, kv_block, p).numpy()
    probs = pooled_probs(q, k, q_block, kv_block, 16 ** -0.5)
    assert mask.shape == probs.shape and mask.dtype == bool
    kept = np.where(mask, probs, 0.0)
    assert (kept.sum(-1) >= p - 1e-5).all()
    # minimal: without its least probable kept block no row reaches p
    smallest = np.where(mask, probs, np.inf).min(-1)
    assert (kept.sum(-1) - smallest < p + 1e-5).all()
    # the kept blocks are the most probable ones
    dropped_max = np.where(mask, -np.inf, probs).max(-1)
    assert (dropped_max <= smallest + 1e-6).all()


def test_topp_is_monotone_in_p_and_keeps_all_at_one():
    gen = torch.Generator().manual_seed(0)
    q, k = 4 * torch.randn(1, 300, 3, 32, generator=gen), torch.randn(1, 300, 3, 32, generator=gen)
    masks = [topp(q, k, 16, 8, p) for p in (0.1, 0.3, 0.5, 0.8, 0.95, 0.999)]
    for small, large in zip(masks, masks[1:]):
        assert (small <= large).all()
    assert (masks[0].sum(-1) >= 1).all()
    assert topp(q / 4, k, 16, 8, 1.0).all()  # nothing underflows at this temperature


def test_topp_breaks_ties_by_lowest_block():
    q, k = torch.zeros(1, 64, 1, 16), torch.zeros(1, 64, 1, 16)  # every block equally probable (1/4)
    mask = topp(q, k, 16, 16, 0.5)
    assert torch.equal(mask[0, 0], torch.tensor([[True, True, False, False]] * 4))


def test_topp_scale_and_dtypes():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 128, 2, 32, generator=gen), torch.randn(1, 128, 2, 32, generator=gen)
    assert torch.equal(topp(q, k, 16, 16, 0.7, scale=0.5), topp(2 * q, k, 16, 16, 0.7, scale=0.25))
    assert topp(q.half(), k.half(), 16, 16, 0.7).shape == (1, 2, 8, 8)


# -- SpargeAttn against its definition ----------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 200), q_block=st.sampled_from([8, 16, 32]), kv_block=st.sampled_from([1, 4, 16, 64]),
       cdf=st.floats(0.05, 1.0), theta=st.sampled_from([0.1, 0.3, 0.6]), seed=st.integers(0, 2**16))
def test_sparge_follows_its_definition(n, q_block, kv_block, cdf, theta, seed):
    gen = torch.Generator().manual_seed(seed)
    q = clustered(2, n, 2, 16, q_block, gen)
    k = clustered(2, n, 2, 16, kv_block, gen)
    mask = sparge(q, k, q_block, kv_block, cdf=cdf, sim_threshold=theta).numpy()
    sim_q, sim_k = similarity(q, q_block), similarity(k, kv_block)
    assert mask.shape == sim_q.shape + (sim_k.shape[-1],) and mask.dtype == bool
    margin = 1e-4  # blocks this close to the threshold may go either way in float32
    q_scattered, k_scattered = sim_q < theta - margin, sim_k < theta - margin
    assert mask[q_scattered].all()  # a scattered query block attends every key block
    assert np.moveaxis(mask, -1, -2)[k_scattered].all()  # every query block attends a scattered key block
    # On the rest: TopCdf over the softmax of the pooled scores of the alike key blocks only.
    k_alike = sim_k >= theta + margin
    clear = (k_scattered | k_alike).all(-1)  # no key block near the threshold: the softmax's columns are known
    scores = np.einsum("bqhd,bkhd->bhqk", pooled(q, q_block), pooled(k, kv_block)) * 16 ** -0.5
    probs = softmax(np.where(k_alike[:, :, None, :], scores, -np.inf))
    rows = (sim_q >= theta + margin) & clear[..., None] & k_alike.any(-1, keepdims=True)
    assert_top_mass(np.where(k_alike[:, :, None, :], mask, False), probs, cdf, rows)


def test_sparge_keeps_scattered_blocks_whole():
    gen = torch.Generator().manual_seed(3)
    n, dim = 256, 32
    q, k, _ = planted(n, 1, dim, 32, 32, 2, 12.0 * dim ** 0.5, seed=3)
    q[0, 64:96] = torch.randn(32, 1, dim, generator=gen)  # query block 2 scattered
    k[0, 160:192] = torch.randn(32, 1, dim, generator=gen)  # key block 5 scattered
    mask = sparge(q, k, 32, 32, cdf=0.5)
    assert mask[0, 0, 2].all() and mask[0, 0, :, 5].all()
    alike = sparge(q, k, 32, 32, cdf=0.5, sim_threshold=-1.0)  # nothing is scattered at theta = -1
    assert not alike[0, 0, 2].all() and not alike[0, 0, :, 5].all()
    assert (alike <= mask).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sparge_counts_a_block_of_zeros_as_scattered(dtype):
    q, k, _ = planted(128, 1, 32, 16, 16, 1, 12.0 * 32 ** 0.5, seed=2)
    k[0, 32:48] = 0.0  # key block 2 holds only zero vectors: alike to nothing
    from natsim.masks.predictors import self_similarity

    assert self_similarity(k.to(dtype), 16)[0, 0, 2] == 0  # finite: no 0 / 0
    mask = sparge(q.to(dtype), k.to(dtype), 16, 16)
    assert mask[0, 0, :, 2].all()
    assert mask[0, 0].sum() <= 32  # the other blocks are alike: at least half the pairs are dropped


# -- DFSAttn's hierarchical scoring against its definition ----------------------------------------------------------


def hierarchical_scores(q, k, q_block, kv_block, sub_block) -> np.ndarray:
    """float64 `[B, H, nQ, nKV]`: Eq. 11, the sub-block attention summed over each block pair's sub-blocks."""
    q_sub, kv_sub = min(sub_block, q_block), min(sub_block, kv_block)
    attn = softmax(np.einsum("bqhd,bkhd->bhqk", pooled(q, q_sub), pooled(k, kv_sub)) * q.shape[-1] ** -0.5)
    n = q.shape[1]
    num_q, num_kv = -(-n // q_block), -(-n // kv_block)
    scores = np.zeros(attn.shape[:2] + (num_q, num_kv))
    for i in range(attn.shape[2]):  # query sub-block i lies in block i * q_sub // q_block
        for j in range(attn.shape[3]):
            scores[:, :, i * q_sub // q_block, j * kv_sub // kv_block] += attn[:, :, i, j]
    return scores


@SETTINGS
@given(n=st.integers(1, 200), q_block=st.sampled_from([8, 16, 32]), kv_block=st.sampled_from([1, 4, 16, 64]),
       sub_block=st.sampled_from([1, 4, 16]), keep=st.floats(0.01, 1.0), seed=st.integers(0, 2**16))
def test_hierarchical_follows_its_definition(n, q_block, kv_block, sub_block, keep, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = 2 * torch.randn(2, n, 2, 16, generator=gen), torch.randn(2, n, 2, 16, generator=gen)
    mask = hierarchical(q, k, q_block, kv_block, keep=keep, sub_block=sub_block).numpy()
    scores = hierarchical_scores(q, k, q_block, kv_block, sub_block)
    assert mask.shape == scores.shape and mask.dtype == bool
    assert (mask.sum(-1) == keep_count(keep, scores.shape[-1])).all()
    smallest = np.where(mask, scores, np.inf).min(-1)
    dropped = np.where(mask, -np.inf, scores).max(-1)
    assert (dropped <= smallest + 1e-5).all()


def test_hierarchical_chunks_give_the_same_mask(monkeypatch):
    from natsim.masks import predictors

    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(2, 300, 3, 16, generator=gen), torch.randn(2, 300, 3, 16, generator=gen)
    whole = hierarchical(q, k, 16, 32, keep=0.3, sub_block=4)
    monkeypatch.setattr(predictors, "_CHUNK_ELEMENTS", 1)  # one query block per chunk
    assert torch.equal(hierarchical(q, k, 16, 32, keep=0.3, sub_block=4), whole)


def test_hierarchical_ties_go_to_the_lowest_block():
    q, k = torch.zeros(1, 64, 1, 16), torch.zeros(1, 64, 1, 16)
    mask = hierarchical(q, k, 16, 16, keep=0.5)
    assert torch.equal(mask[0, 0], torch.tensor([[True, True, False, False]] * 4))


# -- edge cases --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 16])
def test_one_block_is_always_kept(n):
    gen = torch.Generator().manual_seed(n)
    q, k = torch.randn(1, n, 2, 16, generator=gen), torch.randn(1, n, 2, 16, generator=gen)
    for mask in (topp(q, k, 16, 16, 0.1), sparge(q, k, 16, 16, cdf=0.1), hierarchical(q, k, 16, 16, keep=0.1)):
        assert mask.shape == (1, 2, 1, 1) and mask.all()


def test_keep_one_and_cdf_one_keep_everything():
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 333, 2, 16, generator=gen), torch.randn(1, 333, 2, 16, generator=gen)
    assert hierarchical(q, k, 16, 8, keep=1.0).all()
    assert sparge(q, k, 16, 8, cdf=1.0, sim_threshold=-1.0).all()  # every block alike, no probability is 0
    assert sparge(q, k, 16, 8, cdf=1.0).all()  # every block scattered: kept whole


def test_p_one_keeps_every_block_of_nonzero_probability_however_peaked():
    """A peaked row whose float32 running sum reaches 1 before its smallest nonzero probabilities (here 2e-9,
    then 2e-9 times 1e-5 and so on): p = 1 and cdf = 1 still keep every block whose probability is not 0."""
    q, k = torch.zeros(1, 64, 1, 16), torch.zeros(1, 64, 1, 16)
    q[..., 0] = 1.0
    for block, height in enumerate((80.0, 0.0, -46.0, -92.0)):  # pooled scores 20, 0, -11.5, -23
        k[:, 16 * block:16 * (block + 1), :, 0] = height
    probs = torch.softmax(torch.tensor([20.0, 0.0, -11.5, -23.0]), -1)
    assert (probs > 0).all() and float(torch.cumsum(probs, 0)[0]) == 1.0  # the running sum is 1 after one block
    assert topp(q, k, 16, 16, 1.0).all()
    assert sparge(q, k, 16, 16, cdf=1.0, sim_threshold=-1.0).all()


@pytest.mark.parametrize("shape", [(0, 64, 2, 32), (1, 64, 0, 32), (1, 0, 2, 32)])
def test_empty_batches_heads_and_sequences_give_empty_masks(shape):
    q = k = torch.randn(shape)
    blocks = (-(-shape[1] // 16),) * 2
    for mask in (topp(q, k, 16, 16, 0.9), sparge(q, k, 16, 16), hierarchical(q, k, 16, 16, keep=0.3)):
        assert mask.shape == (shape[0], shape[2], *blocks) and mask.dtype == torch.bool


def test_sparge_and_hierarchical_take_half_precision_and_scale():
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 128, 2, 32, generator=gen), torch.randn(1, 128, 2, 32, generator=gen)
    assert torch.equal(sparge(q, k, 16, 16, cdf=0.7, sim_threshold=0.0, scale=0.5),
                       sparge(2 * q, k, 16, 16, cdf=0.7, sim_threshold=0.0, scale=0.25))
    assert torch.equal(hierarchical(q, k, 16, 16, keep=0.3, scale=0.5), hierarchical(2 * q, k, 16, 16, keep=0.3,
                                                                                     scale=0.25))
    assert sparge(q.half(), k.half(), 16, 16).shape == hierarchical(q.half(), k.half(), 16, 16, keep=0.5).shape


def test_bad_arguments_raise_sentences():
    q = torch.randn(1, 64, 2, 16)
    cases = [
        (lambda: sparge(q, q, 16, 16, cdf=0), ValueError, r"cdf must be a number in \(0, 1\], got cdf=0"),
        (lambda: sparge(q, q, 16, 16, cdf=1.5), ValueError, r"cdf must be a number in \(0, 1\], got cdf=1.5"),
        (lambda: sparge(q, q, 16, 16, sim_threshold=2), ValueError,
         r"sim_threshold must be a cosine similarity in \[-1, 1\], got sim_threshold=2"),
        (lambda: sparge(q, q, 12, 16), ValueError, r"q_block must be a power of two between 8 and 128, got q_block=12"),
        (lambda: sparge(q, q[:, :32], 16, 16), ValueError, r"q and k must be \[batch, tokens, heads, head_dim\]"),
        (lambda: sparge(q, q, 16, 16, scale=-1.0), ValueError, r"scale must be a positive finite number or None"),
        (lambda: hierarchical(q, q, 16, 16, keep=0), ValueError,
         r"keep must be a fraction of key blocks in \(0, 1\], got keep=0"),
        (lambda: hierarchical(q, q, 16, 16, keep=1.2), ValueError, r"keep must be a fraction of key blocks"),
        (lambda: hierarchical(q, q, 16, 16, keep=0.5, sub_block=3), ValueError,
         r"sub_block must be a power of two between 1 and 128, got sub_block=3"),
        (lambda: hierarchical(q, q.numpy(), 16, 16, keep=0.5), TypeError, r"k must be a torch.Tensor, got ndarray"),
        (lambda: hierarchical(q, q.int(), 16, 16, keep=0.5), ValueError, r"q and k must be floating-point tensors"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


# -- MaskCache: Algorithm 1 ---------------------------------------------------------------------------------------


def run(cache: MaskCache, steps, keys=("layer",)):
    """Call the cache at `steps` for every key, each predict returning a fresh mask; returns the masks."""
    masks = []
    for step in steps:
        for key in keys:
            masks.append(cache.mask(key, step, lambda budget: torch.rand(1, 1, 4, 4) < budget))
    return masks


def test_cache_follows_the_papers_schedule_over_50_steps():
    # Section 6.1 / appendix B: dense for the first 25% of 50 steps (steps 0-12, as 12 < 12.5 <= 13), then
    # refresh when t = 0 mod 12 (Delta = 12) and at the first sparse step (13); budget 0.3 from the end of
    # the warm-up, 0.2 from 12.5 + 12.5 = 25, 0.1 from 12.5 + 25 = 37.5 (step 38).
    cache = MaskCache(50)
    masks = run(cache, range(50))
    assert all(m is None for m in masks[:13]) and all(m is not None for m in masks[13:])
    assert [(r.step, r.budget) for r in cache.refreshes] == [(13, 0.3), (24, 0.3), (36, 0.2), (48, 0.1)]
    assert all(masks[s] is masks[13] for s in range(13, 24)) and masks[24] is not masks[23]
    assert all(masks[s] is masks[36] for s in range(36, 48))
    assert [cache.budget(s) for s in (0, 12, 13, 24, 25, 37, 38, 49)] == [1.0, 1.0, 0.3, 0.3, 0.2, 0.2, 0.1, 0.1]


def test_cache_with_ten_steps_and_two_layers():
    # 10 steps: dense while step < 2.5 (0, 1, 2); Delta = 10 // 4 = 2, so refreshes at 3 (first sparse step),
    # 4, 6, 8; phases of 2.5 steps from 2.5: budget 0.3 on [2.5, 5), 0.2 on [5, 7.5), 0.1 on [7.5, 10).
    cache = MaskCache(10)
    run(cache, range(10), keys=("a", "b"))
    assert [(r.key, r.step, r.budget) for r in cache.refreshes] == [
        ("a", 3, 0.3), ("b", 3, 0.3), ("a", 4, 0.3), ("b", 4, 0.3),
        ("a", 6, 0.2), ("b", 6, 0.2), ("a", 8, 0.1), ("b", 8, 0.1),
    ]


def test_cache_reuses_within_a_step_and_refreshes_on_a_new_run():
    cache = MaskCache(8, dense_fraction=0.0, interval=3)  # no warm-up: refresh at 0, 3, 6
    calls = []

    def predict(budget):
        calls.append(budget)
        return torch.ones(1, 1, 2, 2, dtype=torch.bool)

    for step in (0, 0, 1, 2, 3, 3, 4, 7, 1, 2):  # step 1 after 7: a new run
        cache.mask("x", step, predict)
    # 0: first; 0, 1, 2 reuse; 3: 3 = 0 mod 3; 3, 4 reuse; 7: the mask due at 6 (never called) is made at 7,
    # the first call of its interval; 1 after 7: a new run; 2 reuses it.
    assert [r.step for r in cache.refreshes] == [0, 3, 7, 1]
    assert len(calls) == 4
    # budgets: phases of 2 steps from step 0: 0.3, 0.3 | 0.2, 0.2 | 0.1 ... never below min_budget 0.1
    assert [cache.budget(s) for s in range(8)] == [0.3, 0.3, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1]
    cache.reset()
    assert cache.refreshes == [] and cache.mask("x", 5, predict) is not None and len(calls) == 5


def test_cache_bad_arguments_raise_sentences():
    with pytest.raises(ValueError, match=r"num_steps must be a positive int, got num_steps=0"):
        MaskCache(0)
    with pytest.raises(ValueError, match=r"dense_fraction must be a number in \[0, 1\], got dense_fraction=1.5"):
        MaskCache(10, dense_fraction=1.5)
    with pytest.raises(ValueError, match=r"min_budget cannot be larger than initial_budget"):
        MaskCache(10, initial_budget=0.1, min_budget=0.2)
    cache = MaskCache(10)
    with pytest.raises(ValueError, match=r"step must be an int in \[0, num_steps=10\), got step=10"):
        cache.mask(0, 10, lambda b: torch.ones(1, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"predict must return a boolean torch.Tensor block mask, got Tensor of dtype"):
        cache.mask(0, 5, lambda b: torch.ones(1))
