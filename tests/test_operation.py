"""Running edgerun as an operator would meet it: a wrong key is named on both sides, an unreachable master is
reported at once and retried, a port in use and bad options are one line and exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgerun.cli import main
from edgerun.net.wire import derive_key
from edgerun.tp.config import MasterConfig
from edgerun.tp.master import Master

pytestmark = pytest.mark.slow  # masters and nodes in processes, joining, dying and coming back

Capsys = pytest.CaptureFixture[str]


def edgerun(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgerun.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def lines_within(proc: subprocess.Popen, n: int, timeout_s: float) -> list[str]:
    """The first n lines of a process's stderr, read until timeout_s has passed."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(lines) < n and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
    return lines


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port something else is listening on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_wrong_key_is_named_on_both_sides(shipped_model) -> None:
    said: list[str] = []
    master = Master(shipped_model, derive_key("right"), MasterConfig(host="127.0.0.1", port=0), log=said.append)
    try:
        node = edgerun("node", "--master", f"127.0.0.1:{master.port}", "--key", "wrong", "--name", "intruder")
        _, err = node.communicate(timeout=60)
        assert node.returncode == 2
        assert err.splitlines()[-1] == (f"edgerun: error: the master at 127.0.0.1:{master.port} rejected this "
                                        "node's key: --key (or EDGERUN_KEY) must be the master's")
        assert any("failed authentication" in m and "--key" in m for m in said), said
        assert master.membership.alive() == []
    finally:
        master.close()


