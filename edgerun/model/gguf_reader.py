"""A lean reader of GGUF files: the metadata's values are decoded when asked for, and tensors are views of one
memory map of the file.

The `gguf` package's reader builds numpy objects for every part of every metadata value up front: for a
vocabulary of 128k tokens and 280k merges that is hundreds of MB of Python objects, more than a small device's
tensor-parallel share, and a node never reads them. Here opening a file walks the metadata once, noting where
each value starts, and decodes a value (a list of 128k strings, say) only when `contents()` is called.
Writing GGUF files stays with the `gguf` package (model/gguf_file.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Value types of the GGUF format and the struct codes of the fixed-size ones.
STRING, ARRAY = 8, 9
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Cursor:
    """Reads little-endian values from a buffer, with a bounds check on every read."""

    def __init__(self, buffer: memoryview, position: int = 0) -> None:
        self.buffer, self.position = buffer, position

    def take(self, code: str) -> Any:
        size = struct.calcsize("<" + code)
        if self.position + size > len(self.buffer):
            raise ValueError("GGUF file ends inside its metadata")
        (value,) = struct.unpack_from("<" + code, self.buffer, self.position)
        self.position += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.position + n > len(self.buffer):
            raise ValueError("GGUF file ends inside a string")
        text = bytes(self.buffer[self.position:self.position + n]).decode("utf-8", errors="replace")
        self.position += n
        return text

    def skip_string(self) -> None:
        n = self.take("Q")  # taken first: it moves the position
        self.position += n

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, count = self.take("I"), self.take("Q")
            if element == STRING:
                return [self.string() for _ in range(count)]
            if element not in SCALARS:
                raise ValueError(f"GGUF array of value type {element}")
            size = struct.calcsize("<" + SCALARS[element]) * count
            if self.position + size > len(self.buffer):
                raise ValueError("GGUF file ends inside an array")
            values = np.frombuffer(self.buffer, "<" + SCALARS[element], count, self.position).tolist()
            self.position += size
            return values
        if kind not in SCALARS:
            raise ValueError(f"GGUF value type {kind}")
        return self.take(SCALARS[kind])

    def skip(self, kind: int) -> None:
        """Past a value without decoding it (strings of an array are walked, not made)."""
        if kind == STRING:
            self.skip_string()
        elif kind == ARRAY:
            element, count = self.take("I"), self.take("Q")
            if element == STRING:
                for _ in range(count):
                    self.skip_string()
            elif element in SCALARS:
                self.position += struct.calcsize("<" + SCALARS[element]) * count
            else:
                raise ValueError(f"GGUF array of value type {element}")
        elif kind in SCALARS:
            self.position += struct.calcsize("<" + SCALARS[kind])
        else:
            raise ValueError(f"GGUF value type {kind}")
        if self.position > len(self.buffer):
            raise ValueError("GGUF file ends inside its metadata")


@dataclass(frozen=True)
class Field:
    """One metadata value, decoded on request."""

    buffer: memoryview
    kind: int
    position: int

    def contents(self) -> Any:
        return _Cursor(self.buffer, self.position).value(self.kind)


@dataclass(frozen=True)
class TensorType:
    name: str  # ggml's name of the type: "Q4_0", "F32", ...


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: TensorType
    shape: np.ndarray  # dimensions in GGUF order: the row length first
    data: np.ndarray  # the tensor's bytes (uint8), a view of the file's memory map


def _qtype(name: str, kind: int) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"tensor {name}: unknown type {kind}") from None


def _nbytes(dims: list[int], qtype: GGMLQuantizationType) -> int:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    return count // block * block_bytes


class GgufReader:
    """`fields` (key -> Field) and `tensors` of a GGUF file, read through one read-only memory map."""

    def __init__(self, path: str | Path) -> None:
        self.map = np.memmap(path, np.uint8, mode="r")
        buffer = memoryview(self.map)
        cursor = _Cursor(buffer)
        if bytes(buffer[:4]) != MAGIC:
            raise ValueError("not a GGUF file (wrong magic)")
        cursor.position = 4
        version, n_tensors, n_fields = cursor.take("I"), cursor.take("Q"), cursor.take("Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key, kind = cursor.string(), cursor.take("I")
            self.fields[key] = Field(buffer, kind, cursor.position)
            cursor.skip(kind)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cursor.string(), cursor.take("I")
            dims = [cursor.take("Q") for _ in range(n_dims)]
            infos.append((name, dims, cursor.take("I"), cursor.take("Q")))
        alignment = self.fields["general.alignment"].contents() if "general.alignment" in self.fields else \
            DEFAULT_ALIGNMENT
        start = -(-cursor.position // alignment) * alignment
        self.tensors: list[Tensor] = []
        sized = []  # each tensor's bytes, counted once: for the file's expected size, then for its view
        for name, dims, kind, offset in infos:
            qtype = _qtype(name, kind)
            sized.append((name, dims, qtype, offset, _nbytes(dims, qtype)))
        end = max((start + offset + nbytes for *_, offset, nbytes in sized), default=start)
        if end > len(self.map):
            raise ValueError(f"the file is {len(self.map)} bytes but its tensors need {end}: truncated?")
        for name, dims, qtype, offset, nbytes in sized:
            self.tensors.append(Tensor(name, TensorType(qtype.name), np.array(dims, np.int64),
                                       self.map[start + offset:start + offset + nbytes]))
