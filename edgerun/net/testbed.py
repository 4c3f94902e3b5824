"""A loss testbed on one Linux machine: the master and every node in network namespaces of their own, with real
kernel loss, rate limits and CPU quotas.

Layout of a testbed named T with N nodes:

    namespace T-master:  lo, bridge br0 (SUBNET.1/24), veth ports node1 .. nodeN
    namespace T-nodeK:   lo, eth0 (SUBNET.(K+1)/24), the other end of the master's port nodeK

Every link is shaped in both directions the same way (shaping.py): each end drops a share of the IP packets it
receives (nftables, ingress hook) and rate-limits and delays what it sends (tbf, netem). Node K may run under a
CPU quota (a cgroup of its own), standing in for a slower device. Nothing is created in the machine's own
namespace, so deleting the namespaces and cgroups removes everything.

The testbed's description is written to a state file before anything is created, so `down` finds all of it,
also after a crash half-way through `up`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from edgerun.errors import EdgerunError
from edgerun.net import netns, shaping
from edgerun.net.kernel_loss import loss_supported
from edgerun.net.netns import NETNS_DIR, entered

STATE_DIR = Path(os.environ.get("EDGERUN_TESTBED_STATE", "/run/edgerun/testbed"))
MAX_NODES = 250  # node K takes address SUBNET.(K+1) of a /24
# A short CFS period makes a quota act like a slower CPU: with the default 100 ms a node at 0.6 cores runs at full
# speed for 60 ms and then stalls for 40, which a 10 ms synchronization timeout sees as a dead node.
CFS_PERIOD_US = 10_000
MIN_CPU_QUOTA = 0.1  # the kernel refuses quotas below 1 ms per period
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,15}$")


@dataclass(frozen=True)
class TestbedSpec:
    """What a testbed is made of. cpu_quotas: cores per node, one value for all nodes or one per node; empty:
    no quota."""
    nodes: int
    loss: float = 0.0
    delay_ms: float = 0.0
    rate_mbit: float | None = None
    cpu_quotas: tuple[float, ...] = ()
    name: str = "edgerun"
    subnet: str = "10.77.0"

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise EdgerunError(f"testbed name must be 1-16 lowercase letters, digits or '-', starting with a letter;"
                               f" got {self.name!r}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise EdgerunError(f"a testbed has 1 to {MAX_NODES} nodes, not {self.nodes}")
        shaping.LinkShape(self.loss, self.rate_mbit, self.delay_ms)  # validates
        if len(self.cpu_quotas) not in (0, 1, self.nodes):
            raise EdgerunError(f"give one CPU quota for all nodes or one per node ({self.nodes}), "
                               f"not {len(self.cpu_quotas)}")
        if any(not q >= MIN_CPU_QUOTA for q in self.cpu_quotas):
            raise EdgerunError(f"CPU quotas are cores, at least {MIN_CPU_QUOTA} (0.5: half a core), got "
                               f"{list(self.cpu_quotas)}")
        parts = self.subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and int(p) < 256 for p in parts):
            raise EdgerunError(f"subnet is the first three numbers of a /24, like 10.77.0, not {self.subnet!r}")

    @property
    def link(self) -> shaping.LinkShape:
        return shaping.LinkShape(self.loss, self.rate_mbit, self.delay_ms)

    @property
    def master_ns(self) -> str:
        return f"{self.name}-master"

    def node_ns(self, k: int) -> str:
        """Namespace of node k, counted from 1."""
        return f"{self.name}-node{k}"

    @property
    def namespaces(self) -> list[str]:
        return [self.master_ns, *(self.node_ns(k) for k in range(1, self.nodes + 1))]

    @property
    def master_address(self) -> str:
        return f"{self.subnet}.1"

    def node_address(self, k: int) -> str:
        return f"{self.subnet}.{k + 1}"

    def cpu_quota(self, k: int) -> float | None:
        if not self.cpu_quotas:
            return None
        return self.cpu_quotas[0] if len(self.cpu_quotas) == 1 else self.cpu_quotas[k - 1]


def _state_file(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def load_spec(name: str) -> TestbedSpec:
    path = _state_file(name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise EdgerunError(f"no testbed {name} (start one with `edgerun testbed up`)") from e
    return TestbedSpec(**(data | {"cpu_quotas": tuple(data["cpu_quotas"])}))


def names() -> list[str]:
    """Names of the testbeds that have a state file."""
    return sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []


# --- CPU quotas: cgroup v1 (cpu controller mounted on its own) or v2 (unified hierarchy) ---

@dataclass(frozen=True)
class CgroupRoot:
    path: Path
    v2: bool


def cgroup_root() -> CgroupRoot:
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return CgroupRoot(v1, v2=False)
    unified = Path("/sys/fs/cgroup")
    controllers = unified / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return CgroupRoot(unified, v2=True)
    raise EdgerunError("no cgroup CPU controller: neither /sys/fs/cgroup/cpu (v1) nor cpu in /sys/fs/cgroup (v2)")


def _cgroup_dir(name: str) -> Path:
    return cgroup_root().path / f"edgerun-testbed-{name}"


def node_cgroup(spec: TestbedSpec, k: int) -> Path | None:
    return None if spec.cpu_quota(k) is None else _cgroup_dir(spec.name) / f"node{k}"


def _make_cgroups(spec: TestbedSpec) -> None:
    root = cgroup_root()
    top = _cgroup_dir(spec.name)
    top.mkdir(exist_ok=True)
    if root.v2:  # the cpu controller must be handed down to each level before a child can use it
        for level in (root.path, top):
            (level / "cgroup.subtree_control").write_text("+cpu")
    for k in range(1, spec.nodes + 1):
        quota = spec.cpu_quota(k)
        assert quota is not None
        d = top / f"node{k}"
        d.mkdir(exist_ok=True)
        quota_us = round(quota * CFS_PERIOD_US)
        if root.v2:
            (d / "cpu.max").write_text(f"{quota_us} {CFS_PERIOD_US}")
        else:
            (d / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota_us))


def _remove_cgroups(name: str) -> list[str]:
    try:
        top = _cgroup_dir(name)
    except EdgerunError:
        return []
    if not top.is_dir():
        return []
    removed = []
    for d in [*sorted(p for p in top.iterdir() if p.is_dir()), top]:
        for pid in (d / "cgroup.procs").read_text().split():
            _kill(int(pid))
        for _ in range(100):  # a killed process leaves its cgroup a moment after the signal
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise EdgerunError(f"cannot remove cgroup {d}: processes are still in it")
        removed.append(str(d))
    return removed


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# --- namespaces and links ---

def _processes_in(ns: str) -> list[int]:
    """Processes whose network namespace is `ns` (they would keep it alive after its name is gone)."""
    try:
        target = os.stat(os.path.join(NETNS_DIR, ns)).st_ino
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                    pids.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to look at
                continue
    return pids


def _up_links(spec: TestbedSpec) -> None:
    with entered(spec.master_ns), IPRoute() as m:
        m.link("set", index=m.link_lookup(ifname="lo")[0], state="up")
        m.link("add", ifname="br0", kind="bridge")
        bridge = m.link_lookup(ifname="br0")[0]
        m.addr("add", index=bridge, address=spec.master_address, prefixlen=24)
        m.link("set", index=bridge, state="up")
        for k in range(1, spec.nodes + 1):
            port, peer = f"node{k}", f"peer{k}"
            m.link("add", ifname=port, kind="veth", peer=peer)
            m.link("set", index=m.link_lookup(ifname=peer)[0], net_ns_fd=spec.node_ns(k))
            m.link("set", index=m.link_lookup(ifname=port)[0], master=bridge, state="up")
            with entered(spec.node_ns(k)), IPRoute() as n:
                n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
                eth = n.link_lookup(ifname=peer)[0]
                n.link("set", index=eth, ifname="eth0")
                n.addr("add", index=eth, address=spec.node_address(k), prefixlen=24)
                n.link("set", index=eth, state="up")


def _link_ends(spec: TestbedSpec) -> Iterator[tuple[str, str, str]]:
    """(device, namespace, address) of both ends of every link: the master's port first, then the node's eth0."""
    for k in range(1, spec.nodes + 1):
        yield f"node{k}", spec.master_ns, spec.master_address
        yield "eth0", spec.node_ns(k), spec.node_address(k)


def _shape(spec: TestbedSpec, link: shaping.LinkShape) -> None:
    # Each end drops on receive and limits on send, so both directions of every link get the same shape.
    for device, ns, _ in _link_ends(spec):
        shaping.shape_link(device, link, ("ingress",), ns)


def up(spec: TestbedSpec) -> TestbedSpec:
    """Create the testbed; on any failure, remove what was made and raise."""
    if os.geteuid() != 0:
        raise EdgerunError("a testbed needs root (network namespaces, nftables, cgroups)")
    existing = set(netns.names())
    if _state_file(spec.name).exists() or existing & set(spec.namespaces):
        raise EdgerunError(f"testbed {spec.name} is already up: `edgerun testbed down --name {spec.name}` first")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _state_file(spec.name).write_text(json.dumps(asdict(spec)))
    try:
        for ns in spec.namespaces:
            netns.create(ns)
        _up_links(spec)
        _shape(spec, spec.link)
        if spec.cpu_quotas:
            _make_cgroups(spec)
    except (OSError, NetlinkError, EdgerunError) as e:
        down(spec.name)
        raise EdgerunError(f"testbed {spec.name} could not be set up (removed again): {e}") from e
    return spec


def set_loss(spec: TestbedSpec, loss: float) -> TestbedSpec:
    """Change every link's loss rate in place (links, rates and running processes stay)."""
    changed = TestbedSpec(**(asdict(spec) | {"loss": loss, "cpu_quotas": spec.cpu_quotas}))
    for device, ns, _ in _link_ends(spec):
        shaping.set_link_loss(device, loss, ("ingress",), ns)
    _state_file(spec.name).write_text(json.dumps(asdict(changed)))
    return changed


