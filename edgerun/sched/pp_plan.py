"""Pipeline-parallel planner: which worker runs which contiguous range of layers.

The planner follows the dynamic-partitioning chapter of the partitioning thesis (§4.3-§5.5):
a cost model (§5.2), a dynamic programme over a fixed worker order (§5.4, Algorithm 5.1) and a search over worker
orders (§5.5), plus the acceptance rule (§5.2.4) and shadow plans (§5.2.5).

Units. Inside the cost model every time is in microseconds, every size in bytes and every speed in bytes per
microsecond, as in the thesis; `workers_from_devices` converts the profiles' ms, Mbit/s and bytes/s, and plans
report seconds. A layer's computational cost C_x is the weight bytes a decode step streams through it, so the
thesis's dimensionless "ops" are bytes and a worker's speed CS is its measured weight bytes per microsecond.

Everything here is a pure function of its arguments: the only clock is the explicit
`seconds_since_redistribution` (plus an injectable clock for the time-bounded search and for `solve_seconds`),
and randomness comes from an explicit seed. The thesis evaluates worker orders on a thread pool; here they are
evaluated one after another: the same results, except that the time-bounded random search sees fewer orders.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import numpy as np

from edgerun.sched.profiles import DeviceProfile, ModelProfile

PP_PLAN_SCHEMA = "edgerun.pp-plan/1"
OBJECTIVES = ("sum", "max")
METHODS = ("exhaustive", "annealing", "random")
SHADOW_MODES = ("strict", "redundancy")
US_PER_S = 1e6
US_PER_MS = 1e3
BYTES_PER_US_PER_MBIT = 1e6 / 8 / US_PER_S

Order = tuple[int, ...]
Score = tuple[int, float]  # (layers left uncovered, C_total): a plan that covers fewer layers is always worse


@dataclass(frozen=True)
class CostParams:
    """Every constant of the cost model (§5.2), with the thesis's values."""

    delta_us: float = 500.0  # δ: per-stage overhead, such as serialisation at the cut and work on the master
    sigma_us: float = 1e6  # σ: creating an inference session, paid by every stage of a new plan
    gamma: float = 0.75  # power applied to the init cost while the server is Up
    gamma_block: float = 0.9  # power applied while no model is loaded, when init cost matters more
    t_mid_s: float = 60.0  # ρ(t_mid) = 1/2: the init penalty has halved a minute after a redistribution
    t_sharp_s: float = 12.0  # steepness of ρ, t_mid / 5
    alpha: float = 0.8  # weight of the slowest download (parallel downloads) against the sum of all downloads
    tau: float = 0.95  # a candidate must beat the current plan by 5 % to be accepted
    lam: float = 10.0  # λ: init-cost factor for reusing a worker of the current plan in a redundancy shadow plan
    include_init: bool = True  # False prices execution only (every init cost is 0)


@dataclass(frozen=True)
class SearchParams:
    """How worker orders are searched (§5.5); n²m is the cost of one DP run."""

    exhaustive_workers_below: int = 8
    exhaustive_size_below: int = 20_000
    annealing_size_below: int = 50_000
    size_limit: float = 1e8  # larger problems are rejected
    anneal_iterations: int = 1000
    anneal_patience: int = 200  # stop after this many iterations without a new best
    anneal_probe_steps: int = 10  # neighbour steps that estimate the cost differences for T0
    anneal_t0_factor: float = 10.0  # T0 = factor · mean |Δ|: a mean bad move is accepted with e^(-1/10) ≈ 0.9
    anneal_final_temperature: float = 10_000.0  # T_f, in cost units (µs), where differences stop mattering
    time_budget_s: float = 0.1  # random search


@dataclass(frozen=True)
class Worker:
    """A worker in the thesis's notation (§5.1.1), in µs, bytes and bytes/µs."""

    name: str
    memory_bytes: float  # M: the hard limit on the summed R_x of its stage
    session_overhead_us: float  # SO: fixed cost of running a stage, whatever its size
    speed: float  # CS: weight bytes streamed per µs
    bandwidth: float  # B: bytes per µs over its link to the master
    latency_us: float  # P: round-trip time, counted once per stage for the request and its reply
    cached: frozenset[int] = frozenset()  # D: layers whose weights it already holds

    def __post_init__(self) -> None:
        if not (self.speed > 0 and self.bandwidth > 0 and self.memory_bytes >= 0 and self.session_overhead_us >= 0
                and self.latency_us >= 0):
            raise ValueError(f"worker {self.name}: speed and bandwidth must be > 0, the other figures >= 0")


def workers_from_devices(devices: Sequence[DeviceProfile],
                         cached: Mapping[str, set[int] | frozenset[int]] | None = None) -> tuple[Worker, ...]:
    """Convert device profiles; `cached` maps a device name to the layers it holds (unknown names are ignored:
    a cache may outlive a device's connection)."""
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"device names must be unique: {names}")
    cached = cached or {}
    return tuple(
        Worker(
            name=d.name,
            memory_bytes=d.budget_bytes,
            session_overhead_us=d.compute.session_overhead_ms * US_PER_MS,
            speed=d.compute.weight_bytes_per_s / US_PER_S,
            # The thesis measures only the download speed; a stage both receives and sends, so the slower direction
            # bounds it.
            bandwidth=min(d.link.up_mbit, d.link.down_mbit) * BYTES_PER_US_PER_MBIT,
            latency_us=d.link.rtt_ms * US_PER_MS,
            cached=frozenset(cached.get(d.name, ())),
        )
        for d in devices
    )


