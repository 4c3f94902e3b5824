"""The tensor-parallel control protocol: every message a master and its nodes exchange over their TCP stream.

Each message is a frozen dataclass. On the wire it is one control frame (`wire.control_frame`): a JSON object
holding the message's name and its fields, then the binary payload of its one `Payload` field if it has one (an
activation, a partial, the predictors). `encode` and `decode` are the only code that turns messages into bytes
and back; `decode` checks every field's type against the class, so a malformed message is a BadMessage, never a
KeyError or a wrong type deep in the master or a node.

Which channel a block's input and partial take is data too: the assignment carries the cluster's `Routes`.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field
from enum import IntEnum

from edgerun.model.onnx_graph import Activations
from edgerun.net.typed import BadMessage, Payload, build, carried_fields, plain
from edgerun.net.wire import Block, Codec, Transport, check_parity
from edgerun.tp.kernel_fit import KernelFit
from edgerun.tp.shard import ShardSpec


class Route(IntEnum):
    """How a decode step's block travels between the master and a node."""

    RELIABLE = 0  # TCP only
    DATAGRAM = 1  # UDP only, with the master's timeout: a lost partial counts as zero
    MIRRORED = 2  # both: the receiver takes whichever copy is whole first, the UDP copy in f32 like the TCP one


@dataclass(frozen=True)
class Routes:
    """Each block's route for single-token (decode) steps. A step of several tokens (prefill) always goes
    reliable: a partial lost there corrupts the KV cache of every prompt token for the rest of the request, and
    prefill is not on the per-token latency path that timeouts protect."""

    attn: tuple[Route, ...]  # per layer
    mlp: tuple[Route, ...]  # per layer
    head: Route

    @classmethod
    def for_transport(cls, transport: str, n_layers: int) -> Routes:
        """HALO's routes. "tcp": everything reliable (the strict baseline). "udp": lossy blocks over UDP, except
        the first layer and the LM head, whose loss would cost most: they go both ways, so a TCP segment lost on
        the way costs nothing unless its UDP copy is lost as well, instead of a retransmission timeout."""
        if transport == Transport.TCP:
            return cls((Route.RELIABLE,) * n_layers, (Route.RELIABLE,) * n_layers, Route.RELIABLE)
        if transport != Transport.UDP:
            raise ValueError(f"unknown transport {transport!r} (udp or tcp)")
        layers = tuple(Route.MIRRORED if layer == 0 else Route.DATAGRAM for layer in range(n_layers))
        return cls(layers, layers, Route.MIRRORED)

    def of(self, layer: int, block: Block, tokens: int) -> Route:
        if tokens > 1:
            return Route.RELIABLE
        if block == Block.HEAD:
            return self.head
        return (self.attn if block == Block.ATTN else self.mlp)[layer]


# The most sequences a share holds at once (Assign.slots; serve --parallel's most)
MAX_SLOTS = 64

# Per layer, a node's priority indices under dynamic mapping: (attention, MLP).
Priorities = tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


# --- node -> master ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Register:
    """A node's first message."""

    name: str
    budget_mb: float
    speed: float  # weight bytes per second, for the planner
    udp_port: int
    datagram_bytes: int  # the largest UDP payload on the node's path to the master
    device: str = ""  # what it runs on, for people to read (profile.device.device_summary)


@dataclass(frozen=True)
class Spare:
    """The first message of a registered node's second TCP stream (its spare, Assign.spare_stream), which names the
    node as its registration did."""

    name: str
    udp_port: int


@dataclass(frozen=True)
class Ready:
    """The node holds its new share."""

    session: int
    weight_bytes: int
    cache_bytes: int
    # its layers' inputs may come as Q8 (wire.encode_vector), which its kernels compute on as on their float32
    q8_inputs: bool = False


