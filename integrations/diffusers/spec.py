"""What natsim needs to know of a diffusers transformer class to route its attention, as one value: `ModelSpec`.

A spec names the attention modules that carry the latent's tokens (as paths such as
`"transformer_blocks.attn"`, or a function of the model), where text tokens sit in their joint attention
("before" or "after" the latent's tokens), and how a forward call's arguments give the token layout (the
latent's frames, height and width after patching, or height and width for images). `Bound` is a spec bound to
one class: its forward's argument positions read once, so that what the forward pre-hook runs is plain
attribute and tuple reads, which `torch.compile` traces without a graph break.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

Attentions = Union[str, Sequence[str], Callable[[nn.Module], Sequence[nn.Module]]]
TEXT_PLACES = ("before", "after")


class Tokens(NamedTuple):
    """The tokens of one forward call: the latent's token `layout`, and the `trailing` tokens outside it that
    follow the latent's tokens in the routed attention: reference images of an edit (joint attention whose text
    comes first), LTX-2's keyframes (its video self-attention). The verdict prices them beside the tokens of the
    spec's `joint` arguments."""

    layout: tuple[int, ...]
    trailing: int = 0


class Call:
    """One forward call of a model as its forward pre-hook sees it, for a spec's layout function:
    `argument(name)` reads an argument given by name or by position."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, positions: dict[str, int]):
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.positions = positions

    def argument(self, name: str) -> Any:
        """The forward argument `name` (None when the call does not give it)."""
        return _argument(self.args, self.kwargs, self.positions, name)

    def required(self, name: str) -> Any:
        """The forward argument `name`, refused with a sentence when the call does not give it."""
        value = self.argument(name)
        if value is None:
            raise ValueError(f"natsim reads the token layout of {type(self.model).__name__} from its forward "
                             f"argument {name}, which this call does not give.")
        return value


LayoutOf = Callable[[Call], Union[Sequence[int], Tokens]]


@dataclass(frozen=True)
class ModelSpec:
    """How natsim routes one transformer class.

    `attentions`: the attention modules attending over the latent's (and text's) tokens: a path
    `"blocks.attn1"` (attribute `attn1` of every block of the model's block list `blocks`; blocks whose
    attribute is None are skipped), several paths, or a function of the model returning the modules.
    `layout`: the token layout of a forward call, a function of its `Call` returning a tuple of 1 to 3 sizes
    (frames, height, width after patching) or `Tokens`; None to give it with `apply(..., layout=...)`.
    `text`: where text tokens sit in joint attention, "before" or "after" the latent's tokens (self-attention
    over the latent alone ignores it). `split`: (attentions, axes) pairs for modules attending over some dims
    of the layout only, the others folded into their batch (Latte's spatial attention over dims (1, 2) per
    frame). `timestep`: the forward's timestep argument (content-adaptive masks count steps by it). `joint`:
    the forward arguments (`[B, T, ...]`) whose tokens join the latent's in the routed joint attention, their
    dim-1 sizes summed (the layout's trailing tokens are added to them): the tokens the verdict prices natsim's
    dense part and the model's longer call by (planner.plans.verdict), and the most a routed call may hold beside
    the layout's (Router.attend refuses more); empty where the routed attention holds the latent alone. Tokens
    outside the layout that no argument brings are the layout function's trailing ones (`Tokens`).
    """

    attentions: Attentions = ()
    layout: Optional[LayoutOf] = None
    text: str = "after"
    split: tuple[tuple[Attentions, tuple[int, ...]], ...] = ()
    timestep: str = "timestep"
    joint: tuple[str, ...] = ()

    def __post_init__(self):
        if self.text not in TEXT_PLACES:
            raise ValueError(f"text must be one of {TEXT_PLACES}, got text={self.text!r}.")
        if self.layout is not None and not callable(self.layout):
            raise TypeError("layout must be None or a function of the forward call returning the token layout "
                            f"(a fixed layout goes to apply(..., layout=...)), got {type(self.layout).__name__}.")
        for entry in self.split:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], tuple)
                    and all(isinstance(axis, int) for axis in entry[1])):
                raise TypeError(f"split must hold (attentions, axes) pairs, axes a tuple of ints, got {entry!r}.")
        if not self.split and not _named(self.attentions):
            raise ValueError("a ModelSpec must name attention modules (attentions=..., or split=...).")
        if not (isinstance(self.joint, tuple) and all(isinstance(name, str) for name in self.joint)):
            raise TypeError(f"joint must be a tuple of forward argument names, got joint={self.joint!r}.")

    def bind(self, cls: type) -> Bound:
        """This spec for the class `cls`: the positions of its forward's arguments, read once."""
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # self first
        positions = {p.name: i for i, p in enumerate(parameters)
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
        return Bound(self, cls.__name__, positions)


def _named(attentions: Attentions) -> bool:
    return callable(attentions) or bool(attentions)


class Bound:
    """A spec bound to one class (`ModelSpec.bind`): what `apply` asks of a model."""

    def __init__(self, spec: ModelSpec, name: str, positions: dict[str, int]):
        self.spec = spec
        self.name = name
        self.positions = positions

    @property
    def text_first(self) -> bool:
        return self.spec.text == "before"

    def routes(self, model: nn.Module, router) -> list[tuple[nn.Module, Any]]:
        """Every attention module to route with the router it attends through: `router` for those over the whole
        layout (`router.whole` says whether there are any), a view of it (`router.view(axes)`) for those of
        `split`."""
        routes = [(module, router) for module in _modules(model, self.spec.attentions, self.name)]
        router.whole = bool(routes)
        for attentions, axes in self.spec.split:
            modules = _modules(model, attentions, self.name)
            view = router.view(axes)
            routes += [(module, view) for module in modules]
        seen = set()
        for module, _ in routes:
            if not callable(getattr(module, "processor", None)):
                raise TypeError(f"natsim routes diffusers attention modules (with a processor), but the spec of "
                                f"{self.name} names a {type(module).__name__}.")
            if id(module) in seen:
                raise ValueError(f"the spec of {self.name} names the attention module {type(module).__name__} twice.")
            seen.add(id(module))
        if not routes:
            raise ValueError(f"the spec of {self.name} finds no attention module in this model.")
        return routes

    def tokens(self, model: nn.Module, args: tuple, kwargs: dict,
               layout: Optional[tuple[int, ...]] = None) -> Tokens:
        """The tokens of a forward call: `layout` when given (apply's), else the spec's, checked."""
        if layout is not None:
            return Tokens(layout)
        if self.spec.layout is None:
            raise ValueError(f"the spec of {self.name} has no layout function: pass the token layout to apply() "
                             "(apply(transformer, ..., layout=(frames, height, width))).")
        tokens = self.spec.layout(Call(model, args, kwargs, self.positions))
        layout, trailing = tokens if isinstance(tokens, Tokens) else (tokens, 0)
        if not (1 <= len(layout) <= 3 and all(_is_int(n) and n > 0 for n in layout)):
            raise ValueError(f"a token layout is 1 to 3 positive ints, but the spec of {self.name} gives {layout}.")
        if not (_is_int(trailing) and trailing >= 0):
            raise ValueError(f"trailing tokens are a count >= 0, but the spec of {self.name} gives {trailing}.")
        # sizes read from shapes under a compile with dynamic shapes are symbolic: one plan (and graph) per size
        return Tokens(tuple(int(n) for n in layout), int(trailing))

    def joint_tokens(self, args: tuple, kwargs: dict) -> int:
        """The tokens a forward call's `joint` arguments bring to the routed joint attention (0 for none)."""
        tokens = 0
        for name in self.spec.joint:
            value = _argument(args, kwargs, self.positions, name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                tokens += int(value.shape[1])
        return tokens

    def timestep(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        """The forward call's timestep argument."""
        return _argument(args, kwargs, self.positions, self.spec.timestep)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _argument(args: tuple, kwargs: dict, positions: dict[str, int], name: str) -> Any:
    """A forward argument given by name or by position (None when absent)."""
    if name in kwargs:
        return kwargs[name]
    index = positions.get(name)
    return args[index] if index is not None and index < len(args) else None


def set_processor(module: nn.Module, processor) -> None:
    """Give an attention module `processor`: through its `set_processor` where it has one (Mochi's attention has
    none, only the attribute its forward calls)."""
    if callable(getattr(module, "set_processor", None)):
        module.set_processor(processor)
    else:
        module.processor = processor


def _modules(model: nn.Module, attentions: Attentions, name: str) -> list[nn.Module]:
    """The modules `attentions` names in `model` (ModelSpec's forms)."""
    if callable(attentions):
        return list(attentions(model))
    paths = (attentions,) if isinstance(attentions, str) else tuple(attentions)
    found = []
    for path in paths:
        blocks_name, _, attribute = path.partition(".")
        blocks = getattr(model, blocks_name, None)
        if not attribute or not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"an attention path is 'block_list.attribute' with block_list a ModuleList of the model, "
                             f"but {name} has no block list for the path {path!r}.")
        for block in blocks:
            module = block
            for part in attribute.split("."):
                if not hasattr(module, part):
                    raise ValueError(f"the attention path {path!r} does not name a module of {name}'s "
                                     f"{type(block).__name__} (no attribute {part!r}).")
                module = getattr(module, part)
                if module is None:  # a block without this attention (SD3's attn2 outside its dual layers)
                    break
            if module is not None:
                found.append(module)
    return found


def patched(sizes: Sequence[int], patches: Sequence[int]) -> tuple[int, ...]:
    """The token layout of a latent of `sizes` cut into patches of `patches`."""
    return tuple(int(size) // int(patch) for size, patch in zip(sizes, patches))
