"""`edgerun bench tp`: a local tensor-parallel cluster (nodes as processes on loopback), swept over
node counts, loss rates and transports, with the time per output token split into the master's
compute, waiting for partials, and the rest.

Loss comes from the in-process loss model (every UDP send, TCP untouched) or from the kernel, which also
makes TCP retransmit (HALO Table I's comparison): nftables drops on loopback, or a testbed of network
namespaces whose links also take a rate limit, and whose nodes take CPU quotas.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from edgerun.bench.ceiling import kernel_ceiling
from edgerun.bench.cores import USABLE_CORES, device_cores, pinned
from edgerun.bench.single import RequestTiming, cluster_baseline, span, spin_line
from edgerun.errors import EdgerunError
from edgerun.model.generate import generate
from edgerun.model.loader import Model, load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net import testbed
from edgerun.net.kernel_loss import loopback_loss, loss_counters
from edgerun.net.loops import auto_spin_us
from edgerun.net.loss import Bernoulli, LossModel, NoLoss, parse_loss
from edgerun.net.netns import entered
from edgerun.net.typed import build, plain
from edgerun.net.wire import Codec, derive_key
from edgerun.sap.predictor import PredictorSet
from edgerun.sched.tp_plan import TPPlan
from edgerun.tables import Column, text_table
from edgerun.tp.config import OVERLAPS, MasterConfig, check_exchange
from edgerun.tp.master import Master, TrialOutcome
from edgerun.tp.membership import NodeConn
from edgerun.tp.trace import BLOCK_KINDS, Leg, breakdown

MIB = 2**20
BENCH_PROMPT = "Distributed inference splits one model across several machines because"
SECRET = "edgerun-bench"
WARMUP_TOKENS = 8  # also what the adaptive timeout learns from before measuring
REBALANCE_WARMUPS = 8  # requests of 2 * WARMUP_TOKENS at most before a rebalance, for the devices' speeds
CONTEXT = 512  # tokens of KV cache in every engine of a benchmark


def bench_prompt(model: Model) -> list[int]:
    """The prompt every request of a benchmark starts with (the cluster's, the single engine's, the kernel
    ceiling's), in the model's tokens."""
    return model.tokenizer.encode(BENCH_PROMPT)


@dataclass(frozen=True)
class DeviceRun:
    """A device of the plan measured: its share's quantized weights and units (the fewest and most attention units
    and MLP groups it holds in a layer, its vocabulary blocks), and its kernels' speed and fixed cost per block as
    fitted from its one-token blocks (None until measured); and, where its share is on ggml, the mean time of a
    one-token share call beyond its kernels' graph (inputs in, output out, Python): the call's own fixed cost,
    which the fitted one holds beside the work of attention that does not grow with the weights."""

    name: str
    weight_mb: float
    speed_gb_s: float | None
    fixed_us: float | None
    attn_units: tuple[int, int] = (0, 0)
    mlp_groups: tuple[int, int] = (0, 0)
    vocab_blocks: int = 0
    call_us: float | None = None

    def units(self) -> str:
        def span(low_high: tuple[int, int]) -> str:
            low, high = low_high
            return f"{low}" if low == high else f"{low}-{high}"

        return (f"{span(self.attn_units)} attention units and {span(self.mlp_groups)} MLP groups a layer, "
                f"{self.vocab_blocks} vocabulary blocks")


@dataclass(frozen=True)
class RowSetup:
    """What a row ran: the cluster, its transport and loss, and the exchange's settings."""

    nodes: int
    transport: str
    loss: str
    loss_at: str  # "process", "kernel" or "testbed"
    codec: str
    timeout: str  # "10 ms" or "adaptive"
    parity: int  # parity fragments after every UDP vector (net.erasure)
    plan: str
    mapping: str
    group_size: int  # MLP neuron-group size
    overlap: str  # dynamic mapping's overlap: "pred" or "none"
    rate_mbit: float | None  # testbed links (None: unlimited)
    spin_us: float = 0.0  # how long master and nodes polled for the next packet (--spin-us, auto resolved)

    def label(self) -> str:
        """The row as its notes under the table name it."""
        return f"{self.nodes} node(s), {self.transport}, loss {self.loss}"


@dataclass(frozen=True)
class TimeSplit:
    """Where a row's token went (ms a token over the whole request, the prompt's prefill included), and the
    synchronization beyond the devices' compute (µs a block)."""

    predicted_ms: float  # the plan's prediction at the speeds the devices showed in this run
    compute_ms: float  # the master's own share
    pred_ms: float  # dynamic mapping: ranking units with the predictors
    wait_ms: float  # waiting for the nodes' partials
    incomplete_wait_ms: float  # of wait: waiting in blocks that ended incomplete
    other_ms: float  # norms, sends, sums, sampling
    node_compute_ms: float  # the busiest node's time in its kernels
    sync_us: float  # per synchronization: time beyond the slowest device's compute, over blocks
    # ... the same for the one-token steps alone: a decode step's time beyond the slowest device's kernels in it,
    # over its blocks (the prompt's blocks carry many tokens each, and their time was most of sync_us on two
    # cores: ~140 of ~190 µs a block)
    decode_sync_us: float


@dataclass(frozen=True)
class BlockCounts:
    """A row's blocks (synchronizations) on the master, and what became of them."""

    total: int
    incomplete: int
    rebuilt: int  # partials rebuilt from a parity fragment
    resent: int  # mirrored partials whole over UDP after the master asked for fragments they lacked
    prompt_inputs_doubled: int  # a prompt's inputs sent on a lossy node's spare stream too (Assign.spare_stream)
    # The native data path (net.fastpath): the row's blocks the master's runner ran, and of each node's one-token
    # blocks on its share (as its last heartbeat said) the share its native server computed.
    native: int = 0
    node_native_share: tuple[float, ...] = ()
    group_nodes: int = 0  # nodes whose one-token inputs went to the master's multicast group (net.group)
    q8_inputs: int = 0  # blocks whose input went to the nodes as Q8 (Exchange.input_codec)


@dataclass(frozen=True)
class PacketCounts:
    """A row's datagrams, as the master and (kernel or testbed loss) the kernel counted them."""

    sent: int
    dropped: int  # by the in-process loss model on the master's side
    kernel_matched: int  # cluster packets the kernel saw (kernel loss only)
    kernel_dropped: int
    late: int
    rejected: int


