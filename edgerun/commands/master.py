"""`edgerun master`: a one-shot tensor-parallel (HALO) or pipeline master."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from edgerun.commands.common import (
    DEFAULT_THREADS,
    activations_arg,
    cluster_args,
    cluster_key,
    limit_blas_threads,
    loss_arg,
    model_arg,
    overlap_arg,
    overlaps,
    route_arg,
    rto_min_arg,
    sampling_args,
    sampling_params,
    share_threads_arg,
    spin_arg,
    udp_args,
)
from edgerun.errors import EdgerunError
from edgerun.net.discovery import ClusterKind
from edgerun.net.wire import Transport
from edgerun.sched.plans import Mapping, cluster_plan, plan_names


def _plan_for_cluster(plan, master):
    """The plan file over the nodes that joined: its first device is this master."""
    from edgerun.sched.tp_plan import check_fits, plan_for_members

    try:
        check_fits(plan, master.profile())
        return plan_for_members(plan, plan.devices[0], [n.name for n in master.membership.alive()])
    except ValueError as e:
        raise EdgerunError(f"--plan-file: {e}") from e


def _advertise(kind: ClusterKind, host: str, port: int, enabled: bool, log: Callable[[str], None]):
    """A context that announces a master by mDNS while it runs (nothing with --no-advertise)."""
    if not enabled:
        return contextlib.nullcontext()
    from edgerun.net.discovery import Advertiser

    return contextlib.closing(Advertiser(kind, host, port, log=log))


def _serve_prompts(args: argparse.Namespace, model, generate) -> None:
    """Generate for --prompt, or for each line of stdin, streaming tokens; `generate(ids, on_token)`
    returns the tokens and a line of statistics."""
    prompts = [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in sys.stdin)
    tok = model.tokenizer
    for text in prompts:
        if not text.strip():
            continue
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        stream = tok.stream_decoder()

        def emit(token: int, stream=stream) -> None:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

        start = time.perf_counter()
        tokens, stats = generate(tok.encode(text), emit)
        sys.stdout.write(stream.flush() + "\n")
        print(f"[master] {len(tokens)} tokens in {time.perf_counter() - start:.2f} s; {stats}", file=sys.stderr)


WAIT_S = 600.0  # for the --expect nodes or workers
PROGRESS_S = 15.0  # how often a wait says who joined


def _wait(what: str, n: int, joined: Callable[[], list[str]], wait: Callable[[float], None], limit_s: float,
          log: Callable[[str], None]) -> None:
    """Wait up to `limit_s` for `n` members (`wait(timeout)` raises EdgerunError at its timeout), saying every
    PROGRESS_S who joined and how long is left; one line naming those who joined when the time is up."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            wait(max(0.1, min(PROGRESS_S, deadline - time.monotonic())))
            return
        except EdgerunError:
            names = joined()
            left = deadline - time.monotonic()
            who = f" ({', '.join(names)})" if names else ""
            if left <= 0:
                raise EdgerunError(f"only {len(names)} of {n} {what} joined within {limit_s:.0f} s{who}: start "
                                   f"more, or lower --expect (or raise --wait)") from None
            log(f"waiting for {what}: {len(names)} of {n} joined{who}; giving up in {left:.0f} s (--wait)")


TRIAL_TOKENS = 8  # tokens a --prefer auto trial generates on the cluster and on the master alone
MIN_GAIN = 0.05  # how much faster the cluster must run to be kept


