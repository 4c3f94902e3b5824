"""Mixture-of-experts planning (the MoEx paper), as pure functions: where each expert's replicas live (consistent
hashing weighted by memory), what a worker holds (Eq. 3), and the latency model of hedged dispatch (Eqs. 5-12,
18) with which a benchmark's measurements are compared.

Placement hashes (layer, expert, replica) onto a ring of virtual points, each worker owning points in proportion
to its memory budget; a replica goes to the first worker clockwise that does not hold the expert yet and has room
for it. A worker joining or leaving moves only the replicas whose walk passes its points: O(E/N) of them.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from edgerun.errors import EdgerunError

POINTS_PER_WORKER = 64  # virtual ring points of a worker with the mean budget


@dataclass(frozen=True)
class ExpertWorker:
    name: str
    budget_mb: float


@dataclass(frozen=True)
class ExpertPlacement:
    """Each (layer, expert)'s replicas, by worker name (the first is the primary), and what each worker holds."""

    replicas: dict[tuple[int, int], tuple[str, ...]]
    held_mb: dict[str, float]
    expert_mb: float

    def experts_of(self, worker: str) -> list[tuple[int, int]]:
        return sorted(key for key, names in self.replicas.items() if worker in names)

    def moved(self, other: ExpertPlacement) -> int:
        """Replicas that are on a different worker in `other`: what a change of membership makes workers fetch."""
        return sum(len(set(names) - set(other.replicas.get(key, ()))) for key, names in self.replicas.items())


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def place_experts(workers: Sequence[ExpertWorker], n_layers: int, n_experts: int, replicas: int,
                  expert_mb: float) -> ExpertPlacement:
    """Every expert of every layer on `replicas` distinct workers, by consistent hashing weighted by budget."""
    if replicas < 1:
        raise EdgerunError(f"replicas must be at least 1, not {replicas}")
    if len({w.name for w in workers}) < replicas:
        raise EdgerunError(f"{replicas} replicas of each expert need {replicas} workers; {len(workers)} connected")
    need = n_layers * n_experts * replicas * expert_mb
    have = sum(w.budget_mb for w in workers)
    if need > have:
        raise EdgerunError(f"{replicas} replicas of {n_layers * n_experts} experts need {need:.0f} MB; the workers' "
                           f"budgets hold {have:.0f} MB")
    mean = have / len(workers)
    ring = sorted((_point(f"{w.name}#{i}"), w.name) for w in workers
                  for i in range(max(1, round(POINTS_PER_WORKER * w.budget_mb / mean))))
    points = [p for p, _ in ring]
    budget = {w.name: w.budget_mb for w in workers}
    held = dict.fromkeys(budget, 0.0)
    placed: dict[tuple[int, int], tuple[str, ...]] = {}
    for layer in range(n_layers):
        for expert in range(n_experts):
            names: list[str] = []
            for replica in range(replicas):
                start = bisect.bisect(points, _point(f"{layer}:{expert}:{replica}"))
                for step in range(len(ring)):
                    name = ring[(start + step) % len(ring)][1]
                    if name not in names and held[name] + expert_mb <= budget[name] + 1e-9:
                        break
                else:
                    raise EdgerunError(f"no worker has room for replica {replica} of expert {expert} of layer "
                                       f"{layer} ({expert_mb:.1f} MB)")
                names.append(name)
                held[name] += expert_mb
            placed[(layer, expert)] = tuple(names)
    return ExpertPlacement(placed, held, expert_mb)


def hedge_setting(text: str, replicas: int) -> tuple[int, bool]:
    """--hedge as a hub takes it: (replicas a dispatch goes to, adaptive). "auto": adaptive, up to all replicas."""
    if text == "auto":
        return replicas, True
    value = int(text) if text.isdigit() else 0
    if not 1 <= value <= replicas:
        raise EdgerunError(f"--hedge takes auto or a number of replicas from 1 to --replicas ({replicas}), "
                           f"not {text!r}")
    return value, False


def worker_memory_bytes(replicas: int, n_experts: int, n_workers: int, moe_layers: int, expert_params: float,
                        bytes_per_param: float) -> float:
    """Seed 001 Eq. 3: what one worker holds with experts spread evenly, r*E/N per layer."""
    return replicas * n_experts / n_workers * moe_layers * expert_params * bytes_per_param