@dataclass(frozen=True)
class Heartbeat:
    """Every HEARTBEAT_S: the node is alive, and what it counted so far."""

    rejected: int  # packets refused
    compute_s: float  # time in the share's kernels
    peak_rss_mb: float
    # One-token blocks since the share was assigned: the device's measured speed and fixed cost per block, which
    # replace the declared ones in later plans.
    decode: KernelFit = field(default_factory=KernelFit)
    # ... and the time of every one-token block's kernels, the LM head's included (NodeConn.sync_s).
    decode_s: float = 0.0
    # The session (request) it is in, and its kernels' time since that session began: what one request cost a
    # node, read after the request without an idle wait before it (bench tp).
    session: int = 0
    session_compute_s: float = 0.0
    # One-token share calls since the share was assigned, and their seconds beyond the kernels' graph (a ggml
    # share's fixed cost a call; 0 where the share does not count them).
    calls: int = 0
    call_overhead_s: float = 0.0
    native_blocks: int = 0  # one-token blocks its native server computed (net.fastpath.NodeServer)
    # ... and the session's one-token blocks' kernels alone: its decode, apart from its prompt (bench tp's sync)
    session_decode_s: float = 0.0


@dataclass(frozen=True)
class Fetch:
    """The node missed an attention input: send it over TCP."""

    session: int
    position: int
    layer: int
    block: Block


@dataclass(frozen=True)
class Partial:
    """A node's partial output of a block over TCP (f32)."""

    session: int
    position: int
    layer: int
    block: Block
    vector: Payload


@dataclass(frozen=True)
class Pong:
    seq: int


@dataclass(frozen=True)
class BandwidthReply:
    filler: Payload


# --- master -> node ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Welcome:
    model_sha256: str  # the node fetches the master's file over HTTP when its own differs
    http_port: int
    udp_port: int
    # The multicast group of the master's one-token inputs (net.group; "": none): the node joins it and echoes its
    # probes, and the master sends an input once to the group for the nodes that did.
    group: str = ""
    group_port: int = 0


@dataclass(frozen=True)
class Assign:
    """A node's share for a new session, and how it talks to the master."""

    session: int
    index: int  # the node's index in the plan, which its datagrams carry
    spec: ShardSpec
    max_len: int
    codec: Codec  # activations and partials on UDP
    routes: Routes
    udp_port: int  # the master's
    rto_min_ms: float | None  # the TCP stream's minimum retransmission timeout; None: the kernel's
    parity: int  # parity fragments after every partial (net.erasure)
    datagram_bytes: int
    priorities: Priorities | None = None  # dynamic mapping: the node holds every unit and computes these indices
    activations: Activations = Activations.INT8  # of the share's quantized products: every device computes alike
    # Open a second TCP stream (Spare). The master sends a prompt's inputs on both streams over a link that has lost
    # a packet; a node that gets inputs on its spare sends its prompt partials on both too; each end takes the first
    # copy that is whole. A lost segment can hold a stream for a retransmission timer or two (8-12 ms and more at
    # 250 Hz); both copies are seldom held at once. Device testbed, 5% loss, 7 nodes: a prompt block's 573 KB to
    # every node and back took 17-21 ms on average on one stream and 11-12 on two (5-9 at 0%: the copies' cost).
    spare_stream: bool = False
    slots: int = 1  # sequences whose caches the share holds at once, for batch sessions (Reset.batch)

    def __post_init__(self) -> None:
        check_parity(self.parity)
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"a share holds 1 to {MAX_SLOTS} sequences, not {self.slots}")


@dataclass(frozen=True)
class Input:
    """A block's normalized input over TCP: reliable blocks, and answers to a Fetch."""

    session: int
    position: int
    layer: int
    block: Block
    ranking: tuple[int, ...] | None  # dynamic mapping: the unit at each priority index
    vector: Payload
    # float32, or Q8 (wire.encode_vector) to a node that takes its layers' inputs so (Exchange.input_codec)
    codec: Codec = Codec.F32


@dataclass(frozen=True)
class Reset:
    """A new request: forget the KV cache. `top`: the request's sampler draws from no more than this many of the
    largest logits (greedy: 1), so a node's LM-head partial is its `top` largest logits and their rows, not every
    row of its vocabulary share (a 1B's 128k rows over 8 devices: 45 datagrams each a token, 1 so); None: every
    row."""

    session: int
    top: int | None = None
    # A batch session (tp.batch): its steps are numbered (an input's `position` is its step's number), each told by
    # a BatchStep first, and every block goes over the stream.
    batch: bool = False

    def __post_init__(self) -> None:
        if self.top is not None and self.top < 1:
            raise ValueError(f"top must be at least 1, not {self.top}")


