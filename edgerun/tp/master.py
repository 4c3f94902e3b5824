"""`edgerun master`: runs one model tensor-parallel over its nodes and itself (HALO).

Per token, for each attention and MLP block the master normalizes the hidden state, sends it to the
nodes holding units of that block, computes its own share, and sums what has arrived when every
node's partial is complete or the timeout expires (a missing fragment contributes zero). The first
layer, the LM head and prefill steps go over TCP. Sampling happens here. A node that dies is dropped:
the master replans over the devices left and re-prefills the request.

Generation runs as a coroutine on the same event loop that receives the nodes' packets, so a
partial that arrives is merged without any thread hand-off; only planning, which blocks on replies,
runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.loader import Model
from edgerun.model.reference import rms_norm
from edgerun.model.sampling import Sampler
from edgerun.net.channel import (
    AsyncChannel,
    Counters,
    DatagramSocket,
    EventLoopThread,
    LossyUdp,
    add_fragment,
    path_datagram_bytes,
)
from edgerun.net.loss import LossModel
from edgerun.net.model_files import ModelServer, model_sha256
from edgerun.net.wire import (
    Added,
    Block,
    Codec,
    Header,
    MsgType,
    Reassembly,
    WireError,
    fragment,
    is_parity,
    peek_block,
    seal,
)
from edgerun.sap.predictor import PredictorSet
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, model_profile
from edgerun.sched.tp_plan import TPPlan, plan_tp
from edgerun.tp.messages import (
    Assign,
    BadMessage,
    BandwidthProbe,
    BandwidthReply,
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
    Welcome,
)
from edgerun.tp.node import settle_heap
from edgerun.tp.shard import QuantShard, Shard, ShardSpec, full_spec

MAPPINGS = ("index", "static", "dynamic")
NODE_SILENT_S = 3.0  # no heartbeat for this long: the node is gone
BW_PROBE_BYTES = 2 * 1024 * 1024
# Inputs of this many recent positions are kept for nodes that missed one and fetch it: a node may
# lag behind by a TCP retransmission timeout or more, which is several tokens on a fast cluster.
KEPT_POSITIONS = 64
OVERLAPS = ("pred", "load")
MAX_PARITY_COPIES = 4  # beyond a few copies, losing all of them is rarer than a lost burst of the data itself
# With --transport udp the reliable channel carries only the first layer, the LM head and fetches,
# all on the per-token path: a lost segment there should cost milliseconds, not the kernel's 200 ms
# minimum retransmission timeout. The strict tcp baseline keeps the kernel's (as distributed-llama).
FAST_RTO_MIN_MS = 5.0


def tcp_rto_min_ms(transport: str, override: float | None) -> float | None:
    """The reliable channel's minimum retransmission timeout: `override` (0: the kernel's), else
    FAST_RTO_MIN_MS for udp and the kernel's for tcp. None means the kernel's."""
    if override is not None:
        return override or None
    return FAST_RTO_MIN_MS if transport == "udp" else None


class NodeLost(Exception):
    """A node died while the master waited on its reply."""


class ArrivalEstimator:
    """When a node's partial arrives after the master sends the block's input, estimated as TCP
    estimates its retransmission timeout (RFC 6298): smoothed mean plus k mean deviations, but never
    below the slowest of the last `window` samples with a margin. Delays on a shared or virtual
    machine have a heavy tail (a descheduled process, a page fault) that mean plus deviations
    underestimates; a partial cut off while it was on its way costs accuracy with no packet lost at
    all, while waiting longer costs time only when a partial really was lost, which parity makes rare.
    Only partials that arrived whole are sampled: a lost one says nothing of the time (Karn's rule)."""

    def __init__(self, window: int = 256, tail_margin: float = 1.25) -> None:
        self.mean: float | None = None
        self.deviation = 0.0
        self.samples = 0
        self.window, self.tail_margin = window, tail_margin
        # (sample number, seconds) of the window's samples that no later sample exceeds, slowest first:
        # the window's maximum is the first, kept in O(1) per sample since bound() runs for every block.
        self.slowest: collections.deque[tuple[int, float]] = collections.deque()

    def observe(self, seconds: float) -> None:
        self.samples += 1
        while self.slowest and self.slowest[-1][1] <= seconds:
            self.slowest.pop()
        self.slowest.append((self.samples, seconds))
        if self.slowest[0][0] <= self.samples - self.window:
            self.slowest.popleft()
        if self.mean is None:
            self.mean, self.deviation = seconds, seconds / 2
            return
        self.deviation += (abs(seconds - self.mean) - self.deviation) / 4
        self.mean += (seconds - self.mean) / 8

    def bound(self, k: float) -> float | None:
        if self.mean is None:
            return None
        return max(self.mean + k * self.deviation, self.tail_margin * self.slowest[0][1])


@dataclass
class Timeouts:
    """When a lossy block stops waiting. Fixed: `fixed_s` after sending. Adaptive: at the latest of
    the participants' estimated arrivals after sending, and, once the first partial is in, at the
    latest of their estimated lags behind the first one. Most delay is common to all nodes (the
    master's own compute, a busy machine, a slow network), so lags are tighter than arrivals: a
    partial that is lost is given up on soon after its peers arrived. Both are kept within
    [floor_s, ceiling_s]; `initial_s` applies until every participant has `warmup` samples."""

    fixed_s: float | None
    deviations: float = 4.0  # k of the estimators' mean + k deviations (TCP's is 4)
    initial_s: float = 0.010
    floor_s: float = 0.001  # event-loop timers have millisecond resolution
    ceiling_s: float = 1.0
    warmup: int = 8

    def _bound(self, estimators: Sequence[ArrivalEstimator]) -> float | None:
        if self.fixed_s is not None or any(e.samples < self.warmup for e in estimators):
            return None
        return min(self.ceiling_s, max([self.floor_s, *(e.bound(self.deviations) for e in estimators)]))

    def after_send(self, arrivals: Sequence[ArrivalEstimator]) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        bound = self._bound(arrivals)
        return self.initial_s if bound is None else bound

    def after_first(self, lags: Sequence[ArrivalEstimator]) -> float | None:
        return self._bound(lags)


@dataclass
class NodeConn:
    index: int
    name: str
    channel: AsyncChannel
    host: str
    udp_port: int
    budget_mb: float
    speed: float
    alive: bool = True
    last_heard: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)
    spec: ShardSpec | None = None
    priorities: Priorities | None = None  # dynamic mapping
    rejected: int = 0  # packets the node refused, as its last heartbeat said
    prefetched: tuple[int, int] = (0, 0)  # load overlap: (weights used, gathered for the wrong units), as said
    link: Link | None = None  # measured when it joined
    datagram_bytes: int = 1472  # the largest UDP payload both ways between it and the master (path MTU)
    parity: int = 0  # parity copies after every vector on this link, both ways
    lossy: bool = False  # the link has lost a packet (or a partial came too late): parity from then on
    arrival: ArrivalEstimator = field(default_factory=ArrivalEstimator)  # seconds after the master sent
    lag: ArrivalEstimator = field(default_factory=ArrivalEstimator)  # seconds after the block's first partial
    pong: threading.Event = field(default_factory=threading.Event)
    pongs: list[float] = field(default_factory=list)
    echoes: int = 0
    # What the node reports: its share's sizes when ready, and with every heartbeat (every HEARTBEAT_S) its
    # kernels' time so far and its peak resident memory.
    weight_bytes: int = 0
    cache_bytes: int = 0
    compute_s: float = 0.0
    peak_rss_mb: float = 0.0
    heartbeats: int = 0


