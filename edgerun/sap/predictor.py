"""Semantic-aware predictors (HALO §III-B2): per layer l ≥ 1 and block, a small regressor from a
normalized hidden state to the log L2 norms of layer l's attention units (a KV head with its query
heads) or MLP neuron groups. Layer 0 has none: it travels over TCP, nothing of it may be lost.

What a predictor reads (`reads`):
- `ahead`, HALO's design: the attention input of layer l − 1. The ranking can be computed while the
  previous layer's partials travel (Pred overlapped with Comm).
- `same`: the block's own input (layer l's attention input for attention, its MLP input for the MLP).
  The ranking waits for the input, a matrix-vector product on the critical path, but it sees what the
  block will see: on the shipped model it loses about a fifth less than `ahead` at 5 % loss.

Two kinds: `mlp` (scikit-learn MLPRegressor, one hidden layer of 256 or 512, as HALO) and `linear`
(ridge regression). Either is stored as plain numpy arrays and runs as two matmuls, no sklearn needed
at run time.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.net.wire import Block
from edgerun.sap.calibrate import Calibration

KINDS = ("mlp", "linear")
READS = ("same", "ahead")


@dataclass(frozen=True)
class Predictor:
    """log-norms = relu(x' @ w1 + b1) @ w2 + b2 (no hidden layer when w1 is empty), with x' the input
    standardized by x_mean and x_scale. mean_norm: each unit's average norm over the calibration,
    the static importance order."""

    x_mean: np.ndarray
    x_scale: np.ndarray
    w1: np.ndarray  # (hidden, width) or (0, 0)
    b1: np.ndarray
    w2: np.ndarray  # (width or hidden, units)
    b2: np.ndarray
    mean_norm: np.ndarray

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Predicted log norms, (seq, units), for inputs (seq, hidden)."""
        h = (x.astype(np.float32) - self.x_mean) / self.x_scale
        if self.w1.size:
            h = np.maximum(h @ self.w1 + self.b1, 0.0)
        return h @ self.w2 + self.b2


@dataclass(frozen=True)
class PredictorSet:
    model_sha256: str
    group_size: int
    kind: str
    attention: dict[int, Predictor]  # layer -> predictor of its attention units' norms
    mlp: dict[int, Predictor]  # layer -> predictor of its groups' norms
    reads: str = "ahead"  # "ahead": layer - 1's attention input; "same": the block's own input

    @property
    def ahead(self) -> bool:
        return self.reads == "ahead"

    def static_order(self, block: Block, n_layers: int, units: int) -> tuple[tuple[int, ...], ...]:
        """Per layer, units from the most to the least important on average over the calibration
        (priority index p is unit order[p]); layer 0, which has no predictor, keeps index order."""
        table = self.attention if block == Block.ATTN else self.mlp
        orders = []
        for layer in range(n_layers):
            if layer in table:
                if table[layer].mean_norm.size != units:
                    raise EdgerunError(f"the predictors know {table[layer].mean_norm.size} units in layer {layer}, "
                                       f"the model has {units}")
                orders.append(tuple(int(u) for u in np.argsort(-table[layer].mean_norm, kind="stable")))
            else:
                orders.append(tuple(range(units)))
        return tuple(orders)

    def predict(self, layer: int, block: Block, features: np.ndarray) -> np.ndarray:
        """Predicted log norms of layer's units from what the predictors read (see `reads`): the
        attention input of layer - 1, or the block's own input."""
        return (self.attention if block == Block.ATTN else self.mlp)[layer](features)

    def rank(self, layer: int, block: Block, features: np.ndarray) -> tuple[int, ...]:
        """Layer's units from the most to the least important (one ranking for a multi-token step, from
        the mean prediction over its tokens). Master and nodes call this same function on the same input,
        so with `ahead` predictors a node can predict the master's ranking before it arrives."""
        scores = self.predict(layer, block, features).mean(axis=0)
        return tuple(int(u) for u in np.argsort(-scores, kind="stable"))

    def cost_per_token_s(self, repeats: int = 20) -> float:
        """Time to predict every layer's units for one token, on this machine."""
        hidden = next(iter(self.attention.values())).x_mean.size
        x = np.zeros((1, hidden), np.float32)
        start = time.perf_counter()
        for _ in range(repeats):
            for table in (self.attention, self.mlp):
                for predictor in table.values():
                    predictor(x)
        return (time.perf_counter() - start) / repeats

    def to_bytes(self) -> bytes:
        """The predictor file's content, for sending to nodes."""
        buffer = io.BytesIO()
        np.savez(buffer, **self._arrays())
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> PredictorSet:
        return cls.load(io.BytesIO(data))

    def save(self, path: Path) -> None:
        try:
            np.savez(path, **self._arrays())
        except OSError as e:
            raise EdgerunError(f"cannot write predictors to {path} ({e.strerror}); choose another with --out") from e

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {"model_sha256": np.array(self.model_sha256),
                                         "group_size": np.array(self.group_size), "kind": np.array(self.kind),
                                         "reads": np.array(self.reads)}
        for name, table in (("attn", self.attention), ("mlp", self.mlp)):
            for layer, p in table.items():
                for field in ("x_mean", "x_scale", "w1", "b1", "w2", "b2", "mean_norm"):
                    arrays[f"{name}.{layer}.{field}"] = getattr(p, field)
        return arrays

    @classmethod
    def load(cls, path: Path | io.BytesIO) -> PredictorSet:
        try:
            with np.load(path, allow_pickle=False) as f:
                tables: dict[str, dict[int, dict[str, np.ndarray]]] = {"attn": {}, "mlp": {}}
                for key in f.files:
                    if key.count(".") == 2:
                        name, layer, field = key.split(".")
                        tables[name].setdefault(int(layer), {})[field] = f[key]
                reads = str(f["reads"]) if "reads" in f.files else "ahead"  # files from before `same` existed
                if reads not in READS:
                    raise ValueError(f"unknown input {reads!r}")
                return cls(str(f["model_sha256"]), int(f["group_size"]), str(f["kind"]),
                           {k: Predictor(**v) for k, v in tables["attn"].items()},
                           {k: Predictor(**v) for k, v in tables["mlp"].items()}, reads)
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise EdgerunError(f"{path}: not a predictor file ({e})") from e


def default_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".sap.npz")


