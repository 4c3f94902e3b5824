"""Entering named network namespaces (the ones `ip netns` and pyroute2 create under /var/run/netns).

Python 3.11 has no os.setns, so this calls the C library's setns(2) directly. Entering changes the namespace of
the calling thread only; threads and processes it starts afterwards inherit it, and sockets it opens belong to
it for their whole life. That is how a master in this process serves a testbed: enter its namespace, open the
master's sockets and start its event-loop thread, go back.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from edgerun.errors import EdgerunError

NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise EdgerunError(f"cannot enter network namespace {what}: {os.strerror(errno)}")


def enter(name: str) -> None:
    """Move the calling thread into the named network namespace for good."""
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise EdgerunError(f"no network namespace {name} (is the testbed up?)") from e
    try:
        _setns(fd, name)
    finally:
        os.close(fd)


@contextmanager
def entered(name: str | None) -> Iterator[None]:
    """The calling thread inside namespace `name` (None: stay) until the context closes."""
    if name is None:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(name)
        try:
            yield
        finally:
            _setns(own, "of this process")
    finally:
        os.close(own)


def preexec(name: str | None, cgroup_procs: str | None = None) -> Callable[[], None] | None:
    """A subprocess preexec_fn that puts the child in namespace `name` and in a cgroup (its procs/tasks file)."""
    if name is None and cgroup_procs is None:
        return None

    def run_in_child() -> None:
        if cgroup_procs is not None:
            with open(cgroup_procs, "w") as f:
                f.write(str(os.getpid()))
        if name is not None:
            enter(name)

    return run_in_child
