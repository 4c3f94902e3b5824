"""Serving under churn (the web-inference thesis's Table 6.8): pipeline workers leave after exponential
lifetimes (mean --mttf seconds) and rejoin, while requests run back to back for --seconds; reports
the share of time the master is Up, tokens served and recoveries. Writes churn.md.

    python scripts/pp_churn.py --out out/churn
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from edgerun.bench.pp import churn
from edgerun.model.loader import load_model
from edgerun.pp.worker import load_threads
from edgerun.sched.pp_plan import MAX_STAGE_PARTS


def say(message: str) -> None:
    """A line on stderr after the wall-clock time, to the millisecond."""
    now = time.time()
    print(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1e3):03d} {message}", file=sys.stderr,
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--budgets", default="80,80,80,80", help="worker memory budgets in MB (default: 80,80,80,80: "
                   "any two hold the model)")
    p.add_argument("--mttf", type=float, default=10.0, help="mean time to failure of a worker, s (default: 10)")
    p.add_argument("--rejoin", type=float, default=2.0, help="seconds before a departed worker restarts (default: 2)")
    p.add_argument("--seconds", type=float, default=120.0, help="how long requests run (default: 120)")
    p.add_argument("--seed", type=int, default=0, help="seed of the departure schedule (default: 0)")
    p.add_argument("--load-threads", type=int, default=None, help="each worker's `edgerun node --load-threads`: "
                   "a stage comes as that many graphs whose sessions it creates at once, so a replacement loads "
                   f"faster (default: this machine's cores, {MAX_STAGE_PARTS} at most, where onnxruntime creates "
                   "sessions concurrently, else 1)")
    p.add_argument("--out", type=Path, required=True, help="directory for churn.md")
    p.add_argument("--log", action="store_true", help="print the master's log (plans, losses, recoveries) with "
                   "timestamps beside the departures (default: departures and rejoins only)")
    args = p.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    threads = load_threads(MAX_STAGE_PARTS) if args.load_threads is None else args.load_threads
    if threads < 1:
        p.error(f"--load-threads must be at least 1, not {threads}")
    r = churn(load_model(args.model), budgets, args.mttf, args.seconds, args.rejoin, seed=args.seed,
              progress=say, log=(lambda m: say(f"  master: {m}")) if args.log else (lambda _: None),
              load_threads=threads)
    summary = (f"# Pipeline under churn\n\nworkers {args.budgets} MB, MTTF {args.mttf:g} s, rejoin after "
               f"{args.rejoin:g} s, stages loaded on {threads} thread(s), {r.seconds:.0f} s\n\n"
               f"- Up {r.up_share:.1%} of the time ("
               + ", ".join(f"{state.value} {share:.1%}" for state, share in r.state_shares.items()) + ")\n"
               "- not Up, by workers alive: " + (", ".join(f"{live} alive {share:.1%}" for live, share in
                                                    r.down_by_live.items()) or "never") + "\n"
               f"- {r.tokens} tokens in {r.requests} requests "
               f"({r.tokens / r.seconds:.1f} tokens/s)\n- {r.departures} departures, {r.recoveries} mid-request "
               f"recoveries, mean time to recover {r.mean_recovery_s:.2f} s\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "churn.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
