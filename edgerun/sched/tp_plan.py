"""Tensor-parallel plans: which device computes which attention units, MLP neuron groups and
LM-head vocabulary blocks (HALO, §III-B).

A plan is made in two steps. First the number of units of each type per layer and device: from a
ratio vector (Algorithm 1 computation-greedy, Algorithm 2 min-max, the Galaxy and vanilla
baselines) or from the exact integer program of Eq. (1). Then Algorithm 3 maps priority indices to
devices by ascending packet-loss rate, so the most reliable device holds the most important units.

Decode is memory-bandwidth bound, so a unit's work is the weight bytes it streams per token and a
device's speed is the weight bytes it streams per second: a unit of work τ takes τ / c seconds.

What synchronizing costs is a `SyncModel`: HALO's Eq. (1) charges 2·L·(n − 1) synchronizations per token, as if
each device's exchange waited for the one before; edgerun's master sends every block's input to all its nodes at
once and merges their partials as they come: a block lasts as long as its slowest device, each counting the fixed
cost of running its block's session, a node its own round trip and the master its work per node
(`SyncModel.STAR`, what the runtime plans with).
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Any

import pulp

from edgerun.errors import EdgerunError
from edgerun.sched.plans import TPStrategy
from edgerun.sched.profiles import ACTIVATION_BYTES, DeviceProfile, ModelProfile

TP_PLAN_SCHEMA = "edgerun.tp-plan/1"


STRATEGIES = tuple(TPStrategy)
LAYER_KINDS = ("attn", "mlp")  # unit types repeated in every layer; "vocab" (the LM head) comes once
MINMAX_EPSILON = 1e-3
ILP_TIME_LIMIT_S = 60.0


class SyncModel(Enum):
    """How the synchronizations of a token are priced."""

    PER_DEVICE = "per-device"  # HALO's Eq. (1): 2·L·(n_used − 1)·T_c, one synchronization per device and block
    STAR = "star"  # edgerun's master: per block, each device's session overhead and compute plus its own round
    # trip (a node) or its work per node used (the master, Compute.send_s_per_node each); the block lasts as its slowest


class InsufficientMemory(ValueError):
    """The devices' memory budgets cannot hold the model."""


@dataclass(frozen=True)
class UnitCounts:
    """How many units of each type every device holds: attn[l][i], mlp[l][i] and vocab[i]."""

    attn: tuple[tuple[int, ...], ...]
    mlp: tuple[tuple[int, ...], ...]
    vocab: tuple[int, ...]

    def layer_kind(self, kind: str) -> tuple[tuple[int, ...], ...]:
        return self.attn if kind == "attn" else self.mlp


@dataclass(frozen=True)
class OOMDevice:
    name: str
    needed_mb: float
    budget_mb: float


@dataclass(frozen=True)
class TPPlan:
    strategy: str
    model: str
    devices: tuple[str, ...]
    plrs: tuple[float, ...]  # each device's packet loss rate (HALO's PLR), which orders who gets important units
    # Priority indices (0 = most important) per layer and device, and per device for the LM head.
    attn: tuple[tuple[tuple[int, ...], ...], ...]
    mlp: tuple[tuple[tuple[int, ...], ...], ...]
    vocab: tuple[tuple[int, ...], ...]
    memory_bytes: tuple[float, ...]
    budget_bytes: tuple[float, ...]
    compute_s: tuple[float, ...]  # each device's own compute time per token
    t_c_s: float  # time of one synchronization (HALO's T_c), seconds
    time_per_token_s: float  # the objective: Eq. (1) with the plan's sync model
    oom_devices: tuple[OOMDevice, ...]
    solve_seconds: float
    ilp_status: str | None  # "optimal" or "time_limit" for the ILP, None for the heuristics
    sync: SyncModel = SyncModel.PER_DEVICE
    schema: str = TP_PLAN_SCHEMA

    @property
    def devices_used(self) -> int:
        """Devices given any unit (a planner may leave some out)."""
        return sum(m > 0 for m in self.memory_bytes)

    def counts(self) -> UnitCounts:
        """How many units of each type the plan gives every device (what `objective` prices)."""
        return UnitCounts(
            attn=tuple(tuple(len(s) for s in layer) for layer in self.attn),
            mlp=tuple(tuple(len(s) for s in layer) for layer in self.mlp),
            vocab=tuple(len(s) for s in self.vocab),
        )

    def to_json(self) -> dict[str, Any]:
        def nested(x: Any) -> Any:
            return [nested(v) for v in x] if isinstance(x, tuple) else x

        return {
            "schema": self.schema, "strategy": self.strategy, "model": self.model,
            "devices": list(self.devices), "plrs": list(self.plrs),
            "attn": nested(self.attn), "mlp": nested(self.mlp), "vocab": nested(self.vocab),
            "memory_bytes": list(self.memory_bytes), "budget_bytes": list(self.budget_bytes),
            "compute_s": list(self.compute_s), "t_c_s": self.t_c_s, "time_per_token_s": self.time_per_token_s,
            "oom_devices": [{"name": o.name, "needed_mb": o.needed_mb, "budget_mb": o.budget_mb}
                            for o in self.oom_devices],
            "solve_seconds": self.solve_seconds, "ilp_status": self.ilp_status, "sync": self.sync.value,
        }


def _json_numbers(data: dict[str, Any], key: str, n: int) -> tuple[float, ...]:
    values = data.get(key)
    if not isinstance(values, list) or len(values) != n or \
            not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{key} must be a list of {n} numbers")
    return tuple(float(v) for v in values)


def _json_number(data: dict[str, Any], key: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, not {value!r}")
    return float(value)


def _json_assignment(sets: Any, n: int, where: str) -> tuple[tuple[int, ...], ...]:
    """One unit type of one layer: n lists of indices that together hold 0..N-1 exactly once."""
    if not isinstance(sets, list) or len(sets) != n or not all(isinstance(s, list) for s in sets):
        raise ValueError(f"{where} must be a list of {n} lists of unit indices")
    flat = [i for s in sets for i in s]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in flat) or sorted(flat) != list(range(len(flat))):
        raise ValueError(f"{where} must assign every unit index exactly once")
    return tuple(tuple(s) for s in sets)


