"""Seeded packet-loss models applied in-process to outgoing datagrams.

Real networks lose packets in bursts, which hurts differently from independent loss at the same rate
(a burst can take every fragment of one vector), so both kinds are offered: independent (Bernoulli)
loss and the two-state Gilbert-Elliott channel. Each model owns its own random generator, so a seed
reproduces the exact same drop pattern regardless of what else draws random numbers.
"""

from __future__ import annotations

import math
import random
from typing import Protocol


class LossModel(Protocol):
    def drop(self) -> bool:
        """Decide for the next packet: True drops it."""
        ...


class NoLoss:
    """Delivers everything."""

    def drop(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NoLoss()"


def _check_unit(name: str, value: float) -> float:
    # `not a <= x <= b` also refuses NaN, which every comparison answers False.
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


class Bernoulli:
    """Each packet is dropped independently with probability `rate`."""

    def __init__(self, rate: float, seed: int | None = None) -> None:
        self.rate = _check_unit("loss rate", rate)
        self._rng = random.Random(seed)

    def drop(self) -> bool:
        # random() lies in [0, 1), so rate 0 never drops and rate 1 always does.
        return self._rng.random() < self.rate

    def __repr__(self) -> str:
        return f"Bernoulli(rate={self.rate})"


class GilbertElliott:
    """A two-state Markov channel: packets in the good state are lost with probability `loss_good`,
    in the bad state with `loss_bad`; after each packet the state flips with the given probabilities.

    With loss_good 0 and loss_bad 1, loss bursts are exactly the bad-state sojourns, whose lengths are
    geometric with mean 1 / p_bad_to_good packets.
    """

    def __init__(self, p_good_to_bad: float, p_bad_to_good: float, loss_good: float = 0.0, loss_bad: float = 1.0,
                 seed: int | None = None) -> None:
        self.p_good_to_bad = _check_unit("p_good_to_bad", p_good_to_bad)
        # Zero would make the bad state absorbing: no stationary loss rate, and a link that never recovers.
        if not 0.0 < p_bad_to_good <= 1.0:
            raise ValueError(f"p_bad_to_good must be in (0, 1], got {p_bad_to_good}")
        self.p_bad_to_good = float(p_bad_to_good)
        self.loss_good = _check_unit("loss_good", loss_good)
        self.loss_bad = _check_unit("loss_bad", loss_bad)
        self._rng = random.Random(seed)
        # Start in the stationary distribution so that even a short run sees the stationary loss rate
        # rather than a warm-up from the good state.
        self.bad = self._rng.random() < self.stationary_bad

    @classmethod
    def for_rate(cls, rate: float, mean_burst: float = 3.0, seed: int | None = None) -> GilbertElliott:
        """Losses at long-run `rate` in bursts of `mean_burst` packets on average (loss_good 0, loss_bad 1)."""
        rate = _check_unit("loss rate", rate)
        if not (math.isfinite(mean_burst) and mean_burst >= 1.0):
            raise ValueError(f"mean burst must be at least 1 packet, got {mean_burst}")
        p_bad_to_good = 1.0 / mean_burst
        if rate == 1.0:
            raise ValueError("a Gilbert-Elliott loss rate of 1 would need a bad state that is never left; "
                             "use Bernoulli(1.0)")
        # Stationary P(bad) = p_gb / (p_gb + p_bg) = rate, solved for p_gb.
        p_good_to_bad = rate * p_bad_to_good / (1.0 - rate)
        if p_good_to_bad > 1.0:
            # Every good-state sojourn lasts at least one packet, which caps the rate for a given burst length.
            raise ValueError(f"loss rate {rate} is unreachable with mean burst {mean_burst}: at most "
                             f"{mean_burst / (mean_burst + 1.0):.4g}")
        return cls(p_good_to_bad, p_bad_to_good, 0.0, 1.0, seed)

    @property
    def stationary_bad(self) -> float:
        """Long-run fraction of packets sent in the bad state."""
        return self.p_good_to_bad / (self.p_good_to_bad + self.p_bad_to_good)

    @property
    def stationary_loss(self) -> float:
        """Long-run fraction of packets dropped."""
        bad = self.stationary_bad
        return (1.0 - bad) * self.loss_good + bad * self.loss_bad

    def drop(self) -> bool:
        lost = self._rng.random() < (self.loss_bad if self.bad else self.loss_good)
        if self.bad:
            self.bad = self._rng.random() >= self.p_bad_to_good
        else:
            self.bad = self._rng.random() < self.p_good_to_bad
        return lost

    def __repr__(self) -> str:
        return (f"GilbertElliott(p_good_to_bad={self.p_good_to_bad:.6g}, p_bad_to_good={self.p_bad_to_good:.6g}, "
                f"loss_good={self.loss_good}, loss_bad={self.loss_bad})")


def _parse_rate(text: str, spec: str) -> float:
    text = text.strip()
    percent = text.endswith("%")
    try:
        value = float(text[:-1] if percent else text)
    except ValueError:
        raise ValueError(f"loss spec {spec!r}: {text!r} is not a number") from None
    if percent:
        value /= 100.0
    if not 0.0 <= value <= 1.0:
        hint = "; write a percentage with %, e.g. 5%" if not percent and 1.0 < value <= 100.0 else ""
        raise ValueError(f"loss spec {spec!r}: rate {text} is outside [0, 1]{hint}")
    return value


_SPEC_FORMS = "expected '0', '5%', '0.05', 'bernoulli:RATE' or 'ge:RATE[:MEAN_BURST]'"


def parse_loss(spec: str, seed: int | None = None) -> LossModel:
    """A loss model from a command-line spec: "0", "5%", "0.05", "bernoulli:0.05", "ge:0.05", "ge:0.05:4"
    (rate, mean burst in packets). A bare rate means independent loss; rate 0 means no loss."""
    parts = [p.strip() for p in spec.strip().split(":")]
    kind = parts[0].lower()
    if len(parts) == 1:
        if not kind:
            raise ValueError(f"empty loss spec; {_SPEC_FORMS}")
        rate = _parse_rate(parts[0], spec)
        return NoLoss() if rate == 0.0 else Bernoulli(rate, seed)
    if kind == "bernoulli" and len(parts) == 2:
        return Bernoulli(_parse_rate(parts[1], spec), seed)
    if kind == "ge" and len(parts) in (2, 3):
        rate = _parse_rate(parts[1], spec)
        if len(parts) == 2:
            return GilbertElliott.for_rate(rate, seed=seed)
        try:
            burst = float(parts[2])
        except ValueError:
            raise ValueError(f"loss spec {spec!r}: mean burst {parts[2]!r} is not a number") from None
        try:
            return GilbertElliott.for_rate(rate, burst, seed)
        except ValueError as e:
            raise ValueError(f"loss spec {spec!r}: {e}") from None
    raise ValueError(f"loss spec {spec!r} not understood; {_SPEC_FORMS}")
