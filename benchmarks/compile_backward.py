"""Compile the GNA backward kernels for a GPU target offline and report registers and spills per variant.

    PYTHONPATH=/path/to/triton-3.6 python benchmarks/compile_backward.py --out DIR [--arch 90] [--head-dim 64]
        [--sparse]

No GPU needed: `triton.compile` lowers each variant of benchmarks/backward.py's tune sweep (Q-tile halvings x
ATOMIC_DQ x IN_TILE x USE_TMA x num_stages) for each problem of its table (HunyuanVideo dense, 1x1x1, 1x8x8, 16x8x8: the
backward's own tiles, mask and padding switches for each; the dQ kernel on its mirrored tiles) to PTX for
`--arch`, and the ptxas bundled with Triton assembles it with `-v`, whose report gives registers per thread and
spill stores/loads (what a run on the card would read from the loaded kernel's `n_regs` / `n_spills`). A
variant that fails to compile is reported with its error, so that the sweep can drop it before it costs device
time. Writes `compile-backward-sm<arch>-d<head_dim>-triton<version>.json`. With `--sparse`, the sparse
backward's kernel instead (its dK/dV and dQ programs in one launch; `SPARSE_VARIANTS`: 128-, 64- and 16-token
blocks at their default tiles, three stages, the earlier 128-token programs, 32-query steps; descriptor loads on
and off), into
`compile-sparse-backward-sm<arch>-...json`."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget

from backward import CASES, SHAPE, TUNE

import natsim
from natsim.kernels.common.backward import launch_options
from natsim.kernels.common.headdim import STRATEGIES, head_split
from natsim.kernels.gna.backward import (DEFAULT_VARIANT, backward_tiles, dkdv_kernel, dq_kernel, padded,
                                         uses_descriptors)
from natsim.kernels.gna.launch import dense_as_1d, needs_mask

INTS = ("tokens", "heads", "L0", "L1", "L2", "W0", "W1", "W2", "S0", "S1", "S2", "D0", "D1", "D2",
        "NQ0", "NQ1", "NQ2", "NK0", "NK1", "NK2", "STEPS0", "STEPS1", "STEPS2",
        "seq_len", "num_q_blocks", "num_kv_blocks", "num_q_tiles", "num_kv_tiles", "mask_b_step", "mask_h_step",
        "mask_heads", "dkdv_q_tiles", "dkdv_kv_tiles", "dq_q_tiles", "dq_kv_tiles")
FLOATS = ("qk_scale", "scale")
# Pointer arguments: bf16 tensors, fp32 statistics; DQ is fp32 under ATOMIC_DQ; COUNTS gets DELTA without DEBUG.
BF16 = ("Q", "K", "V", "DO", "DK", "DV")
FP32 = ("LSE", "DELTA", "COUNTS")
U8 = ("MASK",)  # the sparse kernels' boolean block mask, read as bytes
I32 = ("COL_COUNT", "COL_FULL", "COL_INDEX", "ROW_COUNT", "ROW_FULL", "ROW_INDEX")  # their tile lists
SWITCHES = ("ATOMIC_DQ", "IN_TILE", "USE_TMA")


def signature(fn, constexprs: dict, atomic: bool) -> tuple[dict, dict]:
    """(signature, attrs) of `fn`: every argument typed, pointers 16-byte aligned as torch's allocations are."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in BF16 or (name == "DQ" and not atomic):
            sig[name] = "*bf16"
        elif name in FP32 or name == "DQ":
            sig[name] = "*fp32"
        elif name in U8:
            sig[name] = "*u8"
        elif name in I32:
            sig[name] = "*i32"
        elif name in INTS:
            sig[name] = "i32"
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            raise ValueError(f"argument {name!r} of {fn.__name__} has no type here; add it to this script.")
        if sig[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def ptxas_report(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and shared memory from `ptxas -v` on `ptx` (the ptxas bundled with Triton)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", str(source), "-o", str(Path(folder) / "k.o")],
                              capture_output=True, text=True)
    text = done.stdout + done.stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else None  # noqa: E731
    return {"ptxas_rc": done.returncode, "registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"), "spill_loads": number(r"(\d+) bytes spill loads"),
            "stack_frame": number(r"(\d+) bytes stack frame")}


