"""`edgerun master`: runs one model tensor-parallel over its nodes and itself (HALO).

Per token, for each attention and MLP block the master normalizes the hidden state, sends it to the
nodes holding units of that block, computes its own share, and sums what has arrived when every
node's partial is complete or the timeout expires (a missing fragment contributes zero). The first
layer, the LM head and prefill steps go over TCP. Sampling happens here. A node that dies is dropped:
the master replans over the devices left and re-prefills the request.

The master is three parts and the generation loop that drives them: membership (tp.membership: nodes
joining, heartbeats, link probes), deployment (tp.deployment: plan -> shares -> assignments) and the block
exchange (tp.exchange: send, wait, merge, timeouts). Generation runs as a coroutine on the same event loop
that receives the nodes' packets, so a partial that arrives is merged without any thread hand-off; only
planning, which blocks on replies, runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np
from starlette.routing import BaseRoute

from edgerun.errors import EdgerunError
from edgerun.model import kernels
from edgerun.model.generate import Engine, EngineLost, default_engine, generate, make_engine
from edgerun.model.ggml_engine import cache_rows
from edgerun.model.loader import Model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler
from edgerun.model.weights import embed_rows
from edgerun.net.channel import Counters, DatagramSocket, EventLoopThread, LossyUdp
from edgerun.net.fastpath import NativeBlock, NativeHead
from edgerun.net.group import PROBE_LAYER, GroupSender, new_group
from edgerun.net.http_server import bind
from edgerun.net.loss import LossModel
from edgerun.net.model_files import ModelServer, model_routes, model_sha256
from edgerun.net.wire import Block, Header, MsgType, Resend, Transport, WireError
from edgerun.sap.predictor import PredictorSet
from edgerun.sched.profiles import SEND_S_PER_NODE, Compute, DeviceProfile, Link, Memory, ModelProfile, model_profile
from edgerun.sched.tp_plan import Rejected, SyncModel, TPPlan, objective, plan_tp, rebalanced
from edgerun.tp.config import Mapping, MasterConfig
from edgerun.tp.deployment import Assignment, NodeLink, deploy, holds, row_span, unit_order_for
from edgerun.tp.exchange import KEPT_POSITIONS, BlockExchange, NodeLost, StepStats
from edgerun.tp.ggml_shard import GgmlShard, build_share, ggml_compute_address, ggml_quantizes_as_wire, wire_q8
from edgerun.tp.kernel_fit import KernelFit, Measured, pooled, pooled_measurements
from edgerun.tp.membership import MIN_SYNC_BLOCKS, Membership, NodeConn
from edgerun.tp.messages import BatchStep, Fetch, Message, Partial, Priorities, Reset, Routes, Shutdown, Welcome
from edgerun.tp.node import settle_heap
from edgerun.tp.shard import QuantShard
from edgerun.tp.trace import Trace

# A measured synchronization time stands for a node's whole exchange: the link's transfer term is left out.
UNLIMITED_MBIT = 1e9

# A deployment's first one-token steps run on shares just built (pages faulted in, sessions' first runs): they are
# left out of the time that judges a replanned split against the one it replaced.
COLD_STEPS = 2
# A split that a rebalance put in place is judged once it has run this many one-token steps (beyond the cold ones),
# against the mean step of the split it replaced (timed over at least as many). The devices' speeds measured on a
# warm-up can mislead: on the device machine, 3 of 4 two-device benchmarks replanned from the even split to a
# master-heavy one (486 MiB against 376) whose master then took 89-95 ms a token to the node's 75: 1.30-1.55x the
# single engine where the even split ran at 1.66-1.74x.
TRIAL_STEPS = 12


@dataclass(frozen=True)
class StepClock:
    """The one-token steps a deployment ran, and their seconds, less its first COLD_STEPS."""

    seen: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> StepClock:
        if self.seen < COLD_STEPS:
            return StepClock(self.seen + 1)
        return StepClock(self.seen + 1, self.steps + 1, self.seconds + seconds)

    def per_step(self, at_least: int = TRIAL_STEPS) -> float | None:
        """Seconds a step once at least `at_least` were timed."""
        return self.seconds / self.steps if self.steps >= at_least and self.steps else None


class Rebalance(Enum):
    """What Master.rebalance did; true when the shares changed."""

    KEPT = "kept"  # the shares stay as they are
    REPLANNED = "replanned"  # new shares from the measured speeds, on trial if the old ones were timed
    REVERTED = "reverted"  # the split on trial ran slower: the one it replaced is back

    def __bool__(self) -> bool:
        return self is not Rebalance.KEPT


@dataclass(frozen=True)
class Trial:
    """A rebalance's split on trial: the plan it replaced and that plan's measured seconds per one-token step."""

    replaced: TPPlan
    replaced_s: float


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended: the replaced split's and the tried split's seconds per one-token step, and whether the
    tried one stayed."""

    replaced_s: float
    tried_s: float
    kept: bool

    def said(self) -> str:
        """The outcome in words, as the master logs it and `bench tp` and `serve` report it."""
        return (f"the split the devices' measured speeds called for ran {self.tried_s * 1e3:.1f} ms a step against "
                f"{self.replaced_s * 1e3:.1f} on the split before it: "
                + ("kept" if self.kept else "back to the split before it"))


@dataclass
class Trials:
    """A master's rebalance trials: the split on trial (judged against the one it replaced), how the last one ended,
    and the splits a trial found slower than those they replaced, by devices and counts (never tried again)."""

    current: Trial | None = None
    last: TrialOutcome | None = None
    rejected: set[Rejected] = field(default_factory=set)