@dataclass(frozen=True)
class Layers:
    """The per-layer metrics of §5.1.1, one entry per pipeline unit."""

    cost: tuple[float, ...]  # C_x: weight bytes streamed per token (or their share by multiply-adds: Pricing)
    weight: tuple[float, ...]  # W_x: bytes to download
    memory: tuple[float, ...]  # R_x: bytes resident while serving
    input: tuple[float, ...]  # I_x: bytes received per token
    output: tuple[float, ...]  # O_x: bytes sent per token

    def __post_init__(self) -> None:
        n = len(self.cost)
        metrics = (self.cost, self.weight, self.memory, self.input, self.output)
        if n == 0 or any(len(v) != n for v in metrics):
            raise ValueError("every layer metric needs one value per layer, and there must be at least one layer")
        # Non-negative memory makes a range's memory grow with its length, which the DP's early break relies on.
        if not all(math.isfinite(v) and v >= 0 for values in metrics for v in values):
            raise ValueError("layer metrics must be finite and >= 0")

    @property
    def n(self) -> int:
        return len(self.cost)


class Pricing(Enum):
    """What a layer's cost C_x counts. BYTES (the thesis's): the weight bytes a one-token step streams, for a
    step bound by memory. MACS: its multiply-adds, for a batch's steps, which read the weights once for several
    rows and multiply each with every row. Counted in the same units (the whole model costs its bytes either way,
    so a device's weight bytes a second price both), MACS shares them out by multiply-adds: an 8-bit LM head
    streams twice the bytes of a 4-bit layer of as many weights but multiplies as many. Measured on a pipeline
    batching 8 streams (device machine, synthetic 1B, 1 thread a worker): the head and one layer computed 9.7 s
    where 7 layers computed 13.2-14.5 s, so the head cost as much as 3.9 layers: 4.3 by multiply-adds, 8.2 by
    bytes."""

    BYTES = "bytes"
    MACS = "macs"

    def __str__(self) -> str:
        return self.value


def layer_costs(model: ModelProfile, pricing: Pricing = Pricing.BYTES) -> tuple[float, ...]:
    """C_x of every layer (the last one's with the LM head) as `pricing` counts it."""
    if pricing is Pricing.BYTES:
        return tuple(model.layer_read_bytes)
    per_flop = sum(model.layer_read_bytes) / sum(model.layer_flops)
    return tuple(f * per_flop for f in model.layer_flops)


def layers_from_model(model: ModelProfile, pricing: Pricing = Pricing.BYTES) -> Layers:
    """Layer metrics of a decode step (one token, or a batch's rows: `pricing`). The thesis sizes R_x as
    1.5·W_x; the profile knows better: the weights plus the layer's KV cache at the planned context."""
    hidden_state = (model.activation_bytes_per_token,) * model.n_layers
    return Layers(cost=layer_costs(model, pricing), weight=tuple(model.layer_weight_bytes),
                  memory=model.layer_memory_bytes, input=hidden_state, output=hidden_state)


def rho(seconds_since_redistribution: float, params: CostParams = CostParams()) -> float:
    """ρ(t) = 1 - 1/(1 + exp(-(t - t_mid)/t_sharp)), written as (1 - tanh(u/2))/2 so no exp overflows."""
    u = (seconds_since_redistribution - params.t_mid_s) / params.t_sharp_s
    return 0.5 * (1.0 - math.tanh(u / 2.0))


@dataclass(frozen=True)
class CostTriple:
    """⟨c_e, c_s, c_m⟩ of §5.2.3: execution cost (µs), summed and largest init penalty (not µs: see init_cost)."""

    exec_us: float
    init_sum: float
    init_max: float

    def plus(self, other: CostTriple, objective: str = "sum") -> CostTriple:
        """The thesis's addition; with the "max" objective execution costs combine by max (the bottleneck stage)."""
        e = self.exec_us + other.exec_us if objective == "sum" else max(self.exec_us, other.exec_us)
        return CostTriple(e, self.init_sum + other.init_sum, max(self.init_max, other.init_max))

    def total(self, alpha: float) -> float:
        """C_total = c_e + α·c_m + (1 - α)·c_s."""
        return self.exec_us + alpha * self.init_max + (1.0 - alpha) * self.init_sum


