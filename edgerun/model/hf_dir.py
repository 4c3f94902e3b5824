"""Hugging Face model directories: config.json, *.safetensors and tokenizer.json.

The safetensors format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes; it is read here by memory-mapping.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from edgerun.model.config import ModelConfig
from edgerun.model.quant import QuantTensor
from edgerun.model.weights import LayerWeights, ModelWeights

# safetensors dtype -> GGML type name holding the same bytes.
SAFETENSORS_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}
ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2}

# LayerWeights field -> tensor name within "model.layers.N.".
LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


# Architectures read from a Hugging Face directory (config.json and safetensors).
HF_ARCHITECTURES = ("llama", "qwen2")

def read_safetensors(path: Path) -> dict[str, QuantTensor]:
    return read_safetensors_with_metadata(path)[0]


def read_safetensors_with_metadata(path: Path) -> tuple[dict[str, QuantTensor], dict[str, str]]:
    """The tensors of a safetensors file, and the string map its header keeps under "__metadata__"."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file (header length {header_len})")
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in SAFETENSORS_TYPES:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        begin, end = info["data_offsets"]
        if end > data.size:
            raise ValueError(f"{path.name} is truncated: tensor {name} ends past the end of the file")
        shape = tuple(info["shape"])
        raw = data[begin:end].reshape(*shape[:-1], shape[-1] * ITEM_SIZE[dtype])
        tensors[name] = QuantTensor(SAFETENSORS_TYPES[dtype], shape, raw)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path.name}: __metadata__ is not a map")
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def write_safetensors(path: Path, tensors: dict[str, QuantTensor], metadata: dict[str, str] | None = None) -> None:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.qtype not in SAFETENSORS_TYPES:
            raise ValueError(f"safetensors holds only F32, F16 or BF16, not {t.qtype} ({name})")
        header[name] = {"dtype": t.qtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # keeps the tensor data 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t.raw).tobytes())


def read_config(directory: Path) -> ModelConfig:
    cfg = json.loads((directory / "config.json").read_text())
    arch = cfg.get("model_type", "")
    if arch not in HF_ARCHITECTURES:  # the others' blocks are read from their GGUF files' metadata only
        raise ValueError(f"a Hugging Face directory of {arch!r} is not supported (supported: "
                         f"{', '.join(HF_ARCHITECTURES)}); convert it to GGUF with llama.cpp's converter")
    n_heads = cfg["num_attention_heads"]
    if cfg.get("rope_scaling"):
        raise ValueError(f"RoPE scaling {cfg['rope_scaling']} is not supported")
    return ModelConfig(
        architecture=arch,
        n_layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        ffn=cfg["intermediate_size"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        vocab_size=cfg["vocab_size"],
        rope_base=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        context_length=cfg.get("max_position_embeddings", 4096),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
    )


def read_weights(directory: Path, config: ModelConfig) -> ModelWeights:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors file")
    tensors: dict[str, QuantTensor] = {}
    for f in files:
        tensors.update(read_safetensors(f))

    def get(name: str) -> QuantTensor:
        if name not in tensors:
            raise ValueError(f"{directory.name} lacks tensor {name}")
        return tensors[name]

    layers = []
    for i in range(config.n_layers):
        fields: dict[str, object] = {}
        for field, suffix in LAYER_TENSORS.items():
            name = f"model.layers.{i}.{suffix}"
            if field.startswith("b"):
                fields[field] = get(name).dequantize() if config.qkv_bias else None
            elif field.endswith("norm"):
                fields[field] = get(name).dequantize()
            else:
                fields[field] = get(name)
        layers.append(LayerWeights(**fields))
    embd = get("model.embed_tokens.weight")
    return ModelWeights(
        token_embd=embd,
        layers=tuple(layers),
        output_norm=get("model.norm.weight").dequantize(),
        output=embd if config.tied_embeddings else get("lm_head.weight"),
    )


def write_hf_dir(directory: Path, config: ModelConfig, weights: ModelWeights) -> None:
    """Write config.json and model.safetensors (the caller writes the tokenizer files)."""
    if config.is_moe or config.architecture not in HF_ARCHITECTURES:
        raise ValueError(f"{config.architecture} models are written as GGUF only (--format gguf)")
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM" if config.architecture == "llama" else "Qwen2ForCausalLM"],
        "model_type": config.architecture,
        "num_hidden_layers": config.n_layers,
        "hidden_size": config.hidden,
        "intermediate_size": config.ffn,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rope_theta": config.rope_base,
        "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.context_length,
        "tie_word_embeddings": config.tied_embeddings,
        "attention_bias": config.qkv_bias,
        "hidden_act": "silu",
    }
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    def f32(v: np.ndarray) -> QuantTensor:
        v = np.ascontiguousarray(v, np.float32)
        return QuantTensor("F32", v.shape, v.view(np.uint8))

    tensors = {"model.embed_tokens.weight": weights.token_embd}
    for i, layer in enumerate(weights.layers):
        for field, suffix in LAYER_TENSORS.items():
            value = getattr(layer, field)
            if value is not None:
                tensors[f"model.layers.{i}.{suffix}"] = value if isinstance(value, QuantTensor) else f32(value)
    tensors["model.norm.weight"] = f32(weights.output_norm)
    if not config.tied_embeddings:
        tensors["lm_head.weight"] = weights.output
    write_safetensors(directory / "model.safetensors", tensors)