def tp_plan_from_json(data: Any) -> TPPlan:
    """Validate a plan document; errors name the offending field."""
    if not isinstance(data, dict):
        raise ValueError("a tensor-parallel plan must be a JSON object")
    if data.get("schema") != TP_PLAN_SCHEMA:
        raise ValueError(f"schema must be {TP_PLAN_SCHEMA!r}, not {data.get('schema')!r}")
    if data.get("strategy") not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {data.get('strategy')!r}")
    model, devices = data.get("model"), data.get("devices")
    if not isinstance(model, str):
        raise ValueError("model must be a string")
    if not isinstance(devices, list) or not devices or not all(isinstance(d, str) for d in devices):
        raise ValueError("devices must be a non-empty list of names")
    n = len(devices)
    layers = {}
    for kind in LAYER_KINDS:
        value = data.get(kind)
        if not isinstance(value, list):
            raise ValueError(f"{kind} must be a list of layers")
        layers[kind] = tuple(_json_assignment(sets, n, f"{kind}[{layer}]") for layer, sets in enumerate(value))
    if len(layers["attn"]) != len(layers["mlp"]):
        raise ValueError("attn and mlp must have the same number of layers")
    oom = data.get("oom_devices")
    if not isinstance(oom, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in oom):
        raise ValueError("oom_devices must be a list of {name, needed_mb, budget_mb} objects")
    status = data.get("ilp_status")
    if status not in (None, "optimal", "time_limit"):
        raise ValueError(f"ilp_status must be null, 'optimal' or 'time_limit', not {status!r}")
    sync = data.get("sync", SyncModel.PER_DEVICE.value)  # plans written before the field priced Eq. (1)'s way
    if sync not in [m.value for m in SyncModel]:
        raise ValueError(f"sync must be one of {', '.join(m.value for m in SyncModel)}, not {sync!r}")
    return TPPlan(
        strategy=data["strategy"], model=model, devices=tuple(devices), plrs=_json_numbers(data, "plrs", n),
        attn=layers["attn"], mlp=layers["mlp"], vocab=_json_assignment(data.get("vocab"), n, "vocab"),
        memory_bytes=_json_numbers(data, "memory_bytes", n), budget_bytes=_json_numbers(data, "budget_bytes", n),
        compute_s=_json_numbers(data, "compute_s", n), t_c_s=_json_number(data, "t_c_s"),
        time_per_token_s=_json_number(data, "time_per_token_s"),
        oom_devices=tuple(OOMDevice(o["name"], _json_number(o, "needed_mb"), _json_number(o, "budget_mb"))
                          for o in oom),
        solve_seconds=_json_number(data, "solve_seconds"), ilp_status=status, sync=SyncModel(sync),
    )


