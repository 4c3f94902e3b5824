"""`edgerun serve`: a long-running master with OpenAI's API. It serves at once from its own single-process
engine, listens for tensor-parallel nodes, and moves requests to the cluster when a plan over the nodes
that joined beats serving alone (and back when they leave)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import EdgerunError
from edgerun.model.batch import ROUND_TOKENS
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import USER_DEFAULTS, SamplingParams
from edgerun.net.channel import EventLoopThread
from edgerun.net.discovery import ClusterKind
from edgerun.net.http_server import HttpServer, bind
from edgerun.net.wire import Transport
from edgerun.pp.config import Route
from edgerun.sched.moe import hedge_setting
from edgerun.sched.plans import TPStrategy, plan_name
from edgerun.serve.switch import Prefer

SWITCH_INTERVAL_S = 0.0005
MAX_PARALLEL = 64  # requests decoded together at most (each a cache of --max-context rows)
# A pipeline's --parallel sequences step in this many lanes, each a batch of its own with one pass in flight: as many
# as the stages of a plan of four keeps each stage busy, and a plan of fewer stages queues the passes it does not take
# at once (the plan is made as workers come, after the lanes).
PIPELINE_LANES = 4


@dataclass(frozen=True)
class ServeConfig:
    model: Path | None = None  # a GGUF file or HF directory; None: the shipped model
    host: str = "127.0.0.1"  # the API and the dashboard: this machine only unless told otherwise
    port: int = 8000  # HTTP: the API and the dashboard
    cluster_host: str = "0.0.0.0"  # where nodes, workers and tabs come: keyed members from the network
    cluster_port: int | None = 7000  # nodes, workers and tabs join here; None: no cluster
    key: bytes = b""  # the cluster's derived key
    secret: str | None = None  # the kept cluster secret, shown in the join line (None: the user gave it)
    kind: ClusterKind = ClusterKind.TP  # the cluster it starts: tensor-parallel, a pipeline, or an expert master (MoEx)
    strategy: TPStrategy = TPStrategy.HALO  # a tensor-parallel cluster's planner
    transport: Transport = Transport.UDP  # a tensor-parallel cluster's
    prefer: Prefer = Prefer.AUTO
    api_key: str | None = None
    max_queue: int = 16
    parallel: int = 1  # requests decoded together on this machine's engine (continuous batching; 1: one at a time)
    round_tokens: int = ROUND_TOKENS  # prompt tokens a --parallel round runs at most (model.batch.BatchLoop)
    max_context: int = 2048
    default_max_tokens: int = 512
    threads: int = 1
    sampling: SamplingParams = USER_DEFAULTS  # what an API request leaves out of its sampling
    max_body: int = 1 << 20  # bytes of an API request's body at most
    cors_origins: tuple[str, ...] = ()  # web pages of these origins may call the API
    metrics_public: bool = False  # /metrics without the API key
    log_requests: bool = True  # one log line per request
    log_format: str = "text"  # of that line: text or json (one object a line)
    model_name: str | None = None  # what the API calls the model (default: the file's name)
    advertise: bool = True  # announce the cluster port by mDNS
    plan_file: Path | None = None  # a tensor-parallel plan (edgerun plan --out) to run when its nodes are present
    local: bool = True  # serve from this machine's own engine too (not when the model is too big for it)
    activations: Activations = Activations.INT8  # of the quantized products: this engine's and the cluster's
    route: Route = Route.CHAIN  # a pipeline's passes: stage to stage, or through this server
    wait_s: float = 30.0  # how long a request waits for nodes when nothing can serve it, before a 503
    replicas: int = 1  # --plan moe: workers holding each expert
    hedge: str = "1"  # --plan moe: replicas each dispatch goes to, or "auto"
    adapter: Path | None = None  # a LoRA adapter (edgerun tune) on the local engine and pipeline stages
    spin_us: float = 0.0  # how long the cluster's master polls for its members' replies before sleeping
    timeout_ms: float = 10.0  # a tensor-parallel block's wait for the nodes' partials over UDP

    def __post_init__(self) -> None:
        if not self.local and self.cluster_port is None:
            raise EdgerunError("--no-local and --no-cluster leave nothing to serve with")
        if self.wait_s < 0:
            raise EdgerunError("--wait must be 0 or more seconds")
        if self.max_body < 1024:
            raise EdgerunError(f"--max-body must be at least 1024 bytes, not {self.max_body}")
        if self.max_queue < 1 or self.max_context < 16 or self.default_max_tokens < 1 or self.threads < 1:
            raise EdgerunError("--max-queue, --max-tokens and --threads must be at least 1, --max-context 16")
        if not 0 <= self.port < 65536 or (self.cluster_port is not None and not 0 <= self.cluster_port < 65536):
            raise EdgerunError("ports must lie in 0..65535")
        if not 1 <= self.parallel <= MAX_PARALLEL:
            raise EdgerunError(f"--parallel must be from 1 to {MAX_PARALLEL}")
        if self.round_tokens < 1:
            raise EdgerunError(f"--round-tokens must be at least 1, not {self.round_tokens}")
        if self.parallel > 1 and not ((self.local and self.cluster_port is None) or
                                      (self.cluster_port is not None and not self.local)):
            raise EdgerunError("--parallel batches this machine's own engine (with --no-cluster) or a cluster's "
                               "(with --no-local): a tensor-parallel cluster's shares, a pipeline's stages (--plan "
                               "dp) or an expert master (--plan moe)")
        if self.parallel > 1 and self.kind is ClusterKind.TP and self.activations is Activations.F32:
            raise EdgerunError("--parallel on a tensor-parallel cluster runs on ggml shares: int8 activations, not "
                               "--activations f32")
        if self.replicas < 1:
            raise EdgerunError("--replicas must be at least 1")
        if not 0 <= self.spin_us < float("inf"):
            raise EdgerunError(f"--spin-us must be 0 or more microseconds, not {self.spin_us}")
        if not 0 < self.timeout_ms < float("inf"):
            raise EdgerunError(f"--timeout-ms must be above 0 milliseconds, not {self.timeout_ms}")
        hedge_setting(self.hedge, self.replicas)  # one line for a bad --hedge, before anything loads
        if self.adapter is not None and self.cluster_port is not None and self.kind is not ClusterKind.PP:
            raise EdgerunError(f"--adapter runs on this machine's engine and pipeline stages: use --plan dp or "
                               f"--no-cluster, not --plan {plan_name(self.kind, self.strategy)}")


def check_batch_memory(cache_bytes: int, parallel: int, max_len: int, available: int | None = None) -> None:
    """Refuse --parallel's caches where they would not fit in the memory this machine has free (the model is
    loaded by then): they are allocated at once, one of max_len positions per sequence."""
    import psutil

    free = psutil.virtual_memory().available if available is None else available
    if cache_bytes > 0.8 * free:
        raise EdgerunError(f"--parallel {parallel} with a context of {max_len} tokens keeps {cache_bytes / 2**30:.1f} "
                           f"GiB of keys and values, and this machine has {free / 2**30:.1f} GiB free: lower "
                           f"--parallel or --max-context")


class Server:
    """Everything `edgerun serve` runs: engines, master, service and the HTTP app. run() serves until
    interrupted. Two doors: the API and the dashboard at host:port (this machine only by default), and the
    cluster's members at cluster_host:cluster_port (every interface by default, every packet checked against the
    cluster key): tensor-parallel nodes' TCP port (their model file from the master's own file server), or a
    pipeline's or expert master's own HTTP server with the workers' WebSockets, browser node page and stage files."""

    def __init__(self, config: ServeConfig, log: Callable[[str], None] = lambda _: None) -> None:
        from edgerun.model.batch import BatchLoop
        from edgerun.model.generate import default_engine, make_engine
        from edgerun.model.loader import load_model
        from edgerun.serve.app import Api, ApiConfig, LogFormat, build_app
        from edgerun.serve.metrics import Metrics
        from edgerun.serve.service import Service
        from edgerun.serve.switch import EngineSwitch

        self.config, self.log = config, log
        # The generation thread and the HTTP loop share the GIL. The engine thread takes it back after every
        # native call; at the default 5 ms switch interval it can wait that long behind the loop's per-token
        # work (decoding, JSON, the socket). A shorter interval bounds that wait.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.sock = bind(config.host, config.port)  # first: a port in use fails before minutes of loading
        self.port = self.sock.getsockname()[1]
        self.net = EventLoopThread()
        self.http: HttpServer | None = None
        try:
            self.model = model = load_model(config.model)
            if config.adapter is not None:
                from edgerun.tune.lora import apply_adapter

                self.model = model = apply_adapter(model, config.adapter)
            max_len = min(config.max_context, model.config.context_length)
            if config.parallel > 1 and (config.local or config.kind is ClusterKind.MOE):  # the caches held here
                check_batch_memory(model.config.kv_cache_bytes(max_len * config.parallel), config.parallel, max_len)
            single = make_engine(default_engine(model, config.activations == Activations.F32), model, max_len,
                                 threads=config.threads, slots=config.parallel) if config.local else None
            self.cluster = None if config.cluster_port is None else self._cluster(model, max_len)
            self.advertiser = None
            if self.cluster is not None and config.advertise:
                from edgerun.net.discovery import Advertiser

                mode = config.kind
                self.advertiser = Advertiser(mode, config.cluster_host, self.cluster.port, log=log)
            self.switch = EngineSwitch(single, self.cluster, config.prefer, max_len, log)
            self.metrics = Metrics()
            batch = None
            if config.parallel > 1 and single is not None:
                batch = BatchLoop(single, round_tokens=config.round_tokens)  # type: ignore[arg-type]  # a GgmlEngine
            elif config.parallel > 1 and config.kind is ClusterKind.MOE:
                # the hub's sequences, one dispatch an expert a step
                batch = BatchLoop(self.cluster.engine, round_tokens=config.round_tokens)
            elif config.parallel > 1 and config.kind is ClusterKind.TP:
                # every share's slots, one exchange a block for all
                from edgerun.tp.batch import TpBatch

                batch = BatchLoop(TpBatch(self.cluster.engine), round_tokens=config.round_tokens)
            elif config.parallel > 1:  # a pipeline's stages in lanes (pp.batch), each stepping in a thread
                batch = self._pipeline_lanes(self.cluster.engine, config.parallel)
            self.service = Service(self.switch, model.tokenizer.stop_ids, config.max_queue, config.wait_s,
                                   self.metrics, log, batch)
            name = config.model_name or model.name
            self.api = Api(model, self.service, self.switch, self.metrics,
                           ApiConfig(name, config.api_key, config.default_max_tokens,
                                     sampling=config.sampling, max_body=config.max_body, threads=config.threads,
                                     cors_origins=config.cors_origins, metrics_public=config.metrics_public))
            self.app = build_app(self.api, log if config.log_requests else None, LogFormat(config.log_format))
        except BaseException:
            self.sock.close()
            self.net.stop()
            raise

    @staticmethod
    def _pipeline_lanes(pipeline, parallel: int) -> list:
        """Batches over a pipeline's slots, PIPELINE_LANES of them (pp.batch.pipeline_lanes); the deployment may
        repartition once none runs."""
        from edgerun.model.batch import BatchLoop
        from edgerun.pp.batch import pipeline_lanes

        lanes: list[BatchLoop] = []

        def idle() -> None:
            if not any(lane.running for lane in lanes):
                pipeline.release()

        lanes += [BatchLoop(engine, draws=True, on_idle=idle) for engine in pipeline_lanes(pipeline, PIPELINE_LANES)]
        return lanes

    def _cluster(self, model, max_len: int):
        """The cluster members join (serve.clusters.build): a tensor-parallel master, a pipeline master for --plan
        dp, or a MoEx hub for --plan moe; pipelines and hubs serve their members on their own HTTP server at the
        cluster port, tensor-parallel nodes download the model from the master's file server beside it."""
        from edgerun.serve.clusters import ClusterSettings, build, cluster_config

        config, log = self.config, self.log
        prefix = ()
        if config.kind is ClusterKind.PP and model.tokenizer.chat_template:
            from edgerun.pp.master import chat_template_prefix

            prefix = tuple(chat_template_prefix(model.tokenizer))
        plan_file = None
        if config.plan_file is not None:
            from edgerun.sched.tp_plan import load_plan_file

            plan_file = load_plan_file(config.plan_file)
        settings = ClusterSettings(config.kind, config.cluster_host, config.cluster_port, max_len, config.activations,
                                   config.threads, config.parallel, config.strategy, config.transport, config.route,
                                   prefix, config.replicas, config.hedge, config.spin_us, config.timeout_ms)
        label = {ClusterKind.PP: "pipeline", ClusterKind.MOE: "experts"}.get(config.kind, "cluster")
        try:
            return build(model, config.key, cluster_config(settings), lambda m: log(f"{label}: {m}"), plan_file)
        except OSError as e:
            raise EdgerunError(f"cannot listen for nodes on {config.cluster_host}:{config.cluster_port}: "
                               f"{e.strerror or e}") from e

    def run(self) -> None:
        where = f"http://{'localhost' if self.config.host in ('0.0.0.0', '::') else self.config.host}:{self.port}"
        mode = {ClusterKind.PP: "--mode pp ", ClusterKind.MOE: "--mode moe "}.get(self.config.kind, "")
        key = f" --key {self.config.secret}" if self.config.secret else \
            (" --key <the key given to serve>" if self.cluster is not None else "")
        nodes = "" if self.cluster is None else \
            f"; nodes join with `edgerun node {mode}--master HOST:{self.cluster.port}{key}`"
        if self.config.kind is not ClusterKind.TP and self.cluster is not None:
            nodes += f", browser tabs at http://HOST:{self.cluster.port}/node" + \
                ("?mode=moe" if self.config.kind is ClusterKind.MOE else "") + \
                f"#key={self.config.secret or '<the key>'}"
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        try:
            self.http = HttpServer(self.app, self.sock, self.net)
            self.log(f"serving {self.api.config.model_name} at {where} (API {where}/v1, dashboard {where}/){nodes}")
            while self.http.running() and not stop.wait(0.5):
                pass
        finally:
            self.close()

    def close(self) -> None:
        if self.advertiser is not None:
            self.advertiser.close()
        self.service.close()
        self.switch.close()  # closes the cluster: a pipeline master closes its workers' WebSockets first
        if self.http is not None:
            self.http.close()
        self.sock.close()
        self.net.stop()
