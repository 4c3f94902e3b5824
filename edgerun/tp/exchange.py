"""The block exchange of a tensor-parallel master: for one block, send the normalized input to the nodes that hold
units of it, let the master compute its own share, and merge the partials that arrive: straight off the UDP
socket on the loop's thread until the block is whole or its deadline passes, or on the event loop for TCP
replies. It keeps the timeouts' estimators, turns parity on for links that lose packets, answers nodes'
fetches of inputs they missed, and counts what happened (StepStats).

Which channel each block takes is the deployment's `Routes`; which nodes take part is the deployment's specs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgerun.model.config import ModelConfig
from edgerun.model.generate import EngineLost
from edgerun.model.reference import rms_norm_fast
from edgerun.net.channel import Counters, DatagramSocket, LossyUdp, SendThread, add_fragment
from edgerun.net.fastpath import (
    NATIVE_JOINS,
    FastPath,
    Gather,
    GatherEnd,
    NativeBlock,
    NativeHead,
    NativeRecord,
    RunEnd,
    Runner,
    addresses,
    fits,
    native_mtu,
    one_datagram_bytes,
    rms_norm,
    rms_norm_rows,
)
from edgerun.net.group import PROBE_LAYER, GroupSender
from edgerun.net.loss import NoLoss
from edgerun.net.wire import (
    Added,
    Block,
    Codec,
    Header,
    MsgType,
    Reassembly,
    Resend,
    Transport,
    WireError,
    as_f32,
    encode_vector,
    fragment,
    fragments_of,
    is_parity,
    parity_fragments,
    peek_parity,
    seal,
    whole_vector,
)
from edgerun.tp.config import MasterConfig
from edgerun.tp.deployment import place_head_top, row_span, vocab_rows
from edgerun.tp.membership import NodeConn
from edgerun.tp.messages import Fetch, Input, ParityOn, Partial, Route, Routes
from edgerun.tp.shard import head_top_size
from edgerun.tp.timeouts import Timeouts
from edgerun.tp.trace import Event, Trace

# Inputs of this many recent positions are kept for nodes that missed one and fetch it: a node may
# lag behind by a TCP retransmission timeout or more, which is several tokens on a fast cluster.
KEPT_POSITIONS = 64

# A mirrored block (the first layer and the LM head over udp) drains its UDP copies at least this long: the
# arrival estimates are learnt on the short attention and MLP blocks, and the LM head's partials come several
# times later, so a drain that ended at the estimate handed nearly every head to the event loop (0.3-0.5 ms more
# a token on the device). A TCP copy that comes first is read by the loop between drains and completes the block.
MIRROR_DRAIN_S = 0.05

# A mirrored block asks again for what has not come (Resend) this long after its first partial is in, and then as
# often, until it is whole or its drain ends. On a lossy link the TCP copy of a partial of tens of fragments (the LM
# head's) took 30-50 ms to get through on the testbed at 5% loss, every token; a round trip there is a few hundred
# microseconds.
RESEND_S = 0.002

# A prompt goes over TCP, where a lost packet shows only as a segment sent again: a node's stream that sent again at
# least this many segments, and this share of those it sent, in one prompt block is lossy (BlockExchange.saw_loss),
# and its next prompt blocks go on its spare stream too. On a clean link a stream sends one again now and then (one
# each in a dozen prompts on the device's testbed at 0%: a tail-loss probe while the other end held its
# acknowledgement); at 5% loss a few percent of a block's hundreds.
LOSSY_RESENT = 8
LOSSY_RESENT_SHARE = 0.005

# A prompt's second copy (on a lossy node's spare stream) shares the link with the first, so it costs its own time
# on the link; what it saves is a retransmission timer (8-12 ms and more at 250 Hz), which at 5% loss held one of a
# prompt block's transfers more often than not. Copies go only where one crosses the node's measured bandwidth in
# at most this long: on a 100 Mbit/s link a 1B model's 70-token vector takes 46 ms, and a second would add as much.
SPARE_COPY_MAX_S = 0.004

BlockKey = tuple[int, int, int, int]  # (session, position, layer, block)


def _copy_pays(node: NodeConn, nbytes: int) -> bool:
    """Whether a second copy of `nbytes` to this node is worth its time on the link (SPARE_COPY_MAX_S); where the
    link was not measured, it is taken as fast."""
    link = node.link
    return link is None or nbytes * 8 / (min(link.up_mbit, link.down_mbit) * 1e6) <= SPARE_COPY_MAX_S


def fits_one(node: NodeConn, codec: Codec, elements: int, prefix: int = 0, tokens: int = 1) -> bool:
    """Whether a vector of this many elements of `tokens` tokens goes to or from the node as one datagram."""
    return fits(codec, elements, prefix, one_datagram_bytes(node.datagram_bytes, node.parity, tokens))


class NodeLost(EngineLost):
    """A node died while the master waited on its reply."""


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
    # One-token blocks with nodes: the master's time from the first send to its own share, and the nodes sent to
    # (Master.send_s_per_node: what the planner charges the master per node and block).
    send_s: float = 0.0
    sends: int = 0
    fold_s: float = 0.0  # of one-token blocks: adding the nodes' partials into the sum (BlockExchange._merge)
    account_s: float = 0.0  # of one-token blocks with nodes: counting them (BlockExchange._account)
    # Mirrored blocks: requests for a partial's missing fragments, inputs sent again (a node asked, or nothing of
    # its partial came), and partials that came whole over UDP after the master asked for some of their fragments.
    resend_asks: int = 0
    inputs_resent: int = 0
    completed_after_ask: int = 0
    spare_inputs: int = 0  # a prompt's inputs sent again on a lossy node's spare stream (Assign.spare_stream)
    native_partials: int = 0  # partials the native data path took off the socket (net.fastpath)
    native_blocks: int = 0  # blocks the native runner ran (BlockExchange.run_blocks)
    native_mirror_waits: int = 0  # of them mirrored (the first layer's), completed by the Python path (MIRROR_WAIT)
    q8_inputs: int = 0  # blocks whose input went to the nodes as Q8 (input_codec), on either path


@dataclass
class _Wait:
    """The block the master is merging: each participant's reply (None until something of it lands; the vector
    when it came whole, in one datagram or over TCP; a reassembly when it comes in several datagrams), and a
    future resolved when all are in, a node is lost, or the deadline passes. The deadline moves earlier when
    the first partial arrives."""

    key: tuple[int, int, int, int]
    parts: dict[int, Reassembly | np.ndarray | None]
    sizes: dict[int, int]  # elements of each participant's reply
    future: asyncio.Future | None  # None: a block the native runner ran, counted after it merged
    sent: float
    outstanding: int
    tokens: int  # the step's tokens: a partial holds one vector per token (the LM head's: the last token's)
    lag_bound: float | None = None  # how long after the first partial the others may still come
    deadline: float | None = None  # perf_counter time; None: wait for every reply
    timer: asyncio.TimerHandle | None = None
    timed: bool = False  # awaited on the event loop, with a timer for the deadline (else drained on the spot)
    from_parity: int = 0  # one-datagram partials whose data was lost and one of whose parity copies came
    arrived: dict[int, float] = field(default_factory=dict)  # node index -> seconds after sending
    nodes: dict[int, NodeConn] = field(default_factory=dict)  # the participants by index
    # A mirrored block (the first layer, the LM head) must come whole: what is missing is asked for again
    # (BlockExchange._ask), first when a partial's parity shows its data is all sent, then every RESEND_S from
    # `retry_at` on. `heard`: when each node's last datagram of the block came; `asked`: the nodes asked so far.
    mirror: bool = False
    heard: dict[int, float] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)
    retry_at: float | None = None
    late: set[int] = field(default_factory=set)  # in `arrived`, but whole only after the block was merged
    streamed: set[int] = field(default_factory=set)  # one-token mirrored: the nodes its input went to on the stream

    @functools.cached_property
    def order(self) -> list[int]:
        """The participants in the order their partials are added: by node index, the same in every run."""
        return sorted(self.parts)

    def arrive(self, index: int, at: float | None = None) -> None:
        """A participant's reply is whole: it came at `at` (perf_counter time; now if not known)."""
        if index in self.arrived:
            return
        now = time.perf_counter()
        self.arrived[index] = (now if at is None else min(at, now)) - self.sent
        self.outstanding -= 1
        if self.outstanding == 0:
            self.finish()
        elif len(self.arrived) == 1:
            if self.lag_bound is not None and self.deadline is not None:
                self.expire_at(min(self.deadline, now + self.lag_bound))
            if self.mirror and self.retry_at is None:
                self.retry_at = now + RESEND_S

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
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    def first(self) -> float:
        return min(self.arrived.values())