def load_plan_file(path: Path) -> TPPlan:
    """A tensor-parallel plan written by `edgerun plan --out`; a file that is missing or holds none is one line."""
    try:
        return tp_plan_from_json(json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise EdgerunError(f"plan file not found: {path}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgerunError(f"{path}: not a JSON file ({e})") from e
    except ValueError as e:
        raise EdgerunError(f"{path}: not a tensor-parallel plan ({e}; pipeline plans cannot be loaded)") from e


def plan_for_members(plan: TPPlan, master: str, nodes: list[str]) -> TPPlan:
    """A plan file (`edgerun plan --out`, made over device profiles) as the running cluster names its devices:
    the profile `master` becomes "master" and goes first, the others follow in `nodes`' order (the order they
    joined). ValueError when the plan's devices are not exactly the master and these nodes."""
    if master not in plan.devices:
        raise ValueError(f"the plan has no device named {master!r} for the master (its devices: "
                         f"{', '.join(plan.devices)})")
    wanted = [master, *nodes]
    if sorted(plan.devices) != sorted(wanted):
        missing = sorted(set(plan.devices) - set(wanted))
        extra = sorted(set(wanted) - set(plan.devices))
        raise ValueError("the plan's devices are not the cluster's: " + "; ".join(
            part for part in (f"not joined: {', '.join(missing)}" if missing else "",
                              f"not in the plan: {', '.join(extra)}" if extra else "") if part))
    order = [plan.devices.index(name) for name in wanted]

    def pick(per_device: tuple) -> tuple:
        return tuple(per_device[i] for i in order)

    return replace(plan, devices=("master", *nodes), plrs=pick(plan.plrs),
                   attn=tuple(pick(layer) for layer in plan.attn), mlp=tuple(pick(layer) for layer in plan.mlp),
                   vocab=pick(plan.vocab), memory_bytes=pick(plan.memory_bytes),
                   budget_bytes=pick(plan.budget_bytes), compute_s=pick(plan.compute_s))


def check_fits(plan: TPPlan, model: ModelProfile) -> None:
    """ValueError unless the plan places exactly this model's units (layers, KV heads, MLP groups of the
    cluster's group size, vocabulary blocks)."""
    shape = (len(plan.attn), sum(map(len, plan.attn[0])) if plan.attn else 0,
             sum(map(len, plan.mlp[0])) if plan.mlp else 0, sum(map(len, plan.vocab)))
    expected = (model.n_layers, model.n_attn_units, model.n_mlp_groups, model.n_vocab_blocks)
    if shape != expected:
        raise ValueError(f"the plan places {shape[0]} layers of {shape[1]} attention units, {shape[2]} MLP groups "
                         f"and {shape[3]} vocabulary blocks; this model at this --group-size has {expected[0]} of "
                         f"{expected[1]}, {expected[2]} and {expected[3]}")


# ---------------------------------------------------------------------------------------------
# Costs


def _n_units(model: ModelProfile, kind: str) -> int:
    return {"attn": model.n_attn_units, "mlp": model.n_mlp_groups, "vocab": model.n_vocab_blocks}[kind]


def _work(model: ModelProfile, kind: str) -> float:
    """τ_k: the weight bytes one unit streams per token."""
    return {"attn": model.attn_unit, "mlp": model.mlp_group, "vocab": model.vocab_unit}[kind].weight_bytes


def sync_seconds(device: DeviceProfile, hidden: int) -> float:
    """One synchronization with the master: a round trip plus a float32 hidden state each way
    over the slower direction of the link (HALO: D = 4096 at 1000 Mbit/s gives 0.262 ms)."""
    link = device.link
    bits = 2 * hidden * ACTIVATION_BYTES * 8
    return link.rtt_ms / 1000 + bits / (min(link.up_mbit, link.down_mbit) * 1e6)


def memory_used(counts: UnitCounts, model: ModelProfile) -> list[float]:
    """Bytes each device holds: weights plus the KV cache of its attention units."""
    n = len(counts.vocab)
    used = [counts.vocab[i] * model.unit_memory("vocab") for i in range(n)]
    for kind in LAYER_KINDS:
        mem = model.unit_memory(kind)
        for layer in counts.layer_kind(kind):
            for i in range(n):
                used[i] += layer[i] * mem
    return used


def compute_seconds(counts: UnitCounts, devices: list[DeviceProfile], model: ModelProfile) -> list[float]:
    """Each device's own compute time per token, were it never to wait for the others."""
    work = [counts.vocab[i] * _work(model, "vocab") for i in range(len(devices))]
    for kind in LAYER_KINDS:
        for layer in counts.layer_kind(kind):
            for i in range(len(devices)):
                work[i] += layer[i] * _work(model, kind)
    return [w / d.compute.weight_bytes_per_s for w, d in zip(work, devices, strict=True)]


def _used_devices(counts: UnitCounts) -> list[int]:
    layers = counts.attn + counts.mlp + (counts.vocab,)
    return [i for i in range(len(counts.vocab)) if any(layer[i] for layer in layers)]


def plan_sync_seconds(counts: UnitCounts, devices: list[DeviceProfile], model: ModelProfile) -> float:
    """T_c: every block waits for the slowest link among the devices that take part."""
    return max(sync_seconds(devices[i], model.hidden) for i in _used_devices(counts))


def star_offsets(devices: list[DeviceProfile], model: ModelProfile, used: set[int] | list[int]) -> list[float]:
    """SyncModel.STAR: what each device adds to every block beside its compute, with `used` taking part. Each
    device that computes runs a session per block (`Compute.session_overhead_ms`). The master (devices[0]) seals
    and sends each used node's input before its own share, `Compute.send_s_per_node` per node (measured by a
    running master), whether or not it computes too; a node waits for its round trip, T_c of its link."""
    nodes = sum(1 for i in used if i != 0)
    offsets = []
    for i, d in enumerate(devices):
        session = d.compute.session_overhead_ms / 1e3 if i in used else 0.0
        sync = nodes * d.compute.send_s_per_node if i == 0 else sync_seconds(d, model.hidden) if i in used else 0.0
        offsets.append(session + sync)
    return offsets


def _block_seconds(model: ModelProfile, kind: str, counts: Sequence[int], speeds: list[float], offsets: list[float],
                   used: Collection[int]) -> float:
    """How long one block of `kind` lasts: its slowest device's compute plus offset. The master and every device
    of the plan take part in each block (STAR's offsets are 0 for the rest)."""
    return max(o + _work(model, kind) * w / c
               for i, (w, c, o) in enumerate(zip(counts, speeds, offsets, strict=True)) if i == 0 or i in used or w)


def objective(plan_counts: UnitCounts, devices: list[DeviceProfile], model: ModelProfile,
              sync: SyncModel = SyncModel.PER_DEVICE) -> float:
    """Seconds per token. PER_DEVICE, Eq. (1): each block lasts as long as its slowest device, plus
    2·L·(n_used − 1) synchronizations (unlike the paper's formula the LM head's block is counted too, and n is the
    number of devices that hold any unit). STAR: each block lasts as long as its slowest device counting what that
    device does beside its compute (`star_offsets`): the master's work per node, a node's round trip; a plan that
    leaves every node out runs as one graph a token (the whole-model engine), one session's fixed cost in all."""
    speeds = [d.compute.weight_bytes_per_s for d in devices]
    used = _used_devices(plan_counts)
    if sync == SyncModel.STAR and used == [0]:
        return devices[0].compute.session_overhead_ms / 1e3 + compute_seconds(plan_counts, devices, model)[0]
    offsets = star_offsets(devices, model, used) if sync == SyncModel.STAR else [0.0] * len(devices)
    total = _block_seconds(model, "vocab", plan_counts.vocab, speeds, offsets, used)
    for kind in LAYER_KINDS:
        total += sum(_block_seconds(model, kind, c, speeds, offsets, used) for c in plan_counts.layer_kind(kind))
    if sync == SyncModel.PER_DEVICE and len(used) > 1:
        total += 2 * model.n_layers * (len(used) - 1) * plan_sync_seconds(plan_counts, devices, model)
    return total


def _check_total_memory(budgets: list[float], demand: float) -> None:
    if sum(budgets) < demand:
        missing = demand - sum(budgets)
        raise InsufficientMemory(f"the devices' memory budgets total {sum(budgets) / 1e6:.1f} MB but the model "
                                 f"needs {demand / 1e6:.1f} MB: {missing / 1e6:.1f} MB missing")


# ---------------------------------------------------------------------------------------------
# Ratios: the share of the model's memory each device holds


def greedy_ratios(budgets: list[float], speeds: list[float], demand: float) -> list[float]:
    """Algorithm 1: fill the fastest devices up to their budgets, the next fastest takes the rest."""
    _check_total_memory(budgets, demand)
    order = sorted(range(len(speeds)), key=lambda i: -speeds[i])  # stable: ties keep the given order
    shares = [0.0] * len(budgets)
    left = demand
    for i in order:
        shares[i] = min(budgets[i], left)
        left -= shares[i]
        if left <= 0:
            break
    return [s / sum(shares) for s in shares]


def minmax_threshold(budgets: list[float], speeds: list[float], demand: float,
                     epsilon: float = MINMAX_EPSILON) -> float:
    """Algorithm 2's SearchThreshold: the least T at which devices filled to min(m_i, T·c_i) hold
    the model. T is a time (memory bytes over weight bytes per second).

    The paper's ε = 1e-3 is an absolute width in T's units: too coarse or too fine depending on them,
    and once it is below the spacing of floats near T the loop never ends. Here ε is relative to
    demand / Σc, the time if memory were unlimited, a lower bound on the optimal T: the returned T is
    feasible and within a factor 1 + ε of the optimum, whatever the units."""
    _check_total_memory(budgets, demand)
    left, right = 0.0, max(budgets) / min(speeds)
    best = right
    tolerance = epsilon * demand / sum(speeds)
    while right - left > tolerance:
        mid = (left + right) / 2
        if sum(min(m, mid * c) for m, c in zip(budgets, speeds, strict=True)) >= demand:
            best = right = mid
        else:
            left = mid
    return best


def minmax_ratios(budgets: list[float], speeds: list[float], demand: float,
                  epsilon: float = MINMAX_EPSILON) -> list[float]:
    """Algorithm 2: shares proportional to speed, capped by memory, at the min-max threshold."""
    threshold = minmax_threshold(budgets, speeds, demand, epsilon)
    shares = [min(m, threshold * c) for m, c in zip(budgets, speeds, strict=True)]
    return [s / sum(shares) for s in shares]


def galaxy_ratios(budgets: list[float], speeds: list[float], demand: float) -> list[float]:
    """Galaxy-style memory-aware split (HALO Fig. 3(b)): shares proportional to speed; a device
    whose share exceeds its budget is capped, and the excess goes to the others in proportion to
    their free memory, whatever their speed. One pass suffices: the excess is at most the total
    free memory (budgets cover the demand), so no device receives more than its own free memory."""
    _check_total_memory(budgets, demand)
    shares = [demand * c / sum(speeds) for c in speeds]
    excess = sum(max(s - m, 0.0) for s, m in zip(shares, budgets, strict=True))
    free = [max(m - s, 0.0) for s, m in zip(shares, budgets, strict=True)]
    if excess > 0:
        shares = [min(s, m) + excess * f / sum(free) for s, m, f in zip(shares, budgets, free, strict=True)]
    return [s / demand for s in shares]


# ---------------------------------------------------------------------------------------------
# Ratios to integer counts


def partition_counts(n_units: int, ratios: list[float]) -> list[int]:
    """Largest-remainder split of n_units in proportion to ratios (ties: lower index): every count
    is the floor or the ceiling of its exact share, so within one unit of it."""
    total = sum(Fraction(r) for r in ratios)
    shares = [Fraction(r) / total * n_units for r in ratios]
    counts = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(ratios)), key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[:n_units - sum(counts)]:
        counts[i] += 1
    return counts


def _wrap_around(totals: list[int], n_layers: int) -> tuple[tuple[int, ...], ...]:
    """Spread each device's total over the layers (McNaughton's wrap-around): lay the devices'
    units end to end and deal position p to layer p mod L. Every layer receives the same number of
    units, and a device receives ⌊T_i/L⌋ or ⌈T_i/L⌉ in each layer, its extra units in consecutive
    layers right after the previous device's, so the layers share the devices' extra units evenly."""
    rows = [[total // n_layers for total in totals] for _ in range(n_layers)]
    position = 0
    for i, total in enumerate(totals):
        for j in range(total % n_layers):
            rows[(position + j) % n_layers][i] += 1
        position += total
    return tuple(map(tuple, rows))


def ratio_counts(ratios: list[float], model: ModelProfile) -> UnitCounts:
    """Integer counts per layer for every unit type: each device's total over all layers is the
    largest-remainder share of L·N_k, so within one unit of r_i·L·N_k, dealt out over the layers
    by wrap-around.

    Error diffusion (largest remainder of r_i·N_k plus the carried error, layer by layer) cannot
    promise that: it assigns cumulatively the largest-remainder rounding of r_i·N_k·l, which is not
    monotone in l (Hamilton's method and its Alabama paradox), so a device can be owed −1 units in
    a layer; with shares ∝ (2, 42, 35) and N_k = 1 that happens at the 20th layer."""
    per_kind = [_wrap_around(partition_counts(model.n_layers * _n_units(model, kind), ratios), model.n_layers)
                for kind in LAYER_KINDS]
    return UnitCounts(per_kind[0], per_kind[1], tuple(partition_counts(model.n_vocab_blocks, ratios)))


def repair_memory(counts: UnitCounts, budgets: list[float], names: list[str], model: ModelProfile) -> UnitCounts:
    """Move units off devices over budget, one at a time, until every device fits.

    The device most over budget gives up the smallest unit type that alone clears its excess (or,
    when none does, its largest), taken from the layer where the receiver holds fewest units of that
    type so the receiver's per-layer time grows least. The receiver is the device with the most free
    memory that can take the unit. Every move takes at least min(unit, excess) off the total excess
    and never overfills the receiver, so the loop ends."""
    n = len(budgets)
    layers = {kind: [list(layer) for layer in counts.layer_kind(kind)] for kind in LAYER_KINDS}
    vocab = list(counts.vocab)
    mem = {kind: model.unit_memory(kind) for kind in (*LAYER_KINDS, "vocab")}
    used = memory_used(counts, model)

    def held(kind: str, i: int) -> int:
        return vocab[i] if kind == "vocab" else sum(layer[i] for layer in layers[kind])

    while True:
        over = [i for i in range(n) if used[i] > budgets[i]]
        if not over:
            return UnitCounts(tuple(map(tuple, layers["attn"])), tuple(map(tuple, layers["mlp"])), tuple(vocab))
        donor = max(over, key=lambda i: (used[i] - budgets[i], -i))
        excess = used[donor] - budgets[donor]
        kinds = [k for k in mem if mem[k] > 0 and held(k, donor)]
        clearing = sorted((k for k in kinds if mem[k] >= excess), key=lambda k: mem[k])
        preference = clearing + sorted((k for k in kinds if mem[k] < excess), key=lambda k: -mem[k])
        for kind in preference:
            takers = [j for j in range(n) if j != donor and budgets[j] - used[j] >= mem[kind]]
            if not takers:
                continue
            receiver = max(takers, key=lambda j: (budgets[j] - used[j], -j))
            if kind == "vocab":
                vocab[donor] -= 1
                vocab[receiver] += 1
            else:
                rows = [layer for layer in layers[kind] if layer[donor] > 0]
                row = min(rows, key=lambda layer: layer[receiver])  # min keeps the first (lowest) layer on ties
                row[donor] -= 1
                row[receiver] += 1
            used[donor] -= mem[kind]
            used[receiver] += mem[kind]
            break
        else:
            raise InsufficientMemory(f"the units do not pack into the memory budgets: {names[donor]} is "
                                     f"{excess / 1e6:.1f} MB over its budget and no other device has room for "
                                     f"any of its units")


# ---------------------------------------------------------------------------------------------
# The exact integer program of Eq. (1)
#
# Written directly in W[l,i,k], Eq. (1) has L! equivalent copies of every solution (the layers are
# identical and memory only counts their sum), and its LP relaxation lets a slow device hold a
# fraction of a unit in every layer at almost no cost: on 8 devices × 32 layers CBC does not close
# the gap in a minute. The program below is Eq. (1) with the layer symmetry quotiented out; it
# solves such instances to proven optimality in seconds:
#
#   levels: a block's time max_i τ_k·W_i/c_i is always one of the values τ_k·w/c_i (w = 1..N_k).
#     At level T, device i may hold cap_i(T) = #{w ≤ N_k : τ_k·w/c_i ≤ T} units.
#   y[k,T]  integer: how many layers run their type-k block at level T (Σ_T y = L; 1 for vocab).
#   X[k,i]  integer: how many type-k units device i holds over all layers (Σ_i X = L·N_k).
#   z_i     binary: device i holds something; X[k,i] ≤ L·N_k·z_i.
#   minimize Σ_{k,T} T·y[k,T] + comm, with memory Σ_k mem_k·X[k,i] ≤ m_i, and for every set S of
#   devices: Σ_{i∈S} X[k,i] ≤ Σ_T y[k,T]·min(N_k, Σ_{i∈S} cap_i(T))   (Gale's condition).
#
# Equivalence. A plan W gives y (each block at the level of its own time) and X (column sums), at
# the same cost, and satisfies Gale's condition layer by layer. Conversely, by max-flow/min-cut
# (Gale's supply-demand theorem) the condition is exactly what makes integer per-layer counts exist
# with row sums N_k, column sums X and W[l,i] ≤ cap_i(level of l), so each block runs no slower than
# its level. The optima coincide. Gale's condition has 2^n sets: it is added lazily, from the min cut
# of the failed split, and the program solved again, until the solution splits into layers.


def _split_layers(caps: list[list[int]], totals: list[int], n_units: int) -> tuple[list[list[int]] | None, list[int]]:
    """Per-layer counts with row sums n_units, column sums totals and W[l][i] ≤ caps[l][i], by
    max flow (source → layer → device → sink). Returns (counts, []) or, when none exist, (None, S)
    with S the devices on the sink side of the min cut: the set whose Gale condition fails."""
    n_layers, n = len(caps), len(totals)
    source, sink = n_layers + n, n_layers + n + 1
    residual: dict[int, dict[int, int]] = {node: {} for node in range(sink + 1)}

    def edge(a: int, b: int, capacity: int) -> None:
        residual[a][b] = capacity
        residual[b].setdefault(a, 0)

    for layer, row in enumerate(caps):
        edge(source, layer, n_units)
        for i in range(n):
            edge(layer, n_layers + i, row[i])
    for i in range(n):
        edge(n_layers + i, sink, totals[i])
    while True:  # Edmonds–Karp: shortest augmenting paths
        parent = {source: source}
        queue = [source]
        for a in queue:
            for b, capacity in residual[a].items():
                if capacity > 0 and b not in parent:
                    parent[b] = a
                    queue.append(b)
        if sink not in parent:
            break
        path = [sink]
        while path[-1] != source:
            path.append(parent[path[-1]])
        pairs = list(zip(path[1:], path[:-1], strict=True))
        push = min(residual[a][b] for a, b in pairs)
        for a, b in pairs:
            residual[a][b] -= push
            residual[b][a] += push
    if sum(residual[n_layers + i][sink] for i in range(n)) > 0:
        return None, [i for i in range(n) if n_layers + i not in parent]
    return [[residual[n_layers + i][layer] for i in range(n)] for layer in range(n_layers)], []


def ilp_counts(model: ModelProfile, devices: list[DeviceProfile], upper_bound: float | None = None,
               time_limit_s: float = ILP_TIME_LIMIT_S, sync: SyncModel = SyncModel.PER_DEVICE,
               incumbent: UnitCounts | None = None) -> tuple[UnitCounts, str]:
    """Solve Eq. (1) exactly with CBC (the program above); returns the counts and "optimal" or
    "time_limit" (the best plan found when the time ran out).

    Times are scaled by the time the whole model would take on all devices at once, and memory by
    the largest unit, so the solver's absolute tolerances (1e-7) are negligible.

    The communication term uses T_c of the slowest link among the devices actually used, as
    `objective` does, not a constant over all devices: with a constant, a plan that leaves out a
    badly connected device would be over-charged and the solver could return something worse than
    a heuristic. 2L·(Σz − 1)·max_{used} T_c stays linear with one big-M constraint per device.
    SyncModel.STAR's plans come from `_star_ilp_counts`.

    upper_bound (seconds per token), when given, is a cut: the objective may not exceed it. It
    prunes the search without fixing any variable. `incumbent`, the plan that gave it, starts SyncModel.STAR's
    search (whose program has a variable per block and device, too many to find a first plan fast)."""
    if sync == SyncModel.STAR:
        return _star_ilp_counts(model, devices, upper_bound, time_limit_s, incumbent)
    n = len(devices)
    speeds = [d.compute.weight_bytes_per_s for d in devices]
    blocks = {"attn": model.n_layers, "mlp": model.n_layers, "vocab": 1}  # blocks of each type per token
    kinds = [k for k in blocks if blocks[k] and _n_units(model, k)]
    unit_mem = {k: model.unit_memory(k) for k in kinds}
    mem_scale = max(unit_mem.values()) or 1.0
    time_scale = sum(blocks[k] * _n_units(model, k) * _work(model, k) for k in kinds) / sum(speeds) or 1.0

    prob = pulp.LpProblem("tp_plan", pulp.LpMinimize)
    use = [prob.add_variable(f"z_{i}", cat=pulp.LpBinary) for i in range(n)]
    levels: dict[str, list[tuple[float, list[int]]]] = {}
    layers_at: dict[str, list[pulp.LpVariable]] = {}
    held: dict[str, list[pulp.LpVariable]] = {}
    block_time = []
    for kind in kinds:
        n_units, count = _n_units(model, kind), blocks[kind]
        times = [[_work(model, kind) * w / c for w in range(1, n_units + 1)] for c in speeds]
        levels[kind] = []
        for t in sorted({t for row in times for t in row}):
            caps = [bisect.bisect_right(row, t) for row in times]
            # Keep the levels that can hold a block, each the fastest with its capacities.
            if sum(caps) >= n_units and (not levels[kind] or caps != levels[kind][-1][1]):
                levels[kind].append((t, caps))
        layers_at[kind] = [prob.add_variable(f"y_{kind}_{v}", 0, count, pulp.LpInteger)
                           for v in range(len(levels[kind]))]
        held[kind] = [prob.add_variable(f"x_{kind}_{i}", 0, count * n_units, pulp.LpInteger) for i in range(n)]
        prob.addConstraint(pulp.lpSum(layers_at[kind]) == count)
        prob.addConstraint(pulp.lpSum(held[kind]) == count * n_units)
        for i in range(n):
            prob.addConstraint(held[kind][i] <= count * n_units * use[i])
            _add_gale(prob, [i], levels[kind], layers_at[kind], held[kind], n_units)
        block_time.append(pulp.lpSum(t / time_scale * y for (t, _), y in zip(levels[kind], layers_at[kind],
                                                                              strict=True)))
    for i in range(n):
        prob.addConstraint(pulp.lpSum(unit_mem[k] / mem_scale * held[k][i] for k in kinds)
                           <= devices[i].budget_bytes / mem_scale)

    # comm ≥ 2L·T_i·(Σz − 1) for every used device i; for an unused one the constraint is relaxed by
    # 2L·T_i·(n − 1), which makes its right side 2L·T_i·(Σz − n) ≤ 0.
    comm = prob.add_variable("comm", 0)
    for i in range(n):
        t_i = sync_seconds(devices[i], model.hidden) / time_scale
        prob.addConstraint(comm >= 2 * model.n_layers * t_i * (pulp.lpSum(use) - 1 - (n - 1) * (1 - use[i])))
    total = pulp.lpSum(block_time) + comm
    prob.setObjective(total)
    if upper_bound is not None:
        prob.addConstraint(total <= upper_bound / time_scale * (1 + 1e-7))

    deadline = time.monotonic() + time_limit_s
    while True:
        left = deadline - time.monotonic()
        prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=max(left, 1.0)))
        if prob.status == pulp.LpStatusInfeasible:
            raise InsufficientMemory("the units do not pack into the devices' memory budgets")
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            raise RuntimeError(f"the ILP found no plan within {time_limit_s:g} s; try the min-max planner")
        split: dict[str, list[list[int]]] = {}
        for kind in kinds:
            caps = [c for (_, c), y in zip(levels[kind], layers_at[kind], strict=True) for _ in range(round(y.value()))]
            rows, short = _split_layers(caps, [round(x.value()) for x in held[kind]], _n_units(model, kind))
            if rows is None:
                _add_gale(prob, short, levels[kind], layers_at[kind], held[kind], _n_units(model, kind))
            else:
                split[kind] = rows
        if len(split) == len(kinds):
            break
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the ILP found no plan within {time_limit_s:g} s; try the min-max planner")

    def rows(kind: str, count: int) -> list[tuple[int, ...]]:
        return [tuple(r) for r in split[kind]] if kind in split else [(0,) * n] * count

    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time_limit"
    return UnitCounts(tuple(rows("attn", model.n_layers)), tuple(rows("mlp", model.n_layers)),
                      rows("vocab", 1)[0]), status


def _star_ilp_counts(model: ModelProfile, devices: list[DeviceProfile], upper_bound: float | None,
                     time_limit_s: float, incumbent: UnitCounts | None) -> tuple[UnitCounts, str]:
    """`objective` under SyncModel.STAR, exactly: a device's time in a block is its offset plus its compute, and the
    master's offset grows with the devices used, so every block gets its own variables (no levels shared by the
    layers as in Eq. (1)'s program). z_i: device i takes part. For a node, t_b ≥ (s_i + T_i)·z_i + τ·x_bi / c_i;
    for the master, t_b ≥ s_0·z_0 + δ·Σ_{i≥1} z_i + τ·x_b0 / c_0 (s: a device's session overhead per block)."""
    n = len(devices)
    speeds = [d.compute.weight_bytes_per_s for d in devices]
    kinds = ["vocab"] + [k for k in LAYER_KINDS for _ in range(model.n_layers)]  # one entry per block
    kinds = [k for k in kinds if _n_units(model, k)]
    time_scale = sum(_n_units(model, k) * _work(model, k) for k in kinds) / sum(speeds) or 1.0
    mem_scale = max(model.unit_memory(k) for k in kinds) or 1.0

    prob = pulp.LpProblem("tp_plan_star", pulp.LpMinimize)
    use = [prob.add_variable(f"z_{i}", cat=pulp.LpBinary) for i in range(n)]
    x = [[prob.add_variable(f"x_{b}_{i}", 0, _n_units(model, k), pulp.LpInteger) for i in range(n)]
         for b, k in enumerate(kinds)]
    t = [prob.add_variable(f"t_{b}", 0) for b in range(len(kinds))]
    for b, k in enumerate(kinds):
        prob.addConstraint(pulp.lpSum(x[b]) == _n_units(model, k))
        for i in range(n):
            prob.addConstraint(x[b][i] <= _n_units(model, k) * use[i])
            compute = _work(model, k) / speeds[i] / time_scale * x[b][i] + \
                devices[i].compute.session_overhead_ms / 1e3 / time_scale * use[i]
            if i == 0:
                prob.addConstraint(t[b] >= compute + devices[0].compute.send_s_per_node / time_scale *
                                   pulp.lpSum(use[1:]))
            else:
                prob.addConstraint(t[b] >= compute + sync_seconds(devices[i], model.hidden) / time_scale * use[i])
    for i in range(n):
        prob.addConstraint(pulp.lpSum(model.unit_memory(k) / mem_scale * x[b][i] for b, k in enumerate(kinds))
                           <= devices[i].budget_bytes / mem_scale)
    total = pulp.lpSum(t)
    prob.setObjective(total)
    if upper_bound is not None:
        prob.addConstraint(total <= upper_bound / time_scale * (1 + 1e-6))
    if incumbent is not None:  # CBC starts from it: the search has a plan at once and only looks for better
        rows = [incumbent.vocab] * bool(_n_units(model, "vocab")) + \
            [r for k in LAYER_KINDS if _n_units(model, k) for r in incumbent.layer_kind(k)]
        used = set(_used_devices(incumbent))
        offsets = star_offsets(devices, model, used)
        for i in range(n):
            use[i].setInitialValue(int(i in used))
        for b, (row, k) in enumerate(zip(rows, kinds, strict=True)):
            for i in range(n):
                x[b][i].setInitialValue(row[i])
            t[b].setInitialValue(_block_seconds(model, k, row, speeds, offsets, used) / time_scale)
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=max(time_limit_s, 1.0), warmStart=incumbent is not None))
    if prob.status == pulp.LpStatusInfeasible:
        raise InsufficientMemory("the units do not pack into the devices' memory budgets")
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise RuntimeError(f"the ILP found no plan within {time_limit_s:g} s; try the min-max planner")
    rows = [tuple(round(v.value()) for v in row) for row in x]
    vocab = rows[0] if _n_units(model, "vocab") else (0,) * n
    layer_rows = rows[1:] if _n_units(model, "vocab") else rows
    per_kind = {}
    for k in LAYER_KINDS:
        if _n_units(model, k):
            per_kind[k], layer_rows = tuple(layer_rows[:model.n_layers]), layer_rows[model.n_layers:]
        else:
            per_kind[k] = ((0,) * n,) * model.n_layers
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time_limit"
    return UnitCounts(per_kind["attn"], per_kind["mlp"], vocab), status