def _prefer(master, prefer: str, prompt: list[int], log: Callable[[str], None]) -> bool:
    """--prefer: `cluster` keeps the plan; `single` has the master compute alone (the nodes stay connected); `auto`
    times a short request both ways and keeps the cluster only where it ran at least MIN_GAIN faster, as `serve`
    does, saying which and why. Whether the master was made to compute alone (the later prompts then do not
    replan by the devices' speeds, which would undo it)."""
    from edgerun.model.sampling import Sampler, SamplingParams

    if prefer == "cluster" or master.whole is not None:  # the plan already leaves every node out
        return False
    if prefer == "single":
        master.replan(master.alone_plan())
        log("--prefer single: the master computes alone; the nodes stay connected")
        return True

    def timed() -> float:
        master.generate(prompt, 2, Sampler(SamplingParams()))  # warm: graphs built, shares touched
        start = time.perf_counter()
        master.generate(prompt, TRIAL_TOKENS, Sampler(SamplingParams()))
        return (time.perf_counter() - start) / TRIAL_TOKENS * 1e3

    plan = master.plan
    cluster_ms = timed()
    master.replan(master.alone_plan())
    alone_ms = timed()
    if cluster_ms < (1 - MIN_GAIN) * alone_ms:
        master.replan(plan)
        log(f"the cluster ran {cluster_ms:.1f} ms/token against {alone_ms:.1f} for the master alone: it serves")
        return False
    log(f"the cluster ran {cluster_ms:.1f} ms/token against {alone_ms:.1f} for the master alone: the master "
        "computes alone, the nodes stay connected (--prefer cluster uses them anyway)")
    return True


def cmd_master(args: argparse.Namespace) -> None:
    limit_blas_threads(args.threads)
    from edgerun.model import ggml_lib

    ggml_lib.cluster_process()  # its threads wait on the network between blocks
    if not args.wait > 0:
        raise EdgerunError(f"--wait must be a positive number of seconds, not {args.wait}")
    from edgerun.model.generate import generate
    from edgerun.model.loader import load_model
    from edgerun.model.sampling import Sampler
    from edgerun.serve.clusters import build, cluster_config

    if args.expect < 0:
        raise EdgerunError("--expect must be 0 or more")
    if args.max_tokens < 1:
        raise EdgerunError("--max-tokens must be at least 1")
    kind, strategy = cluster_plan(args.plan)
    if kind is ClusterKind.MOE:
        _check_moe_args(args)
    if args.adapter is not None and kind is not ClusterKind.PP:
        raise EdgerunError(f"--adapter runs on pipeline stages: use --plan dp, not --plan {args.plan}")
    model = load_model(args.model)
    if args.adapter is not None:
        from edgerun.tune.lora import apply_adapter

        model = apply_adapter(model, args.adapter)
    params = sampling_params(args)
    log = lambda m: print(f"[master] {m}", file=sys.stderr, flush=True)  # noqa: E731
    fixed = None
    if args.plan_file is not None and kind is ClusterKind.TP:
        from edgerun.sched.tp_plan import load_plan_file

        fixed = load_plan_file(args.plan_file)
    # The options are checked before the key is looked for: a bad option is the one line said, not after the
    # warning that no key was found.
    config = _config(args, cluster_config(_settings(args, model, kind, strategy)))
    loss, predictors = loss_arg(args), _predictors(args, model, kind)
    key = cluster_key(args)
    try:
        cluster = build(model, key, config, log, loss=loss, predictors=predictors)
    except OSError as e:
        raise EdgerunError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    log(f"listening on port {cluster.port}{JOINING[kind].format(port=cluster.port)}; waiting for {args.expect} "
        f"{cluster.members_are}")
    alone = False  # --prefer had the master compute alone

    def run(ids: list[int], emit) -> tuple[list[int], str]:
        if not alone:
            cluster.rebalance()  # the speeds the devices showed on the last prompt, if they call for other shares
        tokens = generate(cluster.engine, ids, args.max_tokens, Sampler(params), model.tokenizer.stop_ids,
                          emit).tokens
        return tokens, cluster.summary()

    try:
        with _advertise(kind, args.host, cluster.port, args.advertise, log):
            if fixed is not None:  # its nodes, then the plan as it is
                master = cluster.engine
                master.wait_for_nodes(len(fixed.devices) - 1)
                master.replan(_plan_for_cluster(fixed, master))
            else:
                _wait(cluster.members_are, args.expect, lambda: list(cluster.members()),
                      lambda t: cluster.wait_for(args.expect, t), args.wait, log)
                if kind is not ClusterKind.MOE:  # a hub places its experts at the first request
                    cluster.deploy()
                if kind is ClusterKind.TP:
                    alone = _prefer(cluster.engine, args.prefer, model.tokenizer.encode(args.prompt or "Hello"), log)
            _serve_prompts(args, model, run)
    finally:
        cluster.close()


