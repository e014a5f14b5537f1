"""One GNA kernel launch of a benchmark case, to run under Nsight Compute.

    ncu --clock-control none --kernel-name regex:gna_forward --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python benchmarks/profile_gna.py 1d-256

The script calls the kernel twice on permuted tokens (the first call compiles; ncu skips it) with the
inputs of benchmarks/gna.py (batch 1, 24 heads, head_dim 128, bf16), so the profiled launch is the one
that benchmark times. `--list` prints the case names.
"""

from __future__ import annotations

import argparse

import torch

import natsim
from natsim.kernels import gna_attention_permuted, permute

# name: (shape, window, stride, tile (Q = KV))
CASES = {
    "hunyuan-dense": ((30, 48, 80), (30, 48, 80), (1, 1, 1), (2, 8, 8)),
    "hunyuan-1x1x1": ((30, 48, 80), (18, 24, 24), (1, 1, 1), (2, 8, 8)),
    "hunyuan-16x8x8": ((30, 48, 80), (18, 24, 24), (16, 8, 8), (2, 8, 8)),
    "1d-dense": ((32768,), (32768,), (1,), (128,)),
    "1d-256": ((32768,), (2048,), (256,), (128,)),
}
HEADS, HEAD_DIM, DTYPE = 24, 128, torch.bfloat16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", choices=sorted(CASES), help="the case to launch")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args()
    if args.list or args.case is None:
        print("\n".join(sorted(CASES)))
        return
    shape, window, stride, tile = CASES[args.case]
    problem = natsim.Problem(shape, window, stride)
    torch.manual_seed(0)
    q, k, v = (
        permute(torch.randn(1, *shape, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE), tile) for _ in range(3)
    )
    for _ in range(2):
        gna_attention_permuted(q, k, v, problem, tile, tile)
    torch.cuda.synchronize()
    sim = natsim.simulate(problem, natsim.TileConfig(tile, tile))
    print(f"{args.case}: {sim.visited_tiles} visited KV tiles over {sim.num_q_tiles} Q tiles per head")


if __name__ == "__main__":
    main()
