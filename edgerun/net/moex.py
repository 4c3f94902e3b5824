"""MoEx frames (the MoEx paper §4.2): a hub and its expert workers over WebSocket binary frames.

    magic "MoEx" | version u16 | type u16 | payload length u32 | sequence id u32 |
    layer u16 | expert u16 | tokens u32 | hidden u16 | dtype u8 | flags u8        (28 bytes, little-endian)

then the payload (payload length bytes) and a 16-byte HMAC-SHA256 over header and payload (the pipeline's MAC,
which browser workers compute with WebCrypto). A DISPATCH's payload is the tokens' expert input (tokens x hidden
in dtype) followed by one float32 gate weight per token, so the worker returns the weighted output; a RESULT's
is that output. CANCEL names the sequence id it cancels and carries nothing. HEARTBEAT and WEIGHT_SYNC carry a
JSON object, typed here (net.typed): a worker's hello, its periodic status or its answer to a weight sync; the
experts a worker is to hold, with their weights' content hashes. browser/expert.js writes and reads the same.
Beyond the seed: dtype 0x05 is float32 (the default: the hub's sums then equal the single engine's to rounding);
flag bit 0 (LZ4) is refused, as no peer compresses.
"""

from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from edgerun.model.config import ModelConfig
from edgerun.model.onnx_graph import Activations
from edgerun.net.typed import build, plain
from edgerun.net.wire import MAC_SIZE, BadMac, WireError, WorkerKind, cluster_mac

MOEX_MAGIC = b"MoEx"
MOEX_VERSION = 1
MOEX_HEADER = struct.Struct("<4sHHIIHHIHBB")
MOEX_MAX_FRAME = 64 * 1024 * 1024
MOEX_COMPRESSED = 0x01


class MoexType(IntEnum):
    DISPATCH = 1
    RESULT = 2
    CANCEL = 3
    HEARTBEAT = 4
    WEIGHT_SYNC = 5


class MoexDtype(IntEnum):
    F16 = 1
    BF16 = 2
    INT8 = 3
    INT4 = 4
    F32 = 5


_MOEX_NUMPY = {MoexDtype.F16: "<f2", MoexDtype.F32: "<f4"}  # the dtypes edgerun sends; the rest are refused


@dataclass(frozen=True)
class ExpertDispatch:
    """The hub's request: expert `expert` of `layer` on these tokens' inputs (tokens, hidden), weighted by `gates`."""

    seq: int
    layer: int
    expert: int
    x: np.ndarray
    gates: np.ndarray
    dtype: MoexDtype = MoexDtype.F32


@dataclass(frozen=True)
class ExpertResult:
    """A worker's answer: the gate-weighted expert output (tokens, hidden) for the dispatch `seq`."""

    seq: int
    layer: int
    expert: int
    y: np.ndarray
    dtype: MoexDtype = MoexDtype.F32


@dataclass(frozen=True)
class ExpertCancel:
    """The hub has its answer for `seq` from another replica: drop it if it is still queued or running."""

    seq: int


@dataclass(frozen=True)
class ExpertHello:
    """A worker's first heartbeat: who it is."""

    name: str
    budget_mb: float = 0.0
    kind: WorkerKind = WorkerKind.NATIVE
    backend: str = ""  # a tab's: wasm


@dataclass(frozen=True)
class ExpertStatus:
    """A worker's periodic heartbeat: what it did so far."""

    computed: int = 0  # dispatches answered
    queued: int = 0
    preempted: int = 0  # stale dispatches dropped (the MoEx paper's preemption)
    peak_rss_mb: float = 0.0


@dataclass(frozen=True)
class SyncDone:
    """A worker's answer to a weight sync (the heartbeat of the sync's sequence id)."""

    ready: bool
    experts: int = 0  # the experts it holds now
    seconds: float = 0.0
    error: str = ""


HeartbeatInfo = ExpertHello | ExpertStatus | SyncDone


@dataclass(frozen=True)
class ExpertHeartbeat:
    seq: int
    info: HeartbeatInfo


@dataclass(frozen=True)
class HeldExpert:
    """An expert a worker is to hold: its weights' blob (fetched by sha256); a tab gets its ONNX graph and float32
    weights file instead (also by sha256)."""

    layer: int
    expert: int
    sha256: str
    graph: str = ""
    weights: str = ""


@dataclass(frozen=True)
class ExpertSet:
    config: ModelConfig
    experts: tuple[HeldExpert, ...]
    activations: Activations = Activations.F32


@dataclass(frozen=True)
class WeightSync:
    """The experts a worker is to hold, and the model's shape; answered by a heartbeat of the same seq (SyncDone)."""

    seq: int
    info: ExpertSet


def _heartbeat_info(data: dict) -> HeartbeatInfo:
    """A heartbeat's object as its kind: an answer to a sync says whether it is `ready`, a hello its `name`."""
    return build(SyncDone if "ready" in data else ExpertHello if "name" in data else ExpertStatus, data)


