"""When a lossy block stops waiting for partials: per-node arrival estimators and the timeout they set."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass


class ArrivalEstimator:
    """When a node's partial arrives after the master sends the block's input, estimated as TCP
    estimates its retransmission timeout (RFC 6298): smoothed mean plus k mean deviations, but never
    below the slowest of the last `window` samples with a margin. Delays on a shared or virtual
    machine have a heavy tail (a descheduled process, a page fault) that mean plus deviations
    underestimates; a partial cut off while it was on its way costs accuracy with no packet lost at
    all, while waiting longer costs time only when a partial really was lost, which parity makes rare.
    Only partials that arrived whole are sampled: a lost one says nothing of the time (Karn's rule)."""

    def __init__(self, window: int = 256, tail_margin: float = 1.25) -> None:
        self.mean: float | None = None
        self.deviation = 0.0
        self.samples = 0
        self.window, self.tail_margin = window, tail_margin
        # (sample number, seconds) of the window's samples that no later sample exceeds, slowest first:
        # the window's maximum is the first, kept in O(1) per sample since bound() runs for every block.
        self.slowest: collections.deque[tuple[int, float]] = collections.deque()

    def observe(self, seconds: float) -> None:
        self.samples += 1
        while self.slowest and self.slowest[-1][1] <= seconds:
            self.slowest.pop()
        self.slowest.append((self.samples, seconds))
        if self.slowest[0][0] <= self.samples - self.window:
            self.slowest.popleft()
        if self.mean is None:
            self.mean, self.deviation = seconds, seconds / 2
            return
        self.deviation += (abs(seconds - self.mean) - self.deviation) / 4
        self.mean += (seconds - self.mean) / 8

    def bound(self, k: float) -> float | None:
        if self.mean is None:
            return None
        return max(self.mean + k * self.deviation, self.tail_margin * self.slowest[0][1])


@dataclass
class Timeouts:
    """When a lossy block stops waiting. Fixed: `fixed_s` after sending. Adaptive: at the latest of
    the participants' estimated arrivals after sending, and, once the first partial is in, at the
    latest of their estimated lags behind the first one. Most delay is common to all nodes (the
    master's own compute, a busy machine, a slow network), so lags are tighter than arrivals: a
    partial that is lost is given up on soon after its peers arrived. Both are kept within
    [floor_s, ceiling_s]; `initial_s` applies until every participant has `warmup` samples."""

    fixed_s: float | None
    deviations: float = 4.0  # k of the estimators' mean + k deviations (TCP's is 4)
    initial_s: float = 0.010
    floor_s: float = 0.001  # event-loop timers have millisecond resolution
    ceiling_s: float = 1.0
    warmup: int = 8

    def _bound(self, estimators: Sequence[ArrivalEstimator]) -> float | None:
        if self.fixed_s is not None or any(e.samples < self.warmup for e in estimators):
            return None
        return min(self.ceiling_s, max([self.floor_s, *(e.bound(self.deviations) for e in estimators)]))

    def after_send(self, arrivals: Sequence[ArrivalEstimator]) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        bound = self._bound(arrivals)
        return self.initial_s if bound is None else bound

    def after_first(self, lags: Sequence[ArrivalEstimator]) -> float | None:
        return self._bound(lags)
