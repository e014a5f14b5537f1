"""Reading plans back from JSON: the checks every plan kind's `from_json` / `from_dict` shares.

A plan is stored as one JSON object with a `format` key (`to_dict`, `to_json`). Reading it back checks, in
order, that the text parses, that it is an object of the plan's format with every key the plan reads, and that
its basis is one a search writes; a part of it that lacks a key is named. Each failure is one sentence.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import ClassVar, Iterator, Mapping, Optional, Sequence

from .ranking import BASIS_COST_MODEL, BASIS_TILES


def parse_json(text: str, reader: str, document: str) -> object:
    """`text` parsed as JSON, or a sentence error saying that `reader` expects `document` and where parsing
    failed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{reader} expects {document}, but parsing failed at line {error.lineno}, column {error.colno}: "
            f"{error.msg}."
        ) from None


def check_record(data: object, kind: str, format_name: str, keys: Sequence[str], writer: str) -> Mapping:
    """`data` when it is a JSON object with format `format_name` and every key of `keys`, else a sentence error
    naming `kind` ("a plan") and the method that writes such objects (`writer`)."""
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{kind} must be a JSON object with format {format_name!r} (as {writer} writes it), got a value "
            f"of type {type(data).__name__}."
        )
    if data.get("format") != format_name:
        raise ValueError(f"{kind} must have format {format_name!r}, got format={data.get('format')!r}.")
    missing = [key for key in keys if key not in data]
    if missing:
        names = ", ".join(repr(key) for key in missing)
        raise ValueError(
            f"{kind} with format {format_name!r} must have the key{'s' if len(missing) > 1 else ''} {names}, "
            f"which {'are' if len(missing) > 1 else 'is'} missing."
        )
    return data


def check_basis(basis: object) -> str:
    """`basis` when it is one a search writes (BASIS_COST_MODEL, BASIS_TILES), else a sentence error."""
    if basis not in (BASIS_COST_MODEL, BASIS_TILES):
        raise ValueError(f"basis must be {BASIS_COST_MODEL!r} or {BASIS_TILES!r}, got basis={basis!r}.")
    return basis


@contextmanager
def required_keys(part: str) -> Iterator[None]:
    """Read `part` of a plan ("a plan's 'tiles'") inside this block: a key it lacks becomes a sentence error."""
    try:
        yield
    except KeyError as error:
        raise ValueError(f"{part} must have the key {error.args[0]!r}, which is missing.") from None


class JsonRecord:
    """`to_json` and `from_json` of a plan kind over its own `to_dict` and `from_dict`; `JSON_DOCUMENT` says what
    `from_json` expects, in its refusal of text that does not parse."""

    JSON_DOCUMENT: ClassVar[str]

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str):
        """Rebuild a plan from `to_json` output."""
        return cls.from_dict(parse_json(text, f"{cls.__name__}.from_json", cls.JSON_DOCUMENT))