class BlockExchange:
    """Runs one block at a time over the nodes (on the event loop's thread)."""

    def __init__(self, model: ModelConfig, key: bytes, config: MasterConfig, udp: LossyUdp,
                 datagrams: DatagramSocket, counters: Counters, log: Callable[[str], None],
                 trace: Trace | None = None) -> None:
        self.model, self.key, self.udp, self.datagrams, self.counters, self.log, self.trace = \
            model, key, udp, datagrams, counters, log, trace
        self.configure(config)
        self.session = 0
        # the nodes send their this many largest logits of each token (a request's Reset.top, a batch step's top)
        self.head_top: int | None = None
        self.routes = Routes.for_transport(config.transport, model.n_layers)
        self.recent_inputs: dict[BlockKey, tuple[np.ndarray, tuple[int, ...] | None]] = {}  # kept for fetches
        self.pending_fetch: dict[BlockKey, list[NodeConn]] = {}  # fetches of inputs not sent yet
        self.wait: _Wait | None = None  # the block in merge
        self.merged: _Wait | None = None  # the block merged last, whose late partials still teach lags
        self.mirrors: dict[BlockKey, _Wait] = {}  # recent mirrored blocks, for their second copies
        self.doubled: dict[BlockKey, _Wait] = {}  # recent prompt blocks sent on spare streams too, likewise
        self.stats = StepStats()
        self.sender: SendThread | None = None  # sends the inputs' parity (started with the first)
        # The block merged last, not yet counted (_account): counted while the next block's nodes compute.
        self.unaccounted: tuple[_Wait, list[NodeConn], bool, float, float] | None = None
        # The native runner's blocks merged but not counted yet (_count_native's arguments), likewise.
        self._uncounted: tuple[int, int, list[list[NodeConn]]] | None = None
        self._deferred: list[Callable[[], None]] = []  # the caller's accounts of a step, for the next slack (defer)
        self._runner_head: list[list[NodeConn]] = []  # the LM head's participants, where the runner sends its input
        # The native data path (net.fastpath), where it was built: it sends a block's one-datagram inputs (where
        # no loss is simulated in this process and no link carries parity) and takes a lossy block's one-datagram
        # partials off the socket; everything else goes datagram by datagram through the Python path below.
        self.fast = FastPath.load(key) if datagrams is not None else None
        self.gather = Gather(self.fast) if self.fast is not None else None
        self.runner = Runner(self.fast) if self.fast is not None else None
        self._runner_codec = Codec.F32  # of the layers' inputs the runner sends (prepare_blocks)
        self.native_sends = self.fast is not None and isinstance(udp, LossyUdp) and isinstance(udp.loss, NoLoss)
        self._to: tuple[tuple[tuple[str, int], ...], object] = ((), None)  # the last nodes' addresses, natively
        self.group: GroupSender | None = None  # the master's multicast group (net.group; the master sets it)
        # A reliable block's Q8 input (_send_inputs): the master sets ggml's quantizer where it writes these bytes
        self.encode_q8: Callable[[np.ndarray], bytes] = lambda x: encode_vector(x, Codec.Q8)
        # Computes the master's share of a prompt's blocks (see run); its thread starts with the first
        self._computer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="own-share")

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self._computer.shutdown(wait=False)

    def configure(self, config: MasterConfig) -> None:
        self.config = config
        self.timeouts = Timeouts(None if config.timeout_ms is None else config.timeout_ms / 1000,
                                 config.timeout_deviations)

    def new_session(self, session: int, routes: Routes | None = None) -> None:
        """A new request or a new deployment: nothing of the old one is kept (what it ran is counted)."""
        self.settle()
        self.session, self.head_top = session, None
        if routes is not None:
            self.routes = routes
        self.recent_inputs.clear()
        self.mirrors.clear()
        self.doubled.clear()
        self.pending_fetch.clear()

    def forget_before(self, position: int) -> None:
        """Let go of what was kept for positions before this one. Both are filled in the order of positions,
        so what goes is at their front: this runs every step and touches only what it drops."""
        for kept in (self.recent_inputs, self.mirrors, self.doubled):
            while kept and (oldest := next(iter(kept)))[1] < position:
                del kept[oldest]

    async def run(self, nodes: list[NodeConn], position: int, layer: int, block: Block, x: np.ndarray,
                  ranking: tuple[int, ...] | None, own_share: Callable[[], np.ndarray],
                  while_waiting: Callable[[], None] | None = None, sent_at: float | None = None,
                  tokens: int | None = None) -> np.ndarray:
        """The block's output: `own_share()` (the master's, computed while the nodes compute theirs) plus every
        node's partial that arrived in time. `while_waiting` runs after the master's share, before waiting for
        the nodes (HALO's Pred overlapped with Comm). `sent_at`: its datagrams went already, then (the LM head's,
        sent by the native runner: prepare_blocks). `tokens`: of one sequence in x's rows, which choose the route
        (BatchStep.tokens; None: every row is one sequence's)."""
        loop = asyncio.get_running_loop()
        seq = x.shape[0]
        key = (self.session, position, layer, int(block))
        route = self.routes.of(layer, block, seq if tokens is None else tokens)
        reliable, mirror, over_udp = route != Route.DATAGRAM, route == Route.MIRRORED, route != Route.RELIABLE
        sent = time.perf_counter() if sent_at is None else sent_at
        # A mirrored block's datagrams before its TCP copy, as nodes send their partials: a node takes the datagram
        # straight off its socket. Sent second, the datagram came after the frame and the node's loop read the
        # frame first for 45 of 94 mirrored inputs in a 32-token 1B run here (`bench tp --trace`).
        if nodes and over_udp and sent_at is None:
            codec = Codec.F32 if mirror else self.config.codec if block == Block.HEAD else self.input_codec(nodes)
            self._send_datagrams(nodes, key, x, ranking, codec)
            self.stats.q8_inputs += codec == Codec.Q8
        # A prompt's input goes on a lossy node's spare stream as well: its partial comes back on both. (Not with the
        # strict tcp baseline, whose nodes close their spares; one opened while a switch to it was under way may
        # still be up.)
        spare = [n for n in nodes if n.lossy and n.spare is not None and _copy_pays(n, x.nbytes)] \
            if seq > 1 and reliable and self.config.transport == Transport.UDP else []
        # A one-token mirrored block goes as datagrams alone (with a lossy link's parity), as the native runner
        # sends the first layer's: stream copies (a frame written to every stream, ~25 µs a node on loopback: 7
        # nodes' were most of the LM head's 309 µs of sends at 8 devices, and each node read and dropped its copy
        # as the next block's input came, or answered it on its stream) cost every block for the few datagrams
        # parity does not mend. What is lost is asked for again (_ask_again), and the input goes over the stream
        # once the drain ends (_wait).
        datagrams_alone = mirror and seq == 1 and self.config.transport == Transport.UDP
        if reliable and nodes and not datagrams_alone:
            self._send_inputs(nodes, key, x, ranking, spare)
        if nodes and seq == 1 and sent_at is None:
            self.stats.send_s += time.perf_counter() - sent
            self.stats.sends += len(nodes)
        # The block's bookkeeping once its inputs are out, off the nodes' path: no reply can be read before this
        # coroutine waits (datagrams are read by this thread, streams by this loop).
        w = self.wait = _Wait(key, dict.fromkeys(n.index for n in nodes),
                              {n.index: self._reply_size(n, block, seq) for n in nodes}, loop.create_future(), sent,
                              len(nodes), seq, nodes={n.index: n for n in nodes}, mirror=mirror)
        if mirror:
            self.mirrors[key] = w
        if spare:
            self.doubled[key] = w
        if nodes:  # kept for the nodes' fetches (a block no node takes part in has none); a block's input is a
            # fresh array its step never writes again, so it is kept as it is, not copied
            self.recent_inputs[key] = (x, ranking)
            for node in self.pending_fetch.pop(key, []):
                self.send_input(node, key, x, ranking)
        compute_start = time.perf_counter()
        if seq > 1 and reliable and nodes:
            # A prompt's share on a thread of its own (the kernels let go of the interpreter), so that this loop
            # reads and checks the nodes' partials meanwhile rather than after it: three 512 KB frames a block of
            # a 64-token chunk of a 1B at 4 devices, which waited in the sockets while the master computed. On the
            # device (--pin 2) such a chunk took 219-255 ms so, against 334-339 ms.
            out = await loop.run_in_executor(self._computer, own_share)
        else:
            out = own_share()
        wait_start = time.perf_counter()
        self.stats.compute_s += wait_start - compute_start
        # While the nodes compute: the block before's accounts.
        self.settle()
        if while_waiting is not None:
            while_waiting()
        await self._wait(w, nodes, reliable, over_udp)
        ended = time.perf_counter()
        self.stats.wait_s += ended - wait_start
        lost = [n for n in nodes if not n.alive]
        if lost:  # its units are gone for every later step too: replan
            raise NodeLost(lost[0].name)
        self.unaccounted = (w, nodes, reliable, ended, wait_start)
        if self.trace is not None and seq == 1 and nodes:
            self._record(w, compute_start, wait_start, ended)
        if block == Block.HEAD:
            self.settle()  # the step's last block: counted before the step returns
            return self._assemble_logits(out, nodes, w.parts)
        return self._merge(w, out)

    def _merge(self, w: _Wait, own: np.ndarray) -> np.ndarray:
        """The master's share plus the partials, added in the participants' order, never in arrival order: float
        addition is not associative, and a sum that followed arrivals gave the same request other tokens from run
        to run. A partial that did not come whole adds what of it came (a lossy block's missing fragments are
        zeros); one of which nothing came is left out. A new array (the master's one-token output is a buffer its
        block reuses). numpy's vectorized adds, in place: a scalar C loop (the native path's, built without
        -march) took 2.7-3x as long at every size, 9 against 3 µs for a one-token block of 3 nodes, 139 against
        52 µs for a 64-token one of a 1B."""
        started = time.perf_counter()
        total = own.copy()
        for part in (w.parts[i] for i in w.order):
            if part is not None:
                total += as_f32(part.vector if isinstance(part, Reassembly) else part).reshape(own.shape)
        if w.tokens == 1:
            self.stats.fold_s += time.perf_counter() - started
        return total

    def defer(self, accounts: Callable[[], None]) -> None:
        """Run `accounts` at the next settle (while the next block's nodes compute, or before the next run of the
        native runner, whose records it may read): off the step's path."""
        self._deferred.append(accounts)

    def settle(self) -> None:
        """Count the block merged last, if it is not yet (its accounts wait for the next block's slack), and the
        native runner's blocks since it last came back; then what was deferred."""
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for accounts in deferred:
                accounts()
        if self._uncounted is not None:
            pending, self._uncounted = self._uncounted, None
            self._count_native(*pending, raise_lost=False)  # a node lost since is the caller's to notice
        if self.unaccounted is not None:
            pending, self.unaccounted = self.unaccounted, None
            started = time.perf_counter()
            if pending[0].outstanding and self.datagrams is not None:
                # Merged incomplete: what came of it since is read first, so a partial that was only late (it
                # came while the master computed the next block's share) does not mark its link lossy. A link
                # marked lossy gets parity and a prompt's second copies from then on; on a clean host one in a few
                # hundred partials misses an adaptive deadline, which turned them on for rows run at 0% loss.
                self.datagrams.read_waiting()
            self._account(*pending)
            if pending[0].tokens == 1 and pending[1]:
                self.stats.account_s += time.perf_counter() - started

    def _send_datagrams(self, nodes: list[NodeConn], key: BlockKey, x: np.ndarray, ranking: tuple[int, ...] | None,
                        codec: Codec) -> None:
        """The input as datagrams to every node; nodes on paths of one MTU get the same datagrams, encoded and
        sealed once."""
        parity = max(n.parity for n in nodes)  # a node of fewer takes the first ones
        if parity == 0 and self.native_sends and self._send_native(nodes, key, x, ranking, codec):
            return
        # datagram size -> (data, parity fragments, data fragments)
        datagrams: dict[int, tuple[list[bytes], list[bytes], int]] = {}
        for node in nodes:
            if node.datagram_bytes not in datagrams:
                count = fragments_of(codec, x.size, node.datagram_bytes, 0 if ranking is None else len(ranking))
                checks = parity_fragments(parity, count)
                sealed = self._input_datagrams(key, x, ranking, codec, node.datagram_bytes, parity=checks)
                datagrams[node.datagram_bytes] = (sealed[:len(sealed) - checks], sealed[len(sealed) - checks:], count)
        # Each node's parity goes from a thread of its own (SendThread), handed over once its data is sent: it
        # crosses while this thread sends the next nodes' data and then computes the master's share. On one host a
        # datagram costs its sender 20-30 µs of kernel work (veth, nftables, the receiver's stack); on the device's
        # testbed (8 devices, q8, 5% loss) a block's input is 14 data datagrams and 14 parity. Sent by this thread
        # after every node's data, a round at a time, the parity held up the master's share; sent by the other
        # after every node's data, a node that lost one data fragment (about half the blocks at 5% have one) still
        # waited for all the data to go before its rebuild. A node's data always goes before its parity: a parity
        # fragment that came first would be decoded (an erasure solve) before the data it stands in for.
        for node in nodes:
            address = (node.host, node.udp_port)
            data, checks, count = datagrams[node.datagram_bytes]
            self.udp.send_all(data, address)
            if node.parity:
                if self.sender is None:
                    self.sender = SendThread(self.udp)
                self.sender.send([(checks[:parity_fragments(node.parity, count)], address)])

    def _send_native(self, nodes: list[NodeConn], key: BlockKey, x: np.ndarray, ranking: tuple[int, ...] | None,
                     codec: Codec) -> bool:
        """The input as one datagram to every node, sealed once and sent by the native data path: False (nothing
        sent) where it takes more than one datagram on some node's path."""
        prefix = b"" if ranking is None else bytes(ranking)
        if not all(fits_one(n, codec, x.size, len(prefix), x.shape[0]) for n in nodes):
            return False
        peers = tuple((n.host, n.udp_port) for n in nodes)
        if self._to[0] != peers:  # the same nodes block after block
            self._to = (peers, addresses(peers))
        session, position, layer, block = key
        header = Header(MsgType.ACTIVATION, session, position, layer, block, 0, codec=codec, tokens=x.shape[0])
        sent = self.fast.send_vector(self.udp.sock.fileno(), header, as_f32(x), self._to[1], prefix=prefix)
        self.udp.sent += len(nodes)
        self.udp.dropped += len(nodes) - max(sent, 0)
        return True

    def _input_datagrams(self, key: BlockKey, x: np.ndarray, ranking: tuple[int, ...] | None, codec: Codec,
                         datagram_bytes: int, parity: int = 0, only: tuple[int, ...] | None = None) -> list[bytes]:
        """A block's input sealed as datagrams of `datagram_bytes` (see wire.fragment), each led by the ranking."""
        session, position, layer, block = key
        header = Header(MsgType.ACTIVATION, session, position, layer, block, 0, codec=codec, tokens=x.shape[0])
        return fragment(header, x, self.key, datagram_bytes, parity=parity,
                        prefix=b"" if ranking is None else bytes(ranking), only=only)

    async def _wait(self, w: _Wait, nodes: list[NodeConn], reliable: bool, over_udp: bool) -> None:
        """Until every partial is in, the deadline passes (lossy blocks) or a participant is lost."""
        # When the partials should be in: a lossy block's deadline, and how long a mirrored one drains for.
        expected = w.sent + self.timeouts.after_send([n.arrival for n in nodes])
        if not reliable:
            w.lag_bound = self.timeouts.after_first([n.lag for n in nodes])
            w.deadline = expected
        else:
            expected = max(expected, w.sent + MIRROR_DRAIN_S)
        gathered = self.gather is not None and w.tokens == 1 and w.outstanding and (not reliable or w.mirror)
        if gathered:
            # A lossy block's partials by its deadline; a mirrored one's (the first layer's, the LM head's) until
            # RESEND_S after the first came, when the drain below asks again for what is missing (7 partials read
            # by the Python path were ~350 µs of the LM head's merge at 8 devices).
            await self._gather(w, nodes, *((w.deadline, w.lag_bound) if not reliable else (expected, RESEND_S)))
        if over_udp and w.outstanding and (not gathered or w.mirror):
            # The lean path: partials are taken straight off the socket on this thread until the block is whole
            # or its deadline passes. A mirrored block (no deadline) drains so long for its UDP copies (at least
            # MIRROR_DRAIN_S), then waits for its TCP copies on the loop. Data on a participant's TCP stream (a
            # reply, a mirrored partial's TCP copy, a heartbeat, a closed connection) goes to the event loop for as
            # long as it takes to read it, and the drain goes on: a block left to the loop until its end waited for
            # the loop to wake for each partial (0.5-2 ms more a token on the device, the LM head's most, as the
            # faster nodes' TCP copies came while the slowest node's partial was on its way).
            # A mirrored block's drain also ends at each time to ask again for what is missing, and goes on.
            watch = [fd for fd in (n.channel.fileno() for n in nodes) if fd >= 0]

            def until() -> float:
                end = expected if w.deadline is None else w.deadline
                return end if w.retry_at is None else min(end, w.retry_at)

            while True:
                if not self.datagrams.drain(lambda: w.outstanding == 0, until, watch):
                    await asyncio.sleep(0)  # the loop reads the stream that had data, and runs what it wakes
                    if w.outstanding == 0 or any(not n.alive for n in nodes):
                        break
                elif w.outstanding and w.retry_at is not None and time.perf_counter() < expected:
                    self._ask_again(w)
                else:
                    break
        if w.outstanding and not any(not n.alive for n in nodes) and (
                reliable or w.deadline is None or time.perf_counter() < w.deadline):
            if w.mirror and w.tokens == 1 and (kept := self.recent_inputs.get(w.key)) is not None:
                # The last resort for a lost one-token input or partial of a node whose input did not go on its
                # stream (its link was clean then): the input over the stream, which a node answers there (from
                # its kept partial where it computed it already), and parity and stream copies from now on
                missing = [n for n in nodes if n.index not in w.arrived and n.index not in w.streamed]
                for node in missing:
                    self.saw_loss(node)
                if missing:
                    self._send_inputs(missing, w.key, *kept)
                    w.streamed.update(n.index for n in missing)
            w.timed = True
            if w.deadline is not None:
                w.expire_at(w.deadline)
            await w.future
        w.finish()
        self.wait, self.merged = None, w

    async def _gather(self, w: _Wait, nodes: list[NodeConn], deadline: float, lag_bound: float | None) -> None:
        """A one-token block's partials taken by the native data path until the block is whole or the deadline
        passes (moved to lag_bound after the first). A datagram it hands back (a fragment of a longer partial, a
        parity fragment, a stray or forged packet) goes through the Python path (on_datagram) and what that took
        is told back; data on a participant's stream lets the event loop run, as in _wait."""
        gather, datagrams = self.gather, self.datagrams
        # the participants still awaited (the native runner's block that came back for a mirrored partial has some
        # in), with the first one's lag bound
        order = [i for i in w.order if i not in w.arrived]
        if w.arrived and lag_bound is not None:
            deadline = min(deadline, w.sent + w.first() + lag_bound)
        gather.start(w.key, order, [w.sizes[i] for i in order], deadline, lag_bound, datagrams.spin_s,
                     [fd for fd in (n.channel.fileno() for n in nodes) if fd >= 0], self._nothing_awaited())
        while True:
            end = gather.run(datagrams.sock.fileno())
            self._took_natively(w, gather.g, gather.arrived, gather.buffer, order)
            if end == GatherEnd.OTHER:
                datagrams.handle(*gather.handed_back())
            elif end == GatherEnd.STREAM:
                await asyncio.sleep(0)  # the loop reads the stream that had data, and runs what it wakes
                if any(not n.alive for n in nodes):
                    return
            if w.outstanding == 0 or end == GatherEnd.TIME:
                return
            self._tell_native(w, gather.g, gather.arrived, order=order)

    def _nothing_awaited(self) -> bool:
        """Whether nothing of the block merged last may still come (its late partials teach lags: _late)."""
        return self.merged is None or self.merged.outstanding == 0

    def _took_natively(self, w: _Wait, g, arrived: np.ndarray, rows: np.ndarray,
                       order: Sequence[int] | None = None) -> None:
        """What the native path took (a gather's or a runner's, `g`, whose participants are `order`: all the
        block's by default), into the block's record."""
        for i, index in enumerate(w.order if order is None else order):
            if not math.isnan(arrived[i]) and index not in w.arrived:
                w.parts[index] = rows[i, :w.sizes[index]]  # merged before the next block's gather writes it again
                w.arrive(index, arrived[i])
                self.stats.native_partials += 1
        w.from_parity += g.from_parity
        self.datagrams.skipped += g.skipped
        g.from_parity = g.skipped = 0

    def _tell_native(self, w: _Wait, g, arrived: np.ndarray, rows: np.ndarray | None = None,
                     order: Sequence[int] | None = None) -> None:
        """What the Python path or the event loop took (and the deadline that the first arrival moved), told back to
        the native path (participants `order`, as in _took_natively); into `rows` too where it adds them up itself
        (the runner)."""
        for i, index in enumerate(w.order if order is None else order):
            if index in w.arrived and math.isnan(arrived[i]):
                arrived[i] = w.sent + w.arrived[index]
                g.outstanding -= 1
                if rows is not None:
                    part = w.parts[index]
                    rows[i] = (part.vector if isinstance(part, Reassembly) else part).reshape(-1)
        if w.deadline is not None:  # a mirrored block has none
            g.deadline = w.deadline = min(g.deadline, w.deadline)

    def norm(self, x: np.ndarray, weight: np.ndarray, eps: float, each_row: bool = False) -> np.ndarray:
        """The master's RMS norm of a block's input: the native runner's for one token where it runs (so a step's
        blocks round alike whichever path runs them), else numpy's. `each_row`: every row as it is alone (a batch's
        rows, each a sequence of its own: numpy's norm of several rows rounds unlike the one-row norms)."""
        if self.fast is not None and x.shape[0] == 1:
            return rms_norm(self.fast, x, weight, eps)
        if each_row and x.shape[0] > 1:
            if self.fast is not None:
                return rms_norm_rows(self.fast, x, weight, eps)
            return np.concatenate([rms_norm_fast(x[i:i + 1], weight, eps) for i in range(x.shape[0])])
        return rms_norm_fast(x, weight, eps)

    def runs_natively(self, nodes: Iterable[NodeConn]) -> bool:
        """Whether a one-token step's lossy blocks whose participants are these nodes can run on the native runner:
        inputs it may send (no loss simulated here) over UDP with a deadline (_sendable)."""
        if self.runner is None or not self.native_sends or self.routes.of(1, Block.ATTN, 1) != Route.DATAGRAM:
            return False
        return self._sendable(nodes, self.input_codec(nodes))

    def input_codec(self, nodes: Iterable[NodeConn]) -> Codec:
        """The codec of a layer's input to these nodes over UDP. Where activations go as float32, Q8 if every one's
        share computes on Q8 what it computes on float32 (Ready.q8_inputs: its ggml quantizes the decoded input
        back into the very bytes it quantizes the float32 into): 3.8x fewer bytes, a 2048-element input one
        datagram of 2.2 KB in place of six on a 1500-byte path, and the same partials. Else the configured codec."""
        nodes = list(nodes)
        if self.config.codec == Codec.F32 and self.config.q8_inputs and nodes and all(n.q8_inputs for n in nodes):
            return Codec.Q8
        return self.config.codec

    def _sendable(self, nodes: Iterable[NodeConn], codec: Codec) -> bool:
        """Whether the runner sends these nodes a one-token input in this codec (and takes their partials): live
        nodes, the vector in one datagram on every path, or cut where a lossy link's is longer, every node's path
        the same (the runner cuts one input for all of a block's nodes, as each node would cut it; cuts_natively)."""
        nodes, hidden = list(nodes), self.model.hidden
        if not all(n.alive for n in nodes):
            return False
        mtus = {native_mtu(codec, hidden, n.datagram_bytes, n.parity) for n in nodes}
        if mtus <= {0}:
            return True
        return None not in mtus and len({n.datagram_bytes for n in nodes}) == 1 and len(nodes) <= NATIVE_JOINS

    def runs_mirrored_natively(self, nodes: Iterable[NodeConn],
                               blocks: Sequence[Block] = (Block.ATTN, Block.MLP)) -> bool:
        """Whether mirrored one-token blocks (the first layer's, or the LM head's input: `blocks`) whose participants
        are these nodes can go through the native runner: mirrored over UDP (datagrams first, reliable), each input
        a float32 vector in one datagram or, on a lossy link, cut at its path as runs_natively says. A lossy link's
        input goes with its parity, as `run` sends it: what parity does not mend is asked for again (MIRROR_WAIT,
        then `_wait`)."""
        if self.config.transport != Transport.UDP or any(self.routes.of(0, b, 1) != Route.MIRRORED for b in blocks):
            return False
        return self._sendable(nodes, Codec.F32)

    def prepare_blocks(self, blocks: list[NativeBlock], participants: list[list[NodeConn]], eps: float, backend: int,
                       compute: int, head: tuple[NativeHead, list[NodeConn]] | None = None) -> None:
        """Set the native runner up for a step's blocks (while they, their graphs and their nodes stay the same);
        with `head` (and its participants), to send the LM head's input too once the last block is merged."""
        self.settle()  # the blocks of its last run are counted from its records
        watch = sorted({fd for nodes in participants for fd in (n.channel.fileno() for n in nodes) if fd >= 0})
        codec = self._runner_codec = self.input_codec({n.index: n for nodes in participants for n in nodes}.values())
        self.runner.prepare(blocks, self.model.hidden, eps, int(codec), self.udp.sock.fileno(),
                            self.datagrams.sock.fileno(), backend, compute, self.datagrams.spin_s, watch,
                            None if head is None else head[0], self._common_path(participants, head))
        self._runner_head = [] if head is None else [head[1]]  # the head's participants, in the slots after the blocks'
        groups: dict[tuple[int, ...], tuple[list[NodeConn], list[int]]] = {}
        for i, nodes in enumerate(participants):
            groups.setdefault(tuple(n.index for n in nodes), (nodes, []))[1].append(i)
        self._runner_groups = list(groups.values())  # blocks with the same participants share their deadlines
        self._runner_timing: list[tuple[float, float | None]] | None = None
        self._runner_links: tuple[tuple[int, bool], ...] | None = None  # its nodes' parity and group, as set
        self._step_nodes = list({n.index: n for nodes in [*participants, *self._runner_head] for n in nodes}.values())

    @staticmethod
    def _common_path(participants: list[list[NodeConn]], head: tuple[NativeHead, list[NodeConn]] | None) -> int:
        """Where the runner cuts a block's input when one of its links has parity: the path every node shares (what
        _sendable asks of vectors that need cutting); 0, never cut, where their paths differ (every vector then goes
        whole on every path: _sendable's other case)."""
        paths = {n.datagram_bytes for nodes in [*participants, *([] if head is None else [head[1]])] for n in nodes}
        return paths.pop() if len(paths) == 1 else 0

    async def run_blocks(self, x: np.ndarray, position: int, participants: list[list[NodeConn]]) -> None:
        """A one-token step's lossy blocks on the native runner as prepare_blocks set it up (see runs_natively), on
        the hidden state x ((1, hidden) float32, updated in place): each block's input normalized from x, sent, the
        master's share computed, the partials gathered by its deadline and added with the share into x. It comes
        back here for a datagram it does not take, a stream with data and a block merged incomplete; each block is
        counted as `run` counts it."""
        runner, datagrams, timeouts = self.runner, self.datagrams, self.timeouts
        timing: list[tuple[float, float | None]] = [(0.0, None)] * len(participants)
        for nodes, members in self._runner_groups:  # each block's deadline and lag bound, as `run` sets them
            after_send = timeouts.after_send([n.arrival for n in nodes])
            after = (after_send, timeouts.after_first([n.lag for n in nodes]))
            for i in members:  # a mirrored block drains, as `_wait` drains one, then asks again for what is missing
                timing[i] = (max(after_send, MIRROR_DRAIN_S), RESEND_S) if runner.blocks[i].mirrored else after
        if timing != self._runner_timing:
            runner.set_timing(timing)
            self._runner_timing = timing
        self._refresh_copies(participants)
        runner.r.g.spin_s = datagrams.spin_s
        self.settle()
        runner.start(x, self.session, position, self._nothing_awaited())
        counted = 0
        w: _Wait | None = None  # the block in gather, where the runner came back in it
        while True:
            end = runner.run()
            r = runner.r
            if r.phase == 1:  # back in a block's gather: its record, for the Python path's datagrams and the loop
                b, nodes = runner.blocks[r.next], participants[r.next]
                if w is None or w.key[2:] != (b.layer, b.block):
                    w = self._native_wait(r.next, position, nodes)
                self.wait = w  # the block in gather, for what the Python path and the loop take
                self._took_natively(w, r.g, runner.arrived[r.next], runner.parts)
                if end == RunEnd.OTHER:
                    datagrams.handle(*runner.handed_back())
                elif end == RunEnd.MIRROR_WAIT:  # what is missing is asked for again, as `run` asks
                    self.stats.native_mirror_waits += 1
                    self.recent_inputs[w.key] = (runner.inputs[r.next:r.next + 1].copy(), None)
                    self.mirrors[w.key] = w
                    await self._wait(w, nodes, True, True)
                else:
                    await asyncio.sleep(0)  # the loop reads the stream that had data, and runs what it wakes
                self._tell_native(w, r.g, runner.arrived[r.next], runner.parts)
                if lost := [n for n in nodes if not n.alive]:
                    self.wait = None
                    raise NodeLost(lost[0].name)
            if end == RunEnd.DONE:  # the blocks not counted yet are counted while the LM head's nodes compute
                self._uncounted = (counted, position, participants)
                self.wait = None  # the last block, if it came back in its gather, is merged: its record is counted
                return
            counted = self._count_native(counted, position, participants)
            if end == RunEnd.INCOMPLETE:  # a link that lost a partial gets its parity from the next block on
                self._refresh_copies(participants)

    def _refresh_copies(self, participants: list[list[NodeConn]]) -> None:
        """The runner's copies of each input: 1 + the parity of the participant's link; and which participants take
        their input from the multicast group."""
        multicast = self.group is not None and self.config.multicast
        links = tuple((n.parity, multicast and n.in_group) for n in self._step_nodes)
        if multicast and not all(in_group for _, in_group in links) and self.group.due():
            self._probe_group(self._step_nodes[0])
        if links == self._runner_links:  # as the runner has them (the same every step but the first few)
            return
        slots = [*participants, *self._runner_head]  # the LM head's input, where the runner sends it, last
        self.runner.set_copies([1 + n.parity for nodes in slots for n in nodes])
        grouped = self._grouped(slots) if multicast else (False,) * sum(map(len, slots))
        self.runner.set_group(self.group.group if any(grouped) else None, grouped)
        self._runner_links = links

    def _grouped(self, participants: list[list[NodeConn]]) -> tuple[bool, ...]:
        """Per participant slot, whether its input goes to the group: where the node echoed a group probe and
        every such node of the step takes part in the block (a group datagram reaches them all)."""
        members = {n.index for n in self._step_nodes if n.in_group}
        return tuple(n.in_group and members <= {m.index for m in nodes} for nodes in participants for n in nodes)

    def _probe_group(self, node: NodeConn) -> None:
        """One probe to the group (net.group), out of the interface that faces `node`: each node that gets it
        echoes it with its index."""
        try:
            self.group.probe(self.udp.sock, seal(Header(MsgType.PROBE, self.session, 0, PROBE_LAYER), b"", self.key),
                             node.channel.local_address())
        except OSError as e:  # no multicast route: the nodes keep their unicast inputs
            self.log(f"cannot send to the multicast group {self.group.group[0]} ({e}): inputs go by unicast")
            self.group = None

    def _native_wait(self, i: int, position: int, nodes: list[NodeConn]) -> _Wait:
        """The record of the runner's block i, as `run` keeps one (from what the runner noted)."""
        b, rec = self.runner.blocks[i], self.runner.records[i]
        w = _Wait((self.session, position, b.layer, b.block), dict.fromkeys(n.index for n in nodes),
                  dict.fromkeys((n.index for n in nodes), self.model.hidden),
                  asyncio.get_running_loop().create_future() if b.mirrored else None, rec.sent, len(nodes), 1,
                  nodes={n.index: n for n in nodes}, mirror=b.mirrored)
        if not b.mirrored:  # a mirrored block has no deadline: it waits for every partial
            w.deadline = rec.sent + rec.after_send
        return w

    def _count_native(self, counted: int, position: int, participants: list[list[NodeConn]],
                      raise_lost: bool = True) -> int:
        """Count the blocks the runner merged since the last count (as `run` counts its blocks), keep their inputs
        for the nodes' fetches, and note their moments in the trace; how many are counted now. NodeLost for a
        participant of an incomplete block found dead, with `raise_lost`."""
        runner, stats = self.runner, self.stats
        if counted < runner.r.next:
            inputs = runner.inputs.copy()  # the runner writes the next step's into its own
        while counted < runner.r.next:
            rec, nodes, b = runner.records[counted], participants[counted], runner.blocks[counted]
            key = (self.session, position, b.layer, b.block)
            arrived = runner.arrived[counted]
            started = rec.computed - rec.own_s
            stats.native_blocks += 1
            stats.compute_s += rec.own_s
            stats.wait_s += rec.merged - rec.computed
            self.datagrams.skipped += rec.skipped
            if nodes:
                self.recent_inputs[key] = (inputs[counted:counted + 1], None)
                for node in self.pending_fetch.pop(key, []):
                    self.send_input(node, key, *self.recent_inputs[key])
                stats.send_s += started - rec.sent
                stats.sends += len(nodes)
                stats.q8_inputs += self._runner_codec == Codec.Q8 and not b.mirrored
                self.udp.sent += len(nodes)
            counted += 1
            if rec.outstanding == 0 and (self.wait is None or self.wait.key != key):
                # The lean count of a whole block that ran without coming back (most do)
                first = float(arrived[:len(nodes)].min()) - rec.sent if nodes else 0.0
                for i, node in enumerate(nodes):  # a mirrored block's float32 partials teach no lossy deadline
                    self._learn(node, arrived[i] - rec.sent, first, 1, bool(rec.mirrored))
                if self.trace is not None and nodes:
                    self._record_native(key, rec, started, nodes, arrived)
                stats.blocks += 1
                stats.native_partials += len(nodes)
                stats.partials_rebuilt += rec.from_parity
                self.merged = None  # nothing of it can come late
                continue
            w = self.wait if self.wait is not None and self.wait.key == key else \
                self._native_wait(counted - 1, position, nodes)
            for i, n in enumerate(nodes):
                if not math.isnan(arrived[i]) and n.index not in w.arrived:
                    w.parts[n.index] = runner.parts[i]
                    w.arrived[n.index] = arrived[i] - rec.sent
                    stats.native_partials += 1
            w.outstanding = len(nodes) - len(w.arrived)
            w.from_parity += rec.from_parity
            # Only the block's own record stops being the one in merge: counted from settle() in the LM head's
            # slack, the head's (which the Python path runs after the runner) stays so, or its partials that come
            # through the Python path (fragments, a resend, the stream) would find no block to go to, and the
            # head, which waits for every partial, would wait for ever.
            if self.wait is w:
                self.wait = None
            self.merged = w
            if w.outstanding:  # a partial only late is read first, as settle() reads it (it teaches a lag, not loss)
                self.datagrams.read_waiting()
            self._account(w, nodes, bool(rec.mirrored), rec.merged, rec.computed)
            if self.trace is not None and nodes:
                self._record(w, started, rec.computed, rec.merged)
            if raise_lost and (lost := [n for n in nodes if not n.alive]):
                raise NodeLost(lost[0].name)
        return counted

    def _account(self, w: _Wait, nodes: list[NodeConn], reliable: bool, ended: float, wait_start: float) -> None:
        """Count the block, note the links that lost a partial, and teach the estimators its arrivals."""
        if w.deadline is not None and w.outstanding:
            self.stats.max_overshoot_s = max(self.stats.max_overshoot_s, ended - w.deadline)
        self.stats.blocks += 1
        if w.outstanding:
            self.stats.blocks_incomplete += 1
            for node in nodes:
                if node.index not in w.arrived:
                    self.saw_loss(node)
            self.stats.incomplete_wait_s += ended - wait_start
        self.stats.partials_rebuilt += sum(isinstance(p, Reassembly) and p.recovered for p in w.parts.values()) + \
            w.from_parity
        if w.tokens > 1 and reliable:
            self._watch_streams(nodes)
        first = w.first() if w.arrived else 0.0
        for node in nodes:
            if node.index in w.arrived and node.index not in w.late:  # a late one taught its lag in _late
                self._learn(node, w.arrived[node.index], first, w.tokens, reliable)

    def _learn(self, node: NodeConn, after: float, first: float, tokens: int, reliable: bool) -> None:
        """A partial that came `after` seconds after its input was sent (`first`: the block's first partial's):
        one-token blocks teach the node's synchronization time (NodeConn.sync_s), lossy ones its arrival and lag
        estimates (a fixed timeout learns nothing)."""
        if tokens == 1:
            node.arrival_s += after
            node.arrival_blocks += 1
        if not reliable and self.timeouts.fixed_s is None:
            node.arrival.observe(after)
            node.lag.observe(after - first)

    def _watch_streams(self, nodes: list[NodeConn]) -> None:
        """After a prompt's block: a node whose stream sent segments again in it (LOSSY_RESENT) is on a lossy link."""
        for node in nodes:
            if node.lossy or node.segments is None or (now := node.channel.segments()) is None:
                continue
            sent, resent = (now[i] - node.segments[i] for i in range(2))
            node.segments = now
            if resent >= LOSSY_RESENT and resent >= LOSSY_RESENT_SHARE * sent:
                self.saw_loss(node)

    def _record_native(self, key: BlockKey, rec: NativeRecord, started: float, nodes: list[NodeConn],
                       arrived: np.ndarray) -> None:
        """A whole native block's moments in the trace, from the runner's record."""
        add = self.trace.add
        add(Event.SEND, key, rec.sent)
        add(Event.SENT, key, started)
        add(Event.OWN, key, rec.computed)
        for i, node in enumerate(nodes):
            add(Event.ARRIVED, key, float(arrived[i]), node.index)
        add(Event.MERGED, key, rec.merged)

    def _record(self, w: _Wait, sent: float, computed: float, merged: float) -> None:
        """The block's moments in the trace (after the block: nothing of it on the nodes' path)."""
        add = self.trace.add
        add(Event.SEND, w.key, w.sent)
        add(Event.SENT, w.key, sent)
        add(Event.OWN, w.key, computed)
        for index, after in w.arrived.items():
            add(Event.ARRIVED, w.key, w.sent + after, index)
        add(Event.MERGED, w.key, merged)

    def _reply_size(self, node: NodeConn, block: Block, seq: int) -> int:
        """Elements of a node's partial: for the LM head, its vocabulary rows of each token sent (a request's last,
        a batch's each one)."""
        if block == Block.HEAD:
            rows = len(vocab_rows(node.spec.vocab_blocks, node.spec.vocab_block, self.model.vocab_size))
            return seq * (rows if self.head_top is None else head_top_size(rows, self.head_top))
        return seq * self.model.hidden

    def _assemble_logits(self, logits: np.ndarray, nodes: list[NodeConn], parts: dict) -> np.ndarray:
        """The master's logits with every node's rows filled in."""
        for node in nodes:
            node_rows = vocab_rows(node.spec.vocab_blocks, node.spec.vocab_block, self.model.vocab_size)
            part = parts[node.index]
            vector = part.vector if isinstance(part, Reassembly) else part
            if self.head_top is not None:
                place_head_top(logits, node_rows, vector.reshape(-1))
                continue
            if logits.ndim == 2:  # a batch's rows
                logits[:, row_span(node_rows)] = vector.reshape(logits.shape[0], -1)
            else:
                logits[row_span(node_rows)] = vector.reshape(-1)[-len(node_rows):]
        return logits

    # --- what the nodes send ------------------------------------------------------------------------
    def on_fetch(self, node: NodeConn, message: Fetch) -> None:
        """The node lost an input."""
        self.saw_loss(node)
        key = (message.session, message.position, message.layer, int(message.block))
        kept = self.recent_inputs.get(key)
        if kept is None:  # not sent yet (or long gone): answered when it is sent
            self.pending_fetch.setdefault(key, []).append(node)
        else:
            self.send_input(node, key, *kept)

    def on_partial(self, node: NodeConn, message: Partial) -> None:
        """A partial over TCP."""
        key = (message.session, message.position, message.layer, int(message.block))
        w = self.wait
        if w is not None and key == w.key and node.index in w.parts and node.index not in w.arrived:
            if len(message.vector) != 4 * w.sizes[node.index]:
                self.counters.reject("misfit")
                return
            w.parts[node.index] = np.frombuffer(message.vector, "<f4")  # read-only, as a datagram's: only read
            w.arrive(node.index)
        elif not self._mirror_copy(key, node.index):
            self.stats.late_packets += 1

    def on_datagram(self, header: Header, payload: bytes) -> None:
        """A partial's datagram."""
        w = self.wait
        key = (header.session, header.position, header.layer, header.block)
        if w is not None and key == w.key and header.node in w.parts and header.node not in w.arrived:
            if w.mirror:
                w.heard[header.node] = time.perf_counter()
            target = w.parts[header.node]
            if target is None:
                # The lean path: a partial in one datagram (most are) is a view of it, with no reassembly.
                vector = whole_vector(header, payload, w.sizes[header.node])
                if vector is not None:
                    w.parts[header.node] = vector
                    w.from_parity += is_parity(header)
                    w.arrive(header.node, self.datagrams.arrived_at)
                    return
                target = w.parts[header.node] = Reassembly(w.sizes[header.node], w.nodes[header.node].datagram_bytes)
            if isinstance(target, Reassembly) and add_fragment(target, header, payload, self.counters):
                w.arrive(header.node, self.datagrams.arrived_at)
                self.stats.completed_after_ask += header.node in w.asked
            elif w.mirror and is_parity(header) and isinstance(target, Reassembly) and \
                    header.node not in w.asked:
                self._ask(w, header.node)  # the parity comes after every data fragment: those missing were lost
            return
        if self._mirror_copy(key, header.node):
            return
        if not is_parity(header):  # the parity of a partial already merged is expected, not late
            self.stats.late_packets += 1
        self._late(key, header, payload)

    def needless(self, data: bytes) -> bool:
        """A datagram to leave unread before its MAC is checked (DatagramSocket.needless): a parity fragment of a
        partial already whole, of the block in merge or the one merged last (whose late partials still teach
        lags), or of any older block. With parity on (a lossy link), each node's partial brings two after its
        data, and the last node's data waited behind every other node's parity being authenticated and opened."""
        peek = peek_parity(data)
        if peek is None:
            return False
        key, node = peek
        for w in (self.wait, self.merged):
            if w is not None and w.key == key:
                return node in w.arrived
        return True

    def _ask(self, w: _Wait, index: int) -> None:
        """Ask a node for the fragments of its partial that have not come (all of them if none has)."""
        part = w.parts[index]
        missing = part.missing() if isinstance(part, Reassembly) else ()
        node = w.nodes[index]
        session, position, layer, block = w.key
        with contextlib.suppress(OSError):
            self.udp.send_all([Resend(session, position, layer, Block(block), index, missing).seal(self.key)],
                              (node.host, node.udp_port))
        w.asked.add(index)
        w.retry_at = time.perf_counter() + RESEND_S
        self.stats.resend_asks += 1

    def _ask_again(self, w: _Wait) -> None:
        """A mirrored block's time to ask again: a node whose fragments stopped coming is asked for the rest. One of
        which nothing came, once the first partial's time since the send has passed again after it (the LM head's
        partials came over 4-7 ms at 8 devices on the device's testbed: a node that is only slower is left to
        compute), gets its input again (it may be what was lost) and is asked for its whole partial."""
        now = time.perf_counter()
        w.retry_at = now + RESEND_S
        first = w.first() if w.arrived else None
        for index, part in w.parts.items():
            if index in w.arrived or now - w.heard.get(index, -1.0) < RESEND_S / 2:
                continue
            if part is None:
                if first is None or now - w.sent < 2 * first:
                    continue
                self._resend_input(w.nodes[index], w.key)
            self._ask(w, index)

    def on_resend(self, request: Resend) -> None:
        """A node asks for the fragments of a mirrored block's input that did not reach it."""
        key = (request.session, request.position, request.layer, int(request.block))
        w = self.mirrors.get(key)
        if w is None or request.node not in w.nodes:  # not a mirrored block of this session, or long gone
            self.counters.reject("stale")
            return
        self._resend_input(w.nodes[request.node], key, request.fragments or None)

    def _resend_input(self, node: NodeConn, key: BlockKey, fragments: tuple[int, ...] | None = None) -> None:
        """A mirrored block's input to one node again, sealed anew: these data fragments, or every one."""
        kept = self.recent_inputs.get(key)
        if kept is None:
            return
        x, ranking = kept
        with contextlib.suppress(OSError):  # in float32, as a mirrored block's input goes
            self.udp.send_all(self._input_datagrams(key, x, ranking, Codec.F32, node.datagram_bytes, only=fragments),
                              (node.host, node.udp_port))
        self.stats.inputs_resent += 1

    def on_node_lost(self, node: NodeConn) -> None:
        if self.wait is not None and node.index in self.wait.parts:
            self.wait.finish()  # the block's coroutine sees the loss and replans

    def saw_loss(self, node: NodeConn) -> None:
        """A packet on this node's link went missing (or came too late to count): parity both ways from now on. A
        group member is probed again (group datagrams may have stopped reaching it: a switch whose membership
        aged out) and takes unicast inputs until it echoes."""
        node.in_group = False
        if node.lossy or not self.config.parity:
            node.lossy = True
            return
        node.lossy, node.parity = True, self.config.parity
        self.log(f"node {node.name}: a packet went missing; {self.config.parity} parity fragments after every vector "
                 "on its link from now on")
        with contextlib.suppress(OSError, ConnectionError):
            node.channel.send(ParityOn(self.config.parity))

    def send_input(self, node: NodeConn, key: BlockKey, x: np.ndarray, ranking: tuple[int, ...] | None) -> None:
        self._send_inputs([node], key, x, ranking)

    def _send_inputs(self, nodes: list[NodeConn], key: BlockKey, x: np.ndarray, ranking: tuple[int, ...] | None,
                     spare: Sequence[NodeConn] = ()) -> None:
        """The block's input over TCP to these nodes: one frame, encoded and sealed once, on every stream; to the
        `spare` nodes on their spare streams too, after every first copy."""
        session, position, layer, block = key
        # Q8 where every node takes its layers' inputs so (the same partials), else float32: a lossy codec's
        # rounding is for datagrams, and the TCP input of a reliable block stays exact
        codec = Codec.Q8 if block != Block.HEAD and self.input_codec(nodes) == Codec.Q8 else Codec.F32
        vector = self.encode_q8(x) if codec == Codec.Q8 else memoryview(as_f32(x)).cast("B")
        frame = nodes[0].channel.frame(Input(session, position, layer, Block(block), ranking, vector, codec))
        self.stats.q8_inputs += codec == Codec.Q8
        for channel in [n.channel for n in nodes] + [n.spare for n in spare if n.spare is not None]:
            with contextlib.suppress(OSError, ConnectionError):
                channel.send_frame(frame)
        self.stats.spare_inputs += len(spare)

    def _mirror_copy(self, key: BlockKey, node: int) -> bool:
        """True for the second copy of a mirrored block's reply, or of a prompt's partial that came on both streams:
        its first copy is in, so nothing is late."""
        w = self.mirrors.get(key) or self.doubled.get(key)
        return w is not None and node in w.arrived

    def _late(self, key: BlockKey, header: Header, payload: bytes) -> None:
        """A partial of the block just merged that completes late: its node's link was slow, not lossy (the block's
        accounts then leave its parity off), and it still teaches the node's lag, so the estimate is not made only
        of partials that beat the deadline (which would shrink it)."""
        w = self.merged
        if w is None or key != w.key or header.node not in w.parts or header.node in w.arrived:
            return
        target = w.parts[header.node]
        if target is None and whole_vector(header, payload, w.sizes[header.node]) is not None:
            completed = True
        else:
            if target is None:
                target = w.parts[header.node] = Reassembly(w.sizes[header.node], w.nodes[header.node].datagram_bytes)
            completed = False
            with contextlib.suppress(WireError):
                completed = isinstance(target, Reassembly) and target.add(header, payload) is Added.COMPLETED
        if completed:
            first = w.first() if w.arrived else None
            w.arrived[header.node] = time.perf_counter() - w.sent  # counted once
            w.late.add(header.node)
            if first is not None and self.timeouts.fixed_s is None:  # a fixed timeout learns nothing
                w.nodes[header.node].lag.observe(w.arrived[header.node] - first)
