"""KernelFit: a device's measured speed and fixed cost per block, fitted from the one-token blocks it ran, and
how the master prices a device with them."""

from __future__ import annotations

import random

import pytest

from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, model_profile
from edgerun.sched.tp_plan import SyncModel, plan_tp
from edgerun.tp.kernel_fit import MIN_MEASURED_S, SAME_WITHIN, KernelFit, Measured, pooled, pooled_measurements
from edgerun.tp.master import planned_compute

SPEED, FIXED = 2e9, 60e-6  # bytes per second, seconds a block


def blocks(sizes: list[int], repeats: int, noise: float = 0.0, seed: int = 0) -> KernelFit:
    """A share's one-token blocks, each taking FIXED plus its bytes at SPEED, with relative noise."""
    rng, fit = random.Random(seed), KernelFit()
    for _ in range(repeats):
        for size in sizes:
            fit = fit.add(size, (FIXED + size / SPEED) * (1 + rng.uniform(-noise, noise)))
    return fit


def test_blocks_of_several_sizes_give_the_speed_and_the_fixed_cost_apart() -> None:
    """A quarter share of a small model: attention and MLP blocks of 0.1 and 0.3 MB. Their ratio of bytes to time
    would say 1.4 GB/s (the fixed cost counted in); the line through them says 2 GB/s and 60 µs."""
    fit = blocks([100_000, 300_000], 1000, noise=0.05)
    assert fit.bytes / fit.seconds < 0.75 * SPEED
    m = fit.measured()
    assert m is not None and m.speed == pytest.approx(SPEED, rel=0.03) and m.fixed_s == pytest.approx(FIXED, rel=0.1)


def test_blocks_of_one_size_leave_the_fixed_cost_to_the_default() -> None:
    """One graph a token (the whole-model engine): one size, so the fixed cost cannot be told from the speed;
    the default fixed cost a block comes out of the time, and the planner prices the default."""
    fit = blocks([50_000_000], 100)
    m = fit.measured(default_fixed_s=FIXED)
    assert m == Measured(pytest.approx(SPEED), None)
    assert blocks([50_000_000], 100).measured(default_fixed_s=1.0).speed == pytest.approx(fit.bytes / fit.seconds * 10)


def test_nothing_is_measured_from_too_little_kernel_time() -> None:
    fit = blocks([200_000, 600_000], 10)
    assert fit.seconds < MIN_MEASURED_S and fit.measured() is None
    assert KernelFit().measured() is None


def test_a_line_below_zero_at_no_bytes_gives_the_plain_ratio() -> None:
    """Noise that tilts the line past the origin: no negative fixed cost, the bytes over the time instead."""
    fit = KernelFit()
    for _ in range(200):
        fit = fit.add(100_000, 0.0005).add(1_000_000, 0.0060)
    m = fit.measured()
    assert m == Measured(pytest.approx(fit.bytes / fit.seconds), 0.0)


def test_plans_priced_at_the_fitted_speed_and_fixed_cost_are_priced_as_the_blocks_take() -> None:
    """The shipped model over four devices whose blocks take FIXED plus their bytes at SPEED. Priced at the ratio
    of a quarter share's bytes to its time (its 61 fixed costs a token counted in) plus the default fixed cost,
    every plan looked a third slower than it is, the master alone most (on the device machine a split predicted at
    28.4 ms/token was taken over the master alone, which measured 17.7); priced at the fitted speed and fixed cost,
    the plans chosen are those the true costs choose, at their time, whether the synchronizations make splitting
    pay or not."""
    from edgerun.model.loader import load_model
    from edgerun.sched.tp_plan import objective

    model = load_model(None)
    profile = model_profile(model.name, model.config, model.weights, context=256)
    share = profile.total_tp_weight_bytes() / 4
    sizes = [int(share * f) for f in (0.004, 0.012)]  # an attention block, an MLP block
    speed = 5e9
    fit = KernelFit()
    rng = random.Random(0)
    for _ in range(3000):
        for size in sizes:
            fit = fit.add(size, (FIXED + size / speed) * (1 + rng.uniform(-0.05, 0.05)))
    fitted = fit.measured()
    assert fitted is not None and fitted.fixed_s == pytest.approx(FIXED, rel=0.1)
    assert planned_compute(1e9, 16e-6, fitted).session_overhead_ms == pytest.approx(FIXED * 1e3, rel=0.1)
    assert planned_compute(1e9, 16e-6, None) == Compute(0.0, 1e9, send_s_per_node=16e-6)
    for sync_ms, used in ((0.05, 4), (0.3, 1)):
        def devices(measured: Measured, sync_ms: float = sync_ms) -> list[DeviceProfile]:
            return [DeviceProfile(name=f"d{i}", kind="node", cores=1, compute=planned_compute(1e9, 16e-6, measured),
                                  memory=Memory(4000, 4000, 4000, 0.0),
                                  link=Link(0.0 if i == 0 else sync_ms, 10_000.0, 10_000.0, 0.0)) for i in range(4)]

        truth = devices(Measured(speed, FIXED))
        plan = plan_tp(profile, devices(fitted), "halo", sync=SyncModel.STAR)
        assert plan.devices_used == plan_tp(profile, truth, "halo", sync=SyncModel.STAR).devices_used == used
        took = objective(plan.counts(), truth, profile, SyncModel.STAR)
        assert plan.time_per_token_s == pytest.approx(took, rel=0.03)
        ratio = devices(Measured(fit.bytes / fit.seconds, None))
        assert objective(plan.counts(), ratio, profile, SyncModel.STAR) > 1.15 * took


