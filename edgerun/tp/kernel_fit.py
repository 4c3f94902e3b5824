"""A device's kernel time per block as a fixed cost plus its weight bytes over a speed, fitted from the one-token
blocks it ran.

A block's time is one onnxruntime run: a fixed cost (the run's own overhead, the graph's small nodes) and the
time to stream its weights. The planners price a block the same way (`Compute.session_overhead_ms` plus bytes
over `Compute.weight_bytes_per_s`), so a device's measured speed must leave the fixed cost out: the bytes of a
share over the time of its blocks counts it in, and a small share, dozens of short blocks a token, then looks
slow. Priced at that speed, the master computing the whole model as one graph (one fixed cost a token) looked
slower than splitting it, and the plans split a small model over nodes that made it slower (synthetic
SmolLM2 shape on the device machine: 28.4 ms/token predicted for four devices against 17.7 measured alone).

A share's attention and MLP blocks differ in size, so a least-squares line through their (bytes, seconds) gives
both: its slope is the inverse speed, its intercept the fixed cost. The LM head is left out: one large product,
it streams its bytes faster than the layers' blocks (20 GB/s against 12-16 on a half share of the 1B here), and
through it the line's slope is the head's and its intercept three times the fixed cost (168 µs against ~50-70
from the layers' blocks alone), which priced the whole model on the master 25% faster than it runs. The sums the
line needs travel in a node's heartbeat.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from edgerun.sched.profiles import Compute

MIN_MEASURED_S = 0.2  # a device's speed is measured from at least this much kernel time (hundreds of blocks)
# The blocks' sizes must spread at least this much (standard deviation over mean) for a line through them to
# say anything: blocks of one size give the speed and fixed cost together, not each.
MIN_SPREAD = 0.05


@dataclass(frozen=True)
class Measured:
    """A device's speed and fixed cost per block as measured; fixed_s None: the blocks could not tell it apart
    from the speed (the speed then leaves out the planner's default fixed cost, as it prices one)."""

    speed: float  # weight bytes per second
    fixed_s: float | None


@dataclass(frozen=True)
class KernelFit:
    """Sums over one-token blocks of a device's kernels: count, weight bytes, seconds, bytes squared and bytes
    times seconds."""

    blocks: int = 0
    bytes: float = 0.0
    seconds: float = 0.0
    bytes_sq: float = 0.0
    cross: float = 0.0

    def add(self, nbytes: float, seconds: float) -> KernelFit:
        return KernelFit(self.blocks + 1, self.bytes + nbytes, self.seconds + seconds,
                         self.bytes_sq + nbytes * nbytes, self.cross + nbytes * seconds)

    def plus(self, other: KernelFit) -> KernelFit:
        """These blocks and another run's together (the native server's, counted in C)."""
        return KernelFit(self.blocks + other.blocks, self.bytes + other.bytes, self.seconds + other.seconds,
                         self.bytes_sq + other.bytes_sq, self.cross + other.cross)

    def add_all(self, nbytes: Sequence[float], seconds: Sequence[float]) -> KernelFit:
        """Every block of a run at once (the native runner's step)."""
        return KernelFit(self.blocks + len(nbytes), self.bytes + sum(nbytes), self.seconds + sum(seconds),
                         self.bytes_sq + sum(b * b for b in nbytes),
                         self.cross + sum(b * t for b, t in zip(nbytes, seconds, strict=True)))

    def measured(self, default_fixed_s: float = Compute.session_overhead_ms / 1e3) -> Measured | None:
        """Speed and fixed cost once there is enough to say. Where the blocks are all of one size, or the line
        through them is not a cost (a slope of zero or less), `default_fixed_s` a block is taken out of the time
        (at most nine tenths of it) and the fixed cost left to the planner's default; a line that would give a
        negative fixed cost gives none and the plain ratio."""
        if self.seconds < MIN_MEASURED_S or self.bytes <= 0 or self.blocks < 2:
            return None
        n = self.blocks
        mean_x, mean_y = self.bytes / n, self.seconds / n
        var_x = self.bytes_sq / n - mean_x * mean_x
        slope = (self.cross / n - mean_x * mean_y) / var_x if var_x > 0 else 0.0
        if var_x < (MIN_SPREAD * mean_x) ** 2 or slope <= 0:
            variable = max(self.seconds - n * default_fixed_s, self.seconds / 10)
            return Measured(self.bytes / variable, None)
        fixed = mean_y - slope * mean_x
        if fixed < 0:
            return Measured(self.bytes / self.seconds, 0.0)
        return Measured(1 / slope, fixed)


# Nodes whose measurements agree this closely (relative to their median) are planned as one kind of device, at the
# mean of their measurements. Identical devices measure apart on a busy host (a warm-up's few hundred blocks,
# another process on the core for a while): eight processes of the 1B on the device machine measured 4.0-5.0 GB/s,
# fixed costs of 124-162 µs and synchronizations of 176-251 µs a block. Unpooled, the planner turned such
# differences into whole units: one such cluster's plan gave one node two attention units and another none, and MLP
# groups from 2 to 5 a device. Every attention block then waited for the node with two units (its prefill kernels
# took 301-355 ms against about 220 for the others), and the cluster decoded at 41.2 ms/token where even shares
# took 31.9 in the same call. A unit there is a quarter to an eighth of a device's share of a block, more than the
# differences pooled; devices that differ by more (a Raspberry Pi beside a Jetson) keep their own figures.
SAME_WITHIN = 0.25


def pooled(values: Mapping[str, float], within: float = SAME_WITHIN) -> dict[str, float]:
    """`values` with every one within `within` of their median (relative to it) replaced by the mean of those."""
    if len(values) < 2:
        return dict(values)
    median = statistics.median(values.values())
    close = [name for name, v in values.items() if abs(v - median) <= within * abs(median)]
    mean = statistics.fmean(values[name] for name in close) if close else 0.0
    return {name: mean if name in close else v for name, v in values.items()}


def pooled_measurements(measured: Mapping[str, Measured], within: float = SAME_WITHIN) -> dict[str, Measured]:
    """Devices' measurements with their speeds pooled, and their fixed costs among those that have one (`pooled`)."""
    speeds = pooled({name: m.speed for name, m in measured.items()}, within)
    fixed = pooled({name: m.fixed_s for name, m in measured.items() if m.fixed_s is not None}, within)
    return {name: Measured(speeds[name], fixed.get(name)) for name in measured}