@dataclass(frozen=True)
class BatchStep:
    """What the rows of a batch session's step are, sent before its inputs. One sequence (one slot): its tokens
    from position starts[0] of the sequence in slots[0] (a prompt's chunk); several: one token each, of the sequence
    in slots[i] at position starts[i], or with `counts` counts[i] tokens each (a round's prompt chunks beside its
    decode tokens, in one step: the LM head then takes each sequence's last row). `copy`: (source, target, rows)
    after each other, where any: before the step's attention at each layer, the keys and values of the first `rows`
    positions of slot `source` go to slot `target` (a prompt that sequences share), in this order. `top`: the rows'
    draws pick from no more than this many of the largest logits, so a node's LM-head partial is each row's `top`
    largest logits and their rows (as Reset.top is a request's); 0: every row of its vocabulary share."""

    session: int
    step: int
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    copy: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    top: int = 0

    def spans(self) -> list[tuple[int, int, int]] | None:
        """(slot, start, tokens) of each sequence where the step gives its counts, else None."""
        return list(zip(self.slots, self.starts, self.counts, strict=True)) if self.counts else None

    def tokens(self, rows: int) -> int:
        """The tokens of one sequence that a block of this step carries in `rows` rows, which choose its route
        (Routes.of): 1 where every row is a sequence's one token (a batch's decode step, the LM head's rows of a
        round), so that each goes as a request's decode token goes, lossy where its layer is; else `rows` (a
        prompt's chunk, a round's blocks), which go reliable as a prompt's do."""
        return 1 if rows == len(self.slots) else rows

    def __post_init__(self) -> None:
        if not self.slots or len(self.slots) != len(self.starts) or len(set(self.slots)) != len(self.slots):
            raise ValueError("a step's rows are distinct slots, each with its start")
        if min(self.slots) < 0 or max(self.slots) >= MAX_SLOTS or min(self.starts) < 0 or self.step < 0:
            raise ValueError("a step's slots, starts and number lie in range")
        if len(self.copy) % 3 or any(not 0 <= slot < MAX_SLOTS for i, slot in enumerate(self.copy) if i % 3 < 2) \
                or any(rows < 0 for rows in self.copy[2::3]):
            raise ValueError("a step's copies are (source slot, target slot, rows) each")
        if self.counts and (len(self.counts) != len(self.slots) or min(self.counts) < 1):
            raise ValueError("a step's counts are each sequence's tokens, at least one")
        if self.top < 0:
            raise ValueError(f"a step's top is 0 (every logit) or more, not {self.top}")


@dataclass(frozen=True)
class ParityOn:
    """The link lost a packet: send this many parity fragments after every partial from now on."""

    fragments: int

    def __post_init__(self) -> None:
        check_parity(self.fragments)


@dataclass(frozen=True)
class Ping:
    seq: int


@dataclass(frozen=True)
class BandwidthProbe:
    """Answered by a BandwidthReply of `reply_bytes`."""

    reply_bytes: int
    filler: Payload


@dataclass(frozen=True)
class Shutdown:
    pass


Message = (Register | Spare | Ready | Heartbeat | Fetch | Partial | Pong | BandwidthReply | Welcome | Assign | Input
           | Reset | BatchStep | ParityOn | Ping | BandwidthProbe | Shutdown)
MESSAGES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}
MAX_PROBE_BYTES = 64 << 20  # the largest bandwidth reply a node sends


def encode(message: Message) -> tuple[bytes, Payload]:
    """A message as its JSON text and its binary payload."""
    (binary,) = carried_fields(type(message)) or (None,)
    payload: Payload = b"" if binary is None else getattr(message, binary)
    fields = {"message": type(message).__name__, **plain(message)}
    return json.dumps(fields, separators=(",", ":")).encode(), payload


def decode(text: bytes, payload: Payload) -> Message:
    """The message in a control frame's JSON text and payload; BadMessage if it is not exactly one of ours."""
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BadMessage(f"bad control JSON: {str(e)[:80]}") from e
    if not isinstance(data, dict):
        raise BadMessage("a control message must be a JSON object")
    name = data.pop("message", None)
    cls = MESSAGES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise BadMessage("unknown control message")
    return build(cls, data, {name: payload for name in carried_fields(cls)})
