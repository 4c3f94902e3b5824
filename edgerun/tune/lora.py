"""LoRA adapters as data: which projections they touch, their shapes, and their file.

An adapter adds (alpha / rank) * B @ A to a frozen projection W (out, in): A is (rank, in), B is (out, rank).
Engines never fold it into W (a quantized matrix cannot absorb it exactly); they compute x @ W.T and add
((x @ A.T) @ B.T) * scale beside it.

Files are PEFT's: a directory with adapter_model.safetensors, named
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` and so on, and adapter_config.json. The
safetensors header's metadata also carries the base model's sha256, so an adapter is never applied to another
model. Q and K rows are in Hugging Face order, as edgerun holds every model's weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig
from edgerun.model.hf_dir import LAYER_TENSORS, read_safetensors_with_metadata, write_safetensors
from edgerun.model.loader import Model
from edgerun.model.quant import quantize

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
BASE_KEY = "edgerun.base_sha256"


# Hugging Face's projection name ("q_proj") -> the LayerWeights field holding it ("wq"), from the one table of names.
_FIELD_OF_PROJECTION = {name.split(".")[1]: field for field, name in LAYER_TENSORS.items()
                        if name.endswith("_proj.weight")}


class Target(Enum):
    """A projection LoRA can adapt, by its Hugging Face name; `field` is the LayerWeights field it adds to."""

    Q = "q_proj"
    K = "k_proj"
    V = "v_proj"
    O = "o_proj"  # noqa: E741 (the projection's name)
    GATE = "gate_proj"
    UP = "up_proj"
    DOWN = "down_proj"

    @property
    def field(self) -> str:
        return _FIELD_OF_PROJECTION[self.value]

    @property
    def module(self) -> str:
        """"self_attn" or "mlp", as Hugging Face names the projection's parent."""
        return LAYER_TENSORS[self.field].split(".")[0]

    def shape(self, config: ModelConfig) -> tuple[int, int]:
        """(out, in) of the projection."""
        h = config.hidden
        return {Target.Q: (config.q_dim, h), Target.K: (config.kv_dim, h), Target.V: (config.kv_dim, h),
                Target.O: (h, config.q_dim), Target.GATE: (config.ffn, h), Target.UP: (config.ffn, h),
                Target.DOWN: (h, config.ffn)}[self]


def parse_targets(text: str) -> tuple[Target, ...]:
    """'q,v' or 'q_proj,v_proj' -> targets; 'all' for every projection."""
    if text.strip() == "all":
        return tuple(Target)
    out = []
    for part in text.split(","):
        name = part.strip()
        name = name if name.endswith("_proj") else f"{name}_proj"
        try:
            out.append(Target(name))
        except ValueError:
            raise EdgerunError(f"unknown LoRA target {part.strip()!r} (choose from q, k, v, o, gate, up, down, "
                               "or all)") from None
    if not out or len(set(out)) != len(out):
        raise EdgerunError(f"LoRA targets must be distinct and at least one: {text!r}")
    return tuple(sorted(out, key=list(Target).index))


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[Target, ...] = (Target.Q, Target.V)
    seed: int = 0  # A's initial values and every dropout mask derive from it

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise EdgerunError(f"LoRA rank must be at least 1, not {self.rank}")
        if not self.alpha > 0:
            raise EdgerunError(f"LoRA alpha must be positive, not {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise EdgerunError(f"LoRA dropout must be in [0, 1), not {self.dropout}")
        if not self.targets:
            raise EdgerunError("LoRA needs at least one target projection")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": [t.value for t in self.targets], "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict) -> LoraConfig:
        return cls(rank=int(data["rank"]), alpha=float(data["alpha"]), dropout=float(data["dropout"]),
                   targets=tuple(Target(t) for t in data["targets"]), seed=int(data.get("seed", 0)))


def tensor_name(layer: int, target: Target, part: str) -> str:
    """PEFT's name of one LoRA matrix; `part` is "A" or "B"."""
    return f"base_model.model.model.layers.{layer}.{target.module}.{target.value}.lora_{part}.weight"


def parse_tensor_name(name: str) -> tuple[int, Target, str]:
    """(layer, target, "A" or "B") of a name `tensor_name` makes; ValueError for any other name."""
    parts = name.split(".")
    if len(parts) != 9 or parts[:4] != ["base_model", "model", "model", "layers"] or \
            parts[7] not in ("lora_A", "lora_B") or parts[8] != "weight":
        raise ValueError(f"unexpected tensor {name}")
    target = Target(parts[6])
    if parts[5] != target.module or not parts[4].isdigit():
        raise ValueError(f"unexpected tensor {name}")
    return int(parts[4]), target, parts[7][-1]


