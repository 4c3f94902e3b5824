"""The kinds of cluster `edgerun serve` can move requests to, behind one interface: a tensor-parallel master and
its nodes (--plan halo, minmax, ...), a pipeline master and its workers and browser tabs (--plan dp), or a MoEx
hub and its expert workers (--plan moe).

Each says who is present, deploys a plan over them (returning its predicted ms/token), and describes its
devices and plan for the dashboard. Both engines run under the one generation loop (model.generate)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from enum import StrEnum
from typing import Any, Protocol

from edgerun.model.generate import EngineLost, Stepper, TokenStepper
from edgerun.moe.hub import MoeHub
from edgerun.net.wire import WorkerKind
from edgerun.pp.master import PipelineMaster
from edgerun.sched.tp_plan import TPPlan, check_fits, plan_for_members
from edgerun.tp.master import Master, Rebalance


class MemberState(StrEnum):
    """A cluster's member as the dashboard and /api/state show it, in every mode."""

    LOADING = "loading"  # joined, its share still loading (a tensor-parallel node)
    SERVING = "serving"  # computing the running plan
    STANDBY = "standby"  # alive, in no stage of the running plan (a pipeline's spare)
    LEFT_OUT = "left out"  # alive, not given work: failed its health checks (an expert worker)
    LOST = "lost"  # gone


class Cluster(Protocol):
    kind: str  # "tensor-parallel" or "pipeline"
    port: int  # where nodes join

    @property
    def engine(self) -> Stepper | TokenStepper: ...

    def members(self) -> tuple[str, ...]: ...

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

    def nodes(self) -> list[dict[str, Any]]: ...

    def plan(self) -> dict[str, Any] | None: ...

    def counters(self) -> dict[str, int]: ...

    def set_own_speed(self, weight_bytes_per_s: float) -> None: ...

    def close(self) -> None: ...


class TensorParallel:
    """A tensor-parallel master: plans with --plan (or a plan file naming exactly the nodes present)."""

    kind = "tensor-parallel"

    def __init__(self, master: Master, plan_file: TPPlan | None, note) -> None:
        self.master, self.plan_file, self.note = master, plan_file, note
        self.port = master.port

    @property
    def engine(self) -> Master:
        return self.master

    def members(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.master.membership.alive())

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
                return self.master.last_trial.said()
        return None

    def on_lost(self, lost: EngineLost) -> None:
        """Nothing: the membership already marked the node dead, and deploy() plans without it."""

    def nodes(self) -> list[dict[str, Any]]:
        out = []
        for n in self.master.nodes:
            spec = n.spec
            # a node the plan gives nothing (every member is assigned, some an empty share) stands by
            holds = spec is not None and bool(sum(map(len, spec.attn_units)) + sum(map(len, spec.mlp_groups))
                                              + len(spec.vocab_blocks))
            state = MemberState.LOST if not n.alive else MemberState.LOADING if not n.ready.is_set() \
                else MemberState.SERVING if holds else MemberState.STANDBY
            out.append({
                "name": n.name, "kind": WorkerKind.NATIVE, "device": n.device, "alive": n.alive, "state": state,
                "memory_mb": (n.weight_bytes + n.cache_bytes) / 1e6, "budget_mb": n.budget_mb,
                "speed_gb_s": (n.speed if (m := n.decode.measured()) is None else m.speed) / 1e9,
                "rtt_ms": None if n.link is None else n.link.rtt_ms,
                "loss": None if n.link is None else n.link.loss_rate,
                "holds": None if spec is None else (
                    f"{sum(map(len, spec.attn_units))} attention units, {sum(map(len, spec.mlp_groups))} MLP "
                    f"groups, {len(spec.vocab_blocks)} vocabulary blocks"),
            })
        return out

    def plan(self) -> dict[str, Any] | None:
        p = self.master.plan
        if p is None:
            return None
        return {"strategy": p.strategy, "devices": list(p.devices), "memory_mb": [m / 1e6 for m in p.memory_bytes],
                "compute_ms": [c * 1e3 for c in p.compute_s], "predicted_ms_per_token": p.time_per_token_s * 1e3}

    def counters(self) -> dict[str, int]:
        s = self.master.stats
        return {"blocks": s.blocks, "blocks_incomplete": s.blocks_incomplete, "late_packets": s.late_packets,
                "rejected": self.master.counters.total()}

    def set_own_speed(self, weight_bytes_per_s: float) -> None:
        self.master.reconfigure(replace(self.master.config, speed=weight_bytes_per_s))

    def close(self) -> None:
        self.master.close()