class _Prefix:
    """Prefix sums of the layer metrics, so the cost of a range [x, i) takes O(1). The cost functions below take
    x and i as ints or as index arrays, so the DP tables and single figures come from the same formulas."""

    def __init__(self, layers: Layers):
        self.layers = layers
        self.cost = np.array([0.0, *itertools.accumulate(layers.cost)])
        self.weight = np.array([0.0, *itertools.accumulate(layers.weight)])
        self.memory = np.array([0.0, *itertools.accumulate(layers.memory)])
        self.input = np.array(layers.input)
        self.output = np.array(layers.output)

    def cached_weight(self, worker: Worker) -> np.ndarray:
        # Per planning call: D_w changes between calls (§6.3.1).
        return np.array([0.0, *itertools.accumulate(w if x in worker.cached else 0.0
                                                     for x, w in enumerate(self.layers.weight))])

    def fits(self, worker: Worker, x: Any, i: Any) -> Any:
        return self.memory[i] - self.memory[x] <= worker.memory_bytes

    def exec_parts_us(self, worker: Worker, x: Any, i: Any, params: CostParams) -> tuple[Any, Any]:
        """(compute, network) of a non-empty range [x, i). δ is counted as network: the thesis places it at the
        network boundary (serialisation, the master's relay)."""
        compute = worker.session_overhead_us + (self.cost[i] - self.cost[x]) / worker.speed
        network = params.delta_us + worker.latency_us + (self.input[x] + self.output[i - 1]) / worker.bandwidth
        return compute, network

    def init(self, worker: Worker, cached_weight: np.ndarray, x: Any, i: Any, params: CostParams,
             seconds_since_redistribution: float, server_up: bool) -> Any:
        """C_init of a non-empty range [x, i)."""
        if not params.include_init:
            return np.zeros(np.broadcast(x, i).shape)
        # Clamped at 0: the two prefix sums round differently, and a negative base would make the power undefined.
        missing = np.maximum((self.weight[i] - self.weight[x]) - (cached_weight[i] - cached_weight[x]), 0.0)
        raw = params.sigma_us + missing / worker.bandwidth
        # Ĉ_init is in µs, but after the power transform it is a penalty whose scale depends on the unit chosen
        # (µs, as in the thesis): it only makes sense next to the thesis's other constants.
        if server_up:
            return raw ** params.gamma * rho(seconds_since_redistribution, params)
        return raw ** params.gamma_block


def _check_range(layers: Layers, first: int, end: int) -> None:
    if not 0 <= first <= end <= layers.n:
        raise ValueError(f"layer range [{first}, {end}) is not within [0, {layers.n}]")


def exec_cost_us(layers: Layers, worker: Worker, first: int, end: int, params: CostParams = CostParams()) -> float:
    """C_exec(w, first, end) of §5.2.1: SO + ΣC/CS + δ + P + (I_first + O_end-1)/B, ∞ when the range's memory
    exceeds M, and 0 for an empty range (a skipped worker)."""
    _check_range(layers, first, end)
    if first == end:
        return 0.0
    pre = _Prefix(layers)
    if not pre.fits(worker, first, end):
        return math.inf
    compute, network = pre.exec_parts_us(worker, first, end, params)
    return float(compute + network)


def init_cost(layers: Layers, worker: Worker, first: int, end: int, *, seconds_since_redistribution: float = 0.0,
              server_up: bool = False, params: CostParams = CostParams()) -> float:
    """C_init(w, first, end) of §5.2.2: Ĉ = σ + (weight bytes not cached on w)/B, then Ĉ^γ·ρ(t) while the server is
    Up and Ĉ^γ_block otherwise; 0 for an empty range or when init cost is switched off."""
    _check_range(layers, first, end)
    if first == end:
        return 0.0
    pre = _Prefix(layers)
    return float(pre.init(worker, pre.cached_weight(worker), first, end, params, seconds_since_redistribution,
                          server_up))


class _StageTable:
    """Every worker's stage costs, indexed [i, k]: the range [i - k, i) ending at layer i, with k = 0 the empty
    range of a skipped worker (cost 0). A stage's cost does not depend on the worker order, so it is computed once
    per planning call rather than once per order.

    Algorithm 5.1's inner loop walks x = i, i-1, ... and breaks at the first range that does not fit. Memory is
    non-negative, so a range's memory grows with k and the ranges that fit are exactly k = 1 .. K_i: the columns
    stop at the longest range any i allows, and the DP never looks past the break. Entries past it have exec cost ∞
    (and init cost 0, so no ∞·0 appears).

    `reuse` (redundancy shadow plans, §5.2.5) maps a worker of the current plan to its current range: it may take
    only ranges that share no layer with it, at λ times the init cost. Ranges grow with k, so once one overlaps all
    longer ones do, and treating overlap like a memory violation is safe.
    """

    def __init__(self, layers: Layers, workers: Sequence[Worker], params: CostParams,
                 seconds_since_redistribution: float, server_up: bool, reuse: Mapping[str, tuple[int, int]]):
        n = self.n = layers.n
        pre = _Prefix(layers)
        i = np.arange(n + 1)[:, None]
        k = np.arange(1, n + 1)[None, :]
        x = np.maximum(i - k, 0)
        starts = np.maximum(np.arange(n + 1)[:, None] - np.arange(n + 1)[None, :], 0)
        self.start: list[np.ndarray] = []  # [i, k] -> i - k, the layer where the stage starts (clamped at 0)
        self.exec: list[np.ndarray] = []
        self.init: list[np.ndarray] = []
        for w in workers:
            usable = (i - k >= 0) & pre.fits(w, x, i)
            banned = reuse.get(w.name)
            if banned is not None:
                # The thesis writes the overlap test on the closed [i, j]; with half-open ranges we ban sharing a
                # layer, so a reused worker may take the range right next to its current one.
                usable &= ~((x < banned[1]) & (banned[0] < i))
            width = int(usable.sum(axis=1).max()) + 1
            compute, network = pre.exec_parts_us(w, x, i, params)
            stage_init = pre.init(w, pre.cached_weight(w), x, i, params, seconds_since_redistribution, server_up)
            factor = params.lam if banned is not None else 1.0
            skip = np.zeros((n + 1, 1))
            self.start.append(starts[:, :width])
            self.exec.append(np.hstack([skip, np.where(usable, compute + network, math.inf)])[:, :width])
            self.init.append(np.hstack([skip, np.where(usable, factor * stage_init, 0.0)])[:, :width])


