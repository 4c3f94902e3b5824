"""The loss testbed: network namespaces with real kernel loss, rate limits and CPU quotas (root only), and a
tensor-parallel cluster over it checked against the reference."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from edgerun.bench.tp import SECRET, TpBenchConfig, local_cluster
from edgerun.cli import main
from edgerun.errors import EdgerunError
from edgerun.model.generate import ReferenceEngine, generate
from edgerun.model.loader import load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.model.synth import SHAPES, SynthSpec
from edgerun.net import netns, shaping, testbed
from edgerun.net.netns import entered
from edgerun.net.testbed import TestbedSpec as Spec

pytestmark = pytest.mark.slow  # network namespaces and kernel packet loss

REASON = testbed.missing_support()
needs_root = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def test_spec_refuses_bad_input() -> None:
    with pytest.raises(EdgerunError, match="1 to 250 nodes"):
        Spec(nodes=0)
    with pytest.raises(EdgerunError, match="loss must be in"):
        Spec(nodes=2, loss=1.5)
    with pytest.raises(EdgerunError, match="one CPU quota for all nodes or one per node"):
        Spec(nodes=3, cpu_quotas=(1.0, 0.5))
    with pytest.raises(EdgerunError, match=r"at least 0\.1"):
        Spec(nodes=1, cpu_quotas=(0.0,))
    with pytest.raises(EdgerunError, match="testbed name"):
        Spec(nodes=1, name="Bad Name")
    with pytest.raises(EdgerunError, match="subnet"):
        Spec(nodes=1, subnet="10.300.0")
    spec = Spec(nodes=3, cpu_quotas=(1.0, 0.5, 0.25), name="tb")
    assert spec.namespaces == ["tb-master", "tb-node1", "tb-node2", "tb-node3"]
    assert (spec.master_address, spec.node_address(3), spec.cpu_quota(2)) == ("10.77.0.1", "10.77.0.4", 0.5)


def _leftovers(name: str) -> list[str]:
    """Everything of testbed `name` that still exists: namespaces, cgroups, the state file."""
    found = [ns for ns in netns.names() if ns.startswith(f"{name}-")]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"**/edgerun-testbed-{name}")]
    if (testbed.STATE_DIR / f"{name}.json").exists():
        found.append("state file")
    return found


def _udp_exchange(spec: Spec, k: int, count: int) -> tuple[int, int]:
    """`count` datagrams from node k to the master and `count` back, paced; (received by master, by node)."""
    port = 9300 + k
    with entered(spec.master_ns):
        master = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    master.bind((spec.master_address, port))
    master.settimeout(1.0)
    echo = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"s.bind(('{spec.node_address(k)}', {port}))\n"
            f"for i in range({count}):\n"
            f"    s.sendto(b'u' * 256, ('{spec.master_address}', {port})); time.sleep(0.0002)\n"
            "s.settimeout(1.5)\nn = 0\n"
            "try:\n    while True:\n        s.recv(512); n += 1\nexcept OSError:\n    pass\nprint(n)\n")
    node = testbed.popen(spec, k, [sys.executable, "-c", echo], stdout=subprocess.PIPE, text=True)
    got = 0
    try:
        while True:
            master.recv(512)
            got += 1
    except TimeoutError:
        pass
    for _ in range(count):
        master.sendto(b"d" * 256, (spec.node_address(k), port))
        time.sleep(0.0002)
    out, _ = node.communicate(timeout=30)
    master.close()
    return got, int(out)


@needs_root
def test_testbed_loses_the_requested_share_and_down_leaves_nothing() -> None:
    """CI's small testbed: 3 namespaces at 5 % loss. The loss the kernel applies (its counters) and the loss
    the sockets see both lie within 1 percentage point of 5 % (over 12,000 datagrams a binomial standard
    deviation is 0.2 points)."""
    spec = Spec(nodes=3, loss=0.05, rate_mbit=100, cpu_quotas=(1.0, 0.5, 0.5), name="tbtest")
    testbed.down(spec.name)  # a leftover of an earlier crashed run
    try:
        testbed.up(spec)
        with pytest.raises(EdgerunError, match="already up"):
            testbed.up(spec)
        assert all(r.qdiscs[0] == "tbf" for r in testbed.status(spec))
        received0, dropped0 = testbed.measured_loss(spec)
        sent = 2000
        delivered = [_udp_exchange(spec, k, sent) for k in range(1, 4)]
        received, dropped = testbed.measured_loss(spec)
        kernel_share = (dropped - dropped0) / (received - received0)
        socket_share = 1 - sum(a + b for a, b in delivered) / (2 * 3 * sent)
        assert abs(kernel_share - 0.05) < 0.01, kernel_share
        assert abs(socket_share - 0.05) < 0.01, socket_share
        # Each node runs in its own cgroup under its quota.
        sleeper = testbed.popen(spec, 2, ["sleep", "60"])
        cgroup = testbed.node_cgroup(spec, 2)
        assert cgroup is not None and str(sleeper.pid) in (cgroup / "cgroup.procs").read_text().split()
    finally:
        removed = testbed.down(spec.name)
    assert sorted(removed.namespaces) == sorted(spec.namespaces)
    assert removed.processes == 1  # the sleeper
    assert sleeper.wait(timeout=10) == -9
    assert _leftovers(spec.name) == []
    # nft tables lived inside the namespaces; none was made in this one.
    assert not shaping.loss_tables()


@needs_root
def test_down_after_a_crash_finds_everything_by_name() -> None:
    spec = Spec(nodes=2, loss=0.1, cpu_quotas=(0.5,), name="tbcrash")
    testbed.down(spec.name)
    testbed.up(spec)
    (testbed.STATE_DIR / f"{spec.name}.json").unlink()  # as if the state file were lost
    testbed.popen(spec, 1, ["sleep", "60"])
    assert main(["testbed", "down", "--name", spec.name]) == 0
    assert _leftovers(spec.name) == []


@needs_root
def test_tensor_parallel_over_the_testbed(tiny_spec, synth_gguf) -> None:
    """Lossless: the reference's greedy tokens exactly, the one-token blocks' partials on the native data path
    though a float32 vector (512 elements, 2 KB) takes two packets of the veth's 1500-byte MTU (the kernel
    fragments the datagram). At 5 % kernel loss on every link: generation completes, and the kernel really
    dropped packets of the cluster."""
    spec = tiny_spec(tied=False)
    path = synth_gguf(replace(spec, config=replace(spec.config, hidden=512, n_heads=8)))
    model = load_model(path)
    prompt = [1, 5, 9, 3]
    expected = generate(ReferenceEngine(model, 64), prompt, 16, Sampler(SamplingParams())).tokens
    spec = Spec(nodes=3, rate_mbit=1000, name="tbtp")
    testbed.down(spec.name)
    # Every node takes a share; float32 activations, so the tokens are the numpy reference's exactly.
    config = TpBenchConfig(path, plan="minmax", timeout_ms=None, loss_at="testbed", activations=Activations.F32)
    with testbed.running(spec), local_cluster(model, config, 3, "0", spec) as master:
        assert sorted(n.host for n in master.nodes) == [spec.node_address(k) for k in (1, 2, 3)]
        master.replan()
        assert all(n.datagram_bytes == 1472 for n in master.nodes)  # the veth's MTU
        assert master.generate(prompt, 16, Sampler(SamplingParams())) == expected
        assert master.stats.native_partials > 0  # partials of one datagram each, taken by the native gather
        testbed.set_loss(spec, 0.05)
        received0, dropped0 = testbed.measured_loss(spec)
        before = master.stats.blocks
        assert len(master.generate(prompt, 24, Sampler(SamplingParams()))) == 24
        received, dropped = testbed.measured_loss(spec)
        assert master.stats.blocks > before and dropped > dropped0 and received - received0 > 500
    assert _leftovers(spec.name) == []


@needs_root
def test_ggml_shares_run_natively_over_ethernets_mtu(tiny_spec, synth_gguf, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native runner (master) and node servers with ggml shares over the veth's 1500-byte MTU, where a float32
    vector of 512 elements is two packets: they ran the one-token blocks and give the Python path's tokens
    (EDGERUN_NATIVE=0, which the node processes inherit). At 5 % kernel loss (the links then carry parity, and
    their vectors are cut at the MTU: two data fragments and two of parity) they still run there, rebuilding lost
    fragments from the parity."""
    spec = tiny_spec(tied=False)
    path = synth_gguf(replace(spec, config=replace(spec.config, hidden=512, n_heads=8)))
    model = load_model(path)
    prompt = [1, 5, 9, 3]
    bed = Spec(nodes=2, rate_mbit=1000, name="tbnat")
    testbed.down(bed.name)
    config = TpBenchConfig(path, plan="minmax", timeout_ms=None, loss_at="testbed")
    tokens = {}
    for native in ("1", "0"):
        monkeypatch.setenv("EDGERUN_NATIVE", native)
        with testbed.running(bed), local_cluster(model, config, 2, "0", bed) as master:
            master.replan()
            tokens[native] = master.generate(prompt, 16, Sampler(SamplingParams()))
            deadline = time.monotonic() + 10  # the nodes' counts come with their heartbeats
            while native == "1" and not all(n.native_blocks for n in master.nodes) and time.monotonic() < deadline:
                time.sleep(0.1)
            runner, servers = master.stats.native_blocks, [n.native_blocks for n in master.nodes]
            assert (runner > 0 and all(servers)) if native == "1" else (runner == 0 and not any(servers))
            assert master.stats.blocks_incomplete == 0
            if native == "1":
                testbed.set_loss(bed, 0.05)
                before = master.stats.native_blocks, [n.native_blocks for n in master.nodes]
                assert len(master.generate(prompt, 40, Sampler(SamplingParams()))) == 40
                assert all(n.parity == 2 for n in master.nodes)  # they lost packets: lossy links, cut vectors
                deadline = time.monotonic() + 10
                while any(n.native_blocks <= b for n, b in zip(master.nodes, before[1], strict=True)) and \
                        time.monotonic() < deadline:
                    time.sleep(0.1)
                assert master.stats.native_blocks > before[0] and master.stats.partials_rebuilt > 0
                assert all(n.native_blocks > b for n, b in zip(master.nodes, before[1], strict=True))
    assert tokens["1"] == tokens["0"] and len(tokens["1"]) == 16
    assert _leftovers(bed.name) == []