def _add_gale(prob: pulp.LpProblem, subset: list[int], levels: list[tuple[float, list[int]]],
              layers_at: list[pulp.LpVariable], held: list[pulp.LpVariable], n_units: int) -> None:
    """Gale's condition for one set of devices: together they hold no more than their capacities."""
    capacity = pulp.lpSum(min(n_units, sum(caps[i] for i in subset)) * y
                          for (_, caps), y in zip(levels, layers_at, strict=True))
    prob.addConstraint(pulp.lpSum(held[i] for i in subset) <= capacity)


# ---------------------------------------------------------------------------------------------
# Algorithm 3 and the planner


def plr_mapping(counts: list[int], plrs: list[float]) -> list[list[int]]:
    """Algorithm 3: priority indices 0..N−1 (0 the most important) split into consecutive blocks,
    the first block to the device with the lowest packet-loss rate (ties: the given order)."""
    order = sorted(range(len(plrs)), key=lambda i: plrs[i])
    mapping: list[list[int]] = [[] for _ in counts]
    start = 0
    for i in order:
        mapping[i] = list(range(start, start + counts[i]))
        start += counts[i]
    return mapping


def refine_counts(counts: UnitCounts, model: ModelProfile, devices: list[DeviceProfile],
                  sync: SyncModel = SyncModel.PER_DEVICE) -> UnitCounts:
    """Local search from a plan that fits in memory, lowering Eq. (1) with every step it takes: a unit moves
    from a block's slowest device to the device that would finish the block soonest with it, where memory
    allows (HALO's ratios give every block the same split, though units are whole and memory is shared by all
    blocks); then a device leaves the plan, its units spread the same way, when its synchronizations cost more
    than its compute saves. devices[0] coordinates (the master) and stays: its share costs no synchronization."""
    n = len(devices)
    speeds = [d.compute.weight_bytes_per_s for d in devices]
    budgets = [d.budget_bytes for d in devices]
    offsets = [0.0] * n  # what each device adds to a block beside its compute (SyncModel.STAR), for `allowed`

    def finish(i: int, count: int, tau: float) -> float:
        """When device i ends a block holding `count` units of work τ each."""
        return offsets[i] + tau * count / speeds[i]

    def balance(blocks: list[tuple[str, list[int]]], allowed: set[int], free: list[float]) -> bool:
        """Move units block by block until no move shortens a block; False if a unit could not be placed."""
        for kind, c in blocks:
            mem = model.unit_memory(kind)
            tau = _work(model, kind)
            for i in range(n):  # devices leaving the plan hand their units on first
                while c[i] and i not in allowed:
                    takers = [j for j in allowed if free[j] >= mem]
                    if not takers:
                        return False
                    j = min(takers, key=lambda j: finish(j, c[j] + 1, tau))
                    c[i], c[j], free[i], free[j] = c[i] - 1, c[j] + 1, free[i] + mem, free[j] - mem
            while c[a := max(allowed, key=lambda i: finish(i, c[i], tau))]:
                # Devices that would finish this block sooner than its slowest one does now, soonest first.
                sooner = finish(a, c[a], tau) * (1 - 1e-12)
                takers = sorted((j for j in allowed if j != a and finish(j, c[j] + 1, tau) < sooner),
                                key=lambda j: finish(j, c[j] + 1, tau))
                j = next((j for j in takers if free[j] >= mem or make_room(blocks, c, allowed, free, j, mem)), None)
                if j is None:
                    break
                c[a], c[j], free[a], free[j] = c[a] - 1, c[j] + 1, free[a] + mem, free[j] - mem
        return True

    def make_room(blocks: list[tuple[str, list[int]]], current: list[int], allowed: set[int], free: list[float],
                  j: int, needed: float) -> bool:
        """Free `needed` bytes on device j by moving its units of other blocks to devices with memory to spare,
        where that does not make those blocks any slower (a memory-rich slow device takes attention units, say,
        so that a fast one with little memory can take MLP groups)."""
        for kind, c in blocks:
            if c is current:
                continue
            mem, tau = model.unit_memory(kind), _work(model, kind)
            slowest = max(finish(i, c[i], tau) for i in allowed)
            while c[j] and free[j] < needed:
                spare = [m for m in allowed if m != j and free[m] >= mem and finish(m, c[m] + 1, tau) <= slowest]
                if not spare:
                    break
                m = min(spare, key=lambda m: finish(m, c[m] + 1, tau))
                c[j], c[m], free[j], free[m] = c[j] - 1, c[m] + 1, free[j] + mem, free[m] - mem
            if free[j] >= needed:
                return True
        return False

    def solve(allowed: set[int]) -> UnitCounts | None:
        if sync == SyncModel.STAR:
            offsets[:] = star_offsets(devices, model, allowed)
        blocks = [("vocab", list(counts.vocab))] + [(kind, list(layer)) for kind in LAYER_KINDS
                                                    for layer in counts.layer_kind(kind)]
        free = [b - u for b, u in zip(budgets, memory_used(counts, model), strict=True)]
        if not balance(blocks, allowed, free):
            return None
        vocab = tuple(blocks[0][1])
        rows = [tuple(c) for _, c in blocks[1:]]
        return UnitCounts(attn=tuple(rows[:model.n_layers]), mlp=tuple(rows[model.n_layers:]), vocab=vocab)

    best = solve(set(_used_devices(counts))) or counts
    best_time = objective(best, devices, model, sync)
    while len(used := _used_devices(best)) > 1:
        trials = [(objective(t, devices, model, sync), t) for d in used if d != 0 and (t := solve(set(used) - {d}))]
        if not trials or min(trials, key=lambda x: x[0])[0] >= best_time:
            break
        best_time, best = min(trials, key=lambda x: x[0])
        counts = best
    return best