# --- the latency model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogNormal:
    """A worker's round-trip time for one expert: log-normal with this median (ms) and sigma."""

    median_ms: float
    sigma: float

    @classmethod
    def parse(cls, text: str) -> LogNormal:
        """"lognormal:MEDIAN_MS:SIGMA"."""
        kind, _, rest = text.partition(":")
        median, _, sigma = rest.partition(":")
        try:
            value = cls(float(median), float(sigma))
        except ValueError:
            value = None
        if kind != "lognormal" or value is None or value.median_ms <= 0 or value.sigma < 0:
            raise EdgerunError(f"latency {text!r}: expected lognormal:MEDIAN_MS:SIGMA with both positive")
        return value

    def cdf(self, t: float) -> float:
        if t <= 0:
            return 0.0
        if self.sigma == 0:
            return 1.0 if t >= self.median_ms else 0.0
        return NormalDist().cdf((math.log(t) - math.log(self.median_ms)) / self.sigma)

    def draw_ms(self, rng: np.random.Generator) -> float:
        return self.median_ms * float(np.exp(self.sigma * rng.standard_normal()))

    def quantile(self, q: float) -> float:
        return self.median_ms * math.exp(self.sigma * NormalDist().inv_cdf(q)) if 0 < q < 1 else \
            (0.0 if q <= 0 else math.inf)


def expert_phase_cdf(dist: LogNormal, k: int, hedge: int, t: float) -> float:
    """Eq. 8: P(the slowest of k experts, each the fastest of `hedge` replicas, is done by t)."""
    return (1.0 - (1.0 - dist.cdf(t)) ** hedge) ** k


def expected_expert_phase_ms(dist: LogNormal, k: int, hedge: int, steps: int = 20000) -> float:
    """Eq. 18, integrated numerically: E[T_expert] = integral over t of 1 - F_max(t)."""
    top = expert_phase_quantile_ms(dist, k, hedge, 1 - 1e-9)
    dt = top / steps
    # The midpoint rule on [0, top]; what lies beyond top is below 1e-9 of probability.
    return sum(1.0 - expert_phase_cdf(dist, k, hedge, (i + 0.5) * dt) for i in range(steps)) * dt


def expert_phase_quantile_ms(dist: LogNormal, k: int, hedge: int, q: float) -> float:
    """The q-quantile of T_expert, inverting Eq. 8: F(t) = 1 - (1 - q^(1/k))^(1/h)."""
    return dist.quantile(1.0 - (1.0 - q ** (1.0 / k)) ** (1.0 / hedge))


@dataclass(frozen=True)
class LayerTimes:
    """Eq. 10's terms, in ms: the hub's attention, routing and combine, the one-way network latency, the expert's
    compute on a worker, and (de)serialization."""

    attn_ms: float
    ffn_ms: float
    net_ms: float
    route_ms: float = 0.0
    combine_ms: float = 0.0
    ser_ms: float = 0.0

    def dispatch_ms(self) -> float:
        """Eq. 11: out, compute, back."""
        return 2 * self.net_ms + self.ffn_ms + self.ser_ms

    def layer_ms(self, dispatch_ms: float | None = None) -> float:
        """Eq. 10, with the dispatch phase given (a hedged expectation) or Eq. 11's."""
        return self.attn_ms + self.route_ms + (self.dispatch_ms() if dispatch_ms is None else dispatch_ms) + \
            self.combine_ms


def token_ms(layers: int, times: LayerTimes, dispatch_ms: float | None = None) -> float:
    """Eq. 12: L layers of Eq. 10."""
    return layers * times.layer_ms(dispatch_ms)


def hedged_dispatch_ms(times: LayerTimes, k: int, hedge: int, sigma: float) -> float:
    """The expected dispatch phase when each expert's round trip is log-normal around Eq. 11's value (its median)
    with this sigma: the slowest of k experts, each the fastest of `hedge` replicas (Eq. 18)."""
    return expected_expert_phase_ms(LogNormal(times.dispatch_ms(), sigma), k, hedge)
