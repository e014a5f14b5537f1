"""Which kernel backends a search ranks: those that run here, and those its cost model can price.

natsim plans for three backends (`PLANNED`): its own Triton kernels ("triton", wherever natsim runs),
FlashAttention-4 ("fa4": installed in natsim's version, on a GPU it runs on; natsim.kernels.backends.fa4) and its
Gluon kernel ("gluon": Hopper; natsim.kernels.backends.gluon; in FP8, and for block masks in inference its 16-bit
variant). A search ranks (configuration, backend) pairs by predicted time, so a backend other than Triton can be
picked only where the cost model prices it (its coefficient set: `CostModel.fa4_coefficients`, for training
`fa4_backward_coefficients`; `gluon_fp8_coefficients` in FP8, `gluon_16bit_coefficients` in 16 bits); ranked by
tile work, without a cost model, the backends cannot be told apart and a search plans the Triton kernels.

Where a backend does not run here but its coefficients exist, a search still prices it (`Backends.priced`), so
that the plan can say what it would have gained. `backend_choice` makes that decision once per search, as a
value; `fa4_gna_refusal`, `fa4_mask_refusal` and `gluon_tiles_refusal` say which configurations a backend runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch

from natsim import TileConfig
from natsim.kernels.backends import capabilities
from natsim.kernels.backends import fa4 as fa4_backend
from natsim.kernels.backends import gluon as gluon_backend

from .cost.gpus import names_a_gpu
from .cost.model import CostModel, coefficients_label
from .cost.resolve import DeviceLike

PLANNED = ("triton", "fa4", "gluon")
NAMES = {"triton": "natsim's Triton kernels", "fa4": "FlashAttention-4", "gluon": "natsim's Gluon kernel"}
FA4_INSTALL = "pip install 'natsim[fa4]'"
BackendsLike = Union[None, str, Sequence[str]]


def _fitted_kernels(backend: str, fp8: bool) -> tuple[str, Optional[str]]:
    """What `natsim calibrate --kernels` fits for `backend` (other than Triton) in a search in FP8 or not: its
    forward's set and its backward's (None: it has no backward)."""
    if backend == "fa4":
        return "fa4", "fa4-backward"
    return ("gluon-fp8" if fp8 else "gluon-16bit"), None


@dataclass(frozen=True)
class Backends:
    """The backends of one search: `allowed` may be picked, `priced` are scored (the allowed ones, and those with
    coefficients that do not run here), both in PLANNED order; `notes` holds, per backend a report should
    mention, why it may not be picked (a sentence)."""

    allowed: tuple[str, ...] = ("triton",)
    priced: tuple[str, ...] = ("triton",)
    notes: tuple[tuple[str, str], ...] = ()


def check_backends(backends: BackendsLike) -> Optional[tuple[str, ...]]:
    """`backends` as a tuple of names in PLANNED order (a name alone is one backend), None for "every one
    available here", or a sentence error."""
    if backends is None:
        return None
    names = (backends,) if isinstance(backends, str) else backends
    if not isinstance(names, (tuple, list)) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"backends must be None, a backend's name or a sequence of names among {PLANNED}, got "
                        f"backends={backends!r}.")
    unknown = [name for name in names if name not in PLANNED]
    if unknown or not names:
        raise ValueError(f"backends must name one or more of {PLANNED} (None: every one available here), got "
                         f"backends={tuple(names)!r}.")
    return tuple(name for name in PLANNED if name in names)


def device_here(device: DeviceLike) -> torch.device:
    """The device a plan made with `device` runs on here: `device` itself when it is a torch device, else (None,
    or a GPU's name, which picks coefficients) the current CUDA device, or the CPU without one."""
    if device is not None and not names_a_gpu(device):
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fa4_refusal(device: torch.device) -> Optional[str]:
    """None when FlashAttention-4 runs on `device` here, else why not (natsim.kernels.backends.fa4's sentence)."""
    return fa4_backend.installed() or fa4_backend.device_refusal(device)


def run_refusal(backend: str, device: torch.device) -> Optional[str]:
    """None when `backend` (other than Triton) runs on `device` here, else why not (its room's sentence)."""
    return fa4_refusal(device) if backend == "fa4" else gluon_backend.device_refusal(device)


def _price_refusal(kernels: tuple[str, Optional[str]], backend: str, model: Optional[CostModel], training: bool,
                   where: str) -> Optional[str]:
    """None when `model` prices `backend`'s calls (its forward's and, with `training`, its backward's `kernels`),
    else why not."""
    if model is None:
        return f"there is no cost model for {where} (plans rank by tile work), which cannot tell the backends apart"
    forward, backward = kernels
    if not model.has(forward):
        return f"the cost model of {model.gpu} has no {coefficients_label(forward)} coefficients"
    if training and (backward is None or not model.has(backward)):
        return f"the cost model of {model.gpu} has no {NAMES[backend]} backward coefficients"
    return None