def test_measurements_that_agree_within_their_noise_are_pooled() -> None:
    values = {"a": 100.0, "b": 110.0, "c": 92.0, "slow": 40.0}
    mean = pytest.approx(302 / 3)
    assert pooled(values, within=0.15) == {"a": mean, "b": mean, "c": mean, "slow": 40.0}
    assert pooled({"a": 1.0}) == {"a": 1.0} and pooled({}) == {}
    assert pooled({"a": 1.0, "b": 2.0}, within=0.1) == {"a": 1.0, "b": 2.0}  # the median 1.5: neither close
    measured = pooled_measurements({"a": Measured(4e9, 100e-6), "b": Measured(4.4e9, None), "c": Measured(1e9, 120e-6)},
                                   within=0.2)
    # Speeds: the median 4e9 pools a and b, not c; fixed costs: a's and c's agree within 20% of their median.
    assert measured == {"a": Measured(4.2e9, pytest.approx(110e-6)), "b": Measured(4.2e9, None),
                        "c": Measured(1e9, pytest.approx(110e-6))}


def test_identical_devices_that_measure_apart_get_even_shares_once_pooled() -> None:
    """Eight identical devices of the 1B shape, measured some 10-15% apart (the device machine measured 4.0-5.0 GB/s
    and 176-251 µs of synchronization on such a cluster). Unpooled, halo gives some plans a node with two attention
    units and one with none; pooled, every device holds one unit and four groups of each layer. A device twice as
    slow is not pooled and holds fewer."""
    from edgerun.model.synth import SHAPES, shape_only_weights

    config = SHAPES["1b"]
    profile = model_profile("llama-1b-Q4_0", config, shape_only_weights(config, "Q4_0"), context=256)
    rng = random.Random(0)

    def devices(speeds: dict[str, float], fixed: dict[str, float], syncs: dict[str, float]) -> list[DeviceProfile]:
        master = DeviceProfile(name="master", kind="node", cores=1, compute=Compute(0.0, 4.6e9, 0.15, 20e-6),
                               memory=Memory(4000, 4000, 4000, 0.0), link=Link(0.0, 1e9, 1e9, 0.0))
        return [master] + [DeviceProfile(name=n, kind="node", cores=1, compute=Compute(0.0, speeds[n], fixed[n] * 1e3),
                                         memory=Memory(4000, 4000, 4000, 0.0), link=Link(syncs[n] * 1e3, 1e9, 1e9, 0.0))
                           for n in speeds]

    names = [f"n{i}" for i in range(7)]
    uneven = 0
    for _ in range(5):
        speeds = {n: 4.5e9 * rng.uniform(0.88, 1.12) for n in names}
        fixed = {n: 145e-6 * rng.uniform(0.88, 1.12) for n in names}
        syncs = {n: 215e-6 * rng.uniform(0.85, 1.15) for n in names}
        raw = plan_tp(profile, devices(speeds, fixed, syncs), "halo", sync=SyncModel.STAR).counts()
        uneven += len(set(raw.attn)) > 1 or any(len(set(layer)) > 1 for layer in raw.attn)
        plan = plan_tp(profile, devices(pooled(speeds), pooled(fixed), pooled(syncs)), "halo", sync=SyncModel.STAR)
        counts = plan.counts()
        assert set(counts.attn) == {(1,) * 8} and set(counts.mlp) == {(4,) * 8}
    assert uneven  # what pooling is for: unpooled, some of those plans were not even
    speeds = {n: 4.5e9 for n in names} | {"n3": 2.2e9}
    counts = plan_tp(profile, devices(pooled(speeds), {n: 145e-6 for n in names}, {n: 215e-6 for n in names}),
                     "halo", sync=SyncModel.STAR).counts()
    assert sum(layer[4] for layer in counts.mlp) < sum(layer[1] for layer in counts.mlp)
    assert SAME_WITHIN < 0.5
