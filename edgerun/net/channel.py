"""Sockets carrying wire-format packets on an event loop (uvloop where installed): the reader of reliable framed
TCP streams (tp.channel holds the tensor-parallel cluster's typed control streams on it), an authenticating UDP
receiver, and a lossy UDP sender usable from any thread."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from edgerun.net.loops import spinning_event_loop
from edgerun.net.loss import LossModel, NoLoss
from edgerun.net.wire import (
    FRAME_LENGTH,
    MAX_UDP_PAYLOAD,
    Added,
    Header,
    Reassembly,
    WireError,
    frame_length,
    open_packet,
)

T = TypeVar("T")

# Linux 6.15+ lets a socket lower TCP's minimum retransmission timeout (default 200 ms), which is
# also what a lone lost segment waits before its tail-loss probe.
TCP_RTO_MIN_US = 45
KERNEL_RTO_MIN_MS = 200.0
# struct tcp_info (linux/tcp.h): tcpi_total_retrans at byte 100, tcpi_data_segs_out at 156 (Linux 4.6+),
# tcpi_dsack_dups at 216 (Linux 5.0+).
TCP_INFO_BYTES = 160
TCP_INFO_DSACK_BYTES = 220
TCP_INFO_U32 = struct.Struct("<I")
TCP_INFO_RESENT_AT, TCP_INFO_DATA_OUT_AT, TCP_INFO_DSACK_AT = 100, 156, 216
IP_MTU = getattr(socket, "IP_MTU", 14)  # Linux's value; Python's socket module does not export it
ETHERNET_UDP_PAYLOAD = 1472  # a 1500-byte Ethernet MTU less IPv4 and UDP headers
# A control stream holds up to this many bytes of whole frames not yet taken before it stops reading its socket.
STREAM_LIMIT = 16 << 20


def resent_segments(info: bytes) -> tuple[int, int] | None:
    """(data segments sent, segments sent again because one was lost) from a struct tcp_info; None if too short.
    A segment sent again that the receiver already had comes back as a duplicate SACK (DSACK): it was sent again
    because an acknowledgement was late, not because anything was lost, and is not counted where the kernel says
    how many there were. On loopback every segment sent again was such a one (a busy receiver's late
    acknowledgement past a lowered retransmission timeout), and counted as loss they marked a clean link lossy."""
    if len(info) < TCP_INFO_BYTES:
        return None
    resent = TCP_INFO_U32.unpack_from(info, TCP_INFO_RESENT_AT)[0]
    if len(info) >= TCP_INFO_DSACK_BYTES:
        resent = max(0, resent - TCP_INFO_U32.unpack_from(info, TCP_INFO_DSACK_AT)[0])
    return TCP_INFO_U32.unpack_from(info, TCP_INFO_DATA_OUT_AT)[0], resent


def path_datagram_bytes(host: str, port: int) -> int:
    """The largest UDP payload that reaches (host, port) in one IP packet: the route's MTU less the IPv4 and UDP
    headers (65507 on loopback, 1472 on Ethernet). A datagram the kernel had to fragment would be lost whole with
    any one of its fragments, so vectors are cut to this size."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            mtu = s.getsockopt(socket.IPPROTO_IP, IP_MTU)
        except OSError:
            return ETHERNET_UDP_PAYLOAD
    return max(ETHERNET_UDP_PAYLOAD // 2, min(mtu - 28, MAX_UDP_PAYLOAD))


@dataclass
class Counters:
    """Packets refused, by reason; shared by a receiver's threads."""

    rejected: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.rejected.values())


def add_fragment(reassembly: Reassembly, header: Header, payload: bytes, counters: Counters) -> bool:
    """Take one fragment into its vector, counting a misfit or a duplicate as rejected; True the one
    time the fragment completes the vector."""
    try:
        added = reassembly.add(header, payload)
    except WireError:
        counters.reject("misfit")
        return False
    if added is Added.DUPLICATE:
        counters.reject("duplicate")
    return added is Added.COMPLETED


