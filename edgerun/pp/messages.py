"""The pipeline protocol: every message a pipeline master and its workers (native processes and browser tabs)
exchange, over the worker's WebSocket or a pass port (pp.passes).

Each message is a frozen dataclass whose KIND is its frame's type (net.wire.PpMsg). On the wire it is one pipeline
frame (`wire.pp_frame`): the plain fields as a JSON object, the array fields as the frame's named tensors. `seal`
and `open_frame` are the only code that turns messages into frames and back; `open_frame` checks every field
against the class (net.typed), so a malformed message is refused in one place, never a KeyError deep in a worker.

A protocol is a table of kinds to classes: PIPELINE here, which tuning (tune.messages) extends with its own; a
receiver decodes what its table holds and refuses the rest. browser/node.js writes and reads the same JSON.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any, ClassVar

import numpy as np

from edgerun.model.config import ModelConfig
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.typed import BadMessage, Tensors, build, carried_fields, hints, plain
from edgerun.net.wire import PpMsg, WorkerKind, open_pp_frame, pp_frame


class Refused(BadMessage):
    """An authentic frame that holds no message this end takes: the request it names may be answered with an
    Error (a worker), or the frame dropped (a master)."""

    def __init__(self, kind: PpMsg, request: int, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.request = kind, request


class TabWeights(Enum):
    """The matrices a browser tab asks for (node.js picks what its browser runs best)."""

    KERNELS = "kernels"  # quantized, for edgerun's own WebAssembly kernels (kernel_stage): int8 activations
    Q4 = "q4"  # quantized in an ONNX graph (MatMulNBits): WebGPU has a kernel for it
    F32 = "f32"  # dequantized in an ONNX graph: onnxruntime-web's WebAssembly without the kernels


class Prefix(StrEnum):
    """A pass that keeps its KV cache as a saved prefix, or continues from the one saved (a shared system prompt)."""

    SAVE = "save"
    RESTORE = "restore"


class ErrorReason(StrEnum):
    INPUT = "input"  # the input was malformed: the sender's fault (on a chained route, the stage before)
    WORKER = "worker"  # anything else: the master decides on the worker


# --- the handshake ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Init:
    """master -> worker, first: the model's shape and the context length; answered by Connect."""

    KIND: ClassVar[PpMsg] = PpMsg.INIT
    config: ModelConfig
    max_len: int


@dataclass(frozen=True)
class Capabilities:
    """What a worker is and runs on. Native workers fill the first part, tabs the second."""

    kind: WorkerKind
    runtime: str = ""  # onnxruntime, onnxruntime-web, edgerun-kernels
    ggml: bool = False  # it builds ggml's stages (native)
    device: str = ""  # cpu or cuda (native)
    host: str = ""  # its machine, for people to read (profile.device.device_summary)
    peer_port: int = 0  # its pass port (0: none)
    load_threads: int = 1  # sessions of a stage it creates at once
    backend: str = ""  # a tab's: wasm or webgpu
    threads: int = 0  # a tab's compute threads
    weights: TabWeights | None = None  # a tab's matrices


@dataclass(frozen=True)
class Connect:
    """worker -> master: who it is, its memory budget and speed, and the files it holds already."""

    KIND: ClassVar[PpMsg] = PpMsg.CONNECT
    name: str
    memory_mb: float
    speed: float  # weight bytes per second
    capabilities: Capabilities
    cached: tuple[str, ...] = ()  # sha256 of every file in its cache


@dataclass(frozen=True)
class Ping:
    KIND: ClassVar[PpMsg] = PpMsg.PING


@dataclass(frozen=True)
class Pong:
    KIND: ClassVar[PpMsg] = PpMsg.PONG


# --- deploying a stage ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DownloadLayers:
    """master -> worker: fetch these files (by sha256) ahead of an assignment; a LayerDownload each, the last one
    the answer."""

    KIND: ClassVar[PpMsg] = PpMsg.DOWNLOAD_LAYERS
    files: tuple[str, ...]


@dataclass(frozen=True)
class LayerDownload:
    """worker -> master: one file fetched, and how long it took (the master learns the link's bandwidth)."""

    KIND: ClassVar[PpMsg] = PpMsg.LAYER_DOWNLOAD
    sha256: str
    seconds: float
    bytes: int  # fetched now (0: it was in the cache)


@dataclass(frozen=True)
class StageLayers:
    first_layer: int
    end_layer: int  # exclusive
    lm_head: bool
    parts: tuple[int, ...] = ()  # where its parts after the first begin (a stage in several onnxruntime sessions)


@dataclass(frozen=True)
class StageFile:
    name: str  # its place in the stage's directory ("0/model.onnx" for a stage in parts)
    sha256: str


