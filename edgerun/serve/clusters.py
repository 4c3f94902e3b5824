"""The kinds of cluster `edgerun serve` and `edgerun master` run, behind one interface: a tensor-parallel master
and its nodes (--plan halo, minmax, ...), a pipeline master and its workers and browser tabs (--plan dp), or a MoEx
master (the paper's hub) and its expert workers (--plan moe). Both commands start theirs the same way:
ClusterSettings (the options they share) -> cluster_config (each kind's own config, pure) -> build.

Each says who is present, deploys a plan over them (returning its predicted ms/token), and describes its
devices, plan and counters for the dashboard as frozen records (NodeView, PlanView, Counters), which only the
HTTP edge turns into JSON. Every engine runs under the one generation loop (model.generate)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from edgerun.model.generate import EngineLost, Stepper, TokenStepper
from edgerun.model.loader import Model
from edgerun.model.onnx_graph import Activations
from edgerun.moe.hub import HubConfig, MoeHub
from edgerun.net.discovery import ClusterKind
from edgerun.net.loss import LossModel
from edgerun.net.wire import Transport, WorkerKind
from edgerun.pp.config import PipelineConfig, Route
from edgerun.pp.master import PipelineMaster
from edgerun.sched.moe import hedge_setting
from edgerun.sched.plans import TPStrategy
from edgerun.sched.pp_plan import Pricing
from edgerun.sched.tp_plan import TPPlan, check_fits, plan_for_members
from edgerun.tp.config import MasterConfig
from edgerun.tp.master import Master, Rebalance


class MemberState(StrEnum):
    """A cluster's member as the dashboard and /api/state show it, in every mode."""

    LOADING = "loading"  # joined, its share still loading (a tensor-parallel node)
    SERVING = "serving"  # computing the running plan
    STANDBY = "standby"  # alive, in no stage of the running plan (a pipeline's spare)
    LEFT_OUT = "left out"  # alive, not given work: failed its health checks (an expert worker)
    LOST = "lost"  # gone


@dataclass(frozen=True)
class NodeView:
    """A member as the dashboard shows it."""

    name: str
    kind: WorkerKind
    device: str  # what it runs on, for people to read
    alive: bool
    state: MemberState
    memory_mb: float | None  # what it holds now (None: not reported)
    budget_mb: float
    speed_gb_s: float | None  # weight bytes a second, measured where it computed, else declared
    rtt_ms: float | None
    loss: float | None  # its link's measured packet loss
    holds: str | None  # its share of the plan, in words (None: not assigned yet)


@dataclass(frozen=True)
class PlanView:
    """The running plan as the dashboard shows it."""

    strategy: str
    devices: tuple[str, ...]
    memory_mb: tuple[float, ...]  # per device, where the plan says
    compute_ms: tuple[float, ...]  # per device (a pipeline: per stage), where the plan says
    predicted_ms_per_token: float | None


@dataclass(frozen=True)
class Counters:
    """What a cluster counted since it started (the tensor-parallel names; an expert master counts dispatches as blocks,
    dropped ones as incomplete and redispatched ones as late)."""

    blocks: int = 0
    blocks_incomplete: int = 0
    late_packets: int = 0
    rejected: int = 0


class Cluster(Protocol):
    kind: str  # "tensor-parallel", "pipeline" or "experts"
    port: int  # where nodes join
    members_are: str  # what its members are called: "nodes", "workers", "expert workers"

    @property
    def engine(self) -> Stepper | TokenStepper: ...

    def members(self) -> tuple[str, ...]: ...

    def wait_for(self, n: int, timeout_s: float) -> None:
        """Until n members are present; EdgerunError after timeout_s."""
        ...

    def summary(self) -> str:
        """What the cluster counted, in a line for people (after a request)."""
        ...

    def deploy(self) -> tuple[str, float]:
        """Plan over the members present and load their shares: (what was planned, predicted ms/token).
        EdgerunError when no plan fits them."""
        ...

    def rebalance(self) -> str | None:
        """Between requests: new shares for the speeds the members showed, if they call for them; what changed, or
        None."""
        ...

    def on_lost(self, lost: EngineLost) -> None:
        """A member was lost mid-request (deploy() follows)."""
        ...

    def nodes(self) -> list[NodeView]: ...

    def plan(self) -> PlanView | None: ...

    def counters(self) -> Counters: ...

    def set_own_speed(self, weight_bytes_per_s: float) -> None: ...

    def close(self) -> None: ...