@dataclass(frozen=True)
class _Result:
    covered: int  # layers [0, covered) are assigned
    cost: CostTriple
    total: float
    stages: tuple[tuple[int, int, int], ...]  # (worker index, first layer, end layer)

    def score(self, n: int) -> Score:
        return n - self.covered, self.total


@dataclass(frozen=True)
class _Row:
    """Row j of the DP table: for every i, the best cost triple (and its C_total) of layers [0, i) with the first j
    workers of the order, and the start x of worker j's stage [x, i)."""

    exec_us: np.ndarray
    init_sum: np.ndarray
    init_max: np.ndarray
    total: np.ndarray
    start: np.ndarray


class _Evaluator:
    """Algorithm 5.1 over worker orders. Row j depends only on the first j workers, so an order that shares a
    prefix with the previous one reuses its rows: every permutation in lexicographic order shares all but the
    last few, which cuts the rows an exhaustive search computes for 7 workers from 35,280 to 13,699.

    Rows are array operations over all i at once; the comparison picks the smallest k (the largest x) among equal
    totals, as the thesis's strict `<` over x = i, i-1, ... does, so a skipped worker wins ties.

    With the "sum" objective and α > 0 the max term of the triple breaks the principle of optimality (the cheapest
    prefix by C_total need not extend to the cheapest whole), so the DP is a heuristic; it is exact when α = 0 or
    init cost is off. With "max" it is exact only when init cost is off.
    """

    def __init__(self, table: _StageTable, objective: str, alpha: float):
        self.table = table
        self.add = objective == "sum"
        self.alpha = alpha
        n = table.n
        unreachable = np.full(n + 1, math.inf)
        unreachable[0] = 0.0
        self.rows = [_Row(unreachable, np.zeros(n + 1), np.zeros(n + 1), unreachable, np.arange(n + 1))]
        self.order: Order = ()

    def _extend(self, row: _Row, w: int) -> _Row:
        t = self.table
        start, stage_exec, stage_init = t.start[w], t.exec[w], t.init[w]
        before = row.exec_us[start]
        e = before + stage_exec if self.add else np.maximum(before, stage_exec)
        s = row.init_sum[start] + stage_init
        m = np.maximum(row.init_max[start], stage_init)
        total = e + self.alpha * m + (1.0 - self.alpha) * s
        k = total.argmin(axis=1)
        i = np.arange(t.n + 1)
        return _Row(e[i, k], s[i, k], m[i, k], total[i, k], i - k)

    def assign(self, order: Order) -> _Result:
        shared = 0
        while shared < min(len(order), len(self.order)) and order[shared] == self.order[shared]:
            shared += 1
        del self.rows[shared + 1:]
        for w in order[shared:]:
            self.rows.append(self._extend(self.rows[-1], w))
        self.order = order
        last = self.rows[-1]
        # §5.4.2: when the order cannot cover every layer, the partial plan reaching the deepest layer.
        i = int(np.flatnonzero(np.isfinite(last.exec_us)).max())
        cost = CostTriple(float(last.exec_us[i]), float(last.init_sum[i]), float(last.init_max[i]))
        covered, total = i, float(last.total[i])
        stages = []
        for j in range(len(order), 0, -1):
            x = int(self.rows[j].start[i])
            if x < i:
                stages.append((order[j - 1], x, i))
            i = x
        return _Result(covered, cost, total, tuple(reversed(stages)))


def choose_method(n_layers: int, n_workers: int, search: SearchParams = SearchParams()) -> str:
    """§5.5: exhaustive for few workers and small problems, annealing for medium, random search for large."""
    size = n_layers * n_layers * n_workers
    if size >= search.size_limit:
        raise ValueError(f"{n_layers} layers × {n_workers} workers is too large to plan (n²m = {size:.3g} ≥ "
                         f"{search.size_limit:.3g})")
    if n_workers < search.exhaustive_workers_below and size < search.exhaustive_size_below:
        return "exhaustive"
    if size < search.annealing_size_below:
        return "annealing"
    return "random"


def exhaustive_search(m: int, score: Callable[[Order], Score]) -> Order:
    """Every permutation of m workers (§5.5.2); the first best in lexicographic order wins ties."""
    return min(itertools.permutations(range(m)), key=score)


