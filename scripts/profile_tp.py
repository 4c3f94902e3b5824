"""Where a tensor-parallel token's time goes: a master in this process and N node processes on loopback (as
`edgerun bench tp` runs them), greedy tokens timed plain and then under cProfile on the master's event-loop
thread, where it sends inputs, computes its share and merges partials. The last node runs under cProfile too,
on its own loop thread (receive, compute, send); its statistics cover its whole run.

    python scripts/profile_tp.py [--model M] [--nodes 7] [--tokens 32] [--rows 30]
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import io
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def node_main(stats_path: str, argv: list[str]) -> None:
    """`edgerun node ARGV` with its event-loop thread profiled; the statistics are written at exit."""
    from edgerun.net import channel

    profile = cProfile.Profile()
    start_thread = channel.EventLoopThread.__init__

    def profiled(self: channel.EventLoopThread) -> None:
        start_thread(self)
        self.loop.call_soon_threadsafe(profile.enable)  # enable() profiles the thread that calls it

    channel.EventLoopThread.__init__ = profiled
    atexit.register(lambda: profile.dump_stats(stats_path))
    from edgerun.cli import main

    sys.argv = ["edgerun", *argv]
    main()


def table(stats: pstats.Stats, rows: int) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the shipped model)")
    p.add_argument("--nodes", type=int, default=7, help="node processes besides the master (default: 7)")
    p.add_argument("--tokens", type=int, default=32, help="tokens timed, plain and profiled (default: 32)")
    p.add_argument("--rows", type=int, default=30, help="functions listed per profile (default: 30)")
    args = p.parse_args()
    if args.nodes < 1 or args.tokens < 1:
        sys.exit("profile_tp: --nodes and --tokens must be at least 1")

    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    from edgerun.bench.tp import SECRET, TpBenchConfig, _node_argv, bench_prompt
    from edgerun.model.loader import load_model
    from edgerun.model.sampling import Sampler, SamplingParams
    from edgerun.net.wire import derive_key
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.master import Master

    model = load_model(args.model)
    config = TpBenchConfig(model_path=args.model, tokens=args.tokens)
    master = Master(model, derive_key(SECRET), MasterConfig(host="127.0.0.1", max_len=512, threads=1))
    node_stats = Path(tempfile.mkdtemp()) / "node.prof"
    procs = []
    for i in range(args.nodes):
        argv = _node_argv(config, f"127.0.0.1:{master.port}", i, "0")  # python -m edgerun.cli node ...
        if i == args.nodes - 1:
            argv = [sys.executable, __file__, "--node-profile", str(node_stats), *argv[3:]]
        procs.append(subprocess.Popen(argv, stderr=subprocess.DEVNULL))
    try:
        master.wait_for_nodes(args.nodes, timeout_s=300)
        master.replan()
        prompt, greedy = bench_prompt(model), Sampler(SamplingParams())
        master.generate(prompt, 16, greedy)  # warm-up
        started = time.perf_counter()
        master.generate(prompt, args.tokens, greedy)
        plain = (time.perf_counter() - started) / args.tokens * 1e3
        profile = cProfile.Profile()
        master.net.call(profile.enable)
        before = dict(master.stats.__dict__)
        started = time.perf_counter()
        master.generate(prompt, args.tokens, greedy)
        profiled = (time.perf_counter() - started) / args.tokens * 1e3
        master.net.call(profile.disable)
        s, n = master.stats, args.tokens
        compute, wait = (s.compute_s - before["compute_s"]) / n * 1e3, (s.wait_s - before["wait_s"]) / n * 1e3
        print(f"{args.nodes + 1} devices: {plain:.2f} ms/token plain, {profiled:.2f} profiled; per token: compute "
              f"{compute:.2f} ms, wait {wait:.2f} ms, {(s.blocks - before['blocks']) / n:.0f} blocks")
        print(f"===== master, event-loop thread, the {n} profiled tokens\n" + table(pstats.Stats(profile), args.rows))
    finally:
        master.close()  # the nodes are told to shut down: the profiled one writes its statistics
        for proc in procs[:-1]:
            proc.kill()
        procs[-1].wait(60)
    if node_stats.exists():
        print("===== one node, event-loop thread, its whole run\n" + table(pstats.Stats(str(node_stats)), args.rows))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--node-profile":
        node_main(sys.argv[2], sys.argv[3:])
    else:
        main()
