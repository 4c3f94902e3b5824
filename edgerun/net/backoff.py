"""Retrying a peer that may not be up yet (a node started before its master): the delays between tries."""

from __future__ import annotations

import time


class Backoff:
    """Delays that double from `first_s` up to `max_s`, for at most `wait_s` from now in all."""

    def __init__(self, wait_s: float, first_s: float = 0.5, max_s: float = 8.0) -> None:
        self.deadline = time.monotonic() + wait_s
        self.delay, self.max_s = first_s, max_s

    def next_delay(self) -> float | None:
        """How long to wait before the next try; None when that try would come after the deadline."""
        if time.monotonic() + self.delay > self.deadline:
            return None
        delay, self.delay = self.delay, min(self.delay * 2, self.max_s)
        return delay
