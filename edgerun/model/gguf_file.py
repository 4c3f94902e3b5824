"""Reading and writing GGUF model files (through the `gguf` package)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from edgerun.model.config import SUPPORTED_ARCHITECTURES, Activation, ModelConfig
from edgerun.model.quant import QuantTensor, check_qtype
from edgerun.model.tokenizer import Vocabulary
from edgerun.model.weights import (
    ExpertWeights,
    LayerWeights,
    ModelWeights,
    MoeWeights,
    rope_rows_from_interleaved,
    rope_rows_to_interleaved,
)

# LayerWeights field -> GGUF tensor name within "blk.N.".
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "ffn_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
OPTIONAL_LAYER_TENSORS = ("bq", "bk", "bv")
DENSE_MLP_TENSORS = ("w_gate", "w_up", "w_down")
# Mixture-of-experts tensors within "blk.N.", as llama.cpp names them: the experts stacked in one 3-D tensor each.
ROUTER, EXPERTS = "ffn_gate_inp.weight", ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
SHARED_GATE = "ffn_gate_inp_shexp.weight"
QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
POST_NORMS = {"attn_post_norm": "post_attention_norm.weight", "ffn_post_norm": "post_ffw_norm.weight"}
# Phi-3's files: Q, K and V rows in one matrix, gate and up rows in ffn_up (gate first), split on load.
FUSED_QKV = "attn_qkv.weight"
ROPE_FREQS = "rope_freqs.weight"
# Gemma 3's windowed layers: five of every six unless the file says otherwise, 10000 their RoPE base.
GEMMA3_WINDOW_PATTERN = 6
# Whether each architecture's chosen expert weights are renormalized to sum to one (as llama.cpp computes them).
RENORMALIZED_GATES = {"llama": True, "qwen3moe": True, "qwen2moe": False}


def _field(reader: gguf.GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = str(_field(reader, "general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    tensor_names = {t.name for t in reader.tensors}
    for t in reader.tensors:  # before any shape: the type is what a newer file most often has that this lacks
        check_qtype(t.tensor_type.name)

    def meta(key: str, default: object = None) -> object:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ValueError(f"per-layer {arch}.{key} is not supported")
        return value

    n_experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if n_experts and "blk.0.ffn_gate_exps.weight" not in tensor_names:
        raise ValueError("experts stored one tensor per expert (older Mixtral files) are not supported: "
                         "convert the file with a current llama.cpp (experts stacked in ffn_*_exps)")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    if scaling not in ("none", "linear", None):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported (none or linear)")
    if "rope_factors_long.weight" in tensor_names:
        raise ValueError("Phi-3's long-context RoPE factors (128k files) are not supported: take a 4k file")
    n_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    rope_dims = int(_field(reader, f"{arch}.rope.dimension_count", head_dim) or head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"RoPE over {rope_dims} of a head's {head_dim} dimensions is not supported")
    gemma = arch == "gemma3"
    layers = int(meta("block_count"))
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0) if gemma else 0
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
    if isinstance(pattern, list):
        raise ValueError("a per-layer sliding-window pattern is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    return ModelConfig(
        architecture=arch,
        n_layers=layers,
        hidden=hidden,
        ffn=int(meta("feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        vocab_size=vocab,
        rope_base=float(meta("rope.freq_base", 10000.0)),
        norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(meta("context_length", 4096)),
        tied_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        n_experts=n_experts,
        n_experts_used=int(_field(reader, f"{arch}.expert_used_count", 0) or 0),
        expert_ffn=int(_field(reader, f"{arch}.expert_feed_forward_length", 0) or 0) if n_experts else 0,
        shared_expert_ffn=int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0)
        if f"blk.0.{SHARED[0]}" in tensor_names else 0,
        norm_gates=bool(_field(reader, f"{arch}.expert_weights_norm", RENORMALIZED_GATES.get(arch, True))),
        qk_norm=f"blk.0.{QK_NORMS[0]}" in tensor_names,
        activation=Activation.GELU_TANH if gemma else Activation.SILU,
        embed_scale=float(np.sqrt(np.float32(hidden))) if gemma else 1.0,
        post_norms=f"blk.0.{POST_NORMS['attn_post_norm']}" in tensor_names,
        sliding_window=window,
        window_pattern=int(pattern) if window else 0,
        rope_base_window=float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
        rope_scale=1.0 / factor if scaling == "linear" and factor else 1.0,
        # llama.cpp's rule (after Gemma's own): queries times 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 27B
        query_scale=(1.0 / float(np.sqrt(hidden / n_heads if layers == 62 else head_dim))) if gemma else 0.0,
    )


def _tensor(t: gguf.ReaderTensor) -> QuantTensor:
    qtype = t.tensor_type.name
    check_qtype(qtype)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    data = np.asarray(t.data)
    raw = data.reshape(-1).view(np.uint8).reshape(*shape[:-1], -1)
    return QuantTensor(qtype, shape, raw)


def _per_expert(t: QuantTensor, n_experts: int, name: str) -> list[QuantTensor]:
    """A stacked (experts, rows, cols) tensor as one matrix per expert, each a view of the file's bytes."""
    if len(t.shape) != 3 or t.shape[0] != n_experts:
        raise ValueError(f"{name}: expected {n_experts} stacked experts, found shape {t.shape}")
    return [QuantTensor(t.qtype, t.shape[1:], t.stored[e]) for e in range(n_experts)]


