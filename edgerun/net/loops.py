"""Event loops: uvloop's where installed, or asyncio's on a selector that polls before it sleeps. A module of its
own, importing nothing of edgerun, so a pipeline worker starts without the tensor-parallel stack."""

from __future__ import annotations

import asyncio
import os
import selectors
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed, asyncio's own otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# A benchmark's --spin-us auto: what its processes poll for when every one has a core of its own. It spans a
# token's period on the pipelines and models we time (20 ms), so a stage or node that waits for its next input
# across a whole token still polls; a process that idled longer sleeps.
AUTO_SPIN_US = 20000.0


def auto_spin_us(processes: int, threads: int, cores: int | None = None) -> float:
    """--spin-us auto for `processes` processes of `threads` compute threads on this machine (or one of `cores`
    cores): AUTO_SPIN_US where each compute thread has a core, else 0. A process spinning on a core another one
    computes on slows that one down more than its own wake-ups cost."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return AUTO_SPIN_US if processes * threads <= cores else 0.0


def polled_select(select: Callable[[float | None], list[T]], spin_s: float, timeout: float | None) -> list[T]:
    """`select(0)` over and over for up to spin_s (within `timeout`), yielding the core between polls, then
    `select` with what is left of `timeout`: a process woken from sleep by a packet can take hundreds of
    microseconds on a VM (a WebSocket round trip here took 0.26 ms against a busy peer and 1.14 ms against one
    idle for 10 ms)."""
    if spin_s <= 0 or timeout == 0:
        return select(timeout)
    start = time.perf_counter()
    end = start + (spin_s if timeout is None else min(spin_s, timeout))
    while True:
        ready = select(0)
        if ready or time.perf_counter() >= end:
            break
        os.sched_yield()
    if ready:
        return ready
    return select(None if timeout is None else max(0.0, timeout - (time.perf_counter() - start)))


class SpinningSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A selector that, when its loop goes idle right after handling something, polls (polled_select) for up to
    `spin_s` before it sleeps. A process that sleeps between the messages of a stream that comes every few
    milliseconds pays the wake-up of an idle core for each: on a pipeline's critical path, once per stage per
    token. It yields the core between polls, so a process computing on the same core is served first."""

    def __init__(self, spin_s: float) -> None:
        super().__init__()
        self.spin_s = spin_s
        self.active = False  # the last select returned events: more are likely soon

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = polled_select(super().select, self.spin_s if self.active else 0.0, timeout)
        self.active = bool(ready)
        return ready


def spinning_event_loop(spin_s: float) -> asyncio.AbstractEventLoop:
    """asyncio's loop on a SpinningSelector (uvloop takes no selector); the usual loop when spin_s is 0."""
    if spin_s <= 0:
        return new_event_loop()
    return asyncio.SelectorEventLoop(SpinningSelector(spin_s))