class LossyUdp:
    """A UDP socket for sending, through an in-process loss model (real kernel loss comes from the
    testbed). Datagrams are received by `listen_datagrams` on the event loop."""

    def __init__(self, key: bytes, host: str = "0.0.0.0", port: int = 0, loss: LossModel | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.key = key
        self.loss = loss or NoLoss()
        self.sent = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def send_all(self, datagrams: list[bytes], addr: tuple[str, int]) -> None:
        # One lock round per call, not per datagram: a master sends every block to each of its nodes.
        with self._lock:
            self.sent += len(datagrams)
            if not isinstance(self.loss, NoLoss):
                kept = [d for d in datagrams if not self.loss.drop()]
                self.dropped += len(datagrams) - len(kept)
                datagrams = kept
        for d in datagrams:
            try:
                self.sock.sendto(d, addr)
            except OSError:
                with self._lock:
                    self.dropped += 1

    def close(self) -> None:
        self.sock.close()


Sends = list[tuple[list[bytes], tuple[str, int]]]  # datagrams and where each batch goes, in order


class SendThread:
    """Sends batches of datagrams through a LossyUdp on a thread of its own, in the order they were handed over,
    while the caller goes on. A send's kernel work (on one host, the receiver's network stack runs inside the
    sender's system call: 20-30 µs a datagram through a testbed's veth and nftables) then runs on the thread's
    core, not the caller's: what a master sends besides a block's data, its parity, no longer delays its own share."""

    def __init__(self, udp: LossyUdp) -> None:
        self.udp = udp
        self.jobs: queue.SimpleQueue[Sends | threading.Event | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="edgerun-send", daemon=True)
        self.thread.start()

    def send(self, batches: Sends) -> None:
        self.jobs.put(batches)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything handed over so far is sent; False if that took longer than `timeout_s`."""
        done = threading.Event()
        self.jobs.put(done)
        return done.wait(timeout_s)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(STOP_WAIT_S)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            for datagrams, addr in job:
                self.udp.send_all(datagrams, addr)  # a failed send counts as dropped


# How long stopping an event loop thread waits for its thread, its tasks and its executor's jobs, each.
STOP_WAIT_S = 10.0


class _Turn:
    """A coroutine EventLoopThread.run_in_turn hands over, and its outcome once it has run."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.outcome: tuple[bool, Any] | None = None  # (returned, its value or exception)
        self.done = threading.Event()

    async def run(self) -> None:
        try:
            self.outcome = (True, await self.coro)
        except BaseException as e:  # handed to the caller, whose call raises it
            self.outcome = (False, e)
        self.done.set()

    def abandon(self) -> None:
        if self.outcome is None:
            self.coro.close()
            self.outcome = (False, RuntimeError("the event loop stopped before this step ran"))
        self.done.set()

    def result(self) -> Any:
        # Waited for asleep: a caller polling through the step took the core from the step's own thread where they
        # share one (bench tp --pin), for no gain (A/B here, master + 1 node: 24.3 ms a token against 23.2 asleep).
        self.done.wait()
        assert self.outcome is not None
        returned, value = self.outcome
        if returned:
            return value
        raise value


class EventLoopThread:
    """An event loop running in its own thread: the network side of a master or node. Other threads
    (generation, compute) hand it coroutines with `run` and send through thread-safe channels. With `spin_s` the
    loop polls for that long before sleeping (SpinningSelector), and so does a thread waiting in `run` while it is
    the only one waiting: both wake-ups of a reply are then taken off its path. Several waiting threads (a
    pipeline's batch lanes) wait asleep: each poll takes the interpreter, and the loop thread, which must read
    their replies, then waits for it. (A pipeline of 4 workers serving 8 streams in 4 lanes, device machine:
    12.5 tok/s with every process polling against 15.0 with none; with this rule 12.5-14.4 against 13.1.)"""

    def __init__(self, spin_s: float = 0.0) -> None:
        self.spin_s = spin_s
        self.loop = spinning_event_loop(spin_s)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        # run_in_turn's coroutines waiting for the task that runs them (None: no such task now)
        self._turns: collections.deque[_Turn] | None = None
        self._turns_lock = threading.Lock()
        self._waiting = 0  # threads waiting in `run`
        self._waiting_lock = threading.Lock()

    def run_in_turn(self, coro: Coroutine[Any, Any, T], spin_s: float) -> T:
        """`run` for a caller that hands the loop one coroutine after another (a generation's steps). With spin_s,
        one task on the loop runs them in turn, and after each polls for the next for up to spin_s without going
        back to the loop; each hands its result to the caller as it ends. A step then skips the rounds of the loop
        that `run` takes each way (a task made, a future's callbacks scheduled: ~90 µs of every tensor-parallel
        token on the master here, its caches cold after the LM head's kernels). The loop's other work waits
        meanwhile, at most spin_s after a step. Without spin_s, `run`. Polling holds a core: for a process that has
        one of its own."""
        if spin_s <= 0:
            return self.run(coro)
        turn = _Turn(coro)
        with self._turns_lock:
            waiting = self._turns
            if waiting is not None:  # the task is polling for it (or about to)
                waiting.append(turn)
            else:
                self._turns = collections.deque([turn])
        if waiting is None:
            self.submit(self._take_turns(spin_s)).add_done_callback(self._turns_ended)
        return turn.result()

    def _turns_ended(self, _: concurrent.futures.Future) -> None:
        """The task of turns ended: the turns it left (the loop stopped, its task cancelled) end with an error."""
        with self._turns_lock:
            left, self._turns = self._turns or collections.deque(), None
        for turn in left:
            turn.abandon()

    async def _take_turns(self, spin_s: float) -> None:
        """Run run_in_turn's coroutines as they come, polling spin_s for each next one; then end."""
        while True:
            with self._turns_lock:
                if not self._turns:
                    self._turns = None
                    return
                turn = self._turns.popleft()
            await turn.run()
            end = time.perf_counter() + spin_s
            while not self._turns and time.perf_counter() < end:
                os.sched_yield()  # the caller takes the interpreter, samples and hands the next step over

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future = self.submit(coro)
        if self.spin_s > 0:
            with self._waiting_lock:
                self._waiting += 1
            try:
                end = time.perf_counter() + (self.spin_s if timeout is None else min(self.spin_s, timeout))
                while self._waiting == 1 and not future.done() and time.perf_counter() < end:
                    os.sched_yield()
                return future.result(timeout)
            finally:
                with self._waiting_lock:
                    self._waiting -= 1
        return future.result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the loop; its future, to wait on from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], T]) -> T:
        """Run a plain function on the loop thread and return its result."""

        async def call() -> T:
            return fn()

        return self.run(call())

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop the loop and, from any other thread, wait for it: its tasks are cancelled, its executor's jobs
        (a stage graph being built, a file being fetched) finish, and the loop is closed. A loop left running
        in its daemon thread, or a job still in its executor, meets the interpreter's teardown at exit, where
        native code (uvloop's handles, onnx, numpy) can crash the process after everything else has passed."""
        if self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed by another thread meanwhile
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is self.thread:
            return  # the loop stops when this callback returns; nothing here can wait for it
        self.thread.join(timeout_s)
        if self.thread.is_alive() or self.loop.is_closed():
            return  # stuck in a blocking call: left to the daemon thread rather than hanging the caller

        async def finish() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout_s)
            await asyncio.wait_for(self.loop.shutdown_default_executor(), timeout_s)

        with contextlib.suppress(Exception):
            self.loop.run_until_complete(finish())
        with contextlib.suppress(RuntimeError):
            self.loop.close()