def read_weights(reader: gguf.GGUFReader, config: ModelConfig) -> ModelWeights:
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> QuantTensor:
        if name not in tensors:
            raise ValueError(f"GGUF file lacks tensor {name}")
        return _tensor(tensors[name])

    def vector(name: str) -> np.ndarray:
        return get(name).dequantize().reshape(-1)

    def fused(i: int) -> dict[str, QuantTensor]:
        """Phi-3's fused matrices as the separate ones: their rows, views of the file's bytes."""
        qkv, up = get(f"blk.{i}.{FUSED_QKV}"), get(f"blk.{i}.ffn_up.weight")
        q, kv, f = config.q_dim, config.kv_dim, config.ffn
        if qkv.rows != q + 2 * kv or up.rows != 2 * f:
            raise ValueError(f"blk.{i}: fused matrices of {qkv.rows} and {up.rows} rows, not {q + 2 * kv} and {2 * f}")
        return {"wq": qkv.take_rows(slice(0, q)), "wk": qkv.take_rows(slice(q, q + kv)),
                "wv": qkv.take_rows(slice(q + kv, q + 2 * kv)), "w_gate": up.take_rows(slice(0, f)),
                "w_up": up.take_rows(slice(f, 2 * f))}

    def moe(i: int) -> MoeWeights:
        gate, up, down = (_per_expert(get(f"blk.{i}.{n}"), config.n_experts, n) for n in EXPERTS)
        shared = None
        if config.shared_expert_ffn:
            shared = ExpertWeights(*(get(f"blk.{i}.{n}") for n in SHARED))
        return MoeWeights(router=get(f"blk.{i}.{ROUTER}"),
                          experts=tuple(ExpertWeights(*e) for e in zip(gate, up, down, strict=True)),
                          shared=shared, shared_gate=vector(f"blk.{i}.{SHARED_GATE}") if shared else None)

    # llama.cpp stores Llama's Q and K rows interleaved for its pairwise RoPE; Qwen2 keeps them as is.
    interleaved = config.architecture == "llama"
    q_rows = rope_rows_from_interleaved(config.n_heads, config.q_dim) if interleaved else None
    k_rows = rope_rows_from_interleaved(config.n_kv_heads, config.kv_dim) if interleaved else None
    layers = []
    for i in range(config.n_layers):
        fields: dict[str, object] = fused(i) if f"blk.{i}.{FUSED_QKV}" in tensors else {}
        for field, suffix in LAYER_TENSORS.items():
            name = f"blk.{i}.{suffix}"
            if field in fields:
                continue
            if field in OPTIONAL_LAYER_TENSORS:
                fields[field] = vector(name) if name in tensors else None
            elif config.is_moe and field in DENSE_MLP_TENSORS:
                fields[field] = None
            elif field.endswith("norm"):
                fields[field] = vector(name)
            else:
                fields[field] = get(name)
        if config.is_moe:
            fields["moe"] = moe(i)
        if config.qk_norm:
            fields["q_norm"], fields["k_norm"] = (vector(f"blk.{i}.{n}") for n in QK_NORMS)
        if config.post_norms:
            fields |= {field: vector(f"blk.{i}.{name}") for field, name in POST_NORMS.items()}
        if interleaved:
            fields["wq"] = fields["wq"].reorder_rows(q_rows)
            fields["wk"] = fields["wk"].reorder_rows(k_rows)
            if fields["bq"] is not None:
                fields["bq"] = fields["bq"][q_rows]
                fields["bk"] = fields["bk"][k_rows]
        layers.append(LayerWeights(**fields))
    embd = get("token_embd.weight")
    return ModelWeights(
        token_embd=embd,
        layers=tuple(layers),
        output_norm=vector("output_norm.weight"),
        output=embd if config.tied_embeddings else get("output.weight"),
        rope_freqs=vector(ROPE_FREQS) if ROPE_FREQS in tensors else None,
    )


