"""A call captured in a CUDA graph and replayed on new inputs, for the GPU tests of every entry point."""

from __future__ import annotations

from typing import Callable

import torch


def replayed_on_new_inputs(fn: Callable, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn` captured in a CUDA graph on copies of `args` (after a warm-up call outside it), the copies refilled
    with new random values and the graph replayed: (the replayed output, `fn` called eagerly on the new values)."""
    static = [t.clone() for t in args]
    fn(*static)  # compiled kernels and cached work before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*static)
    for t in static:
        t.copy_(torch.randn_like(t))
    graph.replay()
    return captured, fn(*static)
