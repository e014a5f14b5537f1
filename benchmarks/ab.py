"""Two natsim checkouts side by side on one GPU: the same kernel calls timed in alternating rounds (ABBA).

    python benchmarks/ab.py --before OLD_CHECKOUT --after . --out DIR

For a change that must not change speed (a refactor, moved modules): each round runs in a fresh process that
imports natsim from one checkout (its folders mapped to the `natsim` package as pyproject.toml's package-dir
says, through links in a temporary folder), so nothing compiled by one tree serves the other. Rows: the GNA
forward at the HunyuanVideo layout (30x48x80, 24 heads of 128, bf16) dense and at window 18x24x24 with strides
1x1x1 (natsim's choice of KV tiling, static, dynamic), 1x8x8 and 16x8x8, a dilated call (the permuted path),
the GNA backward at 16x8x8 and 1x1x1, and the sparse kernel forward and backward on a random 128x128 block mask
at 70% sparsity (32,768 tokens). Medians of `triton.testing.do_bench`; the table gives each tree's rounds and
the ratio of the means (after / before). Writes `ab-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROUNDS = ("before", "after", "after", "before")


def package_root(checkout: Path, folder: Path) -> Path:
    """A folder in which `import natsim` finds `checkout`'s rooms: links named as pyproject.toml maps them."""
    mapping = tomllib.loads((checkout / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = folder / "natsim"
    root.mkdir(parents=True)
    for path in (checkout / mapping["natsim"]).glob("*.py"):
        (root / path.name).symlink_to(path.resolve())
    for name, source in mapping.items():
        if name.count(".") == 1:  # natsim.<room>
            (root / name.split(".")[1]).symlink_to((checkout / source).resolve())
    return folder


def worker(out: Path) -> None:
    """Time every row with the natsim on sys.path; write `{row: ms}` to `out`."""
    import torch
    from triton.testing import do_bench

    from natsim.kernels import gna_attention, sparse_attention

    torch.manual_seed(0)
    shape, heads, head_dim, window = (30, 48, 80), 24, 128, (18, 24, 24)
    q, k, v = (torch.randn(1, *shape, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows: dict[str, float] = {}

    def bench(name: str, fn, rep_ms: int) -> None:
        fn()
        torch.cuda.synchronize()
        rows[name] = do_bench(fn, warmup=max(rep_ms // 4, 25), rep=rep_ms, return_mode="median")
        print(f"{name:24s} {rows[name]:9.3f} ms", flush=True)

    forward = [("fwd dense", shape, 1, 1, None, 1500), ("fwd 1x1x1", window, 1, 1, None, 400),
               ("fwd 1x1x1 static", window, 1, 1, "static", 400), ("fwd 1x1x1 dynamic", window, 1, 1, "dynamic", 400),
               ("fwd 1x8x8", window, (1, 8, 8), 1, None, 400), ("fwd 16x8x8", window, (16, 8, 8), 1, None, 400),
               ("fwd 1x1x1 dil 1x2x2", (9, 12, 12), 1, (1, 2, 2), None, 400)]
    for name, win, stride, dilation, kv_tiling, rep in forward:
        bench(name, lambda: gna_attention(q, k, v, win, stride, dilation, kv_tiling=kv_tiling), rep)
    grad = torch.randn_like(q)
    for name, stride in (("bwd 16x8x8", (16, 8, 8)), ("bwd 1x1x1", 1)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = gna_attention(qq, kk, vv, window, stride)
        bench(name, lambda: torch.autograd.grad(out, (qq, kk, vv), grad, retain_graph=True), 1000)
    tokens = 32768
    qs, ks, vs = (torch.randn(1, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3))
    mask = torch.rand(1, heads, tokens // 128, tokens // 128, device="cuda") < 0.3
    bench("sparse fwd 70%", lambda: sparse_attention(qs.detach(), ks.detach(), vs.detach(), mask, 128, 128), 300)
    out = sparse_attention(qs, ks, vs, mask, 128, 128)
    grad = torch.randn_like(out)
    bench("sparse bwd 70%", lambda: torch.autograd.grad(out, (qs, ks, vs), grad, retain_graph=True), 500)
    out.write_text(json.dumps(rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="checkout of the version to compare against")
    parser.add_argument("--after", type=Path, help="checkout of the changed version")
    parser.add_argument("--out", type=Path, help="folder for the JSON result")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one round, in its own process
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return
    if args.before is None or args.after is None or args.out is None:
        parser.error("--before, --after and --out are required.")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    import triton

    results: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as folder:
        roots = {name: package_root(checkout, Path(folder) / name)
                 for name, checkout in (("before", args.before), ("after", args.after))}
        for index, name in enumerate(ROUNDS):
            result = Path(folder) / f"round{index}.json"
            print(f"-- round {index + 1}: {name}", flush=True)
            env = {**os.environ, "PYTHONPATH": str(roots[name])}
            subprocess.run([sys.executable, "-P", __file__, "--worker", str(result)], env=env, check=True)
            results[name].append(json.loads(result.read_text()))
    device = torch.cuda.get_device_name()
    record = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "rounds": list(ROUNDS), "results": results}
    name = f"ab-{device.replace(' ', '_')}-{record['date']}.json"
    (args.out / name).write_text(json.dumps(record, indent=1))
    print(f"\n{'row':24s} {'before (ms)':>18s} {'after (ms)':>18s}  after/before")
    for row in results["before"][0]:
        before = [r[row] for r in results["before"]]
        after = [r[row] for r in results["after"]]
        ratio = (sum(after) / len(after)) / (sum(before) / len(before))
        print(f"{row:24s} {' '.join(f'{t:8.2f}' for t in before):>18s} {' '.join(f'{t:8.2f}' for t in after):>18s}"
              f"  {ratio:.3f}")


if __name__ == "__main__":
    main()
