"""What `edgerun serve` generates with: its own single-process engine, or the cluster of nodes that joined it
(tensor-parallel or pipeline, serve.clusters), whichever is faster, switched between requests.

The switch is a Stepper (model.generate), so the one generation loop drives it. A device lost mid-request
raises EngineLost; recover() replans over the devices left, or falls back to the single engine when none is
left, and the loop re-prefills: the request goes on with the same tokens. Without a single engine
(--no-local) and without a cluster there is no capacity: requests wait for one (Service)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from edgerun.errors import EdgerunError
from edgerun.model.generate import Engine, EngineLost, Stepper, TokenStepper, generate
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.serve.clusters import Cluster

# A cluster must be predicted this much faster than the single engine before requests move to it: a plan's
# prediction is a model, and moving costs a replan.
MIN_GAIN = 0.05
WARMUP_TOKENS = 8


class Mode(Enum):
    SINGLE = "single"  # this process's own engine
    CLUSTER = "cluster"  # the nodes that joined (and the master's own share, tensor-parallel)
    NONE = "none"  # neither: requests wait


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

    def __init__(self, single: Engine | None, cluster: Cluster | None, prefer: Prefer, max_len: int,
                 log: Callable[[str], None] = lambda _: None, single_ms: float | None = None) -> None:
        """`single_ms`: the single engine's decode ms/token where already known (else measured here, which also
        warms it up)."""
        if single is None and cluster is None:
            raise EdgerunError("nothing to serve with: no single engine and no cluster")
        self.single, self.cluster, self.prefer, self.log = single, cluster, prefer, log
        self._max_len = max_len
        self.mode = Mode.SINGLE if single is not None else Mode.NONE
        self.why = "the single engine" if single is not None else "no nodes yet"  # the last change of mode's reason
        self.lock = threading.Lock()  # update() against the dashboard's reads
        self.events: deque[Event] = deque(maxlen=50)
        self.planned_for: tuple[str, ...] = ()  # the members the cluster's current plan covers
        self.measured_ms: dict[Mode, float] = {}  # decode ms/token, a running mean per mode
        self.single_ms: float | None = None
        if single is not None:
            self.single_ms = self._warm_up(single) if single_ms is None else single_ms
            self.note(f"single engine: {self.single_ms:.1f} ms/token")
            if cluster is not None:  # the master's own speed for its plans: what its engine just showed
                cluster.set_own_speed(single.weight_bytes / (self.single_ms / 1e3))

    def note(self, text: str) -> None:
        self.events.append(Event(time.time(), text))
        self.log(text)

    @staticmethod
    def _warm_up(single: Engine) -> float:
        """The single engine's decode time per token, measured on a short greedy run (which also warms it).

        It runs on a thread of its own, which ends with it. ggml computes a graph on several threads through
        OpenMP, and every thread that starts such a graph keeps a team of OpenMP threads for as long as it lives.
        Once a process holds more of them than it has cores, libgomp's threads stop spinning at each barrier and
        sleep instead, hundreds of barriers a token: warmed up on the main thread, this machine's engine (2 cores,
        2 threads) decoded at 16-18 ms a token on the generation thread instead of 5-6."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="warm-up") as thread:
            result = thread.submit(generate, single, list(range(1, 12)), WARMUP_TOKENS,
                                   Sampler(SamplingParams())).result()
        return result.decode_s / max(1, len(result.tokens) - 1) * 1e3

    # --- the generation loop's interface (on the generation thread) -------------------------------------
    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def engine(self) -> Stepper | TokenStepper:
        if self.mode == Mode.CLUSTER and self.cluster is not None:
            return self.cluster.engine
        if self.single is None:
            raise EngineLost("no capacity")
        return self.single

    def reset(self) -> None:
        self.engine.reset()

    def step_token(self, tokens: Sequence[int], start: int, sampler: Sampler) -> int:
        """The next token from whichever engine is in use: sampled here from its logits, or where a pipeline's
        last stage has them."""
        engine = self.engine
        if isinstance(engine, TokenStepper):
            return engine.step_token(tokens, start, sampler)
        return sampler(engine.step(tokens), start + len(tokens))

    def release(self) -> None:
        for engine in (self.single, None if self.cluster is None else self.cluster.engine):
            if engine is not None:
                engine.release()

    def recover(self, lost: EngineLost) -> None:
        self.note(f"{lost} lost mid-request")
        if self.mode == Mode.CLUSTER and self.cluster is not None:
            self.cluster.on_lost(lost)
        self._plan(self.members())
        if self.mode == Mode.NONE:  # why: every node left, or those left cannot hold the model (the plan's error)
            raise NoCapacity(f"{lost} was lost mid-request and nothing else can compute: {self.why}")

    @property
    def has_capacity(self) -> bool:
        return self.mode != Mode.NONE

    # --- moving between engines (between requests, on the generation thread) ---------------------------
    def members(self) -> tuple[str, ...]:
        return () if self.cluster is None else self.cluster.members()

    def update(self) -> None:
        """Plan again when nodes joined or left since the last plan; in auto mode, leave a cluster that measures
        slower than the single engine."""
        members = self.members()
        if members != self.planned_for:
            self._plan(members)
        elif self.mode == Mode.CLUSTER and self.cluster is not None and (changed := self.cluster.rebalance()):
            self.note(changed)
        if self.prefer == Prefer.AUTO and self.mode == Mode.CLUSTER and self.single_ms is not None and \
                self.measured_ms.get(Mode.CLUSTER, 0.0) > self.single_ms:
            self._set_mode(Mode.SINGLE, f"the cluster measured {self.measured_ms[Mode.CLUSTER]:.1f} ms/token, "
                                        f"slower than the single engine's {self.single_ms:.1f}")

    def _fallback(self, why: str) -> None:
        self._set_mode(Mode.SINGLE if self.single is not None else Mode.NONE,
                       why + ("" if self.single is not None else "; requests wait for nodes"))

    def _plan(self, members: tuple[str, ...]) -> None:
        with self.lock:
            self.planned_for = members
            self.measured_ms.pop(Mode.CLUSTER, None)
        if self.cluster is None:
            return
        if not members:
            self._fallback("no nodes")
            return
        if self.prefer == Prefer.SINGLE and self.single is not None:
            self._set_mode(Mode.SINGLE, f"{len(members)} node(s) present; --prefer single keeps the single engine")
            return
        try:
            what, predicted = self.cluster.deploy()
        except EdgerunError as e:
            self._fallback(f"cannot plan over {', '.join(members)} ({e})")
            return
        what = f"{what}: {predicted:.1f} ms/token predicted"
        if self.single_ms is None or self.prefer == Prefer.CLUSTER or predicted < (1 - MIN_GAIN) * self.single_ms:
            self._set_mode(Mode.CLUSTER, what)
        else:
            self._set_mode(Mode.SINGLE, f"{what}, no faster than the single engine's {self.single_ms:.1f}")

    def _set_mode(self, mode: Mode, why: str) -> None:
        with self.lock:
            self.mode, self.why = mode, why
        self.note(f"{mode.value}: {why}")

    def measured(self, ms_per_token: float) -> None:
        """A request's decode time per token, on the mode it ran on."""
        with self.lock:
            old = self.measured_ms.get(self.mode)
            self.measured_ms[self.mode] = ms_per_token if old is None else 0.7 * old + 0.3 * ms_per_token

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()


class NoCapacity(EdgerunError):
    """Nothing can generate: no single engine and no cluster that holds the model."""
