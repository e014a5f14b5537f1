"""What a kernel backend runs, as one value the planner and the dispatchers read instead of kernel internals.

A `Capabilities` table answers, before anything runs, whether a backend can take a call: on which devices and
GPU generations, in which dtypes and head dims, with which Q and KV block (tile) sizes, and which features
(partial tiles through an element mask, a backward pass, FP8, dynamic KV tiling, reading a token layout where it
lies instead of in tile order, frame ranges for context parallelism). `refusal` turns a mismatch into the one
sentence a user reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FEATURES = ("partial_tiles", "backward", "fp8", "dynamic_kv_tiling", "in_place_layouts", "frame_ranges")


@dataclass(frozen=True)
class Capabilities:
    """One backend's capability table.

    `devices`: device types it runs ("cuda", "cpu"); `min_capability` / `max_capability`: the CUDA compute
    capabilities (major, minor) it runs on, inclusive (None: any). `dtypes`: the input dtypes of a bf16/fp16
    call. `head_dims`: the head dims it runs. `q_blocks` / `kv_blocks`: the tokens of a Q tile (query block)
    and of a KV tile it runs, for GNA tiles and block masks alike. The features are those of `FEATURES`.
    """

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    q_blocks: tuple[int, ...]
    kv_blocks: tuple[int, ...]
    partial_tiles: bool
    backward: bool
    fp8: bool
    dynamic_kv_tiling: bool
    in_place_layouts: bool
    frame_ranges: bool
    min_capability: Optional[tuple[int, int]] = None
    max_capability: Optional[tuple[int, int]] = None

    def features(self) -> tuple[str, ...]:
        """The features of `FEATURES` this backend has."""
        return tuple(name for name in FEATURES if getattr(self, name))

    def runs_on(self, capability: Optional[tuple[int, int]]) -> bool:
        """Whether a CUDA device of compute `capability` (None: the CPU) is one this backend runs on."""
        if capability is None:
            return "cpu" in self.devices
        if "cuda" not in self.devices:
            return False
        low, high = self.min_capability, self.max_capability
        return (low is None or capability >= low) and (high is None or capability <= high)

    def refusal(
        self,
        *,
        dtype: Optional[torch.dtype] = None,
        head_dim: Optional[int] = None,
        q_block: Optional[int] = None,
        kv_block: Optional[int] = None,
        capability: Optional[tuple[int, int]] = ...,  # type: ignore[assignment]
        needs: tuple[str, ...] = (),
    ) -> Optional[str]:
        """None when this backend runs a call of these properties, else one sentence naming the first one it does
        not run (arguments left out are not checked; `capability` None is the CPU, `needs` names FEATURES)."""
        if capability is not ... and not self.runs_on(capability):
            where = "CPU tensors" if capability is None else f"a GPU of compute capability {capability[0]}.{capability[1]}"
            return f"the {self.name} backend does not run on {where}."
        if dtype is not None and dtype not in self.dtypes:
            return f"the {self.name} backend runs dtypes {_names(self.dtypes)}, got dtype={dtype}."
        if head_dim is not None and head_dim not in self.head_dims:
            return f"the {self.name} backend runs head_dim {_span(self.head_dims)}, got head_dim={head_dim}."
        if q_block is not None and q_block not in self.q_blocks:
            return f"the {self.name} backend runs Q tiles of {_span(self.q_blocks)} tokens, got {q_block}."
        if kv_block is not None and kv_block not in self.kv_blocks:
            return f"the {self.name} backend runs KV tiles of {_span(self.kv_blocks)} tokens, got {kv_block}."
        for feature in needs:
            if feature not in FEATURES:
                raise ValueError(f"needs must name features of {FEATURES}, got {feature!r}.")
            if not getattr(self, feature):
                return f"the {self.name} backend has no {feature.replace('_', ' ')}."
        return None


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _span(values: tuple[int, ...]) -> str:
    """A readable list: '32, 64 or 128', or for a long arithmetic run '8 to 256 in steps of 8'."""
    values = tuple(sorted(values))
    if len(values) > 4:
        steps = {b - a for a, b in zip(values, values[1:])}
        if len(steps) == 1:
            return f"{values[0]} to {values[-1]} in steps of {steps.pop()}"
        return ", ".join(map(str, values[:-1])) + f" or {values[-1]}"
    return ", ".join(map(str, values[:-1])) + (" or " if len(values) > 1 else "") + str(values[-1])
