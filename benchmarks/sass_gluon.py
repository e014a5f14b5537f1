"""SASS of the Gluon FP8 kernel (kernels/gluon/forward.py) for sm_90, compiled on any machine, GPU or not,
and the instruction mix of its consumers' loop: what a change to the loop body costs per key block, before
device time is spent on it.

    pip install --target /tmp/t36 triton==3.6.0        # the GPU machine's Triton: Gluon's API moves between releases
    PYTHONPATH=/tmp/t36 python benchmarks/sass_gluon.py OUT_DIR [--head-dim 128] [--lists]

Triton compiles for a target it is told (here Hopper, compute capability 9.0) without a driver: a stand-in
driver names the target, and the kernel is compiled through `warmup` on CPU tensors of the launch's shapes.
Writes OUT_DIR/fp8-gluon-d<head_dim>.{ptx,sass} and prints, per innermost loop of the SASS (the consumers'
key-block loops), its instruction count and mix. The loop counts instructions
as laid out, including the padding mask's 64 selects that a branch skips on every block but the sequence's last.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Hopper:
    """What Triton's JIT asks of a driver to compile, for an sm_90 target with no GPU present."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def compile_kernel(head_dim: int, lists: bool, operand: torch.dtype = torch.float8_e4m3fn):
    """The compiled kernel for 4,096 tokens and 2 heads (shapes do not change the code, only descriptors), on FP8
    operands or, with `operand` bf16 / fp16, the 16-bit variant."""
    driver.set_active(_Hopper())
    from natsim.kernels.gluon import forward as k
    rows, heads = 4096, 2
    q = torch.zeros(1, rows, heads, head_dim, dtype=operand)
    fp8 = operand == torch.float8_e4m3fn
    if fp8:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        v_t = torch.zeros(heads * head_dim, rows, dtype=operand)
        v_desc = TensorDescriptor.from_tensor(v_t, [head_dim, k.BLOCK_N], gl.NVMMASharedLayout.get_default_for(
            [head_dim, k.BLOCK_N], gl.float8e4nv))
    else:
        v_desc = k._descriptor(q, k.BLOCK_N)
    f32 = torch.zeros(rows * heads, dtype=torch.float32)
    i32 = torch.zeros(16, dtype=torch.int32)
    return k._forward_kernel.warmup(
        k._descriptor(q, k.HALF_M), k._descriptor(q, k.BLOCK_N), v_desc,
        f32, f32, f32[:heads * head_dim], torch.zeros(rows * heads * head_dim, dtype=torch.bfloat16), f32, i32, i32,
        i32, i32, heads, rows, rows, 0.1, 0, 0, 0, 0, rows // k.BLOCK_N, grid=(1,),
        **k.kernel_options(head_dim, dense=not lists, return_lse=False, operand=operand))


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """(start, end, opcode counts) of the consumers' key-block loops: conditional branches back by more than
    1 KiB over a block's exponentials, smallest first, each kept where it overlaps no smaller one kept. The
    out-of-line mbarrier retries at the kernel's end jump back into the loops unconditionally and are not
    loops."""
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    at = {address: i for i, (address, _) in enumerate(code)}
    found = []
    for i, (address, text) in enumerate(code):
        branch = re.match(r"@!?P\w+\s+BRA\s.*?(0x[0-9a-f]+)", text)  # a loop closes with a conditional branch
        if branch and address - int(branch.group(1), 16) > 0x400:
            start = int(branch.group(1), 16)
            ops = collections.Counter()
            for _, body in code[at[start]:i + 1]:
                opcode = re.sub(r"^@!?U?P\w+\s+", "", body).split()[0]
                ops[opcode if opcode.startswith("MUFU") else opcode.split(".")[0]] += 1
            if ops["MUFU.EX2"] >= 32:  # a consumer's key-block loop: a block's exponentials
                found.append((start, address, ops))
    kept: list[tuple[int, int, collections.Counter]] = []
    for loop in sorted(found, key=lambda span: span[1] - span[0]):
        if all(loop[1] < other[0] or other[1] < loop[0] for other in kept):
            kept.append(loop)
    return sorted(kept)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lists", action="store_true", help="the block-list variant (default: dense)")
    parser.add_argument("--dtype", choices=("fp8", "bf16", "fp16"), default="fp8",
                        help="operands: FP8 (default), or the 16-bit variant's")
    args = parser.parse_args(argv)
    if triton.__version__ != "3.6.0":
        print(f"note: Triton {triton.__version__}; the GPU machine runs 3.6.0, whose Gluon this kernel is written for")
    args.out.mkdir(parents=True, exist_ok=True)
    operand = dict(fp8=torch.float8_e4m3fn, bf16=torch.bfloat16, fp16=torch.float16)[args.dtype]
    kernel = compile_kernel(args.head_dim, args.lists, operand)
    stem = args.out / f"{args.dtype}-gluon-d{args.head_dim}{'-lists' if args.lists else ''}"
    stem.with_suffix(".ptx").write_text(kernel.asm["ptx"])
    cubin = stem.with_suffix(".cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    stem.with_suffix(".sass").write_text(sass)
    print(f"shared memory {kernel.metadata.shared} bytes; SASS in {stem.with_suffix('.sass')}")
    for start, end, ops in loops(sass):
        print(f"loop {start:#06x}-{end:#06x}: {sum(ops.values())} instructions; "
              + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))


if __name__ == "__main__":
    main()
