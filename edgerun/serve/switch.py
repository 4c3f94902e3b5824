"""What `edgerun serve` generates with: its own single-process engine, or the tensor-parallel cluster of the
master it runs and the nodes that joined it, whichever is faster, switched between requests.

The switch is a Stepper (model.generate), so the one generation loop drives it. A node lost mid-request
raises EngineLost; recover() replans over the nodes left, or falls back to the single engine when none is
left, and the loop re-prefills: the request goes on with the same tokens."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.generate import Engine, generate
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.sched.tp_plan import TPPlan, check_fits, plan_for_members
from edgerun.tp.master import Master

# A cluster must be predicted this much faster than the single engine before requests move to it: a plan's
# prediction is a model, and moving costs a replan.
MIN_GAIN = 0.05
WARMUP_PROMPT = "The quick brown fox jumps over the lazy dog."
WARMUP_TOKENS = 8


class Mode(Enum):
    SINGLE = "single"  # this process's own engine
    CLUSTER = "cluster"  # the tensor-parallel master and its nodes


class Prefer(Enum):
    AUTO = "auto"  # the cluster when its plan is predicted faster, and while it measures faster
    CLUSTER = "cluster"  # the cluster whenever a node is there
    SINGLE = "single"  # never the cluster (nodes may still join and be watched)


@dataclass(frozen=True)
class Event:
    at: float  # time.time()
    text: str


class EngineSwitch:
    """Stepper over the single engine and the cluster; update() between requests moves between them."""

    def __init__(self, single: Engine, master: Master | None, prefer: Prefer,
                 log: Callable[[str], None] = lambda _: None, plan_file: TPPlan | None = None) -> None:
        self.single, self.master, self.prefer, self.log = single, master, prefer, log
        self.plan_file = plan_file  # used whenever the nodes present are exactly its devices
        self.mode = Mode.SINGLE
        self.lock = threading.Lock()  # update() against the dashboard's reads
        self.events: deque[Event] = deque(maxlen=50)
        self.planned_for: tuple[str, ...] = ()  # the nodes the master's current plan covers
        self.measured_ms: dict[Mode, float] = {}  # decode ms/token, a running mean per mode
        self.single_ms = self._warm_up()
        self.note(f"single engine: {self.single_ms:.1f} ms/token")
        if master is not None:  # the master's own speed for its plans: what its engine just showed
            weight_bytes = getattr(single, "weight_bytes", 0)
            if weight_bytes:
                master.reconfigure(replace(master.config, speed=weight_bytes / (self.single_ms / 1e3)))

    def note(self, text: str) -> None:
        self.events.append(Event(time.time(), text))
        self.log(text)

    def _warm_up(self) -> float:
        """The single engine's decode time per token, measured on a short greedy run (which also warms it)."""
        prompt = list(range(1, 12))
        result = generate(self.single, prompt, WARMUP_TOKENS, Sampler(SamplingParams()))
        return result.decode_s / max(1, len(result.tokens) - 1) * 1e3

    # --- the Stepper interface (on the generation thread) -------------------------------------------
    @property
    def max_len(self) -> int:
        return self.single.max_len

    @property
    def engine(self) -> Engine | Master:
        return self.master if self.mode == Mode.CLUSTER and self.master is not None else self.single

    def reset(self) -> None:
        self.engine.reset()

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return self.engine.step(tokens)

    def recover(self) -> None:
        self.note("a node was lost mid-request")
        self._plan(self._alive())

    # --- moving between engines (between requests, on the generation thread) ---------------------------
    def _alive(self) -> tuple[str, ...]:
        return () if self.master is None else tuple(n.name for n in self.master.membership.alive())

    def update(self) -> None:
        """Plan again when nodes joined or left since the last plan; in auto mode, leave a cluster that measures
        slower than the single engine."""
        alive = self._alive()
        if alive != self.planned_for:
            self._plan(alive)
        elif self.mode == Mode.CLUSTER and self.master is not None and self.master.rebalance():
            self.note("replanned on the speeds the devices showed")
        if self.prefer == Prefer.AUTO and self.mode == Mode.CLUSTER and \
                self.measured_ms.get(Mode.CLUSTER, 0.0) > self.single_ms:
            self._set_mode(Mode.SINGLE, f"the cluster measured {self.measured_ms[Mode.CLUSTER]:.1f} ms/token, "
                                        f"slower than the single engine's {self.single_ms:.1f}")

    def _plan(self, alive: tuple[str, ...]) -> None:
        with self.lock:
            self.planned_for = alive
            self.measured_ms.pop(Mode.CLUSTER, None)
        if not alive or self.master is None or self.prefer == Prefer.SINGLE:
            self._set_mode(Mode.SINGLE, "no nodes: serving from the single engine" if not alive else
                           f"{len(alive)} node(s) present; --prefer single keeps the single engine")
            return
        try:
            plan = self.master.replan(self._from_file(alive))
        except EdgerunError as e:
            self._set_mode(Mode.SINGLE, f"cannot plan over {len(alive)} node(s) ({e}): single engine")
            return
        predicted = plan.time_per_token_s * 1e3
        what = f"plan {plan.strategy} over master + {', '.join(alive)}: {predicted:.1f} ms/token predicted"
        if self.prefer == Prefer.CLUSTER or predicted < (1 - MIN_GAIN) * self.single_ms:
            self._set_mode(Mode.CLUSTER, what)
        else:
            self._set_mode(Mode.SINGLE, f"{what}, no faster than the single engine's {self.single_ms:.1f}")

    def _from_file(self, alive: tuple[str, ...]) -> TPPlan | None:
        """The plan file over these nodes, or None (plan with --plan) when it does not cover exactly them."""
        if self.plan_file is None or self.master is None:
            return None
        try:
            check_fits(self.plan_file, self.master.profile())
            return plan_for_members(self.plan_file, self.plan_file.devices[0], list(alive))
        except ValueError as e:
            self.note(f"the plan file does not fit the nodes present ({e}): planning with --plan")
            return None

    def _set_mode(self, mode: Mode, why: str) -> None:
        with self.lock:
            self.mode = mode
        self.note(f"{mode.value}: {why}")

    def measured(self, ms_per_token: float) -> None:
        """A request's decode time per token, on the mode it ran on."""
        with self.lock:
            old = self.measured_ms.get(self.mode)
            self.measured_ms[self.mode] = ms_per_token if old is None else 0.7 * old + 0.3 * ms_per_token