class TensorParallel:
    """A tensor-parallel master: plans with --plan (or a plan file naming exactly the nodes present)."""

    kind = "tensor-parallel"
    members_are = "nodes"

    def __init__(self, master: Master, plan_file: TPPlan | None, note) -> None:
        self.master, self.plan_file, self.note = master, plan_file, note
        self.port = master.port

    @property
    def engine(self) -> Master:
        return self.master

    def members(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.master.membership.alive())

    def wait_for(self, n: int, timeout_s: float) -> None:
        self.master.wait_for_nodes(n, timeout_s)

    def summary(self) -> str:
        s = self.master.stats
        return (f"compute {s.compute_s:.2f} s, waiting {s.wait_s:.2f} s; {s.blocks_incomplete} of {s.blocks} blocks "
                f"incomplete, {s.late_packets} late packets, {self.master.counters.total()} rejected")

    def deploy(self) -> tuple[str, float]:
        plan = self.master.replan(self._from_file())
        return (f"plan {plan.strategy} over master + {', '.join(plan.devices[1:])}", plan.time_per_token_s * 1e3)

    def _from_file(self) -> TPPlan | None:
        """The plan file over the nodes present, or None (plan with --plan) when it does not cover exactly them."""
        if self.plan_file is None:
            return None
        try:
            check_fits(self.plan_file, self.master.profile())
            return plan_for_members(self.plan_file, self.plan_file.devices[0], list(self.members()))
        except ValueError as e:
            self.note(f"the plan file does not fit the nodes present ({e}): planning with --plan")
            return None

    def rebalance(self) -> str | None:
        match self.master.rebalance():
            case Rebalance.REPLANNED:
                return "replanned on the speeds the devices showed"
            case Rebalance.REVERTED:
                return self.master.trials.last.said()
        return None

    def on_lost(self, lost: EngineLost) -> None:
        """Nothing: the membership already marked the node dead, and deploy() plans without it."""

    def nodes(self) -> list[NodeView]:
        out = []
        for n in self.master.nodes:
            spec = n.spec
            # a node the plan gives nothing (every member is assigned, some an empty share) stands by
            holds = spec is not None and bool(sum(map(len, spec.attn_units)) + sum(map(len, spec.mlp_groups))
                                              + len(spec.vocab_blocks))
            state = MemberState.LOST if not n.alive else MemberState.LOADING if not n.ready.is_set() \
                else MemberState.SERVING if holds else MemberState.STANDBY
            out.append(NodeView(
                n.name, WorkerKind.NATIVE, n.device, n.alive, state, (n.weight_bytes + n.cache_bytes) / 1e6,
                n.budget_mb, (n.speed if (m := n.decode.measured()) is None else m.speed) / 1e9,
                None if n.link is None else n.link.rtt_ms, None if n.link is None else n.link.loss_rate,
                None if spec is None else (
                    f"{sum(map(len, spec.attn_units))} attention units, {sum(map(len, spec.mlp_groups))} MLP "
                    f"groups, {len(spec.vocab_blocks)} vocabulary blocks")))
        return out

    def plan(self) -> PlanView | None:
        p = self.master.plan
        if p is None:
            return None
        return PlanView(str(p.strategy), tuple(p.devices), tuple(m / 1e6 for m in p.memory_bytes),
                        tuple(c * 1e3 for c in p.compute_s), p.time_per_token_s * 1e3)

    def counters(self) -> Counters:
        s = self.master.stats
        return Counters(s.blocks, s.blocks_incomplete, s.late_packets, self.master.counters.total())

    def set_own_speed(self, weight_bytes_per_s: float) -> None:
        self.master.reconfigure(replace(self.master.config, speed=weight_bytes_per_s))

    def close(self) -> None:
        self.master.close()