def _or_alone(counts: UnitCounts, model: ModelProfile, devices: list[DeviceProfile]) -> UnitCounts:
    """`counts`, or every unit on the master where it holds them all and is predicted faster so (SyncModel.STAR): its
    one graph a token can beat a split whose synchronizations cost more than the compute they spread (a small
    model), which a search over per-block times does not see."""
    n = len(devices)
    alone = UnitCounts(attn=((model.n_attn_units,) + (0,) * (n - 1),) * model.n_layers,
                       mlp=((model.n_mlp_groups,) + (0,) * (n - 1),) * model.n_layers,
                       vocab=(model.n_vocab_blocks,) + (0,) * (n - 1))
    if memory_used(alone, model)[0] > devices[0].budget_bytes or alone == counts:
        return counts
    star = SyncModel.STAR
    return alone if objective(alone, devices, model, star) < objective(counts, devices, model, star) else counts


def _heuristic_counts(strategy: str, model: ModelProfile, devices: list[DeviceProfile],
                      sync: SyncModel = SyncModel.PER_DEVICE) -> UnitCounts:
    budgets = [d.budget_bytes for d in devices]
    speeds = [d.compute.weight_bytes_per_s for d in devices]
    demand = model.total_tp_memory()
    if strategy == "even":  # vanilla TP ignores memory: the plan reports the devices it overfills
        return ratio_counts([1.0] * len(devices), model)
    ratios = {"halo": minmax_ratios, "minmax": minmax_ratios, "greedy": greedy_ratios,
              "galaxy": galaxy_ratios}[strategy](budgets, speeds, demand)
    counts = repair_memory(ratio_counts(ratios, model), budgets, [d.name for d in devices], model)
    return refine_counts(counts, model, devices, sync) if strategy == "halo" else counts


