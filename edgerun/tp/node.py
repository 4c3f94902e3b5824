"""`edgerun node`: one device of a tensor-parallel cluster.

The node registers with the master over TCP, receives its share (a ShardSpec) and then, for every
block it holds a unit of, waits for the master's normalized input, computes its partial output and
sends it back: over UDP for the lossy layers, over TCP for the first layer and the LM head.

Only attention has state (the KV cache), and only per layer: attention at position p of layer l
needs the cache of layer l up to p, nothing of other layers. So an attention input that went
missing holds back that layer alone: it is fetched over TCP and run for its keys and values only
(its output would arrive too late to count), and inputs of that layer queued behind it follow.
A missing MLP input is simply skipped: the MLP is stateless and its contribution is lost either way.

Everything runs on one event loop: a datagram that completes an input is computed on and answered
in the same callback, with no thread hand-off on the per-token path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.memory import peak_rss_mb, reset_peak_rss, return_freed_memory
from edgerun.model import kernels
from edgerun.model.ggml_engine import cache_rows
from edgerun.model.loader import Model, load_model
from edgerun.net.backoff import Backoff
from edgerun.net.channel import (
    ETHERNET_UDP_PAYLOAD,
    Counters,
    DatagramSocket,
    EventLoopThread,
    LossyUdp,
    add_fragment,
    path_datagram_bytes,
)
from edgerun.net.fastpath import FastPath, NodeServer, ServeEnd, addresses, native_mtu
from edgerun.net.group import PROBE_LAYER, join_group
from edgerun.net.loss import LossModel, NoLoss
from edgerun.net.model_files import fetch_model, model_sha256
from edgerun.net.wire import (
    Q8_BLOCK,
    Q8_BLOCK_BYTES,
    Block,
    Codec,
    Header,
    KeyRejected,
    MsgType,
    Reassembly,
    Resend,
    WireError,
    as_f32,
    decode_vector,
    fragment,
    fragments_of,
    is_parity,
    parity_fragments,
    peek_parity,
    seal,
    whole_vector,
)
from edgerun.profile.device import device_summary
from edgerun.tp.channel import AsyncChannel, connect_channel
from edgerun.tp.ggml_shard import GgmlShard, build_share, ggml_compute_address
from edgerun.tp.kernel_fit import KernelFit
from edgerun.tp.messages import (
    MAX_PROBE_BYTES,
    Assign,
    BandwidthProbe,
    BandwidthReply,
    BatchStep,
    Fetch,
    Heartbeat,
    Input,
    Message,
    ParityOn,
    Partial,
    Ping,
    Pong,
    Priorities,
    Ready,
    Register,
    Reset,
    Route,
    Routes,
    Shutdown,
    Spare,
    Welcome,
)
from edgerun.tp.shard import QuantShard, Shard, ShardSpec, every_unit_spec, head_top
from edgerun.tp.trace import Event, Trace

HEARTBEAT_S = 0.5
SUMMARY_S = 5.0  # how often a verbose node says what it did
KEPT_PARTIALS = 8  # mirrored partials kept for the master's Resend requests (three a token: layer 0's two, the head)
JOIN_WAIT_S = 60.0  # how long a node keeps trying to reach its master
MAX_RETRY_S = 8.0  # the longest pause between two tries


def settle_heap() -> None:
    """Put every object alive now (the model, the share, the reader's metadata: hundreds of thousands)
    out of the garbage collector's reach. Otherwise a full collection, which comes every few hundred
    blocks, walks them all and stalls the event loop for up to a hundred milliseconds: a partial
    that misses its merge for no loss at all."""
    gc.collect()
    gc.freeze()


def valid_ranking(ranking: bytes | list | tuple | None, units: int) -> tuple[int, ...] | None:
    """A block's unit ranking if it is a permutation of its units, else None."""
    if ranking is None or len(ranking) != units or sorted(int(u) for u in ranking) != list(range(units)):
        return None
    return tuple(int(u) for u in ranking)


@dataclass
class _Input:
    total: int  # elements of the vector
    prefix: int  # bytes of unit ranking before each datagram's elements
    reassembly: Reassembly | None = None  # made for a vector that comes in several datagrams
    fetched: bool = False
    asked: bool = False  # a mirrored input's missing fragments were asked for (Resend)
    full: np.ndarray | None = None  # set when it came whole (over TCP, or in one datagram)
    ranking: tuple[int, ...] | None = None  # dynamic mapping: the unit at each priority index, if it came whole
    done: bool = False  # a stateless block computed already (its other copy may still come)

    def value(self) -> np.ndarray | None:
        if self.full is not None:
            return self.full
        r = self.reassembly
        return r.vector if r is not None and r.complete else None


@dataclass(frozen=True)
class NodeConfig:
    """Who a node is and how it runs (`edgerun node`'s options)."""

    master: tuple[str, int]  # the master's address
    name: str
    budget_mb: float  # memory it offers for its share
    speed: float  # weight bytes a second it reports to the planner
    threads: int = 1  # of the share's kernels
    spin_s: float = 0.0  # how long to poll for the next input without sleeping (DatagramSocket.spin_s)
    verbose: bool = False  # a timing summary every SUMMARY_S
    device: str = "cpu"  # where its share computes: "cpu" or "cuda" (ggml's CUDA backend)
    join_wait_s: float = JOIN_WAIT_S  # how long it keeps trying to reach the master


@dataclass
class KernelClock:
    """A node's time in its share's kernels, as its heartbeats report it."""

    compute_s: float = 0.0  # every block's, since it joined
    session_compute_s: float = 0.0  # ... of it, since the session began
    session_decode_s: float = 0.0  # ... and of its one-token blocks alone
    decode_s: float = 0.0  # every one-token block's on the current share, the LM head's too
    decode: KernelFit = field(default_factory=KernelFit)  # the layers' one-token blocks: the share's measured speed
    native_blocks: int = 0  # one-token blocks the native server computed on the current share

    def new_share(self) -> None:
        self.decode, self.decode_s, self.native_blocks = KernelFit(), 0.0, 0

    def new_session(self) -> None:
        self.session_compute_s = self.session_decode_s = 0.0

    def took(self, seconds: float, one_token: bool) -> None:
        """A block's kernels took `seconds` (its output sent)."""
        self.compute_s += seconds
        self.session_compute_s += seconds
        if one_token:
            self.decode_s += seconds
            self.session_decode_s += seconds

    def served(self, fit: KernelFit) -> None:
        """The native server computed one-token blocks of the layers: `fit` sums them."""
        self.native_blocks += fit.blocks
        self.took(fit.seconds, one_token=True)
        self.decode = self.decode.plus(fit)


class Node:
    def __init__(self, config: NodeConfig, model: Model | None, key: bytes, loss: LossModel | None = None,
                 log=print, trace: Trace | None = None) -> None:
        """`trace`: where the node appends its timeline of one-token blocks (tp.trace)."""
        self.config = config
        self.trace = trace
        self.model = model
        self.key = key
        self.log = log
        self.udp = LossyUdp(key, loss=loss)  # sends; datagrams arrive on self.datagrams
        # The native data path (net.fastpath) seals and sends a partial that fits one datagram, where no loss is
        # simulated in this process.
        self.fast = FastPath.load(key) if loss is None or isinstance(loss, NoLoss) else None
        self._to_master: tuple[tuple[str, int], object] = (("", 0), None)  # its address, natively
        # ... and serves the share's lossy one-token blocks (NodeServer) where it can: see _serve_natively.
        self.server: NodeServer | None = None
        self.datagrams: DatagramSocket | None = None  # the UDP socket, once joined
        # The master's multicast group of one-token inputs (Welcome.group, net.group), read beside it while the share
        # computes a block by datagram.
        self.group: tuple[str, int] | None = None
        self.group_datagrams: DatagramSocket | None = None
        self._server_n_kv = 0  # the cache rows its attention graphs read
        self.counters = Counters()
        # Loop-thread state: the share, the session, and the inputs not computed yet.
        self.spec: ShardSpec | None = None
        self.shard: GgmlShard | QuantShard | Shard | None = None  # Shard: the float reference, which tests run
        self.attn_layers: list[int] = []  # layers where this node holds attention units
        self.session = -1
        self.top: int | None = None  # the session's sampler draws from this many logits at most (Reset.top)
        self.inputs: dict[tuple[int, int, int, int], _Input] = {}
        # The last mirrored partials sent (their headers and vectors), for the master's Resend requests, and whether
        # each went on the stream too (a one-token partial on a clean link goes as a datagram alone: _keep_mirrored).
        self.kept_partials: dict[tuple[int, int, int, int], tuple[Header, np.ndarray, bool]] = {}
        self._from_stream = False  # computing an input that came on the stream: its partial goes there too
        self.latest_seen: tuple[int, int, int] = (-1, -1, -1)  # order key of the newest input of the session
        # The share and how to talk to the master, as the master assigned them (its parity grows on a lost packet:
        # ParityOn), and each block's channel to the master now (a batch session sets the assigned ones aside).
        self.assign: Assign | None = None
        self.routes: Routes | None = None
        # A batch session (Reset.batch): an input's position is its step's number, the steps' rows as the master
        # told them (BatchStep), and per layer the steps whose attention is in the cache.
        self.batch = False
        self.steps: dict[int, BatchStep] = {}
        self.step_done: list[int] = []
        self.clock = KernelClock()
        self.running = True
        self.channel: AsyncChannel | None = None
        # The second stream to the master (Assign.spare_stream), and whether the master sends a prompt's inputs on it
        # too (it does over a lossy link): then this node sends its prompt partials on both.
        self.spare: AsyncChannel | None = None
        self.spare_used = False
        self.spare_task: asyncio.Task | None = None  # opens and reads it (the loop holds its tasks only weakly)
        self.master_udp_port = 0
        self.net = EventLoopThread()

    @property
    def index(self) -> int:
        """This node's index in the master's plan, which its datagrams carry."""
        return 0 if self.assign is None else self.assign.index

    @property
    def codec(self) -> Codec:
        return Codec.F32 if self.assign is None else self.assign.codec

    @property
    def parity(self) -> int:
        """Parity fragments after every partial (net.erasure)."""
        return 0 if self.assign is None else self.assign.parity

    @property
    def datagram_bytes(self) -> int:
        """The largest UDP payload to and from the master."""
        return ETHERNET_UDP_PAYLOAD if self.assign is None else self.assign.datagram_bytes

    @property
    def priorities(self) -> Priorities | None:
        """Dynamic mapping: this node's priority indices per layer; it holds every unit and computes, per block, the
        units the master's ranking puts at those indices. None: static shares."""
        return None if self.assign is None else self.assign.priorities

    @property
    def master_udp(self) -> tuple[str, int]:
        """The master's UDP address."""
        return self.config.master[0], self.master_udp_port

    def run(self) -> None:
        try:
            welcome = self._join_with_retries()
        except BaseException:
            self.udp.close()
            self.net.stop()
            raise
        self.master_udp_port = welcome.udp_port
        self.group = (welcome.group, welcome.group_port) if welcome.group else None
        heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeat(), self.net.loop)
        self._use_masters_model(welcome.model_sha256, welcome.http_port)
        try:
            self.net.run(self._control_loop())
        except (ConnectionError, OSError, WireError) as e:
            self.log(f"node {self.config.name}: master connection ended ({e})")
        finally:
            self.running = False
            self.udp.close()
            heartbeat.cancel()
            self.net.stop()
            if self.group_datagrams is not None:  # its reader went with the loop
                self.group_datagrams.sock.close()
                self.group_datagrams = None
            if self.trace is not None:  # the blocks since the last heartbeat's flush
                self.trace.flush()

    def _join_with_retries(self) -> Welcome:
        """Join, retrying with backoff while the master cannot be reached (it may not be up yet); each failure is
        said at once. A rejected key ends it."""
        backoff = Backoff(self.config.join_wait_s, max_s=MAX_RETRY_S)
        at = "{}:{}".format(*self.config.master)
        while True:
            try:
                welcome = self.net.run(self._join(), timeout=60)
                self.log(f"node {self.config.name}: joined the master at {at}")
                return welcome
            except KeyRejected as e:
                raise EdgerunError(f"the master at {at} rejected this node's key: "
                                   "--key (or EDGERUN_KEY) must be the master's") from e
            except (OSError, ConnectionError, WireError, TimeoutError) as e:
                delay = backoff.next_delay()
                if delay is None:
                    raise EdgerunError(f"cannot reach the master at {at} within "
                                       f"{self.config.join_wait_s:.0f} s: {e}") from e
                self.log(f"node {self.config.name}: cannot reach the master at {at} ({e}); "
                         f"retrying in {delay:.1f} s")
                time.sleep(delay)

    async def _join(self) -> Welcome:
        self.channel = await connect_channel(*self.config.master, self.key, self.net.loop)
        datagrams = DatagramSocket("0.0.0.0", self.key, self.counters, self._on_datagram, self.config.spin_s,
                                   idle_spin=True, needless=self._needless)
        try:
            datagrams.watch_streams([self.channel.fileno()])  # a control message ends a spin
            datagrams.attach(asyncio.get_running_loop())
            c = self.config
            self.channel.send(Register(c.name, c.budget_mb, c.speed, datagrams.port, path_datagram_bytes(*c.master),
                                       device_summary() + (", computing on its GPU" if c.device == "cuda" else "")))
            welcome = await self.channel.receive()
            if not isinstance(welcome, Welcome):
                raise WireError(f"expected a welcome, got {type(welcome).__name__}")
        except BaseException:  # a failed join leaves nothing open for the next try
            datagrams.close()
            self.channel.close()
            raise
        self.datagrams = datagrams
        return welcome

    async def _control_loop(self) -> None:
        loop = asyncio.get_running_loop()
        async for message in self.channel.messages(self.counters):
            if isinstance(message, Assign):  # loading a share takes a while: keep the loop (heartbeats) going
                spec = message.spec
                self._serve_natively(False)  # the native server computes on the old share's graphs
                # The old share goes before the new one is built (no local name may keep it either: a device
                # would hold both while it builds, the peak of its memory).
                self.shard = None
                gc.unfreeze()  # settle_heap froze the old share with everything else: its cycles must be collectable
                gc.collect()
                reset_peak_rss()  # the peak reported from now on is the new share's, its build included
                dynamic = message.priorities is not None
                if dynamic:  # every device holds every unit
                    spec = every_unit_spec(self.model.config, spec)
                build = functools.partial(build_share, self.model.config, self.model.weights, spec, message.max_len,
                                          self.config.threads, message.activations, dynamic=dynamic,
                                          mapped_files=[self.model.path], device=self.config.device,
                                          slots=message.slots)
                self._assign(message, spec, await loop.run_in_executor(None, build))
                settle_heap()
            else:
                self._control(message)
            if not self.running:  # Shutdown
                break

    def _use_masters_model(self, sha256: str, http_port: int) -> None:
        """Keep the local model if it is the master's file; otherwise fetch the master's copy."""
        if self.model is not None and model_sha256(self.model.path) == sha256:
            return
        self.log(f"node {self.config.name}: the local model is not the master's ({sha256[:12]}); fetching it")
        self.model = load_model(fetch_model(f"http://{self.config.master[0]}:{http_port}", sha256))

    async def _heartbeat(self) -> None:
        summarized, last_compute, last_decode = time.monotonic(), 0.0, KernelFit()
        while self.running:
            await asyncio.sleep(HEARTBEAT_S)
            if self.trace is not None:  # between blocks
                self.trace.flush()
            try:
                calls = getattr(self.shard, "calls", None)  # a ggml share counts its calls' overhead
                clock = self.clock
                self.channel.send(Heartbeat(self.counters.total(), clock.compute_s, peak_rss_mb(), clock.decode,
                                            clock.decode_s, self.session, clock.session_compute_s,
                                            0 if calls is None else calls.count,
                                            0.0 if calls is None else calls.overhead_s, clock.native_blocks,
                                            clock.session_decode_s))
            except (OSError, ConnectionError):
                return
            now = time.monotonic()
            clock = self.clock
            if self.config.verbose and now - summarized >= SUMMARY_S and clock.compute_s > last_compute:
                busy = clock.compute_s - last_compute
                rate = (clock.decode.bytes - last_decode.bytes) / max(clock.decode.seconds - last_decode.seconds,
                                                                      1e-9) / 1e9
                self.log(f"node {self.config.name}: {busy * 1e3:.0f} ms in kernels over the last "
                         f"{now - summarized:.0f} s "
                         f"({100 * busy / (now - summarized):.0f}% busy), one-token steps at {rate:.2f} GB/s, "
                         f"{self.counters.total()} packets rejected, peak RSS {peak_rss_mb():.0f} MB")
                summarized, last_compute, last_decode = now, clock.compute_s, clock.decode

    def _in_group(self, on: bool) -> None:
        """Join the master's group (on the interface that faces it) or leave it. A node whose share computes no
        block by datagram leaves it, so that the master's inputs do not wake it; a host that cannot join it keeps
        its unicast inputs (the master sends by multicast only to nodes that echoed its group probe)."""
        if on == (self.group_datagrams is not None) or self.group is None or self.datagrams is None:
            return
        if not on:
            self.group_datagrams.close()
            self.group_datagrams = None
            self.datagrams.watch_streams([self.channel.fileno()])
            return
        try:
            sock = join_group(self.group, self.channel.local_address())
        except OSError as e:
            self.log(f"node {self.config.name}: cannot join the master's group {self.group[0]} ({e}): its inputs come "
                     "by unicast")
            self.group = None
            return
        group = DatagramSocket("", self.key, self.counters, self._on_datagram, self.config.spin_s, idle_spin=True,
                               needless=self._needless, sock=sock)
        group.watch_streams([self.channel.fileno(), self.datagrams.sock.fileno()])
        group.attach(asyncio.get_running_loop())
        self.datagrams.watch_streams([self.channel.fileno(), sock.fileno()])  # a group input ends a spin
        self.group_datagrams = group

    def _assign(self, message: Assign, spec: ShardSpec, shard: GgmlShard | QuantShard | Shard) -> None:
        self.spec, self.shard = spec, shard
        self.attn_layers = [layer for layer, units in enumerate(spec.attn_units) if units]
        self.assign, self.routes = message, message.routes
        self.master_udp_port = message.udp_port
        self.clock.new_share()
        self.channel.set_rto_min(message.rto_min_ms)
        self.spare_used = False
        if message.spare_stream and self.spare is None and (self.spare_task is None or self.spare_task.done()):
            self.spare_task = asyncio.get_running_loop().create_task(self._serve_spare(message.rto_min_ms))
        elif self.spare is not None and not message.spare_stream:
            self.spare.close()
            self.spare = None
        elif self.spare is not None:
            self.spare.set_rto_min(message.rto_min_ms)
        self._new_session(message.session)
        self._in_group(any((spec.attn_units[layer] and self.routes.of(layer, Block.ATTN, 1) == Route.DATAGRAM) or
                           (spec.mlp_groups[layer] and self.routes.of(layer, Block.MLP, 1) == Route.DATAGRAM)
                           for layer in range(len(spec.attn_units))))
        self._serve_natively(True)
        self.channel.send(Ready(self.session, shard.weight_bytes, shard.cache_bytes, shard.takes_q8_inputs))
        self.log(f"node {self.config.name}: holds {sum(map(len, spec.attn_units))} attention units, "
                 f"{sum(map(len, spec.mlp_groups))} MLP groups and {len(spec.vocab_blocks)} vocabulary blocks: "
                 f"{shard.weight_bytes / 1e6:.1f} MB of weights, {shard.cache_bytes / 1e6:.1f} MB of KV cache")

    async def _serve_spare(self, rto_min_ms: float | None) -> None:
        """Open the spare stream and take the prompt inputs the master sends on it, as those on the first. Losing it
        costs nothing but the second copies."""
        try:
            spare = await connect_channel(*self.config.master, self.key, asyncio.get_running_loop())
        except OSError as e:
            self.log(f"node {self.config.name}: no spare stream to the master ({e})")
            return
        self.spare = spare
        try:
            spare.set_rto_min(rto_min_ms)
            spare.send(Spare(self.config.name, self.datagrams.port))
            async for message in spare.messages(self.counters):
                if isinstance(message, Input):
                    self.spare_used = True
                    self._control(message)
                else:
                    self.counters.reject("unexpected")
                if not self.running:
                    break
        except (ConnectionError, OSError, WireError):
            pass
        finally:
            spare.close()
            if self.spare is spare:
                self.spare, self.spare_used = None, False

    def _control(self, message: Message) -> None:
        match message:
            case Reset(session, top, batch):
                self._new_session(session, top, batch)
            case BatchStep(session) if session == self.session and self.batch:
                self.steps[message.step] = message
                self._take_told(message.step)
            case Input(session, position, layer, block, ranking, vector, codec):
                if len(vector) % (Q8_BLOCK_BYTES if codec == Codec.Q8 else 4) or codec not in (Codec.F32, Codec.Q8):
                    self.counters.reject("message")
                    return
                key = (session, position, layer, int(block))
                kept = self.kept_partials.get(key)
                if kept is not None and not kept[2]:  # its partial went as a datagram alone: the master lacks it
                    self.kept_partials[key] = (*kept[:2], True)
                    self._stream_copy(kept[0], kept[1])
                    return
                # float32: a view of the frame (the share reads it, never writes)
                x = np.frombuffer(vector, "<f4") if codec == Codec.F32 else \
                    decode_vector(vector, codec, len(vector) // Q8_BLOCK_BYTES * Q8_BLOCK)
                entry = self._entry(Header(MsgType.ACTIVATION, session, position, layer, block), x.size)
                if entry is not None:
                    entry.full = x
                    entry.ranking = valid_ranking(ranking, self._units(block))
                    self._from_stream = True  # what it computes now is answered on the stream too
                    try:
                        self._take(position, layer, block, entry)
                    finally:
                        self._from_stream = False
            case ParityOn(fragments):  # the link lost a packet: parity after every partial from now on
                if self.assign is not None:
                    self.assign = replace(self.assign, parity=fragments)
            case Ping(seq):
                self.channel.send(Pong(seq))
            case BandwidthProbe(reply_bytes):
                self.channel.send(BandwidthReply(bytes(max(0, min(reply_bytes, MAX_PROBE_BYTES)))))
            case Shutdown():
                self.log(f"node {self.config.name}: the master closed the cluster")
                self.running = False
            case _:
                self.counters.reject("unexpected")

    def _new_session(self, session: int, top: int | None = None, batch: bool = False) -> None:
        self.session, self.top = session, top
        self.clock.new_session()
        was_batch, self.batch, self.steps = self.batch, batch, {}
        if self.model is not None:
            self.step_done = [0] * self.model.config.n_layers
        if self.assign is not None and batch != was_batch:
            # The native server computes a request's one-token blocks (one sequence, its cache at slot 0): a batch's
            # rows go through the Python path, which reads their step's slots and positions (BatchStep)
            self._serve_natively(not batch)
        if self.server is not None:
            self.server.new_session()
        self.inputs.clear()
        self.kept_partials.clear()
        self.latest_seen = (-1, -1, -1)
        if self.shard is not None:
            self.shard.truncate(0)

    def _serve_natively(self, on: bool) -> None:
        """Serve the share's lossy one-token blocks natively (net.fastpath.NodeServer: no Python between an input's
        datagram and its partial's), where the share is on ggml in this process's memory with static units, no
        loss is simulated here; otherwise (and with `on` False) the Python path reads every datagram."""
        shard = self.shard
        if not on or self.fast is None or self.priorities is not None or \
                not isinstance(shard, GgmlShard) or shard.backend.name != "cpu" or not shard.native or \
                self.datagrams is None:
            self.server = None
            for socket_ in (self.datagrams, self.group_datagrams):
                if socket_ is not None:
                    socket_.set_reader(None)
            return
        c = self.model.config
        n_kv = cache_rows(min((shard.lengths[layer] for layer in self.attn_layers), default=0) + 1, shard.max_len)
        graphs, weight_bytes = [], []
        for layer in range(c.n_layers):
            for block in (Block.ATTN, Block.MLP):
                graphs.append(shard.native_graph(layer, block, n_kv))
                weight_bytes.append(shard.block_bytes(layer, block))
        by_datagram, mirrored = ([all(self.routes.of(layer, block, 1) == route for block in (Block.ATTN, Block.MLP))
                                  for layer in range(c.n_layers)] for route in (Route.DATAGRAM, Route.MIRRORED))
        # A lossy link's partials are cut at its path natively where they fit none of its datagrams, if they can be
        # (cuts_natively; else that link's blocks go to the Python path, which cuts any)
        path = self.datagram_bytes
        cut = all(native_mtu(codec, c.hidden, path, parity=1) is not None for codec in (self.codec, Codec.F32))
        server = self.server or NodeServer(self.fast)
        server.prepare(graphs, weight_bytes, by_datagram, self.attn_layers, c.hidden, self.index, int(self.codec),
                       self.master_udp, self.udp.sock.fileno(), self.datagrams.sock.fileno(),
                       shard.backend.handle, ggml_compute_address(), self.config.spin_s, [self.channel.fileno()],
                       -1 if self.group_datagrams is None else self.group_datagrams.sock.fileno(), mirrored,
                       path if cut else -1)
        if self.trace is not None:
            server.keep_trace()
        self.server, self._server_n_kv = server, n_kv
        self.datagrams.set_reader(self._read_natively)
        if self.group_datagrams is not None:
            self.group_datagrams.set_reader(self._read_natively)

    def _read_natively(self) -> None:
        """The socket is readable: the native server serves what it can, the Python path the rest."""
        while (server := self.server) is not None and self.shard is not None:
            end = server.serve(self.session, self.shard.lengths, self.latest_seen, 1 + self.parity)
            self.latest_seen = server.latest
            s = server.s
            if s.computed:  # counted as _compute_and_send counts a block
                self.clock.served(KernelFit(s.computed, s.bytes, s.seconds, s.bytes_sq, s.cross))
            self.datagrams.skipped += s.skipped
            if self.trace is not None:
                for position, layer, block, *moments in server.traced():
                    key = (self.session, position, layer, block)
                    for event, at in zip((Event.RECEIVED, Event.HANDLED, Event.COMPUTED, Event.REPLIED), moments,
                                         strict=True):
                        self.trace.add(event, key, at, self.index)
            if end == ServeEnd.MIRRORED:
                self._served_mirrored()
                continue
            if end != ServeEnd.OTHER:
                return
            self.datagrams.handle(*server.handed_back())
            first = next(iter(self.attn_layers), None)
            if first is not None and self.shard is not None and \
                    cache_rows(self.shard.lengths[first] + 1, self.shard.max_len) != self._server_n_kv:
                self._serve_natively(True)  # the next attention graphs read more cache rows

    def _order(self, position: int, layer: int, block: int) -> tuple[int, int, int]:
        """Where an input falls in the master's sending order: the LM head comes after every layer."""
        return position, self.model.config.n_layers if block == Block.HEAD else layer, block

    def _units(self, block: Block) -> int:
        c = self.model.config
        return c.n_kv_heads if block == Block.ATTN else -(-c.ffn // self.spec.group_size)

    def _prefix(self, block: int) -> int:
        """Bytes of unit ranking before each activation fragment's vector."""
        return self._units(Block(block)) if self.priorities is not None and block != Block.HEAD else 0

    def _entry(self, header: Header, total: int) -> _Input | None:
        """The input record for a header of the current session (created on first sight)."""
        if header.session != self.session or self.shard is None:
            return None
        key = (header.session, header.position, header.layer, header.block)
        entry = self.inputs.get(key)
        if entry is None and header.block != Block.ATTN and header.position < self.latest_seen[0]:
            return None  # a stateless block of a step the master has left (a late TCP copy): nothing to do
        if entry is None:
            entry = self.inputs[key] = _Input(total, self._prefix(header.block))
        order = self._order(header.position, header.layer, header.block)
        if order > self.latest_seen:
            new_step = order[0] > self.latest_seen[0]
            self.latest_seen = order
            self._fetch_missing()
            if new_step:
                self._drop_stale_inputs()
        return entry

    def _needless(self, data: bytes) -> bool:
        """A datagram to leave unread before its MAC is checked (DatagramSocket.needless): a parity fragment of an
        input this node holds whole, or of an attention input already computed into its KV cache. With parity on,
        each input brings two after its data, which would otherwise be authenticated and opened on the way to
        the next block's input."""
        peek = peek_parity(data)
        if peek is None or peek[0][0] != self.session or self.shard is None:
            return False
        key = peek[0]
        entry = self.inputs.get(key)
        if entry is not None:
            return entry.done or entry.value() is not None
        _, position, layer, block = key
        lengths = self._done()
        return block == Block.ATTN and 0 <= layer < len(lengths) and position < lengths[layer]

    def _on_datagram(self, header: Header, payload: bytes, _: tuple[str, int]) -> None:
        if self.trace is not None and header.tokens == 1 and header.type == MsgType.ACTIVATION:
            key = (header.session, header.position, header.layer, header.block)
            self.trace.add(Event.RECEIVED, key, self.datagrams.arrived_at)
            self.trace.add(Event.HANDLED, key, time.perf_counter())
        if header.type == MsgType.PROBE:
            # A link probe from the master: echo it, through this side's loss like any datagram. A group probe
            # comes back with this node's index: the master then sends its inputs to the group for it.
            if header.layer == PROBE_LAYER:
                header = header._replace(node=self.index)
            self.udp.send_all([seal(header, payload, self.key)], self.master_udp)
            return
        if header.type == MsgType.RESEND:
            self._resend(header, payload)
            return
        if (header.type != MsgType.ACTIVATION or header.block not in (Block.ATTN, Block.MLP, Block.HEAD)
                or self.model is None):
            self.counters.reject("unexpected")
            return
        if header.block != Block.HEAD and self.spec is not None and self.priorities is None and (
                header.layer >= len(self.spec.attn_units) or
                not (self.spec.attn_units if header.block == Block.ATTN else self.spec.mlp_groups)[header.layer]):
            # a block this share holds nothing of: a group datagram for the other nodes (the master sends one to
            # the group only for blocks every member it knows takes part in; this node had not echoed yet)
            self.counters.reject("unexpected")
            return
        entry = self._entry(header, header.tokens * self.model.config.hidden) if header.tokens else None
        if entry is None:
            self.counters.reject("stale")
            return
        if entry.value() is not None:  # a copy of what is whole already (parity, a mirrored block's other copy)
            return
        if entry.reassembly is None:
            # The lean path: a vector in one datagram (most are) is decoded straight from it.
            vector = whole_vector(header, payload, entry.total, entry.prefix)
            if vector is not None:
                entry.full = vector
                entry.ranking = valid_ranking(payload[:entry.prefix], self._units(Block(header.block))) \
                    if entry.prefix else None
                self._take(header.position, header.layer, Block(header.block), entry)
                return
            entry.reassembly = Reassembly(entry.total, self.datagram_bytes, prefix=entry.prefix)
        if add_fragment(entry.reassembly, header, payload, self.counters):
            self._take(header.position, header.layer, Block(header.block), entry)
        elif is_parity(header) and not entry.asked and not entry.reassembly.complete and \
                self.routes.of(header.layer, Block(header.block), header.tokens) == Route.MIRRORED:
            # A mirrored input's data is all sent once its parity comes: ask for what was lost rather than wait for
            # the TCP copy, which takes tens of milliseconds to get through a lossy link.
            entry.asked = True
            request = Resend(header.session, header.position, header.layer, Block(header.block), self.index,
                             entry.reassembly.missing())
            self.udp.send_all([request.seal(self.key)], self.master_udp)

    def _resend(self, header: Header, payload: bytes) -> None:
        """The master asks for fragments of a mirrored partial that did not reach it: seal them again."""
        try:
            request = Resend.open(header, payload)
        except WireError:
            self.counters.reject("message")
            return
        kept = self.kept_partials.get((request.session, request.position, request.layer, int(request.block)))
        if kept is None:  # not computed yet (its input is on its way), or long gone
            return
        partial, out, _ = kept
        self.udp.send_all(fragment(partial, out, self.key, self.datagram_bytes, only=request.fragments or None),
                          self.master_udp)

    def _take(self, position: int, layer: int, block: Block, entry: _Input) -> None:
        """An input is complete: compute on it, or queue it behind a missing attention input, or in a batch
        session behind its step's rows (a datagram can come before the stream tells them: _take_told)."""
        key = (self.session, position, layer, int(block))
        if self.batch and position not in self.steps:
            return
        if block != Block.ATTN:  # stateless: compute now; the entry stays till the step ends, so a parity
            # fragment or a mirrored copy that comes after the data finds it done instead of starting it anew
            if not entry.done:
                entry.done = True
                self._compute_and_send(position, layer, block, entry.value(), ranking=self._ranking(entry, block))
            return
        lengths = self._done()
        if position < lengths[layer]:  # already cached (a copy that came both ways)
            self.inputs.pop(key, None)
        while position == lengths[layer]:
            entry = self.inputs.get(key)
            x = None if entry is None else entry.value()
            if x is None or (self.batch and position not in self.steps):  # its rows are not told yet
                return
            del self.inputs[key]
            self._compute_and_send(position, layer, block, x, output=not entry.fetched,
                                   ranking=self._ranking(entry, block))
            position = lengths[layer]
            key = (self.session, position, layer, int(block))

    def _take_told(self, step: int) -> None:
        """A batch step's rows are told: its inputs that came whole before them, computed now."""
        for (_, position, layer, block), entry in list(self.inputs.items()):
            if position == step and not entry.done and entry.value() is not None:
                self._take(position, layer, Block(block), entry)

    def _fetch_missing(self) -> None:
        """Fetch each layer's next attention input once the master has clearly moved past it."""
        now_position, now_layer, now_block = self.latest_seen
        lengths = self._done()
        for layer in self.attn_layers:  # runs for every input: plain comparisons, no tuples
            position = lengths[layer]
            if position > now_position or (position == now_position and (
                    layer > now_layer or (layer == now_layer and now_block == Block.ATTN))):
                continue  # the master has not moved past this layer's next attention input yet
            key = (self.session, position, layer, int(Block.ATTN))
            entry = self.inputs.get(key)
            if entry is None:
                entry = self.inputs[key] = _Input(self.model.config.hidden, self._prefix(Block.ATTN))
            if entry.fetched or entry.value() is not None:
                continue
            entry.fetched = True
            self.channel.send(Fetch(self.session, position, layer, Block.ATTN))

    def _drop_stale_inputs(self) -> None:
        """Forget incomplete stateless inputs of finished steps and stray fragments of cached
        attention inputs: they will never be computed. Once a step, not on every block."""
        now, lengths = self.latest_seen[0], self._done()
        self.inputs = {k: v for k, v in self.inputs.items()
                       if (k[1] >= lengths[k[2]] if k[3] == Block.ATTN else k[1] >= now)}
        if self.steps:  # the rows of steps every layer's attention has taken
            done = min((lengths[layer] for layer in self.attn_layers), default=now)
            self.steps = {step: rows for step, rows in self.steps.items() if step >= done}

    def _done(self) -> list[int]:
        """Per layer, the next attention input the cache takes: a position, or in a batch session a step."""
        return self.step_done if self.batch else self.shard.lengths

    def _ranking(self, entry: _Input, block: Block) -> tuple[int, ...] | None:
        if self.priorities is None or block == Block.HEAD:
            return None
        if entry.ranking is not None or entry.reassembly is None:
            return entry.ranking
        return valid_ranking(entry.reassembly.prefix_bytes, self._units(block))

    def _compute_and_send(self, position: int, layer: int, block: Block, x: np.ndarray, output: bool = True,
                          ranking: tuple[int, ...] | None = None) -> None:
        x = x.reshape(-1, self.model.config.hidden)
        units = None
        if self.priorities is not None and block != Block.HEAD:
            if ranking is None:  # a forged or garbled ranking: compute only the cache, send nothing
                self.counters.reject("ranking")
                output = False
            else:
                units = [ranking[p] for p in self.priorities[0 if block == Block.ATTN else 1][layer]]
        started = time.perf_counter()
        # a batch's decode step: each row a sequence's, its numbers as it gets them alone (kernels.each_column_alone)
        step = self.steps.get(position) if self.batch else None
        alone = kernels.each_column_alone() if step is not None and len(step.slots) > 1 else contextlib.nullcontext()
        if block == Block.ATTN and self.batch:
            rows = self.steps[position]
            out = self.shard.step_attention(layer, x, rows.slots, rows.starts, rows.copy, rows.counts)
            self.step_done[layer] = position + 1
            out = out if output else None
        elif block == Block.ATTN:
            out = self.shard.attention(layer, x, position, output=output, units=units)
        elif block == Block.MLP:
            with alone:
                out = self.shard.mlp(layer, x, groups=units) if output else None
            if self.server is not None and x.shape[0] == 1:  # its datagram's copies then find it computed natively
                self.server.mlp_taken[layer] = position
        else:
            with alone:
                _, out = self.shard.logits(x)  # the rows the master sent: a request's last token, a batch's each one
            # the request's sampler, or the batch step's samplers, pick from no more: the rest stays here
            top = self.top if step is None else step.top or None
            if top is not None:
                out = head_top(out, top)
        took = time.perf_counter() - started
        if out is not None:
            self._send_partial(position, layer, block, x.shape[0], out)
            if self.trace is not None and x.shape[0] == 1:
                key = (self.session, position, layer, int(block))
                self.trace.add(Event.COMPUTED, key, started + took)
                self.trace.add(Event.REPLIED, key, time.perf_counter(), self.index)
        # Counted once the partial is out: the accounts are off the master's path.
        one_token = x.shape[0] == 1 and out is not None
        self.clock.took(took, one_token)
        if one_token and block != Block.HEAD:  # the layers' blocks (KernelFit)
            clock = self.clock
            clock.decode = clock.decode.add(
                self.shard.block_bytes(layer, block, None if units is None else len(units)), took)

    def _send_partial(self, position: int, layer: int, block: Block, seq: int, out: np.ndarray) -> None:
        step = self.steps.get(position) if self.batch else None
        route = self.routes.of(layer, block, seq if step is None else step.tokens(seq))
        # A mirrored partial's UDP copy first: the master takes it straight off its socket while it waits, and a
        # TCP copy that came first would hand its wait to the event loop.
        if route != Route.RELIABLE:
            header = Header(MsgType.PARTIAL, self.session, position, layer, block, self.index,
                            codec=Codec.F32 if route == Route.MIRRORED else self.codec, tokens=seq)
            master = self.master_udp
            mtu = native_mtu(header.codec, out.size, self.datagram_bytes, self.parity, seq)
            if self.fast is not None and (mtu == 0 or (mtu is not None and route == Route.DATAGRAM)):
                if self._to_master[0] != master:
                    self._to_master = (master, addresses([master]))
                # a lossy link's partial too long for one datagram is cut at the path, as wire.fragment cuts it
                sent = self.fast.send_vector(self.udp.sock.fileno(), header, as_f32(out), self._to_master[1],
                                             copies=1 + self.parity, mtu=mtu)
                self.udp.sent += max(sent, 0)
            else:
                count = fragments_of(header.codec, out.size, self.datagram_bytes)
                self.udp.send_all(fragment(header, out, self.key, self.datagram_bytes,
                                           parity=parity_fragments(self.parity, count)), master)
            if route == Route.MIRRORED and not self._keep_mirrored(header, out.copy()):
                return  # `out` is a buffer its block reuses: kept as a copy
        if route != Route.DATAGRAM:  # the frame is built before send returns: a view of `out` is copied once
            frame = self.channel.frame(Partial(self.session, position, layer, block,
                                               memoryview(as_f32(out)).cast("B")))
            self.channel.send_frame(frame)
            if seq > 1 and self.spare_used and self.spare is not None:  # a prompt's partial over a lossy link
                with contextlib.suppress(OSError, ConnectionError):
                    self.spare.send_frame(frame)

    def _keep_mirrored(self, header: Header, out: np.ndarray) -> bool:
        """A mirrored partial sent as datagrams, kept for the master's Resend requests; whether its stream copy
        goes too. A one-token partial goes as datagrams alone (with its link's parity): at 8 devices the stream
        copies of the first layer's and the LM head's partials were 21 frames a token for the master to read and
        drop, and on a lossy link sending one held the node's next input ~200 µs. One that is lost is asked for again
        (Resend), and where its input comes over the stream after all (the master's last resort) the kept partial
        answers it there. An input that came on the stream is always answered there."""
        streamed = header.tokens > 1 or self._from_stream
        self.kept_partials[(header.session, header.position, header.layer, header.block)] = (header, out, streamed)
        while len(self.kept_partials) > KEPT_PARTIALS:
            del self.kept_partials[next(iter(self.kept_partials))]
        return streamed

    def _stream_copy(self, header: Header, out: np.ndarray) -> None:
        """A mirrored partial (its datagrams' header) on the stream to the master."""
        self.channel.send(Partial(header.session, header.position, header.layer, Block(header.block),
                                  memoryview(as_f32(out)).cast("B")))

    def _served_mirrored(self) -> None:
        """The native server computed a mirrored one-token block and sent its partial: kept as _send_partial keeps
        one, its stream copy sent where the link wants one, and an MLP input marked done, so that the input's stream
        copy finds it computed (an attention input's does: the cache holds its position)."""
        position, layer, block, out = self.server.served()
        header = Header(MsgType.PARTIAL, self.session, position, layer, block, self.index, codec=Codec.F32, tokens=1)
        if self._keep_mirrored(header, out):
            self._stream_copy(header, out)
        if block == Block.MLP and (entry := self._entry(header._replace(type=MsgType.ACTIVATION),
                                                        self.model.config.hidden)) is not None:
            entry.done = True


def run_node(master: tuple[str, int], model_path: Path | None, key: bytes, name: str, budget_mb: float,
             speed: float, loss: LossModel | None, threads: int = 1, spin_s: float = 0.0,
             verbose: bool = False, trace: Path | None = None, device: str = "cpu") -> None:
    return_freed_memory()  # a node process holds a share and little else: what it frees goes back
    try:
        model = load_model(model_path)
    except EdgerunError as e:  # no usable local copy: the master's is fetched after joining
        print(f"{e}; will fetch the master's model", file=sys.stderr)
        model = None
    log = functools.partial(print, file=sys.stderr, flush=True)
    wait_s = JOIN_WAIT_S
    timeline = None if trace is None else Trace(trace, name)  # one file for every session it joins
    while True:  # a master that goes away may come back (restarted, or its network back): rejoin until Ctrl-C
        config = NodeConfig(master, name, budget_mb, speed, threads, spin_s, verbose, device, join_wait_s=wait_s)
        node = Node(config, model, key, loss, log=log, trace=timeline)
        node.run()
        model, wait_s = node.model, float("inf")
        log(f"node {name}: trying to rejoin the master at {master[0]}:{master[1]} until it is back (Ctrl-C stops)")
