"""How a pipeline runs: its master's settings and the route a forward pass takes through the stages."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from edgerun.errors import EdgerunError
from edgerun.model.onnx_graph import Activations
from edgerun.net.wire import PP_MAX_FRAME
from edgerun.sched.pp_plan import Pricing


class Route(Enum):
    """How a forward pass goes through the stages.

    CHAIN (the default): the master sends the pass to the first stage, each stage hands its output straight to the
    next one, and the last returns the token: one network hop per stage plus one, instead of two per stage, and
    the master touches no hidden state. STAR: the master sends each stage its input and takes back its output;
    a plan falls back to it where a stage cannot be chained: a browser tab (it cannot accept connections), a
    stage with hedged replicas (the master takes the first answer), a worker that offers no peer port."""

    CHAIN = "chain"
    STAR = "star"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline master runs."""

    host: str = "0.0.0.0"
    port: int = 0  # workers (WebSocket /ws), browser pages (/node) and stage files; 0: any free port
    max_len: int = 1024  # context length: KV cache per worker
    objective: str = "sum"  # the planner's: "sum" (one token's latency) or "max" (the slowest stage)
    pricing: Pricing = Pricing.BYTES  # what the planner counts as a layer's cost (a batch's: MACS)
    # Weigh a plan's start (downloads, sessions) against its speed, as the thesis's planner does for a pipeline
    # that replans between requests. A batch's server is seldom idle and a busy pipeline does not replan, so it is
    # planned for its speed alone.
    init_cost: bool = True
    max_frame: int = PP_MAX_FRAME  # the largest WebSocket message (when the master serves its routes itself)
    replicas: int = 1  # workers per stage where spare ones can hold it (hedged: the first answer counts)
    activations: Activations = Activations.INT8  # of native workers' quantized products (browser tabs: float32)
    route: Route = Route.CHAIN  # stage to stage where every stage can take it, else through the master
    # Prefix cache (the web-inference thesis): every deployment runs these tokens once and the workers keep their KV
    # rows; a request that starts with them sends only the rest.
    prefix: tuple[int, ...] = ()
    # Poll this long for a reply before sleeping (its event loop when the master serves its routes itself, and
    # a chained route's links): a sleeping process wakes late for a packet, once per token on the pipeline's
    # path. Holds a core while generating.
    spin_us: float = 0.0
    # Sequences every ggml stage holds caches for, so that a batch of them runs together (pp.batch; serve
    # --parallel); 1: one request at a time.
    slots: int = 1

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise EdgerunError(f"a pipeline holds at least one sequence, not {self.slots}")
        if self.spin_us < 0:
            raise EdgerunError(f"--spin-us must not be negative, not {self.spin_us}")
        if self.replicas < 1:
            raise EdgerunError(f"--replicas must be at least 1, not {self.replicas}")
        if self.objective not in ("sum", "max"):
            raise EdgerunError(f"unknown objective {self.objective!r} (sum or max)")
        if self.max_len < 1:
            raise EdgerunError("the context length must be at least 1")