def plan_tp(model: ModelProfile, devices: list[DeviceProfile], strategy: str,
            ilp_time_limit_s: float = ILP_TIME_LIMIT_S, sync: SyncModel = SyncModel.PER_DEVICE) -> TPPlan:
    """Plan tensor parallelism for `model` over `devices` with one of STRATEGIES, pricing synchronizations as
    `sync` says (the paper's Eq. (1) by default; edgerun's master plans with SyncModel.STAR). devices[0] is the
    master where that matters (halo's local search keeps it)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    if not devices:
        raise ValueError("a tensor-parallel plan needs at least one device")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"device names must be unique: {', '.join(names)}")
    if any(d.compute.weight_bytes_per_s <= 0 for d in devices):
        raise ValueError("every device needs a positive compute.weight_bytes_per_s")
    if model.n_layers < 1 or model.total_tp_memory() <= 0:
        raise ValueError(f"model {model.name} has no layers or no units to place")
    _check_total_memory([d.budget_bytes for d in devices], model.total_tp_memory())

    start = time.perf_counter()
    status = None
    if strategy == "ilp":
        bound, incumbent = None, None
        for heuristic in ("greedy", "minmax", "galaxy", "even", "halo"):
            try:
                candidate = _heuristic_counts(heuristic, model, devices, sync)
            except InsufficientMemory:  # its repair could not pack the units; the ILP may still
                continue
            # A candidate on the master alone is priced as one graph a token (objective), which the ILP's per-block
            # model cannot reach: no bound for it (_or_alone weighs it after the solve).
            alone = sync == SyncModel.STAR and _used_devices(candidate) == [0]
            if not alone and all(u <= d.budget_bytes for u, d in
                                 zip(memory_used(candidate, model), devices, strict=True)):
                value = objective(candidate, devices, model, sync)
                if bound is None or value < bound:
                    bound, incumbent = value, candidate
        start = time.perf_counter()  # the solve alone, not the heuristics that give its bound
        counts, status = ilp_counts(model, devices, bound, ilp_time_limit_s, sync, incumbent)
    else:
        counts = _heuristic_counts(strategy, model, devices, sync)
    if strategy in ("halo", "ilp") and sync == SyncModel.STAR:
        counts = _or_alone(counts, model, devices)
    solve_seconds = time.perf_counter() - start

    plrs = [float(d.link.loss_rate) for d in devices]
    used = memory_used(counts, model)
    oom = tuple(OOMDevice(d.name, u / 1e6, float(d.memory.budget_mb))
                for d, u in zip(devices, used, strict=True) if u > d.budget_bytes)

    def mapped(kind: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return tuple(tuple(tuple(s) for s in plr_mapping(list(layer), plrs)) for layer in counts.layer_kind(kind))

    return TPPlan(
        strategy=strategy, model=model.name, devices=tuple(names), plrs=tuple(plrs),
        attn=mapped("attn"), mlp=mapped("mlp"),
        vocab=tuple(tuple(s) for s in plr_mapping(list(counts.vocab), plrs)),
        memory_bytes=tuple(used), budget_bytes=tuple(d.budget_bytes for d in devices),
        compute_s=tuple(compute_seconds(counts, devices, model)),
        t_c_s=plan_sync_seconds(counts, devices, model), time_per_token_s=objective(counts, devices, model, sync),
        oom_devices=oom, solve_seconds=solve_seconds, ilp_status=status, sync=sync,
    )


# A split tried and found slower than the one it replaced: its devices and counts (never planned again).
Rejected = tuple[tuple[str, ...], UnitCounts]


def rebalanced(plan: TPPlan, devices: list[DeviceProfile], model: ModelProfile, strategy: str,
               rejected: Collection[Rejected] = (), min_gain: float = 0.05) -> tuple[float, TPPlan] | None:
    """A rebalance's decision: the plan over `devices` (priced at the speeds they showed) where it is predicted at
    least `min_gain` faster than `plan`'s split at the same speeds, fits in memory and was not tried and rejected
    before; with `plan`'s predicted seconds per token. None: keep `plan`."""
    now = objective(plan.counts(), devices, model, SyncModel.STAR)
    try:
        better = plan_tp(model, devices, strategy, sync=SyncModel.STAR)
    except ValueError:
        return None
    if better.oom_devices or better.time_per_token_s > (1 - min_gain) * now or \
            (better.devices, better.counts()) in rejected:
        return None
    return now, better
