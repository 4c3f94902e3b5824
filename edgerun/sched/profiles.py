"""Device and model profiles: the plain data every planner decides from.

A device profile is a versioned JSON document (schema "edgerun.device/1"), written by
`edgerun profile` or shipped in profiles/ for hardware that is not at hand. A model profile is
computed from a model file without running it: the bytes, FLOPs and memory of every unit the
planners place — a layer for pipeline plans; an attention unit, an MLP neuron group or an LM-head
vocabulary block for tensor-parallel plans.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig

if TYPE_CHECKING:  # a type here: the GGUF reader stays out of processes that only plan or describe devices
    from edgerun.model.weights import ModelWeights

DEVICE_SCHEMA = "edgerun.device/1"
ACTIVATION_BYTES = 4  # float32 hidden states on the wire and in the KV cache


# A master's time per node and block before its own share starts, until it has measured its own: sealing and
# sending the node's input, and (counted here too, to err on the side of a lighter master share) taking in and
# adding its partial. Measured with bench tp's per-block trace on the device machine (16 slow cores, 1B model, 7
# nodes): 210-330 µs from the first send to the master's own compute and about 30 µs more per partial in one
# stop; ~115 µs to its own compute in another.
SEND_S_PER_NODE = 50e-6


@dataclass(frozen=True)
class Compute:
    matmul_gflops: float  # float32 matrix-multiply throughput
    weight_bytes_per_s: float  # decode throughput: weight bytes a forward pass streams per second
    session_overhead_ms: float = 0.2  # fixed cost per stage run, whatever its size
    layer_ms: float = 0.0  # measured decode time of one layer of `layer_model` (0: not measured)
    layer_model: str = ""
    # A tensor-parallel master's time per node it hands a block's input to (sealing, sending) before its own share
    # starts; a running master measures its own (SyncModel.STAR prices the master's blocks with it).
    send_s_per_node: float = SEND_S_PER_NODE


@dataclass(frozen=True)
class Memory:
    total_mb: float
    available_mb: float
    budget_mb: float  # what edgerun may use: the planners' hard limit
    bandwidth_gb_s: float


@dataclass(frozen=True)
class Link:
    """The link between this device and the master."""

    rtt_ms: float
    up_mbit: float
    down_mbit: float
    loss_rate: float  # packet-loss rate, 0..1


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    kind: str  # rpi4, rpi5, jetson, gpu, browser, x86, ...
    cores: int
    compute: Compute
    memory: Memory
    link: Link
    disk_read_mb_s: float = 0.0
    measured_at: str = ""  # ISO 8601; empty for reference profiles
    sources: dict[str, str] = field(default_factory=dict)  # field -> where its figure comes from

    @property
    def budget_bytes(self) -> float:
        return self.memory.budget_mb * 1e6

    def to_json(self) -> dict[str, Any]:
        return {"schema": DEVICE_SCHEMA, **asdict(self)}

    def with_budget(self, budget_mb: float) -> DeviceProfile:
        memory = Memory(self.memory.total_mb, self.memory.available_mb, budget_mb, self.memory.bandwidth_gb_s)
        return DeviceProfile(self.name, self.kind, self.cores, self.compute, memory, self.link,
                             self.disk_read_mb_s, self.measured_at, self.sources)


def _number(data: dict[str, Any], key: str, where: str, minimum: float = 0.0, maximum: float | None = None,
            default: float | None = None) -> float:
    if key not in data:
        if default is not None:
            return default
        raise ValueError(f"{where}.{key} is missing")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key} must be a number, not {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ValueError(f"{where}.{key} must be {bound}, not {value}")
    return float(value)


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{key} is missing or not an object")
    return value


def device_from_json(data: Any) -> DeviceProfile:
    """Validate a device profile document; errors name the offending field."""
    if not isinstance(data, dict):
        raise ValueError("a device profile must be a JSON object")
    if data.get("schema") != DEVICE_SCHEMA:
        raise ValueError(f"schema must be {DEVICE_SCHEMA!r}, not {data.get('schema')!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("name must be a non-empty string")
    c, m, n = _section(data, "compute"), _section(data, "memory"), _section(data, "link")
    memory = Memory(_number(m, "total_mb", "memory", 1), _number(m, "available_mb", "memory", 0),
                    _number(m, "budget_mb", "memory", 0), _number(m, "bandwidth_gb_s", "memory", 0))
    if memory.budget_mb > memory.total_mb:
        raise ValueError(f"memory.budget_mb ({memory.budget_mb}) exceeds memory.total_mb ({memory.total_mb})")
    sources = data.get("sources", {})
    if not isinstance(sources, dict):
        raise ValueError("sources must be an object")
    return DeviceProfile(
        name=name,
        kind=str(data.get("kind", "unknown")),
        cores=int(_number(data, "cores", "device", 1)),
        compute=Compute(_number(c, "matmul_gflops", "compute", 0), _number(c, "weight_bytes_per_s", "compute", 1),
                        _number(c, "session_overhead_ms", "compute", 0, default=0.2),
                        _number(c, "layer_ms", "compute", 0, default=0.0), str(c.get("layer_model", ""))),
        memory=memory,
        link=Link(_number(n, "rtt_ms", "link", 0), _number(n, "up_mbit", "link", 1e-3),
                  _number(n, "down_mbit", "link", 1e-3), _number(n, "loss_rate", "link", 0, 1)),
        disk_read_mb_s=_number(data, "disk_read_mb_s", "device", 0, default=0.0),
        measured_at=str(data.get("measured_at", "")),
        sources={str(k): str(v) for k, v in sources.items()},
    )


def load_device(path: Path) -> DeviceProfile:
    """Read a device profile file; every problem becomes an EdgerunError naming the file and field."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise EdgerunError(f"device profile not found: {path}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgerunError(f"{path}: not a JSON file ({e})") from e
    try:
        return device_from_json(data)
    except ValueError as e:
        raise EdgerunError(f"{path}: {e}") from e


