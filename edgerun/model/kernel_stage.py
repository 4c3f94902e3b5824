"""A pipeline stage for the browser node's own WebAssembly kernels (browser/kernels.wat, browser/kernels.js).

onnxruntime-web's WebAssembly has no quantized matrix kernel faster than its float32 MatMul, so a tab running an
ONNX stage holds its matrices in float32 (5-6x the bytes) and reads them all on every pass. A kernel stage keeps
them quantized: every matrix in onnx_graph's affine-block form (w = scale * (code - mid) + offset per block of 32
columns), which the tab multiplies with int8 activations as onnxruntime's MatMulNBits does natively.

One file, `stage.bin`:
    b"ERK1", u32 little-endian header length, the header (JSON), zeros up to a multiple of 64, then the tensors,
    each starting at a multiple of 64 bytes from the data's start.
The header holds the model's shape and block (activation, embedding scale, query scale), the stage's layers with
each one's attention window and rotation (RoPE base and position scale), and, per tensor name, its offset, byte
length and type:
    "f32" vectors (norm weights, Qwen2's attention biases);
    a matrix "<name>" as "<name>.codes" (4-bit: 16 bytes a block, byte j = column j | column j + 16 << 4, the
    GGUF order; 8-bit: 32 signed bytes a block, code - 128), "<name>.scales" and, where it has offsets,
    "<name>.offsets" (f32, rows x blocks), with "matrices"[name] = {bits, rows, cols, offsets}.
Layer i's tensors are named "<i>.attn_norm", "<i>.wq", ... as LayerWeights' fields (the optional vectors "<i>.bq",
"<i>.bk", "<i>.bv", "<i>.q_norm", "<i>.k_norm", "<i>.attn_post_norm", "<i>.ffn_post_norm" only where the model
has them); the embedding (first stage)
and LM head (last) are "token_embd" and "output" (the same tensor when tied), with "output_norm".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from edgerun.model.config import ModelConfig
from edgerun.model.quant import AffineBlocks, QuantTensor, to_affine_blocks
from edgerun.model.weights import ModelWeights

KERNEL_STAGE_FILE = "stage.bin"
MAGIC = b"ERK1"
ALIGN = 64
FORMAT = 2
LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# The layer vectors beside the two norms, each present only where the model has it: Qwen2's attention biases,
# Qwen3's query/key norms, Gemma 3's norms after attention and after the MLP.
LAYER_VECTORS = ("bq", "bk", "bv", "q_norm", "k_norm", "attn_post_norm", "ffn_post_norm")

# The dense blocks: Llama's (Llama 3's RoPE factors included), Phi-3's (Llama's once its fused matrices are split),
# Qwen2's (attention biases), Qwen3's (query/key norms) and Gemma 3's (GeGLU, windowed layers on their own RoPE
# base, scaled embedding and queries, post norms, linear RoPE scaling).
KERNEL_ARCHITECTURES = ("llama", "phi3", "qwen2", "qwen3", "gemma3")

def _matrices(weights: ModelWeights) -> list[QuantTensor]:
    """Every matrix a stage holds: the layers', the LM head and the embedding."""
    return [t for layer in weights.layers for _, t in layer.matrices()] + [weights.output, weights.token_embd]


def _kernel_form(form: AffineBlocks | None) -> bool:
    """Whether the kernels multiply this form: 4- or 8-bit codes in blocks of 32."""
    return form is not None and form.block == 32 and form.bits in (4, 8)


def _forms(weights: ModelWeights) -> dict[str, AffineBlocks | None]:
    """Per quantization type of the model's matrices, the affine form of one row (its bits and offsets)."""
    matrices = _matrices(weights)
    return {qtype: to_affine_blocks(next(t for t in matrices if t.qtype == qtype).take_rows(slice(0, 1)))
            for qtype in sorted({t.qtype for t in matrices})}


def unsupported(config: ModelConfig, weights: ModelWeights) -> str | None:
    """Why the kernels cannot run this model (None when they can): they implement the dense blocks of
    KERNEL_ARCHITECTURES."""
    if config.architecture not in KERNEL_ARCHITECTURES:
        return f"architecture {config.architecture} (the kernels run {', '.join(KERNEL_ARCHITECTURES)})"
    if weights.adapter_sha256:
        return "a LoRA adapter"
    for qtype, form in _forms(weights).items():
        if not _kernel_form(form):
            return f"{qtype} matrices (the kernels take 4- and 8-bit codes in blocks of 32)"
    return None


def expansion(weights: ModelWeights) -> float:
    """How many times the file's bytes a stage's matrices take in stage.bin (float32 scales and offsets beside the
    codes): a tab on the kernels holds that many times fewer layers in its memory budget."""
    forms = _forms(weights)
    total = 0
    for t in _matrices(weights)[:-1]:  # the embedding is only indexed (ModelWeights.matrix_bytes)
        form = forms[t.qtype]
        rows, cols = t.shape
        total += rows * cols * form.bits // 8 + rows * cols // 32 * 4 * (1 + (form.offsets is not None))
    return total / weights.matrix_bytes()


