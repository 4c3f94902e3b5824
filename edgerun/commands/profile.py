"""`edgerun profile`: measure this device into a device profile."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    pass
from edgerun.commands.common import host_port, model_arg, threads_arg


def cmd_profile(args: argparse.Namespace) -> None:
    from edgerun.net.probe import ProbeResponder
    from edgerun.profile.device import measure_device

    if args.serve_probes is not None:
        responder = ProbeResponder(port=args.serve_probes).start()
        print(f"answering link probes on port {responder.port} (UDP echo and TCP transfers); Ctrl-C stops",
              file=sys.stderr)
        try:
            while True:
                time.sleep(3600)
        finally:
            responder.close()
    master = host_port(args.master) if args.master else None
    if args.seconds <= 0:
        raise EdgerunError("--seconds must be positive")
    if args.memory_budget is not None and not 0 < args.memory_budget < float("inf"):
        raise EdgerunError(f"--memory-budget must be a positive number of MB, not {args.memory_budget}")
    steps = ["memory bandwidth", "matrix multiply", "decode speed on the model", "disk read", "link"]

    def progress(stage: str) -> None:
        done = next((i for i, s in enumerate(steps) if stage.startswith(s)), len(steps) - 1)
        print(f"[{done + 1}/{len(steps)}] measuring {stage}...", file=sys.stderr)

    try:
        profile = measure_device(name=args.name, model_path=args.model, master=master, budget_mb=args.memory_budget,
                                 threads=args.threads, seconds=args.seconds, progress=progress)
    except OSError as e:
        raise EdgerunError(f"link probe failed: {e}") from e
    text = json.dumps(profile.to_json(), indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this device into a device profile (JSON)",
                       description="Measure this machine's compute (matmul and decode on the model), memory, disk "
                                   "and, with --master, its link to the master (RTT, bandwidth both ways, packet "
                                   "loss from UDP echo bursts). Takes about --seconds. The output is the device "
                                   "profile the planners take (edgerun plan --devices ...).")
    model_arg(p)
    p.add_argument("--master", default=None, help="HOST:PORT of a master or of `edgerun profile "
                   "--serve-probes` to measure the link to (default: no link measured)")
    p.add_argument("--name", default=None, help="device name (default: the host name)")
    p.add_argument("--memory-budget", type=float, default=None, help="MB edgerun may use (default: 80%% of "
                   "available memory)")
    threads_arg(p)
    p.add_argument("--seconds", type=float, default=30.0, help="measurement time (default: 30)")
    p.add_argument("--out", type=Path, default=None, help="write the profile here (default: stdout)")
    p.add_argument("--serve-probes", type=int, default=None, metavar="PORT",
                   help="instead of measuring, answer other devices' link probes on PORT (0: any free port; "
                        "default: off)")
    p.set_defaults(func=cmd_profile)
