"""`edgerun serve` and `edgerun chat`: each parser beside its handler."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from edgerun.commands.common import (
    activations_arg,
    route_arg,
    sampling_args,
    sampling_params,
    spin_arg,
    thread_count,
)
from edgerun.errors import EdgerunError
from edgerun.model.batch import PREFILL_CHUNK, ROUND_TOKENS
from edgerun.net.discovery import ClusterKind
from edgerun.net.wire import Transport
from edgerun.sched.plans import cluster_plan, plan_names
from edgerun.serve.client import API_KEY_ENV, stream_events


def add_commands(sub: argparse._SubParsersAction, threads_default: int) -> None:
    p = sub.add_parser(
        "serve", help="a long-running master with an OpenAI-compatible API and a live dashboard",
        description="Serve the model over HTTP (POST /v1/chat/completions, /v1/completions, GET /v1/models, "
                    "/health, /metrics, the dashboard at /). Requests are served at once from this machine's own "
                    "engine; tensor-parallel nodes that join (`edgerun node --master HOST:CLUSTER_PORT`) are "
                    "planned over, and requests move to the cluster when its plan beats serving alone, and back "
                    "when nodes leave. Requests run one at a time in arrival order.")
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF file or a Hugging Face directory (default: the shipped SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address of the API and dashboard: this machine only unless set (0.0.0.0: every "
                        "interface; give --api-key then) (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the API and dashboard (default: 8000)")
    p.add_argument("--cluster-host", default="0.0.0.0",
                   help="address nodes, pipeline and expert workers and browser tabs come to; every packet there is "
                        "checked against the cluster key (default: 0.0.0.0)")
    p.add_argument("--cluster-port", type=int, default=7000,
                   help="port they join at: tensor-parallel nodes' TCP port (their model file comes from a port "
                        "beside it), or with --plan dp or moe the workers' WebSockets and the browser node page "
                        "http://HOST:PORT/node (default: 7000)")
    p.add_argument("--no-cluster", action="store_true", help="serve from this machine alone: no nodes")
    p.add_argument("--no-advertise", dest="advertise", action="store_false",
                   help="do not announce the cluster port on the LAN by mDNS (nodes then need --master)")
    p.add_argument("--plan", choices=plan_names(*ClusterKind), default="halo",
                   help="tensor-parallel planner; dp: a pipeline of workers (`edgerun node --mode pp`) and browser "
                        "tabs (http://HOST:PORT/node) holding ranges of layers; moe: a mixture-of-experts model's "
                        "experts on expert workers (`edgerun node --mode moe --master HOST:PORT`) and tabs "
                        "(http://HOST:PORT/node?mode=moe), the rest here (default: halo)")
    p.add_argument("--adapter", type=Path, default=None,
                   help="a LoRA adapter directory from `edgerun tune`, applied by this machine's engine and, with "
                        "--plan dp, by every pipeline stage (default: none)")
    p.add_argument("--replicas", type=int, default=1, help="--plan moe: workers holding each expert; --plan dp: "
                   "workers running each stage where spare ones can hold it, the first answer taken (default: 1)")
    p.add_argument("--hedge", default="1", help="--plan moe: replicas each expert dispatch goes to at once, or auto "
                   "(one while the fastest-looking replica is quick, else --replicas) (default: 1)")
    p.add_argument("--transport", choices=tuple(Transport), default="udp",
                   help="tensor-parallel: udp sends partial results over UDP with a timeout (a late or lost one costs "
                        "a little accuracy, not a stall); tcp waits for every node, exact (default: udp)")
    p.add_argument("--no-local", dest="local", action="store_false",
                   help="never generate on this machine's own engine (a model too big for it): requests wait for "
                        "nodes, up to --wait")
    p.add_argument("--wait", type=float, default=30.0,
                   help="seconds a request waits for nodes when nothing can serve it, before a 503 (default: 30)")
    p.add_argument("--plan-file", type=Path, default=None,
                   help="a tensor-parallel plan from `edgerun plan --out` (first device: this server), used "
                        "whenever exactly its nodes are present; otherwise --plan plans (default: none)")
    p.add_argument("--prefer", choices=("auto", "cluster", "single"), default="auto",
                   help="auto: the cluster when its plan is predicted at least 5%% faster than this machine alone, "
                        "and while it measures faster; cluster: whenever a node is there; single: never "
                        "(default: auto)")
    p.add_argument("--api-key", default=None, help=f"bearer token the /v1 endpoints require (default: "
                   f"${API_KEY_ENV}; unset: open)")
    p.add_argument("--max-queue", type=int, default=16, help="requests queued or running before 429 (default: 16)")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="requests decoded together on this machine's engine: each joins the running batch between "
                        "its steps with a cache of its own (N caches of --max-context rows, refused where they would "
                        "not fit in free memory), its prompt prefilled in chunks between the others' tokens, a prompt "
                        "or prefix another sequence prefilled taken from its cache; at most 64; needs --no-cluster "
                        "and the ggml engine, or --no-local and a cluster: tensor-parallel (int8 activations), whose "
                        "every share holds N sequences and every block carries a step's rows at once; --plan dp, a "
                        "pipeline whose ggml stages each hold N sequences, a step's sequences going through the "
                        "stages in micro-batches at once; --plan moe, the expert master holds N sequences' caches and "
                        "sends each expert one dispatch of every token of a step that chose it (default: 1, one "
                        "request at a time)")
    p.add_argument("--round-tokens", type=int, default=ROUND_TOKENS, metavar="N",
                   help="with --parallel: prompt tokens a round of the batch runs at most, in chunks of "
                        f"{PREFILL_CHUNK} from each joining request (always one chunk), before the running requests' "
                        "next token; prompts that arrive together share a round's pass over the weights (and on a "
                        "tensor-parallel cluster its exchanges): more finishes them sooner and holds the running "
                        "requests' next token longer; a pipeline's rounds take a chunk a stage instead "
                        f"(default: {ROUND_TOKENS})")
    p.add_argument("--max-context", type=int, default=2048,
                   help="context length (KV cache) per request (default: 2048)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per request when it names none (default: 512)")
    p.add_argument("--model-name", default=None, help="the model's name in the API (default: the file's name)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key, for a Prometheus that has none (default: with --api-key "
                        "every data route needs it: /v1, /metrics, /api/state, /api/events)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of this origin (https://host:port, or * for any) call the API from a "
                        "browser; repeat for several (default: none, same-origin only)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="the one line logged per request (method, path, status, tokens, ms): text, or a JSON "
                        "object a line (default: text)")
    p.add_argument("--no-request-log", dest="log_requests", action="store_false",
                   help="log no line per request (default: one per request)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="bytes of a request's body at most: a larger one "
                   "gets a 413 as it arrives (default: 1048576, 1 MiB)")
    sampling_args(p, ": the API's, for what a request leaves out")
    activations_arg(p)
    route_arg(p)
    spin_arg(p)
    p.add_argument("--timeout-ms", type=float, default=10.0,
                   help="tensor-parallel with --transport udp: how long a block waits for the nodes' partial results "
                        "after sending its input; a later one is left out of the sum (default: 10, as HALO)")
    p.add_argument("--threads", type=thread_count, default=threads_default,
                   help=f"compute threads of this machine's engine and share (default: {threads_default}, this "
                        "machine's cores)")
    p.add_argument("--key", default=None, help="cluster secret that authenticates every packet between master and "
                   "nodes (default: $EDGERUN_KEY, else the one kept in ~/.config/edgerun/cluster.key, made on the "
                   "first run; the join line printed at start shows it)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("chat", help="a multi-turn chat in the terminal with a served model, streaming",
                       description="Type a message and press Enter; an empty line or Ctrl-D ends the chat, "
                                   "/reset forgets the conversation.")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="where `edgerun serve` listens (default: http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV})")
    p.add_argument("--system", default=None, help="a system message that starts the conversation "
                   "(default: none)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most (default: 256)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0 is greedy (default: the server's, 0.8 unless it says otherwise)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the server's)")
    p.add_argument("--greedy", action="store_true", help="always the most likely token, as --temperature 0 "
                   "(default: off)")
    p.set_defaults(func=cmd_chat)


def cmd_serve(args: argparse.Namespace) -> None:
    from edgerun.model.onnx_graph import Activations
    from edgerun.pp.config import Route
    from edgerun.serve.server import ServeConfig, Server
    from edgerun.serve.switch import Prefer

    key, secret = b"", None
    if not args.no_cluster:
        from edgerun.commands.common import cluster_secret
        from edgerun.net.wire import derive_key

        secret = cluster_secret(args, make=True)
        key = derive_key(secret)
        if args.key or os.environ.get("EDGERUN_KEY"):
            secret = None  # a key the user gave is not echoed into the log
    kind, strategy = cluster_plan(args.plan)
    config = ServeConfig(model=args.model, host=args.host, port=args.port, cluster_host=args.cluster_host,
                         secret=secret, cluster_port=None if args.no_cluster else args.cluster_port, key=key,
                         kind=kind, strategy=strategy,
                         prefer=Prefer(args.prefer), api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                         max_queue=args.max_queue, parallel=args.parallel, round_tokens=args.round_tokens,
                         max_context=args.max_context,
                         default_max_tokens=args.max_tokens,
                         threads=args.threads, model_name=args.model_name, sampling=sampling_params(args),
                         max_body=args.max_body, cors_origins=tuple(args.cors_origin),
                         log_requests=args.log_requests, log_format=args.log_format,
                         metrics_public=args.metrics_public,
                         advertise=args.advertise, plan_file=args.plan_file, local=args.local, wait_s=args.wait,
                         transport=Transport(args.transport), activations=Activations(args.activations),
                         route=Route(args.route), replicas=args.replicas, hedge=args.hedge, adapter=args.adapter,
                         spin_us=args.spin_us, timeout_ms=args.timeout_ms)
    server = Server(config, log=lambda m: print(f"[serve] {m}", file=sys.stderr, flush=True))
    server.run()


def cmd_chat(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise EdgerunError("--max-tokens must be at least 1")
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    url = args.url.rstrip("/") + "/v1/chat/completions"
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line.strip()})
        body: dict = {"messages": history, "stream": True, "max_tokens": args.max_tokens}
        if args.greedy or args.temperature is not None:
            body["temperature"] = 0.0 if args.greedy else args.temperature
        if args.seed is not None:
            body["seed"] = args.seed
        answer: list[str] = []
        try:
            _stream_answer(url, body, api_key, answer)
        except KeyboardInterrupt:  # Ctrl-C stops the answer (the server stops at its next token), not the chat
            if not interactive:
                raise
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(answer)})


def _stream_answer(url: str, body: dict, api_key: str | None, answer: list[str]) -> None:
    """Print a streamed chat answer as it comes, its pieces appended to `answer`."""
    for data in stream_events(url, body, api_key):
        piece = data["choices"][0]["delta"].get("content") if data.get("choices") else None
        if piece:
            answer.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
