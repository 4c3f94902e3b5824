"""The cores a benchmark gives each device it starts on one machine (--pin): every process of a cluster on cores of
its own, as separate machines have, one hardware thread of each physical core first."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path


def physical_first(cores: Iterable[int], siblings_of: Callable[[int], Sequence[int]] | None = None) -> tuple[int, ...]:
    """The cores, one hardware thread of every physical core before the second thread of any: two devices pinned
    to the two threads of one core share its execution units (one spinning for a packet slows the other's
    kernels), which separate machines do not. `siblings_of(core)`: the hardware threads of its physical core
    (default: Linux's topology files; a core without them is a core of its own)."""
    def rank(core: int) -> int:
        siblings = sorted((siblings_of or _siblings)(core))
        return siblings.index(core) if core in siblings else 0
    return tuple(sorted(cores, key=lambda core: (rank(core), core)))


def _siblings(core: int) -> list[int]:
    """The hardware threads of a core's physical core, from sysfs (e.g. "0,8" or "0-1")."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return [core]
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


# The cores this process may use, taken before --pin narrows them to the master's.
USABLE_CORES = physical_first(os.sched_getaffinity(0))


def device_cores(device: int, cores: int) -> set[int] | None:
    """The cores of device `device` (0: the master) under --pin: the next `cores` of those this process may use
    (in physical_first's order), device after device, wrapping around when there are more devices than cores;
    None unpinned."""
    if cores < 1:
        return None
    return {USABLE_CORES[(device * cores + k) % len(USABLE_CORES)] for k in range(cores)}


@contextlib.contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """Every thread of this process on `cores` (threads started inside inherit it), as it was afterwards."""
    if cores is None:
        yield
        return
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    before = os.sched_getaffinity(0)
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cores)
    try:
        yield
    finally:
        for tid in [int(t) for t in os.listdir("/proc/self/task")]:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before)