class Experts:
    """A MoEx master (the paper's hub): expert workers (`edgerun node --mode moe`) and browser tabs (node?mode=moe)
    hold the experts."""

    kind = "experts"
    members_are = "expert workers"

    def __init__(self, hub: MoeHub) -> None:
        self.hub = hub
        self.port = hub.port

    @property
    def engine(self) -> MoeHub:
        return self.hub

    def members(self) -> tuple[str, ...]:
        return tuple(sorted(w.name for w in self.hub.workers.values() if w.alive))

    def wait_for(self, n: int, timeout_s: float) -> None:
        self.hub.wait_for_workers(n, timeout_s)

    def summary(self) -> str:
        s = self.hub.stats
        return (f"{s.dispatches} expert dispatches, {s.sent} sent (hedged), {s.redispatched} redispatched, "
                f"{s.dropped} dropped at the deadline")

    def deploy(self) -> tuple[str, float]:
        placement = self.hub.deploy()
        held = ", ".join(f"{name} {len(placement.experts_of(name))}" for name in self.members())
        return f"experts over {held}", self.hub.probe_ms()

    def rebalance(self) -> str | None:
        return None  # a join is placed at the next deploy; a loss is replicated again in the background

    def on_lost(self, lost: EngineLost) -> None:
        """Nothing: the hub saw the worker leave; deploy() places its experts over the workers left."""

    def nodes(self) -> list[NodeView]:
        placement = self.hub.placement
        return [NodeView(w.name, w.kind, str(w.kind), w.alive,
                         MemberState.SERVING if w.healthy else MemberState.LEFT_OUT if w.alive else MemberState.LOST,
                         w.peak_rss_mb or None, w.budget_mb, None, w.p50_s * 1e3 if w.recent else None, None,
                         f"{len(placement.experts_of(w.name))} experts" if placement else "nothing")
                for w in self.hub.workers.values()]

    def plan(self) -> PlanView | None:
        placement = self.hub.placement
        if placement is None:
            return None
        names = tuple(sorted(placement.held_mb))
        return PlanView("moe", names, tuple(placement.held_mb[n] for n in names), (), None)

    def counters(self) -> Counters:
        s = self.hub.stats
        return Counters(s.dispatches, s.dropped, s.redispatched)

    def set_own_speed(self, weight_bytes_per_s: float) -> None:
        """The hub's own share (attention, routers, head) is not planned."""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.hub.close()


class Pipeline:
    """A pipeline master: workers (`edgerun node --mode pp`) and browser tabs hold ranges of layers."""

    kind = "pipeline"
    members_are = "workers"

    def __init__(self, pipeline: PipelineMaster) -> None:
        self.pipeline = pipeline
        self.port = pipeline.port

    @property
    def engine(self) -> PipelineMaster:
        return self.pipeline

    def members(self) -> tuple[str, ...]:
        return tuple(sorted(w.name for w in self.pipeline.workers.alive()))

    def wait_for(self, n: int, timeout_s: float) -> None:
        self.pipeline.wait_for_workers(n, timeout_s)

    def summary(self) -> str:
        return f"state {self.pipeline.state}, {len(self.pipeline.recovery_seconds)} recoveries"

    def deploy(self) -> tuple[str, float]:
        plan = self.pipeline.start()
        stages = ", ".join(f"{s.worker} {s.first_layer}-{s.end_layer - 1}" for s in plan.stages)
        return f"pipeline over {stages}", plan.exec_s_per_token * 1e3

    def rebalance(self) -> str | None:
        return None  # the pipeline master repartitions by itself between requests

    def on_lost(self, lost: EngineLost) -> None:
        self.pipeline.recover(lost)  # the pipeline goes Down; its next prefill replans

    def nodes(self) -> list[NodeView]:
        stages = {s.worker: s for s in self.pipeline.plan.stages} if self.pipeline.plan else {}
        out = []
        for w in self.pipeline.workers.alive():  # a tab that closed leaves the list
            s = stages.get(w.name)
            browser = w.kind is WorkerKind.BROWSER
            # A native worker: its machine and onnxruntime's device; a tab: its backend (wasm or webgpu).
            c = w.capabilities
            device = c.backend if browser else ", ".join(v for v in (c.host, c.device) if v)
            out.append(NodeView(w.name, w.kind, device, True, MemberState.SERVING if s else MemberState.STANDBY, None,
                                w.memory_mb, w.measured_speed / 1e9, w.rtt_ms, None,
                                f"layers {s.first_layer}-{s.end_layer - 1}" if s else "nothing"))
        return out

    def plan(self) -> PlanView | None:
        p = self.pipeline.plan
        if p is None:
            return None
        return PlanView("dp", tuple(s.worker for s in p.stages), (), tuple(c * 1e3 for c in p.stage_compute_s),
                        p.exec_s_per_token * 1e3)

    def counters(self) -> Counters:
        return Counters()

    def set_own_speed(self, weight_bytes_per_s: float) -> None:
        """The pipeline master computes no layers itself."""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pipeline.close()


