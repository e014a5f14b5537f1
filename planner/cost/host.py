"""The host's time to issue one call, per kernel backend (`natsim calibrate --kernels host`).

A kernel call costs the host Python, argument checks and the launch before the GPU sees it: about 0.05 ms through
natsim's prebound Triton path, and measured at about 1 ms through FlashAttention-4's CuTe DSL call (a compiled
PixArt-Sigma step at 1024 px: 25.6 ms with plans on FlashAttention-4 against 10.05 ms on natsim's Triton kernels,
docs/performance.md). Where the kernel's own time is shorter, the call takes the host's time, and in a model step
of many such calls the host bounds the step. The kernel features cannot see this (calibration leaves host-bound
cases out of the fits), so the cost model keeps it per backend (`CostModel.host_seconds`) and the searches price a
call at max(host, kernel).

The host time of torch's SDPA (`OWN_ATTENTION`) is kept beside them: it is what a model's own attention costs the
host, against which the diffusers integration weighs natsim's call on small layouts (AutoPlan.verdict).

Measured as the wall time of issuing `CALLS` back-to-back calls of a tiny problem (a few microseconds of GPU work
each, fewer than the launch queue holds), divided by their number: natsim's backends through the operator a
model's compiled graph and `AutoPlan` call where no gradient is needed, `natsim::gna_resolved_inference`, with the
log-sum-exp (joint attention asks for it), torch's SDPA as a model calls it; the Gluon kernel's 16-bit variant
(`GLUON_16BIT_HOST`), which runs block masks only, through `sparse_attention` on a boolean mask of two by two
128-token blocks: its block lists are built on the call, as they are on a mask plan's calls on prepared work too,
which differ only in the front's checks. (The host times shipped on
2026-11-27 were measured through `natsim::gna_resolved`, whose autograd layer cost more, before its twin existed.)
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from natsim.kernels import register_resolver, resolved_operators, sparse_attention
from natsim.kernels.backends import fa4 as fa4_backend
from natsim.kernels.backends import gluon as gluon_backend

from .model import GLUON_16BIT_HOST, OWN_ATTENTION

CALLS = 200
WARMUP = 10
TOKENS = 256  # a tiny sequence: two 128-token blocks
HEADS, HEAD_DIM = 2, 64
_resolver_ids: dict[str, int] = {}  # one registered resolver per backend measured


def host_refusal(backend: str, device: torch.device) -> Optional[str]:
    """None when `backend` (or OWN_ATTENTION) runs on `device` here, else why not (the backend's own sentence)."""
    if backend == "fa4":
        return fa4_backend.installed() or fa4_backend.device_refusal(device)
    if backend in ("gluon", GLUON_16BIT_HOST):
        return gluon_backend.device_refusal(device)
    return None if device.type == "cuda" else f"host times are measured on a CUDA GPU, got device={str(device)!r}."


def tiny_call(backend: str, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """A dense call over `TOKENS` tokens on `backend` through the resolved operator without autograd (the Gluon
    kernel's in FP8, the one precision it runs GNA in), of torch's SDPA for OWN_ATTENTION, or the 16-bit variant's
    block-mask call for GLUON_16BIT_HOST."""
    q, k, v = (torch.randn(1, TOKENS, HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(3))
    if backend == OWN_ATTENTION:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return lambda: F.scaled_dot_product_attention(q, k, v)
    if backend == GLUON_16BIT_HOST:
        blocks = -(-TOKENS // 128)
        mask = torch.ones(1, HEADS, blocks, blocks, dtype=torch.bool, device=device)
        return lambda: sparse_attention(q, k, v, mask, 128, 128, backend="gluon")
    arguments = dict(window=(TOKENS,), stride=(1,), dilation=(1,), causal=(False,), q_tile=(128,), kv_tile=(128,),
                     kv_tiling=None, precision="fp8" if backend == "gluon" else None, backend=backend)
    resolver = _resolver_ids.get(backend)
    if resolver is None:
        resolver = _resolver_ids[backend] = register_resolver(lambda *layout_and_call: arguments)
    resolved, _ = resolved_operators(tracked=False)  # what a model calls without gradients
    return lambda: resolved(q, k, v, resolver, None, True)


def host_seconds(backend: str, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds the host takes to issue one call on `backend` (module docstring), on a CUDA `device`."""
    refusal = host_refusal(backend, device)
    if refusal is not None:
        raise ValueError(f"the host time of {backend!r} cannot be measured here: {refusal}")
    return issue_seconds(tiny_call(backend, dtype, device), device)


def issue_seconds(run: Callable[[], object], device: torch.device) -> float:
    """Seconds the host takes to issue one `run()`: `CALLS` back-to-back calls after `WARMUP`, the GPU idle before
    and after, their wall time over their number."""
    for _ in range(WARMUP):
        run()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(CALLS):
        run()
    issued = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return issued / CALLS
