"""Building ONNX graphs of a model, or of a contiguous range of its layers (a pipeline stage).

A graph takes the embedded hidden state (or, for a first stage with `embed`, the token ids) and
per-layer KV buffers, and returns either the next hidden state or, for the last stage, the logits
of the last position. Attention is onnxruntime's
GroupQueryAttention with RoPE inside it; the KV buffers are preallocated to the context length and
bound as both the past and the present tensor, so a step writes only its new rows.
Quantized matrices become MatMulNBits (4-bit or 8-bit codes with per-block scales), holding exactly
the values the file holds; other types become float32 MatMul.

Initializers are written straight to an external data file as the graph is built, so models
larger than protobuf's 2 GB limit build without holding a second copy in memory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgerun.cache import cache_root
from edgerun.errors import EdgerunError
from edgerun.model.config import Activation, ModelConfig, kv_names
from edgerun.model.kernel_stage import build_kernel_stage
from edgerun.model.quant import AffineBlocks, QuantTensor, concat_affine, slice_affine, to_affine_blocks
from edgerun.model.reference import rope_tables
from edgerun.model.weights import (
    EMBED_SCALE,
    GELU_GATE,
    POST_NORMS,
    QK_NORM,
    ROPE_FACTORS,
    ROPE_SCALING,
    SLIDING_WINDOW,
    ExpertWeights,
    LayerWeights,
    ModelWeights,
    MoeWeights,
    lacking,
)

# What a stage's graph computes beyond the Llama/Qwen2 block: Qwen3's query/key norms, Llama 3's RoPE factors (in
# its cos/sin tables), Gemma 3's GeGLU (FastGelu, the tanh approximation), scaled embedding and queries (the
# attention's own scale), post norms, windowed layers (the attention's local window) on their own RoPE base and
# linear RoPE scaling (each layer's cos/sin tables). A tensor-parallel share's graphs have none of them
# (tp.ggml_shard.build_share refuses them).
ONNX_FEATURES = frozenset({QK_NORM, ROPE_FACTORS, GELU_GATE, EMBED_SCALE, POST_NORMS, SLIDING_WINDOW, ROPE_SCALING})

# Bump when the graph layout changes, so cached graphs are rebuilt.
# 3: large tensors page-aligned (mapped, not copied, by onnxruntime); 4: a mid-model stage normalizes its input
# as the whole graph does; 5: Gemma 3's blocks
GRAPH_VERSION = 5
OPSET = 17
IR_VERSION = 10
WEIGHTS_FILE = "weights.bin"
PAGE = 4096  # onnxruntime maps external tensors whose offsets are multiples of this
HEAD_CHUNK_ROWS = 8192  # LM-head rows per product when a share's head is built: bounds what building holds at once


class Activations(Enum):
    """How quantized matrix products (MatMulNBits) take their activations.

    INT8 quantizes each 32-element block of the activation to int8 with its own scale and runs integer dot products,
    as llama.cpp does for its quantized types (Q8 activations): 3-4x faster on CPUs than float32, and within the
    model's own quantization noise of it, though greedy tokens may part from the float reference's after a few
    near-ties. F32 multiplies float32 activations: what the numpy reference computes, to rounding."""

    INT8 = "int8"
    F32 = "f32"

    @property
    def accuracy_level(self) -> int:
        """MatMulNBits' attribute: 4 computes with int8 activations, 0 in float32."""
        return 4 if self is Activations.INT8 else 0


@dataclass(frozen=True)
class StageSpec:
    first_layer: int
    end_layer: int  # exclusive
    lm_head: bool  # the stage ends with the final norm and the LM head
    accuracy_level: int = 0  # MatMulNBits: 0 computes in float32, 4 quantizes activations to int8
    embed: bool = False  # the stage starts from token ids (input_ids) with the embedding inside
    # Matrices stored dequantized (float32) and multiplied by MatMul: for onnxruntime-web's WebAssembly, whose
    # MatMulNBits has no kernel of its own there and dequantizes every matrix on every call (20-30x slower than
    # its float32 MatMul). Several times the bytes; the same numbers as float32 activations to rounding.
    dequantized: bool = False
    # Not an ONNX graph: stage.bin for the browser node's own WebAssembly kernels (kernel_stage), matrices as
    # quantized as the file holds them, int8 activations (accuracy_level 4) as the native kernels compute.
    kernels: bool = False

    @classmethod
    def for_layers(cls, config: ModelConfig, first_layer: int, end_layer: int, activations: Activations,
                   dequantized: bool = False) -> StageSpec:
        """The pipeline stage of layers [first_layer, end_layer): the first holds the embedding (it takes token
        ids), the last the final norm and the LM head."""
        return cls(first_layer, end_layer, lm_head=end_layer == config.n_layers,
                   accuracy_level=activations.accuracy_level, embed=first_layer == 0, dequantized=dequantized)

    def check(self, config: ModelConfig) -> None:
        if not 0 <= self.first_layer < self.end_layer <= config.n_layers:
            raise ValueError(f"layer range [{self.first_layer}, {self.end_layer}) outside 0..{config.n_layers}")
        if self.embed and self.first_layer != 0:
            raise ValueError("only the stage holding layer 0 can hold the embedding")
        if self.lm_head and self.end_layer != config.n_layers:
            raise ValueError("only the stage holding the last layer can hold the LM head")


