"""Shaping one network interface with the kernel: random loss, a rate limit, a delay.

- Loss: an nftables table of family netdev whose chain, hooked to the interface's ingress (or egress), drops a
  random share of its IP packets. Counters in the rule give the loss the kernel really applied. This works on
  kernels without sch_netem (the machines here) and measures itself, so it is used on every kernel. Only IP is
  dropped: ARP stays whole, as a link's loss would not usually starve address resolution for seconds.
- Rate: a token-bucket filter (tbf) as the interface's root qdisc.
- Delay: a netem qdisc, which only kernels built with sch_netem have; without it a delay is refused with the
  reason rather than silently left out.

The interface may live in a named network namespace (`netns`); everything is then done inside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from edgerun.errors import EdgerunError
from edgerun.net.kernel_loss import SCALE, nft
from edgerun.net.netns import entered

TABLE_PREFIX = "edgerun_link_"
HOOKS = ("ingress", "egress")
# tbf's queue may hold this much time's worth of traffic before it drops: long enough not to add loss of its
# own to a burst of activation fragments, short enough not to hide a link that is too slow.
TBF_LATENCY = "50ms"


@dataclass(frozen=True)
class LinkShape:
    """What to do to one interface: loss rate in [0, 1], rate in Mbit/s (None: unlimited), delay in ms."""
    loss: float = 0.0
    rate_mbit: float | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss <= 1.0:  # also refuses NaN
            raise EdgerunError(f"loss must be in [0, 1], got {self.loss}")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise EdgerunError(f"rate must be above 0 Mbit/s, got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise EdgerunError(f"delay must be 0 ms or more, got {self.delay_ms}")


def loss_table(device: str, hook: str) -> str:
    """The nft table that drops on `device`'s `hook`; names are identifiers, so other characters become _."""
    return TABLE_PREFIX + hook + "_" + re.sub(r"[^A-Za-z0-9_]", "_", device)


def _loss_ruleset(table: str, device: str, hook: str, rate: float) -> str:
    threshold = round(rate * SCALE)
    # Declaring the table first and deleting it makes the load replace an older table of the same name in one
    # transaction (a plain `delete` fails when there is none).
    return (f"table netdev {table} {{}}\ndelete table netdev {table}\n"
            f"table netdev {table} {{\n"
            f"  chain lossy {{\n    type filter hook {hook} device \"{device}\" priority filter; policy accept;\n"
            f"    meta protocol {{ ip, ip6 }} counter numgen random mod {SCALE} < {threshold} counter drop\n"
            f"  }}\n}}\n")


def set_loss(device: str, rate: float, hook: str = "ingress", netns: str | None = None) -> str:
    """Drop a share `rate` of the IP packets on `device`'s hook (ingress: arriving, egress: leaving); the table."""
    if hook not in HOOKS:
        raise EdgerunError(f"hook must be one of {', '.join(HOOKS)}, not {hook!r}")
    LinkShape(loss=rate)  # validates
    table = loss_table(device, hook)
    try:
        nft("-f", "-", script=_loss_ruleset(table, device, hook, rate), netns=netns)
    except EdgerunError as e:
        if hook == "egress" and "egress" in str(e):
            raise EdgerunError(f"{e} (the netdev egress hook needs Linux 5.16 or newer: try ingress)") from e
        raise
    return table


def loss_counters(table: str, netns: str | None = None) -> tuple[int, int]:
    """(IP packets that reached the draw, packets dropped) of a loss table."""
    listing = nft("list", "table", "netdev", table, netns=netns)
    counts = [int(n) for n in re.findall(r"counter packets (\d+)", listing)]
    if len(counts) != 2:
        raise EdgerunError(f"unexpected listing of {table}: {listing!r}")
    return counts[0], counts[1]


def loss_tables(netns: str | None = None) -> list[str]:
    """Names of the loss tables present."""
    names = []
    for line in nft("list", "tables", "netdev", netns=netns).splitlines():
        parts = line.split()  # "table netdev edgerun_link_ingress_eth0"
        if len(parts) == 3 and parts[2].startswith(TABLE_PREFIX):
            names.append(parts[2])
    return names