@dataclass(frozen=True)
class MemoryUse:
    """Memory in MiB (2**20 bytes), as the kernel counts resident memory."""

    master_weight_mb: float  # the master's share of quantized weights
    node_weight_mb: float  # the largest node share
    node_kv_mb: float  # that node's KV cache
    node_peak_rss_mb: float  # the largest peak resident memory of any node process (since it took its share)
    node_overhead_mb: float  # the most any node's peak RSS exceeds its share's weights and KV cache


@dataclass(frozen=True)
class Split:
    """The devices a row's plan gave units to, and how that plan came about."""

    computed_on: tuple[str, ...]  # the devices the plan gave units to, master first (a planner may leave some out)
    left_out: tuple[str, ...]  # the devices of the cluster it gave none
    rebalanced: bool  # the plan measured was made with the devices' measured speeds, after a warm-up
    # The rebalance's trial of that plan against the one before it (Master.rebalance), if it made one.
    trial: TrialOutcome | None = None
    devices: tuple[DeviceRun, ...] = ()  # rows with nodes: each device's share and its kernels as measured in the run

    @property
    def used(self) -> int:
        """Devices the plan gave units to, the master included."""
        return len(self.computed_on)

    def nodes_idle(self, nodes: int) -> bool:
        """Whether the nodes computed nothing (the plan left every node out): such a row measures the master
        alone, and no speed-up or loss effect of a cluster may be read from it."""
        return nodes > 0 and bool(self.computed_on) and set(self.computed_on) <= {"master"}


@dataclass(frozen=True)
class Compared:
    """The single engine's timing of the same request (`timing`, as it ran around a row) and the speed-ups of a
    run (a row, or a row's kernel ceiling) over it: the single engine's time over the run's."""

    timing: RequestTiming
    speedup: float  # whole request
    decode_speedup: float
    prefill_speedup: float

    @classmethod
    def of(cls, reference: RequestTiming, run: RequestTiming) -> Compared:
        return cls(reference, reference.ms_per_token / run.ms_per_token,
                   reference.decode_ms_per_token / run.decode_ms_per_token, reference.prefill_ms / run.prefill_ms)


@dataclass(frozen=True)
class Yardstick:
    """llama.cpp's llama-bench on the same file and threads (--vs-llamacpp), and a row's decode against it."""

    decode_ms_per_token: float
    prefill_tok_s: float
    decode_speedup: float  # decode_ms_per_token / the row's


@dataclass(frozen=True)
class CeilingRun:
    """--ceiling: the devices' even shares' kernels alone, every block in step on all of them, no network
    (bench.ceiling): the decode, the prompt and the whole request this machine allows the cluster with nothing but
    its kernels; `single` the single engine's times over them (--baseline)."""

    timing: RequestTiming
    # a one-token block of each kind in step, the slowest device's kernel (µs, mean; Ceiling.block_us)
    block_us: dict[str, float] = field(default_factory=dict)
    single: Compared | None = None