@dataclass(frozen=True)
class Adapter:
    """Float32 LoRA matrices by (layer, target): (A (rank, in), B (out, rank))."""

    config: LoraConfig
    base_sha256: str
    matrices: dict[tuple[int, Target], tuple[np.ndarray, np.ndarray]]

    def for_layer(self, layer: int) -> dict[Target, tuple[np.ndarray, np.ndarray]]:
        return {t: ab for (i, t), ab in self.matrices.items() if i == layer}

    def check_model(self, config: ModelConfig, sha256: str, where: str) -> None:
        """EdgerunError unless this adapter was made for the model with this hash and shape."""
        if self.base_sha256 != sha256:
            raise EdgerunError(f"adapter {where} was trained on another model (base sha256 "
                               f"{self.base_sha256[:12]}…, this model {sha256[:12]}…)")
        for (layer, target), (a, b) in self.matrices.items():
            out, inp = target.shape(config)
            if not 0 <= layer < config.n_layers or a.shape != (self.config.rank, inp) or \
                    b.shape != (out, self.config.rank):
                raise EdgerunError(f"adapter {where}: {target.value} of layer {layer} does not fit this model")

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for (layer, target), (a, b) in sorted(self.matrices.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            for part, m in (("A", a), ("B", b)):
                tensors[tensor_name(layer, target, part)] = quantize(m, "F32")
        write_safetensors(directory / ADAPTER_FILE, tensors, {BASE_KEY: self.base_sha256, "format": "pt"})
        # PEFT's own keys, so its loader takes the directory; edgerun reads its own below.
        (directory / CONFIG_FILE).write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.config.rank, "lora_alpha": self.config.alpha,
            "lora_dropout": self.config.dropout, "target_modules": [t.value for t in self.config.targets],
            "bias": "none", "fan_in_fan_out": False, "edgerun": {**self.config.to_dict(),
                                                                   "base_sha256": self.base_sha256}}, indent=1))


def load_adapter(path: str | Path) -> Adapter:
    """An adapter directory (or its safetensors file); every problem is one EdgerunError line."""
    p = Path(path).expanduser()
    directory = p if p.is_dir() else p.parent
    file = p / ADAPTER_FILE if p.is_dir() else p
    if not file.is_file():
        raise EdgerunError(f"no adapter at {p} (expected a directory holding {ADAPTER_FILE})")
    try:
        tensors, metadata = read_safetensors_with_metadata(file)
        meta = json.loads((directory / CONFIG_FILE).read_text())
        config = LoraConfig.from_dict(meta["edgerun"])
        matrices: dict[tuple[int, Target], list[np.ndarray | None]] = {}
        for name, t in tensors.items():
            layer, target, part = parse_tensor_name(name)
            matrices.setdefault((layer, target), [None, None])[part == "B"] = np.array(t.dequantize(), np.float32)
        if any(a is None or b is None for a, b in matrices.values()):
            raise ValueError("a LoRA matrix lacks its pair")
        base = metadata.get(BASE_KEY)
        if not base:
            raise ValueError(f"no {BASE_KEY} in its metadata")
    except EdgerunError:
        raise
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise EdgerunError(f"cannot read adapter {p}: {e}") from e
    return Adapter(config, base, {k: (a, b) for k, (a, b) in matrices.items()})


def apply_adapter(model: Model, path: str | Path) -> Model:
    """`model` with the adapter at `path` on its layers (LayerWeights.lora), every engine built from it then
    adds the adapter's products; EdgerunError when the adapter was made for another model."""
    from edgerun.net.model_files import file_sha256, model_sha256

    adapter = load_adapter(path)
    adapter.check_model(model.config, model_sha256(model.path), str(path))
    p = Path(path).expanduser()
    file = p / ADAPTER_FILE if p.is_dir() else p
    layers = list(model.weights.layers)
    for i, layer in enumerate(layers):
        pairs = adapter.for_layer(i)
        if pairs:
            scaled = tuple((t.field, a, (b * np.float32(adapter.config.scale)).astype(np.float32))
                           for t, (a, b) in sorted(pairs.items(), key=lambda kv: list(Target).index(kv[0])))
            layers[i] = replace(layer, lora=scaled)
    weights = replace(model.weights, layers=tuple(layers), adapter_sha256=file_sha256(file))
    return replace(model, weights=weights)