def _neighbour(order: Order, rng: np.random.Generator) -> Order:
    """One of the four moves of §5.5.3 (the text announces five but lists four; their weights sum to 100 %)."""
    p = list(order)
    m = len(p)
    r = rng.random()
    if r < 0.2:  # range swap: two non-overlapping subranges of equal length change places
        length = int(rng.integers(1, m // 2 + 1))
        a = int(rng.integers(0, m - 2 * length + 1))
        b = int(rng.integers(a + length, m - length + 1))
        p[a:a + length], p[b:b + length] = p[b:b + length], p[a:a + length]
    elif r < 0.4:  # range reversal
        i, j = sorted(int(v) for v in rng.choice(m, 2, replace=False))
        p[i:j + 1] = p[i:j + 1][::-1]
    elif r < 0.6:  # the first or the last worker swaps with another: the end layers are the largest
        end = 0 if rng.random() < 0.5 else m - 1
        other = int(rng.integers(0, m - 1))
        other += other >= end
        p[end], p[other] = p[other], p[end]
    else:  # element swap
        i, j = (int(v) for v in rng.choice(m, 2, replace=False))
        p[i], p[j] = p[j], p[i]
    return tuple(p)


def _metropolis(current: Score, candidate: Score, temperature: float, rng: np.random.Generator) -> bool:
    if candidate[0] != current[0]:  # covering fewer layers is infinitely worse, covering more infinitely better
        return candidate[0] < current[0]
    delta = candidate[1] - current[1]
    return delta <= 0 or rng.random() < math.exp(-delta / temperature)


def anneal_search(m: int, score: Callable[[Order], Score], rng: np.random.Generator,
                  search: SearchParams = SearchParams()) -> Order:
    """Simulated annealing over worker orders (§5.5.3), starting from the identity order; returns the best order
    seen, so it is never worse than the identity."""
    current = tuple(range(m))
    current_score = score(current)
    best, best_score = current, current_score
    if m < 2:
        return best
    # T0 from the mean |Δ| along a short random walk; a move that changes coverage has no finite Δ and is left out.
    diffs = []
    walk, walk_score = current, current_score
    for _ in range(search.anneal_probe_steps):
        step = _neighbour(walk, rng)
        step_score = score(step)
        if step_score[0] == walk_score[0]:
            diffs.append(abs(step_score[1] - walk_score[1]))
        if step_score < best_score:
            best, best_score = step, step_score
        walk, walk_score = step, step_score
    final = search.anneal_final_temperature
    # When the probe sees only small differences T0 would lie below T_f and the schedule would heat up: hold at T_f.
    t0 = max(search.anneal_t0_factor * sum(diffs) / len(diffs), final) if diffs else final
    cooling = (final / t0) ** (1.0 / search.anneal_iterations)
    temperature = t0
    stale = 0
    for _ in range(search.anneal_iterations):
        candidate = _neighbour(current, rng)
        candidate_score = score(candidate)
        if _metropolis(current_score, candidate_score, temperature, rng):
            current, current_score = candidate, candidate_score
        if candidate_score < best_score:
            best, best_score = candidate, candidate_score
            stale = 0
        else:
            stale += 1
            if stale >= search.anneal_patience:
                break
        temperature *= cooling
    return best


def random_search(m: int, score: Callable[[Order], Score], rng: np.random.Generator, budget_s: float,
                  clock: Callable[[], float] = time.perf_counter) -> Order:
    """Random orders until the budget is spent (§5.5.4). The identity order is always evaluated, and the budget is
    checked between evaluations, so one DP run may overshoot it."""
    start = clock()
    best = tuple(range(m))
    best_score = score(best)
    while clock() - start < budget_s:
        candidate = tuple(int(v) for v in rng.permutation(m))
        candidate_score = score(candidate)
        if candidate_score < best_score:
            best, best_score = candidate, candidate_score
    return best


@dataclass(frozen=True)
class Stage:
    worker: str
    first_layer: int
    end_layer: int  # exclusive


@dataclass(frozen=True)
class Assignment:
    """The DP's answer for one worker order."""

    stages: tuple[Stage, ...]
    cost: CostTriple
    covered: int  # layers [0, covered) are assigned


@dataclass(frozen=True)
class PPPlan:
    model: str
    n_layers: int
    objective: str  # "sum": one token's latency; "max": the slowest stage (throughput)
    stages: tuple[Stage, ...]
    complete: bool  # the stages cover every layer
    exec_s_per_token: float  # predicted time of one token through all stages in turn, whatever the objective
    stage_compute_s: tuple[float, ...]  # per stage: SO + ΣC/CS
    stage_network_s: tuple[float, ...]  # per stage: δ + P + (I + O)/B
    cost: CostTriple  # c_e aggregates the stages by the objective (sum or max)
    method: str  # how the worker order was found: "exhaustive" | "annealing" | "random"
    solve_seconds: float
    pricing: Pricing = Pricing.BYTES  # what the layers' costs counted
    schema: str = PP_PLAN_SCHEMA

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "model": self.model,
            "n_layers": self.n_layers,
            "objective": self.objective,
            "stages": [{"worker": s.worker, "first_layer": s.first_layer, "end_layer": s.end_layer}
                       for s in self.stages],
            "complete": self.complete,
            "exec_s_per_token": self.exec_s_per_token,
            "stage_compute_s": list(self.stage_compute_s),
            "stage_network_s": list(self.stage_network_s),
            "cost": {"exec_us": self.cost.exec_us, "init_sum": self.cost.init_sum, "init_max": self.cost.init_max},
            "method": self.method,
            "solve_seconds": self.solve_seconds,
            "pricing": str(self.pricing),
        }


def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str = "plan") -> Any:
    if key not in data:
        raise ValueError(f"{where}.{key} is missing")
    value = data[key]
    # bool is an int subclass; no field of a plan takes a bool where a number is expected, or the reverse.
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise ValueError(f"{where}.{key} has the wrong type: {value!r}")
    return value