@dataclass
class StepStats:
    compute_s: float = 0.0
    pred_s: float = 0.0  # dynamic mapping: ranking units with the predictors
    wait_s: float = 0.0
    blocks: int = 0
    blocks_incomplete: int = 0  # lossy blocks merged without some node's full partial
    incomplete_wait_s: float = 0.0  # of wait_s, spent in blocks that ended incomplete: the price of lost partials
    partials_rebuilt: int = 0  # partials that lost a fragment and were rebuilt from the parity
    late_packets: int = 0
    max_overshoot_s: float = 0.0  # the longest a lossy block's wait ran past its deadline


@dataclass
class _Wait:
    """The block the master is merging: what each participant's reply is collected in (a reassembly
    for datagrams, None until a TCP reply lands), and a future resolved when all are in, a node is
    lost, or the deadline passes. The deadline moves earlier when the first partial arrives."""

    key: tuple[int, int, int, int]
    parts: dict[int, Reassembly | np.ndarray | None]
    future: asyncio.Future
    sent: float
    outstanding: int
    tokens: int  # the step's tokens: a partial holds one vector per token (the LM head's: the last token's)
    lag_bound: float | None = None  # how long after the first partial the others may still come
    deadline: float | None = None  # perf_counter time; None: wait for every reply
    timer: asyncio.TimerHandle | None = None
    timed: bool = False  # awaited on the event loop, with a timer for the deadline (else drained on the spot)
    arrived: dict[int, float] = field(default_factory=dict)  # node index -> seconds after sending

    def arrive(self, index: int) -> None:
        if index in self.arrived:
            return
        now = time.perf_counter()
        self.arrived[index] = now - self.sent
        self.outstanding -= 1
        if self.outstanding == 0:
            self.finish()
        elif len(self.arrived) == 1 and self.lag_bound is not None and self.deadline is not None:
            self.expire_at(min(self.deadline, now + self.lag_bound))

    def expire_at(self, deadline: float) -> None:
        self.deadline = deadline
        if not self.timed:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.future.get_loop().call_later(max(0.0, deadline - time.perf_counter()), self.finish)

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.future.done():
            self.future.set_result(None)

    def first(self) -> float:
        return min(self.arrived.values())


@dataclass(frozen=True)
class Assignment:
    """Dynamic mapping of one block at one position."""

    ranking: tuple[int, ...]  # units from the most to the least important (priority index -> unit)
    units: dict[str, tuple[int, ...]]  # device name -> the units it was handed


@dataclass(frozen=True)
class UnitOrder:
    """Per layer, the unit at each priority index (priority 0: the most important). The plan gives
    the most reliable devices the lowest priority indices (HALO Alg. 3)."""

    attn: tuple[tuple[int, ...], ...]
    mlp: tuple[tuple[int, ...], ...]

    @classmethod
    def index(cls, n_layers: int, attn_units: int, groups: int) -> UnitOrder:
        """Priority p is unit p: no knowledge of importance."""
        return cls((tuple(range(attn_units)),) * n_layers, (tuple(range(groups)),) * n_layers)


