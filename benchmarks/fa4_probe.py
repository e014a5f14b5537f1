"""FlashAttention-4 through natsim's kernels/fa4 pieces (the simulator's lists, the GNA mask_mod) on the GPU, beside
natsim's references and kernels: correctness (forward, backward, CUDA graph replay) and first timings (GNA
block-sparse and through the mask, dense, random block masks).

    python benchmarks/fa4_probe.py OUT_DIR            # every section; SECTIONS=env,dense_32768 picks some

Each section is guarded (a failure is recorded, the rest run) and the results go to OUT_DIR/probe.json as they
come. Results: benchmarks/results/fa4-probe-*.json.
"""
import json
import os
import sys
import time
import traceback

import torch
import triton
from triton.testing import do_bench

OUT = sys.argv[1]
results = {}
def section(name):
    def wrap(fn):
        if os.environ.get('SECTIONS') and name not in os.environ['SECTIONS'].split(','):
            return
        t0 = time.time()
        try:
            results[name] = fn()
            print(f"[{name}] ok in {time.time()-t0:.1f}s: {results[name]}", flush=True)
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(f"[{name}] FAILED: {traceback.format_exc()[-3000:]}", flush=True)
        json.dump(results, open(os.path.join(OUT, "probe.json"), "w"), indent=1, default=str)
    return wrap

from natsim import Problem
from natsim.kernels import reference_attention, gna_attention
from natsim.kernels.gna.permute import permute, unpermute
from natsim.kernels.fa4 import library, run
from natsim.kernels.fa4.lists import gna_lists, lists_from_blocks
from natsim.kernels.fa4.gna_mask import GnaMask
from natsim.kernels.fa4.mask_mod import gna_mask_mod

def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())

@section("env")
def _():
    import importlib.metadata as md
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                fa4=library.installed() or md.version("flash-attn-4"))

def fa4_gna(q, k, v, problem, qt, kt, scale=None, return_lse=False, lists=None):
    lists = lists or gna_lists(problem, qt, kt, q.device)
    mm = gna_mask_mod(GnaMask(problem, qt, kt)) if lists.masked else None
    qp, kp, vp = permute(q, qt, problem.dilation), permute(k, kt, problem.dilation), permute(v, kt, problem.dilation)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = run.forward(qp, kp, vp, scale, lists, mm, return_lse)
    return unpermute(out, problem.shape, qt, problem.dilation), lse

CASES = [  # shape, window, stride, dilation, causal, q_tile, kv_tile, head_dim
    ((6, 10, 12), (3, 5, 7), (1, 1, 1), (1, 1, 1), (False,)*3, (1, 8, 8), (1, 8, 8), 128),
    ((6, 10, 12), (3, 5, 7), (3, 5, 7), (1, 1, 1), (False,)*3, (2, 4, 8), (1, 4, 8), 64),
    ((8, 16, 16), (4, 8, 8), (4, 8, 8), (1, 1, 1), (False,)*3, (2, 8, 8), (2, 8, 8), 128),
    ((5, 9, 14), (3, 4, 5), (2, 1, 3), (1, 2, 1), (True, False, False), (2, 4, 8), (2, 4, 8), 64),
    ((40, 36), (9, 12), (1, 4), (1, 1), (False, True), (8, 16), (8, 16), 96),
    ((1000,), (301,), (1,), (1,), (True,), (128,), (64,), 128),
]

@section("gna_forward_correctness")
def _():
    rows = []
    for shape, w, s, d, c, qt, kt, hd in CASES:
        p = Problem(shape, w, s, d, c)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, *shape, 3, hd, device="cuda", generator=g).bfloat16() for _ in range(3))
        out, lse = fa4_gna(q, k, v, p, qt, kt, return_lse=True)
        ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), w, s, d, c, return_lse=True)
        lse_u = unpermute(lse.contiguous()[..., None].float(), shape, qt, d)[..., 0] if lse is not None else None
        rows.append(dict(case=str(p), masked=gna_lists(p, qt, kt, q.device).masked, err=rel(out, ref),
                         lse_err=None if lse_u is None else float((lse_u.double() - ref_lse).abs().max())))
    return rows

@section("gna_backward_correctness")
def _():
    rows = []
    for shape, w, s, d, c, qt, kt, hd in [((8, 16, 16), (4, 8, 8), (4, 8, 8), (1,)*3, (False,)*3, (2, 8, 8), (2, 8, 8), 128),
                                         ((6, 16, 16), (3, 5, 7), (1, 1, 1), (1,)*3, (False,)*3, (2, 8, 8), (2, 8, 8), 128),
                                         ((6, 16, 16), (3, 5, 7), (1, 2, 1), (1,)*3, (True, False, False), (2, 8, 8), (2, 8, 8), 64)]:
        p = Problem(shape, w, s, d, c)
        lists = gna_lists(p, qt, kt, torch.device("cuda"))
        mm = gna_mask_mod(GnaMask(p, qt, kt)) if lists.masked else None
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v, do = (torch.randn(1, *shape, 2, hd, device="cuda", generator=g).bfloat16() for _ in range(4))
        qp, kp, vp = (permute(x, t, d) for x, t in ((q, qt), (k, kt), (v, kt)))
        dop = permute(do, qt, d)
        scale = hd ** -0.5
        outp, lse = run.forward(qp, kp, vp, scale, lists, mm, True)
        dq, dk, dv = run.backward(qp, kp, vp, outp, dop, lse, None, scale, lists, mm)
        dq, dk, dv = unpermute(dq, shape, qt, d), unpermute(dk, shape, kt, d), unpermute(dv, shape, kt, d)
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ref = reference_attention(qr, kr, vr, w, s, d, c)
        ref.backward(do.double())
        rows.append(dict(case=str(p), masked=lists.masked, dq=rel(dq, qr.grad), dk=rel(dk, kr.grad), dv=rel(dv, vr.grad)))
    return rows