# How members join, after "listening on port N"
JOINING = {ClusterKind.TP: "",
           ClusterKind.PP: " (workers: ws://HOST:{port}/ws, browsers: http://HOST:{port}/node)",
           ClusterKind.MOE: " (expert workers: edgerun node --mode moe --master HOST:{port})"}


def _check_moe_args(args: argparse.Namespace) -> None:
    if args.expert_timeout_ms <= 0 or (args.expert_deadline_ms is not None and args.expert_deadline_ms <= 0):
        raise EdgerunError("--expert-timeout-ms and --expert-deadline-ms must be positive")
    if args.replicas < 1 or args.expect < args.replicas:
        raise EdgerunError(f"--replicas {args.replicas} needs at least 1 and at most --expect ({args.expect}) workers: "
                           "each expert's replicas are on distinct workers")


def _settings(args: argparse.Namespace, model, kind: ClusterKind, strategy):
    """The options `edgerun master` shares with `edgerun serve` (serve.clusters.ClusterSettings)."""
    from edgerun.model.onnx_graph import Activations
    from edgerun.pp.config import Route
    from edgerun.pp.master import chat_template_prefix
    from edgerun.serve.clusters import ClusterSettings

    prefix = tuple(chat_template_prefix(model.tokenizer)) if args.chat and kind is ClusterKind.PP else ()
    return ClusterSettings(kind, args.host, args.port, args.max_context, Activations(args.activations), args.threads,
                           strategy=strategy, transport=args.transport, route=Route(args.route), prefix=prefix,
                           replicas=args.replicas, hedge=args.hedge, spin_us=args.spin_us)


def _config(args: argparse.Namespace, config):
    """The kind's config with the options only `edgerun master` has: the tensor-parallel exchange's and the expert
    timeouts."""
    from edgerun.moe.hub import HubConfig
    from edgerun.net.wire import Codec
    from edgerun.tp.config import MasterConfig

    if isinstance(config, MasterConfig):
        return replace(config, codec=Codec[args.codec.upper()],
                       timeout_ms=None if args.adaptive_timeout else args.timeout_ms, budget_mb=args.memory_budget,
                       group_size=args.group_size, rto_min_ms=args.tcp_rto_min_ms,
                       timeout_deviations=args.timeout_deviations, parity=args.parity,
                       parity_always=args.parity_always, mapping=args.mapping, overlap=overlaps(args.overlap),
                       multicast=args.multicast)
    if isinstance(config, HubConfig):
        return replace(config, expert_timeout_s=args.expert_timeout_ms / 1000,
                       expert_deadline_s=None if args.expert_deadline_ms is None else args.expert_deadline_ms / 1000)
    return config


