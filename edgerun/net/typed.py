"""Messages as frozen dataclasses in JSON, checked field by field on the way in.

Every protocol of edgerun (tensor-parallel control, pipeline, expert) writes its messages as frozen dataclasses and
puts their plain fields in a JSON object; `plain` turns a message into that object, `build` turns an object back
into a message, checking every field against the class's type hints, so a malformed message is a BadMessage, never
a KeyError or a wrong type deep in a master or a worker. Binary fields (a payload, tensors) do not go in the JSON:
each protocol carries them its own way and hands them to `build` as `carried`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from enum import Enum
from typing import Any, Union

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.net.wire import WireError

# A message's binary field. Decoded, it is a read-only view of the frame it came in (wire.open_frame): a prefill's
# activations and partials are hundreds of kilobytes, which are not copied again on their way to numpy.
Payload = bytes | memoryview
# A message's named tensors beside its declared ones (a checkpoint's matrices): every tensor the frame carries
# that no field of its own names.
Tensors = dict[str, np.ndarray]
CARRIED = (Payload, np.ndarray, np.ndarray | None, Tensors)  # the types of fields that travel outside the JSON


class BadMessage(WireError):
    """An authentic frame that holds no valid message: refused, and the stream goes on."""


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """A message class's field types (resolving them compiles their annotations: once per class)."""
    return typing.get_type_hints(cls)


@functools.cache
def carried_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The fields of `cls` that travel outside its JSON."""
    return tuple(f for f in dataclasses.fields(cls) if hints(cls)[f.name] in CARRIED)


def plain(value: Any) -> Any:
    """A value as JSON holds it; a message's carried fields are left out."""
    if dataclasses.is_dataclass(value):
        return {name: plain(getattr(value, name)) for name in _fields(type(value))[2]}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    hint: Any
    carried: bool  # travels outside the JSON
    required: bool  # no default


@functools.cache
def _fields(cls: type) -> tuple[tuple[_Field, ...], frozenset[str], tuple[str, ...]]:
    """A class's fields as build reads them, and the names its JSON holds, as a set and in order (once per class: a
    pipeline frame is made and opened on every stage of every token)."""
    fields = tuple(_Field(f.name, hints(cls)[f.name], hints(cls)[f.name] in CARRIED,
                          f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                   for f in dataclasses.fields(cls))
    names = tuple(f.name for f in fields if not f.carried)
    return fields, frozenset(names), names


def build(cls: type, data: dict, carried: dict[str, Any] | None = None) -> Any:
    """The message of class `cls` in the JSON object `data`, its carried fields taken from `carried` by name
    (a field absent from it takes its default); BadMessage where anything does not fit."""
    fields, known, _ = _fields(cls)
    if not known.issuperset(data):
        raise BadMessage(f"{cls.__name__}: unknown fields {sorted(set(data) - known)}")
    carried = carried or {}
    values = {}
    for f in fields:
        source = carried if f.carried else data
        if f.name in source:
            values[f.name] = source[f.name] if f.carried else _coerce(data[f.name], f.hint, (cls, f.name))
        elif f.required:
            raise BadMessage(f"{cls.__name__}: missing {'' if f.carried else 'field '}{f.name}")
    try:
        return cls(**values)
    except (ValueError, EdgerunError) as e:  # a field out of its range (the class's own check)
        raise BadMessage(f"{cls.__name__}: {e}") from e


def _coerce(value: Any, hint: Any, where: tuple[type, str]) -> Any:
    """value checked against a field's type (JSON's lists become tuples, values become enums, objects dataclasses);
    `where`: the class and field, named in the error."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise _bad(where, "expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], where) for v in value)
        if len(value) != len(args):
            raise _bad(where, f"expected {len(args)} items")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args, strict=True))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _bad(where, "expected an object")
        return build(hint, value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError as e:
            raise _bad(where, str(e)) from e
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise _bad(where, f"expected {getattr(hint, '__name__', hint)}, not {type(value).__name__}")


def _bad(where: tuple[type, str], why: str) -> BadMessage:
    return BadMessage(f"{where[0].__name__}.{where[1]}: {why}")
