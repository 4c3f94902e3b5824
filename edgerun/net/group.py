"""The multicast group a tensor-parallel master sends its one-token inputs to.

Every node of a block takes the same input. Sent to each node, it costs the master one system call and one copy on
the wire per node, and the last node gets it that much after the first: on loopback each unicast datagram is
delivered inside the sender's call (7 nodes x 8 KB: ~50 µs on this 2-core machine, against ~7-11 µs for one
multicast send to 7 member sockets), and on a gigabit LAN each 8 KB copy holds the wire for 66 µs. Sent to a group,
the master sends once and the switch (or the kernel, on one host) copies it.

A group is an administratively scoped address (239.255.0.0/16, which routers do not forward) and a port, picked at
random by the master. A node joins it on the interface that faces the master and reads it beside its own socket.
Multicast may not reach a node (a routed path, a network that filters it), so the master uses the group for a node
only after the node has echoed a probe sent to the group (`PROBE_LAYER`); other nodes keep their unicast inputs.
"""

from __future__ import annotations

import math
import random
import socket
import time

PROBE_LAYER = 0xFFFF  # a probe sent to the group carries this layer; the node echoes it with its own index


def new_group(rng: random.Random | None = None) -> tuple[str, int]:
    """A random group address of the local scope and a port for it."""
    rng = rng or random.SystemRandom()
    return f"239.255.{rng.randrange(256)}.{rng.randrange(1, 255)}", rng.randrange(20000, 60000)


def send_to_groups(sock: socket.socket, interface: str) -> None:
    """Let `sock` send to groups out of `interface` (the master's address facing its nodes), one hop, to members on
    this host too."""
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)


def join_group(group: tuple[str, int], interface: str) -> socket.socket:
    """A non-blocking socket that receives the group's datagrams on `interface` (this host's address facing the
    master). Several sockets of one host may join the same group: each gets every datagram. OSError where the host
    cannot join."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.bind(group)  # the group's address: unicast datagrams to the port do not come here
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        socket.inet_aton(group[0]) + socket.inet_aton(interface))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class GroupSender:
    """A master's side of its group: where it is, and its probes. `probe` sends one (out of the interface that faces
    the nodes, set on the socket before the first) when one is `due`; OSError where the host cannot send there."""

    PROBE_S = 0.2  # a node that has not echoed a probe is probed again this often (one datagram)

    def __init__(self, group: tuple[str, int]) -> None:
        self.group = group
        self.probed = -math.inf  # monotonic time of the last probe
        self.sending = False  # the socket sends to groups out of the right interface

    def due(self) -> bool:
        return time.monotonic() - self.probed >= self.PROBE_S

    def probe(self, sock: socket.socket, probe: bytes, interface: str) -> None:
        """Send `probe` (a sealed PROBE of layer PROBE_LAYER) to the group from `sock`."""
        self.probed = time.monotonic()
        if not self.sending:
            send_to_groups(sock, interface)
            self.sending = True
        sock.sendto(probe, self.group)
