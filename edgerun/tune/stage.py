"""One pipeline stage's side of training: forward passes that keep their graph until the gradient comes back,
backward passes that accumulate into the LoRA matrices, and AdamW steps (PyTorch's).

A micro-batch goes forward through every stage; the last stage computes its loss and at once its gradient
with respect to its input; each earlier stage, handed the gradient of its output, returns the gradient of its
input. Several micro-batches may be in flight (GPipe): each keeps its graph here, by id, until its backward
pass. A step then applies the accumulated gradients. The DE-LLMIT report's StepTune (§3.2.4) creates its AdamW in
every step, which throws its moments away; here the optimizer lives with the stage and its state is part of
every checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from edgerun.model.config import ModelConfig
from edgerun.model.weights import ModelWeights
from edgerun.tune.lora import Adapter, LoraConfig, parse_tensor_name, tensor_name
from edgerun.tune.model import StageModel


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 5e-5  # the DE-LLMIT report's
    weight_decay: float = 0.1  # the DE-LLMIT report's
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


class StageTrainer:
    def __init__(self, config: ModelConfig, weights: ModelWeights, first: int, end: int, lora: LoraConfig,
                 optim: OptimConfig, recompute: bool = False) -> None:
        self.model = StageModel(config, weights, first, end, lora, recompute)
        self.params = self.model.named_lora()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=optim.lr, betas=optim.betas,
                                           eps=optim.eps, weight_decay=optim.weight_decay)
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output)
        self.compute_s = 0.0  # forward and backward time, for benchmarks

    @property
    def first(self) -> int:
        return self.model.first

    @property
    def end(self) -> int:
        return self.model.end

    def _input(self, x: np.ndarray) -> torch.Tensor:
        if self.model.is_first:
            return torch.from_numpy(np.array(x, np.int64))
        return torch.from_numpy(np.array(x, np.float32)).requires_grad_(True)

    def forward(self, micro: int, x: np.ndarray, key: tuple[int, int]) -> np.ndarray:
        """A middle or first stage's forward pass; its graph waits for `backward(micro, ...)`."""
        start = time.perf_counter()
        inp = self._input(x)
        out = self.model(inp, key)
        self.pending[micro] = (inp, out)
        self.compute_s += time.perf_counter() - start
        return out.detach().numpy()

    def forward_loss(self, x: np.ndarray, labels: np.ndarray, key: tuple[int, int],
                     denominator: int) -> tuple[float, int, np.ndarray | None]:
        """The last stage: forward, loss (summed over labelled tokens, divided by `denominator`, the labelled
        tokens of the whole step, so micro-batches add up to the step's mean) and its backward pass at once.
        Returns (summed loss, labelled tokens, gradient of the input, or None for a single stage)."""
        start = time.perf_counter()
        inp = self._input(x)
        total, count = self.model.loss_sum(self.model(inp, key), torch.from_numpy(np.asarray(labels, np.int64)))
        (total / denominator).backward()
        grad = None if self.model.is_first else inp.grad.numpy()
        self.compute_s += time.perf_counter() - start
        return float(total.detach()), count, grad

    def backward(self, micro: int, grad: np.ndarray) -> np.ndarray | None:
        """Continue micro-batch `micro`'s backward pass from its output's gradient; the input's gradient, or None
        on the first stage."""
        start = time.perf_counter()
        inp, out = self.pending.pop(micro)
        out.backward(torch.from_numpy(np.array(grad, np.float32)))
        self.compute_s += time.perf_counter() - start
        return None if self.model.is_first else inp.grad.numpy()

    @torch.no_grad()
    def eval_loss(self, x: np.ndarray, labels: np.ndarray | None) -> tuple[np.ndarray | None, float, int]:
        """A forward pass without dropout or graph: (output, 0, 0) for an inner stage, (None, summed loss,
        labelled tokens) for the last."""
        out = self.model(self._input(x).detach(), None)
        if labels is None:
            return out.numpy(), 0.0, 0
        total, count = self.model.loss_sum(out, torch.from_numpy(np.asarray(labels, np.int64)))
        return None, float(total), count

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.clear()

    def gradients(self) -> dict[str, np.ndarray]:
        """The accumulated gradient of every LoRA matrix by name (tests compare stages with a single process)."""
        return {n: (np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy().copy())
                for n, p in self.params.items()}

    # --- checkpoints: LoRA matrices and AdamW moments, by name, so any later split can take them ----------
    def state(self) -> tuple[dict[str, np.ndarray], int]:
        """(tensors, optimizer steps taken): each matrix under its name, its moments under name + '.exp_avg' and
        '.exp_avg_sq'."""
        tensors, steps = {}, 0
        for name, p in self.params.items():
            tensors[name] = p.detach().numpy().copy()
            s = self.optimizer.state.get(p)
            if s:
                tensors[f"{name}.exp_avg"] = s["exp_avg"].numpy().copy()
                tensors[f"{name}.exp_avg_sq"] = s["exp_avg_sq"].numpy().copy()
                steps = int(s["step"])
        return tensors, steps

    def load_state(self, tensors: dict[str, np.ndarray], steps: int) -> None:
        """Take this stage's part of a checkpoint; names for other layers are ignored, a missing one is an error."""
        with torch.no_grad():
            for name, p in self.params.items():
                if name not in tensors:
                    raise ValueError(f"the checkpoint lacks {name}")
                p.copy_(torch.from_numpy(np.asarray(tensors[name], np.float32)))
                if steps and f"{name}.exp_avg" in tensors:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(float(steps)),
                        "exp_avg": torch.from_numpy(np.array(tensors[f"{name}.exp_avg"], np.float32)),
                        "exp_avg_sq": torch.from_numpy(np.array(tensors[f"{name}.exp_avg_sq"], np.float32))}


def adapter_from_state(tensors: dict[str, np.ndarray], lora: LoraConfig, base_sha256: str) -> Adapter:
    """The adapter a checkpoint's LoRA matrices make (the moments left out)."""
    matrices = {}
    for name in tensors:
        if name.endswith(".lora_A.weight"):  # the moments' names end in .exp_avg and .exp_avg_sq
            layer, target, _ = parse_tensor_name(name)
            matrices[(layer, target)] = (tensors[name], tensors[tensor_name(layer, target, "B")])
    return Adapter(lora, base_sha256, matrices)
