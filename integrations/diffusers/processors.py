"""Routed attention processors: the model's own processor, with its attention call going through natsim.

A diffusers processor projects, normalises and rotates q, k and v, calls one attention function, and projects
the output. natsim keeps all of that. Its routed processor is the model's processor (a subclass of its class,
with its state) whose call marks its `Router` active for the duration of the call; the attention function the
processor's code calls, `dispatch_attention_fn` (diffusers' dispatch) or `F.scaled_dot_product_attention`
(torch's), is replaced in the module that defines the processor class by a stand-in that serves the active
router and hands every other call, and every call while no router is active, to the function it replaced.
So other models, and processors natsim did not route, attend as before; `remove` puts the module's function
back once no routed processor of that module is left. The active router is a module global, set and reset
around the call: `torch.compile` traces through it (no graph break), and concurrent threads must not run two
routed models at once.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Callable, Optional

import torch.nn.functional as F

from . import parallel
from .attention import Router
from .parallel import context_parallel

_active: Optional[Router] = None
_installed: dict[str, tuple[str, object, int]] = {}  # module -> (name replaced, what it was, routed processors)


def _dispatch_stand_in(model_attention: Callable) -> Callable:
    """diffusers' `dispatch_attention_fn` call convention (`[B, N, heads, head_dim]`), routed when a router is
    active; under diffusers' context parallelism (`parallel_config`) through parallel.py."""
    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        router = _active
        if router is not None and not (dropout_p or is_causal or enable_gqa or attention_kwargs):
            if context_parallel(parallel_config) is None:
                out = router.attend(query, key, value, attn_mask, scale)
            else:
                out = parallel.attend(router, query, key, value, attn_mask, scale)
            if out is not None:
                return out
        return model_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                               scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs,
                               backend=backend, parallel_config=parallel_config)
    return dispatch_attention_fn


def _functional_stand_in() -> types.ModuleType:
    """torch.nn.functional with `scaled_dot_product_attention` (`[B, heads, N, head_dim]`) routed when a router
    is active."""
    functional = types.ModuleType("natsim_routed_functional")
    functional.__dict__.update(F.__dict__)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        router = _active
        if router is not None and not (dropout_p or is_causal or enable_gqa):
            out = router.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, scale)
            if out is not None:
                return out.transpose(1, 2)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    return functional


def _install(cls: type) -> str:
    """Put the stand-in into the module defining `cls`'s call (once per module); returns the module's name."""
    call = cls.__call__
    module_name = call.__module__
    module = sys.modules[module_name]
    if module_name in _installed:
        name, replaced, count = _installed[module_name]
        _installed[module_name] = (name, replaced, count + 1)
        return module_name
    names = call.__code__.co_names
    if "dispatch_attention_fn" in names and callable(getattr(module, "dispatch_attention_fn", None)):
        name, replaced = "dispatch_attention_fn", module.dispatch_attention_fn
        stand_in = _dispatch_stand_in(replaced)
    elif "F" in names and getattr(module, "F", None) is F:
        name, replaced, stand_in = "F", F, _functional_stand_in()
    else:
        raise TypeError(
            f"natsim cannot route {cls.__name__}: its attention is neither a call of diffusers' dispatch_attention_fn "
            "nor of torch's scaled_dot_product_attention."
        )
    setattr(module, name, stand_in)
    _installed[module_name] = (name, replaced, 1)
    return module_name


def release(processor) -> None:
    """`processor` (routed) is no longer used: restore its module's attention function if it was the last."""
    module_name = processor._natsim_module
    name, replaced, count = _installed[module_name]
    if count > 1:
        _installed[module_name] = (name, replaced, count - 1)
    else:
        setattr(sys.modules[module_name], name, replaced)
        del _installed[module_name]


def routed_processor(original, router: Router):
    """A processor that does what `original` does, but attends through `router` (see the module docstring)."""
    cls = type(original)
    module_name = _install(cls)
    processor = object.__new__(_routed_class(cls))
    processor.__dict__.update(vars(original))
    processor._natsim_router = router
    processor._natsim_module = module_name
    return processor


_routed_classes: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """The routed subclass of a processor class, one per class: compiled blocks that share code then share their
    graph, as with the model's own processors (Dynamo guards on the processor's type)."""
    routed = _routed_classes.get(cls)
    if routed is None:
        @functools.wraps(cls.__call__)  # diffusers passes a processor only the keyword arguments its signature names
        def __call__(self, *args, **kwargs):
            global _active
            previous = _active
            _active = self._natsim_router
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                _active = previous

        routed = type(f"Natsim{cls.__name__}", (cls,), {
            "__call__": __call__,
            "__doc__": f"{cls.__name__} attending through natsim (natsim.integrations.diffusers).",
        })
        _routed_classes[cls] = routed
    return routed