def backend_choice(backends: BackendsLike, *, device: DeviceLike, model: Optional[CostModel], training: bool,
                   gpu: Optional[str], fp8: bool, excluded: Optional[Mapping[str, str]] = None) -> Backends:
    """The backends a search of `backends` ranks with cost model `model` (None: tile work) on `device`, in FP8
    with `fp8` (each backend priced by that precision's coefficients), or a sentence error for a backend asked for
    that cannot run here or cannot be priced.

    None means every backend available here: the Triton kernels, and each other backend where it runs on the
    device (`device_here`) and `model` prices it; where only the first fails it is priced all the same, and the
    note says why it was not picked. `excluded` holds, per backend, why it has no place in this search at all (a
    precision it does not run, several ranks): such a backend is neither priced nor noted."""
    asked = check_backends(backends)
    excluded = dict(excluded or {})
    for name in asked or ():
        if name in excluded:
            raise ValueError(f"backends={asked!r} asks for {NAMES[name]}, but {excluded[name]}.")
    here, where = device_here(device), gpu or "this machine (no CUDA GPU)"
    allowed, priced, notes = ["triton"], ["triton"], []
    for name in PLANNED[1:]:
        if name in excluded or (asked is not None and name not in asked):
            continue
        fitted = _fitted_kernels(name, fp8)
        run, price = run_refusal(name, here), _price_refusal(fitted, name, model, training, where)
        kernels = ",".join(kernel for kernel in fitted[:2 if training else 1] if kernel)
        if asked is not None:
            if run is not None:
                raise ValueError(f"backends={asked!r} asks for {NAMES[name]}, which does not run here: {run}")
            if price is not None:
                raise ValueError(f"backends={asked!r} asks for {NAMES[name]}, but {price}; run `natsim calibrate "
                                 f"--kernels {kernels}` on the GPU to fit them, or leave backends out.")
        if price is None:
            priced.append(name)
            if run is None:
                allowed.append(name)
            else:
                notes.append((name, run))
        elif run is None:
            notes.append((name, f"{NAMES[name]} runs here, but {price}: plans run natsim's Triton kernels "
                                f"(`natsim calibrate --kernels {kernels}` on this GPU fits them)."))
    if asked is not None:
        allowed = [name for name in allowed if name in asked]
        priced = [name for name in priced if name in asked]
    return Backends(allowed=tuple(allowed), priced=tuple(priced), notes=tuple(notes))


def fa4_gna_refusal(tiles: TileConfig, head_dim: int, dtype: torch.dtype, training: bool) -> Optional[str]:
    """None when FlashAttention-4 runs GNA with these multi-D tiles at `head_dim` in `dtype` (and with
    `training`, its backward), else why not: static KV tiling (its key blocks lie on a fixed grid), its capability
    table, then its tile rules (natsim.kernels.backends.fa4.gna_tile_refusal: a KV tile that is the Q tile or a
    slab of it along its first dimension longer than 1, block sizes per head dim)."""
    if tiles.kv_tiling != "static":
        return f"FlashAttention-4 runs static KV tiling only, got kv_tiling={tiles.kv_tiling!r}."
    refusal = capabilities("fa4", "gna").refusal(dtype=dtype, head_dim=head_dim, q_block=tiles.q_tokens,
                                                  kv_block=tiles.kv_tokens, needs=("backward",) if training else ())
    return refusal or fa4_backend.gna_tile_refusal(tiles.q_tile, tiles.kv_tile, head_dim, backward=training)


def fa4_mask_refusal(q_block: int, kv_block: int, head_dim: int, dtype: torch.dtype,
                     backward: bool = False) -> Optional[str]:
    """None when FlashAttention-4 runs a block mask of `q_block` x `kv_block` tokens (unmerged) at `head_dim` in
    `dtype` (and with `backward`, its backward), else why not (its capability table, then its block sizes per
    head dim)."""
    refusal = capabilities("fa4", "masks").refusal(dtype=dtype, head_dim=head_dim, q_block=q_block,
                                                    kv_block=kv_block, needs=("backward",) if backward else ())
    return refusal or fa4_backend.tile_refusal(q_block, kv_block, head_dim, backward=backward)


def gluon_tiles_refusal(q_tokens: int, kv_tokens: int, head_dim: int, dtype: torch.dtype) -> Optional[str]:
    """None when natsim's Gluon kernel runs blocks of `q_tokens` x `kv_tokens` at `head_dim` on `dtype` inputs (its
    capability table: 128 x 128 tiles, head_dim 64 or 128; FP8 from those inputs or its 16-bit variant on them),
    else why not; on GNA's partial tiles the FP8 search prices it where its fit has them
    (planner.search.gluon_scores)."""
    return capabilities("gluon", "masks").refusal(dtype=dtype, head_dim=head_dim, q_block=q_tokens,
                                                   kv_block=kv_tokens)