@dataclass
class BatchSession:
    """A batch session (tp.batch): its session number, its steps so far (an input's position is its step's number),
    and the cache copies its next step makes on the nodes."""

    session: int
    steps: int = 0
    copies: list[tuple[int, int, int]] = field(default_factory=list)

    def next_step(self, slots: Sequence[int], starts: Sequence[int], counts: Sequence[int] = (),
                  top: int | None = None) -> BatchStep:
        """The next step's rows as the nodes are told them, with the copies asked for since the last."""
        rows = BatchStep(self.session, self.steps, tuple(slots), tuple(starts),
                         tuple(n for copy in self.copies for n in copy), tuple(counts), top or 0)
        self.steps += 1
        self.copies = []
        return rows


@dataclass(frozen=True)
class Participants:
    """Who takes part in a deployment's one-token blocks, as the native runner sends to them: found once a
    deployment (its plan and session; a replan may keep its plan)."""

    plan: TPPlan
    session: int
    blocks: list[list[NodeConn]]  # each layer's attention's and MLP's, in order
    first: list[NodeConn]  # the first layer's nodes
    others: list[NodeConn]  # the later layers'
    head: list[NodeConn]  # the LM head's


@dataclass(frozen=True)
class Prepared:
    """What the native runner was last prepared for (its graphs change with the cache rows a step reads), who takes
    part in its blocks, and each block's weight bytes, for the master's own kernel fit."""

    key: tuple
    taking: Participants
    block_bytes: list[float]


def planned_compute(speed: float, send_s_per_node: float, measured: Measured | None) -> Compute:
    """A device's compute as the planner prices it: its declared speed and the default fixed cost per block until
    it has been measured, then its measured speed and, where its blocks told it apart, its fixed cost."""
    if measured is None:
        return Compute(0.0, speed, send_s_per_node=send_s_per_node)
    if measured.fixed_s is None:
        return Compute(0.0, measured.speed, send_s_per_node=send_s_per_node)
    return Compute(0.0, measured.speed, measured.fixed_s * 1e3, send_s_per_node=send_s_per_node)


