"""Kernel packet loss on loopback (nftables): measured UDP loss rate, untouched ports, TCP integrity, cleanup.

The tests that change nftables skip where loss_supported() says kernel loss cannot work here (not root,
no nft binary, no nf_tables in the kernel).
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from edgerun.net import kernel_loss
from edgerun.net.kernel_loss import TABLE_PREFIX, loopback_loss, loss_counters, loss_supported, remove_stale_tables

MSS = 1400  # TCP segment size for the TCP test, about an Ethernet frame's
SIGMAS = 5.0  # tolerance for empirical rates; a false failure at 5 sigma has odds under 1e-6


@pytest.fixture
def nft_ok() -> None:
    reason = loss_supported()
    if reason is not None:
        pytest.skip(reason)


def tables() -> set[str]:
    return {line.split()[-1] for line in kernel_loss.nft("list", "tables").splitlines() if line.strip()}


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # A large receive buffer, so that no datagram is lost to a full queue: all loss is the rule's.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def drain(sock: socket.socket, seen: set[int]) -> None:
    while True:
        try:
            seen.add(int.from_bytes(sock.recv(64)[:4], "big"))
        except BlockingIOError:
            return


def test_rate_zero_creates_nothing() -> None:
    # Needs neither root nor nft: nothing is run.
    with loopback_loss(0.0, [1234], [1234]) as table:
        assert table == ""


@pytest.mark.parametrize("rate", [-0.1, 1.5, math.nan])
def test_rate_out_of_range(rate: float) -> None:
    with pytest.raises(ValueError), loopback_loss(rate, [], [1234]):
        pass


def test_ruleset_text() -> None:
    text = kernel_loss._ruleset("edgerun_loss_1_0", 2000, [80, 443], [9000])
    assert "numgen random mod 10000 < 2000 counter drop" in text
    assert 'iif "lo" tcp sport { 80, 443 } jump lossy' in text
    assert 'iif "lo" tcp dport { 80, 443 } jump lossy' in text
    assert 'iif "lo" udp dport { 9000 } jump lossy' in text
    assert "hook input" in text and "hook output" not in text


def test_udp_loss_rate_and_untouched_port(nft_ok: None) -> None:
    rate, n = 0.2, 2000
    lossy, clean = udp_socket(), udp_socket()
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    got_lossy: set[int] = set()
    got_clean: set[int] = set()
    try:
        with loopback_loss(rate, [], [lossy.getsockname()[1]], label="test udp") as table:
            assert table.startswith(TABLE_PREFIX) and table.endswith("_test_udp")
            assert table in tables()
            for i in range(n):
                payload = i.to_bytes(4, "big") + bytes(28)
                sender.sendto(payload, lossy.getsockname())
                sender.sendto(payload, clean.getsockname())
                if i % 100 == 99:  # pace lightly and empty the queues as we go
                    time.sleep(0.002)
                    drain(lossy, got_lossy)
                    drain(clean, got_clean)
            time.sleep(0.1)
            drain(lossy, got_lossy)
            drain(clean, got_clean)
            matched, dropped = loss_counters(table)
    finally:
        for sock in (lossy, clean, sender):
            sock.close()
    assert table not in tables()
    assert len(got_clean) == n
    # Every datagram to the lossy port met the rule, and the rule's drops are the only losses.
    assert (matched, dropped) == (n, n - len(got_lossy))
    expected = 1.0 - rate
    tolerance = SIGMAS * math.sqrt(rate * (1.0 - rate) / n)
    received = len(got_lossy) / n
    assert abs(received - expected) <= tolerance, f"received {received:.4f}, expected {expected} ± {tolerance:.4f}"


def test_table_deleted_on_exception(nft_ok: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), loopback_loss(0.5, [40000], [40001]) as table:
        assert table in tables()
        raise RuntimeError("boom")
    assert table not in tables()


def test_tcp_delivers_everything_under_loss(nft_ok: None) -> None:
    data = os.urandom(8 << 20)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # nftables sees loopback's segmentation-offload packets, up to 64 KiB each (TCP segments are never split on
    # lo), so a few MiB are only a few hundred packets. An Ethernet-sized MSS, advertised by both ends, gives
    # smaller bursts and so more packets (measured: 3x), enough for 5 % loss to hit some.
    server.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MSS)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(60)
    digest: list[str] = []
    received: list[int] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            h, count = hashlib.sha256(), 0
            while chunk := conn.recv(1 << 16):
                h.update(chunk)
                count += len(chunk)
            received.append(count)
            digest.append(h.hexdigest())
            conn.sendall(b"ok")  # the reply travels through the lossy rule too (sport is the server's)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    start = time.perf_counter()
    with loopback_loss(0.05, [server.getsockname()[1]], []) as table, server:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MSS)
            client.settimeout(60)
            client.connect(server.getsockname())
            for i in range(0, len(data), 1 << 14):
                client.sendall(data[i:i + (1 << 14)])
            client.shutdown(socket.SHUT_WR)
            reply = client.recv(16)
        thread.join(60)
        matched, dropped = loss_counters(table)
    elapsed = time.perf_counter() - start
    assert reply == b"ok"
    assert received == [len(data)]
    assert digest == [hashlib.sha256(data).hexdigest()]
    assert matched >= 300 and dropped > 0  # TCP really lost segments and recovered them
    print(f"8 MiB over TCP at 5% loss: {elapsed:.2f} s, {dropped} of {matched} packets dropped")


def test_remove_stale_tables(nft_ok: None) -> None:
    # A pid that surely belongs to no live process: a child that has exited and been reaped.
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    dead = f"{TABLE_PREFIX}{int(child.stdout)}_0"
    live = f"{TABLE_PREFIX}{os.getpid()}_999999"
    kernel_loss.nft("-f", "-", script=f"table inet {dead} {{}}\ntable inet {live} {{}}\n")
    try:
        removed = remove_stale_tables()
        assert dead in removed and live not in removed
        remaining = tables()
        assert dead not in remaining and live in remaining
    finally:
        for name in (dead, live):
            if name in tables():
                kernel_loss.nft("delete", "table", "inet", name)
