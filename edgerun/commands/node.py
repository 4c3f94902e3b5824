"""`edgerun node`: one device of a tensor-parallel or pipeline cluster."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError
from edgerun.net.wire import KeyRejected

if TYPE_CHECKING:
    pass
from edgerun.commands.common import (
    DEFAULT_THREADS,
    NODE_BUDGET_MB,
    NODE_SPEED,
    cluster_args,
    cluster_key,
    host_port,
    limit_blas_threads,
    loss_arg,
    model_arg,
    share_threads_arg,
    spin_arg,
)


def cmd_node(args: argparse.Namespace) -> None:
    limit_blas_threads(args.threads)
    from edgerun.model import ggml_lib

    ggml_lib.cluster_process()  # its threads wait on the network between blocks
    profile = None
    if args.profile is not None:
        from edgerun.sched.profiles import load_device

        profile = load_device(args.profile)
    # Explicit options first, then the profile's figures, then the defaults.
    if args.memory_budget is None:
        args.memory_budget = profile.memory.budget_mb if profile else NODE_BUDGET_MB
    if args.speed is None:
        args.speed = profile.compute.weight_bytes_per_s if profile else NODE_SPEED
    if not (0 < args.memory_budget < float("inf") and 0 < args.speed < float("inf")):  # NaN fails too
        raise EdgerunError("--memory-budget and --speed must be positive, finite numbers")
    name = args.name or (profile.name if profile else f"node-{os.getpid()}")
    if args.master is None:
        args.master = _discover_master(args.mode)
    if args.mode == "moe":
        from edgerun.moe.worker import run_expert_worker
        from edgerun.sched.moe import LogNormal

        url = args.master if args.master.startswith(("ws://", "wss://")) else f"ws://{args.master}/moe"
        for wait_s in _joins():
            try:
                run_expert_worker(url, cluster_key(args), name, args.memory_budget, args.threads, log=_log,
                                  latency=None if args.inject_latency is None else
                                  LogNormal.parse(args.inject_latency), seed=args.loss_seed, wait_s=wait_s)
            except KeyRejected as e:
                raise EdgerunError(str(e)) from e
            except OSError as e:
                raise EdgerunError(f"cannot reach the master at {url}: {e}") from e
            _log(f"expert worker {name}: trying to rejoin the master at {url} until it is back (Ctrl-C stops)")
        return
    if args.mode == "pp":
        import asyncio

        from edgerun.net.loops import spinning_event_loop
        from edgerun.pp.worker import PeerPortInUse, PipelineWorker
        from edgerun.tune.worker import TuneRole

        if args.load_threads < 1:
            raise EdgerunError(f"--load-threads must be at least 1, not {args.load_threads}")
        url = args.master if args.master.startswith(("ws://", "wss://")) else f"ws://{args.master}/ws"
        if not 0 <= args.peer_port < 65536:
            raise EdgerunError(f"--peer-port must be 0..65535, not {args.peer_port}")
        for wait_s in _joins():
            worker = PipelineWorker(url, cluster_key(args), name, args.memory_budget, args.speed, args.threads,
                                    log=_log, device=args.device, verbose=args.verbose, peer_port=args.peer_port,
                                    spin_s=args.spin_us / 1e6, load_threads=args.load_threads, tune_role=TuneRole)
            try:
                with asyncio.Runner(loop_factory=lambda: spinning_event_loop(args.spin_us / 1e6)) as runner:
                    runner.run(worker.run(wait_s))
            except PeerPortInUse as e:
                raise EdgerunError(f"--peer-port {args.peer_port} is in use ({e})") from e
            except KeyRejected as e:
                raise EdgerunError(str(e)) from e
            except OSError as e:
                raise EdgerunError(f"cannot reach the master at {url}: {e}") from e
            del worker  # its stage goes before the next join loads one
            _log(f"worker {name}: trying to rejoin the master at {url} until it is back (Ctrl-C stops)")
        return
    from edgerun.tp.node import run_node  # here: a pipeline or expert worker starts without the TP stack

    master = host_port(args.master)
    loss = loss_arg(args)  # checked before the key is looked for, as `edgerun master` checks its options
    try:
        run_node(master, args.model, cluster_key(args), name, args.memory_budget, args.speed, loss,
                 args.threads, args.spin_us / 1e6, verbose=args.verbose, trace=args.trace,
                 device=_tp_device(args.device))
    except OSError as e:
        raise EdgerunError(f"cannot reach the master at {args.master}: {e}") from e


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _joins():
    """How long each join tries to reach the master: a minute the first time, then, after the master went away
    (restarted, or its network down), until it is back: a worker or node rejoins until Ctrl-C."""
    yield 60.0
    while True:
        yield float("inf")


def _tp_device(wanted: str) -> str:
    """Where a tensor-parallel share computes: ggml's CUDA backend where asked for, or with "auto" where an
    NVIDIA GPU and nvcc (which builds that backend once) are here; else the CPU."""
    if wanted != "auto":
        return wanted
    from edgerun.llamacpp import cuda_buildable

    return "cuda" if cuda_buildable() else "cpu"


def _discover_master(mode: str) -> str:
    """HOST:PORT of a master of this mode found on the LAN by mDNS."""
    from edgerun.net.discovery import FIND_TIMEOUT_S, ClusterKind, find_master

    print(f"looking for a {mode} master on the LAN (mDNS, {FIND_TIMEOUT_S:.0f} s)", file=sys.stderr, flush=True)
    found = find_master(ClusterKind(mode))
    if found is None:
        raise EdgerunError(f"no {mode} master answered on the LAN (mDNS) within {FIND_TIMEOUT_S:.0f} s: "
                           "give --master HOST:PORT")
    print(f"found master '{found.name}' at {found.host}:{found.port}", file=sys.stderr, flush=True)
    return f"{found.host}:{found.port}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="serve as one device of a tensor-parallel, pipeline or expert cluster",
                       description="Join a master and compute what it assigns until it shuts down: with --mode tp, "
                                   "a share of every layer from the local model file; with --mode pp, a range of "
                                   "layers as an ONNX stage downloaded from the master; with --mode moe, the "
                                   "experts of a mixture-of-experts model the master places here, fetched from "
                                   "it. Every mode's cluster is a master and its nodes; a pipeline's nodes are its "
                                   "workers, a mixture of experts' its expert workers.")
    p.add_argument("--master", default=None, help="HOST:PORT of the master (pp also takes ws://HOST:PORT/ws, moe "
                   "ws://HOST:PORT/moe; default: the first master of --mode found on the LAN by mDNS)")
    p.add_argument("--mode", choices=("tp", "pp", "moe"), default="tp",
                   help="tp: tensor-parallel (edgerun master --plan halo, ...); pp: pipeline (--plan dp); moe: expert "
                        "worker of a mixture-of-experts master (--plan moe, the MoEx hub) (default: tp)")
    model_arg(p)
    p.add_argument("--name", default=None, help="node name (default: the profile's name, else node-PID)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say every 5 s how much this node computed (kernel time, speed, memory)")
    p.add_argument("--profile", type=Path, default=None, help="this device's profile from `edgerun profile "
                   "--out`: name, memory budget and speed come from it unless given (default: none)")
    p.add_argument("--memory-budget", type=float, default=None,
                   help=f"MB this node may use (default: the profile's budget, else {NODE_BUDGET_MB:.0f})")
    p.add_argument("--speed", type=float, default=None, help="decode speed in weight bytes/s (default: the "
                   f"profile's, else {NODE_SPEED:.0e}; equal speeds give equal shares)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the share or stage computes. tp: cuda runs the share on ggml's CUDA backend (built once "
                        "with nvcc, minutes); pp: cuda needs the onnxruntime-gpu package. auto takes the GPU where "
                        "that is possible, else the CPU (default: auto)")
    p.add_argument("--peer-port", type=int, default=0,
                   help="pp: the pass port (plain TCP, on every interface) where the master and the previous stage "
                        "of a chained route send this worker its passes, authenticated with the cluster key like every "
                        "frame (default: 0, any free port; the worker tells the master which)")
    p.add_argument("--load-threads", type=int, default=1, metavar="N",
                   help="pp: create a stage's sessions on up to N threads at once (4 at most, and only with "
                        "onnxruntime 1.32 or later, which builds sessions concurrently): the master then sends the "
                        "stage as that many graphs, so it loads up to N times faster when this worker replaces a "
                        "lost one, at 0.2-0.6 ms more per pass for each graph beyond the first (measured on a "
                        "16-core host; none measurable on a 2-core one). For workers that come and go (default: 1, "
                        "one graph)")
    p.add_argument("--inject-latency", default=None, metavar="lognormal:MEDIAN_MS:SIGMA",
                   help="moe: hold each expert reply back by a delay drawn from this distribution (seeded by "
                        "--loss-seed), as a slow or jittery device would: for benchmarks of hedged dispatch "
                        "(default: none)")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="tp: append this node's timeline of one-token blocks to FILE as JSON lines, once a heartbeat "
                        "(when each input came, was taken, computed and answered), for `edgerun bench tp --trace`'s "
                        "breakdown of a synchronization (default: none)")
    share_threads_arg(p, DEFAULT_THREADS)
    spin_arg(p)
    cluster_args(p)
    p.set_defaults(func=cmd_node)