def unit_order_for(model: Model, sha256: str, mapping: str, predictors: PredictorSet | None,
                   group_size: int) -> UnitOrder:
    """The priority order of units: by index, or by the calibration's average importance."""
    c = model.config
    groups = -(-c.ffn // group_size)
    if mapping not in MAPPINGS:
        raise EdgerunError(f"unknown mapping {mapping!r} ({', '.join(MAPPINGS)})")
    if mapping == "index":
        return UnitOrder.index(c.n_layers, c.n_kv_heads, groups)
    if predictors is None:
        raise EdgerunError(f"mapping {mapping} needs predictors: run `edgerun sap calibrate` and `edgerun sap train`")
    if predictors.model_sha256 != sha256:
        raise EdgerunError(f"the predictors were trained on another model ({predictors.model_sha256[:12]}, not "
                           f"{sha256[:12]}): calibrate and train on this one")
    if predictors.group_size != group_size:
        raise EdgerunError(f"the predictors rank groups of {predictors.group_size}, not {group_size}")
    if mapping == "dynamic" and max(groups, c.n_kv_heads) > 256:  # a ranking travels as one byte per unit
        raise EdgerunError(f"dynamic mapping ranks at most 256 units per block; groups of {group_size} make "
                           f"{groups}: choose a larger --group-size")
    return UnitOrder(predictors.static_order(Block.ATTN, c.n_layers, c.n_kv_heads),
                     predictors.static_order(Block.MLP, c.n_layers, groups))


def spec_for_device(plan: TPPlan, i: int, group_size: int, vocab_block: int, order: UnitOrder) -> ShardSpec:
    """Device i's units: its priority indices through the unit order."""
    def units(layers: tuple, orders: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sorted(o[p] for p in layer[i])) for layer, o in zip(layers, orders, strict=True))

    return ShardSpec(attn_units=units(plan.attn, order.attn), mlp_groups=units(plan.mlp, order.mlp),
                     vocab_blocks=tuple(sorted(plan.vocab[i])), group_size=group_size, vocab_block=vocab_block)


def vocab_rows(blocks: Sequence[int], block_rows: int, vocab: int) -> np.ndarray:
    """LM-head rows of the given vocabulary blocks, in block order (the order a shard returns them)."""
    return np.concatenate([np.arange(b * block_rows, min((b + 1) * block_rows, vocab)) for b in blocks]
                          or [np.zeros(0, np.int64)])


@dataclass(frozen=True)
class MasterConfig:
    """How a tensor-parallel master runs. Change it with dataclasses.replace and Master.reconfigure."""

    strategy: str = "halo"  # tensor-parallel planner (sched.tp_plan.STRATEGIES)
    host: str = "0.0.0.0"
    port: int = 0  # 0: any free port
    transport: str = "udp"  # "udp": lossy layers over UDP with a timeout; "tcp": everything reliable
    codec: Codec = Codec.F32  # activations on the wire
    timeout_ms: float | None = 10.0  # a lossy block's fixed wait; None: adaptive
    timeout_deviations: float = 4.0  # the adaptive timeout's k
    rto_min_ms: float | None = None  # the reliable channel's minimum retransmission timeout (None: by transport)
    parity: int = 2  # parity copies after every vector on a lossy link, both ways
    parity_always: bool = False  # parity on clean links too
    max_len: int = 1024  # context length: KV cache per device
    budget_mb: float = 4096.0  # the master's own memory budget for its share
    speed: float = 1e9  # the master's own speed for the planner, weight bytes per second
    group_size: int = 256  # MLP neuron-group size
    vocab_block: int = 4096  # LM-head rows per unit
    mapping: str = "index"  # which units go where: "index", "static" or "dynamic" (MAPPINGS)
    # Dynamic mapping's two overlaps (HALO Fig. 5): pred ranks the next layer while this one's partials travel;
    # load has nodes predict the next layer's ranking themselves and gather their units' weights meanwhile.
    overlap: tuple[str, ...] = OVERLAPS
    threads: int = 1  # onnxruntime threads of the master's own share

    def __post_init__(self) -> None:
        unknown = set(self.overlap) - set(OVERLAPS)
        if unknown:
            raise EdgerunError(f"unknown overlap {sorted(unknown)} (choose from {', '.join(OVERLAPS)})")
        if not 0 <= self.parity <= MAX_PARITY_COPIES:
            raise EdgerunError(f"parity copies must be 0 to {MAX_PARITY_COPIES}, not {self.parity}")
        if self.transport not in ("udp", "tcp"):
            raise EdgerunError(f"unknown transport {self.transport!r} (udp or tcp)")
        if self.mapping not in MAPPINGS:
            raise EdgerunError(f"unknown mapping {self.mapping!r} ({', '.join(MAPPINGS)})")
        if self.threads < 1 or self.max_len < 1:
            raise EdgerunError("threads and max_len must be at least 1")


