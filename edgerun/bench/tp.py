"""`edgerun bench tp`: a local tensor-parallel cluster (nodes as processes on loopback) against the
same model's single-process speed, with the time per token split into compute, waiting and the rest."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from edgerun.model.loader import load_model
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.loss import parse_loss
from edgerun.net.wire import Codec, derive_key
from edgerun.tp.master import Master

BENCH_PROMPT = "Distributed inference splits one model across several machines because"
SECRET = "edgerun-bench"


@dataclass(frozen=True)
class TpResult:
    nodes: int
    transport: str
    loss: str
    plan: str
    tokens: int
    ms_per_token: float
    compute_ms_per_token: float  # the master's own share
    wait_ms_per_token: float  # waiting for the nodes' partials
    other_ms_per_token: float  # norms, sends, sums, sampling
    blocks: int
    blocks_incomplete: int
    datagrams_sent: int
    datagrams_dropped: int  # by the in-process loss model on the master's side
    late_packets: int
    rejected: int


def bench_tp(model_path: Path | None, nodes: int, loss: str, transport: str, plan: str, tokens: int,
             timeout_ms: float | None, codec: str = "f32") -> TpResult:
    model = load_model(model_path)
    master = Master(model, derive_key(SECRET), strategy=plan, host="127.0.0.1", port=0, transport=transport,
                    codec=Codec[codec.upper()], timeout_ms=timeout_ms, loss=parse_loss(loss, seed=0), max_len=512)
    model_args = [] if model_path is None else ["--model", str(model_path)]
    procs = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{master.port}",
                               "--name", f"bench-{i}", "--key", SECRET, "--loss", loss, "--loss-seed", str(i + 1),
                               *model_args], stderr=subprocess.DEVNULL) for i in range(nodes)]
    try:
        master.wait_for_nodes(nodes, timeout_s=300)
        master.replan()
        prompt = model.tokenizer.encode(BENCH_PROMPT)
        master.generate(prompt, 4, Sampler(SamplingParams()))  # warm-up
        before = master.stats.__dict__.copy(), master.udp.sent, master.udp.dropped
        start = time.perf_counter()
        generated = master.generate(prompt, tokens, Sampler(SamplingParams()))
        elapsed = time.perf_counter() - start
        s = master.stats
        n = max(1, len(generated))
        compute = (s.compute_s - before[0]["compute_s"]) / n
        wait = (s.wait_s - before[0]["wait_s"]) / n
        return TpResult(
            nodes=nodes, transport=transport, loss=loss, plan=plan, tokens=len(generated),
            ms_per_token=elapsed / n * 1e3, compute_ms_per_token=compute * 1e3, wait_ms_per_token=wait * 1e3,
            other_ms_per_token=(elapsed / n - compute - wait) * 1e3, blocks=s.blocks - before[0]["blocks"],
            blocks_incomplete=s.blocks_incomplete - before[0]["blocks_incomplete"],
            datagrams_sent=master.udp.sent - before[1], datagrams_dropped=master.udp.dropped - before[2],
            late_packets=s.late_packets - before[0]["late_packets"], rejected=master.counters.total())
    finally:
        master.close()
        for p in procs:
            p.kill()
            p.wait()


def tp_table(results: list[TpResult]) -> str:
    rows = [f"{'nodes':>5} {'transport':>9} {'loss':>6} {'ms/token':>9} {'compute':>8} {'wait':>8} {'other':>8} "
            f"{'incomplete blocks':>17} {'late pkts':>9}"]
    for r in results:
        rows.append(f"{r.nodes:>5} {r.transport:>9} {r.loss:>6} {r.ms_per_token:>9.1f} {r.compute_ms_per_token:>8.1f} "
                    f"{r.wait_ms_per_token:>8.1f} {r.other_ms_per_token:>8.1f} "
                    f"{f'{r.blocks_incomplete}/{r.blocks}':>17} {r.late_packets:>9}")
    return "\n".join(rows)


def tp_json(results: list[TpResult]) -> list[dict[str, object]]:
    return [asdict(r) for r in results]