def packed_codes(form: AffineBlocks) -> np.ndarray:
    """The codes as the kernels read them (see the module's docstring)."""
    rows, cols = form.codes.shape
    if form.bits == 8:
        return (form.codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
    blocks = form.codes.reshape(rows, cols // 32, 32)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).astype(np.uint8).reshape(rows, cols // 2)


class _Writer:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.tensors: dict[str, dict[str, object]] = {}
        self.matrices: dict[str, dict[str, object]] = {}

    def tensor(self, name: str, array: np.ndarray, kind: str) -> None:
        pad = -self.size % ALIGN
        self.chunks.append(b"\0" * pad)
        self.size += pad
        data = np.ascontiguousarray(array).tobytes()
        self.tensors[name] = {"offset": self.size, "bytes": len(data), "type": kind}
        self.chunks.append(data)
        self.size += len(data)

    def matrix(self, name: str, t: QuantTensor) -> None:
        form = to_affine_blocks(t)
        if not _kernel_form(form):
            raise ValueError(f"{name}: {t.qtype} has no 4- or 8-bit affine form in blocks of 32")
        self.tensor(f"{name}.codes", packed_codes(form), "u8")
        self.tensor(f"{name}.scales", form.scales.astype("<f4"), "f32")
        if form.offsets is not None:
            self.tensor(f"{name}.offsets", form.offsets.astype("<f4"), "f32")
        rows, cols = t.shape
        self.matrices[name] = {"bits": form.bits, "rows": rows, "cols": cols, "offsets": form.offsets is not None}

    def alias(self, name: str, existing: str) -> None:
        """`name` for a matrix written already (the tied LM head and embedding: one copy)."""
        self.matrices[name] = self.matrices[existing]
        for part in ("codes", "scales", "offsets"):
            if f"{existing}.{part}" in self.tensors:
                self.tensors[f"{name}.{part}"] = self.tensors[f"{existing}.{part}"]


def build_kernel_stage(config: ModelConfig, weights: ModelWeights, first_layer: int, end_layer: int, embed: bool,
                       lm_head: bool, out_dir: Path) -> int:
    """Write `stage.bin` for layers [first_layer, end_layer) into out_dir; return its size in bytes."""
    reason = unsupported(config, weights)
    if reason is not None:
        raise ValueError(f"the browser kernels cannot run this model: {reason}")
    w = _Writer()
    if embed:
        w.matrix("token_embd", weights.token_embd)
    for i in range(first_layer, end_layer):
        layer = weights.layers[i]
        w.tensor(f"{i}.attn_norm", layer.attn_norm.astype("<f4"), "f32")
        w.tensor(f"{i}.ffn_norm", layer.ffn_norm.astype("<f4"), "f32")
        for name in LAYER_VECTORS:
            if getattr(layer, name) is not None:
                w.tensor(f"{i}.{name}", getattr(layer, name).astype("<f4"), "f32")
        for name in LAYER_MATRICES:
            w.matrix(f"{i}.{name}", getattr(layer, name))
    if lm_head:
        w.tensor("output_norm", weights.output_norm.astype("<f4"), "f32")
        if weights.output is weights.token_embd and embed:
            w.alias("output", "token_embd")
        else:
            w.matrix("output", weights.output)
    header = json.dumps({
        "format": FORMAT, "first_layer": first_layer, "end_layer": end_layer, "embed": embed, "lm_head": lm_head,
        "hidden": config.hidden, "ffn": config.ffn, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "vocab": config.vocab_size, "rope_base": config.rope_base,
        # Llama 3's: each rotary pair's frequency divided by its factor (none: 1)
        "rope_freqs": None if weights.rope_freqs is None else [float(f) for f in weights.rope_freqs],
        "norm_eps": config.norm_eps, "activation": str(config.activation), "embed_scale": config.embed_scale,
        # 0: the scores scaled by 1/sqrt(head_dim); else the queries by this, after their rotation
        "query_scale": config.query_scale,
        # per layer of the stage: how far back it attends (0: the whole context), its RoPE base and position scale
        "windows": [config.window(i) for i in range(first_layer, end_layer)],
        "rope_bases": [config.rope_base_of(i) for i in range(first_layer, end_layer)],
        "rope_scales": [config.rope_scale_of(i) for i in range(first_layer, end_layer)],
        "tensors": w.tensors, "matrices": w.matrices}).encode()
    start = 8 + len(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / KERNEL_STAGE_FILE
    with path.open("wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header + b"\0" * (-start % ALIGN))
        for chunk in w.chunks:
            f.write(chunk)
    return path.stat().st_size


def read_kernel_stage(path: Path) -> tuple[dict, memoryview]:
    """The header and the data of a stage file (for tests and tools)."""
    raw = path.read_bytes()
    if raw[:4] != MAGIC:
        raise ValueError(f"{path} is not a kernel stage")
    (length,) = struct.unpack_from("<I", raw, 4)
    start = 8 + length
    return json.loads(raw[8:start]), memoryview(raw)[start + (-start % ALIGN):]