def write_report(out: Path, kind: str, arch: int, head_dim: int, rows: list[dict]) -> None:
    """`compile-<kind>-sm<arch>-d<head_dim>-triton<version>.json` in `out`, and a line counting failures and
    variants that spill."""
    record = {"triton": triton.__version__, "arch": arch, "head_dim": head_dim, "rows": rows}
    name = f"compile-{kind}-sm{arch}-d{head_dim}-triton{triton.__version__}.json"
    (out / name).write_text(json.dumps(record, indent=1))
    failed = sum("error" in r or r.get("ptxas_rc") for r in rows)
    spilling = sum(bool(r.get("spill_stores")) for r in rows)
    print(f"{len(rows)} {kind} kernel variants for sm_{arch}: {failed} failed to compile, {spilling} spill registers.")


def compile_variant(fn, q_tile, kv_tile, options: dict, masked: bool, pad: bool, arch: int,
                    head_dim: int = 128, strategy: Optional[str] = None) -> dict:
    split = head_split(head_dim, strategy)
    options = {**launch_options(math.prod(q_tile), math.prod(kv_tile), split).triton_options(), **options}
    dq_stages = options.pop("DQ_STAGES", None)
    if fn is dq_kernel and dq_stages is not None:
        options["num_stages"] = dq_stages
    # the kernels' tuning constexprs, DEFAULT_VARIANT's where the variant is silent; descriptors as the launcher
    # allows them (`uses_descriptors`: unmasked kernels only)
    switches = {name: int(options.pop(name, DEFAULT_VARIANT.get(name, False))) for name in SWITCHES}
    switches["USE_TMA"] = int(uses_descriptors(bool(switches["USE_TMA"]), masked))
    atomic = switches["ATOMIC_DQ"]
    tq, tk = (tuple(t) + (1,) * (3 - len(t)) for t in (q_tile, kv_tile))
    constexprs = dict(C0=False, C1=False, C2=False, TQ0=tq[0], TQ1=tq[1], TQ2=tq[2], TK0=tk[0], TK1=tk[1],
                      TK2=tk[2], **split.constexprs(), MASKED=masked, PADDED=pad,
                      IN_TILE=bool(switches["IN_TILE"]), USE_TMA=bool(switches["USE_TMA"]))
    if fn is dkdv_kernel:
        constexprs.update(DEBUG=False, ATOMIC_DQ=atomic)
    launch = {"num_warps": options["num_warps"], "num_stages": options["num_stages"]}
    row = {"kernel": fn.__name__, "q_tile": list(q_tile), "kv_tile": list(kv_tile), "masked": masked,
           "padded": pad, "chunks": [split.a, split.b], **switches, **launch}
    return {**row, **compile_report(fn, constexprs, atomic, launch, arch)}


def compile_report(fn, constexprs: dict, atomic: bool, launch: dict, arch: int) -> dict:
    """`fn` compiled for `arch` with `constexprs` and the launch options: shared memory and ptxas's register
    report, or the error (reported, so that a sweep drops the variant before it costs device time)."""
    sig, attrs = signature(fn, constexprs, atomic)
    try:
        compiled = triton.compile(triton.compiler.ASTSource(fn, sig, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 128), options=launch)
        return dict(shared_bytes=compiled.metadata.shared, **ptxas_report(compiled.asm["ptx"], arch))
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:400]}


# The sparse backward's variants for --sparse: (mask block, BackwardTiles fields or None for the default tiles,
# launch options over `launch_options`), each compiled with descriptor loads on and off.
SPARSE_VARIANTS = [(128, None, {}), (128, None, {"num_stages": 3}), (128, (64, 128, 128, 64), {"num_stages": 3}),
                   (128, (32, 128, 128, 64), {}), (64, None, {}), (16, None, {})]