@dataclass(frozen=True)
class Quality:
    """Validation figures of one predictor."""

    layer: int
    block: str
    relative_error: float  # mean |predicted - true| / true, of the norms
    recall: float  # share of the true top-k units among the predicted top-k
    k: int
    units: int


def top_k_recall(predicted: np.ndarray, true: np.ndarray, k: int) -> float:
    """Mean over rows of |top-k(predicted) ∩ top-k(true)| / k."""
    p = np.argsort(-predicted, axis=1)[:, :k]
    t = np.argsort(-true, axis=1)[:, :k]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(p, t, strict=True)]))


def _fit(x: np.ndarray, y: np.ndarray, mean_norm: np.ndarray, kind: str, width: int, seed: int) -> Predictor:
    x = x.astype(np.float32)
    x_mean, x_scale = x.mean(axis=0), x.std(axis=0) + 1e-6
    xs = (x - x_mean) / x_scale
    if kind == "linear":
        # Ridge: (X'X + λI) w = X'y on the standardized inputs, with a bias column left unpenalized.
        a = np.hstack([xs, np.ones((len(xs), 1), np.float32)]).astype(np.float64)
        penalty = np.eye(a.shape[1]) * 10.0
        penalty[-1, -1] = 0.0
        w = np.linalg.solve(a.T @ a + penalty, a.T @ y)
        return Predictor(x_mean, x_scale, np.zeros((0, 0), np.float32), np.zeros(0, np.float32),
                         w[:-1].astype(np.float32), w[-1].astype(np.float32), mean_norm)
    from sklearn.neural_network import MLPRegressor

    net = MLPRegressor(hidden_layer_sizes=(width,), alpha=1e-3, learning_rate_init=1e-3, max_iter=200,
                       early_stopping=True, n_iter_no_change=10, random_state=seed)
    net.fit(xs, y)
    (w1, w2), (b1, b2) = net.coefs_, net.intercepts_
    return Predictor(x_mean, x_scale, w1.astype(np.float32), b1.astype(np.float32), w2.astype(np.float32),
                     b2.astype(np.float32), mean_norm)


def train(calibration: Calibration, kind: str = "linear", width: int = 256, validation: float = 0.2, seed: int = 0,
          reads: str = "same", progress: Callable[[str], None] = lambda _: None) -> tuple[PredictorSet, list[Quality]]:
    """One predictor per layer ≥ 1 and block; the last `validation` share of tokens is held out
    (a contiguous tail, so validation text is text the predictor has not seen)."""
    if kind not in KINDS:
        raise EdgerunError(f"unknown predictor kind {kind!r} ({', '.join(KINDS)})")
    if reads not in READS:
        raise EdgerunError(f"predictors read {' or '.join(READS)}, not {reads!r}")
    if reads == "same" and calibration.mlp_inputs.size == 0:
        raise EdgerunError("this calibration has no MLP inputs (an older edgerun wrote it): run `edgerun sap "
                           "calibrate` again, or train with --reads ahead")
    if not 0.0 < validation < 1.0:
        raise EdgerunError(f"validation share must lie in (0, 1), not {validation}")
    n = calibration.tokens
    split = int(n * (1 - validation))
    if split < 16 or n - split < 16:
        raise EdgerunError(f"{n} calibration tokens are too few to train and validate on")
    tables: dict[str, dict[int, Predictor]] = {"attention": {}, "mlp": {}}
    qualities = []
    for layer in range(1, calibration.inputs.shape[0]):
        if reads == "ahead":
            features = {"attention": calibration.inputs[layer - 1], "mlp": calibration.inputs[layer - 1]}
        else:
            features = {"attention": calibration.inputs[layer], "mlp": calibration.mlp_inputs[layer]}
        for name, norms in (("attention", calibration.attn_norms), ("mlp", calibration.group_norms)):
            x = features[name]
            start = time.perf_counter()
            y = np.log(norms[layer] + 1e-6)
            predictor = _fit(x[:split], y[:split], norms[layer][:split].mean(axis=0), kind, width, seed)
            predicted = np.exp(predictor(x[split:]))
            true = norms[layer][split:]
            k = max(1, -(-true.shape[1] // 4))
            quality = Quality(layer, name, float(np.mean(np.abs(predicted - true) / (true + 1e-6))),
                              top_k_recall(predicted, true, k), k, true.shape[1])
            tables[name][layer] = predictor
            qualities.append(quality)
            progress(f"layer {layer:>3} {name:9} relative error {quality.relative_error:6.1%}, top-{k} recall "
                     f"{quality.recall:6.1%} (chance {k / quality.units:.0%}), {time.perf_counter() - start:.1f} s")
    return PredictorSet(calibration.model_sha256, calibration.group_size, kind, tables["attention"],
                        tables["mlp"], reads), qualities
