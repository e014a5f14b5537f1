"""One attention call of a benchmark case, to run under Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "profiled/" --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python benchmarks/profile_gna.py hunyuan-16x8x8

The script makes the call twice (the first compiles) with the inputs of benchmarks/gna.py (batch 1, 24 heads,
head_dim 128 unless `--head-dim` says otherwise, bf16); the second call runs inside the NVTX range "profiled",
which the command above restricts ncu to. Cases named `permuted-*` run the kernel alone on permuted tokens
(`gna_attention_permuted`, the warp-specialized loop where every tile is full); the others run `gna_attention` as a
model calls it (the token layout read in place; dense attention over the flattened sequence); `cudnn-*` run SDPA's
cuDNN backend on the same tensors; `sparse-*` run `sparse_attention` on a random 128x128 block mask of the given
density. `--precision fp8` runs the FP8 kernels (`gna_attention` and `sparse_attention` with `precision="fp8"`; the
call then launches the quantization kernel first, so restrict ncu to the attention kernel with `--kernel-name
regex:forward`). `--list` prints the case names.
"""

from __future__ import annotations

import argparse

import torch

import natsim
from natsim.kernels import gna_attention, gna_attention_permuted, permute

# name: (shape, window, stride, tile (Q = KV) or None for the default tiles)
CASES = {
    "hunyuan-dense": ((30, 48, 80), (30, 48, 80), (1, 1, 1), None),
    "hunyuan-16x8x8": ((30, 48, 80), (18, 24, 24), (16, 8, 8), (2, 8, 8)),
    "permuted-hunyuan-dense": ((30, 48, 80), (30, 48, 80), (1, 1, 1), (2, 8, 8)),
    "permuted-hunyuan-1x1x1": ((30, 48, 80), (18, 24, 24), (1, 1, 1), (2, 8, 8)),
    "permuted-hunyuan-16x8x8": ((30, 48, 80), (18, 24, 24), (16, 8, 8), (2, 8, 8)),
    "permuted-1d-dense": ((32768,), (32768,), (1,), (128,)),
    "permuted-1d-256": ((32768,), (2048,), (256,), (128,)),
    "cudnn-hunyuan-dense": ((30, 48, 80), (30, 48, 80), (1, 1, 1), None),
    "dense-8k": ((8192,), (8192,), (1,), None),
    "wan720-plan": ((21, 45, 80), (10, 23, 32), (1, 8, 16), (1, 8, 16)),
}
KV_TILING = {"wan720-plan": "dynamic"}  # cases whose plan tiles keys dynamically
# name: (tokens, density of a random 128x128 block mask): the sparse kernel on Wan 480p (21x30x52 tokens)
SPARSE_CASES = {"sparse-all-480p": (32760, 1.0), "sparse-random70-480p": (32760, 0.3)}
HEADS, DTYPE = 24, torch.bfloat16


def _call(name: str, precision=None, head_dim: int = 128):
    """The call to profile, on fresh random inputs (`precision`: None or "fp8") of `head_dim` channels."""
    torch.manual_seed(0)
    if name in SPARSE_CASES:
        from natsim.kernels import prepare_sparse, sparse_attention

        tokens, density = SPARSE_CASES[name]
        q, k, v = (torch.randn(1, tokens, HEADS, head_dim, device="cuda", dtype=DTYPE) for _ in range(3))
        blocks = -(-tokens // 128)
        work = prepare_sparse(torch.rand(1, HEADS, blocks, blocks, device="cuda") < density, 128, 128, tokens)
        return lambda: sparse_attention(q, k, v, work, precision=precision)
    shape, window, stride, tile = CASES[name]
    q, k, v = (torch.randn(1, *shape, HEADS, head_dim, device="cuda", dtype=DTYPE) for _ in range(3))
    if name.startswith("cudnn-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = (t.reshape(1, -1, HEADS, head_dim).transpose(1, 2) for t in (q, k, v))

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)

        return run
    if name.startswith("permuted-"):
        problem = natsim.Problem(shape, window, stride)
        qp, kp, vp = (permute(t, tile) for t in (q, k, v))
        return lambda: gna_attention_permuted(qp, kp, vp, problem, tile, tile)
    tiles = {} if tile is None else {"q_tile": tile, "kv_tile": tile}
    if name in KV_TILING:
        tiles["kv_tiling"] = KV_TILING[name]
    return lambda: gna_attention(q, k, v, window, stride, precision=precision, **tiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", choices=sorted({**CASES, **SPARSE_CASES}), help="the case to run")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--precision", choices=["fp8"], default=None, help="run the FP8 kernels")
    parser.add_argument("--head-dim", type=int, default=128,
                        help="channels per head (widths that are not powers of two run in column chunks)")
    args = parser.parse_args()
    if args.list or args.case is None:
        print("\n".join(sorted({**CASES, **SPARSE_CASES})))
        return
    if args.precision and args.case.startswith(("permuted-", "cudnn-")):
        parser.error(f"--precision fp8 runs through gna_attention or sparse_attention, not case {args.case}")
    run = _call(args.case, args.precision, args.head_dim)
    run()
    torch.cuda.synchronize()
    with torch.cuda.nvtx.range("profiled"):
        run()
    torch.cuda.synchronize()
    print(f"{args.case} at head_dim {args.head_dim}: profiled one call")


if __name__ == "__main__":
    main()
