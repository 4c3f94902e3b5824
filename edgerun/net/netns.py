"""Entering named network namespaces (the ones `ip netns` and pyroute2 create under /var/run/netns).

Python 3.11 has no os.setns, so this calls the C library's setns(2) directly. Entering changes the namespace of
the calling thread only; threads and processes it starts afterwards inherit it, and sockets it opens belong to
it for their whole life. That is how a master in this process serves a testbed: enter its namespace, open the
master's sockets and start its event-loop thread, go back. A program started from inside the context runs in
the namespace too. (A subprocess preexec_fn could enter it in the forked child instead, but in a process with
threads the child can block forever on a lock another thread held at the fork.)
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
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


_MS_BIND = 4096
_MNT_DETACH = 2


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise EdgerunError(f"{what}: {os.strerror(errno)}")


def create(name: str) -> None:
    """Create a named network namespace, as `ip netns add` does: a new namespace, kept alive by a bind mount of
    it on /var/run/netns/NAME. Made in a thread of its own (unshare moves only the calling thread), so nothing
    forks: forking a process with threads can leave the child blocked on a lock for ever."""
    path = os.path.join(NETNS_DIR, name)
    os.makedirs(NETNS_DIR, exist_ok=True)
    if os.path.exists(path):
        raise EdgerunError(f"network namespace {name} exists already")
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444))
    failure: list[BaseException] = []

    def make() -> None:
        try:
            _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            _check(_libc.mount(b"/proc/thread-self/ns/net", path.encode(), None, _MS_BIND, None),
                   f"bind-mounting the new namespace on {path}")
        except BaseException as e:  # reported by the caller's thread
            failure.append(e)

    thread = threading.Thread(target=make, name=f"netns-{name}")
    thread.start()
    thread.join()
    if failure:
        os.unlink(path)
        raise failure[0]


def remove(name: str) -> None:
    """Delete a named network namespace (it lives on while a process is still inside it)."""
    path = os.path.join(NETNS_DIR, name)
    _libc.umount2(path.encode(), _MNT_DETACH)  # fails harmlessly when a crash left the file unmounted
    os.unlink(path)


def names() -> list[str]:
    """The named network namespaces."""
    return sorted(os.listdir(NETNS_DIR)) if os.path.isdir(NETNS_DIR) else []
