"""Which kernel backends a search ranks: those that run here, and those its cost model can price.

natsim plans for two backends (`PLANNED`): its own Triton kernels ("triton", wherever natsim runs) and
FlashAttention-4 ("fa4": installed in natsim's version, on a GPU it runs on; natsim.kernels.backends.fa4). A
search ranks (configuration, backend) pairs by predicted time, so FlashAttention-4 can be picked only where the
cost model prices it (`CostModel.fa4_coefficients`, and for training `fa4_backward_coefficients`); ranked by tile
work, without a cost model, the backends cannot be told apart and a search plans the Triton kernels.

Where FlashAttention-4 does not run here but its coefficients exist, a search still prices it (`Backends.priced`),
so that the plan can say what it would have gained. `backend_choice` makes that decision once per search, as a
value; `fa4_gna_refusal` and `fa4_mask_refusal` say which configurations FlashAttention-4 runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from natsim import TileConfig
from natsim.kernels.backends import capabilities
from natsim.kernels.backends import fa4 as fa4_backend

from .cost.gpus import names_a_gpu
from .cost.model import CostModel
from .cost.resolve import DeviceLike

PLANNED = ("triton", "fa4")
NAMES = {"triton": "natsim's Triton kernels", "fa4": "FlashAttention-4"}
FA4_INSTALL = "pip install 'natsim[fa4]'"
BackendsLike = Union[None, str, Sequence[str]]


@dataclass(frozen=True)
class Backends:
    """The backends of one search: `allowed` may be picked, `priced` are scored (the allowed ones, and
    FlashAttention-4 where it has coefficients but does not run here), both in PLANNED order; `notes` holds, per
    backend a report should mention, why it may not be picked (a sentence)."""

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


def _price_refusal(model: Optional[CostModel], training: bool, where: str) -> Optional[str]:
    """None when `model` prices FlashAttention-4 calls (forward, and with `training` backward), else why not."""
    if model is None:
        return f"there is no cost model for {where} (plans rank by tile work), which cannot tell the backends apart"
    if not model.has("fa4"):
        return f"the cost model of {model.gpu} has no FlashAttention-4 coefficients"
    if training and not model.has("fa4-backward"):
        return f"the cost model of {model.gpu} has no FlashAttention-4 backward coefficients"
    return None


def backend_choice(backends: BackendsLike, *, device: DeviceLike, model: Optional[CostModel], training: bool,
                   gpu: Optional[str], excluded: Optional[str] = None) -> Backends:
    """The backends a search of `backends` ranks with cost model `model` (None: tile work) on `device`, or a
    sentence error for a backend asked for that cannot run here or cannot be priced.

    None means every backend available here: the Triton kernels, and FlashAttention-4 where it runs on the device
    (`device_here`) and `model` prices it; where only the first fails it is priced all the same, and the note
    says why it was not picked. `excluded` is why FlashAttention-4 has no place in this search at all (a
    precision or several ranks it does not run): then it is neither priced nor noted."""
    asked = check_backends(backends)
    if excluded is not None:
        if asked is not None and "fa4" in asked:
            raise ValueError(f"backends={asked!r} asks for FlashAttention-4, but {excluded}.")
        return Backends()
    run = fa4_refusal(device_here(device))
    price = _price_refusal(model, training, gpu or "this machine (no CUDA GPU)")
    kernels = "fa4,fa4-backward" if training else "fa4"
    if asked is not None:
        if "fa4" in asked and run is not None:
            raise ValueError(f"backends={asked!r} asks for FlashAttention-4, which does not run here: {run}")
        if "fa4" in asked and price is not None:
            raise ValueError(f"backends={asked!r} asks for FlashAttention-4, but {price}; run `natsim calibrate "
                             f"--kernels {kernels}` on the GPU to fit them, or leave backends out.")
        return Backends(allowed=asked, priced=asked)
    if price is None and run is None:
        return Backends(allowed=PLANNED, priced=PLANNED)
    if price is None:
        return Backends(priced=PLANNED, notes=(("fa4", run),))
    if run is None:
        return Backends(notes=(("fa4", f"FlashAttention-4 runs here, but {price}: plans run natsim's Triton "
                                       f"kernels (`natsim calibrate --kernels {kernels}` on this GPU fits them)."),))
    return Backends()


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