def _add_matrix(writer: gguf.GGUFWriter, name: str, t: QuantTensor) -> None:
    if t.qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(t.raw).view(np.float32).reshape(t.shape))
    elif t.qtype == "F16":
        writer.add_tensor(name, np.ascontiguousarray(t.raw).view(np.float16).reshape(t.shape))
    else:
        writer.add_tensor(name, np.ascontiguousarray(t.raw), raw_dtype=gguf.GGMLQuantizationType[t.qtype])


def _stacked(tensors: list[QuantTensor]) -> QuantTensor:
    """Matrices of one type and shape as one (n, rows, cols) tensor, as llama.cpp stores experts."""
    first = tensors[0]
    return QuantTensor(first.qtype, (len(tensors), *first.shape), np.stack([np.asarray(t.raw) for t in tensors]))


def _joined(tensors: list[QuantTensor]) -> QuantTensor:
    """Matrices of one type and width as one, their rows one after another."""
    if len({t.qtype for t in tensors}) != 1:
        raise ValueError("fused matrices take one quant type")
    raw = np.concatenate([np.asarray(t.raw) for t in tensors])
    return QuantTensor(tensors[0].qtype, (raw.shape[0], tensors[0].shape[1]), raw)


def _add_moe(writer: gguf.GGUFWriter, i: int, moe: MoeWeights) -> None:
    _add_matrix(writer, f"blk.{i}.{ROUTER}", moe.router)
    for name, matrices in zip(EXPERTS, zip(*(e.matrices() for e in moe.experts), strict=True), strict=True):
        _add_matrix(writer, f"blk.{i}.{name}", _stacked(list(matrices)))
    if moe.shared is not None:
        for name, matrix in zip(SHARED, moe.shared.matrices(), strict=True):
            _add_matrix(writer, f"blk.{i}.{name}", matrix)
        writer.add_tensor(f"blk.{i}.{SHARED_GATE}", np.asarray(moe.shared_gate, np.float32))


def write_gguf(path: Path, config: ModelConfig, weights: ModelWeights, vocab: Vocabulary, name: str) -> None:
    arch = config.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.hidden)
    writer.add_feed_forward_length(config.ffn)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.rope_scale != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(1.0 / config.rope_scale)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", config.window_pattern)
        writer.add_float32(f"{arch}.rope.freq_base_swa", config.rope_base_window)
    if config.is_moe:
        writer.add_expert_count(config.n_experts)
        writer.add_expert_used_count(config.n_experts_used)
        writer.add_expert_feed_forward_length(config.expert_ffn)
        if config.shared_expert_ffn:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_ffn)
        if config.norm_gates != RENORMALIZED_GATES.get(arch, True):
            writer.add_expert_weights_norm(config.norm_gates)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)

    interleave = arch == "llama"
    q_rows = rope_rows_to_interleaved(config.n_heads, config.q_dim)
    k_rows = rope_rows_to_interleaved(config.n_kv_heads, config.kv_dim)
    _add_matrix(writer, "token_embd.weight", weights.token_embd)
    if weights.rope_freqs is not None:
        writer.add_tensor(ROPE_FREQS, np.asarray(weights.rope_freqs, np.float32))
    fuse = arch == "phi3"
    for i, layer in enumerate(weights.layers):
        if fuse:  # as Phi-3's converter writes them
            _add_matrix(writer, f"blk.{i}.{FUSED_QKV}", _joined([layer.wq, layer.wk, layer.wv]))
            _add_matrix(writer, f"blk.{i}.ffn_up.weight", _joined([layer.w_gate, layer.w_up]))
        for field, suffix in LAYER_TENSORS.items():
            value = getattr(layer, field)
            if value is None or (fuse and field in ("wq", "wk", "wv", "w_gate", "w_up")):
                continue
            if interleave and field in ("wq", "bq"):
                value = value.take_rows(q_rows) if field == "wq" else value[q_rows]
            if interleave and field in ("wk", "bk"):
                value = value.take_rows(k_rows) if field == "wk" else value[k_rows]
            if isinstance(value, QuantTensor):
                _add_matrix(writer, f"blk.{i}.{suffix}", value)
            else:
                writer.add_tensor(f"blk.{i}.{suffix}", np.asarray(value, np.float32))
        if layer.q_norm is not None:
            for suffix, norm in zip(QK_NORMS, (layer.q_norm, layer.k_norm), strict=True):
                writer.add_tensor(f"blk.{i}.{suffix}", np.asarray(norm, np.float32))
        for field, suffix in POST_NORMS.items():
            if getattr(layer, field) is not None:
                writer.add_tensor(f"blk.{i}.{suffix}", np.asarray(getattr(layer, field), np.float32))
        if layer.moe is not None:
            _add_moe(writer, i, layer.moe)
    writer.add_tensor("output_norm.weight", np.asarray(weights.output_norm, np.float32))
    if not config.tied_embeddings:
        _add_matrix(writer, "output.weight", weights.output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