class FrameReader(asyncio.BufferedProtocol):
    """The reading side of a control stream: each length-prefixed frame is read from the socket straight into a
    buffer of its own, the one copy the kernel makes. asyncio's StreamReader copied every frame twice more on its
    way (into its buffer, then out as bytes) and paused its socket whenever it held more than its limit: a
    prefill's frame (a 70-token vector of a 1B model is 573 KB, to every node and back from each) took 1.2 ms to
    cross loopback that way and 0.45-0.5 ms this way. Whole frames wait for `next` up to STREAM_LIMIT bytes;
    beyond that the socket is not read until they are taken. `on_connection` runs when the connection is made
    (a server's handler for it)."""

    def __init__(self, on_connection: Callable[[FrameReader], None] | None = None) -> None:
        self.on_connection = on_connection
        self.transport: asyncio.Transport | None = None
        self._prefix = bytearray(FRAME_LENGTH.size)
        self._frame: bytearray | None = None  # the frame being read, once its length is known
        self._filled = 0  # bytes of the prefix, or of the frame, read so far
        self._frames: collections.deque[bytearray] = collections.deque()
        self._queued = 0  # bytes in _frames
        self._paused = False
        self._error: Exception | None = None  # what ends the stream, raised once its frames are taken
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.on_connection is not None:
            self.on_connection(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._error is not None:  # what comes after a length not to be trusted is read into nothing
            self._filled = 0
            return memoryview(self._prefix)
        return memoryview(self._prefix if self._frame is None else self._frame)[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._frame is None:
            if self._filled < len(self._prefix) or self._error is not None:
                return
            try:  # the master's KEY_REJECTED, or a length no frame has: nothing after it can be trusted
                self._frame, self._filled = bytearray(frame_length(bytes(self._prefix))), 0
            except WireError as e:
                self._end(e)
                self.transport.close()
        elif self._filled == len(self._frame):
            self._frames.append(self._frame)
            self._queued += len(self._frame)
            self._frame, self._filled = None, 0
            if self._queued > STREAM_LIMIT and not self._paused:
                self.transport.pause_reading()
                self._paused = True
            self._wake()

    def eof_received(self) -> bool:
        self._end(ConnectionError("connection closed"))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ConnectionError("connection closed" if exc is None else f"connection lost: {exc}"))

    def _end(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> bytearray:
        """The next whole frame (without its length prefix); what ended the stream once none is left."""
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        frame = self._frames.popleft()
        self._queued -= len(frame)
        if self._paused and self._queued <= STREAM_LIMIT // 2:
            self.transport.resume_reading()
            self._paused = False
        return frame


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value, which Python does not name
STAMP = struct.Struct("qq")  # the stamp's struct timespec: seconds, nanoseconds
STAMP_BYTES = socket.CMSG_SPACE(STAMP.size)


def arrival_time(ancillary: Sequence[tuple[int, int, bytes]], clock_offset: float) -> float:
    """When a datagram arrived, in perf_counter time, from its kernel stamp (realtime, shifted by `clock_offset`);
    now where it carries none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= STAMP.size:
            seconds, nanoseconds = STAMP.unpack_from(data)
            return seconds + nanoseconds * 1e-9 + clock_offset
    return time.perf_counter()


class DatagramSocket:
    """A UDP socket whose authentic datagrams go to a callback: read by the event loop while the loop is idle,
    and straight off the socket by the loop's own thread while it waits on a block (`drain`), with no event-loop
    round per packet.

    With `spin_s` > 0 a reader that runs out of datagrams keeps polling the socket, without sleeping, for that
    long before it blocks: on virtualized machines a sleeping thread takes a few hundred microseconds to wake
    when a packet comes, more than a whole round trip. `drain` spins so until its block is whole; the loop's own
    reader spins so only with `idle_spin` (a node, whose work all comes as datagrams: a master awaits its
    coroutines on that loop, which a spinning reader would hold up for spin_s after every stray datagram). It
    stops spinning at once when one of the `watch` descriptors (TCP streams the event loop reads) has data, and
    the loop's own reader returns to the loop at least every MAX_SPIN_S so its timers (heartbeats) run. Spinning
    holds a core: use it where each process has one of its own.

    `needless(data)`, where given, is asked of every datagram before its MAC is checked: True leaves it unread
    (a parity fragment of a vector already whole, see wire.peek_parity), counted in `skipped`."""

    MAX_SPIN_S = 0.05

    def __init__(self, host: str, key: bytes, counters: Counters,
                 on_packet: Callable[[Header, bytes, tuple[str, int]], None], spin_s: float = 0.0,
                 idle_spin: bool = False, needless: Callable[[bytes], bool] | None = None,
                 sock: socket.socket | None = None) -> None:
        """`sock`: a bound, non-blocking socket to read (a multicast group's, net.group) instead of a new one on
        an ephemeral port of `host`."""
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.bind((host, 0))
            sock.setblocking(False)
        self.sock = sock
        self.port = self.sock.getsockname()[1]
        # The kernel stamps each datagram as it arrives: a reader busy with other work (the master computing its
        # own share) still learns when a partial came, not when it got round to reading it.
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.stamped = True
        except OSError:
            self.stamped = False
        self.arrived_at = 0.0  # the datagram being handed to the callback: when it arrived (perf_counter time)
        self.key, self.counters, self.on_packet, self.needless = key, counters, on_packet, needless
        self.skipped = 0  # datagrams `needless` left unread
        self.spin_s, self.idle_spin = spin_s, idle_spin
        self._watched = select.poll()  # descriptors that end a spin of the loop's reader (watch_streams)
        self._drain_poller: tuple[list[int] | None, select.poll | None] = (None, None)  # drain's, by its watch
        self.loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read on `loop` whenever it is idle (call on the loop's thread)."""
        self.loop = loop
        loop.add_reader(self.sock.fileno(), self.read_all)

    def set_reader(self, reader: Callable[[], None] | None) -> None:
        """What reads the socket when the loop finds it readable: `reader` (a node's native server), or read_all.
        On the loop's thread."""
        if self.loop is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.add_reader(self.sock.fileno(), reader or self.read_all)

    def watch_streams(self, fds: list[int]) -> None:
        """The descriptors (TCP streams the loop reads) whose data ends a spin of the loop's reader."""
        self._watched = self._poller(fds, udp=False)

    def read_all(self) -> None:
        """Hand every datagram waiting on the socket to the callback (and with idle_spin, those that come within
        spin_s)."""
        self.read_waiting()
        if self.idle_spin and self.spin_s > 0:
            started = time.perf_counter()
            self._spin(lambda: False, lambda: started + self.MAX_SPIN_S, self._watched)

    def read_waiting(self) -> int:
        """Hand every datagram waiting now to the callback, without spinning; how many were read."""
        n = 0
        clock_offset = time.perf_counter() - time.time()  # realtime stamps to perf_counter time
        while True:
            try:
                if self.stamped:
                    data, ancillary, _, addr = self.sock.recvmsg(MAX_UDP_PAYLOAD + 64, STAMP_BYTES)
                else:
                    data, addr = self.sock.recvfrom(MAX_UDP_PAYLOAD + 64)
                    ancillary = ()
            except (BlockingIOError, InterruptedError):
                return n
            except OSError:  # e.g. an ICMP error from an earlier send to a node that left
                continue
            n += 1
            self.handle(data, arrival_time(ancillary, clock_offset), addr)

    def handle(self, data: bytes, arrived_at: float, addr: tuple[str, int]) -> None:
        """One datagram read off the socket (here, or handed back by the native data path), which arrived at
        `arrived_at` (perf_counter time): checked and given to the callback, or counted as rejected or needless."""
        if self.needless is not None and self.needless(data):
            self.skipped += 1
            return
        self.arrived_at = arrived_at
        try:
            header, payload = open_packet(data, self.key)
        except WireError as e:
            self.counters.reject(str(e).split(" ")[0])
            return
        self.on_packet(header, payload, addr)

    def _poller(self, watch: list[int], udp: bool) -> select.poll:
        poller = select.poll()
        for fd in [self.sock.fileno()] * udp + [fd for fd in watch if fd >= 0]:
            poller.register(fd, select.POLLIN)
        return poller

    def _spin(self, done: Callable[[], bool], until: Callable[[], float], watched: select.poll) -> bool:
        """Read without sleeping until done(), until() passes, or spin_s passes with nothing read: True; False as
        soon as a watched descriptor has data."""
        idle_until = time.perf_counter() + self.spin_s
        spins = 0
        while not done():
            now = time.perf_counter()
            if now >= until() or now >= idle_until:
                return True
            if self.read_waiting():
                idle_until = time.perf_counter() + self.spin_s
            else:
                os.sched_yield()  # a process computing on this core (more processes than cores) goes first
            spins += 1
            if spins % 32 == 0 and watched.poll(0):
                return False
        return True

    def drain(self, done: Callable[[], bool], until: Callable[[], float], watch: list[int]) -> bool:
        """Read datagrams on this thread until done() or the perf_counter time until() (re-read after every
        packet: an arrival may move it). False as soon as one of the `watch` descriptors (TCP streams the event
        loop reads) has data or closes: the caller must then let the loop run. What waits on the socket already is
        read first, deadline or not: a partial that came while the reader was busy (computing its own share)
        is there to be taken."""
        self.read_waiting()
        if self.spin_s > 0 and not self._spin(done, until, self._poller(watch, udp=False)):
            return False
        if self._drain_poller[0] != watch:  # the same streams block after block: one poller for them
            self._drain_poller = (list(watch), self._poller(watch, udp=True))
        poller = self._drain_poller[1]
        udp = self.sock.fileno()
        while not done():
            remaining = until() - time.perf_counter()
            if remaining <= 0:
                return True
            for fd, _ in poller.poll(min(remaining, 1.0) * 1000):
                if fd != udp:
                    return False
                self.read_waiting()
        return True

    def close(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
