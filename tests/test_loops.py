"""Event loops that poll before they sleep (SpinningSelector, EventLoopThread with spin_s)."""

from __future__ import annotations

import asyncio
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


def test_auto_spin_where_every_compute_thread_has_a_core() -> None:
    """A benchmark's --spin-us auto: spin where the run's processes' compute threads fit the cores, else not."""
    assert auto_spin_us(8, 1, cores=16) == AUTO_SPIN_US
    assert auto_spin_us(8, 2, cores=16) == AUTO_SPIN_US
    assert auto_spin_us(9, 2, cores=16) == 0.0
    assert auto_spin_us(3, 1, cores=2) == 0.0
    assert auto_spin_us(1, 1) == AUTO_SPIN_US  # this machine's cores by default

