"""Real kernel packet loss on the loopback interface, for comparing TCP and UDP under loss on one machine.

The in-process loss models (edgerun.net.loss) drop datagrams before they are sent, which cannot show what
loss does to TCP: TCP's retransmissions and congestion control only react to segments the kernel really
loses. This module makes the kernel lose them, with an nftables table of its own in the current network
namespace that drops a random share of the loopback packets of the given ports.

Drops happen on the input hook (receiving side): a drop on the output hook makes sendto() fail with EPERM,
which a sender sees as an error instead of as a silent loss. Everything sent over loopback passes input, so
one input rule on the ports of a TCP listener covers both directions of its connections.

The kernel's `numgen random` cannot be seeded, so kernel loss is not reproducible run to run; `label`
names the table (it is appended to the table's name) so that a table can be traced to its run.

Needs root (CAP_NET_ADMIN) and the `nft` binary: found on PATH (and /usr/sbin, /sbin), or given as a path
in the environment variable EDGERUN_NFT for machines where nftables is unpacked outside PATH.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from edgerun.errors import EdgerunError
from edgerun.net.netns import entered

NFT_ENV = "EDGERUN_NFT"
TABLE_PREFIX = "edgerun_loss_"
# numgen draws an integer in [0, SCALE); a packet is dropped when the draw is below round(rate * SCALE),
# so rates resolve to 0.01 %.
SCALE = 10_000
# The PATH of a non-root shell often lacks the sbin directories, where Debian and Ubuntu put nft.
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
_TIMEOUT_S = 10.0

_counter = itertools.count()


def nft_binary() -> str:
    """Path of the nft binary: $EDGERUN_NFT if set, else nft on PATH or in the sbin directories."""
    configured = os.environ.get(NFT_ENV)
    if configured:
        # An explicit setting that does not work is an error, not a reason to fall back silently to another nft.
        if not (os.path.isfile(configured) and os.access(configured, os.X_OK)):
            raise EdgerunError(f"{NFT_ENV}={configured} is not an executable file")
        return configured
    search = os.pathsep.join([os.environ.get("PATH", os.defpath), *_SBIN])
    found = shutil.which("nft", path=search)
    if found is None:
        raise EdgerunError(f"nft not found: apt-get install nftables (or set {NFT_ENV} to an nft binary)")
    return found


def nft(*args: str, script: str | None = None, netns: str | None = None) -> str:
    """Run nft with arguments (and a ruleset on stdin for `-f -`), inside network namespace `netns` if given;
    its stdout, or EdgerunError with its stderr."""
    cmd = [nft_binary(), *args]
    try:
        with entered(netns):
            done = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except OSError as e:  # not executable, wrong architecture, missing interpreter of a wrapper script
        raise EdgerunError(f"cannot run {cmd[0]}: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise EdgerunError(f"{' '.join(cmd)} did not finish in {_TIMEOUT_S:.0f} s") from e
    if done.returncode != 0:
        # nft reports a syntax error over several lines (message, source line, caret); errors here are one line.
        detail = "; ".join(line.strip() for line in done.stderr.splitlines() if line.strip()) or "no message"
        raise EdgerunError(f"{' '.join(cmd)} failed (exit {done.returncode}): {detail}")
    return done.stdout


def loss_supported() -> str | None:
    """None if kernel loss can work here, else the reason it cannot (one line)."""
    if os.geteuid() != 0:
        return "kernel loss needs root (CAP_NET_ADMIN to change nftables)"
    try:
        # Listing proves the binary runs, its libraries load and the kernel answers nf_tables requests; the
        # check-only load (-c: the kernel validates the batch, then aborts it) proves it has every expression used.
        nft("list", "ruleset")
        nft("-c", "-f", "-", script=_ruleset(f"{TABLE_PREFIX}probe", 1, [1], [1]))
    except EdgerunError as e:
        return str(e)
    return None


def _check_ports(name: str, ports: Sequence[int]) -> list[int]:
    checked = sorted({int(p) for p in ports})
    bad = [p for p in checked if not 0 < p < 65536]
    if bad:
        raise ValueError(f"{name} must be in 1..65535, got {bad}")
    return checked


def _ruleset(table: str, threshold: int, tcp_ports: list[int], udp_ports: list[int]) -> str:
    def port_set(ports: list[int]) -> str:
        return "{ " + ", ".join(map(str, ports)) + " }"

    rules = []
    if tcp_ports:
        # Both directions of a connection to a listed port arrive on lo: the client's segments carry it as
        # dport, the server's as sport.
        rules += [f'iif "lo" tcp sport {port_set(tcp_ports)} jump lossy',
                  f'iif "lo" tcp dport {port_set(tcp_ports)} jump lossy']
    if udp_ports:
        rules.append(f'iif "lo" udp dport {port_set(udp_ports)} jump lossy')
    body = "\n".join(f"    {rule}" for rule in rules)
    # The draw lives in its own chain that ends in accept, so a packet matching several rules (a TCP segment
    # between two listed ports) is drawn once and lost with probability `rate`, not more.
    # The counters (packets that reached the draw, packets dropped) let a benchmark report the loss it really got.
    return (f"table inet {table} {{\n"
            f"  chain lossy {{\n    counter numgen random mod {SCALE} < {threshold} counter drop\n    accept\n  }}\n"
            f"  chain input {{\n    type filter hook input priority filter; policy accept;\n{body}\n  }}\n"
            f"}}\n")


def _table_name(label: str | None) -> str:
    # pid and a per-process counter keep concurrent contexts (also of other processes) apart; the pid also lets
    # remove_stale_tables tell a crashed owner from a live one.
    name = f"{TABLE_PREFIX}{os.getpid()}_{next(_counter)}"
    if label:
        # nft table names are identifiers: keep letters, digits and underscores.
        name += "_" + re.sub(r"[^A-Za-z0-9_]", "_", label)[:32]
    return name


@contextmanager
def loopback_loss(rate: float, tcp_ports: Sequence[int], udp_ports: Sequence[int],
                  label: str | None = None) -> Iterator[str]:
    """Drop packets arriving on lo with probability `rate` while the context is open; yields the table's name.

    Dropped: TCP segments with source or destination port in `tcp_ports` (both directions of those
    connections), and UDP datagrams with destination port in `udp_ports`. The table is deleted on exit, also
    on exceptions. A rate that rounds to 0 (below 0.005 %) creates nothing and yields "".
    """
    if not 0.0 <= rate <= 1.0:  # also refuses NaN
        raise ValueError(f"loss rate must be in [0, 1], got {rate}")
    tcp, udp = _check_ports("tcp_ports", tcp_ports), _check_ports("udp_ports", udp_ports)
    threshold = round(rate * SCALE)
    if threshold == 0:
        yield ""
        return
    if os.geteuid() != 0:
        raise EdgerunError("kernel loss needs root (CAP_NET_ADMIN to change nftables)")
    table = _table_name(label)
    nft("-f", "-", script=_ruleset(table, threshold, tcp, udp))
    try:
        yield table
    finally:
        # A failure here raises with the body's exception (if any) chained as its context, so neither is lost.
        nft("delete", "table", "inet", table)


def loss_counters(table: str) -> tuple[int, int]:
    """(packets that matched the ports, packets dropped) so far in an open loopback_loss table; (0, 0) for ""."""
    if not table:
        return 0, 0
    listing = nft("list", "chain", "inet", table, "lossy")
    counts = [int(n) for n in re.findall(r"counter packets (\d+)", listing)]
    if len(counts) != 2:
        raise EdgerunError(f"unexpected listing of {table}: {listing!r}")
    return counts[0], counts[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def remove_stale_tables() -> list[str]:
    """Delete the loss tables whose owning process is gone (a crash skipped their deletion); their names."""
    removed = []
    for line in nft("list", "tables").splitlines():
        parts = line.split()  # "table inet edgerun_loss_1234_0"
        if len(parts) != 3 or parts[0] != "table" or not parts[2].startswith(TABLE_PREFIX):
            continue
        family, name = parts[1], parts[2]
        pid = name[len(TABLE_PREFIX):].split("_", 1)[0]
        # A table of a live process is in use by its open context; one with an unparsable pid is ours but
        # of no known owner, so it counts as stale.
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        nft("delete", "table", family, name)
        removed.append(name)
    return removed