class Experts:
    """A MoEx hub: expert workers (`edgerun node --mode moe`) and browser tabs (node?mode=moe) hold the experts."""

    kind = "experts"

    def __init__(self, hub: MoeHub) -> None:
        self.hub = hub
        self.port = hub.port

    @property
    def engine(self) -> MoeHub:
        return self.hub

    def members(self) -> tuple[str, ...]:
        return tuple(sorted(w.name for w in self.hub.workers.values() if w.alive))

    def deploy(self) -> tuple[str, float]:
        placement = self.hub.deploy()
        held = ", ".join(f"{name} {len(placement.experts_of(name))}" for name in self.members())
        return f"experts over {held}", self.hub.probe_ms()

    def rebalance(self) -> str | None:
        return None  # a join is placed at the next deploy; a loss is replicated again in the background

    def on_lost(self, lost: EngineLost) -> None:
        """Nothing: the hub saw the worker leave; deploy() places its experts over the workers left."""

    def nodes(self) -> list[dict[str, Any]]:
        placement = self.hub.placement
        return [{"name": w.name, "kind": w.kind, "device": w.kind, "alive": w.alive,
                 "state": MemberState.SERVING if w.healthy else MemberState.LEFT_OUT if w.alive else MemberState.LOST,
                 "memory_mb": w.peak_rss_mb or None, "budget_mb": w.budget_mb, "speed_gb_s": None,
                 "rtt_ms": w.p50_s * 1e3 if w.recent else None, "loss": None,
                 "holds": f"{len(placement.experts_of(w.name))} experts" if placement else "nothing"}
                for w in self.hub.workers.values()]

    def plan(self) -> dict[str, Any] | None:
        placement = self.hub.placement
        if placement is None:
            return None
        names = sorted(placement.held_mb)
        return {"strategy": "moe", "devices": names, "memory_mb": [placement.held_mb[n] for n in names],
                "compute_ms": [], "predicted_ms_per_token": None}

    def counters(self) -> dict[str, int]:
        s = self.hub.stats
        return {"blocks": s.dispatches, "blocks_incomplete": s.dropped, "late_packets": s.redispatched,
                "rejected": 0}

    def set_own_speed(self, weight_bytes_per_s: float) -> None:
        """The hub's own share (attention, routers, head) is not planned."""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.hub.close()


class Pipeline:
    """A pipeline master: workers (`edgerun node --mode pp`) and browser tabs hold ranges of layers."""

    kind = "pipeline"

    def __init__(self, pipeline: PipelineMaster) -> None:
        self.pipeline = pipeline
        self.port = pipeline.port

    @property
    def engine(self) -> PipelineMaster:
        return self.pipeline

    def members(self) -> tuple[str, ...]:
        return tuple(sorted(w.name for w in self.pipeline.workers.alive()))

    def deploy(self) -> tuple[str, float]:
        plan = self.pipeline.start()
        stages = ", ".join(f"{s.worker} {s.first_layer}-{s.end_layer - 1}" for s in plan.stages)
        return f"pipeline over {stages}", plan.exec_s_per_token * 1e3

    def rebalance(self) -> str | None:
        return None  # the pipeline master repartitions by itself between requests

    def on_lost(self, lost: EngineLost) -> None:
        self.pipeline.recover(lost)  # the pipeline goes Down; its next prefill replans

    def nodes(self) -> list[dict[str, Any]]:
        stages = {s.worker: s for s in self.pipeline.plan.stages} if self.pipeline.plan else {}
        out = []
        for w in self.pipeline.workers.alive():  # a tab that closed leaves the list
            s = stages.get(w.name)
            browser = w.kind is WorkerKind.BROWSER
            # A native worker: its machine and onnxruntime's device; a tab: its backend (wasm or webgpu).
            device = w.capabilities.get("backend") if browser else \
                ", ".join(str(w.capabilities[k]) for k in ("host", "device") if w.capabilities.get(k))
            out.append({
                "name": w.name, "kind": w.kind, "device": device, "alive": True,
                "state": MemberState.SERVING if s else MemberState.STANDBY, "memory_mb": None, "budget_mb": w.memory_mb,
                "speed_gb_s": w.measured_speed / 1e9, "rtt_ms": w.rtt_ms, "loss": None,
                "holds": f"layers {s.first_layer}-{s.end_layer - 1}" if s else "nothing",
            })
        return out

    def plan(self) -> dict[str, Any] | None:
        p = self.pipeline.plan
        if p is None:
            return None
        return {"strategy": "dp", "devices": [s.worker for s in p.stages], "memory_mb": [],
                "compute_ms": [c * 1e3 for c in p.stage_compute_s],
                "predicted_ms_per_token": p.exec_s_per_token * 1e3}

    def counters(self) -> dict[str, int]:
        return {"blocks": 0, "blocks_incomplete": 0, "late_packets": 0, "rejected": 0}

    def set_own_speed(self, weight_bytes_per_s: float) -> None:
        """The pipeline master computes no layers itself."""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pipeline.close()