@pytest.mark.parametrize("plan", ["halo", "dp"])
def test_a_master_short_of_nodes_gives_up_at_its_wait_and_names_who_came(plan: str, shipped_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "edgerun.cli", "master", "--plan", plan, "--expect", "2", "--wait",
                           "2", "--host", "127.0.0.1", "--port", "0", "--key", "k", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    what = "nodes" if plan == "halo" else "workers"
    assert proc.stderr.splitlines()[-1] == (f"edgerun: error: only 0 of 2 {what} joined within 2 s: start more, or "
                                            "lower --expect (or raise --wait)"), proc.stderr


@pytest.mark.parametrize("mode", ["pp", "moe"])
def test_a_worker_with_another_key_says_so_and_fails(mode: str, tmp_path: Path, shipped_model) -> None:
    """A pipeline or expert worker whose key is not the master's ends at once with status 2 and one line naming the
    key (it used to log a dropped frame and exit 0)."""
    if mode == "pp":
        from edgerun.pp.config import PipelineConfig
        from edgerun.pp.master import PipelineMaster

        master = PipelineMaster(shipped_model, derive_key("right"), PipelineConfig(host="127.0.0.1"))
    else:
        from edgerun.model.loader import load_model
        from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic
        from edgerun.moe.hub import HubConfig, MoeHub

        write_synthetic(SynthSpec(SHAPES["moe-tiny"], "Q4_0", seed=5), tmp_path / "moe.gguf", "gguf")
        master = MoeHub(load_model(tmp_path / "moe.gguf"), derive_key("right"), HubConfig(max_len=64))
    try:
        worker = edgerun("node", "--mode", mode, "--master", f"127.0.0.1:{master.port}", "--key", "wrong",
                         "--name", "intruder", "--threads", "1")
        _, err = worker.communicate(timeout=60)
        assert worker.returncode == 2, err
        last = err.splitlines()[-1]
        assert last.startswith("edgerun: error: the master") and "cluster key" in last, err
    finally:
        master.close()


def test_master_auto_times_the_cluster_against_itself_alone(shipped_path: Path) -> None:
    """`edgerun master --prefer auto` (the default) times a short request on the plan and on the master alone and
    says which it keeps, by the figures it prints; the answer is the same either way."""
    import re

    port = free_port()
    master = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "master", "--expect", "2", "--key", "k",
                               "--host", "127.0.0.1", "--port", str(port), "--no-advertise", "--threads", "1",
                               "--prompt", "The capital of France is", "--max-tokens", "8"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nodes = [edgerun("node", "--master", f"127.0.0.1:{port}", "--key", "k", "--name", f"n{i}", "--threads", "1")
             for i in range(2)]
    try:
        out, err = master.communicate(timeout=300)
        assert master.returncode == 0, err
        found = re.search(r"the cluster ran ([\d.]+) ms/token against ([\d.]+) for the master alone: (.*)", err)
        assert found, err
        cluster_ms, alone_ms, decision = float(found.group(1)), float(found.group(2)), found.group(3)
        assert decision == "it serves" if cluster_ms < 0.95 * alone_ms else decision.startswith(
            "the master computes alone, the nodes stay connected"), found.group(0)
        assert "Paris" in out
    finally:
        master.kill()
        for node in nodes:
            node.kill()
            node.wait()


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_a_node_rejoins_a_master_that_comes_back(mode: str, shipped_model) -> None:
    """A node or worker whose master closed the cluster says so and keeps trying to rejoin (it exited 0); a master
    started again on the same port gets it back."""
    from edgerun.pp.config import PipelineConfig
    from edgerun.pp.master import PipelineMaster

    port = free_port()

    def start() -> tuple[object, callable]:
        if mode == "tp":
            m = Master(shipped_model, derive_key("k"), MasterConfig(host="127.0.0.1", port=port))
            return m, lambda: (m.wait_for_nodes(1, timeout_s=60), [n.name for n in m.membership.alive()])[1]
        m = PipelineMaster(shipped_model, derive_key("k"), PipelineConfig(host="127.0.0.1", port=port))
        return m, lambda: (m.wait_for_workers(1, timeout_s=60), [w.name for w in m.workers.alive()])[1]

    master, joined = start()
    node = edgerun("node", "--mode", mode, "--master", f"127.0.0.1:{port}", "--key", "k", "--name", "faithful",
                   "--threads", "1")
    try:
        assert joined() == ["faithful"]
        master.close()
        lines = [line for line in lines_within(node, 10, 30) if "rejoin" in line]
        assert lines and "until it is back (Ctrl-C stops)" in lines[0], lines
        assert node.poll() is None  # still trying
        master, joined = start()
        assert joined() == ["faithful"]
    finally:
        master.close()
        node.kill()
        node.wait()


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_unreachable_master_is_reported_within_3s_and_retried(mode: str) -> None:
    port = free_port()
    started = time.monotonic()
    node = edgerun("node", "--mode", mode, "--master", f"127.0.0.1:{port}", "--key", "k", "--name", "lonely")
    try:
        lines = [line for line in lines_within(node, 3, 10) if "cannot reach the master" in line]
        assert len(lines) >= 2, lines  # said at once, then again after a longer pause
        assert time.monotonic() - started < 10
        assert "retrying in 0.5 s" in lines[0] and "retrying in 1.0 s" in lines[1]
        assert node.poll() is None  # still trying
    finally:
        node.kill()
        node.wait()


@pytest.mark.parametrize("command", [["master", "--expect", "0", "--prompt", "hi"],
                                     ["master", "--plan", "dp", "--expect", "0", "--prompt", "hi"],
                                     ["serve"]])
def test_port_in_use_is_one_line(command: list[str], held_port: int, shipped_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "edgerun.cli", *command, "--host", "127.0.0.1", "--port",
                           str(held_port), "--key", "k"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"edgerun: error: cannot listen on 127.0.0.1:{held_port}: ")
    assert "in use" in errors[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["master", "--max-tokens", "0", "--prompt", "hi"],
                                  ["master", "--max-tokens", "-1", "--plan", "dp", "--prompt", "hi"],
                                  ["chat", "--max-tokens", "0"],
                                  ["serve", "--max-queue", "0"]])
def test_bad_counts_are_one_line(argv: list[str], capsys: Capsys, shipped_path: Path) -> None:
    code = main([*argv, "--key", "k"] if argv[0] != "chat" else argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("edgerun: error: ")], err


def test_discovery_finds_a_master_of_the_asked_mode() -> None:
    from edgerun.net.discovery import Advertiser, ClusterKind, find_master

    said: list[str] = []
    advertiser = Advertiser(ClusterKind.PP, "0.0.0.0", 7177, name="edgerun test pp", log=said.append)
    try:
        found = find_master(ClusterKind.PP, timeout_s=5)
        assert found is not None and found.port == 7177 and found.mode == ClusterKind.PP
        socket.inet_aton(found.host)  # an IPv4 address
        other = find_master(ClusterKind.TP, timeout_s=1.5)  # another test's master may be on the LAN, not ours
        assert other is None or other.port != 7177  # a pipeline master is no TP master
    finally:
        advertiser.close()
    assert said == ["announced on the LAN by mDNS as 'edgerun test pp (7177)'"]