def _predictors(args: argparse.Namespace, model, kind: ClusterKind):
    """--mapping static or dynamic's predictors (tensor-parallel), or None."""
    if kind is not ClusterKind.TP or args.mapping == Mapping.INDEX:
        return None
    from edgerun.sap.predictor import PredictorSet, default_path

    path = args.sap or default_path(model.path)
    if not path.exists():
        raise EdgerunError(f"--mapping {args.mapping} needs predictors at {path}: run `edgerun sap calibrate` "
                           "and `edgerun sap train`, or give --sap FILE")
    return PredictorSet.load(path)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("master", help="run a model tensor-parallel over nodes (HALO)",
                       description="Wait for --expect nodes, plan who computes which attention units and MLP "
                                   "neuron groups, then generate: from --prompt, or one prompt per line of stdin. "
                                   "Between prompts it replans when the speeds the devices showed call for shares "
                                   "predicted at least 5% faster, and keeps the new shares only if their first "
                                   "dozen one-token steps run faster than the old ones' did.")
    model_arg(p)
    p.add_argument("--plan", choices=plan_names(*ClusterKind), default="halo",
                   help="tensor-parallel planner; dp: pipeline layer ranges over WebSocket workers and browser "
                        "pages; moe: a mixture-of-experts model's experts on expert workers (edgerun node --mode "
                        "moe), the rest here (default: halo)")
    p.add_argument("--adapter", type=Path, default=None,
                   help="with --plan dp: a LoRA adapter directory from `edgerun tune`, applied by every stage "
                        "(default: none)")
    p.add_argument("--expect", type=int, default=1, help="nodes (or pipeline workers) to wait for (default: 1)")
    p.add_argument("--prefer", choices=("auto", "cluster", "single"), default="auto",
                   help="tensor-parallel: auto times a short request on the plan and on the master alone and keeps "
                        "the cluster only where it runs at least 5%% faster; cluster always uses the plan; single "
                        "has the master compute alone (default: auto)")
    p.add_argument("--wait", type=float, default=WAIT_S, metavar="SECONDS",
                   help=f"how long to wait for the --expect nodes or workers, saying who joined every "
                        f"{PROGRESS_S:.0f} s, before giving up (default: {WAIT_S:.0f})")
    route_arg(p)
    p.add_argument("--replicas", type=int, default=1, help="with --plan dp: run each stage on this many workers "
                   "where spare ones can hold it and take the first answer (hedged replicas); with --plan moe: "
                   "workers holding each expert (default: 1)")
    p.add_argument("--hedge", default="1", help="with --plan moe: replicas each expert dispatch goes to at once, the "
                   "first answer taken and the others cancelled (at most --replicas); auto: one replica while the "
                   "fastest-looking one's recent median round trip is within 1.5 times the workers' median, else "
                   "--replicas of them (the MoEx paper's adaptive hedging) (default: 1)")
    p.add_argument("--expert-deadline-ms", type=float, default=None, help="with --plan moe: an expert none of whose "
                   "replicas answered this long after its layer was dispatched is dropped, and the token's other "
                   "gates are scaled up to their full sum (default: none, wait for every expert)")
    p.add_argument("--expert-timeout-ms", type=float, default=5000.0, help="with --plan moe: after this a "
                   "dispatch goes to another replica; three timeouts in a row leave a worker out (default: 5000)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0, every interface)")
    p.add_argument("--port", type=int, default=7000, help="TCP port nodes connect to (default: 7000)")
    p.add_argument("--transport", choices=tuple(Transport), default="udp",
                   help="udp: partial results over UDP with a timeout (default); tcp: wait for every node")
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f32", help="activation encoding on the wire: "
                   "f32 exact, f16 and q8 fewer datagrams per vector (default: f32)")
    p.add_argument("--no-multicast", dest="multicast", action="store_false",
                   help="send every one-token input to each node rather than once to the master's multicast group "
                        "(default: multicast, for the nodes that echo a probe sent to the group)")
    udp_args(p)
    rto_min_arg(p)
    spin_arg(p)
    activations_arg(p)
    p.add_argument("--memory-budget", type=float, default=4096.0, help="MB the master's own share may use "
                   "(default: 4096)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256)")
    p.add_argument("--mapping", choices=tuple(Mapping), default="index",
                   help="which units the most reliable devices compute: index (unit order), static (the "
                        "calibration's most important ones) or dynamic (re-ranked by the predictors every token; "
                        "every device then holds the whole model; default: index)")
    p.add_argument("--sap", type=Path, default=None, help="predictor file for --mapping static or dynamic "
                   "(default: MODEL.sap.npz)")
    overlap_arg(p)
    share_threads_arg(p, DEFAULT_THREADS)
    p.add_argument("--max-context", type=int, default=1024, help="KV cache length (default: 1024)")
    p.add_argument("--plan-file", type=Path, default=None,
                   help="a tensor-parallel plan from `edgerun plan --out`: its first device is this master, the "
                        "others are the nodes (by name, e.g. `edgerun node --profile` with their profiles); waits "
                        "for them instead of --expect and runs the plan as it is (default: plan with --plan)")
    p.add_argument("--no-advertise", dest="advertise", action="store_false",
                   help="do not announce this master on the LAN by mDNS (nodes then need --master)")
    p.add_argument("--prompt", default=None, help="generate for this prompt and exit "
                   "(default: one prompt per line of stdin)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt at most (default: 64)")
    sampling_args(p)
    cluster_args(p)
    p.set_defaults(func=cmd_master)
