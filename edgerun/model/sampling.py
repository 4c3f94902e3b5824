"""Choosing the next token from logits: greedy, or seeded temperature / top-k / top-p sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError("temperature must be 0 (greedy) or a positive number")
        if self.top_k < 0:
            raise ValueError("top-k must be 0 (off) or positive")
        if not 0.0 < self.top_p <= 1.0:  # also rejects nan
            raise ValueError("top-p must lie in (0, 1]")


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        candidates = np.arange(z.size)
        if 0 < p.top_k < z.size:
            candidates = np.argpartition(-z, p.top_k - 1)[: p.top_k]
        # Sort candidates by probability, highest first, so top-p keeps a prefix.
        candidates = candidates[np.argsort(-z[candidates], kind="stable")]
        probs = np.exp(z[candidates] - z[candidates[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
        return int(candidates[self.rng.choice(candidates.size, p=probs)])