def clear_loss(device: str, netns: str | None = None, hooks: Sequence[str] = HOOKS) -> list[str]:
    """Delete the loss tables of `device` on `hooks` (default: both); the names deleted."""
    gone = []
    for table in loss_tables(netns):
        if table in (loss_table(device, hook) for hook in hooks):
            nft("delete", "table", "netdev", table, netns=netns)
            gone.append(table)
    return gone


def set_link_loss(device: str, rate: float, hooks: Sequence[str] = ("ingress",), netns: str | None = None) -> None:
    """Loss `rate` on exactly `hooks` of `device`: a table on another hook is removed, and rate 0 removes all."""
    clear_loss(device, netns, [h for h in HOOKS if rate == 0 or h not in hooks])
    if rate > 0:
        for hook in hooks:
            set_loss(device, rate, hook, netns)


@contextmanager
def _ipr(netns: str | None) -> Iterator[Any]:
    # A netlink socket belongs to the namespace it was opened in. (pyroute2's NetNS would fork a helper,
    # which can hang in a process that has threads.)
    with entered(netns), IPRoute() as ipr:
        yield ipr


def _index(ipr: Any, device: str) -> int:
    found = ipr.link_lookup(ifname=device)
    if not found:
        raise EdgerunError(f"no network interface {device}")
    return int(found[0])


def _tbf_burst(rate_mbit: float) -> int:
    # A bucket of 10 ms of traffic, and never below 64 KiB: smaller buckets throttle a burst of full-size
    # fragments below the rate asked for (the kernel's timer granularity).
    return max(65536, int(rate_mbit * 1e6 / 8 / 100))


def set_qdiscs(device: str, shape: LinkShape, netns: str | None = None) -> None:
    """Replace `device`'s root qdisc by what `shape` asks for: netem (delay), tbf (rate), both, or none."""
    with _ipr(netns) as ipr:
        index = _index(ipr, device)
        _delete_root(ipr, index)
        rate = None if shape.rate_mbit is None else f"{shape.rate_mbit * 1000:.0f}kbit"
        try:
            if shape.delay_ms > 0:
                ipr.tc("add", "netem", index, handle="1:", delay=int(shape.delay_ms * 1000))
                if rate is not None:  # netem's one class takes the rate limit as its child
                    ipr.tc("add", "tbf", index, parent="1:1", handle="10:", rate=rate,
                           burst=_tbf_burst(shape.rate_mbit or 0), latency=TBF_LATENCY)
            elif rate is not None:
                ipr.tc("add", "tbf", index, handle="1:", rate=rate, burst=_tbf_burst(shape.rate_mbit or 0),
                       latency=TBF_LATENCY)
        except NetlinkError as e:
            if shape.delay_ms > 0 and e.code in (2, 95):  # ENOENT, EOPNOTSUPP: no such qdisc in this kernel
                raise EdgerunError("a delay needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM);"
                                   " loss and rate work without it") from e
            raise EdgerunError(f"cannot set qdiscs on {device}: {e}") from e


def _delete_root(ipr: Any, index: int) -> bool:
    try:
        ipr.tc("del", index=index, handle="0:", parent=0xFFFFFFFF)
    except NetlinkError as e:
        if e.code in (2, 22):  # ENOENT / EINVAL: only the default qdisc is there
            return False
        raise
    return True


def clear_qdiscs(device: str, netns: str | None = None) -> bool:
    """Put `device` back on its default qdisc; whether a qdisc of ours was there."""
    with _ipr(netns) as ipr:
        return _delete_root(ipr, _index(ipr, device))


def qdisc_kinds(device: str, netns: str | None = None) -> list[str]:
    """The kinds of the qdiscs on `device`, root first ("tbf", "netem", "noqueue", ...)."""
    with _ipr(netns) as ipr:
        return [q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index=_index(ipr, device))]


def shape_link(device: str, shape: LinkShape, hooks: Sequence[str] = ("ingress",), netns: str | None = None) -> None:
    """Apply all of `shape` to `device`, its loss on `hooks`: qdiscs first, so no packet is lost before the
    rate holds."""
    set_qdiscs(device, shape, netns)
    set_link_loss(device, shape.loss, hooks, netns)
