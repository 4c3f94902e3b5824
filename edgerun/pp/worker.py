"""`edgerun node --mode pp`: a native pipeline worker.

It connects to the master's WebSocket, says what it is (CONNECT), and then only reacts: it downloads
the files of the stage it is given (named by sha256, cached across restarts), loads the stage into
onnxruntime, and runs forward passes on what the master sends. A last stage samples the next token
itself, so only the token id goes back. A sampled token depends on the seed and its position only, so
a request replayed after a recovery draws the same tokens.

It also listens on a pass port (plain TCP, `peer_port` in its CONNECT; pp.passes): on a chained route the
master sends a pass to the first stage's port only, each stage hands its output straight to the next one's, and
the last stage returns the token, with every stage's compute time, to the master. A thread serves that port and
computes each pass as it comes: no event loop on a token's path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import websockets

from edgerun.cache import cache_root
from edgerun.llamacpp import cuda_buildable
from edgerun.memory import peak_rss_mb
from edgerun.model.config import ModelConfig
from edgerun.model.ggml_stage import GGML_STAGE_FILE, GgmlStage
from edgerun.model.loader import load_model
from edgerun.model.session import CONCURRENT_SESSIONS, StageSession, execution_providers
from edgerun.net.backoff import Backoff
from edgerun.net.model_files import fetch_checked
from edgerun.net.wire import PP_MAX_FRAME, WireError, WorkerKind, not_admitted, wrong_key
from edgerun.pp.messages import (
    PIPELINE,
    BatchComputation,
    BatchResult,
    Capabilities,
    CommitDone,
    CommitModel,
    Computation,
    ComputationResult,
    Connect,
    DownloadLayers,
    Error,
    ErrorReason,
    Init,
    InvalidateCache,
    KvData,
    KvFetch,
    KvLoad,
    KvLoaded,
    LayerDownload,
    Ping,
    Pong,
    Prefix,
    PrepareDone,
    PrepareModel,
    Refused,
    ReleaseSession,
    Sampling,
    SlotCopied,
    SlotCopy,
    StageFile,
    Table,
    open_frame,
    seal,
)
from edgerun.pp.passes import PassPort
from edgerun.profile.device import device_summary


class Role(Protocol):
    """What answers requests beside the pipeline's own (training stages: tune.worker.TuneRole). Made when the
    first of its requests comes, from the master's HTTP base URL for files, the compute threads and the log."""

    requests: ClassVar[Table]  # the messages it answers, by kind

    def __init__(self, base_url: str, threads: int | None, log: Callable[[str], None]) -> None: ...

    async def answer(self, message: Any) -> Any: ...


def files_dir() -> Path:
    return cache_root() / "pp" / "files"


def cached_files() -> list[str]:
    d = files_dir()
    return sorted(p.name for p in d.iterdir() if len(p.name) == 64) if d.is_dir() else []


def download(base_url: str, sha256: str) -> tuple[Path, float, int]:
    """The file with this sha256, from the cache or the master; (path, seconds, bytes fetched)."""
    target = files_dir() / sha256
    if target.is_file():
        return target, 0.0, 0
    start = time.perf_counter()
    size = fetch_checked(f"{base_url}/files/{sha256}", target, sha256)
    return target, time.perf_counter() - start, size


def load_threads(wanted: int) -> int:
    """How many sessions (parts of a stage) this worker creates at once, of the `wanted`: no more than its cores,
    and one where onnxruntime builds one session at a time."""
    return max(1, min(wanted, len(os.sched_getaffinity(0)))) if CONCURRENT_SESSIONS else 1


class PeerPortInUse(OSError):
    """The port for the previous stage's connections cannot be had."""


class MalformedInput(ValueError):
    """A pass's input that this stage cannot take (wrong tensor, dtype or shape)."""


def _described(x: np.ndarray | None) -> str:
    return "nothing" if x is None else f"{x.dtype} {tuple(x.shape)}"


