"""Event loops that poll before they sleep (SpinningSelector, EventLoopThread with spin_s)."""

from __future__ import annotations

import asyncio
import collections
import selectors
import socket
import threading
import time

import pytest

from edgerun.net.channel import EventLoopThread
from edgerun.net.loops import AUTO_SPIN_US, SpinningSelector, auto_spin_us, spinning_event_loop


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def counted(monkeypatch: pytest.MonkeyPatch, selector: SpinningSelector) -> list[float | None]:
    """The timeouts of every select the spinning selector makes on the selector beneath it."""
    calls: list[float | None] = []
    below = type(selector).__mro__[1]
    original = below.select

    def select(self: selectors.BaseSelector, timeout: float | None = None) -> list:
        calls.append(timeout)
        return original(self, timeout)

    monkeypatch.setattr(below, "select", select)
    return calls


def test_an_idle_selector_sleeps_and_a_busy_one_polls_first(monkeypatch: pytest.MonkeyPatch,
                                                           pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    selector = SpinningSelector(0.02)
    selector.register(b, selectors.EVENT_READ)
    calls = counted(monkeypatch, selector)
    assert selector.select(0.01) == [] and calls == [0.01]  # nothing came before: one sleeping select
    a.send(b"x")
    assert len(selector.select(1.0)) == 1 and calls[-1] == 1.0  # idle before: it slept, and woke for the byte
    b.recv(1)
    calls.clear()
    # Something came last time: it polls (timeout 0) for up to spin_s, then sleeps for what is left of 0.05 s.
    started = time.perf_counter()
    assert selector.select(0.05) == []
    assert time.perf_counter() - started >= 0.045
    assert len(calls) > 1 and all(t == 0 for t in calls[:-1]) and 0 < calls[-1] <= 0.03
    # Idle again: the next select sleeps at once.
    calls.clear()
    assert selector.select(0.01) == [] and calls == [0.01]
    selector.close()
    # A byte that comes while it polls is returned by a poll (a spin long enough for the timer on a busy machine).
    selector = SpinningSelector(2.0)
    selector.register(b, selectors.EVENT_READ)
    a.send(b"y")
    assert len(selector.select(1.0)) == 1
    b.recv(1)
    calls.clear()
    threading.Timer(0.005, a.send, (b"z",)).start()
    assert len(selector.select(3.0)) == 1 and all(t == 0 for t in calls), calls
    selector.close()


def test_a_spinning_loop_thread_runs_coroutines_and_answers_in_time(pair: tuple[socket.socket, socket.socket]) -> None:
    """EventLoopThread with spin_s: coroutines and readers run as on any loop, the caller's wait polls first."""
    a, b = pair
    net = EventLoopThread(spin_s=0.01)
    try:
        assert isinstance(net.loop._selector, SpinningSelector)  # type: ignore[attr-defined]
        got = asyncio.Queue()

        async def watch() -> None:
            b.setblocking(False)
            net.loop.add_reader(b.fileno(), lambda: got.put_nowait(b.recv(16)))

        async def read() -> bytes:
            return await asyncio.wait_for(got.get(), 5)

        net.run(watch())
        for word in (b"one", b"two"):
            a.send(word)
            assert net.run(read()) == word
        assert net.call(lambda: 6 * 7) == 42
    finally:
        net.stop()
    assert net.loop.is_closed()
    plain = spinning_event_loop(0.0)  # no spinning: the usual loop (uvloop's where installed)
    assert not isinstance(getattr(plain, "_selector", None), SpinningSelector)
    plain.close()


def test_a_thread_waiting_in_run_polls_only_while_it_waits_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """EventLoopThread.run with spin_s: one waiting thread polls (yields the core between polls); while several
    wait (a pipeline's batch lanes) none does, since each poll takes the interpreter from the loop thread that must
    read their replies; all of them get their results."""
    import edgerun.net.channel as channel

    yields = collections.Counter()
    real_yield = channel.os.sched_yield

    def counted() -> None:
        yields[threading.current_thread().name] += 1
        real_yield()

    def lanes() -> int:
        # the waiting threads' polls alone: os.sched_yield is one function for every module, and the loop thread's
        # own selector (net.loops) yields between its polls too, for up to spin_s after each wake-up
        return sum(n for name, n in yields.items() if name.startswith("lane-"))

    monkeypatch.setattr(channel.os, "sched_yield", counted)
    net = EventLoopThread(spin_s=5.0)
    try:
        release = net.call(asyncio.Event)

        async def wait(value: int) -> int:
            await release.wait()
            return value

        results: dict[int, int] = {}
        waiters = [threading.Thread(target=lambda i=i: results.__setitem__(i, net.run(wait(i))), name=f"lane-{i}")
                   for i in range(3)]
        waiters[0].start()
        # Conditions waited for, not fixed sleeps: on a busy machine a thread may not run for a while.
        deadline = time.monotonic() + 5
        while lanes() <= 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lanes() > 10  # the one waiting thread polls
        for t in waiters[1:]:
            t.start()
        # They wait (and a poll that had passed its check as the others came ends): the count stops growing, and
        # stays put for 50 ms on end. A thread that went on polling would grow it in every window.
        deadline = time.monotonic() + 5
        while True:
            before = lanes()
            time.sleep(0.05)
            if lanes() == before or time.monotonic() > deadline:
                break
        assert lanes() == before  # three waiting: none polls
        net.loop.call_soon_threadsafe(release.set)
        for t in waiters:
            t.join(5)
        assert results == {0: 0, 1: 1, 2: 2}
    finally:
        net.stop()


def test_auto_spin_where_every_compute_thread_has_a_core() -> None:
    """A benchmark's --spin-us auto: spin where the run's processes' compute threads fit the cores, else not."""
    assert auto_spin_us(8, 1, cores=16) == AUTO_SPIN_US
    assert auto_spin_us(8, 2, cores=16) == AUTO_SPIN_US
    assert auto_spin_us(9, 2, cores=16) == 0.0
    assert auto_spin_us(3, 1, cores=2) == 0.0
    assert auto_spin_us(1, 1) == AUTO_SPIN_US  # this machine's cores by default



def test_coroutines_run_in_turn_by_one_task_and_the_loop_runs_on_between_them() -> None:
    """run_in_turn: one task runs the caller's coroutines one after another (a step that awaits still lets the loop
    run), hands back each one's result or exception, polls spin_s for the next and then ends, after which the next
    call starts a new one; the loop's other coroutines run between turns; turns the task left when it ended (a
    stopped loop cancels it) fail rather than wait forever."""
    from edgerun.net.channel import _Turn

    net = EventLoopThread()
    tasks: list[asyncio.Task | None] = []

    async def step(i: int) -> int:
        tasks.append(asyncio.current_task())
        await asyncio.sleep(0.001)  # awaits on the loop, as a step's stream replies do
        if i == 3:
            raise ValueError("step 3")
        return i * i

    try:
        assert [net.run_in_turn(step(i), 0.2) for i in range(3)] == [0, 1, 4]
        assert len({id(t) for t in tasks}) == 1  # one task ran them all
        with pytest.raises(ValueError, match="step 3"):
            net.run_in_turn(step(3), 0.2)
        assert net.call(lambda: 6 * 7) == 42  # the loop's own work runs once the turns' polling ends
        time.sleep(0.3)  # ... past spin_s: the task of turns ended
        assert net.run_in_turn(step(4), 0.2) == 16 and len({id(t) for t in tasks}) == 2
        assert net.run_in_turn(step(5), 0.0) == 25  # no spin: a plain run, a task of its own
        assert len({id(t) for t in tasks}) == 3
        time.sleep(0.3)
        left = _Turn(step(6))
        with net._turns_lock:
            net._turns = collections.deque([left])
        net._turns_ended(None)  # as the task's end calls it
        with pytest.raises(RuntimeError, match="stopped before this step ran"):
            left.result()
        assert net._turns is None and net.run_in_turn(step(7), 0.2) == 49
    finally:
        net.stop()
