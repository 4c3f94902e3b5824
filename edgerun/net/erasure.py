"""The erasure code of a vector's UDP fragments: any k of its k data fragments and m check fragments give back all k.

Arithmetic is over GF(2^8) (the polynomial x^8 + x^4 + x^3 + x^2 + 1, generator 2), byte by byte. Check j of
data fragments D_0 .. D_{k-1} is the sum over i of g^(j*i) * D_i: check 0 is their XOR, and checks 0 and 1
together rebuild any two lost fragments (every 2x2 matrix of their coefficients, [[1, 1], [g^a, g^b]] with
a != b, is invertible). That is what two checks buy over two copies of one XOR: at 5% loss a two-fragment vector
with two copies of its XOR is lost when both data fragments are (0.25%), with two checks only when three of its
four datagrams are (0.05%), for the same bytes on the wire.

Checks beyond the second are rows of a Vandermonde matrix that need not give an invertible system for every
pattern of losses; `solve` then leaves the vector incomplete (as if too many fragments were lost) rather than
rebuild anything wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

_POLYNOMIAL = 0x11D


def _tables() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(510, np.int64)
    log = np.zeros(256, np.int64)
    value = 1
    for power in range(255):
        exp[power] = value
        log[value] = power
        value <<= 1
        if value & 0x100:
            value ^= _POLYNOMIAL
    exp[255:] = exp[:255]  # exp[a + b] without a modulo, for logs a, b < 255
    return exp, log


EXP, LOG = _tables()
# MUL[c] maps every byte b to c * b: a product of a coefficient and a whole fragment is one table lookup.
MUL = np.zeros((256, 256), np.uint8)
MUL[1:, 1:] = EXP[LOG[1:, None] + LOG[None, 1:]]


def coefficient(check: int, index: int) -> int:
    """Data fragment `index`'s coefficient in check `check`: g^(check * index)."""
    return int(EXP[(check * index) % 255])


def inverse(c: int) -> int:
    return int(EXP[255 - LOG[c]])


def check_fragment(payloads: Sequence[bytes], check: int, size: int) -> bytes:
    """Check `check` of the data payloads (each zero-padded to `size` bytes)."""
    out = np.zeros(size, np.uint8)
    for index, payload in enumerate(payloads):
        data = np.frombuffer(payload, np.uint8)
        c = coefficient(check, index)
        out[:data.size] ^= data if c == 1 else MUL[c][data]
    return out.tobytes()


def solve(data: Mapping[int, bytes], checks: Mapping[int, bytes], missing: Sequence[int],
          size: int) -> dict[int, bytes] | None:
    """The missing data fragments (each `size` bytes, zero-padded) from the data fragments that came and the
    checks that came, by Gaussian elimination over GF(2^8); None when those checks do not determine them."""
    if not missing or len(checks) < len(missing):
        return None
    # One equation per check: sum over the missing m of coefficient(j, m) * D_m = check j + the received terms.
    received = {index: np.frombuffer(got, np.uint8) for index, got in data.items()}
    rows: list[list[int]] = []
    sides: list[np.ndarray] = []
    for j, payload in checks.items():
        side = np.zeros(size, np.uint8)
        side[:len(payload)] = np.frombuffer(payload, np.uint8)
        for index, got in received.items():
            side[:got.size] ^= MUL[coefficient(j, index)][got]
        rows.append([coefficient(j, m) for m in missing])
        sides.append(side)
    for column in range(len(missing)):
        pivot = next((r for r in range(column, len(rows)) if rows[r][column]), None)
        if pivot is None:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        sides[column], sides[pivot] = sides[pivot], sides[column]
        scale = inverse(rows[column][column])
        rows[column] = [int(MUL[scale][v]) for v in rows[column]]
        sides[column] = MUL[scale][sides[column]]
        for r in range(len(rows)):
            factor = rows[r][column]
            if r != column and factor:
                rows[r] = [a ^ int(MUL[factor][b]) for a, b in zip(rows[r], rows[column], strict=True)]
                sides[r] = sides[r] ^ MUL[factor][sides[column]]
    return {m: sides[i].tobytes() for i, m in enumerate(missing)}
