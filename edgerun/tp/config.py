"""How a tensor-parallel master runs: one frozen config for its membership, deployment and block exchange."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import EdgerunError
from edgerun.model.onnx_graph import Activations
from edgerun.net.wire import MAX_PARITY, Codec, Transport
from edgerun.sched.plans import Mapping, TPStrategy
from edgerun.tp.messages import MAX_SLOTS

MAPPINGS = tuple(Mapping)
OVERLAPS = ("pred",)
# With --transport udp the reliable channel carries only the first layer, the LM head and fetches,
# all on the per-token path: a lost segment there should cost milliseconds, not the kernel's 200 ms
# minimum retransmission timeout. The strict tcp baseline keeps the kernel's (as distributed-llama).
FAST_RTO_MIN_MS = 5.0


def tcp_rto_min_ms(transport: str, override: float | None) -> float | None:
    """The reliable channel's minimum retransmission timeout: `override` (0: the kernel's), else
    FAST_RTO_MIN_MS for udp and the kernel's for tcp. None means the kernel's."""
    if override is not None:
        return override or None
    return FAST_RTO_MIN_MS if transport == Transport.UDP else None


def check_exchange(timeout_ms: float | None, timeout_deviations: float, rto_min_ms: float | None,
                   group_size: int) -> None:
    """EdgerunError for a timeout, retransmission timeout or neuron-group size no cluster can run with (a master's
    config and a benchmark's, checked before anything is loaded)."""
    if timeout_ms is not None and not timeout_ms > 0:
        raise EdgerunError(f"the UDP merge timeout must be above 0 ms, not {timeout_ms}")
    if not 0 < timeout_deviations < float("inf"):
        raise EdgerunError(f"the adaptive timeout's deviations must be above 0, not {timeout_deviations}")
    if rto_min_ms is not None and not 0 <= rto_min_ms < float("inf"):
        raise EdgerunError(f"the minimum retransmission timeout must be 0 ms (the kernel's) or more, not {rto_min_ms}")
    if group_size < 1:
        raise EdgerunError(f"the MLP neuron-group size must be at least 1, not {group_size}")


@dataclass(frozen=True)
class MasterConfig:
    """How a tensor-parallel master runs. Change it with dataclasses.replace and Master.reconfigure."""

    strategy: TPStrategy = TPStrategy.HALO  # tensor-parallel planner
    host: str = "0.0.0.0"
    port: int = 0  # 0: any free port
    # Where nodes download the model file: None, a server of the master's own; a port, an HTTP server there
    # serves the master's routes() (`edgerun serve`: its one port).
    files_port: int | None = None
    transport: Transport = Transport.UDP
    codec: Codec = Codec.F32  # activations on the wire
    # With float32 activations: the layers' inputs as Q8 to the nodes whose shares compute on it as on float32
    # (Exchange.input_codec), 3.8x fewer bytes; off sends them float32, as the partials go.
    q8_inputs: bool = True
    timeout_ms: float | None = 10.0  # a lossy block's fixed wait; None: adaptive
    timeout_deviations: float = 4.0  # the adaptive timeout's k
    rto_min_ms: float | None = None  # the reliable channel's minimum retransmission timeout (None: by transport)
    parity: int = 2  # parity fragments after every vector on a lossy link, both ways (net.erasure)
    parity_always: bool = False  # parity on clean links too
    max_len: int = 1024  # context length: KV cache per device
    slots: int = 1  # sequences each device's share holds caches of at once, for a batch (tp.batch)
    budget_mb: float = 4096.0  # the master's own memory budget for its share
    speed: float = 1e9  # the master's own speed for the planner, weight bytes per second
    group_size: int = 256  # MLP neuron-group size
    vocab_block: int = 4096  # LM-head rows per unit
    mapping: Mapping = Mapping.INDEX
    # Dynamic mapping's overlap (HALO Fig. 5): pred ranks the next layer while this one's partials travel. HALO's
    # other, Load with Comp, has nothing to hide here: a dynamic share holds every unit's weights in its kernels'
    # packed form and a step selects its units inside the graph, so nothing is gathered.
    overlap: tuple[str, ...] = OVERLAPS
    threads: int = 1  # onnxruntime threads of the master's own share
    activations: Activations = Activations.INT8  # of every device's quantized products (its kernels' numbers)
    spin_us: float = 0.0  # how long the master polls for partials without sleeping (DatagramSocket.spin_s)
    trace_dir: Path | None = None  # where the master writes its timeline of one-token blocks (tp.trace)
    # One-token inputs go once to a multicast group for the nodes that joined it (net.group) rather than to each.
    # Off for loss made on loopback's input hook (bench tp --loss-at kernel): there one drop would lose a group
    # datagram for every node at once, where on a LAN each node's link loses its own copy.
    multicast: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.overlap) - set(OVERLAPS)
        if unknown:
            raise EdgerunError(f"unknown overlap {sorted(unknown)} (choose from {', '.join(OVERLAPS)})")
        if not 0 <= self.parity <= MAX_PARITY:
            raise EdgerunError(f"parity fragments must be 0 to {MAX_PARITY}, not {self.parity}")
        for name, kind in (("strategy", TPStrategy), ("transport", Transport), ("mapping", Mapping)):
            try:  # the enum's member for a name given as a string
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise EdgerunError(f"unknown {name} {getattr(self, name)!r} (choose from {', '.join(kind)})") from None
        if self.spin_us < 0:
            raise EdgerunError(f"spin must be 0 or more microseconds, not {self.spin_us}")
        if self.threads < 1 or self.max_len < 1:
            raise EdgerunError(f"threads and the context length must be at least 1, not {self.threads} and "
                               f"{self.max_len}")
        if not 0 <= self.budget_mb < float("inf") or not 0 < self.speed < float("inf"):
            raise EdgerunError(f"the master's memory budget must be 0 MB or more and its speed above 0, not "
                               f"{self.budget_mb} MB and {self.speed} bytes/s")
        if not 1 <= self.slots <= MAX_SLOTS:
            raise EdgerunError(f"a batch holds 1 to {MAX_SLOTS} sequences, not {self.slots}")
        if self.slots > 1 and (self.mapping == Mapping.DYNAMIC or self.activations is Activations.F32):
            raise EdgerunError("a tensor-parallel batch runs on ggml shares: static mapping and int8 activations")
        if self.vocab_block < 1:
            raise EdgerunError(f"vocabulary blocks must hold at least 1 row, not {self.vocab_block}")
        check_exchange(self.timeout_ms, self.timeout_deviations, self.rto_min_ms, self.group_size)
