"""Choosing the next token from logits: greedy, or seeded temperature / top-k / min-p / top-p sampling.

A sampled token depends only on the logits, the seed and its position in the sequence, never on how
many draws came before: a reference run, a tensor-parallel cluster, a pipeline whose last stage is a
browser tab, and a request replayed after a recovery all choose the same tokens."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edgerun.model.logits import LogitShaper

MASK64 = (1 << 64) - 1
MAX_SEED = 1 << 53


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no limit
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the most likely one; 0: off

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError("temperature must be 0 (greedy) or a positive number")
        if self.top_k < 0:
            raise ValueError("top-k must be 0 (off) or positive")
        if not 0.0 < self.top_p <= 1.0:  # also rejects nan
            raise ValueError("top-p must lie in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError("min-p must lie in [0, 1)")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:  # JSON numbers carry it exactly to browsers
            raise ValueError(f"the seed must lie in [0, 2^53), not {self.seed}")


def uniform(seed: int, position: int) -> float:
    """The draw in [0, 1) for the token at `position` under `seed`: one splitmix64 step from a state
    mixed of both, its top 53 bits. A pure function of (seed, position), written the same way in the
    browser node (browser/sampling.js), so any stage, native or browser, and any replay after a recovery
    samples the same token."""
    state = (((seed & MASK64) ^ ((position * 0xD1B54A32D192ED03) & MASK64)) + 0x9E3779B97F4A7C15) & MASK64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


class Sampler:
    """One generation's draws. A `shaper` (model/logits.py) applies a request's grammar, penalties and biases to
    the logits before each draw and keeps the log-probabilities; the draw itself is the same."""

    def __init__(self, params: SamplingParams, shaper: LogitShaper | None = None) -> None:
        self.params, self.shaper = params, shaper
        # Without a seed, a random one for this sampler; it stays fixed, so positions still decide the draws.
        self.seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)

    @property
    def candidates(self) -> int | None:
        """How many of the largest logits a draw can pick from (greedy: one; top-k: k), None for all of them. An
        engine whose logits are spread over devices may gather only each device's `largest` that many: the
        draw is the same, as every other logit could be minus infinity."""
        p = self.params
        if self.needs_logits:
            return None
        if p.temperature == 0.0:
            return 1
        return p.top_k if p.top_k > 0 else None

    @property
    def needs_logits(self) -> bool:
        """Whether the draw needs the whole vocabulary's logits here (a shaper's rules), not a few candidates or a
        token drawn elsewhere."""
        return self.shaper is not None and self.shaper.rules.active

    def __call__(self, logits: np.ndarray, position: int) -> int:
        """The token at `position` (its index in the sequence) from the logits before it."""
        if self.shaper is None:
            return self._draw(logits, position)
        token = self._draw(self.shaper.shape(logits), position)
        self.shaper.accept(token, logits)
        return token

    def _draw(self, logits: np.ndarray, position: int) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        with np.errstate(over="ignore"):
            z = logits.astype(np.float64) / p.temperature
        # Candidates from the most to the least likely, ties by index (a stable sort; with top-k, `largest`, the
        # same order cut at k), so that every implementation keeps the same top-k and top-p prefix. Sums are
        # running sums (cumsum), which JavaScript computes in the same order.
        candidates = largest(z, p.top_k) if p.top_k > 0 else np.argsort(-z, kind="stable")
        if not np.isfinite(z[candidates[0]]):
            # A temperature so small that the logits overflow (2e-313 in an API request): its draw is the greedy one
            # (the weights below would be inf - inf, not a number)
            return int(np.argmax(logits))
        weights = np.exp(z[candidates] - z[candidates[0]])  # each candidate's probability over the first's
        if p.min_p > 0.0:  # the candidates at least min-p times as likely as the first: a prefix of them
            weights = weights[:int(np.count_nonzero(weights >= p.min_p))]
        cdf = np.cumsum(weights)
        if p.top_p < 1.0:  # the shortest prefix whose probability reaches top-p
            cdf = cdf[:int(np.searchsorted(cdf, p.top_p * cdf[-1])) + 1]
        index = int(np.searchsorted(cdf, uniform(self.seed, position) * cdf[-1], side="right"))
        return int(candidates[min(index, cdf.size - 1)])


def largest(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, the larger first and equal ones by index: a top-k sampler's candidates, so
    the k a device keeps of its own rows hold every one the whole vocabulary's draw can pick. In linear time: a
    vocabulary share is tens of thousands of rows, sorted in milliseconds."""
    logits = logits.reshape(-1)
    k = min(k, logits.size)
    masked = np.isneginf(logits) if k > 1 else None
    if masked is not None and np.count_nonzero(masked) > logits.size // 2:
        # Mostly minus infinities (a grammar's mask): numpy's partition slows to milliseconds over so many equal
        # values, so the finite ones are ranked alone and the rest follow by index, as they would anyway.
        finite = np.flatnonzero(~masked)
        chosen = finite[largest(logits[finite], min(k, finite.size))] if finite.size else finite
        return np.concatenate([chosen, np.flatnonzero(masked)[:k - chosen.size]]) if chosen.size < k else chosen
    if k == 1:
        return np.array([int(np.argmax(logits))])  # the first of the largest
    threshold = np.partition(logits, logits.size - k)[logits.size - k]  # the k-th largest value
    above = np.flatnonzero(logits > threshold)
    chosen = np.concatenate([above, np.flatnonzero(logits == threshold)[:k - above.size]])
    return chosen[np.lexsort((chosen, -logits[chosen]))]


# What a person gets from `generate`, `chat`, `master` and the API unless they say otherwise: llama.cpp's server
# defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), which keep a small model's text from looping the way
# greedy decoding does, and a fixed seed, so the same request gives the same text every time (another seed, another
# draw). Greedy is `--greedy` (temperature 0). The library's SamplingParams() stays greedy.
USER_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=0, min_p=0.05)