@dataclass(frozen=True)
class Traced:
    """--trace: where a row's one-token blocks' time went, leg by leg of their critical path (empty where no block
    with a node's partial was recorded), and the same of the blocks of each kind alone (trace.BLOCK_KINDS' names)."""

    legs: tuple[Leg, ...] = ()
    kind_legs: dict[str, tuple[Leg, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class TpResult:
    """One row of `bench tp`: what ran, its times, and where they went."""

    setup: RowSetup
    tokens: int
    timing: RequestTiming  # ms a token (prefill included), the one-token steps alone, the prefill
    time: TimeSplit
    blocks: BlockCounts
    packets: PacketCounts
    memory: MemoryUse
    split: Split
    single: Compared | None = None  # against the single-process engine, same model and threads (--baseline)
    llamacpp: Yardstick | None = None  # --vs-llamacpp
    ceiling: CeilingRun | None = None  # --ceiling
    trace: Traced | None = None  # --trace

    def nodes_idle(self) -> bool:
        """Whether this row's nodes computed nothing: it gives no speed-up or loss effect of a cluster."""
        return self.split.nodes_idle(self.setup.nodes)


def loss_model(spec: str, seed: int | None = None) -> LossModel:
    """--plr's spec as a loss model; EdgerunError (one line, exit 2) for one that is not a loss spec."""
    try:
        return parse_loss(spec, seed=seed)
    except ValueError as e:
        raise EdgerunError(f"--plr: {e}") from e


def kernel_rate(spec: str) -> float:
    """A plain loss rate ("5%", "0.05"): the kernel drops independently; bursts are in-process only."""
    model = loss_model(spec)
    if isinstance(model, NoLoss):
        return 0.0
    if not isinstance(model, Bernoulli):
        raise EdgerunError(f"kernel loss takes a plain rate, not {spec!r}")
    return model.rate


def check_losses(losses: Sequence[str], loss_at: str) -> dict[str, float]:
    """Every --plr spec checked before a model is loaded or a node started (EdgerunError for a bad one); with
    kernel or testbed loss, each one's rate."""
    if loss_at != "process":
        return {loss: kernel_rate(loss) for loss in losses}  # parses each as loss_model does, and more
    for loss in losses:
        loss_model(loss)
    return {}


@dataclass(frozen=True)
class TpBenchConfig:
    """How a benchmark cluster runs; the sweep (node counts, loss rates, transports) is given beside it.

    loss_at: "process" (the in-process loss model, UDP only), "kernel" (nftables on loopback) or "testbed"
    (every node in its own network namespace, the links shaped by the kernel: loss, rate_mbit, delay_ms,
    and cpu_quotas, one value for all nodes or one per node). node_speeds: what each node reports to the
    planner, in weight bytes per second (empty: the node's default)."""
    model_path: Path | None = None
    plan: str = "halo"
    tokens: int = 32
    codec: str = "f32"
    timeout_ms: float | None = 10.0  # None: adaptive
    timeout_deviations: float = 4.0
    rto_min_ms: float | None = None
    parity: int = 2  # parity fragments per vector
    loss_at: str = "process"
    rate_mbit: float | None = None
    delay_ms: float = 0.0
    cpu_quotas: tuple[float, ...] = ()
    node_speeds: tuple[float, ...] = ()
    mapping: str = "index"
    sap: Path | None = None  # predictors, for static and dynamic mapping
    overlap: tuple[str, ...] = OVERLAPS
    threads: int = 1  # BLAS threads of the master and of each node: all share one machine
    group_size: int = 256  # MLP neuron-group size
    parity_always: bool = False  # parity on clean links too (else once a link loses a packet)
    spin_us: float | None = 0.0  # master and nodes poll their UDP socket this long before sleeping; None: auto
    rebalance: bool = True  # after a warm-up, replan with the speeds the devices showed (Master.rebalance)
    # An experiment's rows: every device computes on every row, on the planner's split at the declared speeds
    # (no rebalance), one split for every transport and loss of a node count; a split that leaves one out is an
    # error. Else (serving's way) a row may run on fewer devices than it started, and says so.
    every_device: bool = False
    vs_llamacpp: bool = False  # also time llama.cpp's llama-bench on the same file and threads, pinned as the master
    activations: Activations = Activations.INT8  # of every quantized product, the single baseline's too
    trace_dir: Path | None = None  # --trace: master's and nodes' timelines, a directory per node count
    pin: int = 0  # cores of its own for every device (master, each node, the single baseline); 0: not pinned
    ceiling: bool = False  # also time each node count's kernels alone, in step, without the network (bench.ceiling)
    gpu_nodes: int = 0  # the first this many nodes compute their shares on the GPU (node --device cuda)
    multicast: bool = True  # one-token inputs to the master's multicast group (never with loss_at "kernel")
    q8_inputs: bool = True  # the layers' inputs as Q8 to nodes whose shares compute on it as on float32

    def __post_init__(self) -> None:
        if self.loss_at not in LOSS_AT:
            raise EdgerunError(f"loss is applied in {', '.join(LOSS_AT)}, not {self.loss_at!r}")
        if self.loss_at != "testbed" and (self.rate_mbit is not None or self.delay_ms or self.cpu_quotas):
            raise EdgerunError("rate, delay and CPU quotas need --loss-at testbed")
        if self.tokens < 1:
            raise EdgerunError("--tokens must be at least 1")
        if self.threads < 1:
            raise EdgerunError("--threads must be at least 1")
        if self.pin < 0:
            raise EdgerunError("--pin takes a number of cores per device, 0 for none")
        if self.gpu_nodes < 0:
            raise EdgerunError("--gpu-nodes takes a number of nodes, 0 for none")
        if self.every_device and self.rebalance:
            raise EdgerunError("--every-device runs the planner's split at the declared speeds, not --rebalance (a "
                               "rebalance by measured speeds may leave slow devices out)")
        check_exchange(self.timeout_ms, self.timeout_deviations, self.rto_min_ms, self.group_size)


LOSS_AT = ("process", "kernel", "testbed")


def _node_argv(config: TpBenchConfig, master: str, i: int, loss: str) -> list[str]:
    argv = [sys.executable, "-m", "edgerun.cli", "node", "--master", master, "--name", f"bench-{i}", "--key",
            SECRET, "--loss", loss, "--loss-seed", str(i + 1), "--threads", str(config.threads),
            "--spin-us", str(config.spin_us), "--device", "cuda" if i < config.gpu_nodes else "cpu"]
    if config.model_path is not None:
        argv += ["--model", str(config.model_path)]
    if config.node_speeds:
        argv += ["--speed", str(config.node_speeds[i % len(config.node_speeds)])]
    return argv


def _trace_dir(config: TpBenchConfig, nodes: int) -> Path | None:
    return None if config.trace_dir is None else config.trace_dir / f"nodes{nodes}"


@contextlib.contextmanager
def local_cluster(model: Model, config: TpBenchConfig, nodes: int, loss: str,
                  bed: testbed.TestbedSpec | None = None) -> Iterator[Master]:
    """A master in this process and `nodes` node processes (one BLAS thread each): on loopback, or with `bed`
    the master in the testbed's master namespace (this thread stays there while the cluster runs) and node i
    in node namespace i + 1."""
    with entered(None if bed is None else bed.master_ns):
        address = "127.0.0.1" if bed is None else bed.master_address
        master_config = MasterConfig(
            strategy=config.plan, host=address, codec=Codec[config.codec.upper()], timeout_ms=config.timeout_ms,
            max_len=CONTEXT, rto_min_ms=config.rto_min_ms, timeout_deviations=config.timeout_deviations,
            parity=config.parity, parity_always=config.parity_always, mapping=config.mapping,
            overlap=tuple(config.overlap), group_size=config.group_size, threads=config.threads,
            spin_us=config.spin_us, activations=config.activations, trace_dir=_trace_dir(config, nodes),
            multicast=config.multicast and config.loss_at != "kernel", q8_inputs=config.q8_inputs)
        master = Master(model, derive_key(SECRET), master_config, loss=loss_model(loss, seed=0),
                        predictors=None if config.sap is None else PredictorSet.load(config.sap))
        procs = []
        try:
            for i in range(nodes):
                argv = _node_argv(config, f"{address}:{master.port}", i, loss)
                if master_config.trace_dir is not None:
                    argv += ["--trace", str(master_config.trace_dir / f"node-{i}.jsonl")]
                cores = device_cores(i + 1, config.pin)
                affinity = None if cores is None else functools.partial(os.sched_setaffinity, 0, cores)
                procs.append(subprocess.Popen(argv, stderr=subprocess.DEVNULL, preexec_fn=affinity) if bed is None
                             else testbed.popen(bed, i + 1, argv, stderr=subprocess.DEVNULL, preexec_fn=affinity))
            master.wait_for_nodes(nodes, timeout_s=300)
            yield master
        finally:
            master.close()
            for p in procs:
                p.kill()
                p.wait()


def _rebalance(master: Master, model: Model) -> tuple[bool, TrialOutcome | None]:
    """Warm up on the plan made with the declared speeds until every device of it has measured its speed (at most
    REBALANCE_WARMUPS requests), then replan with those the devices showed, as `edgerun master` does between
    requests, and run the new split until its trial ends (Master.rebalance: kept if faster, else the old split
    again); whether the plan changed, and how the trial ended if there was one. (A small model's share of a few
    milliseconds a token measures nothing in one short request: the replan kept the declared speeds and a split
    slower than the master alone.)"""
    prompt = bench_prompt(model)
    used = computing(master.plan)
    for _ in range(REBALANCE_WARMUPS):
        _warm_up(master, prompt)
        master.take_measurements()
        if all(name in master.measured for name in used):
            break
    original, outcome = master.plan.counts(), master.trials.last
    master.rebalance()
    for _ in range(REBALANCE_WARMUPS):
        if master.trials.current is None:
            break
        _warm_up(master, prompt)
        master.rebalance()
    # The outcome of a trial this call ran, not of one an earlier row of this cluster ran.
    return master.plan.counts() != original, None if master.trials.last is outcome else master.trials.last


def _warm_up(master: Master, prompt: list[int]) -> None:
    """One warm-up request, and the nodes' reports of it."""
    master.generate(prompt, WARMUP_TOKENS * 2, Sampler(SamplingParams()))
    master.fresh_reports()


def _measure(master: Master, model: Model, config: TpBenchConfig, nodes: int, loss: str,
             kernel_counters: Callable[[], tuple[int, int]], rebalanced: bool) -> TpResult:
    prompt = bench_prompt(model)
    greedy = Sampler(SamplingParams())
    # The timed request follows its warm-up at once, as the single baseline's does: after an idle second (the
    # nodes' next heartbeats) a prefill took 37-43 ms where a warm one took 30-34, in either engine. The nodes'
    # kernel time is what they report for the timed request's session, read after it.
    master.generate(prompt, WARMUP_TOKENS, greedy)
    s, sent, dropped, rejected = master.stats, master.udp.sent, master.udp.dropped, master.counters.total()
    before = dict(s.__dict__)
    matched0, kdropped0 = kernel_counters()
    at_first: dict[str, float] = {}  # the master's counts when the prompt's token came: the decode's start

    def first(_: int) -> None:
        if not at_first:
            at_first.update(s.__dict__)

    start = time.perf_counter()
    result = generate(master, prompt, config.tokens, greedy, on_token=first)
    elapsed = time.perf_counter() - start
    timing = RequestTiming.of(result, elapsed)
    generated = result.tokens
    matched1, kdropped1 = kernel_counters()
    reports = master.fresh_reports()  # after the nodes' heartbeats, which flushed their traces
    trace: Traced | None = None
    devices: tuple[DeviceRun, ...] = ()
    if master.trace is not None:
        master.trace.flush()
        found = breakdown(master.config.trace_dir, master.exchange.session)
        trace = Traced(tuple(found[None]),
                       {name: tuple(found[kind]) for kind, name in BLOCK_KINDS.items() if kind in found})
    if reports:
        devices = _device_runs(master, reports)
    n = max(1, len(generated))
    compute = (s.compute_s - before["compute_s"]) / n
    wait = (s.wait_s - before["wait_s"]) / n
    session = master.exchange.session
    node_compute = max([r.session_compute[1] / n for r in reports if r.session_compute[0] == session], default=0.0)
    blocks = s.blocks - before["blocks"]
    syncs_per_token = blocks / n
    overhead = (elapsed / n - max(compute, node_compute)) / max(syncs_per_token, 1)
    steps = max(1, len(generated) - 1)
    decode_compute = max([(s.compute_s - at_first["compute_s"]) / steps]
                         + [r.session_decode[1] / steps for r in reports if r.session_decode[0] == session])
    decode_sync = (timing.decode_ms_per_token / 1e3 - decode_compute) / max((s.blocks - at_first["blocks"]) / steps, 1)
    biggest = max(reports, key=lambda r: r.weight_bytes, default=None)
    c = master.config
    setup = RowSetup(
        nodes=nodes, transport=c.transport, loss=loss, loss_at=config.loss_at, codec=config.codec,
        timeout="adaptive" if c.timeout_ms is None else f"{c.timeout_ms:g} ms", parity=c.parity, plan=c.strategy,
        mapping=c.mapping, group_size=c.group_size, overlap="+".join(sorted(c.overlap)) or "none",
        rate_mbit=config.rate_mbit, spin_us=config.spin_us or 0.0)
    time_split = TimeSplit(
        predicted_ms=master.predicted_s() * 1e3, compute_ms=compute * 1e3,
        pred_ms=(s.pred_s - before["pred_s"]) / n * 1e3, wait_ms=wait * 1e3,
        incomplete_wait_ms=(s.incomplete_wait_s - before["incomplete_wait_s"]) / n * 1e3,
        other_ms=(elapsed / n - compute - wait) * 1e3, node_compute_ms=node_compute * 1e3, sync_us=overhead * 1e6,
        decode_sync_us=decode_sync * 1e6 if len(generated) > 1 else float("nan"))
    block_counts = BlockCounts(
        total=blocks, incomplete=s.blocks_incomplete - before["blocks_incomplete"],
        rebuilt=s.partials_rebuilt - before["partials_rebuilt"],
        resent=s.completed_after_ask - before["completed_after_ask"],
        prompt_inputs_doubled=s.spare_inputs - before["spare_inputs"],
        native=s.native_blocks - before["native_blocks"],
        node_native_share=tuple(r.native_blocks / r.decode.blocks if r.decode.blocks else 0.0 for r in reports),
        # the runner alone sends to the group: a row it did not run (tcp, loss made in-process) sent none there
        group_nodes=sum(n.alive and n.in_group for n in master.membership.nodes)
        if c.multicast and s.native_blocks > before["native_blocks"] else 0,
        q8_inputs=s.q8_inputs - before["q8_inputs"])
    packets = PacketCounts(
        sent=master.udp.sent - sent, dropped=master.udp.dropped - dropped, kernel_matched=matched1 - matched0,
        kernel_dropped=kdropped1 - kdropped0, late=s.late_packets - before["late_packets"],
        rejected=master.counters.total() - rejected)
    memory = MemoryUse(
        master_weight_mb=master.weight_bytes / MIB,
        node_weight_mb=0.0 if biggest is None else biggest.weight_bytes / MIB,
        node_kv_mb=0.0 if biggest is None else biggest.cache_bytes / MIB,
        node_peak_rss_mb=max([r.peak_rss_mb for r in reports], default=0.0),
        node_overhead_mb=max([r.peak_rss_mb - (r.weight_bytes + r.cache_bytes) / MIB for r in reports], default=0.0))
    split = Split(computed_on=computing(master.plan), left_out=leaving_out(master.plan), rebalanced=rebalanced,
                  devices=devices)
    return TpResult(setup=setup, tokens=len(generated), timing=timing, time=time_split, blocks=block_counts,
                    packets=packets, memory=memory, split=split, trace=trace)


def computing(plan: TPPlan) -> tuple[str, ...]:
    """The devices a plan gives units to, in its order (the master first)."""
    return tuple(name for name, held in zip(plan.devices, plan.memory_bytes, strict=True) if held > 0)


def leaving_out(plan: TPPlan) -> tuple[str, ...]:
    """The devices a plan gives no units to."""
    return tuple(name for name, held in zip(plan.devices, plan.memory_bytes, strict=True) if held == 0)


def _device_runs(master: Master, reports: list[NodeConn]) -> tuple[DeviceRun, ...]:
    master.take_measurements()
    held = {"master": master.weight_bytes} | {r.name: r.weight_bytes for r in reports}
    calls = {r.name: r.call_cost for r in reports}
    own = getattr(master.shard, "calls", None)
    if own is not None:
        calls["master"] = (own.count, own.overhead_s)
    counts = master.plan.counts()
    runs = []
    for i, name in enumerate(master.plan.devices):
        m = master.measured.get(name)
        attn, mlp = [layer[i] for layer in counts.attn], [layer[i] for layer in counts.mlp]
        count, overhead_s = calls.get(name, (0, 0.0))
        runs.append(DeviceRun(name, held.get(name, 0) / MIB, None if m is None else m.speed / 1e9,
                              None if m is None or m.fixed_s is None else m.fixed_s * 1e6,
                              (min(attn), max(attn)), (min(mlp), max(mlp)), counts.vocab[i],
                              overhead_s / count * 1e6 if count else None))
    return tuple(runs)


def single_baseline(model: Model, config: TpBenchConfig) -> RequestTiming:
    """The single-process engine (default_engine) on the same model, prompt, token count and threads, timed as a
    cluster is (prefill included, after a warm-up request)."""
    return cluster_baseline(model, bench_prompt(model), config.tokens, config.threads,
                            config.activations, CONTEXT, WARMUP_TOKENS)


def _testbed_for(config: TpBenchConfig, nodes: int) -> testbed.TestbedSpec:
    quotas = config.cpu_quotas if len(config.cpu_quotas) <= 1 else config.cpu_quotas[:nodes]
    return testbed.TestbedSpec(nodes=nodes, rate_mbit=config.rate_mbit, delay_ms=config.delay_ms,
                               cpu_quotas=quotas, name=f"bench{os.getpid()}")


def bench_tp(config: TpBenchConfig, node_counts: list[int], losses: list[str], transports: list[str],
             progress: Callable[[str], None] = lambda _: None, plans: Sequence[str] = (),
             baseline: bool = False) -> list[TpResult]:
    """Every (nodes, loss, plan, transport) combination; plans default to config.plan. With kernel or testbed
    loss one cluster per node count serves every loss rate (links are measured and assignments sent before any
    loss); in-process loss is set when a node starts, so each rate gets its own cluster."""
    rates = check_losses(losses, config.loss_at)
    if config.loss_at == "testbed" and 0 in node_counts:
        raise EdgerunError("a testbed needs at least one node (the master alone has no links)")
    if len(config.cpu_quotas) > 1 and len(config.cpu_quotas) != max(node_counts):
        # one per node of the largest count; a smaller count takes the first ones (_testbed_for)
        raise EdgerunError(f"--cpu-quota takes one value for every node, or one per node of the largest --nodes "
                           f"({max(node_counts)}), not {len(config.cpu_quotas)}")
    model = load_model(config.model_path)
    results = []
    # The master in this process is held to the nodes' BLAS threads: with a thread per core in every process
    # of one machine, they would slow each other down.
    with threadpool_limits(config.threads), pinned(device_cores(0, config.pin)):
        singles = []  # the single engine, timed before the first node count and after each

        def single() -> None:
            progress(f"single-process engine (ggml, or onnx where ggml does not run the model), "
                     f"{config.threads} thread(s)")
            singles.append(single_baseline(model, config))

        if baseline:
            single()
        reference = llamacpp_reference(model, config, progress) if config.vs_llamacpp else None
        for nodes in node_counts:
            # auto: by the cores this process could use before --pin narrowed them to the master's
            spin_us = auto_spin_us(nodes + 1, max(config.threads, config.pin), len(USABLE_CORES)) \
                if config.spin_us is None else config.spin_us
            rows = _bench_cluster(replace(config, spin_us=spin_us), model, nodes, losses, transports, progress,
                                  plans, rates)
            if config.ceiling:
                progress(f"kernel ceiling: {nodes + 1} device(s)' shares in step, no network")
                cores = [device_cores(i, config.pin) for i in range(nodes + 1)]  # all None unpinned
                ceiling = kernel_ceiling(config.model_path, nodes + 1, config.threads, config.activations.value,
                                         config.tokens, CONTEXT, cores,
                                         prompt=len(bench_prompt(model)))
                timing = RequestTiming(ceiling.ms_per_token(config.tokens), ceiling.decode_ms_per_token,
                                       ceiling.prefill_ms)
                rows = [replace(r, ceiling=CeilingRun(timing, dict(ceiling.block_us))) for r in rows]
            if baseline:  # each row against the single engine as fast as it was around it
                single()
                around = RequestTiming.mean(singles[-2:])
                rows = [replace(r, single=Compared.of(around, r.timing), ceiling=None if r.ceiling is None else
                                replace(r.ceiling, single=Compared.of(around, r.ceiling.timing))) for r in rows]
            if reference is not None:  # llama.cpp on one device, the yardstick beside every row
                decode_ms = 1e3 / reference.decode_tok_s
                rows = [replace(r, llamacpp=Yardstick(decode_ms, reference.prefill_tok_s,
                                                      decode_ms / r.timing.decode_ms_per_token)) for r in rows]
            results += rows
    return results


def llamacpp_reference(model: Model, config: TpBenchConfig, progress: Callable[[str], None]):
    """llama.cpp's llama-bench (built once from the PyPI sdist) on the same GGUF file, at the master's threads
    and cores, with the bench's prompt length and token count."""
    from edgerun import llamacpp

    if model.path.suffix != ".gguf":
        raise EdgerunError(f"--vs-llamacpp runs llama.cpp on the model's GGUF file; {model.path} is not one")
    cores = device_cores(0, config.pin)
    progress(f"llama.cpp's llama-bench, {config.threads} thread(s)" + ("" if cores is None else " (pinned)"))
    return llamacpp.llama_bench(model.path, config.threads, len(bench_prompt(model)), config.tokens, repetitions=2,
                                cores=None if cores is None else ",".join(map(str, sorted(cores))))


def _bench_cluster(config: TpBenchConfig, model: Model, nodes: int, losses: list[str], transports: list[str],
                   progress: Callable[[str], None], plans: Sequence[str], rates: dict[str, float]) -> list[TpResult]:
    """One node count's combinations: one cluster for all loss rates where the kernel applies them."""
    results = []
    in_kernel = config.loss_at != "process"
    # A planner's first split (and its rebalance) serves every row of this node count: with in-process loss each
    # rate has a cluster of its own, whose nodes bear the same names and take the same split.
    first: dict[str, tuple[TPPlan, bool, TrialOutcome | None]] = {}
    with contextlib.ExitStack() as stack:
        bed = stack.enter_context(testbed.running(_testbed_for(config, nodes))) if config.loss_at == "testbed" else None
        for group in ([losses] if in_kernel else [[loss] for loss in losses]):
            with local_cluster(model, config, nodes, "0" if in_kernel else group[0], bed) as master:
                # In one cluster, a planner's rows after its first run on the split its first made (and
                # rebalanced): a row then differs from its neighbours by its loss rate or transport alone, on the
                # same devices. Replanned from each row's warm-up, rows of one rate on this 2-core machine ran on
                # plans from the master alone to 424 of 862 MiB on the node, and the loss ratio measured the plans
                # more than the loss; planned per transport, tcp rows ran on the master alone beside udp rows on
                # three devices, and "tcp = 0.15x udp" compared two different clusters.
                for loss, plan, transport in itertools.product(group, plans or [config.plan], transports):
                    progress(f"master + {nodes} node(s), plan {plan}, {transport}, {config.loss_at} loss {loss}")
                    master.reconfigure(replace(master.config, strategy=plan, transport=transport))
                    master.forget_loss()  # a row after a lossy one (--plr 0,5%,0,5%) starts on clean links too
                    kept = first.get(plan)
                    master.replan(None if kept is None else kept[0])  # before the loss: assignments travel clean
                    if kept is None:
                        if config.every_device and master.plan.devices_used < nodes + 1:
                            raise EdgerunError(
                                f"plan {plan} leaves {', '.join(leaving_out(master.plan))} out of {nodes} node(s) at "
                                "the declared speeds, and --every-device asks every device to compute: use --plan "
                                "even, or declare speeds the planner gives units to")
                        rebalanced, trial = _rebalance(master, model) if config.rebalance and nodes > 0 else \
                            (False, None)
                        first[plan] = (master.plan, rebalanced, trial)
                    else:
                        rebalanced, trial = kept[1:]
                    # A row on a kept plan has no warm-ups before its loss, in which a spare stream reopened (after
                    # a tcp row closed it) had time to connect.
                    if not master.wait_for_spares():
                        progress("a node's spare stream did not open in time: its prompts cross on one stream")
                    with _lossy(config, master, bed, rates.get(loss, 0.0)) as counters:
                        row = _measure(master, model, config, nodes, loss, counters, rebalanced)
                        results.append(replace(row, split=replace(row.split, trial=trial)))
    return results


@contextlib.contextmanager
def _lossy(config: TpBenchConfig, master: Master, bed: testbed.TestbedSpec | None,
           rate: float) -> Iterator[Callable[[], tuple[int, int]]]:
    """Loss at `rate` where the config puts it, for the length of the context; yields its kernel counters."""
    if bed is not None:
        testbed.set_loss(bed, rate)
        try:
            yield lambda: testbed.measured_loss(bed)
        finally:
            testbed.set_loss(bed, 0.0)
    elif config.loss_at == "kernel":
        udp_ports = [master.udp_port] + [n.udp_port for n in master.nodes]
        with loopback_loss(rate, [master.port], udp_ports) as table:
            yield lambda: loss_counters(table)
    else:
        yield lambda: (0, 0)


def _speedup_cell(r: TpResult, ratio: Callable[[Compared], float]) -> str:
    """A speed-up over the single engine: none measured, none to measure (the master computed alone), or the
    ratio."""
    return "" if r.single is None else "-" if r.nodes_idle() else f"{ratio(r.single):.2f}x"


TP_COLUMNS: tuple[Column[TpResult], ...] = (
    Column("nodes", lambda r: r.setup.nodes),
    Column("used", lambda r: r.split.used),
    Column("transport", lambda r: r.setup.transport),
    Column("loss", lambda r: r.setup.loss, width=6),
    Column("ms/token", lambda r: r.timing.ms_per_token, ".1f", width=9),
    Column("plan", lambda r: r.time.predicted_ms, ".1f", width=6),
    Column("speed-up", lambda r: _speedup_cell(r, lambda c: c.speedup)),
    Column("decode", lambda r: r.timing.decode_ms_per_token, ".1f", width=7),
    Column("(x)", lambda r: _speedup_cell(r, lambda c: c.decode_speedup), width=6),
    Column("prefill", lambda r: r.timing.prefill_ms, ".1f", width=8),
    Column("(x)", lambda r: _speedup_cell(r, lambda c: c.prefill_speedup), width=6),
    Column("compute", lambda r: r.time.compute_ms, ".1f", width=8),
    Column("node", lambda r: r.time.node_compute_ms, ".1f", width=7),
    Column("wait", lambda r: r.time.wait_ms, ".1f", width=8),
    Column("lost wait", lambda r: r.time.incomplete_wait_ms, ".1f"),
    Column("other", lambda r: r.time.other_ms, ".1f", width=8),
    Column("sync µs", lambda r: r.time.decode_sync_us, ".0f", width=8),
    Column("req sync", lambda r: r.time.sync_us, ".0f"),
    Column("incomplete blocks", lambda r: f"{r.blocks.incomplete}/{r.blocks.total}"),
    Column("rebuilt", lambda r: r.blocks.rebuilt),
    Column("resent", lambda r: r.blocks.resent),
    Column("late pkts", lambda r: r.packets.late),
    Column("kernel drops", lambda r: f"{r.packets.kernel_dropped}/{r.packets.kernel_matched}"),
    Column("node MiB w+kv/rss (+over)", lambda r: _node_memory(r.memory) if r.setup.nodes else "-", width=26),
)


def _node_memory(m: MemoryUse) -> str:
    return f"{m.node_weight_mb:.0f}+{m.node_kv_mb:.0f}/{m.node_peak_rss_mb:.0f} (+{m.node_overhead_mb:.0f})"


def tp_table(results: list[TpResult]) -> str:
    """Times in ms per token; "used" the devices the plan gave units to (master included); "plan" what the plan
    predicts at the speeds the devices showed in the run (its model of the run, to check against ms/token);
    "lost wait" is the part of "wait" spent in blocks that ended incomplete; "node" the busiest node's kernels;
    "sync" the time per one-token synchronization beyond the slowest device's compute in the decode steps (µs),
    "req sync" the same over the whole request (the prompt's blocks and time counted in); "speed-up" against the
    single-process engine (--baseline); "decode" the one-token steps alone (ms/token includes the prompt's
    prefill), with their speed-up over the single engine's; "prefill" the prompt's prefill and first token in ms
    (the time to the first token), with its speed-up; "rebuilt" partials rebuilt from a parity fragment, "resent"
    mirrored partials that came whole after the master asked for fragments they lacked."""
    rows = text_table(TP_COLUMNS, results)
    rows += [f"{r.setup.label()}: computed on {', '.join(r.split.computed_on)}"
             + (f"; left out: {', '.join(r.split.left_out)}" if r.split.left_out else "")
             + ("; the nodes computed nothing, so this row gives no speed-up or loss effect" if r.nodes_idle() else "")
             + _native_said(r) for r in results if r.split.computed_on]
    yardstick = [(r, r.llamacpp) for r in results if r.llamacpp is not None]
    if yardstick:
        ref = yardstick[0][1]
        rows.append(f"llama.cpp (llama-bench, same file and threads, on the master's cores): decode "
                    f"{ref.decode_ms_per_token:.1f} ms/token, prefill {ref.prefill_tok_s:.1f} "
                    "tok/s; each row's decode against it: " + ", ".join(
                        f"{r.setup.nodes} node(s) {r.setup.transport} loss {r.setup.loss} "
                        + ("- (nodes idle)" if r.nodes_idle() else f"{y.decode_speedup:.2f}x")
                        for r, y in yardstick))
    singles = [r.single.timing for r in results if r.single is not None]
    if singles:
        rows.append(f"single-process engine: {span([t.ms_per_token for t in singles])} ms/token, decode "
                    f"{span([t.decode_ms_per_token for t in singles])}, prefill "
                    f"{span([t.prefill_ms for t in singles])} ms (timed before the first node count "
                    "and after each: each row is compared with the mean of the two runs around it)")
    rows += _repeated(results)

    def run_of(r: TpResult) -> tuple[int, RequestTiming | None]:  # a node count run again has ceilings anew
        return r.setup.nodes, None if r.ceiling is None else r.ceiling.timing

    for run in dict.fromkeys(run_of(r) for r in results if r.ceiling is not None):
        rows.append(_ceiling_line([r for r in results if run_of(r) == run]))
    if results:
        rows.append(spin_line({r.setup.nodes + 1: r.setup.spin_us for r in results}))  # the master and its nodes
    for r in results:
        label = r.setup.label()
        if r.trace is not None and not r.trace.legs:
            rows.append(f"{label}: no one-token block with a node's partial to trace (the plan leaves every node "
                        "out, or its blocks went over TCP)")
        if r.trace is not None and r.trace.legs:
            rows.append(f"{label}: a one-token block's critical path (--trace; µs, median/mean; the nodes' legs at "
                        "the node that answered last): " + _legs(r.trace.legs))
        for kind, legs in ({} if r.trace is None else r.trace.kind_legs).items():
            rows.append(f"{label}: {kind} blocks alone: {_legs(legs)}")
        if r.blocks.prompt_inputs_doubled:
            rows.append(f"{label}: {r.blocks.prompt_inputs_doubled} prompt inputs went to lossy nodes on both their "
                        "streams")
        if r.split.trial is not None:
            rows.append(f"{label}: {r.split.trial.said()}")
        if r.split.devices:
            rows.append(f"{label}: shares (MiB of weights, units, kernels measured as speed + fixed cost a block, "
                        "and a share call's own cost beyond its kernels): "
                        + "; ".join(f"{d.name} {d.weight_mb:.0f} MiB, {d.units()}" +
                                    ("" if d.speed_gb_s is None else f", {d.speed_gb_s:.2f} GB/s") +
                                    ("" if d.fixed_us is None else f" + {d.fixed_us:.0f} µs") +
                                    ("" if d.call_us is None else f", calls {d.call_us:.0f} µs")
                                    for d in r.split.devices))
    return "\n".join(rows)


def _native_said(r: TpResult) -> str:
    """How much of a row the native data path ran (net.fastpath): the master's blocks, each node's one-token ones."""
    b = r.blocks
    if not r.setup.nodes or not b.total:
        return ""
    shares = ", ".join(f"{share:.0%}" for share in b.node_native_share) or "none"
    return f"; natively: {b.native} of the master's {b.total} blocks, of each node's one-token blocks " \
           f"{shares}; inputs by multicast to {b.group_nodes} of {r.setup.nodes} nodes" + \
           (f"; layers' inputs as Q8 in {b.q8_inputs} blocks" if b.q8_inputs else "")


def _legs(legs: Sequence[Leg]) -> str:
    return "; ".join(f"{leg.name} {leg.median_us:.0f}/{leg.mean_us:.0f}" for leg in legs)


def _ceiling_line(same: list[TpResult]) -> str:
    """What a node count's kernels alone allow (--ceiling, measured once for the rows `same` of one cluster, which
    carry it alike), each over the single engine where it was timed, and those rows against it."""
    ceiling = same[0].ceiling
    assert ceiling is not None
    c = ceiling.timing

    def over_single(speedup: Callable[[Compared], float]) -> str:
        return "" if ceiling.single is None else f" = {speedup(ceiling.single):.2f}x the single engine's"

    return (f"kernel ceiling, {same[0].setup.nodes + 1} device(s) (--ceiling: even shares' kernels alone, every block "
            f"in step, no network): decode {c.decode_ms_per_token:.1f} ms/token"
            f"{over_single(lambda s: s.decode_speedup)}, prefill {c.prefill_ms:.1f} ms"
            f"{over_single(lambda s: s.prefill_speedup)}, whole request {c.ms_per_token:.1f} ms/token"
            f"{over_single(lambda s: s.speedup)}; the cluster's decode and prefill: "
            + "; ".join(f"{r.setup.transport} at loss {r.setup.loss} {r.timing.decode_ms_per_token:.1f} ms/token "
                        f"({r.timing.decode_ms_per_token / c.decode_ms_per_token:.2f}x it), "
                        f"{r.timing.prefill_ms:.1f} ms ({r.timing.prefill_ms / c.prefill_ms:.2f}x it)" for r in same)
            + _ceiling_blocks(same, ceiling.block_us))


def _ceiling_blocks(same: list[TpResult], block_us: dict[str, float]) -> str:
    """The ceiling's one-token block of each kind, and (--trace) each row's blocks of that kind beyond it: the
    synchronization that kind of block costs the cluster."""
    if not block_us:
        return ""
    text = "; a one-token block in step, the slowest device's kernel: " + ", ".join(
        f"{kind} {us:.0f} µs" for kind, us in block_us.items())
    for r in same:
        kind_legs = {} if r.trace is None else r.trace.kind_legs
        spans = {kind: {leg.name: leg for leg in legs}.get("block, send to merged") for kind, legs in kind_legs.items()}
        beyond = [f"{kind} {leg.mean_us:.0f} µs ({leg.mean_us - block_us[kind]:+.0f})"
                  for kind, leg in spans.items() if leg is not None and kind in block_us]
        if beyond:
            text += (f"; the cluster's, send to merged ({r.setup.transport} at loss {r.setup.loss}, mean): "
                     + ", ".join(beyond))
    return text


def _repeated(results: list[TpResult]) -> list[str]:
    """For each combination run more than once against the single engine (--nodes 1,3,7,1,3,7 --baseline): the
    median of its speed-ups, whole, decode and prefill, and each run's. On a shared machine one node count's
    speed-up moved between 2.6x and 3.8x over five minutes (8 devices, 1B, the device machine): one run says
    little."""
    runs: dict[tuple[int, str, str, str], list[Compared]] = {}
    for r in results:
        if r.single is not None and not r.nodes_idle():
            runs.setdefault((r.setup.nodes, r.setup.plan, r.setup.transport, r.setup.loss), []).append(r.single)

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x ({', '.join(f'{v:.2f}x' for v in values)})"

    return [f"{nodes} node(s), plan {plan}, {transport}, loss {loss}, {len(same)} runs: speed-up over the single "
            f"engine, median {median([c.speedup for c in same])}; decode {median([c.decode_speedup for c in same])}; "
            f"prefill {median([c.prefill_speedup for c in same])}"
            for (nodes, plan, transport, loss), same in runs.items() if len(same) > 1]


def tp_ratios(results: list[TpResult]) -> str:
    """Per node count (and plan) and loss: udp against its own lossless time, and tcp against udp (HALO Table I).
    Each row is paired with the nearest row it is compared with (the lossless udp row run last before it, or else
    first after it; the udp row of the same loss). Loss rates given more than once (--plr 0,5%,0,5%) give several
    pairs, and their median: on a shared machine two rows a quarter of a minute apart can differ by a fifth, which
    one pair cannot tell from the cost of the loss."""
    base = results[0].setup.loss
    several_plans = len({r.setup.plan for r in results}) > 1
    rows = []
    for nodes, plan in dict.fromkeys((r.setup.nodes, r.setup.plan) for r in results):
        mine = [r for r in results if r.setup.nodes == nodes and r.setup.plan == plan]
        udp = [i for i, r in enumerate(mine) if r.setup.transport == "udp"]

        for loss in dict.fromkeys(mine[i].setup.loss for i in udp):
            rows_of = [i for i in udp if mine[i].setup.loss == loss]
            label = f"{nodes} node(s), plan {plan}" if several_plans else f"{nodes} node(s)"
            parts = [f"{label}, loss {loss}: udp {statistics.median(_ms(mine[i]) for i in rows_of):.1f} ms/token"]
            # A pair whose rows ran on the master alone measures no loss or transport effect of a cluster.
            pairs = [1.0] if loss == base else [
                _ms(mine[i]) / lossless.timing.ms_per_token for i in rows_of
                if (lossless := _nearest(mine, i, base, True)) is not None and not mine[i].nodes_idle()
                and not lossless.nodes_idle()]
            if pairs and not all(mine[i].nodes_idle() for i in rows_of):
                parts.append(_ratio(pairs, f"udp at loss {base}"))
            tcp = [i for i, r in enumerate(mine) if r.setup.transport == "tcp" and r.setup.loss == loss]
            if tcp:
                over = [_ms(mine[i]) / other.timing.ms_per_token for i in tcp
                        if (other := _nearest(mine, i, loss, False)) is not None and not mine[i].nodes_idle()
                        and not other.nodes_idle()]
                parts.append(f"tcp {statistics.median(_ms(mine[i]) for i in tcp):.1f} ms/token"
                             + (f" = {_ratio(over, 'udp')}" if over else ""))
            if any(mine[i].nodes_idle() for i in rows_of + tcp):
                parts.append("rows whose nodes computed nothing are left out of the ratios")
            rows.append("; ".join(parts))
    return "\n".join(rows)


def _ms(row: TpResult) -> float:
    return row.timing.ms_per_token


def _nearest(rows: list[TpResult], i: int, loss: str, before_first: bool) -> TpResult | None:
    """The udp row of `loss` nearest row i (the last one before it first, where `before_first`)."""
    candidates = [j for j, r in enumerate(rows) if r.setup.transport == "udp" and r.setup.loss == loss and j != i]
    if before_first and (before := [j for j in candidates if j < i]):
        return rows[before[-1]]
    return rows[min(candidates, key=lambda j: abs(j - i))] if candidates else None


def _ratio(ratios: list[float], against: str) -> str:
    """"1.23x udp", or with several pairs "1.23x udp (median of 3 pairs: 1.10x, 1.23x, 1.41x)"."""
    text = f"{statistics.median(ratios):.2f}x {against}"
    if len(ratios) > 1:
        text += f" (median of {len(ratios)} pairs: {', '.join(f'{v:.2f}x' for v in ratios)})"
    return text


def tp_json(results: Sequence[TpResult]) -> list[dict[str, object]]:
    """The rows as JSON objects, each record of a row an object of its own (None where not measured)."""
    return [plain(r) for r in results]


def tp_result(data: dict[str, Any]) -> TpResult:
    """A row back from tp_json's object (the tests build tables from a run's JSON)."""
    return build(TpResult, data)