@dataclass(frozen=True)
class PrepareModel:
    """master -> worker: the stage's layers and files; answered by PrepareDone once the files are there."""

    KIND: ClassVar[PpMsg] = PpMsg.PREPARE_MODEL
    stage: StageLayers
    files: tuple[StageFile, ...]
    # A staged plan's stage, loaded now beside the one serving with this context length (a swap to it is then a
    # handover); None: the stage to serve next.
    preload: int | None = None
    keep_kv: bool = False  # a hot swap: keep the KV of the layers held before and after


@dataclass(frozen=True)
class PrepareDone:
    KIND: ClassVar[PpMsg] = PpMsg.PREPARE_DONE
    loaded: bool = False  # its session is loaded already (kept, preloaded, or the staged stage just loaded)
    kept: tuple[int, ...] = ()  # the layers whose KV it kept (keep_kv)
    preloaded: bool = False  # it took the stage it had preloaded


@dataclass(frozen=True)
class NextStage:
    host: str
    port: int


@dataclass(frozen=True)
class CommitModel:
    """master -> worker: load the prepared stage; answered by CommitDone."""

    KIND: ClassVar[PpMsg] = PpMsg.COMMIT_MODEL
    max_len: int
    slots: int = 1  # sequences whose caches it holds, for batched passes (ggml's stages)
    following: NextStage | None = None  # a chained route: where this stage's output goes (None: back to the master)


@dataclass(frozen=True)
class CommitDone:
    KIND: ClassVar[PpMsg] = PpMsg.COMMIT_DONE
    seconds: float = 0.0


@dataclass(frozen=True)
class InvalidateCache:
    """master -> worker: forget the request's KV cache."""

    KIND: ClassVar[PpMsg] = PpMsg.INVALIDATE_CACHE


@dataclass(frozen=True)
class ReleaseSession:
    """master -> worker: drop the stage, a preloaded one and every cache (it is out of the plan)."""

    KIND: ClassVar[PpMsg] = PpMsg.RELEASE_SESSION


# --- passes -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampling:
    """A request's sampler as a pass carries it to the last stage, which draws the token itself (browser/sampling.js
    draws exactly as model/sampling.py). `logits`: the master draws (model/logits.py): the stage returns them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    logits: bool = False

    @classmethod
    def of(cls, sampler: Sampler) -> Sampling:
        p = sampler.params
        return cls(p.temperature, p.top_p, p.top_k, p.min_p, sampler.seed, sampler.needs_logits)

    def sampler(self) -> Sampler:
        return Sampler(SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                      seed=self.seed, min_p=self.min_p))


@dataclass(frozen=True)
class Computation:
    """A forward pass of one sequence: token ids (1, n) int64 for the first stage, else a hidden state (1, n,
    hidden) float32. On a chained route it goes from stage to stage, `chain` the compute seconds of the stages
    before."""

    KIND: ClassVar[PpMsg] = PpMsg.COMPUTATION
    position: int
    input_ids: np.ndarray | None = None
    hidden: np.ndarray | None = None
    sampling: Sampling | None = None  # the last stage's draw
    prefix: Prefix | None = None
    chain: tuple[float, ...] | None = None

    def input(self) -> np.ndarray | None:
        return self.input_ids if self.input_ids is not None else self.hidden


@dataclass(frozen=True)
class ComputationResult:
    """A stage's answer: its output hidden state, or (the last stage) the token drawn or the logits to draw from.
    On a chained route the last stage answers with every stage's seconds."""

    KIND: ClassVar[PpMsg] = PpMsg.COMPUTATION_RESULT
    seconds: float = 0.0  # its kernels' time
    token: int | None = None
    stage_seconds: tuple[float, ...] = ()  # a chained pass's: each stage's
    hidden: np.ndarray | None = None
    logits: np.ndarray | None = None


@dataclass(frozen=True)
class BatchComputation:
    """A batch's pass (pp.batch, ggml's stages): one position of each of several sequences, or with `prompt` a chunk
    of one sequence's prompt from its position on. Ids (n,) int64 for the first stage, else hidden states (n,
    hidden) float32."""

    KIND: ClassVar[PpMsg] = PpMsg.BATCH_COMPUTATION
    slots: tuple[int, ...]
    positions: tuple[int, ...]
    prompt: bool = False
    sampling: tuple[Sampling, ...] = ()  # the last stage's: one per sequence
    input_ids: np.ndarray | None = None
    hidden: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.positions) or not self.slots or (self.prompt and len(self.slots) != 1):
            raise ValueError(f"a batch's pass names a slot and a position per sequence (a prompt's: one), not "
                             f"{self.slots} and {self.positions}")


