"""A pipeline stage on ggml, llama.cpp's kernels: a run of the model's layers with StageSession's interface.

The stage is the whole-model engine (GgmlEngine) over its layers: the embedding where it starts at layer 0, the
final norm and LM head where it ends at the last, one graph per step. Its KV cache is ggml's (F16, rows as the
file stores Q and K); what it hands to other stages and takes from them (kv_rows, load_kv_rows) is StageSession's
form, float32 (1, kv heads, positions, head dim) in Hugging Face row order, so keys and values move between a
ggml stage and an onnxruntime one as between two of a kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgerun.model import ggml_lib
from edgerun.model.ggml_engine import GgmlEngine
from edgerun.model.loader import Model
from edgerun.model.weights import rope_rows_from_interleaved, rope_rows_to_interleaved

# The file a worker gets for a ggml stage: the model's own GGUF, whose layers the stage reads.
GGML_STAGE_FILE = "model.gguf"


class GgmlStage:
    """Layers [first_layer, end_layer) of a model on a ggml backend (the CPU's, or a CUDA GPU's)."""

    def __init__(self, model: Model, first_layer: int, end_layer: int, max_len: int, threads: int | None = None,
                 device: str = "cpu", slots: int = 1) -> None:
        """`slots`: sequences whose caches it holds at once, for batched steps (run_slot, run_batch); run and the
        KV moves take the first."""
        self.engine = GgmlEngine(model, max_len, threads, device, range(first_layer, end_layer), slots=slots)
        self.config = model.config
        self.layers = self.engine.layer_range
        self.max_len = max_len
        self.input_name = "input_ids" if self.engine.embeds else "hidden"
        self.prefix: tuple[int, dict[int, tuple[np.ndarray, np.ndarray]]] | None = None
        c = self.config
        # Keys cached as the file's interleaved rows are put in Hugging Face order on the way out, and back in.
        interleaved = self.engine.rope_mode == ggml_lib.ROPE_NORM
        self._to_hf = rope_rows_from_interleaved(c.n_kv_heads, c.kv_dim) if interleaved else None
        self._from_hf = rope_rows_to_interleaved(c.n_kv_heads, c.kv_dim) if interleaved else None

    @property
    def position(self) -> int:
        return self.engine.position

    @position.setter
    def position(self, value: int) -> None:
        self.engine.position = value

    def reset(self) -> None:
        """Forget every cached position (attention reads only the rows cached, whatever the buffers hold)."""
        self.engine.reset()

    def warm_up(self) -> None:
        """Run one position and forget it: the first run builds the one-token graph later runs reuse."""
        x = np.zeros((1, 1), np.int64) if self.engine.embeds else np.zeros((1, 1, self.config.hidden), np.float32)
        self.run(x)
        self.reset()

    def run(self, x: np.ndarray) -> np.ndarray:
        """Run token ids (1, seq) or hidden states (1, seq, hidden) after the positions cached: the hidden states
        (1, seq, hidden), or, on the last stage, the last position's logits (1, 1, vocab)."""
        if x.shape[1] + self.position > self.max_len:
            raise ValueError(f"context of {self.max_len} tokens exceeded")
        out = self.engine.run(self._embedded(x[0]))
        return out.reshape(1, 1, -1) if self.engine.has_head else out[None]

    def run_slot(self, slot: int, x: np.ndarray, start: int) -> np.ndarray:
        """A prompt's positions start.. of the sequence in `slot` (token ids (1, seq) or hidden states (1, seq,
        hidden)), as run runs them for the first slot."""
        if x.shape[1] + start > self.max_len:
            raise ValueError(f"context of {self.max_len} tokens exceeded")
        out = self.engine.run_slot(slot, self._embedded(x[0]), start)
        return out.reshape(1, 1, -1) if self.engine.has_head else out[None]

    def run_batch(self, batch: Sequence[tuple[int, int]], x: np.ndarray) -> np.ndarray:
        """One position of each of several sequences, (slot, position) each, in one step: token ids (B,) or hidden
        states (B, hidden) in, the hidden states (B, hidden) out, or on the last stage each one's logits (B, vocab).
        Each sequence's rows are those it gets alone (GgmlEngine.decode_rows)."""
        return self.engine.decode_rows(batch, self._embedded(x))

    def _embedded(self, x: np.ndarray) -> np.ndarray:
        """The first stage's token ids (n,) as their embedding rows (n, hidden); a later stage's hidden states as
        they are. ValueError for ids outside the vocabulary."""
        if not self.engine.embeds:
            return x
        ids = np.asarray(x, np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids outside the vocabulary of {self.config.vocab_size}")
        return self.engine.embed(ids)

    def _cache(self, layer: int) -> tuple[int, int]:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not in this stage ({self.layers.start}-{self.layers.stop - 1})")
        attn = self.engine.layers[layer - self.layers.start].attn
        return self.engine.weights.tensor(attn.k_cache), self.engine.weights.tensor(attn.v_cache)

    def kv_rows(self, layer: int, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One layer's keys and values of the positions cached from `since` on, (1, kv heads, positions, head
        dim) each, float32, Hugging Face row order."""
        end = self.position
        if not 0 <= since <= end:
            raise ValueError(f"no KV rows of layer {layer} from position {since} here")
        c = self.config
        g = ggml_lib.lib()
        out = []
        for which, tensor in enumerate(self._cache(layer)):
            rows = np.empty((end - since, c.kv_dim), np.float16)
            g.ggml_backend_tensor_get(tensor, rows.ctypes.data, since * c.kv_dim * 2, rows.nbytes)
            if which == 0 and self._to_hf is not None:
                rows = rows[:, self._to_hf]
            out.append(np.ascontiguousarray(
                rows.astype(np.float32).reshape(-1, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)[None]))
        return out[0], out[1]

    def load_kv_rows(self, layer: int, keys: np.ndarray, values: np.ndarray, since: int = 0) -> None:
        """Continue after these keys and values of one layer (kv_rows' form, from `since` on)."""
        c = self.config
        length = keys.shape[2] if keys.ndim == 4 else -1
        expected = (1, c.n_kv_heads, length, c.head_dim)
        if keys.shape != expected or values.shape != expected or since < 0 or since + length > self.max_len:
            raise ValueError(f"KV rows {keys.shape} from position {since} for layer {layer} do not fit this stage")
        g = ggml_lib.lib()
        for which, (tensor, rows) in enumerate(zip(self._cache(layer), (keys, values), strict=True)):
            flat = rows[0].transpose(1, 0, 2).reshape(length, c.kv_dim)
            if which == 0 and self._from_hf is not None:
                flat = flat[:, self._from_hf]
            data = np.ascontiguousarray(flat, np.float16)
            g.ggml_backend_tensor_set(tensor, data.ctypes.data, since * c.kv_dim * 2, data.nbytes)
        self.position = since + length

    def adopt_kv(self, other, layer: int) -> None:
        """Take another stage's cached rows of one layer (a worker swapping stages keeps the layers both hold);
        copied, as ggml owns its buffers."""
        self.load_kv_rows(layer, *other.kv_rows(layer))

    def save_prefix(self) -> None:
        """Keep the KV rows of every position cached so far (a shared prompt prefix)."""
        self.prefix = (self.position, {layer: self.kv_rows(layer) for layer in self.layers})

    def restore_prefix(self) -> int:
        """Continue from the saved prefix, whatever ran since; returns its length."""
        if self.prefix is None:
            raise ValueError("no prefix saved")
        length, rows = self.prefix
        for layer, (keys, values) in rows.items():
            self.load_kv_rows(layer, keys, values)
        self.position = length
        return length