def pp_plan_from_json(data: Any) -> PPPlan:
    """Validate a plan document written by PPPlan.to_json; errors name the offending field."""
    if not isinstance(data, dict):
        raise ValueError("a pipeline plan must be a JSON object")
    if data.get("schema") != PP_PLAN_SCHEMA:
        raise ValueError(f"schema must be {PP_PLAN_SCHEMA!r}, not {data.get('schema')!r}")
    number = (int, float)
    objective = _field(data, "objective", str)
    if objective not in OBJECTIVES:
        raise ValueError(f"plan.objective must be one of {OBJECTIVES}, not {objective!r}")
    method = _field(data, "method", str)
    if method not in METHODS:
        raise ValueError(f"plan.method must be one of {METHODS}, not {method!r}")
    pricing = data.get("pricing", str(Pricing.BYTES))  # plans written before MACS pricing counted bytes
    if pricing not in {str(p) for p in Pricing}:
        raise ValueError(f"plan.pricing must be one of {', '.join(str(p) for p in Pricing)}, not {pricing!r}")
    stages = []
    for k, s in enumerate(_field(data, "stages", list)):
        if not isinstance(s, dict):
            raise ValueError(f"plan.stages[{k}] must be an object")
        where = f"plan.stages[{k}]"
        stages.append(Stage(_field(s, "worker", str, where), _field(s, "first_layer", int, where),
                            _field(s, "end_layer", int, where)))
    compute = _field(data, "stage_compute_s", list)
    network = _field(data, "stage_network_s", list)
    if len(compute) != len(stages) or len(network) != len(stages):
        raise ValueError("plan.stage_compute_s and plan.stage_network_s need one value per stage")
    if any(isinstance(v, bool) or not isinstance(v, number) for v in compute + network):
        raise ValueError("plan.stage_compute_s and plan.stage_network_s must hold numbers")
    cost = _field(data, "cost", dict)
    return PPPlan(
        model=_field(data, "model", str),
        n_layers=_field(data, "n_layers", int),
        objective=objective,
        stages=tuple(stages),
        complete=_field(data, "complete", bool),
        exec_s_per_token=float(_field(data, "exec_s_per_token", number)),
        stage_compute_s=tuple(float(v) for v in compute),
        stage_network_s=tuple(float(v) for v in network),
        cost=CostTriple(float(_field(cost, "exec_us", number, "plan.cost")),
                        float(_field(cost, "init_sum", number, "plan.cost")),
                        float(_field(cost, "init_max", number, "plan.cost"))),
        method=method,
        solve_seconds=float(_field(data, "solve_seconds", number)),
        pricing=Pricing(pricing),
    )


def _check_choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, not {value!r}")


def _to_assignment(result: _Result, workers: Sequence[Worker]) -> Assignment:
    return Assignment(tuple(Stage(workers[w].name, x, i) for w, x, i in result.stages), result.cost, result.covered)


def assign_in_order(layers: Layers, workers: Sequence[Worker], order: Sequence[int] | None = None, *,
                    objective: str = "sum", seconds_since_redistribution: float = 0.0, server_up: bool = False,
                    params: CostParams = CostParams()) -> Assignment:
    """The DP of Algorithm 5.1 for one worker order (indices into `workers`, default as given); workers may be
    skipped."""
    _check_choice(objective, OBJECTIVES, "objective")
    order = tuple(range(len(workers))) if order is None else tuple(order)
    if sorted(order) != list(range(len(workers))):
        raise ValueError(f"order must be a permutation of 0..{len(workers) - 1}, not {order}")
    table = _StageTable(layers, workers, params, seconds_since_redistribution, server_up, {})
    return _to_assignment(_Evaluator(table, objective, params.alpha).assign(order), workers)


def plan_layers(layers: Layers, workers: Sequence[Worker], *, model_name: str = "", objective: str = "sum",
                seconds_since_redistribution: float = 0.0, server_up: bool = False,
                params: CostParams = CostParams(), search: SearchParams = SearchParams(), seed: int = 0,
                clock: Callable[[], float] = time.perf_counter,
                reuse: Mapping[str, tuple[int, int]] | None = None) -> PPPlan:
    """DP plus worker-order search over plain layer and worker metrics; the core of plan_pp and shadow_plan.

    `reuse` restricts the named workers to ranges that share no layer with the given one, at λ times the init
    cost (redundancy shadow plans). When no order covers every layer, the plan reaching deepest (then cheapest) is
    returned with complete=False.
    """
    _check_choice(objective, OBJECTIVES, "objective")
    if seconds_since_redistribution < 0:
        raise ValueError(f"seconds_since_redistribution must be >= 0, not {seconds_since_redistribution}")
    if len({w.name for w in workers}) != len(workers):
        raise ValueError("worker names must be unique")
    start = clock()
    n, m = layers.n, len(workers)
    method = choose_method(n, m, search)
    table = _StageTable(layers, workers, params, seconds_since_redistribution, server_up, reuse or {})
    evaluator = _Evaluator(table, objective, params.alpha)
    results: dict[Order, _Result] = {}

    def score(order: Order) -> Score:
        # Annealing revisits orders; remember each DP run.
        if order not in results:
            results[order] = evaluator.assign(order)
        return results[order].score(n)

    rng = np.random.default_rng(seed)
    if method == "exhaustive":
        best = exhaustive_search(m, score)
    elif method == "annealing":
        best = anneal_search(m, score, rng, search)
    else:
        best = random_search(m, score, rng, search.time_budget_s, clock)
    result = results[best]
    pre = _Prefix(layers)
    parts = [tuple(map(float, pre.exec_parts_us(workers[w], x, i, params))) for w, x, i in result.stages]
    return PPPlan(
        model=model_name,
        n_layers=n,
        objective=objective,
        stages=_to_assignment(result, workers).stages,
        complete=result.covered == n,
        exec_s_per_token=sum(c + k for c, k in parts) / US_PER_S,
        stage_compute_s=tuple(c / US_PER_S for c, _ in parts),
        stage_network_s=tuple(k / US_PER_S for _, k in parts),
        cost=result.cost,
        method=method,
        solve_seconds=clock() - start,
    )