@dataclass(frozen=True)
class ClusterSettings:
    """What `edgerun serve` and `edgerun master` start a cluster with; each kind reads its part (cluster_config)."""

    kind: ClusterKind
    host: str
    port: int
    max_len: int
    activations: Activations = Activations.INT8
    threads: int = 1  # the master's or hub's own compute threads
    slots: int = 1  # sequences a batch runs together (serve --parallel); 1: one request at a time
    strategy: TPStrategy = TPStrategy.HALO  # tensor-parallel: the planner
    transport: Transport = Transport.UDP  # tensor-parallel
    route: Route = Route.CHAIN  # a pipeline's passes
    prefix: tuple[int, ...] = ()  # a pipeline's cached prefix (the chat template's start)
    replicas: int = 1  # workers holding each pipeline stage (hedged) or each expert
    hedge: str = "1"  # an expert dispatch's replicas at once, or "auto"
    spin_us: float = 0.0  # how long a master polls for replies before sleeping
    timeout_ms: float = 10.0  # tensor-parallel: a block's wait for the nodes' partials over UDP


ClusterConfig = MasterConfig | PipelineConfig | HubConfig


def cluster_config(s: ClusterSettings) -> ClusterConfig:
    """The kind's own config for these settings (what only one command sets: dataclasses.replace after)."""
    match s.kind:
        case ClusterKind.MOE:
            hedge, adaptive = hedge_setting(s.hedge, s.replicas)
            return HubConfig(host=s.host, port=s.port, max_len=s.max_len, replicas=s.replicas, hedge=hedge,
                             adaptive_hedge=adaptive, activations=s.activations, threads=s.threads,
                             slots=s.slots if s.slots > 1 else 0)
        case ClusterKind.PP:
            # A batch keeps every stage busy at once, so its pace is the slowest stage's ("max"), its products
            # multiply each weight with several rows (MACS), and it is planned for its speed alone (init_cost); one
            # request at a time passes the stages in turn, waiting for their sum, each stage streaming its weights.
            batched = s.slots > 1
            return PipelineConfig(host=s.host, port=s.port, max_len=s.max_len, replicas=s.replicas,
                                  activations=s.activations, route=s.route, prefix=s.prefix, spin_us=s.spin_us,
                                  slots=s.slots, objective="max" if batched else "sum",
                                  pricing=Pricing.MACS if batched else Pricing.BYTES, init_cost=not batched)
        case _:
            return MasterConfig(strategy=s.strategy, host=s.host, port=s.port, max_len=s.max_len, threads=s.threads,
                                transport=s.transport, activations=s.activations, slots=s.slots, spin_us=s.spin_us,
                                timeout_ms=s.timeout_ms)


def build(model: Model, key: bytes, config: ClusterConfig, log: Callable[[str], None],
          plan_file: TPPlan | None = None, loss: LossModel | None = None, predictors=None) -> Cluster:
    """The cluster `config` starts, listening for its members. Tensor-parallel only: `plan_file` to run when its
    nodes are present, injected `loss`, the predictors of static or dynamic mapping."""
    match config:
        case HubConfig():
            return Experts(MoeHub(model, key, config, log=log))
        case PipelineConfig():
            return Pipeline(PipelineMaster(model, key, config, log=log))
        case MasterConfig():
            return TensorParallel(Master(model, key, config, loss=loss, predictors=predictors, log=log), plan_file,
                                  log)
    raise TypeError(f"not a cluster's config: {config!r}")