@dataclass(frozen=True)
class Removed:
    processes: int = 0
    namespaces: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)


def down(name: str) -> Removed:
    """Remove testbed `name`: its processes, namespaces (with their links, qdiscs and nft tables), cgroups and
    state file. Works from the state file, and from the names alone when the state file is gone."""
    pattern = re.compile(rf"^{re.escape(name)}-(master|node\d+)$")
    spaces = [ns for ns in netns.names() if pattern.match(ns)]
    killed = 0
    for ns in spaces:
        for pid in _processes_in(ns):
            _kill(pid)
            killed += 1
    for ns in spaces:
        netns.remove(ns)
    cgroups = _remove_cgroups(name)
    _state_file(name).unlink(missing_ok=True)
    return Removed(killed, spaces, cgroups)


# --- using a testbed ---

def popen(spec: TestbedSpec, where: str | int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
    """Start argv in the master's namespace ("master") or node k's (k, from 1), under its CPU quota if any."""
    if where == "master":
        ns, cgroup = spec.master_ns, None
    elif isinstance(where, int) and 1 <= where <= spec.nodes:
        ns, cgroup = spec.node_ns(where), node_cgroup(spec, where)
    else:
        raise EdgerunError(f"testbed {spec.name} has master and node1..node{spec.nodes}, not {where!r}")
    with entered(ns):
        proc = subprocess.Popen(list(argv), **kwargs)  # type: ignore[call-overload]
    if cgroup is not None:
        # Moved in right after the start: a new process has done next to nothing outside its quota by then.
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
    return proc


def listening(spec: TestbedSpec, port: int) -> bool:
    """Whether a TCP socket listens on `port` in the master's namespace."""
    with entered(spec.master_ns):
        rows = []
        for table in ("/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"):
            try:
                with open(table) as f:
                    rows += f.read().splitlines()[1:]
            except FileNotFoundError:
                continue
    # Columns: sl local_address rem_address st ...; local_address is HEXIP:HEXPORT, state 0A is LISTEN.
    return any(r.split()[1].rsplit(":", 1)[1] == f"{port:04X}" and r.split()[3] == "0A" for r in rows)


@contextmanager
def running(spec: TestbedSpec) -> Iterator[TestbedSpec]:
    """A testbed for the length of the context, removed afterwards whatever happens: also on SIGTERM (as from
    `kill` or a job runner), which would otherwise end the process without unwinding."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    up(spec)
    try:
        yield spec
    finally:
        down(spec.name)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@dataclass(frozen=True)
class LinkStatus:
    namespace: str
    device: str
    address: str
    qdiscs: list[str]
    received: int  # IP packets that reached the loss rule
    dropped: int


def _loss_counts(spec: TestbedSpec) -> Iterator[tuple[str, str, str, int, int]]:
    """(device, namespace, address, IP packets received, dropped) of every link end whose namespace exists;
    0, 0 where no loss table is set."""
    present, tables = set(netns.names()), {}
    for device, ns, address in _link_ends(spec):
        if ns not in present:
            continue
        if ns not in tables:  # one listing per namespace: the master's holds a table per node
            tables[ns] = shaping.loss_tables(ns)
        table = shaping.loss_table(device, "ingress")
        yield device, ns, address, *(shaping.loss_counters(table, ns) if table in tables[ns] else (0, 0))


def status(spec: TestbedSpec) -> list[LinkStatus]:
    """Every shaped interface of the testbed with what the kernel has done to it so far."""
    return [LinkStatus(ns, device, address, shaping.qdisc_kinds(device, ns), received, dropped)
            for device, ns, address, received, dropped in _loss_counts(spec)]


def measured_loss(spec: TestbedSpec) -> tuple[int, int]:
    """(IP packets received over all links, packets the kernel dropped) so far. Read around every benchmark
    measurement, so it asks nftables only (not the qdiscs)."""
    counts = list(_loss_counts(spec))
    return sum(c[3] for c in counts), sum(c[4] for c in counts)


def missing_support() -> str | None:
    """None if a testbed can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "a testbed needs root (network namespaces, nftables, cgroups)"
    return loss_supported()
