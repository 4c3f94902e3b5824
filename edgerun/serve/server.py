"""`edgerun serve`: a long-running master with OpenAI's API. It serves at once from its own single-process
engine, listens for tensor-parallel nodes, and moves requests to the cluster when a plan over the nodes
that joined beats serving alone (and back when they leave)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import EdgerunError
from edgerun.serve.switch import Prefer

SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ServeConfig:
    model: Path | None = None  # a GGUF file or HF directory; None: the shipped model
    host: str = "0.0.0.0"
    port: int = 8000  # HTTP: the API and the dashboard
    cluster_port: int | None = 7000  # tensor-parallel nodes connect here; None: no cluster
    key: bytes = b""  # the cluster's derived key
    plan: str = "halo"  # tensor-parallel planner
    prefer: Prefer = Prefer.AUTO
    api_key: str | None = None
    max_queue: int = 16
    max_context: int = 2048
    default_max_tokens: int = 512
    threads: int = 1
    model_name: str | None = None  # what the API calls the model (default: the file's name)
    advertise: bool = True  # announce the cluster port by mDNS
    plan_file: Path | None = None  # a tensor-parallel plan (edgerun plan --out) to run when its nodes are present

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_context < 16 or self.default_max_tokens < 1 or self.threads < 1:
            raise EdgerunError("--max-queue, --max-tokens and --threads must be at least 1, --max-context 16")
        if not 0 <= self.port < 65536 or (self.cluster_port is not None and not 0 <= self.cluster_port < 65536):
            raise EdgerunError("ports must lie in 0..65535")


def bind(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound here so that a port in use is one clear line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EdgerunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class Server:
    """Everything `edgerun serve` runs: engines, master, service and the HTTP app. start() returns once it
    listens; run() serves until interrupted."""

    def __init__(self, config: ServeConfig, log: Callable[[str], None] = lambda _: None) -> None:
        import uvicorn

        from edgerun.model.generate import make_engine
        from edgerun.model.loader import load_model
        from edgerun.serve.app import Api, ApiConfig, build_app
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
        try:
            self.model = model = load_model(config.model)
            max_len = min(config.max_context, model.config.context_length)
            single = make_engine("onnx", model, max_len, threads=config.threads)
            self.master = None
            if config.cluster_port is not None:
                from edgerun.tp.config import MasterConfig
                from edgerun.tp.master import Master

                try:
                    self.master = Master(model, config.key, MasterConfig(
                        strategy=config.plan, host=config.host, port=config.cluster_port, max_len=max_len,
                        threads=config.threads), log=lambda m: log(f"cluster: {m}"))
                except OSError as e:
                    raise EdgerunError(f"cannot listen for nodes on {config.host}:{config.cluster_port}: "
                                       f"{e.strerror or e}") from e
            self.advertiser = None
            if self.master is not None and config.advertise:
                from edgerun.net.discovery import Advertiser, ClusterMode

                self.advertiser = Advertiser(ClusterMode.TP, config.host, self.master.port, log=log)
            plan_file = None
            if config.plan_file is not None:
                from edgerun.cli import load_plan_file

                plan_file = load_plan_file(config.plan_file)
            self.switch = EngineSwitch(single, self.master, config.prefer, log, plan_file)
            self.metrics = Metrics()
            self.service = Service(self.switch, model.tokenizer.stop_ids, config.max_queue, self.metrics, log)
            name = config.model_name or model.name
            self.api = Api(model, self.service, self.switch, self.metrics,
                           ApiConfig(name, config.api_key, config.default_max_tokens))
            self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(self.api), log_level="warning",
                                                         loop="auto", timeout_graceful_shutdown=2))
        except BaseException:
            self.sock.close()
            raise

    def run(self) -> None:
        where = f"http://{'localhost' if self.config.host in ('0.0.0.0', '::') else self.config.host}:{self.port}"
        nodes = "" if self.master is None else f"; nodes join with `edgerun node --master HOST:{self.master.port}`"
        self.log(f"serving {self.api.config.model_name} at {where} (API {where}/v1, dashboard {where}/){nodes}")
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.close()

    def stop(self) -> None:
        self.uvicorn.should_exit = True

    def close(self) -> None:
        if self.advertiser is not None:
            self.advertiser.close()
        self.service.close()
        if self.master is not None:
            self.master.close()
        self.sock.close()
