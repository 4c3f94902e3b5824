"""`edgerun bench tp`: a local tensor-parallel cluster (nodes as processes on loopback), swept over
node counts, loss rates and transports, with the time per output token split into the master's
compute, waiting for partials, and the rest.

Loss comes from the in-process loss model (every UDP send, TCP untouched) or from the kernel
(nftables drops on loopback, which also make TCP retransmit: HALO Table I's comparison).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from edgerun.errors import EdgerunError
from edgerun.model.loader import Model, load_model
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.kernel_loss import loopback_loss, loss_counters
from edgerun.net.loss import Bernoulli, NoLoss, parse_loss
from edgerun.net.wire import Codec, derive_key
from edgerun.tp.master import Master

BENCH_PROMPT = "Distributed inference splits one model across several machines because"
SECRET = "edgerun-bench"
WARMUP_TOKENS = 8  # also what the adaptive timeout learns from before measuring


@dataclass(frozen=True)
class TpResult:
    nodes: int
    transport: str
    loss: str
    loss_at: str  # "process" or "kernel"
    codec: str
    timeout: str  # "10 ms" or "adaptive"
    parity: bool  # an XOR parity fragment after every UDP vector
    plan: str
    tokens: int
    ms_per_token: float
    compute_ms_per_token: float  # the master's own share
    wait_ms_per_token: float  # waiting for the nodes' partials
    other_ms_per_token: float  # norms, sends, sums, sampling
    blocks: int
    blocks_incomplete: int
    partials_rebuilt: int  # from a parity fragment
    datagrams_sent: int
    datagrams_dropped: int  # by the in-process loss model on the master's side
    kernel_matched: int  # cluster packets the kernel saw (kernel loss only)
    kernel_dropped: int
    late_packets: int
    rejected: int


def kernel_rate(spec: str) -> float:
    """A plain loss rate ("5%", "0.05"): the kernel drops independently; bursts are in-process only."""
    model = parse_loss(spec)
    if isinstance(model, NoLoss):
        return 0.0
    if not isinstance(model, Bernoulli):
        raise EdgerunError(f"kernel loss takes a plain rate, not {spec!r}")
    return model.rate


@contextlib.contextmanager
def local_cluster(model: Model, model_path: Path | None, nodes: int, loss: str, plan: str, codec: str,
                  timeout_ms: float | None, rto_min_ms: float | None = None,
                  timeout_deviations: float = 4.0, parity: bool = True) -> Iterator[Master]:
    """A master in this process and `nodes` node processes (one BLAS thread each) on loopback."""
    master = Master(model, derive_key(SECRET), strategy=plan, host="127.0.0.1", port=0, codec=Codec[codec.upper()],
                    timeout_ms=timeout_ms, loss=parse_loss(loss, seed=0), max_len=512, rto_min_ms=rto_min_ms,
                    timeout_deviations=timeout_deviations, parity=parity)
    model_args = [] if model_path is None else ["--model", str(model_path)]
    procs = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{master.port}",
                               "--name", f"bench-{i}", "--key", SECRET, "--loss", loss, "--loss-seed", str(i + 1),
                               "--threads", "1", *model_args], stderr=subprocess.DEVNULL) for i in range(nodes)]
    try:
        master.wait_for_nodes(nodes, timeout_s=300)
        yield master
    finally:
        master.close()
        for p in procs:
            p.kill()
            p.wait()


def _measure(master: Master, model: Model, tokens: int, nodes: int, loss: str, loss_at: str, codec: str,
             plan: str, table: str) -> TpResult:
    prompt = model.tokenizer.encode(BENCH_PROMPT)
    greedy = Sampler(SamplingParams())
    master.generate(prompt, WARMUP_TOKENS, greedy)
    s, sent, dropped, rejected = master.stats, master.udp.sent, master.udp.dropped, master.counters.total()
    before = dict(s.__dict__)
    matched0, kdropped0 = loss_counters(table)
    start = time.perf_counter()
    generated = master.generate(prompt, tokens, greedy)
    elapsed = time.perf_counter() - start
    matched1, kdropped1 = loss_counters(table)
    n = max(1, len(generated))
    compute = (s.compute_s - before["compute_s"]) / n
    wait = (s.wait_s - before["wait_s"]) / n
    fixed = master.timeouts.fixed_s
    return TpResult(
        nodes=nodes, transport=master.transport, loss=loss, loss_at=loss_at, codec=codec,
        timeout="adaptive" if fixed is None else f"{fixed * 1e3:g} ms", parity=master.parity, plan=plan,
        tokens=len(generated),
        ms_per_token=elapsed / n * 1e3, compute_ms_per_token=compute * 1e3, wait_ms_per_token=wait * 1e3,
        other_ms_per_token=(elapsed / n - compute - wait) * 1e3, blocks=s.blocks - before["blocks"],
        blocks_incomplete=s.blocks_incomplete - before["blocks_incomplete"],
        partials_rebuilt=s.partials_rebuilt - before["partials_rebuilt"],
        datagrams_sent=master.udp.sent - sent, datagrams_dropped=master.udp.dropped - dropped,
        kernel_matched=matched1 - matched0, kernel_dropped=kdropped1 - kdropped0,
        late_packets=s.late_packets - before["late_packets"], rejected=master.counters.total() - rejected)


def bench_tp(model_path: Path | None, node_counts: list[int], losses: list[str], transports: list[str],
             loss_at: str = "process", plan: str = "halo", tokens: int = 32, timeout_ms: float | None = 10.0,
             codec: str = "f32", rto_min_ms: float | None = None, timeout_deviations: float = 4.0,
             parity: bool = True, progress: Callable[[str], None] = lambda _: None) -> list[TpResult]:
    """Every (nodes, loss, transport) combination. With kernel loss one cluster per node count serves
    every loss rate (links are measured before any loss); in-process loss is set when a node starts,
    so each rate gets its own cluster."""
    if loss_at not in ("process", "kernel"):
        raise EdgerunError(f"loss must be applied in the process or the kernel, not {loss_at!r}")
    rates = {loss: kernel_rate(loss) for loss in losses} if loss_at == "kernel" else {}
    model = load_model(model_path)
    results = []
    for nodes in node_counts:
        groups = [losses] if loss_at == "kernel" else [[loss] for loss in losses]
        for group in groups:
            start_loss = "0" if loss_at == "kernel" else group[0]
            with local_cluster(model, model_path, nodes, start_loss, plan, codec, timeout_ms, rto_min_ms,
                               timeout_deviations, parity) as master:
                for loss in group:
                    for transport in transports:
                        progress(f"master + {nodes} node(s), {transport}, {loss_at} loss {loss}")
                        master.transport = transport
                        master.replan()  # before the loss: assignments and link probes travel clean
                        tcp_ports = [master.port]
                        udp_ports = [master.udp_port] + [n.udp_port for n in master.nodes]
                        with loopback_loss(rates.get(loss, 0.0), tcp_ports, udp_ports) as table:
                            results.append(_measure(master, model, tokens, nodes, loss, loss_at, codec, plan, table))
    return results


def tp_table(results: list[TpResult]) -> str:
    rows = [f"{'nodes':>5} {'transport':>9} {'loss':>6} {'ms/token':>9} {'compute':>8} {'wait':>8} {'other':>8} "
            f"{'incomplete blocks':>17} {'rebuilt':>7} {'late pkts':>9} {'kernel drops':>12}"]
    for r in results:
        rows.append(f"{r.nodes:>5} {r.transport:>9} {r.loss:>6} {r.ms_per_token:>9.1f} {r.compute_ms_per_token:>8.1f} "
                    f"{r.wait_ms_per_token:>8.1f} {r.other_ms_per_token:>8.1f} "
                    f"{f'{r.blocks_incomplete}/{r.blocks}':>17} {r.partials_rebuilt:>7} {r.late_packets:>9} "
                    f"{f'{r.kernel_dropped}/{r.kernel_matched}':>12}")
    return "\n".join(rows)


def tp_ratios(results: list[TpResult]) -> str:
    """Per node count and loss: udp against its own lossless time, and tcp against udp (HALO Table I)."""
    by = {(r.nodes, r.transport, r.loss): r.ms_per_token for r in results}
    lossless = {n: by.get((n, "udp", results[0].loss)) for n in {r.nodes for r in results}}
    rows = []
    for (nodes, transport, loss), ms in by.items():
        if transport != "udp":
            continue
        parts = [f"{nodes} node(s), loss {loss}: udp {ms:.1f} ms/token"]
        if lossless[nodes]:
            parts.append(f"{ms / lossless[nodes]:.2f}x udp at loss {results[0].loss}")
        if (nodes, "tcp", loss) in by:
            parts.append(f"tcp {by[(nodes, 'tcp', loss)]:.1f} ms/token = {by[(nodes, 'tcp', loss)] / ms:.2f}x udp")
        rows.append("; ".join(parts))
    return "\n".join(rows)


def tp_json(results: list[TpResult]) -> list[dict[str, object]]:
    return [asdict(r) for r in results]