def compile_sparse(arch: int, head_dim: int, seq_len: int = 32768, strategy: Optional[str] = None) -> list[dict]:
    """The sparse backward's kernel (kernels/sparse/backward.py: dK/dV and dQ programs in one launch) for
    `SPARSE_VARIANTS`, its masked loops built as the launcher builds them for N = `seq_len`."""
    import torch

    from natsim.kernels.sparse.backward import (STAGES, BackwardTiles, _may_hold_partial_pairs, backward_tiles,
                                                sparse_backward_kernel)

    split = head_split(head_dim, strategy)
    rows = []
    for block, fields, options in SPARSE_VARIANTS:
        tiles = BackwardTiles(*fields) if fields else backward_tiles(block, block, torch.device("cuda"))
        for use_tma in (True, False):
            launch = {**launch_options(max(tiles.dkdv_queries, tiles.dq_queries),
                                       max(tiles.dkdv_keys, tiles.dq_keys), split).triton_options(),
                      "num_stages": STAGES,
                      **options}
            constexprs = dict(QB=block, KVB=block, DKDV_M=tiles.dkdv_queries, DKDV_N=tiles.dkdv_keys,
                              DQ_M=tiles.dq_queries, DQ_N=tiles.dq_keys, **split.constexprs(), USE_TMA=use_tma,
                              DKDV_PARTIAL=_may_hold_partial_pairs(tiles.dkdv_queries, tiles.dkdv_keys, block, block,
                                                                   seq_len),
                              DQ_PARTIAL=_may_hold_partial_pairs(tiles.dq_queries, tiles.dq_keys, block, block,
                                                                 seq_len))
            row = {"kernel": sparse_backward_kernel.__name__, "block": block, "tiles": list(tiles.__dict__.values()),
                   "USE_TMA": use_tma, "DKDV_PARTIAL": constexprs["DKDV_PARTIAL"],
                   "DQ_PARTIAL": constexprs["DQ_PARTIAL"], **launch,
                   **compile_report(sparse_backward_kernel, constexprs, False, launch, arch)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim of the compiled kernels")
    parser.add_argument("--num-warps", type=int, default=None, help="override every variant's num_warps")
    parser.add_argument("--sparse", action="store_true",
                        help="compile the sparse backward's kernels instead (SPARSE_VARIANTS)")
    parser.add_argument("--strategy", choices=STRATEGIES, default=None,
                        help="how a head_dim that is not a power of two runs (kernels/common/headdim.py; default: "
                             "the width's own)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sparse:
        write_report(args.out, "sparse-backward", args.arch, args.head_dim,
                     compile_sparse(args.arch, args.head_dim, strategy=args.strategy))
        return
    rows, seen = [], set()
    for halvings, options in TUNE:
        for case, (stride, window) in CASES.items():
            problem = natsim.Problem(SHAPE, window, stride)
            problem = dense_as_1d(problem) or problem
            q_tile, kv_tile = backward_tiles(problem, args.head_dim, halvings)
            if args.num_warps is not None:
                options = {**options, "num_warps": args.num_warps}
            pad = padded(problem, q_tile, kv_tile)
            kernels = [(dkdv_kernel, q_tile, kv_tile)]
            if not options.get("ATOMIC_DQ"):  # the dQ kernel runs on the mirrored tiles
                kernels.append((dq_kernel, kv_tile, q_tile))
            for fn, tq, tk in kernels:
                masked = needs_mask(problem, tq, tk)
                key = (fn.__name__, tq, tk, masked, pad, json.dumps(options, sort_keys=True))
                if key in seen:
                    continue
                seen.add(key)
                row = {"case": case, "q_halvings": halvings, "head_dim": args.head_dim,
                       **compile_variant(fn, tq, tk, options, masked, pad, args.arch, args.head_dim, args.strategy)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    write_report(args.out, "backward", args.arch, args.head_dim, rows)


if __name__ == "__main__":
    sys.exit(main())