def _workers(devices: Sequence[DeviceProfile], cached: Mapping[str, set[int] | frozenset[int]] | None,
             current: PPPlan | None) -> tuple[Worker, ...]:
    """Workers, with each stage of the current plan counted as cached on its worker: it holds those weights."""
    held: dict[str, set[int]] = {name: set(layers) for name, layers in (cached or {}).items()}
    for s in current.stages if current is not None else ():
        held.setdefault(s.worker, set()).update(range(s.first_layer, s.end_layer))
    return workers_from_devices(devices, held)


def plan_pp(model: ModelProfile, devices: Sequence[DeviceProfile], *, objective: str = "sum",
            pricing: Pricing = Pricing.BYTES,
            current: PPPlan | None = None, seconds_since_redistribution: float = 0.0, server_up: bool = False,
            cached: Mapping[str, set[int] | frozenset[int]] | None = None, params: CostParams = CostParams(),
            search: SearchParams = SearchParams(), seed: int = 0,
            clock: Callable[[], float] = time.perf_counter) -> PPPlan:
    """The best pipeline plan for `model` on `devices` (§5.4-§5.5).

    `current` is the deployed plan, if any: its workers hold its layers, so those count as cached. Whether the
    result should replace `current` is `accept`'s decision. Every stage of the result, including one identical to
    a current stage, pays σ in its init cost, as in the thesis.
    """
    return replace(plan_layers(layers_from_model(model, pricing), _workers(devices, cached, current),
                               model_name=model.name, objective=objective,
                               seconds_since_redistribution=seconds_since_redistribution, server_up=server_up,
                               params=params, search=search, seed=seed, clock=clock), pricing=pricing)


def shadow_plan(model: ModelProfile, devices: Sequence[DeviceProfile], current: PPPlan, *, mode: str = "strict",
                objective: str = "sum", pricing: Pricing = Pricing.BYTES,
                seconds_since_redistribution: float = 0.0, server_up: bool = False,
                cached: Mapping[str, set[int] | frozenset[int]] | None = None, params: CostParams = CostParams(),
                search: SearchParams = SearchParams(), seed: int = 0,
                clock: Callable[[], float] = time.perf_counter) -> PPPlan:
    """A standby plan to switch to when a worker fails (§5.2.5).

    "strict": the workers of `current` are left out. "redundancy": they may take only layer ranges that share no
    layer with their current one, at λ times the init cost. A result with complete=False means no shadow plan.
    """
    _check_choice(mode, SHADOW_MODES, "mode")
    in_use = {s.worker: (s.first_layer, s.end_layer) for s in current.stages}
    workers = _workers(devices, cached, current)
    if mode == "strict":
        workers = tuple(w for w in workers if w.name not in in_use)
    return replace(plan_layers(layers_from_model(model, pricing), workers, model_name=model.name,
                               objective=objective, seconds_since_redistribution=seconds_since_redistribution,
                               server_up=server_up, params=params, search=search, seed=seed, clock=clock,
                               reuse=in_use if mode == "redundancy" else None), pricing=pricing)


def cover_stages(current: PPPlan, spares: Sequence[str], fits: Callable[[str, Stage], bool],
                 load_cost: Callable[[Stage], float] = lambda _: 0.0,
                 loaded: Mapping[str, Stage] | None = None) -> tuple[Stage, ...]:
    """Stages of `current` for spare workers to load ahead, each the very layers a serving worker runs, one per
    spare: a loss of a covered stage's worker is then recovered by handing its stage over (replacement_plan) with
    nothing to load. Where the spares cannot cover every stage, the stages that take longest to load
    (`load_cost`) are covered first, so that a loss nobody covers costs the shortest load; ties in stage order.
    A spare that holds a running stage loaded already (`loaded`: worker -> stage) keeps it, even where a costlier
    stage goes uncovered: switching would leave both uncovered while the costlier loads."""
    running = {(s.first_layer, s.end_layer) for s in current.stages}
    held: dict[tuple[int, int], str] = {}  # a running stage's layers -> the spare holding it loaded already
    for w in spares:
        stage = (loaded or {}).get(w)
        if stage is not None and (stage.first_layer, stage.end_layer) in running:
            held.setdefault((stage.first_layer, stage.end_layer), w)
    free = [w for w in spares if w not in held.values()]
    covers = []
    for s in sorted(current.stages, key=lambda s: -load_cost(s)):  # sorted is stable: ties keep stage order
        taker = held.get((s.first_layer, s.end_layer)) or next((w for w in free if fits(w, s)), None)
        if taker is not None:
            if taker in free:
                free.remove(taker)
            covers.append(Stage(taker, s.first_layer, s.end_layer))
    return tuple(covers)


