"""Tests for edgerun.sched.pp_plan: optimality against brute force, the cost model's figures, the order search,
acceptance, shadow plans and the JSON form."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.sched.pp_plan import (
    CostParams,
    CostTriple,
    Layers,
    Pricing,
    SearchParams,
    Stage,
    Worker,
    accept,
    anneal_search,
    assign_in_order,
    choose_method,
    cover_stages,
    exec_cost_us,
    init_cost,
    layer_costs,
    layers_from_model,
    plan_exec_us,
    plan_layers,
    plan_pp,
    pp_plan_from_json,
    random_search,
    replacement_plan,
    rho,
    shadow_plan,
    stage_parts,
    workers_from_devices,
)
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, ModelProfile, UnitCost

EXEC_ONLY = CostParams(include_init=False)


def device(name: str, budget_mb: float, *, bytes_per_s: float = 1e9, so_ms: float = 0.2, rtt_ms: float = 2.0,
           up_mbit: float = 80.0, down_mbit: float = 160.0) -> DeviceProfile:
    return DeviceProfile(name=name, kind="x86", cores=4, compute=Compute(10.0, bytes_per_s, so_ms),
                         memory=Memory(budget_mb, budget_mb, budget_mb, 10.0),
                         link=Link(rtt_ms, up_mbit, down_mbit, 0.0))


def model(weights: list[float], *, kv_per_layer: float = 0.0, context: int = 1, activation: float = 4096.0,
          name: str = "test-model") -> ModelProfile:
    unit = UnitCost(1.0, 1.0)
    return ModelProfile(name=name, n_layers=len(weights), hidden=1024, context=context, n_attn_units=1,
                        n_mlp_groups=1, n_vocab_blocks=1, group_size=1, vocab_block=1, attn_unit=unit, mlp_group=unit,
                        vocab_unit=unit, layer_weight_bytes=tuple(weights), layer_read_bytes=tuple(weights),
                        layer_flops=tuple(weights),
                        kv_bytes_per_token_per_layer=kv_per_layer, activation_bytes_per_token=activation)


# --- brute force, written without the planner's prefix sums, tables or DP ---------------------------------------

def brute_exec(layers: Layers, w: Worker, x: int, i: int) -> float:
    if sum(layers.memory[x:i]) > w.memory_bytes:
        return math.inf
    compute = w.session_overhead_us + sum(layers.cost[x:i]) / w.speed
    return compute + 500.0 + w.latency_us + (layers.input[x] + layers.output[i - 1]) / w.bandwidth


def brute_init_blocking(layers: Layers, w: Worker, x: int, i: int) -> float:
    missing = sum(layers.weight[k] for k in range(x, i) if k not in w.cached)
    return (1e6 + missing / w.bandwidth) ** 0.9


def cuts(q: int, k: int):
    """Every way to split layers [0, q) into k non-empty contiguous ranges, as boundary tuples (0, ..., q)."""
    for inner in itertools.combinations(range(1, q), k - 1):
        yield (0, *inner, q)


def brute_best(layers: Layers, workers: list[Worker], objective: str, order: list[int] | None = None,
               with_init: bool = False) -> tuple[int, float]:
    """(deepest coverable layer q, cheapest cost of covering [0, q)) over every partition of [0, q) into at most m
    ranges and every assignment of distinct workers, in any order or, with `order`, keeping that order."""
    m = len(workers)
    for q in range(layers.n, 0, -1):
        best = math.inf
        for k in range(1, min(m, q) + 1):
            picks = itertools.combinations(order, k) if order is not None else itertools.permutations(range(m), k)
            for chosen in picks:
                for b in cuts(q, k):
                    costs = [brute_exec(layers, workers[w], b[s], b[s + 1]) for s, w in enumerate(chosen)]
                    if any(c == math.inf for c in costs):
                        continue
                    cost = sum(costs) if objective == "sum" else max(costs)
                    if with_init:
                        cost += sum(brute_init_blocking(layers, workers[w], b[s], b[s + 1])
                                    for s, w in enumerate(chosen))
                    best = min(best, cost)
        if best < math.inf:
            return q, best
    return 0, 0.0


def covered(stages) -> int:
    return stages[-1].end_layer if stages else 0


def check_memory(layers: Layers, workers: list[Worker], stages) -> None:
    by_name = {w.name: w for w in workers}
    assert len({s.worker for s in stages}) == len(stages)
    end = 0
    for s in stages:
        assert s.first_layer == end < s.end_layer  # contiguous, non-empty, from layer 0
        assert sum(layers.memory[s.first_layer:s.end_layer]) <= by_name[s.worker].memory_bytes
        end = s.end_layer


@st.composite
def instances(draw, max_layers: int = 6, max_workers: int = 4):
    n = draw(st.integers(1, max_layers))
    m = draw(st.integers(2, max_workers))
    ints = lambda lo, hi: st.lists(st.integers(lo, hi), min_size=n, max_size=n)  # noqa: E731
    weight = draw(ints(1, 1000))
    layers = Layers(cost=tuple(float(c) * 1e3 for c in draw(ints(1, 1000))), weight=tuple(w * 1e3 for w in weight),
                    memory=tuple(float(r) for r in draw(ints(1, 100))),
                    input=tuple(float(v) for v in draw(ints(1, 5000))),
                    output=tuple(float(v) for v in draw(ints(1, 5000))))
    workers = [Worker(name=f"w{k}", memory_bytes=float(draw(st.integers(0, 300))),
                      session_overhead_us=float(draw(st.integers(0, 2000))),
                      speed=float(draw(st.integers(1, 100))), bandwidth=float(draw(st.integers(1, 100))),
                      latency_us=float(draw(st.integers(0, 5000))),
                      cached=frozenset(draw(st.sets(st.integers(0, n - 1)))))
               for k in range(m)]
    return layers, workers


@settings(max_examples=150, deadline=None)
@given(instances(), st.sampled_from(["sum", "max"]))
def test_exhaustive_order_search_matches_brute_force(instance, objective):
    layers, workers = instance
    plan = plan_layers(layers, workers, objective=objective, params=EXEC_ONLY)
    assert plan.method == "exhaustive"
    q, best = brute_best(layers, workers, objective)
    assert covered(plan.stages) == q
    assert plan.complete == (q == layers.n)
    assert plan.cost.exec_us == pytest.approx(best, rel=1e-12)
    check_memory(layers, workers, plan.stages)


@settings(max_examples=150, deadline=None)
@given(instances(), st.sampled_from(["sum", "max"]), st.data())
def test_dp_for_a_fixed_order_matches_brute_force_in_that_order(instance, objective, data):
    layers, workers = instance
    order = data.draw(st.permutations(range(len(workers))))
    result = assign_in_order(layers, workers, order, objective=objective, params=EXEC_ONLY)
    q, best = brute_best(layers, workers, objective, order=order)
    assert result.covered == covered(result.stages) == q
    assert result.cost.exec_us == pytest.approx(best, rel=1e-12)
    check_memory(layers, workers, result.stages)
    positions = [order.index(int(s.worker[1:])) for s in result.stages]
    assert positions == sorted(positions)


@settings(max_examples=100, deadline=None)
@given(instances())
def test_dp_is_exact_with_init_cost_when_alpha_is_zero(instance):
    # α = 0 makes the triple's total a plain sum, so the DP and the exhaustive search are exact again.
    layers, workers = instance
    plan = plan_layers(layers, workers, params=CostParams(alpha=0.0))
    q, best = brute_best(layers, workers, "sum", with_init=True)
    assert covered(plan.stages) == q
    assert plan.cost.total(0.0) == pytest.approx(best, rel=1e-12)


def test_a_small_worker_first_in_the_order_is_skipped():
    layers = Layers((1e6,) * 3, (1e6,) * 3, (1e6,) * 3, (10.0,) * 3, (10.0,) * 3)
    tiny = Worker("tiny", 0.5e6, 100.0, 1000.0, 10.0, 1000.0)
    big = Worker("big", 10e6, 100.0, 1000.0, 10.0, 1000.0)
    result = assign_in_order(layers, [tiny, big], objective="sum", params=EXEC_ONLY)
    assert result.covered == 3
    assert [(s.worker, s.first_layer, s.end_layer) for s in result.stages] == [("big", 0, 3)]


def test_empty_range_costs_nothing():
    layers = Layers((1e6,) * 2, (1e6,) * 2, (1e6,) * 2, (10.0,) * 2, (10.0,) * 2)
    w = Worker("w", 0.0, 100.0, 1000.0, 10.0, 1000.0)  # even one that fits no layer
    assert exec_cost_us(layers, w, 1, 1) == 0.0
    assert init_cost(layers, w, 1, 1) == 0.0
    assert exec_cost_us(layers, w, 0, 1) == math.inf


def test_the_thesis_counterexample_needs_the_other_order():
    # §5.3.1: 8 GB and 16 GB workers, layers needing 16 GB and 1 GB; ⟨w1, w2⟩ cannot work, ⟨w2, w1⟩ can.
    m = model([16e9, 1e9])
    devices = [device("w1", 8000), device("w2", 16000)]
    fixed = assign_in_order(layers_from_model(m), list(workers_from_devices(devices)), params=EXEC_ONLY)
    assert fixed.covered == 1  # w1 is skipped, w2 takes layer 0, and nobody is left for layer 1
    plan = plan_pp(m, devices)
    assert plan.complete
    assert [(s.worker, s.first_layer, s.end_layer) for s in plan.stages] == [("w2", 0, 1), ("w1", 1, 2)]


def test_partial_plan_when_memory_runs_out():
    m = model([10e9] * 3)
    plan = plan_pp(m, [device("a", 10000), device("b", 10000)])
    assert not plan.complete
    assert covered(plan.stages) == 2
    assert [(s.first_layer, s.end_layer) for s in plan.stages] == [(0, 1), (1, 2)]
    assert plan.exec_s_per_token > 0
    assert plan_pp(m, []).stages == ()


def test_memory_includes_the_kv_cache():
    # 3 layers of 1 MB weights plus 1 MB of KV cache each: 4 MB holds two layers, not three or four.
    m = model([1e6] * 3, kv_per_layer=1000.0, context=1000)
    plan = plan_pp(m, [device("a", 4), device("b", 4)])
    assert plan.complete
    assert sorted(s.end_layer - s.first_layer for s in plan.stages) == [1, 2]


def test_workers_from_devices_converts_units():
    d = device("d", 1500, bytes_per_s=2e9, so_ms=0.3, rtt_ms=4.0, up_mbit=80.0, down_mbit=40.0)
    (w,) = workers_from_devices([d], {"d": {1, 2}, "gone": {0}})
    assert w == Worker("d", 1.5e9, 300.0, 2000.0, 5.0, 4000.0, frozenset({1, 2}))
    with pytest.raises(ValueError, match="unique"):
        workers_from_devices([d, d])


def test_exec_cost_by_hand():
    # SO = 0.2 ms = 200 µs; CS = 1e9 B/s = 1000 B/µs; P = 2 ms = 2000 µs; B = min(80, 160) Mbit/s = 10 B/µs.
    # Layers [0, 2): 200 + (1e6 + 2e6)/1000 + δ 500 + 2000 + (4096 + 4096)/10 = 200 + 3000 + 500 + 2000 + 819.2.
    m = model([1e6, 2e6])
    layers = layers_from_model(m)
    (w,) = workers_from_devices([device("d", 100)])
    assert exec_cost_us(layers, w, 0, 2) == pytest.approx(6519.2)
    assert exec_cost_us(layers, w, 0, 1) == pytest.approx(200 + 1000 + 500 + 2000 + 819.2)
    plan = plan_pp(m, [device("d", 100)], params=EXEC_ONLY)
    assert plan.stage_compute_s == pytest.approx((3200e-6,))
    assert plan.stage_network_s == pytest.approx((3319.2e-6,))
    assert plan.exec_s_per_token == pytest.approx(6519.2e-6)
    (small,) = workers_from_devices([device("d", 2.5)])  # 2.5 MB: layer 0 fits, layers 0-1 (3 MB) do not
    assert exec_cost_us(layers, small, 0, 2) == math.inf
    assert exec_cost_us(layers, small, 0, 1) < math.inf


def test_init_cost_by_hand():
    # B = 8 Mbit/s = 1 B/µs; layer 0 (1 MB) is cached, so [0, 2) downloads layer 1's 3 MB:
    # Ĉ = σ + 3e6/1 = 1e6 + 3e6 = 4e6 µs.
    layers = layers_from_model(model([1e6, 3e6]))
    (w,) = workers_from_devices([device("d", 100, up_mbit=8.0, down_mbit=8.0)], {"d": {0}})
    # Up, a minute after the last redistribution: (4e6)^0.75 · ρ(60) = 2^1.5 · 10^4.5 · 0.5 = 44721.36.
    assert init_cost(layers, w, 0, 2, seconds_since_redistribution=60.0, server_up=True) == pytest.approx(44721.36)
    # Blocking: (4e6)^0.9 = 2^1.8 · 10^5.4 = 3.48220 · 251188.64 = 874,689.66.
    assert init_cost(layers, w, 0, 2) == pytest.approx(874689.66, rel=1e-7)
    # Only cached layers: Ĉ = σ = 1e6 µs, (1e6)^0.9 = 10^5.4 = 251,188.6.
    assert init_cost(layers, w, 0, 1) == pytest.approx(251188.64, rel=1e-7)
    assert init_cost(layers, w, 0, 2, params=EXEC_ONLY) == 0.0


def test_rho():
    assert rho(60.0) == pytest.approx(0.5)
    assert rho(0.0) == pytest.approx(1 - 1 / (1 + math.exp(5)))  # ≈ 0.9933: not quite 1 right after a change
    assert rho(1e9) == pytest.approx(0.0, abs=1e-12)  # no overflow, however long ago
    assert rho(48.0) > rho(60.0) > rho(72.0)


def test_cost_triple_addition_and_total():
    a, b = CostTriple(100.0, 10.0, 10.0), CostTriple(200.0, 30.0, 30.0)
    assert a.plus(b) == CostTriple(300.0, 40.0, 30.0)
    assert a.plus(b, "max") == CostTriple(200.0, 40.0, 30.0)
    # c_e + α·c_m + (1 - α)·c_s = 300 + 0.8·30 + 0.2·40 = 332
    assert a.plus(b).total(0.8) == pytest.approx(332.0)
    assert a.plus(b, "max").total(0.8) == pytest.approx(232.0)


def two_stage_setup():
    m = model([1e6] * 4)
    devices = [device("a", 2.5), device("b", 2.5), device("c", 2.5), device("d", 2.5)]
    return m, devices


def test_acceptance_threshold_is_strict():
    m, devices = two_stage_setup()
    current = plan_pp(m, devices[:2])
    params = CostParams()
    threshold = params.tau * plan_exec_us(current, m, devices)
    at = dataclasses.replace(current, cost=CostTriple(threshold, 0.0, 0.0))
    below = dataclasses.replace(current, cost=CostTriple(math.nextafter(threshold, 0.0), 0.0, 0.0))
    assert not accept(at, current, m, devices)
    assert accept(below, current, m, devices)
    # The init penalty counts against the candidate: α·c_m + (1 - α)·c_s = 1 pushes it over the line.
    assert not accept(dataclasses.replace(below, cost=CostTriple(threshold - 0.5, 1.0, 1.0)), current, m, devices)
    # The same plan again never wins: it would have to be 5 % faster than itself.
    assert not accept(dataclasses.replace(current, cost=CostTriple(current.cost.exec_us, 0.0, 0.0)), current, m,
                      devices)


def test_acceptance_without_a_working_current_plan():
    m, devices = two_stage_setup()
    candidate = plan_pp(m, devices)
    assert accept(candidate, None, m, devices)
    current = plan_pp(m, devices[:2])
    assert accept(candidate, current, m, devices[1:])  # a current worker is gone: C_exec(current) = ∞
    assert accept(candidate, dataclasses.replace(current, complete=False), m, devices)
    assert not accept(dataclasses.replace(candidate, complete=False), None, m, devices)


def test_current_plan_counts_as_cached():
    m, devices = two_stage_setup()
    current = plan_pp(m, devices[:2])
    again = plan_pp(m, devices[:2], current=current, server_up=True)
    fresh = plan_pp(m, devices[:2], server_up=True)
    assert again.stages == current.stages
    assert again.cost.init_sum < fresh.cost.init_sum


def test_a_lost_stage_goes_to_a_spare_that_covers_it_and_the_others_stay():
    m, devices = two_stage_setup()  # every device holds two of the four layers
    current = plan_pp(m, devices[:2])
    first, second = current.stages
    everyone = {"a", "b", "c", "d"}

    def fits(worker: str, stage: Stage) -> bool:
        return worker != "d"  # d's budget holds neither stage

    # c covers the first stage; the second stage's worker is lost: no spare has it loaded, c takes it anyway.
    covers = cover_stages(current, ["d", "c"], fits)
    assert covers == (Stage("c", first.first_layer, first.end_layer),)
    lost_second = replacement_plan(current, everyone - {second.worker}, ["d", "c"], fits, {"c": covers[0]})
    assert lost_second.stages == (first, Stage("c", second.first_layer, second.end_layer))
    assert lost_second.method == "replacement" and lost_second.complete
    # With two spares that fit, the one holding the lost stage loaded ahead is chosen over the first in order.
    loaded = {"d": Stage("d", second.first_layer, second.end_layer)}
    both = replacement_plan(current, everyone - {second.worker}, ["c", "d"], lambda w, s: True, loaded)
    assert both.stages == (first, loaded["d"])
    # Nothing lost, or no spare that can take a lost stage: None (plan afresh).
    assert replacement_plan(current, everyone, ["c", "d"], fits) is None
    assert replacement_plan(current, everyone - {first.worker}, ["d"], fits) is None
    assert replacement_plan(current, everyone - {first.worker, "c"}, ["c", "d"], fits) is None
    # Both stages lost: each takes a spare of its own.
    two = replacement_plan(current, {"c", "d"}, ["c", "d"], lambda w, s: True)
    assert [s.worker for s in two.stages] == ["c", "d"]
    assert cover_stages(current, ["c", "d"], lambda w, s: True) == tuple(
        Stage(w, s.first_layer, s.end_layer) for w, s in zip("cd", current.stages, strict=True))
    # One spare for two stages: the stage that takes longer to load is the one covered (a loss of the other then
    # costs the shorter load); equal costs keep stage order.
    heavier_second = cover_stages(current, ["c"], lambda w, s: True, lambda s: s.first_layer)
    assert heavier_second == (Stage("c", second.first_layer, second.end_layer),)
    assert cover_stages(current, ["c"], lambda w, s: True, lambda s: 1.0) == (Stage("c", first.first_layer,
                                                                                      first.end_layer),)
    # With room for both, both are covered whatever they cost; the costlier first.
    assert set(cover_stages(current, ["c", "d"], lambda w, s: True, lambda s: s.first_layer)) == {
        Stage("c", second.first_layer, second.end_layer), Stage("d", first.first_layer, first.end_layer)}
    # A spare that holds a running stage loaded already keeps it: d holds the first (the costlier here), which c,
    # first in order, would otherwise take; d keeps it and c takes the second, nothing loaded twice.
    held = {"d": Stage("d", first.first_layer, first.end_layer)}
    assert set(cover_stages(current, ["c", "d"], lambda w, s: True, lambda s: -s.first_layer, held)) == {
        held["d"], Stage("c", second.first_layer, second.end_layer)}
    # One spare holding the cheaper stage keeps it rather than switch to the costlier one (both would go
    # uncovered while that loads).
    assert cover_stages(current, ["d"], lambda w, s: True, lambda s: -s.first_layer,
                        {"d": Stage("d", second.first_layer, second.end_layer)}) == (
        Stage("d", second.first_layer, second.end_layer),)
    # A loaded stage that is not a running one counts for nothing.
    stale = {"c": Stage("c", first.first_layer, first.end_layer + 1)}
    assert cover_stages(current, ["c"], lambda w, s: True, lambda s: s.first_layer, stale) == heavier_second


def test_shadow_plans():
    m, devices = two_stage_setup()  # every device holds two of the four layers
    current = plan_pp(m, devices[:2])
    used = {s.worker for s in current.stages}
    assert used == {"a", "b"}
    strict = shadow_plan(m, devices, current, mode="strict")
    assert strict.complete and not {s.worker for s in strict.stages} & used
    alone = shadow_plan(m, devices[:3], current, mode="strict")  # only c is spare: half the model
    assert not alone.complete
    redundant = shadow_plan(m, devices[:3], current, mode="redundancy")
    assert redundant.complete
    ranges = {s.worker: (s.first_layer, s.end_layer) for s in current.stages}
    reused = [s for s in redundant.stages if s.worker in ranges]
    assert reused
    for s in reused:
        first, end = ranges[s.worker]
        assert s.end_layer <= first or end <= s.first_layer
    with pytest.raises(ValueError, match="mode"):
        shadow_plan(m, devices, current, mode="loose")


@settings(max_examples=100, deadline=None)
@given(instances(), st.data())
def test_redundancy_never_overlaps_a_current_range(instance, data):
    layers, workers = instance
    current = plan_layers(layers, workers, params=EXEC_ONLY)
    reuse = {s.worker: (s.first_layer, s.end_layer) for s in current.stages}
    plan = plan_layers(layers, workers, params=CostParams(include_init=data.draw(st.booleans())), reuse=reuse)
    check_memory(layers, workers, plan.stages)
    for s in plan.stages:
        if s.worker in reuse:
            first, end = reuse[s.worker]
            assert s.end_layer <= first or end <= s.first_layer


def ten_workers():
    rng = np.random.default_rng(7)
    n = 20
    weight = rng.integers(50, 200, n) * 1e6
    weight[0] += 300e6
    weight[-1] += 300e6
    layers = Layers(tuple(weight), tuple(weight), tuple(weight), (8192.0,) * n, (8192.0,) * n)
    workers = [Worker(f"w{k}", float(rng.uniform(0.1, 0.5) * weight.sum()), float(rng.uniform(100, 2000)),
                      float(rng.uniform(100, 5000)), float(rng.uniform(1, 50)), float(rng.uniform(200, 20000)),
                      frozenset(int(v) for v in rng.choice(n, 5, replace=False)))
               for k in range(10)]
    return layers, workers


def test_annealing_is_no_worse_than_the_identity_order_and_deterministic():
    layers, workers = ten_workers()
    plan = plan_layers(layers, workers, seed=3)
    assert plan.method == "annealing"
    identity = assign_in_order(layers, workers)
    alpha = CostParams().alpha
    assert (layers.n - covered(plan.stages), plan.cost.total(alpha)) <= \
        (layers.n - identity.covered, identity.cost.total(alpha))
    again = plan_layers(layers, workers, seed=3)
    assert dataclasses.replace(again, solve_seconds=0.0) == dataclasses.replace(plan, solve_seconds=0.0)
    check_memory(layers, workers, plan.stages)


def test_annealing_returns_the_best_order_it_scored():
    seen = []

    def value(order):
        return 0, float(sum(k * w for k, w in enumerate(order)))  # best: descending order

    def score(order):
        seen.append(order)
        return value(order)

    best = anneal_search(6, score, np.random.default_rng(0))
    assert value(best) == min(value(o) for o in seen)
    assert all(sorted(o) == list(range(6)) for o in seen)


def fake_clock(step: float):
    """A clock that advances `step` seconds each time it is read (steps exact in binary, so no rounding)."""
    now = [0.0]

    def clock() -> float:
        now[0] += step
        return now[0]

    return clock


def test_random_search_respects_its_budget():
    calls = []

    def value(order):
        return 0, float(order[0])

    def score(order):
        calls.append(order)
        return value(order)

    best = random_search(5, score, np.random.default_rng(0), 1.0, fake_clock(0.25))
    # Started at 0.25; the checks read 0.5, 0.75 and 1.0 (0.25, 0.5 and 0.75 elapsed: three random orders after the
    # identity), then 1.25, when the budget is spent.
    assert len(calls) == 4
    assert calls[0] == (0, 1, 2, 3, 4)
    assert best == min(calls, key=value)


def test_plan_uses_random_search_for_large_problems():
    rng = np.random.default_rng(1)
    n, m = 25, 80  # n²m = 50,000
    layers = Layers((1e6,) * n, (1e6,) * n, (1e6,) * n, (10.0,) * n, (10.0,) * n)
    workers = [Worker(f"w{k}", float(rng.integers(1, 6)) * 1e6, 100.0, float(rng.uniform(100, 1000)), 10.0, 1000.0)
               for k in range(m)]
    plan = plan_layers(layers, workers, clock=fake_clock(0.25), search=SearchParams(time_budget_s=0.6))
    assert plan.method == "random"
    assert plan.complete
    # Reads: 0.25 plan start, 0.5 search start, 0.75 and 1.0 within budget, 1.25 past it, 1.5 plan end.
    assert plan.solve_seconds == 1.25
    check_memory(layers, workers, plan.stages)


def test_choose_method():
    assert choose_method(32, 5) == "exhaustive"
    assert choose_method(53, 7) == "exhaustive"  # 19,663
    assert choose_method(54, 7) == "annealing"  # 20,412
    assert choose_method(10, 8) == "annealing"  # too many workers to try every order
    assert choose_method(32, 12) == "annealing"
    assert choose_method(100, 5) == "random"  # 50,000
    with pytest.raises(ValueError, match="too large"):
        choose_method(1000, 100)


def test_json_round_trip():
    m, devices = two_stage_setup()
    plan = plan_pp(m, devices, objective="max", server_up=True, seconds_since_redistribution=30.0)
    text = json.dumps(plan.to_json())
    assert pp_plan_from_json(json.loads(text)) == plan
    assert json.loads(text)["schema"] == "edgerun.pp-plan/1"
    bad = json.loads(text)
    bad["schema"] = "edgerun.pp-plan/0"
    with pytest.raises(ValueError, match="schema"):
        pp_plan_from_json(bad)
    bad = json.loads(text)
    bad["stages"][0]["end_layer"] = True
    with pytest.raises(ValueError, match=r"stages\[0\]\.end_layer"):
        pp_plan_from_json(bad)


def test_json_keeps_the_pricing_and_reads_plans_written_without_it():
    m, devices = two_stage_setup()
    plan = plan_pp(m, devices, objective="max", pricing=Pricing.MACS)
    data = json.loads(json.dumps(plan.to_json()))
    assert data["pricing"] == "macs" and pp_plan_from_json(data) == plan
    del data["pricing"]  # a plan file written before plans were priced by multiply-adds
    assert pp_plan_from_json(data).pricing is Pricing.BYTES
    data["pricing"] = "flops"
    with pytest.raises(ValueError, match=r"plan\.pricing"):
        pp_plan_from_json(data)


def lm_head_model() -> ModelProfile:
    """16 layers, the last with an LM head of 8-bit weights: 8 times a layer's bytes, but 4 times its multiply-adds
    (a 4-bit layer of as many weights streams half the bytes); the first holds an embedding table as large
    (memory, not multiplied)."""
    layer_bytes, layer_flops = 10e6, 40e6
    read = [layer_bytes] * 15 + [layer_bytes * 9]
    flops = [layer_flops] * 15 + [layer_flops * 5]
    weight = [layer_bytes * 9] + [layer_bytes] * 14 + [layer_bytes * 9]
    return dataclasses.replace(model(weight), layer_read_bytes=tuple(read), layer_flops=tuple(flops))


def test_macs_share_the_bytes_out_by_multiply_adds():
    """Pricing.MACS: the model costs its bytes in all, shared among the layers as their multiply-adds are; a
    batch's plan by it splits the layers evenly around the head's stage, where by bytes the head's stage alone
    is the slowest and the others fall as they may."""
    m = lm_head_model()
    by_bytes, by_macs = layer_costs(m), layer_costs(m, Pricing.MACS)
    assert by_bytes == m.layer_read_bytes and math.isclose(sum(by_macs), sum(by_bytes))
    assert by_macs[-1] / by_macs[0] == pytest.approx(5.0) and by_bytes[-1] / by_bytes[0] == pytest.approx(9.0)
    assert layers_from_model(m, Pricing.MACS).cost == by_macs
    devices = [device(f"w{i}", 1e6) for i in range(4)]
    plan = plan_pp(m, devices, objective="max", pricing=Pricing.MACS, params=EXEC_ONLY)
    assert plan.pricing is Pricing.MACS
    # 20 layer-loads of multiply-adds in 4 stages: the head's layer alone takes 5, the others 5 each
    assert [(s.first_layer, s.end_layer) for s in plan.stages] == [(0, 5), (5, 10), (10, 15), (15, 16)]
    by_bytes_plan = plan_pp(m, devices, objective="max", params=EXEC_ONLY)
    assert by_bytes_plan.pricing is Pricing.BYTES and by_bytes_plan.stages[-1].first_layer == 15
    # priced again as planned (the repartition loop's comparison); by bytes the head's stage is slower
    assert plan_exec_us(plan, m, devices, params=EXEC_ONLY) == pytest.approx(plan.cost.exec_us)
    assert plan_exec_us(plan, m, devices, pricing=Pricing.BYTES, params=EXEC_ONLY) > plan.cost.exec_us


def test_a_batch_benchmarks_budgets_hold_its_fastest_split_on_every_worker():
    """bench serve --workers N --parallel P: the smallest budget that holds the model forces the split by memory
    (the embedding's stage one layer, the next ones seven), while a batch's budget (bench.pp.batch_budgets_mb)
    leaves room for the split a batch is planned for, and still makes the plan use every worker."""
    from edgerun.bench.pp import batch_budgets_mb, stage_budgets_mb

    m = lm_head_model()
    tight = [device(f"w{i}", stage_budgets_mb(m.layer_memory_bytes, 4)) for i in range(4)]
    room = [device(f"w{i}", batch_budgets_mb(m, 4)) for i in range(4)]
    by_memory = plan_pp(m, tight, objective="max", pricing=Pricing.MACS, params=EXEC_ONLY)
    batch = plan_pp(m, room, objective="max", pricing=Pricing.MACS, params=EXEC_ONLY)
    assert by_memory.complete and batch.complete and len(batch.stages) == 4
    assert [(s.first_layer, s.end_layer) for s in batch.stages] == [(0, 5), (5, 10), (10, 15), (15, 16)]
    assert max(by_memory.stage_compute_s) > 1.3 * max(batch.stage_compute_s)
    # three of those budgets cannot hold the model as fast: the plan runs all four
    assert plan_pp(m, room[:3], objective="max", pricing=Pricing.MACS, params=EXEC_ONLY).cost.exec_us > \
        batch.cost.exec_us


def test_bad_arguments():
    m, devices = two_stage_setup()
    with pytest.raises(ValueError, match="objective"):
        plan_pp(m, devices, objective="mean")
    with pytest.raises(ValueError, match="seconds_since_redistribution"):
        plan_pp(m, devices, seconds_since_redistribution=-1.0)


def test_cost_result_errors():
    from edgerun.bench.pp import CostResult

    r = CostResult((80.0, 80.0), 2, predicted_ms=11.0, measured_ms=10.0, running_predicted_ms=(9.0, 12.0),
                   running_measured_ms=(10.0, 10.0))
    assert r.error == pytest.approx(0.1)
    assert r.running_error == pytest.approx(0.15)  # (10 % + 20 %) / 2


def test_a_stage_splits_into_parts_whose_largest_load_is_smallest():
    """stage_parts: bounds that minimise the largest part's repacked bytes, in as few parts as give that."""
    even = [1.0] * 12
    assert stage_parts(even, 2, 10, 4) == [4, 6, 8]
    assert stage_parts(even, 2, 10, 2) == [6]
    assert stage_parts(even, 2, 10, 1) == [] and stage_parts(even, 3, 4, 4) == []  # one part, one layer
    assert stage_parts(even, 0, 3, 8) == [1, 2]  # no more parts than layers
    # An LM head heavier than the rest of its stage: two parts load as fast as four would.
    head = [1.0] * 7 + [10.0]
    assert stage_parts(head, 0, 8, 4) == [7]
    # Uneven layers: the bound goes where the two sides are closest.
    assert stage_parts([3.0, 1.0, 1.0, 1.0, 2.0], 0, 5, 2) == [2]


def test_measured_speeds_price_a_stage_at_the_time_it_took():
    """A worker's speed samples leave the session overhead out: the cost model adds SO to every stage, so a stage
    priced with them takes the seconds it was measured at (not SO more), and a pass shorter than SO keeps a
    finite speed."""
    from types import SimpleNamespace

    from edgerun.net.wire import WorkerKind
    from edgerun.pp.messages import Capabilities
    from edgerun.pp.workers import WorkerConn

    conn = WorkerConn("w", SimpleNamespace(host="127.0.0.1"), 80.0, 1e8, Capabilities(WorkerKind.NATIVE), set())
    for seconds in (0.0031, 0.0030, 0.0029):
        conn.observe_decode(6e6, seconds)
    worker = workers_from_devices([conn.device(80.0)])[0]
    assert conn.session_overhead_ms > 0
    assert worker.session_overhead_us == pytest.approx(conn.session_overhead_ms * 1e3)
    assert worker.session_overhead_us + 6e6 / worker.speed == pytest.approx(3000.0)  # the median pass, in µs
    assert conn.decode_passes == 3 and conn.decode_s == pytest.approx(0.009)
    conn.observe_decode(1e5, 0.0001)  # shorter than the overhead: a tenth of it counts
    assert conn.speeds[-1] == pytest.approx(1e5 / 0.00001)


def test_the_repartition_loops_next_move() -> None:
    """pp.deployment.next_move: recover a broken pipeline between requests (a request recovers by itself), take a
    better plan (staged beside a running request, else deployed), else keep a plan standing by for a loss."""
    from edgerun.pp.deployment import Move, next_move

    assert next_move(whole=False, busy=False, better=True, standing_by=True) is Move.RECOVER
    assert next_move(whole=False, busy=True, better=False, standing_by=False) is Move.NOTHING
    assert next_move(whole=True, busy=True, better=True, standing_by=True) is Move.STAGE
    assert next_move(whole=True, busy=False, better=True, standing_by=False) is Move.DEPLOY
    assert next_move(whole=True, busy=False, better=False, standing_by=False) is Move.SHADOW
    assert next_move(whole=True, busy=True, better=False, standing_by=True) is Move.NOTHING