class Master:
    def __init__(self, model: Model, key: bytes, config: MasterConfig | None = None, *,
                 loss: LossModel | None = None, predictors: PredictorSet | None = None,
                 log: Callable[[str], None] = lambda _: None) -> None:
        """A master listening on config.host:config.port (the defaults without a config). Its settings change with
        reconfigure(), taking effect at the next replan (host and port stay those it listens on)."""
        config = config or MasterConfig()
        self.model, self.key, self.predictors, self.log = model, key, predictors, log
        self.model_sha256 = model_sha256(model.path)
        # Settings are checked before anything is opened: a refused master leaves no thread or socket behind.
        if model.config.is_moe:
            raise EdgerunError(f"tensor-parallel plans split dense models; {model.path.name} is a mixture of "
                               "experts: run it with edgerun generate or a pipeline (--plan dp)")
        unit_order_for(model, self.model_sha256, config.mapping, predictors, config.group_size)
        host = config.host
        # Bound before any thread starts: a port in use fails here with nothing to tear down (a master that
        # raised later left its loop and file server threads running into the interpreter's exit, which could
        # crash the process after its one-line error).
        listener = bind(host, config.port)
        self.model_server = None if config.files_port is not None else \
            ModelServer(model.path, self.model_sha256, host)
        files_port = config.files_port if self.model_server is None else self.model_server.port
        self.udp = LossyUdp(key, host, 0, loss)  # sends; datagrams arrive on self.datagrams
        self.counters = Counters()
        self.net = EventLoopThread()
        self.datagrams = DatagramSocket(host, key, self.counters, self._on_datagram, config.spin_us / 1e6,
                                        needless=lambda data: self.exchange.needless(data))
        self.udp_port = self.datagrams.port
        self.trace = None if config.trace_dir is None else Trace(config.trace_dir / "master.jsonl", "master")
        self.exchange = BlockExchange(model.config, key, config, self.udp, self.datagrams, self.counters, log,
                                      self.trace)
        # The multicast group of one-token inputs (net.group): named to the nodes that join (none without multicast)
        group = new_group()
        self.exchange.group = GroupSender(group)
        self.membership = Membership(key, Welcome(self.model_sha256, files_port, self.udp_port,
                                                  *(group if config.multicast else ("", 0))),
                                     self.net, self.udp, self.counters, self._node_message,
                                     self.exchange.on_node_lost, log)
        self.reconfigure(config)
        self.position = 0
        # A request's Reset goes to the nodes with its first step, which knows what the sampler draws from.
        self.reset_pending = False
        self.shard: GgmlShard | QuantShard | None = None
        # A plan that leaves every node out runs on the whole-model engine instead of a share: one graph a token
        # rather than one a block (the share engine alone was 0.82x the single engine on the shipped model's
        # shape, 61 calls a token), so a cluster whose nodes do not help is as fast as one process.
        self.whole: Engine | None = None
        self.whole_step_bytes = 0  # every unit's weight bytes: what a one-token step of it streams, as planners count
        self.plan: TPPlan | None = None
        self.routes: Routes | None = None  # the deployment's, a request's session's and a batch session's
        self.batch: BatchSession | None = None
        self.prepared: Prepared | None = None  # the native runner's setup (_native_step)
        # The nodes the plan was deployed over: a block a dead one of them holds cannot be computed without it.
        self.deployed: list[NodeConn] = []
        self.own_priorities: Priorities | None = None  # dynamic mapping: the master's priority indices
        # Dynamic mapping, per recent (session, position, layer, block): the ranking and what each device got.
        self.assignments: dict[tuple[int, int, int, int], Assignment] = {}
        # Devices' speeds and fixed costs per block as measured on their shares (one-token blocks), by name: they
        # replace the declared ones in every later plan. The master's own blocks on its current share:
        self.measured: dict[str, Measured] = {}
        self.measured_sync: dict[str, float] = {}  # nodes' seconds per block beyond their kernels, by name
        self.own_decode = KernelFit()
        self.clock = StepClock()  # the one-token steps of the current deployment
        self.trials = Trials()
        self.server = self.net.run(self._listen(listener))
        self.port = self.server.sockets[0].getsockname()[1]

    def reconfigure(self, config: MasterConfig) -> None:
        """Take new settings (`dataclasses.replace(master.config, ...)`); the next replan applies them."""
        self.unit_order = unit_order_for(self.model, self.model_sha256, config.mapping, self.predictors,
                                         config.group_size)
        self.exchange.configure(config)
        self.datagrams.spin_s = config.spin_us / 1e6
        self.config = config

    async def _listen(self, listener: socket.socket) -> asyncio.Server:
        server = await self.membership.listen(listener)
        self.datagrams.attach(asyncio.get_running_loop())
        return server

    @property
    def nodes(self) -> list[NodeConn]:
        return self.membership.nodes

    @property
    def stats(self) -> StepStats:
        return self.exchange.stats

    @property
    def weight_bytes(self) -> int:
        """The quantized weights the master computes with: its share's, or the whole model's."""
        return self.whole.weight_bytes if self.whole is not None else 0 if self.shard is None else \
            self.shard.weight_bytes

    def _node_message(self, node: NodeConn, message: Message) -> None:
        match message:
            case Fetch():
                self.exchange.on_fetch(node, message)
            case Partial():
                self.exchange.on_partial(node, message)
            case _:
                self.counters.reject("unexpected")

    def _on_datagram(self, header: Header, payload: bytes, _: tuple[str, int]) -> None:
        if header.type == MsgType.PROBE:
            if header.layer != PROBE_LAYER or header.session == self.exchange.session:  # a group probe: this plan's
                self.membership.probe_echoed(header)
        elif header.type == MsgType.PARTIAL:
            self.exchange.on_datagram(header, payload)
        elif header.type == MsgType.RESEND:
            try:
                request = Resend.open(header, payload)
            except WireError:
                self.counters.reject("message")
                return
            self.exchange.on_resend(request)
        else:
            self.counters.reject("unexpected")

    def wait_for_nodes(self, n: int, timeout_s: float = 600.0) -> None:
        self.membership.wait_for_nodes(n, timeout_s)

    def fresh_reports(self, timeout_s: float = 3.0) -> list[NodeConn]:
        return self.membership.fresh_reports(timeout_s)

    def lost_nodes(self) -> list[str]:
        return self.membership.lost_nodes()

    # --- planning (blocks on the nodes' replies: never on the loop thread) -------------------------
    @property
    def send_s_per_node(self) -> float:
        """The master's time per node and one-token block beside its own share: from its first send to its share,
        adding the node's partial into the block's sum and counting it, as measured (over at least MIN_SYNC_BLOCKS
        node-blocks), else the planner's default. On the device machine sending measured ~16 µs a node at 7 nodes
        where the default says 50: plans made with the default left the master idle ~0.5 ms a block while its nodes
        finished.
        The adds are charged too: a master whose share ends after the partials came adds them all then, on the
        block's path (~20 µs each there: a master planned without them finished its 1B share ~100 µs after its
        seven nodes' partials, and merged for 160 µs more); with a share that ends first, it adds them while it
        waits."""
        s = self.stats
        return (s.send_s + s.fold_s + s.account_s) / s.sends if s.sends >= MIN_SYNC_BLOCKS else SEND_S_PER_NODE

    def _device(self, name: str, budget_mb: float, speed: float, measured: Measured | None,
                link: Link | None = None) -> DeviceProfile:
        """A device as the planner sees it: at its measured speed and fixed cost per block once there are some, else
        at the declared `speed` and the planner's default fixed cost."""
        send = self.send_s_per_node if name == "master" else SEND_S_PER_NODE
        return DeviceProfile(name=name, kind="node", cores=1,
                             compute=planned_compute(speed, send, measured),
                             memory=Memory(budget_mb, budget_mb, budget_mb, 0.0),
                             link=link or Link(0.0, 10_000.0, 10_000.0, 0.0))

    def _devices(self, alive: list[NodeConn]) -> list[DeviceProfile]:
        """The master and these nodes as the planner sees them. The nodes' measurements that agree within their
        noise are pooled (kernel_fit.SAME_WITHIN); the master's stand alone (it also sends and merges)."""
        names = {n.name for n in alive}
        measured = pooled_measurements({name: m for name, m in self.measured.items() if name in names})
        # Measured synchronization times stand for the probes' where every node has one: a mix of the two would
        # favour whichever nodes happen to have been timed.
        timed = all(n.name in self.measured_sync for n in alive)
        syncs = pooled({n.name: self.measured_sync[n.name] for n in alive}) if timed else {}
        return [self._device("master", self.config.budget_mb, self.config.speed, self.measured.get("master"))] + \
               [self._device(n.name, n.budget_mb, n.speed, measured.get(n.name),
                             self._link(n, syncs[n.name]) if timed else n.link) for n in alive]

    @staticmethod
    def _link(node: NodeConn, sync_s: float) -> Link | None:
        """A node's link as the planner sees it once its blocks have been timed: its measured synchronization time
        per block (`sync_s`) stands for the probe's round trip and transfer. (The probe, a round trip of Python echoes
        at join, says little of the block exchange: on loopback here it says 0.5 ms where a block's exchange takes
        0.4-0.5 ms beyond the node's kernels, and it cannot see a master busy with its own share.)"""
        if node.link is None:
            return None
        return Link(sync_s * 1e3, UNLIMITED_MBIT, UNLIMITED_MBIT, node.link.loss_rate)

    def profile(self) -> ModelProfile:
        # a batch's every sequence has a cache of max_len rows on every device
        return model_profile(self.model.name, self.model.config, self.model.weights,
                             context=self.config.max_len * self.config.slots,
                             group_size=self.config.group_size, vocab_block=self.config.vocab_block)

    def take_measurements(self) -> None:
        """Keep, for later plans, every device's speed and fixed cost per block measured on its current share where
        there is enough to say (see KernelFit)."""
        fits = {"master": self.own_decode} | {n.name: n.decode for n in self.membership.alive()}
        self.measured |= {name: m for name, fit in fits.items() if (m := fit.measured()) is not None}
        self.measured_sync |= {n.name: sync for n in self.membership.alive() if (sync := n.sync_s) is not None}

    def predicted_s(self) -> float:
        """The current plan's time per token at the speeds the devices showed on it. The plan's own figure used
        the speeds it was made with, which for a plan made before any measurement are the declared ones."""
        self.take_measurements()
        alive = self.membership.alive()
        if self.plan is None or not self._made_for(self.plan, alive):
            raise EdgerunError("no plan over the devices present")
        return objective(self.plan.counts(), self._devices(alive), self.profile(), self.plan.sync)

    def alone_plan(self) -> TPPlan:
        """A plan over the master and every live node that gives the nodes nothing: the master computes the whole
        model (its single engine), the nodes stay connected for a later replan."""
        alive = self.membership.alive()
        devices = self._devices(alive)
        devices[1:] = [replace(d, memory=replace(d.memory, budget_mb=0.0)) for d in devices[1:]]
        try:
            return plan_tp(self.profile(), devices, self.config.strategy, sync=SyncModel.STAR)
        except ValueError as e:
            raise EdgerunError(f"the master cannot hold the model alone: {e}") from e

    @staticmethod
    def _made_for(plan: TPPlan | None, alive: list[NodeConn]) -> bool:
        """Whether `plan` places exactly the master and these nodes, in this order."""
        return plan is not None and list(plan.devices) == ["master"] + [n.name for n in alive]

    def rebalance(self, min_gain: float = 0.05) -> Rebalance:
        """Replan with the devices' measured speeds when that plan is at least `min_gain` faster than the current
        shares at the same speeds (a device slower or faster than declared, or than the profile said): REPLANNED.
        Call between requests: the nodes load their new shares.
        A replanned split is on trial until it has run TRIAL_STEPS one-token steps: then, if its steps took longer
        than those of the split it replaced, the master goes back to that one (REVERTED) and never tries it again;
        a split made from speeds that misled does not stay."""
        self.take_measurements()
        alive = self.membership.alive()
        if not self._made_for(self.plan, alive):
            return Rebalance.KEPT  # no plan yet, or the members changed: the next replan takes the speeds anyway
        if self.trials.current is not None:
            return self._judge_trial()
        devices = self._devices(alive)
        decided = rebalanced(self.plan, devices, self.profile(), self.config.strategy, self.trials.rejected, min_gain)
        if decided is None:
            return Rebalance.KEPT
        now, better = decided
        speeds = ", ".join(f"{d.name} {d.compute.weight_bytes_per_s / 1e9:.2f} GB/s + "
                           f"{d.compute.session_overhead_ms * 1e3:.0f} µs a block" for d in devices)
        self.log(f"measured speeds ({speeds}): replanning, {now * 1e3:.1f} -> {better.time_per_token_s * 1e3:.1f} "
                 "ms/token predicted")
        replaced, replaced_s = self.plan, self.clock.per_step()
        self.replan(better)
        if replaced_s is not None:  # a split not timed yet has nothing to judge the new one against
            self.trials.current = Trial(replaced, replaced_s)
        return Rebalance.REPLANNED

    def _judge_trial(self) -> Rebalance:
        """The split on trial, once timed: kept if its steps are faster than the replaced split's, else replaced by
        it again (REVERTED)."""
        trial, now_s = self.trials.current, self.clock.per_step()
        if now_s is None:
            return Rebalance.KEPT
        self.trials.current = None
        self.trials.last = TrialOutcome(trial.replaced_s, now_s, kept=now_s < trial.replaced_s)
        self.log(self.trials.last.said())
        if self.trials.last.kept:
            return Rebalance.KEPT
        self.trials.rejected.add((self.plan.devices, self.plan.counts()))
        self.replan(trial.replaced)
        return Rebalance.REVERTED

    def wait_for_spares(self, timeout_s: float = 10.0) -> bool:
        """Until every node of the plan has the spare stream its assignment asked for (--transport udp); False if one
        still had none after `timeout_s`. A benchmark starts its loss after this: a stream opened under loss waits
        out the lost handshake's retransmission timer (a second), and until then the node's prompts cross on one
        stream."""
        if self.config.transport != Transport.UDP:
            return True
        deadline = time.monotonic() + timeout_s
        while any(n.alive and n.spare is None for n in self.deployed):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def forget_loss(self) -> None:
        """Take every link as clean again until it loses a packet: the next replan sends no parity and a prompt no
        second copies where a link did not measure loss when it joined (a benchmark's row after a lossy one starts as
        the first did)."""
        for node in self.membership.alive():
            node.lossy = False

    def replan(self, plan: TPPlan | None = None) -> TPPlan:
        """Plan over the master and every live node (or take `plan`, made over exactly them), hand out shares, wait
        until all are loaded."""
        alive = self.membership.alive()
        for node in alive:
            if node.link is None:
                node.link = self.membership.measure_link(node)
                self.log(f"node {node.name}: RTT {node.link.rtt_ms:.2f} ms, loss {node.link.loss_rate:.1%}, "
                         f"{node.link.up_mbit:.0f} Mbit/s")
        self.take_measurements()  # what the shares about to go showed
        if not self._made_for(plan, alive):
            try:
                plan = plan_tp(self.profile(), self._devices(alive), self.config.strategy, sync=SyncModel.STAR)
            except ValueError as e:
                raise EdgerunError(str(e)) from e
        if plan.oom_devices:
            raise EdgerunError(f"plan {plan.strategy} runs out of memory on "
                               f"{', '.join(o.name for o in plan.oom_devices)}")
        session = self.exchange.session + 1
        d = deploy(self.model.config, plan, self.config, self.unit_order, session, self.udp_port,
                   [NodeLink(n.datagram_bytes, n.lossy or (n.link is not None and n.link.loss_rate > 0))
                    for n in alive])
        self.plan, self.own_priorities, self.deployed = plan, d.own_priorities, alive
        self.routes = d.routes
        self.own_decode = KernelFit()
        self.clock, self.trials.current = StepClock(), None
        self.net.call(lambda: self.exchange.new_session(session, d.routes))
        self.shard = self.whole = None  # the old share goes before the new one is built
        for node, assign in zip(alive, d.assignments, strict=True):
            node.assign, node.index, node.parity = assign, assign.index, assign.parity  # parity grows on a loss
            node.segments = node.channel.segments()
            if not assign.spare_stream and node.spare is not None:  # the strict tcp baseline: one stream
                node.spare.close()
                node.spare = None
            for channel in (node.channel, node.spare):
                if channel is not None:
                    channel.set_rto_min(assign.rto_min_ms)
            node.reset_estimators()  # a new share takes another time
            node.ready.clear()
            node.channel.send(assign)
        # The master builds its own share while the nodes build theirs.
        if self._alone(plan):
            engine = default_engine(self.model, self.config.activations is Activations.F32)
            self.whole = make_engine(engine, self.model, self.config.max_len, self.config.threads,
                                     slots=self.config.slots)
            self.whole_step_bytes = int(self.profile().total_tp_weight_bytes())
        else:
            self.shard = build_share(self.model.config, self.model.weights, d.own_spec, self.config.max_len,
                                     self.config.threads, self.config.activations,
                                     dynamic=self.config.mapping == Mapping.DYNAMIC, mapped_files=[self.model.path],
                                     slots=self.config.slots)
            if isinstance(self.shard, GgmlShard) and ggml_quantizes_as_wire():
                self.exchange.encode_q8 = wire_q8
        settle_heap()
        for node in alive:
            if not node.ready.wait(120):
                raise EdgerunError(f"node {node.name} did not load its share within 120 s")
        self.log(f"plan {plan.strategy}: " + ", ".join(
            f"{name} {mem / 1e6:.1f} MB" for name, mem in zip(plan.devices, plan.memory_bytes, strict=True)))
        if self.whole is not None:
            self.log(f"the plan leaves every node out: the master runs the whole model as one graph "
                     f"({self.whole.weight_bytes / 1e6:.1f} MB of quantized weights)")
        elif self.config.mapping == Mapping.DYNAMIC:
            self.log(f"dynamic mapping: every device holds every unit ({self.shard.weight_bytes / 1e6:.0f} MB of "
                     f"quantized weights, {self.shard.cache_bytes / 1e6:.1f} MB of KV cache) and computes the share "
                     "above of the units ranked for each token")
            if not self.predictors.ahead and self.config.overlap:
                self.log("the predictors read each block's own input: ranking runs on the critical path, without "
                         "the pred overlap (train with --reads ahead for it)")
        else:
            self.log(f"master: {self.shard.weight_bytes / 1e6:.1f} MB of quantized weights, "
                     f"{self.shard.cache_bytes / 1e6:.1f} MB of KV cache")
        return plan

    @staticmethod
    def _alone(plan: TPPlan) -> bool:
        """Whether `plan` gives no node any unit: the master computes every unit, whatever the mapping, as the
        planners price it (one graph a token)."""
        return not any(plan.memory_bytes[1:])

    # --- generation (on the loop thread) ------------------------------------------------------------
    def _reset(self) -> None:
        if self.trace is not None:  # the last request's blocks, between requests
            self.trace.flush()
        self.exchange.new_session(self.exchange.session + 1, self.routes)
        if self.whole is not None:
            self.whole.reset()
        else:
            self.shard.truncate(0)
        self.reset_pending = True
        self.position = 0

    def _announce(self, top: int | None, batch: bool = False) -> None:
        """The request's Reset to every node: its session, and how many of the largest logits its sampler draws
        from (each node's LM-head partial is then that many, not its whole vocabulary share); or a batch
        session's (start_batch)."""
        self.exchange.head_top = top
        for node in self.membership.alive():
            with contextlib.suppress(OSError, ConnectionError):
                node.channel.send(Reset(self.exchange.session, top, batch=batch))
        self.reset_pending = False

    def _participants(self, layer: int, block: Block) -> list[NodeConn]:
        """The deployed nodes that hold units of this block. One of them found dead (between requests, or
        between blocks) is NodeLost here: left out, its units would be missing from every later step."""
        nodes = [n for n in self.deployed if n.spec is not None and holds(n.spec, n.priorities, layer, block)]
        if lost := [n for n in nodes if not n.alive]:
            raise NodeLost(lost[0].name)
        return nodes

    def _rank(self, layer: int, block: Block, features: np.ndarray | None) -> tuple[int, ...] | None:
        """Dynamic mapping: the block's units from the most to the least important, predicted from
        what the predictors read (HALO's Pred); the static order where there is nothing to read.
        A multi-token step takes one ranking, from the predictions' mean over its tokens."""
        if self.config.mapping != Mapping.DYNAMIC:
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
                     while_waiting: Callable[[], None] | None = None, sent_at: float | None = None,
                     rows: BatchStep | None = None) -> np.ndarray:
        """This block's output: the master's share plus every node's partial that arrived in time (`sent_at`: its
        input went to the nodes then, from the native runner). `rows`: a batch session's step (`start` is its
        number); its LM head's logits are every row's, (rows, vocab)."""
        nodes = self._participants(layer, block)
        own_units = None
        if ranking is not None:
            kind = 0 if block == Block.ATTN else 1
            own_units = tuple(ranking[p] for p in self.own_priorities[kind][layer])
            handed = {"master": own_units} | {n.name: tuple(ranking[p] for p in n.priorities[kind][layer])
                                              for n in nodes}
            self.assignments[(self.exchange.session, start, layer, int(block))] = Assignment(ranking, handed)

        sequences = rows is not None and len(rows.slots) > 1  # a batch's decode step: each row as it is alone

        def own_share() -> np.ndarray:
            started = time.perf_counter()
            if block == Block.ATTN and rows is not None:
                out = self.shard.step_attention(layer, x, rows.slots, rows.starts, rows.copy, rows.counts)
            elif block == Block.ATTN:
                out = self.shard.attention(layer, x, start, units=own_units)
            elif block == Block.MLP:
                with kernels.each_column_alone() if sequences else contextlib.nullcontext():
                    out = self.shard.mlp(layer, x, groups=own_units)
            else:  # the LM head: this device's vocabulary rows, computed while the nodes compute theirs
                with kernels.each_column_alone() if sequences else contextlib.nullcontext():
                    vocab, own = self.shard.logits(x)  # the rows sent: a request's last token, a batch's each one
                out = np.zeros((x.shape[0], self.model.config.vocab_size), np.float32)
                out[:, row_span(vocab)] = own
                out = out if rows is not None else out[-1]
            if x.shape[0] == 1 and block != Block.HEAD and rows is None:  # one-token blocks measure its kernels
                self.own_decode = self.own_decode.add(
                    self.shard.block_bytes(layer, block, None if own_units is None else len(own_units)),
                    time.perf_counter() - started)
            return out

        return await self.exchange.run(nodes, start, layer, block, x, ranking, own_share, while_waiting, sent_at,
                                       tokens=None if rows is None else rows.tokens(x.shape[0]))

    def _whole_step(self, tokens: Sequence[int]) -> np.ndarray:
        """A step of a plan that leaves every node out: the whole-model engine's logits. Its one-token steps
        measure the master's speed as a share's would (every unit's weight bytes)."""
        started = time.perf_counter()
        logits = self.whole.step(tokens)
        took = time.perf_counter() - started
        self.stats.compute_s += took
        if len(tokens) == 1:
            self.own_decode = self.own_decode.add(self.whole_step_bytes, took)
        self.position += len(tokens)
        return logits

    async def _step(self, tokens: Sequence[int], top: int | None = None) -> np.ndarray:
        """The last token's logits; with `top`, only each node's `top` largest of its rows are filled in (the
        others are minus infinity): what a sampler that draws from no more needs. One-token steps are timed
        (StepClock: what judges a rebalanced split)."""
        started = time.perf_counter()
        logits = await self._compute_step(tokens, top)
        if len(tokens) == 1:
            self.clock = self.clock.add(time.perf_counter() - started)
        return logits

    async def _compute_step(self, tokens: Sequence[int], top: int | None, rows: BatchStep | None = None
                            ) -> np.ndarray:
        """The step's logits: of its last token, or in a batch session (`rows`, told to the nodes) of each
        sequence's where the step is one token of each of several."""
        if rows is None and self.reset_pending:
            self._announce(top)
        elif rows is None and self.batch is not None and self.exchange.session == self.batch.session:
            # the nodes number a batch's steps
            raise RuntimeError("a batch session runs: a request's steps begin with reset()")
        elif rows is None and self.exchange.head_top is not None and (top is None or top > self.exchange.head_top):
            raise RuntimeError(f"this request's steps gather {self.exchange.head_top} logits a node, not {top}")
        # Blocks drained on the spot never yield: let the loop read the nodes' streams (heartbeats) once a step.
        await asyncio.sleep(0)
        if self.whole is not None:
            return self._whole_step(tokens)
        c = self.model.config
        x = embed_rows(c, self.model.weights, tokens)
        start = self.position if rows is None else rows.step
        weights = self.model.weights
        # Dynamic mapping ranks each block's units. Predictors that read one layer ahead rank a layer from the
        # previous layer's attention input: with the pred overlap while that layer's MLP partials travel,
        # without it on the path. Predictors that read the block's own input rank on the path, from the input
        # about to be sent.
        ahead = self.config.mapping == Mapping.DYNAMIC and self.predictors.ahead
        overlap_pred = ahead and "pred" in self.config.overlap
        previous_input = None
        predicted: dict[Block, tuple[int, ...] | None] = {}  # the next layer's rankings, made while waiting
        # a batched step's rows (several sequences, one token each) each normalized as that sequence's token alone,
        # a round's prompt chunks and decode tokens each sequence's rows as its own step
        norm = self.exchange.norm if rows is None or len(rows.slots) == 1 else \
            functools.partial(self.exchange.norm, each_row=True) if not rows.counts else \
            functools.partial(self._norm_spans, rows.counts)
        head_sent: float | None = None  # when the native runner sent the LM head's input, where it did
        for layer in range(c.n_layers):
            # A one-token step's layers natively: every one where the first layer's links are clean, else those
            # after the first (the first then runs here: its stream copies, parity)
            if layer <= 1 and len(tokens) == 1 and rows is None and \
                    (participants := self._native_step(start, layer)) is not None:
                x = await self._run_native(x, start, participants, layer)
                if (runner := self.exchange.runner).head is not None:  # it sent the LM head's input too: that one
                    head_sent, x = runner.r.head_sent, runner.head_input.copy()
                break
            lw = weights.layers[layer]
            ranked, predicted = predicted, {}
            attn_input = norm(x, lw.attn_norm, c.norm_eps)
            features = previous_input if ahead else attn_input
            attn_ranking = ranked[Block.ATTN] if ranked else self._rank(layer, Block.ATTN, features)
            out = await self._block(layer, Block.ATTN, attn_input, start, attn_ranking, rows=rows)
            x = x + (out if lw.attn_post_norm is None else norm(out, lw.attn_post_norm, c.norm_eps))
            mlp_input = norm(x, lw.ffn_norm, c.norm_eps)
            features = previous_input if ahead else mlp_input
            mlp_ranking = ranked[Block.MLP] if ranked else self._rank(layer, Block.MLP, features)

            def predict_next(layer: int = layer + 1, features: np.ndarray = attn_input,
                             into: dict[Block, tuple[int, ...] | None] = predicted) -> None:
                into.update({b: self._rank(layer, b, features) for b in (Block.ATTN, Block.MLP)})

            out = await self._block(layer, Block.MLP, mlp_input, start, mlp_ranking,
                                    while_waiting=predict_next if overlap_pred and layer + 1 < c.n_layers else None,
                                    rows=rows)
            x = x + (out if lw.ffn_post_norm is None else norm(out, lw.ffn_post_norm, c.norm_eps))
            previous_input = attn_input
        if rows is None:
            self.position = end = start + len(tokens)
        else:
            end = start + 1
        self.exchange.defer(functools.partial(self._forget_before, end - KEPT_POSITIONS))
        # the LM head's rows: the last token's, or each sequence's of a batched step of several (its last token's)
        last = x[np.cumsum(rows.counts) - 1] if rows is not None and rows.counts else \
            x if rows is not None and len(rows.slots) > 1 else x[-1:]
        # a round's head rows are one a sequence: each normalized alone, as a batch's decode rows
        head_norm = functools.partial(self.exchange.norm, each_row=True) if rows is not None and rows.counts else norm
        head_input = x if head_sent is not None else head_norm(last, weights.output_norm, c.norm_eps)
        return await self._block(0, Block.HEAD, head_input, start, sent_at=head_sent, rows=rows)

    def _norm_spans(self, counts: Sequence[int], x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """The RMS norm of a step's rows that are several sequences' tokens, `counts` of each: each sequence's rows as
        its own step normalizes them (a chunk's together, a decode token's alone)."""
        ends = list(itertools.accumulate(counts))
        return np.concatenate([self.exchange.norm(x[end - n:end], weight, eps)
                               for n, end in zip(counts, ends, strict=True)])

    # --- a batch session (tp.batch) -------------------------------------------------------------------
    def start_batch(self) -> bool:
        """A batch session from here on: whether one had to start (a request, a replan or a rebalance since the last
        made a new session: what the batch's caches held is gone)."""
        return self.net.call(self.begin_batch)

    def begin_batch(self) -> bool:
        """start_batch, on the loop's thread: what a batch step's own turn runs first (a call through the loop
        between steps would wait out the turns' polling, spin_us, every step)."""
        if self.batch is not None and self.batch.session == self.exchange.session:
            return False
        session = self.exchange.session + 1
        # the deployment's routes: a step's rows that are each a sequence's one token go as a request's decode token
        # goes (lossy where its layer is), a prompt's rows reliable (BatchStep.tokens)
        self.exchange.new_session(session, self.routes or Routes.for_transport(self.config.transport,
                                                                              self.model.config.n_layers))
        self._announce(None, batch=True)
        self.batch = BatchSession(session)
        return True

    async def batch_step(self, tokens: Sequence[int], slots: Sequence[int], starts: Sequence[int],
                         counts: Sequence[int] = (), top: int | None = None) -> np.ndarray:
        """One step of the batch session (start_batch): one sequence's tokens from starts[0] of slot slots[0] (its
        last token's logits), or one token of each of several sequences (each one's logits, (rows, vocab)), or with
        `counts` that many tokens of each (each one's last token's logits: a round's prompt chunks beside its decode
        tokens). Its rows go to the nodes first (BatchStep), with the cache copies asked for since the last step.
        `top`: of a decode step (one token of each), the nodes send only each row's `top` largest logits of theirs
        (TpBatch.decode)."""
        if top is not None and counts:
            raise ValueError("a round's prompt chunks keep every logit (a prompt's logits serve later sequences)")
        rows = self.batch.next_step(slots, starts, counts, top)
        self.exchange.head_top = top  # this step's nodes' LM-head partials, as BatchStep.top tells them
        if self.whole is not None:  # a plan that leaves every node out: the whole-model engine's slots
            await asyncio.sleep(0)
            if counts:
                return self.whole.span_rows(list(zip(slots, starts, counts, strict=True)),
                                            self.whole.embed(np.asarray(tokens, np.int64)))
            if len(slots) == 1:
                return self.whole.prefill(slots[0], tokens, starts[0])
            return self.whole.decode(list(zip(slots, starts, tokens, strict=True)))
        for node in self.deployed:
            try:
                node.channel.send(rows)
            except (OSError, ConnectionError) as e:  # its units would be missing from every block
                raise NodeLost(node.name) from e
        return await self._compute_step(tokens, None, rows)

    def copy_batch_cache(self, source: int, target: int, rows: int) -> None:
        """The first `rows` cached positions of a batch's slot `source` into slot `target`: the master's own share
        now, the nodes' before their next step's attention, layer by layer (BatchStep.copy)."""
        def copy() -> None:
            if self.whole is not None:
                self.whole.copy_cache(source, target, rows)
                return
            self.shard.copy_cache(source, target, rows)
            self.batch.copies.append((source, target, rows))

        self.net.call(copy)

    def _forget_before(self, oldest: int) -> None:
        """Let go of what was kept for positions before `oldest` (the nodes' fetches, dynamic mapping's rankings)."""
        self.exchange.forget_before(oldest)
        self.assignments = {k: v for k, v in self.assignments.items() if k[1] >= oldest}

    def _native_step(self, start: int, first: int) -> list[list[NodeConn]] | None:
        """The participants of a one-token step's blocks from layer `first` (0 or 1) on, with the native runner
        prepared to run them (BlockExchange.run_blocks); None where it cannot: a share off this process's memory or
        not on ggml, dynamic mapping, nodes it cannot send to (BlockExchange.runs_natively), and from the first layer,
        one of its nodes on a lossy link (BlockExchange.runs_mirrored_natively)."""
        shard, c = self.shard, self.model.config
        # (post norms: the runner adds partials straight into the residual)
        if not isinstance(shard, GgmlShard) or shard.backend.name != "cpu" or \
                self.config.mapping == Mapping.DYNAMIC or not shard.native or c.post_norms:
            return None
        n_kv = cache_rows(start + 1, shard.max_len)
        key: tuple = (self.plan, n_kv, self.exchange.session, first)
        prepared = self.prepared
        if prepared is not None and prepared.taking.plan is self.plan and \
                prepared.taking.session == self.exchange.session:
            taking = prepared.taking
        else:  # who takes part in each block: once a deployment (a session; a replan may keep its plan)
            blocks = [self._participants(layer, block)
                      for layer in range(c.n_layers) for block in (Block.ATTN, Block.MLP)]
            first_nodes, others = (list({n.index: n for nodes in part for n in nodes}.values())
                                   for part in (blocks[:2], blocks[2:]))
            taking = Participants(self.plan, self.exchange.session, blocks, first_nodes, others,
                                  self._participants(0, Block.HEAD))
        participants = taking.blocks[2 * first:]
        if not self.exchange.runs_natively(taking.others) or \
                (first == 0 and not self.exchange.runs_mirrored_natively(taking.first)):
            return None
        # the LM head's input goes from the runner too where it runs the first layer and the head's links are clean
        head_sent = first == 0 and bool(taking.head) and \
            self.exchange.runs_mirrored_natively(taking.head, (Block.HEAD,))
        key = (*key, head_sent)
        if prepared is None or prepared.key != key:  # the graphs change with the cache rows a step reads
            blocks = []
            for i, nodes in enumerate(participants):
                layer, block = first + i // 2, Block.ATTN if i % 2 == 0 else Block.MLP
                lw = self.model.weights.layers[layer]
                blocks.append(NativeBlock(layer, int(block), lw.attn_norm if block == Block.ATTN else lw.ffn_norm,
                                          shard.native_graph(layer, block, n_kv),
                                          tuple((n.host, n.udp_port) for n in nodes), tuple(n.index for n in nodes),
                                          mirrored=layer == 0))
            head = (NativeHead(self.model.weights.output_norm, tuple((n.host, n.udp_port) for n in taking.head),
                               tuple(n.index for n in taking.head)), taking.head) if head_sent else None
            self.exchange.prepare_blocks(blocks, participants, c.norm_eps, shard.backend.handle, ggml_compute_address(),
                                         head)
            self.prepared = Prepared(key, taking, [shard.block_bytes(b.layer, Block(b.block)) for b in blocks])
        return participants

    async def _run_native(self, x: np.ndarray, start: int, participants: list[list[NodeConn]],
                          first: int) -> np.ndarray:
        """The hidden state after the step's layers from `first` on ran natively; the master's kernels measured as
        `_block` measures them."""
        shard = self.shard
        shard.advance(range(first, self.model.config.n_layers), start)
        x = np.array(x, np.float32, order="C")  # the runner adds into it
        await self.exchange.run_blocks(x, start, participants)
        self.exchange.defer(self._count_own_native)  # in the LM head's slack (~50-75 µs of the step's path)
        return x

    def _count_own_native(self) -> None:
        """The master's kernels in the native runner's last step, as `_block` measures them."""
        self.own_decode = self.own_decode.add_all(self.prepared.block_bytes,
                                                  [r.own_s for r in self.exchange.runner.records])

    # --- the blocking interface, for callers outside the loop -------------------------------------
    def reset(self) -> None:
        """Start a new request: every device forgets its KV cache."""
        self.net.call(self._reset)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens after those already seen; the last token's logits."""
        return self.net.run_in_turn(self._step(tokens), self.config.spin_us / 1e6)

    def step_token(self, tokens: Sequence[int], start: int, sampler: Sampler) -> int:
        """Run tokens after those already seen; the token the sampler draws (the generation loop's step): the
        nodes send only the logits it can draw (Sampler.candidates)."""
        return sampler(self.net.run_in_turn(self._step(tokens, sampler.candidates), self.config.spin_us / 1e6),
                       start + len(tokens))

    def recover(self, lost: EngineLost) -> None:
        """After a node was lost mid-step: plan over the devices left (the generation loop re-prefills)."""
        self.log(f"node {lost} lost mid-generation: replanning")
        self.replan()

    def release(self) -> None:
        """Nothing to let go of between requests."""

    @property
    def max_len(self) -> int:
        return self.config.max_len

    def generate(self, prompt: Sequence[int], max_tokens: int, sampler: Sampler,
                 stop_ids: frozenset[int] = frozenset(), on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy or sampled generation (the one generation loop, model.generate): a node lost midway triggers a
        replan and a re-prefill of the prompt and the tokens so far, and generation goes on."""
        return generate(self, prompt, max_tokens, sampler, stop_ids, on_token).tokens

    def close(self) -> None:
        if self.trace is not None:
            self.trace.flush()
        for node in self.membership.alive():
            with contextlib.suppress(OSError, ConnectionError):
                node.channel.send(Shutdown())
        self.net.run(self._close_listeners())
        self.net.stop()
        self.exchange.close()
        self.udp.close()
        if self.model_server is not None:
            self.model_server.close()

    def routes(self) -> list[BaseRoute]:
        """The model file, for an HTTP server at config.files_port."""
        return model_routes(self.model.path, self.model_sha256)

    async def _close_listeners(self) -> None:
        self.membership.close_channels()
        self.server.close()
        self.datagrams.close()