def load_devices(paths: list[Path]) -> list[DeviceProfile]:
    if not paths:
        raise EdgerunError("no device profiles given")
    devices = [load_device(p) for p in paths]
    names = [d.name for d in devices]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise EdgerunError(f"device names must be unique; repeated: {', '.join(duplicates)}")
    return devices


@dataclass(frozen=True)
class UnitCost:
    """One placeable unit: its weights in their stored format, FLOPs and KV bytes per token."""

    weight_bytes: float
    flops: float
    kv_bytes_per_token: float = 0.0


@dataclass(frozen=True)
class ModelProfile:
    name: str
    n_layers: int
    hidden: int
    context: int  # tokens the KV cache is sized for
    # Tensor-parallel units, the same in every layer (GQA: one attention unit per KV head, holding
    # the query heads that share it, so K and V are computed once).
    n_attn_units: int
    n_mlp_groups: int
    n_vocab_blocks: int
    group_size: int
    vocab_block: int
    attn_unit: UnitCost
    mlp_group: UnitCost  # a full group; the last may be shorter, which the planners ignore
    vocab_unit: UnitCost
    # Pipeline units: one per transformer layer, the embedding in the first and the head in the last.
    layer_weight_bytes: tuple[float, ...]  # held (and downloaded) by the stage
    layer_read_bytes: tuple[float, ...]  # streamed per token: the embedding table is only indexed
    layer_flops: tuple[float, ...]
    kv_bytes_per_token_per_layer: float
    activation_bytes_per_token: float  # a hidden state crossing a cut

    @property
    def layer_memory_bytes(self) -> tuple[float, ...]:
        kv = self.kv_bytes_per_token_per_layer * self.context
        return tuple(w + kv for w in self.layer_weight_bytes)

    def unit_memory(self, kind: str) -> float:
        unit = {"attn": self.attn_unit, "mlp": self.mlp_group, "vocab": self.vocab_unit}[kind]
        return unit.weight_bytes + unit.kv_bytes_per_token * self.context

    def total_tp_weight_bytes(self) -> float:
        """Every unit's weight bytes: what a one-token step of the whole model streams, as the planners count it."""
        per_layer = self.n_attn_units * self.attn_unit.weight_bytes + self.n_mlp_groups * self.mlp_group.weight_bytes
        return self.n_layers * per_layer + self.n_vocab_blocks * self.vocab_unit.weight_bytes

    def total_tp_memory(self) -> float:
        per_layer = self.n_attn_units * self.unit_memory("attn") + self.n_mlp_groups * self.unit_memory("mlp")
        return self.n_layers * per_layer + self.n_vocab_blocks * self.unit_memory("vocab")