class Master:
    def __init__(self, model: Model, key: bytes, config: MasterConfig = MasterConfig(), *,
                 loss: LossModel | None = None, predictors: PredictorSet | None = None,
                 log: Callable[[str], None] = lambda _: None) -> None:
        """A master listening on config.host:config.port. Its settings change with reconfigure(), taking effect
        at the next replan (host and port stay those it listens on)."""
        self.model, self.key, self.predictors = model, key, predictors
        self.model_sha256 = model_sha256(model.path)
        self.reconfigure(config)
        host, port = config.host, config.port
        # Dynamic mapping, per recent (session, position, layer, block): the ranking and what each device got.
        self.assignments: dict[tuple[int, int, int, int], Assignment] = {}
        self.own_priorities: Priorities = ((), ())
        self.log = log
        self.model_server = ModelServer(model.path, self.model_sha256, host)
        self.udp = LossyUdp(key, host, 0, loss)  # sends; datagrams arrive on self.datagrams
        self.counters = Counters()
        self.cond = threading.Condition()  # membership: nodes joining and leaving
        self.nodes: list[NodeConn] = []
        self.session = 0
        self.position = 0
        self.shard: QuantShard | Shard | None = None
        self.plan: TPPlan | None = None
        self.routes = Routes.for_transport(config.transport, model.config.n_layers)
        # Loop-thread state: inputs kept for fetches, fetches of inputs not sent yet, the block in merge.
        self.recent_inputs: dict[tuple[int, int, int, int], bytes] = {}
        self.pending_fetch: dict[tuple[int, int, int, int], list[NodeConn]] = {}
        self.wait: _Wait | None = None
        self.merged: _Wait | None = None  # the block merged last, whose late partials still teach lags
        self.mirrors: dict[tuple[int, int, int, int], _Wait] = {}  # recent mirrored blocks, for their second copies
        self.stats = StepStats()
        self.running = True
        self.net = EventLoopThread()
        self.datagrams = DatagramSocket(host, key, self.counters, self._on_datagram, self._redundant)
        self.udp_port = self.datagrams.port
        self.server = self.net.run(self._listen(host, port))
        self.port = self.server.sockets[0].getsockname()[1]

    def reconfigure(self, config: MasterConfig) -> None:
        """Take new settings (`dataclasses.replace(master.config, ...)`); the next replan applies them."""
        self.unit_order = unit_order_for(self.model, self.model_sha256, config.mapping, self.predictors,
                                         config.group_size)
        self.timeouts = Timeouts(None if config.timeout_ms is None else config.timeout_ms / 1000,
                                 config.timeout_deviations)
        self.config = config

    async def _listen(self, host: str, port: int) -> asyncio.Server:
        server = await asyncio.start_server(self._serve_node, host, port)
        self.watch_task = asyncio.get_running_loop().create_task(self._watch())
        self.datagrams.attach(asyncio.get_running_loop())
        return server

    # --- membership ----------------------------------------------------------------------------
    async def _serve_node(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = AsyncChannel(reader, writer, self.key, self.net.loop)
        addr = writer.get_extra_info("peername")
        node: NodeConn | None = None
        try:
            message = await asyncio.wait_for(channel.receive(), 10)
            if not isinstance(message, Register):
                raise WireError("first message must register")
            channel.send(Welcome(self.model_sha256, self.model_server.port, self.udp_port))
            with self.cond:
                node = NodeConn(len(self.nodes) + 1, message.name, channel, addr[0], message.udp_port,
                                message.budget_mb, message.speed)
                # Both directions' path MTU: the node measured its way here, the master measures its way there.
                node.datagram_bytes = min(message.datagram_bytes, path_datagram_bytes(node.host, node.udp_port))
                self.nodes.append(node)
                self.cond.notify_all()
            self.log(f"node {node.name} joined from {addr[0]}")
            while self.running:
                try:
                    message = await channel.receive()
                except BadMessage:
                    self.counters.reject("message")
                    continue
                node.last_heard = time.monotonic()
                self._node_message(node, message)
        except (ConnectionError, OSError, WireError, ValueError, TimeoutError) as e:
            if node is None:
                self.counters.reject("registration")
            else:
                self.log(f"node {node.name} lost ({e})")
        finally:
            channel.close()
            if node is not None:
                with self.cond:
                    node.alive = False
                    self.cond.notify_all()
                if self.wait is not None and node.index in self.wait.parts:
                    self.wait.finish()  # the block's coroutine sees the loss and replans

    async def _watch(self) -> None:
        while self.running:
            await asyncio.sleep(0.5)
            for node in list(self.nodes):
                if node.alive and time.monotonic() - node.last_heard > NODE_SILENT_S:
                    self.log(f"node {node.name} silent for {NODE_SILENT_S} s")
                    node.channel.close()  # its reader then ends and marks it dead

    def _node_message(self, node: NodeConn, message: Message) -> None:
        match message:
            case Ready(_, weight_bytes, cache_bytes):
                node.weight_bytes, node.cache_bytes = weight_bytes, cache_bytes
                node.ready.set()
            case Pong() | BandwidthReply():
                node.pongs.append(time.perf_counter())
                node.pong.set()
            case Heartbeat(rejected, hits, misses, compute_s, rss_mb):
                node.rejected, node.prefetched, node.compute_s, node.peak_rss_mb = \
                    rejected, (hits, misses), compute_s, rss_mb
                node.heartbeats += 1
            case Fetch(session, position, layer, block):  # the node lost an input
                self._saw_loss(node)
                key = (session, position, layer, int(block))
                kept = self.recent_inputs.get(key)
                if kept is None:  # not sent yet (or long gone): answered when it is sent
                    self.pending_fetch.setdefault(key, []).append(node)
                else:
                    self._send_input(node, key, *kept)
            case Partial(session, position, layer, block, vector):
                key = (session, position, layer, int(block))
                w = self.wait
                if w is not None and key == w.key and node.index in w.parts and node.index not in w.arrived:
                    if len(vector) != 4 * self._reply_size(node, block, w.tokens):
                        self.counters.reject("misfit")
                        return
                    w.parts[node.index] = np.frombuffer(vector, "<f4").astype(np.float32)
                    w.arrive(node.index)
                elif not self._mirror_copy(key, node.index):
                    self.stats.late_packets += 1
            case _:
                self.counters.reject("unexpected")

    def _saw_loss(self, node: NodeConn) -> None:
        """A packet on this node's link went missing (or came too late to count): parity both ways from now on."""
        if node.lossy or not self.config.parity:
            node.lossy = True
            return
        node.lossy, node.parity = True, self.config.parity
        self.log(f"node {node.name}: a packet went missing; {self.config.parity} parity copies on its link from now on")
        with contextlib.suppress(OSError, ConnectionError):
            node.channel.send(ParityOn(self.config.parity))

    def _send_input(self, node: NodeConn, key: tuple[int, int, int, int], data: bytes,
                    ranking: tuple[int, ...] | None) -> None:
        session, position, layer, block = key
        with contextlib.suppress(OSError, ConnectionError):
            node.channel.send(Input(session, position, layer, Block(block), ranking, data))

    def _on_datagram(self, header: Header, payload: bytes, _: tuple[str, int]) -> None:
        if header.type == MsgType.PROBE:
            for node in self.nodes:
                if node.index == header.node:
                    node.echoes += 1
            return
        if header.type != MsgType.PARTIAL:
            self.counters.reject("unexpected")
            return
        w = self.wait
        key = (header.session, header.position, header.layer, header.block)
        target = None if w is None or key != w.key else w.parts.get(header.node)
        if isinstance(target, Reassembly) and header.node not in w.arrived:
            if add_fragment(target, header, payload, self.counters):
                w.arrive(header.node)
            return
        if self._mirror_copy(key, header.node):
            return
        if not is_parity(header):  # the parity of a partial already merged is expected, not late
            self.stats.late_packets += 1
        self._late(key, header, payload)

    def _redundant(self, data: bytes) -> bool:
        """A datagram of a partial already whole in the block being merged or the one merged last (a parity copy
        after its data): nothing to learn from it, so it is dropped before its MAC is checked."""
        peeked = peek_block(data)
        if peeked is None:
            return False
        key, node = peeked[:4], peeked[4]
        return any(w is not None and w.key == key and node in w.arrived for w in (self.wait, self.merged))

    def _mirror_copy(self, key: tuple[int, int, int, int], node: int) -> bool:
        """True for the second copy of a mirrored block's reply: its first copy is in, so nothing is late."""
        w = self.mirrors.get(key)
        return w is not None and node in w.arrived

    def _late(self, key: tuple[int, int, int, int], header: Header, payload: bytes) -> None:
        """A partial of the block just merged that completes late still teaches its node's lag, so the
        estimate is not made only of partials that beat the deadline (which would shrink it)."""
        w = self.merged
        target = None if w is None or key != w.key or not w.arrived else w.parts.get(header.node)
        if not isinstance(target, Reassembly) or header.node in w.arrived:
            return
        with contextlib.suppress(WireError):
            if target.add(header, payload) is Added.COMPLETED:
                lag = time.perf_counter() - w.sent - w.first()
                for node in self.nodes:
                    if node.index == header.node:
                        node.lag.observe(lag)

    def wait_for_nodes(self, n: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while sum(node.alive for node in self.nodes) < n:
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise EdgerunError(f"only {sum(nd.alive for nd in self.nodes)} of {n} nodes joined "
                                       f"within {timeout_s:.0f} s")

    # --- planning (blocks on the nodes' replies: never on the loop thread) -------------------------
    def measure_link(self, node: NodeConn, pings: int = 7, probes: int = 200) -> Link:
        """RTT: median of TCP pings. Loss: UDP probes the node echoes; a probe is lost if either
        direction drops it, so the one-way rate is 1 - sqrt(1 - round-trip rate). Bandwidth: a timed
        TCP exchange, taken as symmetric."""
        rtts = []
        for seq in range(pings):
            node.pong.clear()
            sent = time.perf_counter()
            node.channel.send(Ping(seq))
            if node.pong.wait(2.0):
                rtts.append(node.pongs[-1] - sent)
        node.echoes = 0
        for seq in range(probes):
            header = Header(MsgType.PROBE, 0, seq, node=node.index)
            self.udp.send_all([seal(header, b"", self.key)], (node.host, node.udp_port))
            time.sleep(0.0005)
        time.sleep(0.2)
        round_trip = 1.0 - min(node.echoes, probes) / probes
        loss_rate = 1.0 - (1.0 - round_trip) ** 0.5
        rtt_ms = float(np.median(rtts)) * 1e3 if rtts else 1000.0
        # Bandwidth: a payload each way over TCP; the node answers "bw" with a payload of the size asked.
        node.pong.clear()
        sent = time.perf_counter()
        node.channel.send(BandwidthProbe(BW_PROBE_BYTES, bytes(BW_PROBE_BYTES)))
        if not node.pong.wait(30.0):
            return Link(rtt_ms=rtt_ms, up_mbit=1.0, down_mbit=1.0, loss_rate=loss_rate)
        # Two transfers and one round trip in that time; each direction gets half.
        mbit = 2 * BW_PROBE_BYTES * 8 / max(node.pongs[-1] - sent - rtt_ms / 1e3, 1e-6) / 1e6
        return Link(rtt_ms=rtt_ms, up_mbit=mbit, down_mbit=mbit, loss_rate=loss_rate)

    def _device(self, name: str, budget_mb: float, speed: float, link: Link | None = None) -> DeviceProfile:
        return DeviceProfile(name=name, kind="node", cores=1, compute=Compute(0.0, speed),
                             memory=Memory(budget_mb, budget_mb, budget_mb, 0.0),
                             link=link or Link(0.0, 10_000.0, 10_000.0, 0.0))

    def replan(self) -> TPPlan:
        """Plan over the master and every live node, hand out shares, wait until all are loaded."""
        alive = [n for n in self.nodes if n.alive]
        for node in alive:
            if node.link is None:
                node.link = self.measure_link(node)
                self.log(f"node {node.name}: RTT {node.link.rtt_ms:.2f} ms, loss {node.link.loss_rate:.1%}, "
                         f"{node.link.up_mbit:.0f} Mbit/s")
        devices = [self._device("master", self.config.budget_mb, self.config.speed)] + \
                  [self._device(n.name, n.budget_mb, n.speed, n.link) for n in alive]
        profile = model_profile(self.model.name, self.model.config, self.model.weights, context=self.config.max_len,
                                group_size=self.config.group_size, vocab_block=self.config.vocab_block)
        try:
            plan = plan_tp(profile, devices, self.config.strategy)
        except ValueError as e:
            raise EdgerunError(str(e)) from e
        if plan.oom_devices:
            raise EdgerunError(f"plan {self.config.strategy} runs out of memory on "
                               f"{', '.join(o.name for o in plan.oom_devices)}")
        self.session += 1
        self.plan = plan
        self.routes = Routes.for_transport(self.config.transport, self.model.config.n_layers)
        own = spec_for_device(plan, 0, self.config.group_size, self.config.vocab_block, self.unit_order)
        if self.config.mapping == "dynamic":  # every device holds every unit and computes those it is handed
            full = full_spec(self.model.config, self.config.group_size, self.config.vocab_block)
            own = replace(full, vocab_blocks=own.vocab_blocks)
            self.own_priorities = (tuple(layer[0] for layer in plan.attn), tuple(layer[0] for layer in plan.mlp))
        self.shard = None  # the old share goes before the new one is built
        rto_min = tcp_rto_min_ms(self.config.transport, self.config.rto_min_ms)
        # Nodes can only gather their next units' weights ahead when the predictors read one layer ahead.
        prefetch = self.config.mapping == "dynamic" and "load" in self.config.overlap and self.predictors.ahead
        predictor_bytes = self.predictors.to_bytes() if prefetch and self.predictors is not None else b""
        for i, node in enumerate(alive, start=1):
            lossy = self.config.parity_always or node.lossy or (node.link is not None and node.link.loss_rate > 0)
            node.parity = self.config.parity if lossy else 0
            node.spec = spec_for_device(plan, i, self.config.group_size, self.config.vocab_block, self.unit_order)
            node.priorities = ((tuple(layer[i] for layer in plan.attn), tuple(layer[i] for layer in plan.mlp))
                               if self.config.mapping == "dynamic" else None)
            node.channel.set_rto_min(rto_min)
            node.index = i
            node.arrival, node.lag = ArrivalEstimator(), ArrivalEstimator()  # a new share takes another time
            node.ready.clear()
            node.channel.send(Assign(self.session, i, node.spec, self.config.max_len, self.config.codec, self.routes,
                                     self.udp_port, rto_min, node.parity, node.datagram_bytes, node.priorities,
                                     prefetch, predictor_bytes))
        # The master builds its own share while the nodes build theirs.
        if self.config.mapping == "dynamic":
            self.shard = Shard(self.model.config, self.model.weights, own, self.config.max_len)
        else:
            self.shard = QuantShard(self.model.config, self.model.weights, own, self.config.max_len,
                                    self.config.threads, mapped_files=[self.model.path])
        settle_heap()
        for node in alive:
            if not node.ready.wait(120):
                raise EdgerunError(f"node {node.name} did not load its share within 120 s")
        self.log(f"plan {self.config.strategy}: " + ", ".join(
            f"{name} {mem / 1e6:.1f} MB" for name, mem in zip(plan.devices, plan.memory_bytes, strict=True)))
        if self.config.mapping == "dynamic":
            self.log(f"dynamic mapping: every device holds every unit ({self.shard.weight_bytes / 1e6:.0f} MB of "
                     "float32 weights) and computes the share above of the units ranked for each token")
            if not self.predictors.ahead and self.config.overlap:
                self.log("the predictors read each block's own input: ranking runs on the critical path, without "
                         "the pred and load overlaps (train with --reads ahead for them)")
        else:
            self.log(f"master: {self.shard.weight_bytes / 1e6:.1f} MB of quantized weights, "
                     f"{self.shard.cache_bytes / 1e6:.1f} MB of KV cache")
        return plan

    # --- generation (on the loop thread) ------------------------------------------------------------
    def _reset(self) -> None:
        self.session += 1
        self.recent_inputs.clear()
        self.mirrors.clear()
        self.pending_fetch.clear()
        self.shard.truncate(0)
        for node in self.nodes:
            if node.alive:
                with contextlib.suppress(OSError, ConnectionError):
                    node.channel.send(Reset(self.session))
        self.position = 0

    def _participants(self, layer: int, block: Block) -> list[NodeConn]:
        def holds(node: NodeConn) -> bool:
            if block == Block.HEAD:
                return bool(node.spec.vocab_blocks)
            if node.priorities is not None:
                return bool(node.priorities[0 if block == Block.ATTN else 1][layer])
            return bool((node.spec.attn_units if block == Block.ATTN else node.spec.mlp_groups)[layer])

        return [n for n in self.nodes if n.alive and n.spec is not None and holds(n)]

    def _rank(self, layer: int, block: Block, features: np.ndarray | None) -> tuple[int, ...] | None:
        """Dynamic mapping: the block's units from the most to the least important, predicted from
        what the predictors read (HALO's Pred); the static order where there is nothing to read.
        A multi-token step takes one ranking, from the predictions' mean over its tokens."""
        if self.config.mapping != "dynamic":
            return None
        order = self.unit_order.attn[layer] if block == Block.ATTN else self.unit_order.mlp[layer]
        if layer == 0 or features is None:
            return order
        started = time.perf_counter()
        ranking = self.predictors.rank(layer, block, features)
        self.stats.pred_s += time.perf_counter() - started
        return ranking

    async def _block(self, layer: int, block: Block, x: np.ndarray, start: int,
                     ranking: tuple[int, ...] | None = None,
                     while_waiting: Callable[[], None] | None = None) -> np.ndarray:
        """This block's output: the master's share plus every node's partial that arrived in time.
        `while_waiting` runs after the inputs are sent and the master's share is computed, before waiting
        for the nodes (HALO's Pred overlapped with Comm)."""
        loop = asyncio.get_running_loop()
        seq = x.shape[0]
        key = (self.session, start, layer, int(block))
        nodes = self._participants(layer, block)
        route = self.routes.of(layer, block, seq)
        reliable, mirror, over_udp = route != Route.DATAGRAM, route == Route.MIRRORED, route != Route.RELIABLE
        data = np.ascontiguousarray(x, "<f4").tobytes()
        self.recent_inputs[key] = (data, ranking)
        for node in self.pending_fetch.pop(key, []):
            self._send_input(node, key, data, ranking)
        own_units = None
        if ranking is not None:
            kind = 0 if block == Block.ATTN else 1
            own_units = tuple(ranking[p] for p in self.own_priorities[kind][layer])
            self.assignments[key] = Assignment(ranking, {"master": own_units} | {
                n.name: tuple(ranking[p] for p in n.priorities[kind][layer]) for n in nodes})
        sent = time.perf_counter()
        w = self.wait = _Wait(key, {n.index: Reassembly(self._reply_size(n, block, seq), n.datagram_bytes)
                                    if over_udp else None for n in nodes}, loop.create_future(), sent, len(nodes), seq)
        if mirror:
            self.mirrors[key] = w
        if reliable:
            for node in nodes:
                self._send_input(node, key, data, ranking)
        if nodes and over_udp:  # nodes on paths of one MTU get the same datagrams: encode and seal them once
            header = Header(MsgType.ACTIVATION, self.session, start, layer, block, 0,
                            codec=Codec.F32 if mirror else self.config.codec, tokens=seq)
            datagrams: dict[int, tuple[list[bytes], list[bytes]]] = {}  # datagram size -> (data, parity copies)
            copies = max(n.parity for n in nodes)
            for node in nodes:
                if node.datagram_bytes not in datagrams:
                    sealed = fragment(header, x.reshape(-1), self.key, node.datagram_bytes, parity=copies,
                                      prefix=b"" if ranking is None else bytes(ranking))
                    datagrams[node.datagram_bytes] = (sealed[:len(sealed) - copies], sealed[len(sealed) - copies:])
            # Every node's data first, then the parity copies: the last node's input does not wait behind them.
            for node in nodes:
                self.udp.send_all(datagrams[node.datagram_bytes][0], (node.host, node.udp_port))
            for node in nodes:
                if node.parity:
                    self.udp.send_all(datagrams[node.datagram_bytes][1][:node.parity], (node.host, node.udp_port))
        compute_start = time.perf_counter()
        if block == Block.ATTN:
            out = self.shard.attention(layer, x, start, units=own_units)
        elif block == Block.MLP:
            out = self.shard.mlp(layer, x, groups=own_units)
        else:  # the LM head: this device's vocabulary rows, computed while the nodes compute theirs
            logits = np.zeros(self.model.config.vocab_size, np.float32)
            rows, own = self.shard.logits(x[-1:])
            logits[rows] = own[-1]
            out = logits
        wait_start = time.perf_counter()
        self.stats.compute_s += wait_start - compute_start
        if while_waiting is not None:
            while_waiting()
        # When the partials should be in: a lossy block's deadline, and how long a mirrored one drains for.
        expected = sent + self.timeouts.after_send([n.arrival for n in nodes])
        if not reliable:
            w.lag_bound = self.timeouts.after_first([n.lag for n in nodes])
            w.deadline = expected
        if over_udp and w.outstanding:
            # The lean path: partials are taken straight off the socket on this thread until the block is whole
            # or its deadline passes. A mirrored block (no deadline) drains so long for its UDP copies, then waits
            # for its TCP copies on the loop. Data on a participant's TCP stream (a reply, a heartbeat, a closed
            # connection) hands the wait to the event loop, which reads it.
            watch = [fd for fd in (n.channel.fileno() for n in nodes) if fd >= 0]
            self.datagrams.drain(lambda: w.outstanding == 0, lambda: expected if w.deadline is None else w.deadline,
                                 watch)
        if w.outstanding and not any(not n.alive for n in nodes) and (
                reliable or w.deadline is None or time.perf_counter() < w.deadline):
            w.timed = True
            if w.deadline is not None:
                w.expire_at(w.deadline)
            await w.future
        w.finish()
        self.wait, self.merged = None, w
        ended = time.perf_counter()
        self.stats.wait_s += ended - wait_start
        lost = [n for n in nodes if not n.alive]
        if lost:  # its units are gone for every later step too: replan
            raise NodeLost(lost[0].name)
        if w.deadline is not None and w.outstanding:
            self.stats.max_overshoot_s = max(self.stats.max_overshoot_s, ended - w.deadline)
        self.stats.blocks += 1
        if w.outstanding:
            self.stats.blocks_incomplete += 1
            for node in nodes:
                if node.index not in w.arrived:
                    self._saw_loss(node)
            self.stats.incomplete_wait_s += ended - wait_start
        self.stats.partials_rebuilt += sum(isinstance(p, Reassembly) and p.recovered for p in w.parts.values())
        if not reliable and w.arrived:
            first = w.first()
            for node in nodes:
                if node.index in w.arrived:
                    node.arrival.observe(w.arrived[node.index])
                    node.lag.observe(w.arrived[node.index] - first)
        if block == Block.HEAD:
            return self._assemble_logits(out, nodes, w.parts)
        out = np.array(out)  # a share's one-token output is a buffer its block reuses
        for part in w.parts.values():
            if part is not None:
                vector = part.vector if isinstance(part, Reassembly) else part
                out += vector.reshape(out.shape)
        return out

    def _reply_size(self, node: NodeConn, block: Block, seq: int) -> int:
        """Elements of a node's partial: its vocabulary rows of the last token for the LM head."""
        if block == Block.HEAD:
            return len(vocab_rows(node.spec.vocab_blocks, node.spec.vocab_block, self.model.config.vocab_size))
        return seq * self.model.config.hidden

    def _assemble_logits(self, logits: np.ndarray, nodes: list[NodeConn], parts: dict) -> np.ndarray:
        """The master's logits with every node's rows filled in."""
        for node in nodes:
            node_rows = vocab_rows(node.spec.vocab_blocks, node.spec.vocab_block, self.model.config.vocab_size)
            part = parts[node.index]
            vector = part.vector if isinstance(part, Reassembly) else part
            logits[node_rows] = vector.reshape(-1)[-len(node_rows):]
        return logits

    async def _step(self, tokens: Sequence[int]) -> np.ndarray:
        # Blocks drained on the spot never yield: let the loop read the nodes' streams (heartbeats) once a step.
        await asyncio.sleep(0)
        c = self.model.config
        x = self.model.weights.token_embd.dequantize_rows(np.asarray(tokens, np.int64))
        start = self.position
        weights = self.model.weights
        # Dynamic mapping ranks each block's units. Predictors that read one layer ahead rank a layer from the
        # previous layer's attention input: with the pred overlap while that layer's MLP partials travel,
        # without it on the path. Predictors that read the block's own input rank on the path, from the input
        # about to be sent.
        ahead = self.config.mapping == "dynamic" and self.predictors.ahead
        overlap_pred = ahead and "pred" in self.config.overlap
        previous_input = None
        predicted: dict[Block, tuple[int, ...] | None] = {}  # the next layer's rankings, made while waiting
        for layer in range(c.n_layers):
            lw = weights.layers[layer]
            ranked, predicted = predicted, {}
            attn_input = rms_norm(x, lw.attn_norm, c.norm_eps)
            features = previous_input if ahead else attn_input
            attn_ranking = ranked[Block.ATTN] if ranked else self._rank(layer, Block.ATTN, features)
            x = x + await self._block(layer, Block.ATTN, attn_input, start, attn_ranking)
            mlp_input = rms_norm(x, lw.ffn_norm, c.norm_eps)
            features = previous_input if ahead else mlp_input
            mlp_ranking = ranked[Block.MLP] if ranked else self._rank(layer, Block.MLP, features)

            def predict_next(layer: int = layer + 1, features: np.ndarray = attn_input,
                             into: dict[Block, tuple[int, ...] | None] = predicted) -> None:
                into.update({b: self._rank(layer, b, features) for b in (Block.ATTN, Block.MLP)})

            x = x + await self._block(layer, Block.MLP, mlp_input, start, mlp_ranking,
                                      while_waiting=predict_next if overlap_pred and layer + 1 < c.n_layers else None)
            previous_input = attn_input
        self.position = start + len(tokens)
        oldest = self.position - KEPT_POSITIONS
        self.recent_inputs = {k: v for k, v in self.recent_inputs.items() if k[1] >= oldest}
        self.mirrors = {k: v for k, v in self.mirrors.items() if k[1] >= oldest}
        self.assignments = {k: v for k, v in self.assignments.items() if k[1] >= oldest}
        return await self._block(0, Block.HEAD, rms_norm(x[-1:], weights.output_norm, c.norm_eps), start)

    async def _generate(self, prompt: Sequence[int], max_tokens: int, sampler: Sampler, stop_ids: frozenset[int],
                        on_token: Callable[[int], None] | None) -> list[int]:
        tokens: list[int] = []
        while True:
            try:
                self._reset()
                logits = await self._step(list(prompt) + tokens)
                while len(tokens) < max_tokens:
                    token = sampler(logits, len(prompt) + len(tokens))
                    if token in stop_ids:
                        return tokens
                    tokens.append(token)
                    if on_token:
                        on_token(token)
                    if len(tokens) < max_tokens:
                        logits = await self._step([token])
                return tokens
            except NodeLost as e:
                self.log(f"node {e} lost mid-generation: replanning and re-prefilling {len(prompt) + len(tokens)} "
                         "tokens")
                await asyncio.get_running_loop().run_in_executor(None, self.replan)

    # --- the blocking interface, for callers outside the loop -------------------------------------
    def reset(self) -> None:
        """Start a new request: every device forgets its KV cache."""
        self.net.call(self._reset)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens after those already seen; the last token's logits."""
        return self.net.run(self._step(tokens))

    def generate(self, prompt: Sequence[int], max_tokens: int, sampler: Sampler,
                 stop_ids: frozenset[int] = frozenset(), on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy or sampled generation; a node lost midway triggers a replan and a re-prefill of
        the prompt and the tokens so far, and generation goes on. `on_token` runs on the loop thread."""
        if len(prompt) + max_tokens > self.config.max_len:
            raise EdgerunError(f"prompt plus max tokens exceeds the context of {self.config.max_len}")
        return self.net.run(self._generate(prompt, max_tokens, sampler, stop_ids, on_token))

    def fresh_reports(self, timeout_s: float = 3.0) -> list[NodeConn]:
        """The live nodes, once each has sent a heartbeat after this call (so its counters cover what ran
        before it), or after timeout_s."""
        nodes = [n for n in self.nodes if n.alive]
        seen = {n.index: n.heartbeats for n in nodes}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(n.heartbeats <= seen[n.index] for n in nodes if n.alive):
            time.sleep(0.02)
        return [n for n in nodes if n.alive]

    def lost_nodes(self) -> list[str]:
        return [n.name for n in self.nodes if not n.alive and n.spec is not None]

    def close(self) -> None:
        self.running = False
        for node in self.nodes:
            if node.alive:
                with contextlib.suppress(OSError, ConnectionError):
                    node.channel.send(Shutdown())
        self.net.run(self._close_listeners())
        self.net.stop()
        self.udp.close()
        self.model_server.close()

    async def _close_listeners(self) -> None:
        self.watch_task.cancel()
        self.server.close()
        self.datagrams.close()
        for node in self.nodes:
            node.channel.close()