class _GraphWriter:
    """Collects nodes and writes initializers to the external data file."""

    def __init__(self, data_path: Path) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.data = data_path.open("wb")
        self.data_name = data_path.name
        self.weight_bytes = 0
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def constant(self, stem: str, array: np.ndarray, weight: bool = False) -> str:
        array = np.ascontiguousarray(array)
        name = self.name(stem)
        tensor = TensorProto(name=name, dims=list(array.shape),
                             data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        if array.nbytes < 1024:
            tensor.raw_data = array.tobytes()
        else:
            # onnxruntime maps a tensor whose offset is a multiple of the page size and reads any other into its
            # heap, where the copy stays beside the kernel's prepacked one: large tensors start on a page.
            self.data.write(b"\0" * (-self.data.tell() % (PAGE if array.nbytes >= 16 * PAGE else 64)))
            offset = self.data.tell()
            self.data.write(array.tobytes())
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.data_name), ("offset", str(offset)), ("length", str(array.nbytes))):
                tensor.external_data.add(key=key, value=value)
        if weight:
            self.weight_bytes += array.nbytes
        self.initializers.append(tensor)
        return name

    def node(self, op: str, inputs: list[str], n_outputs: int = 1, domain: str = "", **attrs: object) -> list[str]:
        outputs = [self.name(op.lower()) for _ in range(n_outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=self.name(op), domain=domain, **attrs))
        return outputs

    def gated(self, flag: str, build: Callable[[], str], zeros_shape: str, width: int) -> str:
        """build()'s output where the boolean `flag` holds, zeros of `zeros_shape` where it does not: an If node
        whose branch holds the weights it uses (onnxruntime prepacks them as any other), so a unit left out
        costs a few microseconds and no weight bytes."""
        outer_nodes, outer_initializers = self.nodes, self.initializers
        self.nodes, self.initializers = [], []
        try:
            (y,) = self.node("Identity", [build()])
            then = helper.make_graph(self.nodes, self.name("then"), [],
                                     [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, "seq", width])],
                                     self.initializers)
            self.nodes, self.initializers = [], []
            (z,) = self.node("ConstantOfShape", [zeros_shape],
                             value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
            otherwise = helper.make_graph(self.nodes, self.name("else"), [],
                                          [helper.make_tensor_value_info(z, TensorProto.FLOAT, [1, "seq", width])])
        finally:
            self.nodes, self.initializers = outer_nodes, outer_initializers
        (out,) = self.node("If", [flag], then_branch=then, else_branch=otherwise)
        return out

    def shape_with_width(self, x: str, width: int) -> str:
        """The shape (1, seq, width) for x of shape (1, seq, any)."""
        (shape,) = self.node("Shape", [x], start=0, end=2)
        (out,) = self.node("Concat", [shape, self.constant("width", np.array([width], np.int64))], axis=0)
        return out

    def flag(self, flags: str, index: int) -> str:
        (out,) = self.node("Gather", [flags, self.constant("index", np.array(index, np.int64))], axis=0)
        return out

    def linear(self, x: str, tensors: list[QuantTensor], accuracy_level: int) -> list[str]:
        """x @ W.T for each W; matrices sharing one block format run as one fused product."""
        return self.linear_forms(x, [to_affine_blocks(t) or t.dequantize() for t in tensors], accuracy_level)

    def linear_forms(self, x: str, forms: list[AffineBlocks | np.ndarray], accuracy_level: int) -> list[str]:
        """x @ W.T for each W, given in affine-block form (a quantized kernel) or as float32 (rows, cols)."""
        if len(forms) > 1 and _fusable(forms):
            (y,) = self._affine_product(x, concat_affine(forms, axis=0), accuracy_level)
            sizes = self.constant("split", np.array([f.codes.shape[0] for f in forms], np.int64))
            return self.node("Split", [y, sizes], n_outputs=len(forms), axis=-1)
        outputs = []
        for form in forms:
            if isinstance(form, AffineBlocks):
                outputs += self._affine_product(x, form, accuracy_level)
            else:
                outputs += self.node("MatMul", [x, self.constant("weight", form.T, weight=True)])
        return outputs

    def low_rank_add(self, x: str, y: str, a: np.ndarray, b: np.ndarray) -> str:
        """y + (x @ A.T) @ B.T: a LoRA adapter's share, in float32 beside the quantized product."""
        (down,) = self.node("MatMul", [x, self.constant("lora_a", np.ascontiguousarray(a.T, np.float32), weight=True)])
        (up,) = self.node("MatMul", [down, self.constant("lora_b", np.ascontiguousarray(b.T, np.float32),
                                                         weight=True)])
        (out,) = self.node("Add", [y, up])
        return out

    def _affine_product(self, x: str, form: AffineBlocks, accuracy_level: int) -> list[str]:
        n, k = form.codes.shape
        if form.bits == 4 or accuracy_level == 4:
            (y,) = self._matmul_nbits(x, form.bits, form.block, form.codes, form.scales, None, accuracy_level)
        else:
            # onnxruntime's float32 kernels take 4-bit codes only: split each 8-bit code into its high
            # and low nibble, s*(c - 128) = 16s*(hi - 8) + s*(lo - 0), one product over both halves.
            codes = np.concatenate([form.codes >> 4, form.codes & 15])
            scales = np.concatenate([16 * form.scales, form.scales])
            zero_points = np.concatenate([np.full(form.scales.shape, 8, np.uint8),
                                          np.zeros(form.scales.shape, np.uint8)])
            (both,) = self._matmul_nbits(x, 4, form.block, codes, scales, zero_points, accuracy_level)
            halves = self.constant("split", np.array([n, n], np.int64))
            (y,) = self.node("Add", self.node("Split", [both, halves], n_outputs=2, axis=-1))
        if form.offsets is None:
            return [y]
        # The offsets' share: each block's sum of x times that block's offset.
        shape = self.constant("shape", np.array([0, 0, k // form.block, form.block], np.int64))
        (blocks,) = self.node("Reshape", [x, shape])
        (sums,) = self.node("ReduceSum", [blocks, self.constant("axes", np.array([-1], np.int64))], keepdims=0)
        (offset,) = self.node("MatMul", [sums, self.constant("offsets", form.offsets.T, weight=True)])
        return self.node("Add", [y, offset])

    def _matmul_nbits(self, x: str, bits: int, block: int, codes: np.ndarray, scales: np.ndarray,
                      zero_points: np.ndarray | None, accuracy_level: int) -> list[str]:
        n, k = codes.shape
        nblocks = k // block
        codes = codes.reshape(n, nblocks, block)
        if bits == 4:
            codes = _pack_nibbles(codes)
        inputs = [x, self.constant("codes", codes, weight=True),
                  self.constant("scales", scales.reshape(-1), weight=True)]
        if zero_points is not None:
            inputs.append(self.constant("zero_points", _pack_nibbles(zero_points).reshape(-1), weight=True))
        return self.node("MatMulNBits", inputs, domain="com.microsoft", K=k, N=n, bits=bits,
                         block_size=block, accuracy_level=accuracy_level)


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Two 4-bit values per byte along the last axis, element 2i in the low nibble (padded to even)."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), values.dtype)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def _fusable(forms: list[AffineBlocks | np.ndarray]) -> bool:
    first = forms[0]
    return isinstance(first, AffineBlocks) and all(
        isinstance(f, AffineBlocks) and f.bits == first.bits and f.block == first.block for f in forms)


def build_stage(config: ModelConfig, weights: ModelWeights, spec: StageSpec, out_dir: Path) -> dict[str, object]:
    """Write model.onnx and its weights into out_dir; return the stage's metadata."""
    spec.check(config)
    reason = lacking(config, weights, "the onnx engine", ONNX_FEATURES)
    if reason is not None:
        raise EdgerunError(f"{reason}: the ggml engine does (--engine ggml, int8 activations)")
    out_dir.mkdir(parents=True, exist_ok=True)
    g = _GraphWriter(out_dir / WEIGHTS_FILE)
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"]) if spec.embed else
        helper.make_tensor_value_info("hidden", f32, [1, "seq", config.hidden]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_seq_len", TensorProto.INT32, []),
    ]
    outputs = []
    rotations: dict[tuple[float, float], tuple[str, str]] = {}  # (base, position scale) -> its cos/sin tables

    def rotation(i: int) -> tuple[str, str]:
        key = config.rotation_of(i)
        if key not in rotations:
            cos, sin = rope_tables(config.head_dim, key[0], np.arange(config.context_length) * key[1],
                                   weights.rope_freqs)
            rotations[key] = (g.constant("rope_cos", cos), g.constant("rope_sin", sin))
        return rotations[key]

    kv_shape = [1, config.n_kv_heads, "max_len", config.head_dim]
    eps = config.norm_eps

    # LoRA pairs by the matrix they add to: every product below picks up its adapter through `linear`.
    lora = {id(getattr(layer, name)): (a, b) for layer in weights.layers for name, a, b in layer.lora}

    def linear(x: str, tensors: list[QuantTensor]) -> list[str]:
        if spec.dequantized:
            outs = g.linear_forms(x, [t.dequantize() for t in tensors], spec.accuracy_level)
        else:
            outs = g.linear(x, tensors, spec.accuracy_level)
        return [y if id(t) not in lora else g.low_rank_add(x, y, *lora[id(t)]) for t, y in zip(tensors, outs,
                                                                                               strict=True)]

    residual = "hidden"
    if spec.embed:  # float32 rows, exactly the reference's dequantized embedding
        table = g.constant("token_embd", weights.token_embd.dequantize(), weight=True)
        (residual,) = g.node("Gather", [table, "input_ids"], axis=0)
        if config.embed_scale != 1.0:  # Gemma: sqrt(hidden), in float32 as the reference
            (residual,) = g.node("Mul", [residual, g.constant("embed_scale", np.array(config.embed_scale,
                                                                                      np.float32))])
    pending = None  # layer 0 normalizes the embedding alone
    if spec.first_layer > 0:
        # A stage that starts mid-model normalizes its input with the kernel the whole model's graph uses there
        # (the one that first adds the last block's output), over zeros + hidden = hidden: another RMS kernel
        # rounds differently in the last bit, which int8 activations turn into other tokens at near-ties, and a
        # pipeline must compute exactly what one process computes.
        (shape,) = g.node("Shape", [residual])
        (pending,) = g.node("ConstantOfShape", [shape], value=helper.make_tensor("zero", f32, [1], [0.0]))
    for i in range(spec.first_layer, spec.end_layer):
        layer = weights.layers[i]
        past_k, past_v, present_k, present_v = kv_names(i)
        inputs += [helper.make_tensor_value_info(n, f32, kv_shape) for n in (past_k, past_v)]
        outputs += [helper.make_tensor_value_info(n, f32, kv_shape) for n in (present_k, present_v)]

        xn, residual = _norm(g, residual, pending, layer.attn_norm, eps)
        q, k, v = linear(xn, [layer.wq, layer.wk, layer.wv])
        if layer.bq is not None:
            q, k, v = (g.node("Add", [t, g.constant("bias", b)])[0] for t, b in
                       ((q, layer.bq), (k, layer.bk), (v, layer.bv)))
        if layer.q_norm is not None:  # Qwen3: each head's query and key RMS-normalized before RoPE
            q, k = (_head_norm(g, t, norm, heads, config) for t, norm, heads in
                    ((q, layer.q_norm, config.n_heads), (k, layer.k_norm, config.n_kv_heads)))
        # Gemma: the scores scaled by its query scale instead of 1/sqrt(head_dim); its windowed layers see their
        # own position and the window - 1 before it (onnxruntime's local window is that many positions in all).
        window = {"local_window_size": config.window(i)} if config.window(i) else {}
        scale = {"scale": config.query_scale} if config.query_scale else {}
        g.nodes.append(helper.make_node(
            "GroupQueryAttention", [q, k, v, past_k, past_v, "seqlens_k", "total_seq_len", *rotation(i)],
            [f"attn_{i}", present_k, present_v], name=f"attention_{i}", domain="com.microsoft",
            num_heads=config.n_heads, kv_num_heads=config.n_kv_heads, do_rotary=1, rotary_interleaved=0,
            **window, **scale))
        (pending,) = linear(f"attn_{i}", [layer.wo])
        pending = _post_norm(g, pending, layer.attn_post_norm, eps)

        xn, residual = _norm(g, residual, pending, layer.ffn_norm, eps)
        if layer.moe is None:
            pending = _gated_mlp(g, xn, layer.w_gate, layer.w_up, layer.w_down, linear, config.activation)
        else:
            pending = _experts(g, xn, layer.moe, config, linear)
        pending = _post_norm(g, pending, layer.ffn_post_norm, eps)

    if spec.lm_head:
        # Only the last position's logits are needed: slice before the final norm and the head.
        last = [g.constant("start", np.array([-1], np.int64)), g.constant("end", np.array([2**62], np.int64)),
                g.constant("axis", np.array([1], np.int64))]
        (r_last,) = g.node("Slice", [residual, *last])
        (p_last,) = g.node("Slice", [pending, *last])
        xn, _ = _norm(g, r_last, p_last, weights.output_norm, eps)
        (logits,) = linear(xn, [weights.output])
        g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
        outputs.insert(0, helper.make_tensor_value_info("logits", f32, [1, 1, config.vocab_size]))
    else:
        g.nodes.append(helper.make_node("Add", [residual, pending], ["hidden_out"], name="hidden_out"))
        outputs.insert(0, helper.make_tensor_value_info("hidden_out", f32, [1, "seq", config.hidden]))

    g.data.close()
    graph = helper.make_graph(g.nodes, "edgerun_stage", inputs, outputs, g.initializers)
    model = helper.make_model(graph, ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])
    onnx.save_model(model, str(out_dir / "model.onnx"))
    meta = {"spec": asdict(spec), "config": config.to_dict(), "weight_bytes": g.weight_bytes,
            "graph_version": GRAPH_VERSION}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


Linear = Callable[[str, list[QuantTensor]], list[str]]


def _gated_mlp(g: _GraphWriter, x: str, w_gate: QuantTensor, w_up: QuantTensor, w_down: QuantTensor,
               linear: Linear, activation: Activation = Activation.SILU) -> str:
    """down(act(gate x) * up x): SwiGLU, or Gemma's GeGLU (onnxruntime's FastGelu is GELU's tanh approximation)."""
    gate, up = linear(x, [w_gate, w_up])
    if activation == Activation.GELU_TANH:
        (acted,) = g.node("FastGelu", [gate], domain="com.microsoft")
    else:
        (acted,) = g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])
    (act,) = g.node("Mul", [acted, up])
    return linear(act, [w_down])[0]


def _post_norm(g: _GraphWriter, x: str, weight: np.ndarray | None, eps: float) -> str:
    """Gemma's norm of a block's output before it joins the residual (x itself where the layer has none)."""
    if weight is None:
        return x
    return g.node("SimplifiedLayerNormalization", [x, g.constant("norm", np.asarray(weight, np.float32))], axis=-1,
                  epsilon=eps)[0]


def _head_norm(g: _GraphWriter, x: str, weight: np.ndarray, heads: int, config: ModelConfig) -> str:
    """RMS norm over each head's slice of x (1, seq, heads * head_dim)."""
    split = g.constant("shape", np.array([0, 0, heads, config.head_dim], np.int64))
    (per_head,) = g.node("Reshape", [x, split])
    (y,) = g.node("SimplifiedLayerNormalization", [per_head, g.constant("norm", np.asarray(weight, np.float32))],
                  axis=-1, epsilon=config.norm_eps)
    (out,) = g.node("Reshape", [y, g.constant("shape", np.array([0, 0, heads * config.head_dim], np.int64))])
    return out


def _experts(g: _GraphWriter, x: str, moe: MoeWeights, config: ModelConfig, linear: Linear) -> str:
    """A mixture of experts on x (1, seq, hidden), as the reference routes it: softmax over the router's logits,
    the top k kept (renormalized where the model says so) and scattered into a (1, seq, experts) gate table.
    Each expert runs inside an If on whether any token chose it, so a one-token step computes only its k experts
    (a prefill computes the union of its tokens' choices, each token weighted by its own gate, zero where it did
    not choose the expert)."""
    (logits,) = linear(x, [moe.router])
    (probs,) = g.node("Softmax", [logits], axis=-1)
    values, indices = g.node("TopK", [probs, g.constant("k", np.array([config.n_experts_used], np.int64))],
                             n_outputs=2, axis=-1, largest=1, sorted=1)
    if config.norm_gates:
        (total,) = g.node("ReduceSum", [values, g.constant("axes", np.array([-1], np.int64))], keepdims=1)
        (values,) = g.node("Div", [values, total])
    (shape,) = g.node("Shape", [probs])
    (zeros,) = g.node("ConstantOfShape", [shape], value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    (gates,) = g.node("ScatterElements", [zeros, indices, values], axis=-1)
    out_shape = g.shape_with_width(x, config.hidden)
    zero = g.constant("zero", np.array(0.0, np.float32))
    outputs = []
    for e, expert in enumerate(moe.experts):
        (column,) = g.node("Gather", [gates, g.constant("index", np.array([e], np.int64))], axis=-1)  # (1, seq, 1)
        (chosen,) = g.node("Greater", [g.node("ReduceMax", [column], keepdims=0)[0], zero])

        def weighted(expert: ExpertWeights = expert, column: str = column) -> str:
            return g.node("Mul", [_gated_mlp(g, x, *expert.matrices(), linear), column])[0]

        outputs.append(g.gated(chosen, weighted, out_shape, config.hidden))
    if moe.shared is not None:
        (score,) = g.node("MatMul", [x, g.constant("shared_gate", moe.shared_gate.reshape(-1, 1), weight=True)])
        (scale,) = g.node("Sigmoid", [score])
        outputs += g.node("Mul", [_gated_mlp(g, x, *moe.shared.matrices(), linear), scale])
    return g.node("Sum", outputs)[0]


def _norm(g: _GraphWriter, residual: str, pending: str | None, weight: np.ndarray, eps: float) -> tuple[str, str]:
    """RMS-normalize residual + pending; return (normalized, new residual)."""
    w = g.constant("norm", np.asarray(weight, np.float32))
    if pending is None:
        (y,) = g.node("SimplifiedLayerNormalization", [residual, w], axis=-1, epsilon=eps)
        return y, residual
    y, _, _, total = g.node("SkipSimplifiedLayerNormalization", [pending, residual, w], n_outputs=4,
                            domain="com.microsoft", epsilon=eps)
    return y, total


def cached_stage(model_path: Path, config: ModelConfig, weights: ModelWeights, spec: StageSpec) -> Path:
    """The directory of a built stage graph, building it once per model file and spec."""
    if not spec.kernels:  # a graph of onnxruntime's attention, which a graph built before this check may hold
        check_head_dim(config)
    st = model_path.stat()
    ident = json.dumps([str(model_path.resolve()), st.st_size, st.st_mtime_ns, asdict(spec), GRAPH_VERSION,
                        weights.adapter_sha256])
    out = cache_root() / "onnx" / hashlib.sha256(ident.encode()).hexdigest()[:24]
    if (out / "meta.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".build-"))
    try:
        if spec.kernels:
            spec.check(config)
            size = build_kernel_stage(config, weights, spec.first_layer, spec.end_layer, spec.embed, spec.lm_head, tmp)
            (tmp / "meta.json").write_text(json.dumps({"spec": asdict(spec), "weight_bytes": size}) + "\n")
        else:
            build_stage(config, weights, spec, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process built it first
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------------
# Tensor-parallel shard blocks: one small graph per block a device holds units of. Each is written to a graph file
# with its weights in a file beside it, which onnxruntime memory-maps: the prepacked weights it runs are then the
# only copy on the heap (a graph given as bytes keeps a second copy of every initializer).
# Weights are the units' rows (wq/wk/wv, gate/up, LM-head rows) and columns (wo, w_down) cut from the
# quantized file blocks (quant.slice_affine), so a shard runs the same 4-bit and 8-bit kernels as the
# whole-model engine and holds only its share's quantized bytes.

def _save(g: _GraphWriter, inputs: list, outputs: list, name: str, out: Path) -> int:
    """Write the graph to `out` (its weights are in the writer's data file beside it); return the weight bytes."""
    g.data.close()
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    model = helper.make_model(graph, ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])
    onnx.save_model(model, str(out))
    return g.weight_bytes


def shard_weights_path(out: Path) -> Path:
    """The weights file beside a shard block's graph file."""
    return out.with_suffix(".bin")


def _attention_io(config: ModelConfig, kv_heads: int, max_len: int, flags: bool) -> tuple[list, list]:
    """Inputs and outputs of a share's attention graph over `kv_heads` KV heads (with `flags`, one bool per head)."""
    f32 = TensorProto.FLOAT
    kv_shape = [1, kv_heads, max_len, config.head_dim]
    inputs = [helper.make_tensor_value_info("hidden", f32, [1, "seq", config.hidden])]
    if flags:
        inputs.append(helper.make_tensor_value_info("flags", TensorProto.BOOL, [kv_heads]))
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total_seq_len", TensorProto.INT32, []),
               helper.make_tensor_value_info("past_key", f32, kv_shape),
               helper.make_tensor_value_info("past_value", f32, kv_shape)]
    outputs = [helper.make_tensor_value_info("partial", f32, [1, "seq", config.hidden]),
               helper.make_tensor_value_info("present_key", f32, kv_shape),
               helper.make_tensor_value_info("present_value", f32, kv_shape)]
    return inputs, outputs


ATTENTION_HEAD_MULTIPLE = 16  # onnxruntime's GroupQueryAttention on CPU takes heads of a multiple of 16 values


def check_head_dim(config: ModelConfig) -> None:
    """An EdgerunError, before anything is built, for a model whose heads onnxruntime's attention cannot run
    (it would fail at the first step, deep inside a session)."""
    if config.head_dim % ATTENTION_HEAD_MULTIPLE:
        raise EdgerunError(f"this model's attention heads have {config.head_dim} values; onnxruntime's attention "
                           f"takes a multiple of {ATTENTION_HEAD_MULTIPLE} (the numpy engine runs any: "
                           "edgerun generate --engine numpy)")


def _grouped_attention(g: _GraphWriter, config: ModelConfig, q: str, k: str, v: str, kv_heads: int,
                       max_len: int) -> None:
    """Rotary attention of `kv_heads` KV heads and their query heads, appending k and v to the bound cache in
    place: "heads" (1, seq, kv_heads * heads_per_kv * head_dim) and the presents."""
    check_head_dim(config)
    cos, sin = rope_tables(config.head_dim, config.rope_base, np.arange(max_len))
    g.nodes.append(helper.make_node(
        "GroupQueryAttention", [q, k, v, "past_key", "past_value", "seqlens_k", "total_seq_len",
                                g.constant("rope_cos", cos), g.constant("rope_sin", sin)],
        ["heads", "present_key", "present_value"], name="attention", domain="com.microsoft",
        num_heads=kv_heads * config.heads_per_kv, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0))


def _mlp_partial(g: _GraphWriter, layer: LayerWeights, ranges: Sequence[tuple[int, int]], accuracy_level: int) -> str:
    """The MLP's partial output of some intermediate row ranges: rows of gate and up, columns of down."""
    rows = np.concatenate([np.arange(a, b) for a, b in ranges])
    gate, up = g.linear_forms("hidden", [slice_affine(layer.w_gate, rows), slice_affine(layer.w_up, rows)],
                              accuracy_level)
    (sig,) = g.node("Sigmoid", [gate])
    (act,) = g.node("Mul", [g.node("Mul", [gate, sig])[0], up])
    return g.linear_forms(act, [slice_affine(layer.w_down, col_ranges=list(ranges))], accuracy_level)[0]


def shard_attention_graph(config: ModelConfig, layer: LayerWeights, units: Sequence[int], max_len: int, out: Path,
                          accuracy_level: int = 0) -> int:
    """The partial attention output of some KV heads (each with its query heads and its columns of wo):
    inputs hidden (1, seq, hidden) normalized, seqlens_k, total_seq_len and the units' KV buffers
    past_key/past_value (1, units, max_len, head_dim); outputs partial (1, seq, hidden) and the presents."""
    c = config
    q_width = c.heads_per_kv * c.head_dim
    q_ranges = [(u * q_width, (u + 1) * q_width) for u in units]
    kv_ranges = [(u * c.head_dim, (u + 1) * c.head_dim) for u in units]
    q_rows = np.concatenate([np.arange(a, b) for a, b in q_ranges])
    kv_rows = np.concatenate([np.arange(a, b) for a, b in kv_ranges])
    g = _GraphWriter(shard_weights_path(out))
    inputs, outputs = _attention_io(c, len(units), max_len, flags=False)
    q, k, v = g.linear_forms("hidden", [slice_affine(layer.wq, q_rows), slice_affine(layer.wk, kv_rows),
                                        slice_affine(layer.wv, kv_rows)], accuracy_level)
    if layer.bq is not None:
        q, k, v = (g.node("Add", [t, g.constant("bias", b[rows])])[0] for t, b, rows in
                   ((q, layer.bq, q_rows), (k, layer.bk, kv_rows), (v, layer.bv, kv_rows)))
    _grouped_attention(g, c, q, k, v, len(units), max_len)
    (y,) = g.linear_forms("heads", [slice_affine(layer.wo, col_ranges=q_ranges)], accuracy_level)
    g.nodes.append(helper.make_node("Identity", [y], ["partial"], name="partial"))
    return _save(g, inputs, outputs, "edgerun_shard_attention", out)


def dynamic_attention_graph(config: ModelConfig, layer: LayerWeights, max_len: int, out: Path,
                            accuracy_level: int = 0) -> int:
    """Every KV head of a layer, for dynamic mapping: keys and values of every head are cached each step (any
    head may be handed to this device next token), while the query, attention output and output projection
    of a head run only where `flags` (bool, one per head) holds; the others add nothing. Inputs hidden,
    flags, seqlens_k, total_seq_len and past_key/past_value (1, n_kv_heads, max_len, head_dim); outputs
    partial (1, seq, hidden) and the presents."""
    c = config
    q_width = c.heads_per_kv * c.head_dim
    g = _GraphWriter(shard_weights_path(out))
    inputs, outputs = _attention_io(c, c.n_kv_heads, max_len, flags=True)
    k, v = g.linear_forms("hidden", [slice_affine(layer.wk), slice_affine(layer.wv)], accuracy_level)
    if layer.bk is not None:
        (k,) = g.node("Add", [k, g.constant("bias", layer.bk)])
        (v,) = g.node("Add", [v, g.constant("bias", layer.bv)])
    q_zeros, out_zeros = g.shape_with_width("hidden", q_width), g.shape_with_width("hidden", c.hidden)

    def query(unit: int) -> str:
        rows = np.arange(unit * q_width, (unit + 1) * q_width)
        (q,) = g.linear_forms("hidden", [slice_affine(layer.wq, rows)], accuracy_level)
        return q if layer.bq is None else g.node("Add", [q, g.constant("bias", layer.bq[rows])])[0]

    queries = [g.gated(g.flag("flags", u), lambda u=u: query(u), q_zeros, q_width) for u in range(c.n_kv_heads)]
    (q,) = g.node("Concat", queries, axis=-1)
    _grouped_attention(g, c, q, k, v, c.n_kv_heads, max_len)

    def output(unit: int) -> str:
        start, stop = unit * q_width, (unit + 1) * q_width
        (heads,) = g.node("Slice", ["heads", g.constant("start", np.array([start], np.int64)),
                                    g.constant("stop", np.array([stop], np.int64)),
                                    g.constant("axis", np.array([-1], np.int64))])
        return g.linear_forms(heads, [slice_affine(layer.wo, col_ranges=[(start, stop)])], accuracy_level)[0]

    parts = [g.gated(g.flag("flags", u), lambda u=u: output(u), out_zeros, c.hidden) for u in range(c.n_kv_heads)]
    g.nodes.append(helper.make_node("Sum", parts, ["partial"], name="partial"))
    return _save(g, inputs, outputs, "edgerun_dynamic_attention", out)


def dynamic_mlp_graph(config: ModelConfig, layer: LayerWeights, ranges: Sequence[tuple[int, int]], out: Path,
                      accuracy_level: int = 0) -> int:
    """Every neuron group of a layer's MLP (intermediate rows [start, stop) each), for dynamic mapping: a group
    runs only where `flags` (bool, one per group) holds. Inputs hidden and flags, output partial."""
    g = _GraphWriter(shard_weights_path(out))
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("hidden", f32, [1, "seq", config.hidden]),
              helper.make_tensor_value_info("flags", TensorProto.BOOL, [len(ranges)])]
    outputs = [helper.make_tensor_value_info("partial", f32, [1, "seq", config.hidden])]
    zeros = g.shape_with_width("hidden", config.hidden)
    parts = [g.gated(g.flag("flags", i), lambda r=r: _mlp_partial(g, layer, [r], accuracy_level), zeros,
                     config.hidden) for i, r in enumerate(ranges)]
    g.nodes.append(helper.make_node("Sum", parts, ["partial"], name="partial"))
    return _save(g, inputs, outputs, "edgerun_dynamic_mlp", out)


def shard_mlp_graph(config: ModelConfig, layer: LayerWeights, ranges: Sequence[tuple[int, int]], out: Path,
                    accuracy_level: int = 0) -> int:
    """The partial MLP output of some neuron ranges (rows of gate and up, columns of down):
    hidden (1, seq, hidden) normalized in, partial (1, seq, hidden) out."""
    g = _GraphWriter(shard_weights_path(out))
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("hidden", f32, [1, "seq", config.hidden])]
    outputs = [helper.make_tensor_value_info("partial", f32, [1, "seq", config.hidden])]
    y = _mlp_partial(g, layer, ranges, accuracy_level)
    g.nodes.append(helper.make_node("Identity", [y], ["partial"], name="partial"))
    return _save(g, inputs, outputs, "edgerun_shard_mlp", out)