def bench(fn, n=3):
    return [round(do_bench(fn, warmup=50, rep=300, return_mode="median"), 3) for _ in range(n)]

@section("hunyuan_16x8x8")
def _():
    shape, heads = (30, 48, 80), 24
    p = Problem(shape, (18, 24, 24), (16, 8, 8))
    qt, kt = (4, 8, 8), (2, 8, 8)
    q, k, v = (torch.randn(1, *shape, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lists = gna_lists(p, qt, kt, q.device)
    qp, kp, vp = permute(q, qt), permute(k, kt), permute(v, kt)
    scale = 128 ** -0.5
    kernel = lambda: run.forward(qp, kp, vp, scale, lists, None, False)
    whole = lambda: fa4_gna(q, k, v, p, qt, kt)
    natsim = lambda: gna_attention(q, k, v, (18, 24, 24), (16, 8, 8), q_tile=qt, kv_tile=kt)
    perm = lambda: (permute(q, qt), permute(k, kt), permute(v, kt), unpermute(qp, shape, qt, 1))
    err = rel(whole()[0], natsim())
    return dict(masked=lists.masked, visited=lists.visited, err_vs_natsim=err, fa4_kernel=bench(kernel), fa4_with_permute=bench(whole),
                natsim=bench(natsim), permute_4=bench(perm))

@section("hunyuan_1x1x1_maskmod")
def _():
    shape, heads = (30, 48, 80), 24
    p = Problem(shape, (18, 24, 24), (1, 1, 1))
    out = {}
    q, k, v = (torch.randn(1, *shape, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for qt, kt in (((4, 8, 8), (2, 8, 8)), ((2, 8, 8), (2, 8, 8))):
        lists = gna_lists(p, qt, kt, q.device)
        mm = gna_mask_mod(GnaMask(p, qt, kt))
        qp, kp, vp = permute(q, qt), permute(k, kt), permute(v, kt)
        t0 = time.time(); run.forward(qp, kp, vp, 128**-0.5, lists, mm, False); torch.cuda.synchronize()
        compile_s = time.time() - t0
        kernel = lambda: run.forward(qp, kp, vp, 128 ** -0.5, lists, mm, False)
        out[str((qt, kt))] = dict(compile_s=compile_s, visited=lists.visited, fa4=bench(kernel, 2))
    natsim = lambda: gna_attention(q, k, v, (18, 24, 24), 1)
    out["natsim"] = bench(natsim, 2)
    return out

@section("dense_32768")
def _():
    q, k, v = (torch.randn(1, 32768, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    from torch.nn.attention import sdpa_kernel, SDPBackend
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
    fa4 = lambda: run.forward(q, k, v, 128 ** -0.5, None, None, False)
    nat = lambda: gna_attention(q, k, v, 32768)
    err = rel(fa4()[0], nat())
    return dict(err=err, fa4=bench(fa4), natsim=bench(nat), cudnn=bench(cudnn))

@section("random_masks")
def _():
    from natsim.kernels import prepare_sparse, sparse_attention
    n, heads = 32768, 24
    rows = []
    for density in (0.3, 0.1):
        g = torch.Generator(device="cuda").manual_seed(2)
        mask = torch.rand(1, heads, n // 128, n // 128, device="cuda", generator=g) < density
        mask[..., torch.arange(n // 128), torch.arange(n // 128)] = True
        q, k, v = (torch.randn(1, n, heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        lists = lists_from_blocks(mask, mask, 128, 128)
        work = prepare_sparse(mask, 128, 128, n)
        fa4 = lambda: run.forward(q.detach(), k.detach(), v.detach(), 128 ** -0.5, lists, None, False)
        nat = lambda: sparse_attention(q.detach(), k.detach(), v.detach(), work)
        err = rel(fa4()[0], nat())
        outp, lse = run.forward(q.detach(), k.detach(), v.detach(), 128 ** -0.5, lists, None, True)
        do = torch.randn_like(outp)
        def fa4_fb():
            o, l = run.forward(q.detach(), k.detach(), v.detach(), 128 ** -0.5, lists, None, True)
            return run.backward(q.detach(), k.detach(), v.detach(), o, do, l, None, 128 ** -0.5, lists, None)
        def nat_fb():
            o = sparse_attention(q, k, v, work)
            o.backward(do)
        # gradient check vs natsim
        dq, dk, dv = fa4_fb()
        q.grad = k.grad = v.grad = None
        nat_fb()
        gerr = [rel(dq, q.grad), rel(dk, k.grad), rel(dv, v.grad)]
        rows.append(dict(sparsity=1 - float(mask.float().mean()), err=err, grad_err=gerr, fa4=bench(fa4, 2), natsim=bench(nat, 2),
                         fa4_fb=bench(fa4_fb, 2), natsim_fb=bench(nat_fb, 2)))
    return rows

@section("cuda_graph_capture")
def _():
    shape = (8, 16, 16); p = Problem(shape, (4, 8, 8), (1, 1, 1)); qt = kt = (2, 8, 8)
    q, k, v = (torch.randn(1, *shape, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = fa4_gna(q, k, v, p, qt, kt)[0]
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fa4_gna(q, k, v, p, qt, kt)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa4_gna(q, k, v, p, qt, kt)[0]
    q.copy_(torch.randn_like(q)); graph.replay(); torch.cuda.synchronize()
    return dict(replay_err=rel(out, fa4_gna(q, k, v, p, qt, kt)[0]), changed=rel(out, ref))

print(json.dumps({k: (v if not isinstance(v, dict) or "error" not in v else v["error"]) for k, v in results.items()}, indent=1, default=str))