MAX_STAGE_PARTS = 4  # graphs a stage is split into for a parallel load, at most


def stage_parts(load_bytes: Sequence[float], first: int, end: int, parts: int) -> list[int]:
    """Where the parts after the first begin when layers [first, end) are split into at most `parts` runs of
    consecutive layers, each created on a thread of its own (StageSession): the split whose largest part
    (`load_bytes` per layer: the weights its session repacks) is smallest, since the load lasts as long as that
    part's, in as few parts as give it (a part more is a session call more per pass: an LM head larger than the
    rest of its stage makes two parts as good as four). Empty for one part."""
    parts = max(1, min(parts, end - first))
    prefix = list(itertools.accumulate(load_bytes[first:end], initial=0.0))

    def cost(a: int, b: int) -> float:
        return prefix[b - first] - prefix[a - first]

    # best[k][a]: (largest part, bounds) splitting layers [a, end) into k parts; ties go to the earlier bound.
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{}, {a: (cost(a, end), ()) for a in range(first, end)}]
    for k in range(2, parts + 1):
        best.append({a: min((max(cost(a, b), best[k - 1][b][0]), (b, *best[k - 1][b][1]))
                            for b in range(a + 1, end - k + 2))
                     for a in range(first, end - k + 1)})
    shortest = min(best[k][first][0] for k in range(1, parts + 1))
    return list(next(best[k][first][1] for k in range(1, parts + 1) if best[k][first][0] <= shortest))


def replacement_plan(current: PPPlan, alive: Collection[str], spares: Sequence[str],
                     fits: Callable[[str, Stage], bool], loaded: Mapping[str, Stage] | None = None) -> PPPlan | None:
    """After workers are lost: `current` with each stage whose worker is gone handed to a spare worker (alive, in
    no stage), the others kept where they are, with their sessions and KV caches. A spare that has that very stage
    loaded ahead (`loaded`: worker -> stage) comes first, then the first spare whose budget holds it (`fits`).
    None when no stage was lost, or a lost one finds no spare: plan afresh then. The plan keeps `current`'s
    predicted costs (a spare is priced when the repartition loop next compares plans)."""
    loaded = loaded or {}
    free = [w for w in spares if w in alive]
    stages = []
    for s in current.stages:
        if s.worker in alive:
            stages.append(s)
            continue
        ready = [w for w in free if loaded.get(w) == Stage(w, s.first_layer, s.end_layer)]
        takers = ready or [w for w in free if fits(w, s)]
        if not takers:
            return None
        free.remove(takers[0])
        stages.append(Stage(takers[0], s.first_layer, s.end_layer))
    if tuple(stages) == current.stages:
        return None
    return replace(current, stages=tuple(stages), method="replacement")


def plan_exec_us(plan: PPPlan, model: ModelProfile, devices: Sequence[DeviceProfile], *,
                 objective: str | None = None, pricing: Pricing | None = None,
                 params: CostParams = CostParams()) -> float:
    """C_exec of a plan priced with today's device metrics, its layers' costs counted by `pricing` and aggregated by
    `objective` (default the plan's own); ∞ when the plan is partial, one of its workers is gone or a stage no
    longer fits."""
    objective = objective or plan.objective
    _check_choice(objective, OBJECTIVES, "objective")
    if plan.model != model.name or plan.n_layers != model.n_layers:
        raise ValueError(f"the plan is for {plan.model} ({plan.n_layers} layers), not {model.name} "
                         f"({model.n_layers} layers)")
    if not plan.complete:
        return math.inf
    layers = layers_from_model(model, pricing or plan.pricing)
    workers = {w.name: w for w in workers_from_devices(devices)}
    costs = [exec_cost_us(layers, workers[s.worker], s.first_layer, s.end_layer, params)
             if s.worker in workers else math.inf for s in plan.stages]
    return sum(costs) if objective == "sum" else max(costs, default=0.0)


def accept(candidate: PPPlan, current: PPPlan | None, model: ModelProfile, devices: Sequence[DeviceProfile], *,
           params: CostParams = CostParams()) -> bool:
    """§5.2.4: switch when C_total(candidate) < τ·C_exec(current).

    The candidate is priced by its own cost triple (it comes straight from plan_pp or shadow_plan, priced at this
    moment); the current plan is re-priced with today's metrics and the candidate's objective and pricing, without
    init cost
    as it is already deployed. A partial candidate is never accepted; a missing or partial current plan has
    C_exec = ∞, so any complete candidate replaces it.
    """
    if not candidate.complete:
        return False
    current_exec = math.inf if current is None else plan_exec_us(current, model, devices, objective=candidate.objective,
                                                                 pricing=candidate.pricing, params=params)
    return candidate.cost.total(params.alpha) < params.tau * current_exec
