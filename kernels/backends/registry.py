"""Which backends there are and what each runs: `capabilities(backend, family)` looks a table up by name.

Every backend declares one table per kernel family: "gna" (GNA on a token layout) and "masks" (attention under
any block mask). A backend describes itself in a module beside triton.py (fa4.py: FlashAttention-4; gluon.py:
natsim's Gluon FP8 kernel) and adds its tables here, where the rooms above the kernels find them by name.
"""

from __future__ import annotations

from . import fa4, gluon, torch_reference, triton
from .capabilities import Capabilities

FAMILIES = ("gna", "masks")
_TABLES: dict[str, dict[str, Capabilities]] = {
    "triton": {"gna": triton.GNA, "masks": triton.MASKS},
    "fa4": {"gna": fa4.GNA, "masks": fa4.MASKS},
    "gluon": {"gna": gluon.GNA, "masks": gluon.MASKS},
    "reference": {"gna": torch_reference.GNA, "masks": torch_reference.MASKS},
}
BACKENDS = tuple(_TABLES)


def capabilities(backend: str, family: str) -> Capabilities:
    """The capability table of `backend` (one of BACKENDS) for kernel `family` (one of FAMILIES)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}.")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got family={family!r}.")
    return _TABLES[backend][family]
