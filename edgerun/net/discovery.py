"""Finding a master on the LAN by mDNS/DNS-SD (python-zeroconf): a master advertises `_edgerun._tcp` with the
port nodes join and the mode it runs; `edgerun node` without --master browses for one of its mode.

An advertisement is a hint, not a credential: a node still authenticates everything with the cluster key, and a
master with another key refuses it (KEY_REJECTED), which the node reports."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

SERVICE = "_edgerun._tcp.local."
FIND_TIMEOUT_S = 5.0  # how long a node listens for masters before it gives up


class ClusterKind(Enum):
    TP = "tp"  # tensor-parallel: nodes join over TCP + UDP (edgerun master --plan halo, edgerun serve)
    PP = "pp"  # pipeline: workers join over WebSocket (edgerun master --plan dp)
    MOE = "moe"  # mixture of experts: expert workers join a hub over WebSocket (edgerun master --plan moe)


@dataclass(frozen=True)
class Found:
    name: str  # the advertised instance, e.g. "edgerun on host-a"
    host: str  # an address to reach it at
    port: int
    mode: ClusterKind


def _addresses(host: str) -> list[bytes]:
    """The IPv4 addresses to advertise: `host` itself, or every interface's but loopback for a wildcard."""
    if host not in ("0.0.0.0", "", "::"):
        return [socket.inet_aton(socket.gethostbyname(host))]
    import psutil

    return [socket.inet_aton(a.address) for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


class Advertiser:
    """Announces one master until closed."""

    def __init__(self, mode: ClusterKind, host: str, port: int, name: str | None = None,
                 log: Callable[[str], None] = lambda _: None) -> None:
        from zeroconf import ServiceInfo, Zeroconf

        self.log = log
        addresses = _addresses(host)
        label = (name or f"edgerun {mode.value} on {socket.gethostname()}")[:50]
        self.info = ServiceInfo(SERVICE, f"{label} ({port}).{SERVICE}", addresses=addresses, port=port,
                                properties={"mode": mode.value, "version": "1"},
                                server=f"{socket.gethostname()}.local.")
        self.zeroconf = Zeroconf()
        # Registration probes the network for name conflicts (a few hundred ms): off the caller's path.
        self.thread = threading.Thread(target=self._register, daemon=True)
        self.thread.start()

    def _register(self) -> None:
        try:
            self.zeroconf.register_service(self.info, allow_name_change=True)
        except Exception as e:  # discovery is a convenience: --master still works without it
            self.log(f"announcing on the LAN by mDNS failed ({e}): nodes need --master")
        else:
            self.log(f"announced on the LAN by mDNS as '{self.info.name.removesuffix('.' + SERVICE)}'")

    def close(self) -> None:
        self.thread.join(timeout=5)
        try:
            self.zeroconf.unregister_service(self.info)
        finally:
            self.zeroconf.close()


def find_master(mode: ClusterKind, timeout_s: float = FIND_TIMEOUT_S) -> Found | None:
    """The first master of `mode` that answers within timeout_s, or None."""
    from zeroconf import ServiceBrowser, ServiceStateChange, Zeroconf

    zeroconf = Zeroconf()
    names: list[str] = []
    seen = threading.Event()

    def changed(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added:
            names.append(name)
            seen.set()

    browser = ServiceBrowser(zeroconf, SERVICE, handlers=[changed])
    deadline = time.monotonic() + timeout_s
    try:
        checked = 0
        while time.monotonic() < deadline:
            seen.wait(max(0.0, min(0.2, deadline - time.monotonic())))
            seen.clear()
            for name in names[checked:]:
                checked += 1
                info = zeroconf.get_service_info(SERVICE, name, timeout=1500)
                if info is None or not info.parsed_addresses():
                    continue
                found_mode = (info.properties or {}).get(b"mode", b"").decode()
                if found_mode == mode.value:
                    return Found(name.removesuffix("." + SERVICE), info.parsed_addresses()[0], info.port, mode)
        return None
    finally:
        browser.cancel()
        zeroconf.close()