def shard_head_graph(config: ModelConfig, output: QuantTensor, rows: np.ndarray, out: Path,
                     accuracy_level: int = 0, after_chunk: Callable[[], None] | None = None) -> int:
    """Logits of some vocabulary rows: hidden (1, seq, hidden) after the final norm in, logits (1, seq, rows) out.
    `after_chunk` runs after each chunk of rows is written (to let go of the model file's pages it read)."""
    g = _GraphWriter(shard_weights_path(out))
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("hidden", f32, [1, "seq", config.hidden])]
    outputs = [helper.make_tensor_value_info("logits", f32, [1, "seq", len(rows)])]
    # One product per chunk of rows, each written out before the next is cut: a vocabulary of 128k rows cut
    # and re-encoded at once would hold several copies of the head in memory while the share is built.
    chunks = []
    for i in range(0, len(rows), HEAD_CHUNK_ROWS):
        chunks.append(g.linear_forms("hidden", [slice_affine(output, rows[i:i + HEAD_CHUNK_ROWS])], accuracy_level)[0])
        if after_chunk is not None:
            after_chunk()
    g.nodes.append(helper.make_node("Concat", chunks, ["logits"], name="logits", axis=-1))
    return _save(g, inputs, outputs, "edgerun_shard_head", out)


def expert_graph(config: ModelConfig, expert: ExpertWeights, out: Path, accuracy_level: int = 0,
                 dequantized: bool = False) -> int:
    """One expert of a mixture, weighted: hidden (1, seq, hidden) and gates (1, seq, 1) in, gates * SwiGLU(hidden)
    out (what an expert worker returns to its hub). `dequantized`: float32 matrices (a browser tab on WebAssembly,
    whose onnxruntime-web has no 4-bit kernel of its own)."""
    g = _GraphWriter(shard_weights_path(out))
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("hidden", f32, [1, "seq", config.hidden]),
              helper.make_tensor_value_info("gates", f32, [1, "seq", 1])]
    outputs = [helper.make_tensor_value_info("weighted", f32, [1, "seq", config.hidden])]

    def linear(x: str, tensors: list[QuantTensor]) -> list[str]:
        if dequantized:
            return g.linear_forms(x, [t.dequantize() for t in tensors], accuracy_level)
        return g.linear(x, tensors, accuracy_level)

    y = _gated_mlp(g, "hidden", *expert.matrices(), linear)
    g.nodes.append(helper.make_node("Mul", [y, "gates"], ["weighted"], name="weighted"))
    return _save(g, inputs, outputs, "edgerun_expert", out)
