"""One GNA call of the 6x13x86 random layout (48 heads, head_dim 128, bf16), for Nsight Compute: the planner's pick
(window 2x5x32, stride 2x2x32, Q tile 2x2x32, KV tile 2x1x32, dynamic KV tiling), which runs 29% slower than the
cost model predicts, or the static kernel on the same tiles; then the mean of 100 calls.

    ncu --clock-control none --nvtx --nvtx-include "profiled/" --kernel-name regex:gna --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python benchmarks/profile_small_layout.py dynamic
"""
import sys

import torch

from natsim.kernels import gna_attention

mode = sys.argv[1] if len(sys.argv) > 1 else "dynamic"
torch.manual_seed(0)
q, k, v = (torch.randn(1, 6, 13, 86, 48, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
run = lambda: gna_attention(q, k, v, (2, 5, 32), (2, 2, 32), q_tile=(2, 2, 32), kv_tile=(2, 1, 32), kv_tiling=mode)  # noqa: E731
run()
torch.cuda.synchronize()
with torch.cuda.nvtx.range("profiled"):
    run()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(100):
    run()
end.record()
torch.cuda.synchronize()
print(mode, "per call ms", start.elapsed_time(end) / 100)
