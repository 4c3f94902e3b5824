"""KernelFit: a device's measured speed and fixed cost per block, fitted from the one-token blocks it ran, and
how the master prices a device with them."""

from __future__ import annotations

import random

import pytest

from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, model_profile
from edgerun.sched.tp_plan import SyncModel, plan_tp
from edgerun.tp.kernel_fit import MIN_MEASURED_S, KernelFit, Measured
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
    from edgerun.sched.tp_plan import objective, plan_counts

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
        took = objective(plan_counts(plan), truth, profile, SyncModel.STAR)
        assert plan.time_per_token_s == pytest.approx(took, rel=0.03)
        ratio = devices(Measured(fit.bytes / fit.seconds, None))
        assert objective(plan_counts(plan), ratio, profile, SyncModel.STAR) > 1.15 * took
