"""`edgerun sap calibrate`: run the reference model over calibration text and record, per layer and
token, the normalized inputs of attention and of the MLP (what a predictor reads) and the L2 norm of
each unit's contribution to the block output (what it learns to predict). Units are what the
tensor-parallel engine hands out: an attention unit is one KV head with the query heads that share
it, an MLP unit a neuron group. SwiGLU MLPs are rarely exactly zero, so importance is this graded
norm, not a label."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.loader import Model
from edgerun.model.reference import BlockHooks, ReferenceModel


@dataclass(frozen=True)
class Calibration:
    """Per token: attention and MLP inputs (layers, tokens, hidden) as float16, attention-unit norms
    (layers, tokens, KV heads) and group norms (layers, tokens, groups) as float32. Calibrations written
    before MLP inputs were recorded have an empty `mlp_inputs`: they train one-layer-ahead predictors only."""

    model_sha256: str
    group_size: int
    inputs: np.ndarray
    attn_norms: np.ndarray
    group_norms: np.ndarray
    mlp_inputs: np.ndarray

    @property
    def tokens(self) -> int:
        return self.inputs.shape[1]

    def save(self, path: Path) -> None:
        np.savez(path, model_sha256=np.array(self.model_sha256), group_size=np.array(self.group_size),
                 inputs=self.inputs, attn_norms=self.attn_norms, group_norms=self.group_norms,
                 mlp_inputs=self.mlp_inputs)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            with np.load(path, allow_pickle=False) as f:
                mlp_inputs = f["mlp_inputs"] if "mlp_inputs" in f.files else np.zeros((0, 0, 0), np.float16)
                return cls(str(f["model_sha256"]), int(f["group_size"]), f["inputs"], f["attn_norms"],
                           f["group_norms"], mlp_inputs)
        except (OSError, KeyError, ValueError) as e:
            raise EdgerunError(f"{path}: not a calibration file ({e})") from e


def attention_units(head_parts: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """Per-head contributions (heads, seq, hidden) summed into per-unit ones (KV heads, seq, hidden):
    head h belongs to KV head h // (heads / KV heads)."""
    heads, seq, hidden = head_parts.shape
    return head_parts.reshape(n_kv_heads, heads // n_kv_heads, seq, hidden).sum(axis=1)


def default_calibration_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".calib.npz")


class _Recorder(BlockHooks):
    wants_partials = True

    def __init__(self, n_layers: int, n_kv_heads: int) -> None:
        self.n_kv_heads = n_kv_heads
        self.inputs: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self.mlp_inputs: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self.heads: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self.groups: list[list[np.ndarray]] = [[] for _ in range(n_layers)]

    def attention_input(self, layer: int, x_norm: np.ndarray) -> None:
        self.inputs[layer].append(x_norm.astype(np.float16))

    def mlp_input(self, layer: int, x_norm: np.ndarray) -> None:
        self.mlp_inputs[layer].append(x_norm.astype(np.float16))

    def head_outputs(self, layer: int, parts: np.ndarray) -> None:
        self.heads[layer].append(np.linalg.norm(attention_units(parts, self.n_kv_heads), axis=-1).T)  # (seq, units)

    def group_outputs(self, layer: int, parts: np.ndarray) -> None:
        self.groups[layer].append(np.linalg.norm(parts, axis=-1).T)  # (seq, groups)


def token_chunks(model: Model, texts: Sequence[str], chunk: int, max_tokens: int) -> Iterator[list[int]]:
    """Texts tokenized end to end, cut into independent sequences of `chunk` tokens."""
    buffer: list[int] = []
    produced = 0
    for text in texts:
        buffer += model.tokenizer.encode(text + "\n\n")
        while len(buffer) >= chunk and produced < max_tokens:
            yield buffer[:chunk]
            buffer = buffer[chunk:]
            produced += chunk
        if produced >= max_tokens:
            return


def calibrate(model: Model, model_sha256: str, texts: Sequence[str], group_size: int = 256, tokens: int = 4096,
              chunk: int = 256, progress: Callable[[int, int], None] = lambda done, total: None) -> Calibration:
    if tokens < chunk or chunk < 2:
        raise EdgerunError(f"calibrate at least one chunk of {chunk} tokens (asked for {tokens})")
    reference = ReferenceModel(model.config, model.weights, group_size)
    recorder = _Recorder(model.config.n_layers, model.config.n_kv_heads)
    done = 0
    for sequence in token_chunks(model, texts, chunk, tokens):
        reference.forward(sequence, reference.new_cache(chunk), recorder)
        done += len(sequence)
        progress(done, tokens)
    if done == 0:
        raise EdgerunError(f"the calibration text is shorter than one chunk of {chunk} tokens")
    return Calibration(model_sha256, group_size,
                       np.stack([np.concatenate(x) for x in recorder.inputs]),
                       np.stack([np.concatenate(x) for x in recorder.heads]).astype(np.float32),
                       np.stack([np.concatenate(x) for x in recorder.groups]).astype(np.float32),
                       np.stack([np.concatenate(x) for x in recorder.mlp_inputs]))