@needs_root
def test_cli_run_starts_nodes_in_their_namespaces(tmp_path: Path, tiny_spec, synth_gguf) -> None:
    path = synth_gguf(tiny_spec(tied=False))
    name = "tbcli"
    testbed.down(name)
    assert main(["testbed", "up", "--name", name, "--nodes", "2", "--plr", "2%"]) == 0
    try:
        # --in: a command in one node's namespace sees that node's address.
        probe = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                 "s.connect(('10.77.0.1', 9)); print(s.getsockname()[0])")
        out = subprocess.run([sys.executable, "-m", "edgerun.cli", "testbed", "run", "--name", name, "--in", "node2",
                              "--", sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "10.77.0.3", out.stderr
        env = os.environ | {"EDGERUN_KEY": SECRET}
        run = subprocess.run(
            [sys.executable, "-m", "edgerun.cli", "testbed", "run", "--name", name, "--port", "7100",
             "--node-cmd", f"edgerun node --master {{master}}:{{port}} --name {{name}} --model {path} --threads 1",
             "--", "edgerun", "master", "--model", str(path), "--port", "7100", "--expect", "2",
             "--max-tokens", "8", "--prompt", "hello", "--threads", "1"],
            capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "node node1 joined from 10.77.0.2" in run.stderr and "node node2 joined from 10.77.0.3" in run.stderr
        assert "8 tokens in" in run.stderr
    finally:
        assert main(["testbed", "down", "--name", name]) == 0
    assert _leftovers(name) == []


@needs_root
def test_netem_command_shapes_and_clears_an_interface() -> None:
    """`edgerun netem` on a veth of a scratch namespace: loss table and tbf appear, a delay without sch_netem is
    refused with the reason, --clear removes both."""
    spec = Spec(nodes=1, name="tbnetem")
    testbed.down(spec.name)
    with testbed.running(spec), entered(spec.node_ns(1)):
        assert main(["netem", "--dev", "eth0", "--loss", "5%", "--rate", "100", "--direction", "both"]) == 0
        assert shaping.qdisc_kinds("eth0")[0] == "tbf"
        assert sorted(shaping.loss_tables()) == sorted(shaping.loss_table("eth0", h) for h in shaping.HOOKS)
        try:
            shaping.set_qdiscs("eth0", shaping.LinkShape(delay_ms=2))
        except EdgerunError as e:  # a kernel without sch_netem
            assert "netem" in str(e)
        else:
            assert shaping.qdisc_kinds("eth0")[0] == "netem"
        assert main(["netem", "--dev", "eth0", "--clear"]) == 0
        assert shaping.loss_tables() == [] and "tbf" not in shaping.qdisc_kinds("eth0")
        assert main(["netem", "--dev", "nosuch0", "--loss", "5%"]) == 2


@needs_root
def test_experiment_scripts_run_on_a_small_testbed(tmp_path: Path, tiny_spec, synth_gguf) -> None:
    """Table I and Fig. 9 end to end on a tiny model: every row measured, CSV, markdown and PNG written."""
    path = str(synth_gguf(tiny_spec(tied=False)))
    root = Path(__file__).parent.parent / "scripts"
    before = set(testbed.names())

    def script(name: str, *args: str) -> str:
        done = subprocess.run([sys.executable, str(root / name), "--model", path, "--tokens", "4",
                               "--out", str(tmp_path / name), *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    out = script("tp_table1.py", "--nodes", "1", "--plr", "0,5%")
    assert "testbed loss" in out and "1 node(s), loss 5%: udp" in out
    # Every row ran on both devices (one split for both transports and both rates), and says so.
    assert out.count("computed on master, bench-0") == 4 and "left out" not in out
    rows = (tmp_path / "tp_table1.py" / "table1.csv").read_text().splitlines()
    assert len(rows) == 1 + 4  # header + (udp, tcp) x (0, 5%)
    out = script("halo_fig9.py", "--nodes", "2", "--scenarios", "1", "--plans", "minmax,galaxy", "--rates", "100")
    assert "speedup over Galaxy" in out
    for name, stem in (("tp_table1.py", "table1"), ("halo_fig9.py", "fig9")):
        for suffix in ("csv", "md", "png"):
            assert (tmp_path / name / f"{stem}.{suffix}").stat().st_size > 0
    assert set(testbed.names()) == before  # the scripts' testbeds are gone


@needs_root
def test_nodes_find_the_master_by_mdns_across_namespaces(tiny_spec, synth_gguf) -> None:
    """`edgerun node` without --master, in node namespaces: each finds the master in its own namespace by
    mDNS over the testbed's bridge and joins it."""
    path = synth_gguf(tiny_spec(tied=False))
    name = "tbmdns"
    testbed.down(name)
    assert main(["testbed", "up", "--name", name, "--nodes", "2"]) == 0
    try:
        edgerun = f"{sys.executable} -m edgerun.cli"
        run = subprocess.run(
            [sys.executable, "-m", "edgerun.cli", "testbed", "run", "--name", name, "--port", "7101",
             "--node-cmd", f"{edgerun} node --name {{name}} --model {path} --threads 1",
             "--", *edgerun.split(), "master", "--model", str(path), "--port", "7101", "--expect", "2",
             "--max-tokens", "4", "--prompt", "hello", "--threads", "1"],
            capture_output=True, text=True, timeout=300, env=os.environ | {"EDGERUN_KEY": SECRET})
        assert run.returncode == 0, run.stderr[-2000:]
        assert "announced on the LAN by mDNS" in run.stderr
        assert "node node1 joined from 10.77.0.2" in run.stderr and "node node2 joined from 10.77.0.3" in run.stderr
        assert "found master" in run.stderr
    finally:
        assert main(["testbed", "down", "--name", name]) == 0
    assert _leftovers(name) == []


@needs_root
def test_mirrored_blocks_ask_for_what_a_lossy_link_lost(synth_gguf) -> None:
    """The LM head's partials and the first layer's inputs take several datagrams each over the testbed's 1500-byte
    MTU; at 20 % kernel loss two of them often go missing, which one parity cannot rebuild. The master asks the
    nodes for what its partials lack and they come whole over UDP (Resend), not by their TCP copies."""
    config = replace(SHAPES["tiny"], vocab_size=16384, hidden=512, n_heads=8, tied_embeddings=False)
    path = synth_gguf(SynthSpec(config, "Q4_0", 0, 0.02))
    model = load_model(path)
    spec = Spec(nodes=2, rate_mbit=1000, name="tbrs")
    testbed.down(spec.name)
    bench = TpBenchConfig(path, plan="minmax", timeout_ms=None, loss_at="testbed", activations=Activations.F32)
    with testbed.running(spec), local_cluster(model, bench, 2, "0", spec) as master:
        master.replan()
        assert all(n.spec.vocab_blocks for n in master.nodes)  # every node sends LM-head rows: 12 datagrams each
        testbed.set_loss(spec, 0.2)
        # A draw from every logit (temperature, no top-k): each node's head partial holds all its rows.
        sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
        assert len(master.generate([1, 5, 9, 3], 16, sampler)) == 16
        stats = master.stats
        assert stats.resend_asks > 0 and stats.completed_after_ask > 0
        # Others lost only as many datagrams as the two parity fragments every vector carries on a lossy link rebuild.
        assert stats.partials_rebuilt > 0
    assert _leftovers(spec.name) == []
