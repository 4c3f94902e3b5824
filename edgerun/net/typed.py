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
from collections.abc import Callable
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
def carried_fields(cls: type) -> tuple[str, ...]:
    """The names of the fields of `cls` that travel outside its JSON."""
    return tuple(f.name for f in _fields(cls)[0] if f.check is None)


def plain(value: Any) -> Any:
    """A value as JSON holds it; a message's carried fields are left out."""
    if value is None or type(value) in (int, float, str, bool):  # most fields: first
        return value
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {name: plain(getattr(value, name)) for name in _fields(type(value))[2]}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class _Unfit(Exception):
    """A JSON value that does not fit its field's type (build names the field)."""


Check = Callable[[Any], Any]  # a JSON value -> the field's value, or _Unfit


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    check: Check | None  # None: carried outside the JSON
    required: bool  # no default


@functools.cache
def _fields(cls: type) -> tuple[tuple[_Field, ...], frozenset[str], tuple[str, ...]]:
    """A class's fields as build reads them, and the names its JSON holds, as a set and in order (once per class: a
    pipeline frame is made and opened on every stage of every token)."""
    fields = tuple(_Field(f.name, None if hints(cls)[f.name] in CARRIED else _check(hints(cls)[f.name]),
                          f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                   for f in dataclasses.fields(cls))
    names = tuple(f.name for f in fields if f.check is not None)
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
        if f.check is None:
            if f.name in carried:
                values[f.name] = carried[f.name]
            elif f.required:
                raise BadMessage(f"{cls.__name__}: missing {f.name}")
        elif f.name in data:
            try:
                values[f.name] = f.check(data[f.name])
            except _Unfit as e:
                raise BadMessage(f"{cls.__name__}.{f.name}: {e}") from None
        elif f.required:
            raise BadMessage(f"{cls.__name__}: missing field {f.name}")
    try:
        return cls(**values)
    except (ValueError, EdgerunError) as e:  # a field out of its range (the class's own check)
        raise BadMessage(f"{cls.__name__}: {e}") from e


@functools.cache
def _check(hint: Any) -> Check:
    """The check of a JSON value against a field's type, made once per type: JSON's lists become tuples, values
    become enums, objects dataclasses."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        check, optional = _check(inner), type(None) in args
        return lambda value: None if value is None and optional else check(value)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _check(args[0])

        def items(value: Any) -> tuple:
            if not isinstance(value, list):
                raise _Unfit("expected a list")
            return tuple(item(v) for v in value)

        return items
    if origin is tuple:
        checks = tuple(_check(a) for a in args)

        def fixed(value: Any) -> tuple:
            if not isinstance(value, list):
                raise _Unfit("expected a list")
            if len(value) != len(checks):
                raise _Unfit(f"expected {len(checks)} items")
            return tuple(check(v) for check, v in zip(checks, value, strict=True))

        return fixed
    if origin is dict and args[0] is str:
        entry = _check(args[1])

        def mapping(value: Any) -> dict:
            if not isinstance(value, dict):
                raise _Unfit("expected an object")
            return {k: entry(v) for k, v in value.items()}

        return mapping
    if dataclasses.is_dataclass(hint):
        def nested(value: Any) -> Any:
            if not isinstance(value, dict):
                raise _Unfit("expected an object")
            return build(hint, value)

        return nested
    if isinstance(hint, type) and issubclass(hint, Enum):
        def member(value: Any) -> Enum:
            try:
                return hint(value)
            except ValueError as e:
                raise _Unfit(str(e)) from None

        return member
    name = getattr(hint, "__name__", str(hint))

    def exact(value: Any) -> Any:
        if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if hint in (int, str, bool) and type(value) is hint:
            return value
        raise _Unfit(f"expected {name}, not {type(value).__name__}")

    return exact