@dataclass
class _Stage:
    first_layer: int
    end_layer: int
    lm_head: bool
    directory: Path
    bounds: tuple[int, ...] = ()  # where its parts after the first begin (StageSession)
    session: StageSession | GgmlStage | None = None

    def same_place(self, other: _Stage) -> bool:
        """The same layers from the same files."""
        return (self.first_layer, self.end_layer, self.lm_head, self.directory, self.bounds) == \
            (other.first_layer, other.end_layer, other.lm_head, other.directory, other.bounds)

    def load(self, config: ModelConfig, max_len: int, threads: int | None, providers: list[str],
             ggml_device: str = "cpu", slots: int = 1) -> StageSession | GgmlStage:
        """Its session: on ggml where the master sent the model's GGUF file, else onnxruntime's, its parts
        created at once. `slots`: sequences whose caches it holds for batched passes (ggml's stages only)."""
        gguf = self.directory / GGML_STAGE_FILE
        if gguf.exists():
            return GgmlStage(load_model(gguf), self.first_layer, self.end_layer, max_len, threads, ggml_device,
                             slots)
        if slots > 1:
            raise ValueError("batched passes run on ggml's stages only (the master sends this one ONNX files)")
        return StageSession(self.directory, config, self.first_layer, self.end_layer, max_len, threads, providers,
                            self.bounds)


def hand_over_kv(old: StageSession | GgmlStage, new: StageSession | GgmlStage) -> list[int]:
    """Give the new session the cached keys and values of the layers both sessions hold (a swap between stages
    of one worker moves nothing over the network for them): their buffers where the context lengths match,
    else a copy of their rows. The layers handed over."""
    shared = [layer for layer in old.layers if layer in new.layers]
    for layer in shared:
        if type(old) is type(new) and old.max_len == new.max_len:
            new.adopt_kv(old, layer)
        else:
            new.load_kv_rows(layer, *old.kv_rows(layer))
    return shared


SUMMARY_S = 5.0  # how often a verbose worker says what it did
CONNECT_TIMEOUT_S = 3.0  # a master that accepts but does not answer the handshake counts as unreachable


