"""Compile natsim's GNA forward kernels for a GPU target offline and report registers, spills and code size.

    PYTHONPATH=/path/to/triton-3.6 python benchmarks/compile_kernels.py --out DIR [--arch 90] [--head-dim 128]

No GPU needed. Each row is one launch that `gna_attention` would make at the HunyuanVideo layout (30x48x80,
window 18x24x24, strides dense / 1x1x1 / 1x8x8 / 16x8x8): natsim's own tiles and KV tiling, on the in-place
path (rank-4 or rank-2 descriptors) and on the permuted path, with and without the LSE, for the static and the
dynamic kernel. The launch's arguments come from `make_call` itself, so the compiled variant is the one a call
runs; scalar arguments are specialised as Triton's launcher does (ints equal to 1 become constants, multiples
of 16 are marked divisible). `triton.compile` lowers each to PTX for `--arch` and the ptxas bundled with Triton
reports registers per thread and spill bytes (benchmarks/compile_backward.py does the same for the backward
kernels). Writes `compile-forward-sm<arch>-d<head_dim>-triton<version>.json`; compare two versions of the
kernels by running it on both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget

from compile_backward import ptxas_report, write_report

import natsim
from natsim.kernels import GnaSpec
from natsim.kernels.common.headdim import STRATEGIES, head_split
from natsim.kernels.gna.launch import dense_as_1d, make_call
from natsim.kernels.gna.tiles import choose_tiles

SHAPE, WINDOW, HEADS = (30, 48, 80), (18, 24, 24), 24
CASES = {"dense": ((1, 1, 1), SHAPE), "1x1x1": ((1, 1, 1), WINDOW), "1x8x8": ((1, 8, 8), WINDOW),
         "16x8x8": ((16, 8, 8), WINDOW)}
ELEMENT = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}


def launches(head_dim: int, strategy: Optional[str] = None):
    """(case, path, kv_tiling, return_lse, GnaCall) for every launch of the table, head_dim in the column chunks
    of `strategy` (kernels/common/headdim.py; None: the width's default)."""
    split = head_split(head_dim, strategy)
    chunks = (("CHUNK_A", split.a), ("CHUNK_B", split.b))
    for case, (stride, window) in CASES.items():
        problem = natsim.Problem(SHAPE, window, stride)
        problem = dense_as_1d(problem) or problem
        for layout in (True, False):
            for mode in ("static", "dynamic"):
                q_tile, kv_tile, _ = choose_tiles(problem, head_dim, (mode,))
                views = (tuple(torch.empty((1, *problem.shape, HEADS, head_dim), device="meta") for _ in range(3))
                         if layout else None)
                for return_lse in (False, True):
                    spec = GnaSpec.for_problem(problem, scale=head_dim**-0.5, q_tile=q_tile, kv_tile=kv_tile,
                                               kv_tiling=mode, return_lse=return_lse)
                    call = make_call(problem, problem.shape, spec, batch=1, heads=HEADS, head_dim=head_dim,
                                     layout_tensors=views, overrides=chunks)
                    yield case, "in-place" if layout else "permuted", mode, return_lse, call


def source(call) -> tuple:
    """The kernel's (signature, constants, attributes) for the launch `call` makes, specialised as Triton's
    launcher would."""
    kernel = call.kernel
    fn = kernel.fn
    tensors = {"Q": torch.bfloat16, "K": torch.bfloat16, "V": torch.bfloat16, "O": torch.bfloat16,
               "LSE": torch.float32 if call.spec.return_lse else torch.bfloat16, "COUNTS": torch.bfloat16}
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = kernel.arguments.get(name, param.default)
        if param.is_constexpr or value is None:  # None: an FP8 scale a bf16 launch leaves out
            signature[name] = "constexpr"
            constants[name] = value
        elif name in tensors:
            signature[name] = ELEMENT[tensors[name]]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and not param.do_not_specialize:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def ptx_instructions(ptx: str) -> int:
    """Instructions in `ptx`: lines that are neither directives, labels, braces nor comments."""
    return sum(1 for line in ptx.splitlines()
               if (text := line.strip()) and not text.startswith((".", "//", "$", "{", "}")) and not text.endswith(":"))


def compile_call(call, arch: int) -> dict:
    signature, constants, attrs = source(call)
    options = dict(call.kernel.options)
    row = {"kernel": call.kernel.fn.__name__, "q_tile": list(call.spec.q_tile), "kv_tile": list(call.spec.kv_tile),
           **{name: constants[name] for name in ("MASKED", "USE_TMA", "WARP_SPECIALIZE", "LAYOUT", "CHUNK_A",
                                                 "CHUNK_B")
              if name in constants}, **options}
    try:
        compiled = triton.compile(triton.compiler.ASTSource(call.kernel.fn, signature, constants, attrs),
                                  target=GPUTarget("cuda", arch, 128), options=options)
        ptx = compiled.asm["ptx"]
        row.update(shared_bytes=compiled.metadata.shared, ptx_instructions=ptx_instructions(ptx),
                   **ptxas_report(ptx, arch))
    except Exception as error:  # reported, so that a variant that fails shows up in the table
        row["error"] = f"{type(error).__name__}: {error}"[:400]
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim of the compiled kernels")
    parser.add_argument("--strategy", choices=STRATEGIES, default=None,
                        help="how a head_dim that is not a power of two runs (kernels/common/headdim.py; default: "
                             "the width's own)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case, path, mode, return_lse, call in launches(args.head_dim, args.strategy):
        row = {"case": case, "path": path, "kv_tiling": mode, "return_lse": return_lse, "head_dim": args.head_dim,
               **compile_call(call, args.arch)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_report(args.out, "forward", args.arch, args.head_dim, rows)


if __name__ == "__main__":
    main()
