"""serve's switch between its own engine and a cluster (serve.switch.EngineSwitch), decided on fake engines: which
mode it takes for each plan's prediction and each --prefer, what it does when the plan fails, when members come and
go, and when the cluster measures slower than it was predicted. (test_serve runs it on real nodes.)"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.generate import EngineLost
from edgerun.serve.switch import MIN_GAIN, EngineSwitch, Mode, NoCapacity, Prefer

SINGLE_MS = 10.0


class FakeEngine:
    name = "fake"
    max_len = 64
    weight_bytes = 1_000_000

    def reset(self) -> None: ...

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return np.zeros(8, np.float32)

    def release(self) -> None: ...


class FakeCluster:
    """Members as the test sets them; deploy() predicts `predicted_ms` or fails with `fails`."""

    kind = "fake"
    port = 0
    members_are = "nodes"

    def __init__(self, predicted_ms: float) -> None:
        self.present: tuple[str, ...] = ()
        self.predicted_ms, self.fails = predicted_ms, None
        self.engine = FakeEngine()
        self.deploys, self.lost, self.own_speed = 0, [], None

    def members(self) -> tuple[str, ...]:
        return self.present

    def deploy(self) -> tuple[str, float]:
        self.deploys += 1
        if self.fails is not None:
            raise EdgerunError(self.fails)
        return f"plan over {', '.join(self.present)}", self.predicted_ms

    def rebalance(self) -> str | None:
        return None

    def on_lost(self, lost: EngineLost) -> None:
        self.lost.append(str(lost))

    def set_own_speed(self, weight_bytes_per_s: float) -> None:
        self.own_speed = weight_bytes_per_s

    def close(self) -> None: ...


def switch(predicted_ms: float, prefer: Prefer = Prefer.AUTO, single: bool = True) -> tuple[EngineSwitch, FakeCluster]:
    cluster = FakeCluster(predicted_ms)
    return EngineSwitch(FakeEngine() if single else None, cluster, prefer, 64, single_ms=SINGLE_MS), cluster


def test_a_cluster_predicted_faster_serves_and_one_that_is_not_does_not() -> None:
    s, cluster = switch(SINGLE_MS * (1 - MIN_GAIN) - 0.1)
    assert s.mode is Mode.SINGLE and cluster.own_speed == pytest.approx(FakeEngine.weight_bytes / 0.01)
    s.update()  # no members: nothing to plan
    assert s.mode is Mode.SINGLE and cluster.deploys == 0
    cluster.present = ("a", "b")
    s.update()
    assert s.mode is Mode.CLUSTER and s.engine is cluster.engine and s.planned_for == ("a", "b")
    s.update()  # the same members: no replan
    assert cluster.deploys == 1
    slow, slow_cluster = switch(SINGLE_MS * (1 - MIN_GAIN) + 0.1)
    slow_cluster.present = ("a",)
    slow.update()
    assert slow.mode is Mode.SINGLE and "no faster than the single engine's 10.0" in slow.why


def test_prefer_cluster_and_prefer_single_override_the_prediction() -> None:
    s, cluster = switch(SINGLE_MS * 3, Prefer.CLUSTER)
    cluster.present = ("a",)
    s.update()
    assert s.mode is Mode.CLUSTER
    s, cluster = switch(SINGLE_MS / 3, Prefer.SINGLE)
    cluster.present = ("a",)
    s.update()
    assert s.mode is Mode.SINGLE and cluster.deploys == 0 and "--prefer single" in s.why


def test_a_cluster_that_measures_slower_than_the_single_engine_is_left_until_the_members_change() -> None:
    s, cluster = switch(SINGLE_MS / 2)
    cluster.present = ("a",)
    s.update()
    assert s.mode is Mode.CLUSTER
    s.measured(SINGLE_MS * 2)
    s.update()
    assert s.mode is Mode.SINGLE and "slower than the single engine's" in s.why
    cluster.present = ("a", "b")  # a join: planned again, its own measurements afresh
    s.update()
    assert s.mode is Mode.CLUSTER and Mode.CLUSTER not in s.measured_ms


def test_a_plan_that_fails_falls_back_and_without_a_single_engine_requests_wait() -> None:
    s, cluster = switch(1.0)
    cluster.present, cluster.fails = ("a",), "the nodes cannot hold the model"
    s.update()
    assert s.mode is Mode.SINGLE and "cannot plan over a (the nodes cannot hold the model)" in s.why
    alone, cluster = switch(1.0, single=False)
    assert alone.mode is Mode.NONE and not alone.has_capacity
    with pytest.raises(EngineLost):
        alone.engine  # noqa: B018 (the property raises)
    cluster.present = ("a",)
    alone.update()
    assert alone.mode is Mode.CLUSTER and alone.has_capacity


def test_a_member_lost_mid_request_replans_over_those_left_or_says_nothing_can_compute() -> None:
    s, cluster = switch(1.0, single=False)
    cluster.present = ("a", "b")
    s.update()
    cluster.present = ("a",)
    s.recover(EngineLost("b"))
    assert cluster.lost == ["b"] and s.mode is Mode.CLUSTER and s.planned_for == ("a",) and cluster.deploys == 2
    cluster.present = ()
    with pytest.raises(NoCapacity, match="a was lost mid-request and nothing else can compute: no nodes"):
        s.recover(EngineLost("a"))
    with_single, cluster = switch(1.0)
    cluster.present = ("a",)
    with_single.update()
    cluster.present = ()
    with_single.recover(EngineLost("a"))
    assert with_single.mode is Mode.SINGLE and with_single.engine is with_single.single


def test_the_warm_up_runs_on_a_thread_that_ends_with_it() -> None:
    """The single engine's warm-up (its speed measured) runs on a thread of its own that is gone afterwards: a
    thread that starts a ggml graph on several threads keeps a team of OpenMP threads while it lives, and with
    more of them than cores libgomp's barriers sleep (the generation thread's steps took 3x as long). Its error,
    if any, is the caller's."""
    import threading

    class Recording(FakeEngine):
        def __init__(self) -> None:
            self.threads: set[threading.Thread] = set()

        def step(self, tokens: Sequence[int]) -> np.ndarray:
            self.threads.add(threading.current_thread())
            return super().step(tokens)

    engine = Recording()
    switch = EngineSwitch(engine, None, Prefer.AUTO, 64)  # type: ignore[arg-type]
    assert switch.single_ms is not None and switch.single_ms >= 0
    assert len(engine.threads) == 1
    (warm,) = engine.threads
    assert warm is not threading.current_thread() and not warm.is_alive()

    class Failing(FakeEngine):
        def step(self, tokens: Sequence[int]) -> np.ndarray:
            raise EdgerunError("no memory for the graph")

    with pytest.raises(EdgerunError, match="no memory for the graph"):
        EngineSwitch(Failing(), None, Prefer.AUTO, 64)  # type: ignore[arg-type]
