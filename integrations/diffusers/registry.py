"""Which spec routes a model, looked up in this order: the specs a user `register`s (by class, then by class
name), natsim's table of diffusers 0.42 classes (models.py, images.py), then its families (every Wan-derived
class, by its attention modules). Classes whose attention over the latent natsim cannot run are refused by
name with the reason, any other with a sentence naming the supported classes and `register`.
"""

from __future__ import annotations

from typing import Callable, Union

from torch import nn

from .images import IMAGE_SPECS
from .models import VIDEO_SPECS, WAN, is_wan
from .spec import Bound, ModelSpec

SPECS: dict[str, ModelSpec] = {**VIDEO_SPECS, **IMAGE_SPECS}
FAMILIES: tuple[tuple[Callable[[nn.Module], bool], ModelSpec], ...] = ((is_wan, WAN),)

LINEAR = ("its attention over the latent is linear attention (a kernel feature map, no softmax), which no sparse "
          "softmax attention reproduces")
REFUSED: dict[str, str] = {
    "SanaTransformer2DModel": LINEAR,
    "SanaVideoTransformer3DModel": LINEAR,
    "SanaWMTransformer3DModel": LINEAR + " (gated delta-rule attention)",
}

_registered: dict[Union[type, str], ModelSpec] = {}


def register(cls_or_name: Union[type, str], spec: ModelSpec) -> None:
    """Route the transformer class `cls_or_name` (a class, or a class name) as `spec` says, before natsim's own
    table: `apply` then routes its models (with `layout=` when the spec has no layout function)."""
    if not isinstance(cls_or_name, (type, str)):
        raise TypeError(f"cls_or_name must be a class or a class name, got {type(cls_or_name).__name__}.")
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a natsim.integrations.diffusers.ModelSpec, got {type(spec).__name__}.")
    if isinstance(cls_or_name, type):
        spec.bind(cls_or_name)  # its forward must have a readable signature
    _registered[cls_or_name] = spec


def unregister(cls_or_name: Union[type, str]) -> None:
    """Forget what `register(cls_or_name, ...)` said."""
    if cls_or_name not in _registered:
        raise ValueError(f"{cls_or_name!r} is not registered (register(cls_or_name, spec) was not called).")
    del _registered[cls_or_name]


def spec_of(model: nn.Module) -> Bound:
    """The spec routing `model`, bound to its class; refused with a sentence when natsim has none."""
    cls = type(model)
    name = cls.__name__
    spec = _registered.get(cls) or _registered.get(name) or SPECS.get(name)
    if spec is None:
        spec = next((family for matches, family in FAMILIES if matches(model)), None)
    if spec is None:
        if name in REFUSED:
            raise TypeError(f"natsim does not route {name}: {REFUSED[name]}.")
        raise TypeError(f"natsim supports the diffusers transformers {', '.join(SPECS)}, got {name}; route another "
                        "class with natsim.integrations.diffusers.register(cls, ModelSpec(...)).")
    return spec.bind(cls)
