"""Plan a GNA configuration for a video token layout, then run it on random q, k, v.

    python examples/plan_and_run.py

The planner picks window, stride and tiles for a target sparsity and explains why; the plan then runs
natsim's GNA kernel with exactly those settings (on CPU tensors: the torch reference, slowly but exactly).
The output is checked against the reference with the same window and stride.
"""

from __future__ import annotations

import rich
import torch

from natsim.kernels import reference_attention
from natsim.planner import Plan, best


def main(shape=(8, 16, 16), sparsity=0.75, heads=2, head_dim=64) -> float:
    """Plan, save and reload the plan, run it, and return its relative error against the reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16

    plan = best(shape, sparsity, heads=heads, head_dim=head_dim, dtype=dtype)
    rich.print(plan.explain())

    # A plan is plain data: save it once per layer shape, load it where the model runs.
    plan = Plan.from_json(plan.to_json())

    q, k, v = (torch.randn((1, *shape, heads, head_dim), device=device, dtype=dtype) for _ in range(3))
    out = plan(q, k, v)

    p = plan.problem
    expected = reference_attention(
        q.double(), k.double(), v.double(), p.window, p.stride, p.dilation, p.causal
    )
    error = float((out.double() - expected).norm() / expected.norm())
    print(f"output {tuple(out.shape)} {out.dtype}; relative error against the float64 reference: {error:.2e}")
    return error


if __name__ == "__main__":
    main()
