"""The membership of a tensor-parallel master: nodes joining over TCP, their heartbeats and silence, and the probes
that measure each node's link (RTT, loss, bandwidth). Messages that belong to the block exchange (partials,
fetches) are handed on to it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.net.channel import (
    Counters,
    EventLoopThread,
    FrameReader,
    LossyUdp,
    path_datagram_bytes,
)
from edgerun.net.group import PROBE_LAYER
from edgerun.net.wire import KEY_REJECTED, BadMac, Header, MsgType, WireError, seal
from edgerun.sched.profiles import Link
from edgerun.tp.channel import AsyncChannel
from edgerun.tp.kernel_fit import KernelFit
from edgerun.tp.messages import (
    Assign,
    BandwidthProbe,
    BandwidthReply,
    Heartbeat,
    Message,
    Partial,
    Ping,
    Pong,
    Priorities,
    Ready,
    Register,
    Spare,
    Welcome,
)
from edgerun.tp.shard import ShardSpec
from edgerun.tp.timeouts import ArrivalEstimator

NODE_SILENT_S = 3.0  # no heartbeat for this long: the node is gone
BW_PROBE_BYTES = 2 * 1024 * 1024


MIN_SYNC_BLOCKS = 200  # a node's synchronization time is measured over at least this many blocks


@dataclass
class NodeConn:
    """What the master knows of one node: its connection, its share and its link, and what it reports."""

    index: int
    name: str
    channel: AsyncChannel
    host: str
    udp_port: int
    budget_mb: float
    speed: float
    alive: bool = True
    spare: AsyncChannel | None = None  # its second stream, once it opened one (Assign.spare_stream)
    spare_partials: int = 0  # prompt partials that came on it (the first or the second copy)
    segments: tuple[int, int] | None = None  # its first stream's (sent, sent again) when last looked at
    device: str = ""  # what it says it runs on
    last_heard: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)
    assign: Assign | None = None  # its share in the running plan, and how it talks to the master
    rejected: int = 0  # packets the node refused, as its last heartbeat said
    link: Link | None = None  # measured when it joined
    datagram_bytes: int = 1472  # the largest UDP payload both ways between it and the master (path MTU)
    parity: int = 0  # parity fragments after every vector on this link, both ways (net.erasure)
    lossy: bool = False  # the link has lost a packet (or a partial came too late): parity from then on
    arrival: ArrivalEstimator = field(default_factory=ArrivalEstimator)  # seconds after the master sent
    lag: ArrivalEstimator = field(default_factory=ArrivalEstimator)  # seconds after the block's first partial
    pong: threading.Event = field(default_factory=threading.Event)
    pongs: list[float] = field(default_factory=list)
    echoes: int = 0
    in_group: bool = False  # it echoed a probe sent to the master's multicast group: its inputs may go there
    # What the node reports: its share's sizes when ready, and with every heartbeat (every HEARTBEAT_S) its
    # kernels' time so far and its peak resident memory.
    weight_bytes: int = 0
    cache_bytes: int = 0
    q8_inputs: bool = False  # its share's inputs may come as Q8 at no cost to its bits (Ready.q8_inputs)
    compute_s: float = 0.0
    session_compute: tuple[int, float] = (0, 0.0)  # (session, its kernels' seconds in it so far)
    session_decode: tuple[int, float] = (0, 0.0)  # (session, its one-token blocks' kernel seconds in it so far)
    peak_rss_mb: float = 0.0
    heartbeats: int = 0
    decode: KernelFit = field(default_factory=KernelFit)  # its layers' one-token blocks on its current share
    decode_s: float = 0.0  # the kernel time of all its one-token blocks, the LM head's too
    call_cost: tuple[int, float] = (0, 0.0)  # one-token share calls, and their seconds beyond the kernels' graph
    native_blocks: int = 0  # one-token blocks its native server computed
    # One-token blocks on its current share whose partial arrived, the seconds from sending each input to its
    # partial's arrival, and both as they stood when its last heartbeat (with `decode`) came.
    arrival_s: float = 0.0
    arrival_blocks: int = 0
    reported_arrivals: tuple[float, int] = (0.0, 0)

    @property
    def spec(self) -> ShardSpec | None:
        return None if self.assign is None else self.assign.spec

    @property
    def priorities(self) -> Priorities | None:
        """Dynamic mapping: the units it computes, by priority index."""
        return None if self.assign is None else self.assign.priorities

    @property
    def rto_min_ms(self) -> float | None:
        """Both streams' minimum retransmission timeout, as its assignment said (None: the kernel's)."""
        return None if self.assign is None else self.assign.rto_min_ms

    def reset_estimators(self) -> None:
        self.arrival, self.lag = ArrivalEstimator(), ArrivalEstimator()
        self.arrival_s, self.arrival_blocks, self.reported_arrivals = 0.0, 0, (0.0, 0)

    @property
    def sync_s(self) -> float | None:
        """What a one-token block of this node takes beyond its kernels (its input's way there, its own work around
        the kernels, its partial's way back), as measured up to its last heartbeat; None until enough blocks."""
        seconds, blocks = self.reported_arrivals
        if blocks < MIN_SYNC_BLOCKS or self.decode_s <= 0:
            return None
        return max(0.0, (seconds - self.decode_s) / blocks)



class Membership:
    """Accepts nodes and watches them; thread-safe where it says so."""

    def __init__(self, key: bytes, welcome: Welcome, net: EventLoopThread, udp: LossyUdp, counters: Counters,
                 on_message: Callable[[NodeConn, Message], None], on_lost: Callable[[NodeConn], None],
                 log: Callable[[str], None]) -> None:
        """`on_message` takes what is not membership's (partials, fetches), `on_lost` a node that left; both run
        on the loop's thread."""
        self.key, self.welcome, self.net, self.udp, self.counters = key, welcome, net, udp, counters
        self.on_message, self.on_lost, self.log = on_message, on_lost, log
        self.cond = threading.Condition()  # nodes joining and leaving
        self.nodes: list[NodeConn] = []
        self.serving: set[asyncio.Task] = set()  # each connection's handler (_serve_node)
        self.running = True

    async def listen(self, listener: socket.socket) -> asyncio.Server:
        """Accept nodes on `listener`, a bound and listening TCP socket."""
        loop = asyncio.get_running_loop()

        def serve(frames: FrameReader) -> None:  # the loop keeps only weak references to its tasks
            task = loop.create_task(self._serve_node(frames))
            self.serving.add(task)
            task.add_done_callback(self.serving.discard)

        server = await loop.create_server(lambda: FrameReader(serve), sock=listener)
        self.watch_task = loop.create_task(self._watch())
        return server

    def alive(self) -> list[NodeConn]:
        return [n for n in self.nodes if n.alive]

    async def _serve_node(self, frames: FrameReader) -> None:
        channel = AsyncChannel(frames, self.key, self.net.loop)
        addr = channel.transport.get_extra_info("peername")
        node: NodeConn | None = None
        try:
            message = await asyncio.wait_for(channel.receive(), 10)
            if isinstance(message, Spare):
                await self._serve_spare(channel, message, addr[0])
                return
            if not isinstance(message, Register):
                raise WireError("first message must register")
            channel.send(self.welcome)
            with self.cond:
                node = NodeConn(len(self.nodes) + 1, message.name, channel, addr[0], message.udp_port,
                                message.budget_mb, message.speed, device=message.device)
                # Both directions' path MTU: the node measured its way here, the master measures its way there.
                node.datagram_bytes = min(message.datagram_bytes, path_datagram_bytes(node.host, node.udp_port))
                self.nodes.append(node)
                self.cond.notify_all()
            self.log(f"node {node.name} joined from {addr[0]}")
            async for message in channel.messages(self.counters):
                node.last_heard = time.monotonic()
                self._message(node, message)
                if not self.running:
                    break
        except (ConnectionError, OSError, WireError, ValueError, TimeoutError) as e:
            if node is None:
                self.counters.reject("registration")
                if isinstance(e, BadMac):  # said on both sides: the node reads KEY_REJECTED (closing flushes it)
                    self.log(f"a node at {addr[0]} failed authentication: its --key (or EDGERUN_KEY) is not "
                             "this master's; refused")
                    channel.transport.write(KEY_REJECTED)
            elif self.running:
                self.log(f"node {node.name} lost ({e})")
            else:  # the master is closing the cluster: its nodes go with it
                self.log(f"node {node.name} left (the cluster closed)")
        finally:
            channel.close()
            if node is not None:
                with self.cond:
                    node.alive = False
                    self.cond.notify_all()
                if node.spare is not None:  # a node gone (or silent) has no use for it either
                    node.spare.close()
                self.on_lost(node)

    async def _serve_spare(self, channel: AsyncChannel, message: Spare, host: str) -> None:
        """A node's spare stream: it carries the node's second copies of a prompt's partials and nothing else. Its
        end is not the node's: the node's first stream says when it is gone."""
        node = next((n for n in self.nodes if n.alive and n.spare is None and n.name == message.name
                     and n.host == host and n.udp_port == message.udp_port), None)
        if node is None:
            self.counters.reject("registration")
            return
        node.spare = channel
        channel.set_rto_min(node.rto_min_ms)
        try:
            async for message in channel.messages(self.counters):
                if isinstance(message, Partial):
                    node.spare_partials += 1
                    self.on_message(node, message)
                else:
                    self.counters.reject("unexpected")
                if not (self.running and node.alive):
                    break
        except (ConnectionError, OSError, WireError):
            pass  # the spare alone is gone: prompts go on the first stream only
        finally:
            if node.spare is channel:
                node.spare = None

    def _message(self, node: NodeConn, message: Message) -> None:
        match message:
            case Ready(_, weight_bytes, cache_bytes, q8_inputs):
                node.weight_bytes, node.cache_bytes, node.q8_inputs = weight_bytes, cache_bytes, q8_inputs
                node.ready.set()
            case Pong() | BandwidthReply():
                node.pongs.append(time.perf_counter())
                node.pong.set()
            case Heartbeat(rejected, compute_s, rss_mb, decode, decode_s, session, session_compute_s, calls,
                           call_overhead_s, native_blocks, session_decode_s):
                node.native_blocks = native_blocks
                node.session_decode = (session, session_decode_s)
                node.rejected, node.compute_s, node.peak_rss_mb = rejected, compute_s, rss_mb
                node.session_compute = (session, session_compute_s)
                node.call_cost = (calls, call_overhead_s)
                node.decode, node.decode_s = decode, decode_s
                node.reported_arrivals = (node.arrival_s, node.arrival_blocks)  # what this decode time was part of
                node.heartbeats += 1
            case _:
                self.on_message(node, message)

    async def _watch(self) -> None:
        while self.running:
            await asyncio.sleep(0.5)
            for node in list(self.nodes):
                if node.alive and time.monotonic() - node.last_heard > NODE_SILENT_S:
                    self.log(f"node {node.name} silent for {NODE_SILENT_S} s")
                    node.channel.close()  # its reader then ends and marks it dead

    def probe_echoed(self, header: Header) -> None:
        """A link probe came back (on the loop's thread); a group probe's (net.group) from the node it names."""
        for node in self.nodes:
            if node.index == header.node and node.alive:
                if header.layer == PROBE_LAYER:
                    node.in_group = True
                else:
                    node.echoes += 1

    def wait_for_nodes(self, n: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while sum(node.alive for node in self.nodes) < n:
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise EdgerunError(f"only {sum(nd.alive for nd in self.nodes)} of {n} nodes joined "
                                       f"within {timeout_s:.0f} s")

    def measure_link(self, node: NodeConn, pings: int = 7, probes: int = 200) -> Link:
        """RTT: median of TCP pings. Loss: UDP probes the node echoes; a probe is lost if either
        direction drops it, so the one-way rate is 1 - sqrt(1 - round-trip rate). Bandwidth: a timed
        TCP exchange, taken as symmetric. Blocks on the node's replies: never on the loop's thread."""
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
        # Bandwidth: a payload each way over TCP; the node answers with a payload of the size asked.
        node.pong.clear()
        sent = time.perf_counter()
        node.channel.send(BandwidthProbe(BW_PROBE_BYTES, bytes(BW_PROBE_BYTES)))
        if not node.pong.wait(30.0):
            return Link(rtt_ms=rtt_ms, up_mbit=1.0, down_mbit=1.0, loss_rate=loss_rate)
        # Two transfers and one round trip in that time; each direction gets half.
        mbit = 2 * BW_PROBE_BYTES * 8 / max(node.pongs[-1] - sent - rtt_ms / 1e3, 1e-6) / 1e6
        return Link(rtt_ms=rtt_ms, up_mbit=mbit, down_mbit=mbit, loss_rate=loss_rate)

    def fresh_reports(self, timeout_s: float = 3.0) -> list[NodeConn]:
        """The live nodes, once each has sent a heartbeat after this call (so its counters cover what ran
        before it), or after timeout_s."""
        nodes = self.alive()
        seen = {n.index: n.heartbeats for n in nodes}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(n.heartbeats <= seen[n.index] for n in nodes if n.alive):
            time.sleep(0.02)
        return [n for n in nodes if n.alive]

    def lost_nodes(self) -> list[str]:
        return [n.name for n in self.nodes if not n.alive and n.spec is not None]

    def close_channels(self) -> None:
        """On the loop's thread."""
        self.running = False
        self.watch_task.cancel()
        for node in self.nodes:
            for channel in (node.channel, node.spare):
                if channel is not None:
                    channel.close()