@dataclass(frozen=True)
class BatchResult:
    """A batch's answer: hidden states, or (the last stage) each sequence's token, None where the master draws
    from the logits (one row per such sequence, in order)."""

    KIND: ClassVar[PpMsg] = PpMsg.BATCH_RESULT
    seconds: float
    tokens: tuple[int | None, ...] = ()
    hidden: np.ndarray | None = None
    logits: np.ndarray | None = None


@dataclass(frozen=True)
class SlotCopy:
    """master -> worker: a batch's sequence in slot `target` takes the first `rows` cached positions of slot
    `source` (a shared prompt); answered by SlotCopied."""

    KIND: ClassVar[PpMsg] = PpMsg.SLOT_COPY
    source: int
    target: int
    rows: int


@dataclass(frozen=True)
class SlotCopied:
    KIND: ClassVar[PpMsg] = PpMsg.SLOT_COPIED


@dataclass(frozen=True)
class PassHello:
    """First on the master's link to a worker's pass port, and the answer: results go back on that link."""

    KIND: ClassVar[PpMsg] = PpMsg.PASS_HELLO


# --- moving KV caches (a hot swap) ------------------------------------------------------------------------
@dataclass(frozen=True)
class KvFetch:
    """master -> worker: one layer's cached keys and values from position `since` on; answered by KvData."""

    KIND: ClassVar[PpMsg] = PpMsg.KV_FETCH
    layer: int
    since: int = 0


@dataclass(frozen=True)
class KvData:
    KIND: ClassVar[PpMsg] = PpMsg.KV_DATA
    keys: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class KvLoad:
    """master -> worker: one layer's rows to place from position `since` on, into the stage it serves or (`staged`)
    the one it preloaded; answered by KvLoaded."""

    KIND: ClassVar[PpMsg] = PpMsg.KV_LOAD
    layer: int
    keys: np.ndarray
    values: np.ndarray
    since: int = 0
    staged: bool = False


@dataclass(frozen=True)
class KvLoaded:
    KIND: ClassVar[PpMsg] = PpMsg.KV_LOADED


@dataclass(frozen=True)
class Error:
    """worker -> master: a request it could not carry out, and why."""

    KIND: ClassVar[PpMsg] = PpMsg.ERROR
    error: str
    reason: ErrorReason = ErrorReason.WORKER


PipelineMessage = (Init | Connect | Ping | Pong | DownloadLayers | LayerDownload | PrepareModel | PrepareDone
                   | CommitModel | CommitDone | InvalidateCache | ReleaseSession | Computation | ComputationResult
                   | BatchComputation | BatchResult | SlotCopy | SlotCopied | PassHello | KvFetch | KvData | KvLoad
                   | KvLoaded | Error)
Table = dict[PpMsg, type]


def table(*classes: type) -> Table:
    """A protocol's table: each class under its KIND."""
    kinds = {cls.KIND: cls for cls in classes}
    if len(kinds) != len(classes):
        raise ValueError("two messages of one kind")
    return kinds


PIPELINE = table(*typing.get_args(PipelineMessage))


def seal(request: int, message: Any, key: bytes) -> bytes:
    """A message as a sealed pipeline frame answering (or asking) `request`."""
    tensors: dict[str, np.ndarray] = {}
    for name in carried_fields(type(message)):
        value = getattr(message, name)
        named = value if isinstance(value, dict) else {} if value is None else {name: value}
        if set(named) & set(tensors):  # the named tensors beside the declared ones take other names
            raise ValueError(f"tensors {sorted(set(named) & set(tensors))} are named twice")
        tensors.update(named)
    return pp_frame(message.KIND, request, plain(message), key, tensors or None)


def open_frame(data: bytes, key: bytes, kinds: Table = PIPELINE) -> tuple[int, Any]:
    """(request, message) of a sealed frame: WireError for a frame not to be trusted, Refused for an authentic one
    that holds no message of the table `kinds`."""
    kind, request, fields, tensors = open_pp_frame(data, key)
    fields.pop("tensors", None)
    cls = kinds.get(kind)
    if cls is None:
        raise Refused(kind, request, f"{kind.name} is not a message this end takes")
    carried: dict[str, Any] = {}
    rest = dict(tensors)
    named = None
    for name in carried_fields(cls):
        if hints(cls)[name] == Tensors:
            named = name
        elif name in rest:
            carried[name] = rest.pop(name)
    if named is not None:
        carried[named] = rest
    elif rest:
        raise Refused(kind, request, f"{cls.__name__}: unexpected tensors {sorted(rest)}")
    try:
        return request, build(cls, fields, carried)
    except BadMessage as e:
        raise Refused(kind, request, str(e)) from e