MoexMessage = ExpertDispatch | ExpertResult | ExpertCancel | ExpertHeartbeat | WeightSync


def _moex_tensor(x: np.ndarray, dtype: MoexDtype) -> tuple[bytes, int, int]:
    if dtype not in _MOEX_NUMPY:
        raise ValueError(f"{dtype.name} tensors are not sent")
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] > 0xFFFF:
        raise ValueError(f"a tensor of shape {x.shape}: expected (tokens, hidden <= 65535)")
    return np.ascontiguousarray(x, _MOEX_NUMPY[dtype]).tobytes(), x.shape[0], x.shape[1]


def moex_frame(message: MoexMessage, key: bytes) -> bytes:
    """One sealed MoEx frame."""
    layer = expert = tokens = hidden = 0
    dtype, payload = MoexDtype.F32, b""
    match message:
        case ExpertDispatch(seq, layer, expert, x, gates, dtype):
            data, tokens, hidden = _moex_tensor(x, dtype)
            gates = np.ascontiguousarray(gates, "<f4").reshape(-1)
            if len(gates) != tokens:
                raise ValueError(f"{len(gates)} gate weights for {tokens} tokens")
            kind, payload = MoexType.DISPATCH, data + gates.tobytes()
        case ExpertResult(seq, layer, expert, y, dtype):
            kind, (payload, tokens, hidden) = MoexType.RESULT, _moex_tensor(y, dtype)
        case ExpertCancel(seq):
            kind = MoexType.CANCEL
        case ExpertHeartbeat(seq, info) | WeightSync(seq, info):
            kind = MoexType.HEARTBEAT if isinstance(message, ExpertHeartbeat) else MoexType.WEIGHT_SYNC
            payload = json.dumps(plain(info), separators=(",", ":")).encode()
        case _:
            raise TypeError(f"not a MoEx message: {message!r}")
    body = MOEX_HEADER.pack(MOEX_MAGIC, MOEX_VERSION, kind, len(payload), seq, layer, expert, tokens, hidden, dtype,
                            0) + payload
    return body + cluster_mac(key, body)


def open_moex_frame(data: bytes, key: bytes) -> MoexMessage:
    """Check and decode one MoEx frame; raise WireError for anything not to be trusted."""
    if not MOEX_HEADER.size + MAC_SIZE <= len(data) <= MOEX_MAX_FRAME:
        raise WireError(f"a MoEx frame of {len(data)} bytes")
    body, mac = data[:-MAC_SIZE], data[-MAC_SIZE:]
    if not hmac.compare_digest(mac, cluster_mac(key, body)):
        raise BadMac("bad MAC (wrong cluster key?)")
    magic, version, kind, length, seq, layer, expert, tokens, hidden, dtype, flags = MOEX_HEADER.unpack_from(body)
    if magic != MOEX_MAGIC:
        raise WireError("bad magic")
    if version != MOEX_VERSION:
        raise WireError(f"MoEx version {version}, expected {MOEX_VERSION}")
    if length != len(body) - MOEX_HEADER.size:
        raise WireError(f"payload length {length} does not match {len(body) - MOEX_HEADER.size}")
    if flags & MOEX_COMPRESSED:
        raise WireError("compressed MoEx payloads are not supported")
    payload = body[MOEX_HEADER.size:]
    try:
        kind = MoexType(kind)
    except ValueError:
        raise WireError(f"MoEx message type {kind}") from None
    if kind == MoexType.CANCEL:
        return ExpertCancel(seq)
    if kind in (MoexType.HEARTBEAT, MoexType.WEIGHT_SYNC):
        try:
            info = json.loads(payload)
        except (ValueError, RecursionError) as e:
            raise WireError(f"bad JSON: {str(e)[:80]}") from e
        if not isinstance(info, dict):
            raise WireError("a heartbeat or weight sync carries a JSON object")
        if kind == MoexType.HEARTBEAT:
            return ExpertHeartbeat(seq, _heartbeat_info(info))
        return WeightSync(seq, build(ExpertSet, info))
    try:
        dtype = MoexDtype(dtype)
        numpy_dtype = np.dtype(_MOEX_NUMPY[dtype])
    except (ValueError, KeyError):
        raise WireError(f"MoEx dtype {dtype} is not accepted") from None
    size = tokens * hidden * numpy_dtype.itemsize
    gates = 4 * tokens if kind == MoexType.DISPATCH else 0
    if tokens == 0 or hidden == 0 or len(payload) != size + gates:
        raise WireError(f"{len(payload)} payload bytes for {tokens} tokens of {hidden} ({dtype.name})")
    x = np.frombuffer(payload, numpy_dtype, tokens * hidden).reshape(tokens, hidden)
    if kind == MoexType.RESULT:
        return ExpertResult(seq, layer, expert, x, dtype)
    return ExpertDispatch(seq, layer, expert, x, np.frombuffer(payload, "<f4", tokens, size), dtype)
