"""One backward pass of a benchmark case, to run under Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "profiled/" --kernel-name regex:"dkdv|tem" --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python benchmarks/profile_backward.py ours-16x8x8

GNA cases (`ours-S`, `flex-S`): HunyuanVideo 30x48x80, window 18x24x24, head_dim 128, bf16, batch 1, `--heads`
heads (default 8: a third of benchmarks/backward.py's 24, so that each of ncu's replays is short). `ours-*` runs
`gna_attention`'s backward (natsim::gna_backward: the dK/dV kernel is the one named `dkdv_kernel`); `flex-*` runs
FlexAttention's backward under the same element mask on permuted tokens (benchmarks/backward.py's setup; its fused
kernel's name starts with `triton_tem`). The backward runs twice (the first compiles); the second runs inside the
NVTX range "profiled", to which the command above restricts ncu (on this thread: autograd's device threads are
turned off for the script).

Block-mask cases (`sparse-ours-P`, `sparse-flex-P`, P the sparsity in percent): benchmarks/training.py's random
128x128 block mask over N = 32,768 tokens, `--heads` heads; ours is `sparse_attention` on the mask prepared once
(`prepare_sparse`: its backward is one kernel, `sparse_backward_kernel`), Flex its compiled `flex_attention` with
the BlockMask of the same blocks, every one full (its backward's kernel name starts with `triton_tem`). Profile
them with `--kernel-name regex:"sparse_backward|tem" --launch-count 1`.
"""

from __future__ import annotations

import argparse
import json

import torch

import natsim

SHAPE, WINDOW, HEAD_DIM, DTYPE = (30, 48, 80), (18, 24, 24), 128, torch.bfloat16
STRIDES = {"dense": None, "1x1x1": (1, 1, 1), "1x8x8": (1, 8, 8), "16x8x8": (16, 8, 8)}


def _sparse_backward(name: str, heads: int):
    """A function that runs one backward pass of block-mask case `name` (sparse-ours-P or sparse-flex-P)."""
    _, kind, percent = name.split("-", 2)
    if kind not in ("ours", "flex") or not percent.isdigit() or not 0 <= int(percent) < 100:
        raise SystemExit(f"block-mask cases are sparse-ours-P or sparse-flex-P with P in 0..99; got {name!r}.")
    from training import Flex, MaskCase, random_mask

    tokens, block = 32768, 128
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, tokens, heads, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = random_mask(tokens, heads, block, int(percent) / 100, seed=0).cuda()
    if kind == "ours":
        from natsim.kernels import prepare_sparse, sparse_attention

        out = sparse_attention(q, k, v, prepare_sparse(mask, block, block, tokens))
    else:
        flex = Flex(q.device)
        case = MaskCase(name, "random", mask, block)
        out = flex.attend(q, k, v, flex.block_mask(case, tokens, heads))
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def _backward(name: str, heads: int):
    """(run, (inputs...)): a function that runs one backward pass of case `name`."""
    if name.startswith("sparse-"):
        return _sparse_backward(name, heads)
    kind, _, stride_name = name.partition("-")
    if kind not in ("ours", "flex") or stride_name not in STRIDES:
        raise SystemExit(f"cases are ours-S or flex-S with S in {', '.join(STRIDES)}; got {name!r}.")
    stride = STRIDES[stride_name]
    window, stride = (SHAPE, (1, 1, 1)) if stride is None else (WINDOW, stride)
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, *SHAPE, heads, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(4))
    if kind == "ours":
        from natsim.kernels import gna_attention

        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = gna_attention(q, k, v, window=window, stride=stride)
        return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    from backward import FLEX_TILE
    from gna import flex_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    from natsim.kernels import permute

    fq, fk, fv, fg = (permute(t, FLEX_TILE).transpose(1, 2).contiguous() for t in (q, k, v, g))
    block_mask = flex_block_mask(natsim.Problem(SHAPE, window, stride), FLEX_TILE, fq.shape[2])
    fq, fk, fv = (t.requires_grad_() for t in (fq, fk, fv))
    out = torch.compile(flex_attention, dynamic=False)(fq, fk, fv, block_mask=block_mask)
    return lambda: torch.autograd.grad(out, (fq, fk, fv), fg, retain_graph=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="ours-S or flex-S, S one of dense, 1x1x1, 1x8x8, 16x8x8; or sparse-ours-P "
                                     "or sparse-flex-P, P the random block mask's sparsity in percent")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--options", type=json.loads, default=None,
                        help='ours: the backward variant\'s options as JSON, e.g. \'{"ATOMIC_DQ": false}\' '
                             "(default: natsim's DEFAULT_VARIANT)")
    args = parser.parse_args(argv)
    if args.options is not None:
        from natsim.kernels import gna_backward

        gna_backward.DEFAULT_VARIANT.clear()
        gna_backward.DEFAULT_VARIANT.update(args.options)
    run = _backward(args.case, args.heads)
    # Autograd runs a CUDA backward on its own device thread, outside this thread's NVTX range: keep it here.
    with torch.autograd.set_multithreading_enabled(False):
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profiled")
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