class PipelineWorker:
    def __init__(self, url: str, key: bytes, name: str, memory_mb: float, speed: float, threads: int | None,
                 log=print, device: str = "cpu", verbose: bool = False, peer_host: str = "0.0.0.0",
                 peer_port: int = 0, spin_s: float = 0.0, load_threads: int = 1,
                 tune_role: type[Role] | None = None) -> None:
        """`tune_role` makes the role that answers training requests (edgerun tune's tune.worker.TuneRole, given
        by `edgerun node`); without one this worker refuses them."""
        self.url, self.key, self.name, self.peer_host, self.spin_s = url, key, name, peer_host, spin_s
        self.load_threads = load_threads  # sessions of a stage created at once (StageSession in parts)
        self.verbose = verbose  # a timing summary every SUMMARY_S
        self.passes, self.pass_s = 0, 0.0  # forward passes computed, and their time
        self.memory_mb, self.speed, self.threads = memory_mb, speed, threads
        # ggml's stages take the GPU where its CUDA backend can be built here; onnxruntime's where its GPU
        # package is installed.
        self.ggml_device = "cuda" if device in ("cuda", "auto") and cuda_buildable() else "cpu"
        self.providers = execution_providers("auto" if self.ggml_device == "cuda" else device)
        self.device = "cuda" if self.ggml_device == "cuda" or self.providers[0] == "CUDAExecutionProvider" \
            else "cpu"
        self.log = log
        scheme, _, rest = url.partition("://")
        self.base_url = f"{'https' if scheme == 'wss' else 'http'}://{rest.split('/', 1)[0]}"  # files come over HTTP
        self.config: ModelConfig | None = None
        self.stage: _Stage | None = None
        self.preloaded: _Stage | None = None  # a staged plan's stage, loaded beside the one serving
        self.max_len = 0
        self.downloads: set[asyncio.Task] = set()  # DOWNLOAD_LAYERS in progress
        self.peer_port = peer_port  # the pass port, where chained passes come (0: any, then the one taken)
        self.pass_port: PassPort | None = None
        self.lock = threading.Lock()  # a pass (the pass port's thread or the loop's) and the stage it runs on
        self.tune_role = tune_role
        self.tune: Role | None = None  # a training stage's role, made when the first of its requests comes
        self.table = PIPELINE | (tune_role.requests if tune_role is not None else {})  # the messages it takes
        self.heard = False  # a frame from the master passed this worker's check

    async def connect(self, wait_s: float = 60.0) -> websockets.ClientConnection:
        """Connect, retrying with backoff for `wait_s` while the master is not up yet; every failure is said at
        once."""
        backoff = Backoff(wait_s)
        while True:
            try:
                ws = await asyncio.wait_for(websockets.connect(self.url, max_size=PP_MAX_FRAME, compression=None),
                                            CONNECT_TIMEOUT_S)
                self.log(f"worker {self.name}: connected to {self.url}")
                return ws
            except (OSError, TimeoutError, websockets.InvalidHandshake) as e:
                delay = backoff.next_delay()
                if delay is None:
                    raise OSError(f"no answer within {wait_s:.0f} s ({e or type(e).__name__})") from e
                self.log(f"worker {self.name}: cannot reach the master at {self.url} ({e or type(e).__name__}); "
                         f"retrying in {delay:.1f} s")
                await asyncio.sleep(delay)

    async def run(self, wait_s: float = 60.0) -> None:
        """Serve until the master closes the connection (trying to reach it for `wait_s` first)."""
        summary = asyncio.create_task(self._summaries()) if self.verbose else None
        try:
            await self._serve(wait_s)
        except websockets.ConnectionClosed as e:
            if not self.heard:
                raise not_admitted(e) from e
            self.log(f"worker {self.name}: the master closed the connection ({e})")
        finally:
            if summary is not None:
                summary.cancel()

    async def _summaries(self) -> None:
        passes, seconds = 0, 0.0
        while True:
            await asyncio.sleep(SUMMARY_S)
            if self.passes > passes:
                n, busy = self.passes - passes, self.pass_s - seconds
                self.log(f"worker {self.name}: {n} passes in the last {SUMMARY_S:.0f} s, {busy / n * 1e3:.1f} ms "
                         f"each ({100 * busy / SUMMARY_S:.0f}% busy), peak RSS {peak_rss_mb():.0f} MB")
                passes, seconds = self.passes, self.pass_s

    async def _serve(self, wait_s: float) -> None:
        try:
            self.pass_port = PassPort(self.peer_host, self.peer_port, self.key, self._chained_pass, self.log,
                                      self.name, self.spin_s)
        except OSError as e:
            raise PeerPortInUse(str(e)) from e
        self.peer_port = self.pass_port.port
        try:
            async with await self.connect(wait_s) as ws:
                self.ws = ws
                async for data in ws:
                    await self._received(data)
        finally:
            self.pass_port.close()

    async def _received(self, data: str | bytes) -> None:
        if not isinstance(data, bytes):
            return
        try:
            request, message = open_frame(data, self.key, self.table)
        except Refused as e:  # authentic, but nothing this worker takes
            self.heard = True
            self.log(f"worker {self.name}: refused a request ({e})")
            await self._send(e.request, Error(str(e), ErrorReason.INPUT))
            return
        except WireError as e:
            if not self.heard:  # the master's first frame: the keys differ
                raise wrong_key(e) from e
            self.log(f"worker {self.name}: dropped a frame ({e})")
            return
        self.heard = True
        if isinstance(message, DownloadLayers) or (isinstance(message, PrepareModel) and message.preload is not None):
            # In the background: the stage held now keeps serving while files come and a staged stage loads.
            task = asyncio.create_task(self._answer(request, message))
            self.downloads.add(task)
            task.add_done_callback(self.downloads.discard)
        else:
            await self._answer(request, message)

    async def _answer(self, request: int, message: Any) -> None:
        try:
            await self._handle(request, message)
        except Exception as e:
            await self._send(request, _error(e))

    async def _send(self, request: int, message: Any) -> None:
        await self.ws.send(seal(request, message, self.key))

    async def _handle(self, request: int, message: Any) -> None:
        loop = asyncio.get_running_loop()
        match message:
            case Init(config, _):
                self.config = config
                await self._send(request, Connect(self.name, self.memory_mb, self.speed, Capabilities(
                    WorkerKind.NATIVE, "onnxruntime", ggml=True, device=self.device, host=device_summary(),
                    peer_port=self.peer_port, load_threads=load_threads(self.load_threads)), tuple(cached_files())))
            case Ping():
                await self._send(request, Pong())
            case DownloadLayers(files):
                for sha in files:
                    _, seconds, size = await loop.run_in_executor(None, download, self.base_url, sha)
                    await self._send(request, LayerDownload(sha, seconds, size))
            case PrepareModel():
                await self._prepare(request, message)
            case CommitModel():
                await self._commit(request, message)
            case Computation():
                await self._compute(request, message)
            case BatchComputation():  # a batch's pass (pp.batch): seconds for several sequences, off the loop
                await self._send(request, await loop.run_in_executor(None, self._batch_pass, message))
            case SlotCopy(source, target, rows):  # a batch's sequence takes another's cached prompt rows
                with self.lock:
                    session = self._session()
                    if not isinstance(session, GgmlStage):
                        raise ValueError("slots are ggml's stages'")
                    session.engine.copy_cache(source, target, rows)
                await self._send(request, SlotCopied())
            case KvFetch(layer, since):  # rows from position `since` on (0: all)
                # Under the pass lock: a hot swap's pre-copy fetches while the request runs, and a pass on the
                # pass port's thread moving the position between the keys' read and the values' gave them
                # different lengths (the master expelled the worker for it).
                with self.lock:
                    keys, values = self._session().kv_rows(layer, since)
                await self._send(request, KvData(keys, values))
            case KvLoad(layer, keys, values, since, staged):  # rows placed from `since`; staged: the preloaded stage
                if staged:
                    if self.preloaded is None or self.preloaded.session is None:
                        raise ValueError("no staged stage loaded")
                    session = self.preloaded.session
                else:
                    session = self._session()
                session.load_kv_rows(layer, keys, values, since)
                await self._send(request, KvLoaded())
            case InvalidateCache():
                with self.lock:
                    if self.stage is not None and self.stage.session is not None:
                        self.stage.session.reset()
            case ReleaseSession():
                self._release()
                self.preloaded = None
                self._port().drop_next()
            case _ if self.tune_role is not None and type(message).KIND in self.tune_role.requests:
                # a training stage (edgerun tune): its own role, PyTorch only when asked
                if self.tune is None:
                    self.tune = self.tune_role(self.base_url, self.threads, self.log)
                await self._send(request, await self.tune.answer(message))
            case _:
                raise ValueError(f"a worker does not take {type(message).__name__}")

    async def _prepare(self, request: int, message: PrepareModel) -> None:
        """Hold the stage `message` names: the one it serves already, the one it preloaded, or a new one from its
        files; or (message.preload) load it beside the one serving."""
        loop = asyncio.get_running_loop()
        stage = message.stage
        directory = cache_root() / "pp" / "stages" / hashlib.sha256(
            "".join(f.sha256 for f in message.files).encode()).hexdigest()[:24]
        new = _Stage(stage.first_layer, stage.end_layer, stage.lm_head, directory, stage.parts)
        if message.preload is not None:  # a staged plan's stage, loaded beside the one serving: a swap hands over
            await self._fetch_files(request, message.files, directory)
            new.session = await loop.run_in_executor(None, new.load, self.config, message.preload, self.threads,
                                                     self.providers, self.ggml_device)
            await loop.run_in_executor(None, new.session.warm_up)
            self.preloaded = new
            await self._send(request, PrepareDone(loaded=True))
            return
        old, ready, self.preloaded = self.stage, self.preloaded, None
        keep_kv = message.keep_kv and old is not None and old.session is not None and old.session.position > 0
        kept: list[int] = []
        took = False
        if old is not None and old.session is not None and old.same_place(new):
            del ready  # the stage it serves already: kept, session, KV cache and all
            kept = list(old.session.layers) if keep_kv else []
        elif ready is not None and ready.same_place(new):
            self._release()
            if keep_kv:
                kept = hand_over_kv(old.session, ready.session)
            self.stage, took = ready, True
        else:
            self._release()
            del ready  # not this stage: its memory goes before the files are fetched
            await self._fetch_files(request, message.files, directory)
            self.stage = new
        del old
        await self._send(request, PrepareDone(self.stage.session is not None, tuple(kept), took))

    async def _commit(self, request: int, message: CommitModel) -> None:
        """Load the prepared stage for `message.max_len` positions and `message.slots` sequences, and hand its
        outputs on where a chained route says."""
        if self.stage is None:
            raise ValueError("commit before prepare")
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        self.max_len = message.max_len
        s = self.stage
        if s.session is None or s.session.max_len != self.max_len or _slots(s.session) != message.slots:
            s.session = await loop.run_in_executor(None, s.load, self.config, self.max_len, self.threads,
                                                   self.providers, self.ggml_device, message.slots)
        if message.following is None:
            self._port().drop_next()
        else:
            await loop.run_in_executor(None, self._port().connect_next, message.following.host,
                                       message.following.port)
        await self._send(request, CommitDone(time.perf_counter() - start))
        self.log(f"worker {self.name}: holds layers {s.first_layer}-{s.end_layer - 1}"
                 f"{' and the LM head' if s.lm_head else ''}, loaded in {time.perf_counter() - start:.1f} s")

    def _port(self) -> PassPort:
        if self.pass_port is None:
            raise ValueError("the pass port is not open")
        return self.pass_port

    def _session(self) -> StageSession | GgmlStage:
        if self.stage is None or self.stage.session is None:
            raise ValueError("no stage loaded")
        return self.stage.session

    def _input(self, s: _Stage, message: Computation) -> np.ndarray:
        """The pass's input as this stage takes it: token ids (1, seq) for the first stage, else a float32 hidden
        state (1, seq, hidden). MalformedInput for anything else."""
        if s.first_layer == 0:
            x = message.input_ids
            if x is None or x.dtype != np.int64 or x.ndim != 2 or x.shape[0] != 1 or x.shape[1] < 1:
                raise MalformedInput(f"the first stage takes int64 token ids (1, seq), not {_described(x)}")
            return x
        x = message.hidden
        if x is None or x.dtype != np.float32 or x.ndim != 3 or x.shape[0] != 1 or x.shape[1] < 1 or \
                x.shape[2] != self.config.hidden:
            raise MalformedInput(f"a stage from layer {s.first_layer} takes a float32 hidden state "
                                 f"(1, seq, {self.config.hidden}), not {_described(x)}")
        return x

    def _release(self) -> None:
        with self.lock:  # not while a pass runs on it
            self.stage = None

    async def _fetch_files(self, request: int, files: tuple[StageFile, ...], directory: Path) -> None:
        """A stage's files into `directory` (links into the download cache), fetched where not cached; a stage in
        parts has each part's files in a directory of its own (0/, 1/, ...)."""
        for f in files:
            name = Path(f.name)
            if name.is_absolute() or ".." in name.parts:
                raise ValueError(f"a stage file named {f.name!r} would lie outside its directory")
        for f in files:
            path, seconds, size = await asyncio.get_running_loop().run_in_executor(None, download, self.base_url,
                                                                                   f.sha256)
            if size:  # fetched now (not from the cache): the master learns the link's bandwidth from it
                await self._send(request, LayerDownload(f.sha256, seconds, size))
            link = directory / f.name
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.exists() and link.is_symlink() == self.config.is_moe:
                link.unlink()  # made for the other kind of graph
            if not link.exists():
                if self.config.is_moe:
                    # onnxruntime refuses external weights behind a link of either kind in a subgraph (the
                    # experts' If branches), so a mixture of experts' stage holds a copy.
                    shutil.copyfile(path, link)
                else:
                    link.symlink_to(path)

    async def _compute(self, request: int, message: Computation) -> None:
        """A pass from the master (the star route): its answer goes back on the WebSocket."""
        if _is_step(message.input()):
            # A one-token step runs on this thread: it takes milliseconds, and handing it to a pool thread and
            # back costs two thread wake-ups per stage per token, on the critical path of every token.
            answer, onward = self._pass(message)
        else:  # a prefill may take seconds: the loop stays free for pings and the WebSocket's keepalive
            answer, onward = await asyncio.get_running_loop().run_in_executor(None, self._pass, message)
        if onward:
            raise ValueError("a chained pass comes to the pass port")
        await self._send(request, answer)

    def _chained_pass(self, message: Computation) -> tuple[Computation | ComputationResult | Error, bool]:
        """A pass from the pass port (pp.passes.PassCompute): an Error answer where it fails."""
        try:
            return self._pass(message)
        except Exception as e:
            return _error(e), False

    def _pass(self, message: Computation) -> tuple[Computation | ComputationResult, bool]:
        """One forward pass over this worker's stage: the answer, and whether it is the next stage's input (a
        chained pass that does not end here) rather than the master's answer."""
        with self.lock:
            session = self._session()
            s = self.stage
            position = message.position
            if message.prefix == Prefix.RESTORE:  # the request starts with the saved prefix
                session.restore_prefix()
            elif position == 0:
                session.reset()
            if position != session.position:
                raise ValueError(f"input at position {position}, but the cache holds {session.position}")
            x = self._input(s, message)
            start = time.perf_counter()
            out = session.run(x)
            seconds = time.perf_counter() - start
            self.passes, self.pass_s = self.passes + 1, self.pass_s + seconds
            if message.prefix == Prefix.SAVE:
                session.save_prefix()
        # On a chained route: the compute seconds of the stages before this one, and this one's.
        chain = None if message.chain is None else (*message.chain, seconds)
        if s.lm_head:
            sampling = message.sampling or Sampling()
            if sampling.logits:  # the master draws (model/logits.py)
                return ComputationResult(seconds, logits=np.ascontiguousarray(out[0, -1], np.float32)), False
            token = sampling.sampler()(out[0, -1], position + x.shape[1])
            return ComputationResult(seconds, token, chain or ()), False
        if chain is not None:  # straight on to the next stage
            return dataclasses.replace(message, input_ids=None, hidden=out, chain=chain), True
        return ComputationResult(seconds, hidden=out), False

    def _batch_pass(self, message: BatchComputation) -> BatchResult:
        """A batch's pass (pp.batch): one position of each of several sequences, or a chunk of one sequence's
        prompt from its position on. A middle stage answers the hidden states; the last draws each sequence's next
        token with that sequence's sampling (as a one-sequence pass does), or, where it asks for logits, sends its
        logits for the master to draw."""
        with self.lock:
            session, s = self._session(), self.stage
            if not isinstance(session, GgmlStage):
                raise ValueError("batched passes run on ggml's stages only")
            slots, positions = message.slots, message.positions
            x = self._batch_input(s, message, None if message.prompt else len(slots))
            start = time.perf_counter()
            if message.prompt:
                out = session.run_slot(slots[0], x[None], positions[0])[0]
                ends = [positions[0] + x.shape[0]]
            else:
                out = session.run_batch(list(zip(slots, positions, strict=True)), x)
                ends = [p + 1 for p in positions]
            seconds = time.perf_counter() - start
            self.passes, self.pass_s = self.passes + 1, self.pass_s + seconds
        if not s.lm_head:
            return BatchResult(seconds, hidden=out)
        if len(message.sampling) != len(ends):
            raise MalformedInput(f"the last stage takes a sampling per sequence, not {len(message.sampling)} for "
                                 f"{len(ends)}")
        tokens: list[int | None] = []
        kept: list[np.ndarray] = []
        for row, p, end in zip(out, message.sampling, ends, strict=True):
            if p.logits:  # the master draws (model/logits.py)
                tokens.append(None)
                kept.append(row)
            else:
                tokens.append(p.sampler()(row, end))
        return BatchResult(seconds, tuple(tokens),
                           logits=np.ascontiguousarray(np.stack(kept), np.float32) if kept else None)

    def _batch_input(self, s: _Stage, message: BatchComputation, rows: int | None) -> np.ndarray:
        """A batch pass's input: token ids (n,) for the first stage, else float32 hidden states (n, hidden); n
        `rows` (a decode step's sequences) or any (a prompt's chunk). MalformedInput for anything else."""
        if s.first_layer == 0:
            x = message.input_ids
            if x is None or x.dtype != np.int64 or x.ndim != 1 or len(x) < 1 or rows not in (None, len(x)):
                raise MalformedInput(f"the first stage takes int64 token ids ({rows or 'n'},), not {_described(x)}")
            return x
        x = message.hidden
        if x is None or x.dtype != np.float32 or x.ndim != 2 or len(x) < 1 or rows not in (None, len(x)) or \
                x.shape[1] != self.config.hidden:
            raise MalformedInput(f"a stage from layer {s.first_layer} takes float32 hidden states "
                                 f"({rows or 'n'}, {self.config.hidden}), not {_described(x)}")
        return x


def _slots(session: StageSession | GgmlStage) -> int:
    return session.engine.slots if isinstance(session, GgmlStage) else 1


def _is_step(x: np.ndarray | None) -> bool:
    """A one-token step's input (token ids or a hidden state of one position)."""
    return x is not None and x.ndim >= 2 and x.shape[1] == 1


def _error(e: Exception) -> Error:
    """A failed request's Error: malformed input is the sender's fault (on a chained route, the stage before);
    anything else (onnxruntime raises its own kinds) the master decides on."""
    if isinstance(e, MalformedInput):
        return Error(str(e), ErrorReason.INPUT)
    return Error(f"{type(e).__name__}: {e}")