def model_profile(name: str, config: ModelConfig, weights: ModelWeights, context: int = 1024,
                  group_size: int = 256, vocab_block: int = 4096) -> ModelProfile:
    """Profile a model from its shape and stored weight sizes."""
    c = config
    layer = weights.layers[0]
    unit_heads = c.heads_per_kv
    # Per attention unit: its query rows and output columns, and one KV head's K and V rows.
    attn_bytes = (layer.wq.nbytes + layer.wo.nbytes) * unit_heads / c.n_heads + \
                 (layer.wk.nbytes + layer.wv.nbytes) / c.n_kv_heads
    attn_params = 2 * unit_heads * c.head_dim * c.hidden + 2 * c.head_dim * c.hidden
    vocab_bytes = weights.output.nbytes * vocab_block / c.vocab_size
    kv_per_unit = 2 * c.head_dim * ACTIVATION_BYTES
    layer_bytes = [float(sum(t.nbytes for _, t in lw.matrices())) for lw in weights.layers]
    if layer.moe is None:
        mlp_bytes = (layer.w_gate.nbytes + layer.w_up.nbytes + layer.w_down.nbytes) * group_size / c.ffn
        read_bytes = list(layer_bytes)
        mlp_width = c.ffn
    else:  # a token reads the router and its k experts (and the shared one) of the layer's experts
        mlp_bytes = 0.0  # no neuron groups: tensor-parallel plans take dense models
        unread = sum(e.nbytes for e in layer.moe.experts) - c.n_experts_used * layer.moe.experts[0].nbytes
        read_bytes = [b - unread for b in layer_bytes]
        mlp_width = c.n_experts_used * c.expert_ffn + c.shared_expert_ffn
    read_bytes[-1] += weights.output.nbytes
    layer_flops = [2.0 * (attn_params * c.n_kv_heads + 3 * c.hidden * mlp_width)] * c.n_layers
    layer_bytes[0] += weights.token_embd.nbytes
    layer_bytes[-1] += weights.output.nbytes  # tied or not, the last stage needs the LM head
    layer_flops[-1] += 2.0 * c.vocab_size * c.hidden
    return ModelProfile(
        name=name, n_layers=c.n_layers, hidden=c.hidden, context=context,
        n_attn_units=c.n_kv_heads, n_mlp_groups=-(-c.ffn // group_size), n_vocab_blocks=-(-c.vocab_size // vocab_block),
        group_size=group_size, vocab_block=vocab_block,
        attn_unit=UnitCost(attn_bytes, 2.0 * attn_params, kv_per_unit),
        mlp_group=UnitCost(mlp_bytes, 2.0 * 3 * c.hidden * group_size),
        vocab_unit=UnitCost(vocab_bytes, 2.0 * vocab_block * c.hidden),
        layer_weight_bytes=tuple(layer_bytes), layer_read_bytes=tuple(read_bytes), layer_flops=tuple(layer_flops),
        kv_bytes_per_token_per_layer=kv_per_unit * c.n_kv_heads,
        activation_bytes_per_token=c.hidden * ACTIVATION_BYTES,
    )
