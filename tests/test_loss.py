"""In-process loss models: determinism, long-run rates, burst lengths, and the command-line spec."""

from __future__ import annotations

import math

import pytest

from edgerun.net.loss import Bernoulli, GilbertElliott, LossModel, NoLoss, parse_loss

DRAWS = 200_000
SIGMAS = 5.0  # tolerance for empirical statistics; a false failure at 5 sigma has odds under 1e-6


def draws(model: LossModel, n: int = DRAWS) -> list[bool]:
    return [model.drop() for _ in range(n)]


def burst_lengths(drops: list[bool]) -> list[int]:
    """Lengths of the maximal runs of consecutive drops."""
    runs, run = [], 0
    for d in drops:
        if d:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    if run:
        runs.append(run)
    return runs


def test_no_loss_never_drops() -> None:
    assert not any(draws(NoLoss(), 1000))


@pytest.mark.parametrize("make", [lambda s: Bernoulli(0.1, seed=s), lambda s: GilbertElliott.for_rate(0.1, 4, seed=s),
                                  lambda s: GilbertElliott(0.2, 0.3, 0.05, 0.7, seed=s)])
def test_same_seed_same_pattern(make) -> None:
    a, b, c = draws(make(7), 5000), draws(make(7), 5000), draws(make(8), 5000)
    assert a == b
    assert a != c


@pytest.mark.parametrize("rate", [0.001, 0.05, 0.3, 0.9])
def test_bernoulli_rate(rate: float) -> None:
    lost = sum(draws(Bernoulli(rate, seed=1)))
    sigma = math.sqrt(DRAWS * rate * (1 - rate))  # binomial
    assert abs(lost - DRAWS * rate) <= SIGMAS * sigma


def test_bernoulli_extremes() -> None:
    assert not any(draws(Bernoulli(0.0, seed=1), 1000))
    assert all(draws(Bernoulli(1.0, seed=1), 1000))


def test_bernoulli_bursts_are_geometric() -> None:
    # Independent loss has mean run length 1 / (1 - rate); a sanity check that it is not bursty.
    rate = 0.2
    runs = burst_lengths(draws(Bernoulli(rate, seed=3)))
    mean, var = 1 / (1 - rate), rate / (1 - rate) ** 2
    assert abs(sum(runs) / len(runs) - mean) <= SIGMAS * math.sqrt(var / len(runs))


def ge_sigma_of_count(model: GilbertElliott, n: int) -> float:
    """Long-run standard deviation of the number of losses in n packets.

    A loss is a coin flip whose bias depends on the state of a two-state Markov chain. The chain's lag-k
    autocorrelation is lam**k with lam = 1 - p_gb - p_bg, so the losses at lag k >= 1 have covariance
    (loss_bad - loss_good)**2 * pi * (1 - pi) * lam**k; summing the lags adds twice that series to the
    binomial variance p * (1 - p). With loss_good 0 and loss_bad 1 this is p * (1 - p) * (1 + lam) / (1 - lam).
    """
    p, pi = model.stationary_loss, model.stationary_bad
    lam = 1 - model.p_good_to_bad - model.p_bad_to_good
    spread = (model.loss_bad - model.loss_good) ** 2 * pi * (1 - pi)
    return math.sqrt(n * (p * (1 - p) + 2 * spread * lam / (1 - lam)))


@pytest.mark.parametrize(("rate", "mean_burst"), [(0.01, 2.0), (0.05, 3.0), (0.05, 8.0), (0.2, 4.0), (0.5, 1.5)])
def test_gilbert_elliott_rate_and_bursts(rate: float, mean_burst: float) -> None:
    model = GilbertElliott.for_rate(rate, mean_burst, seed=11)
    assert model.stationary_loss == pytest.approx(rate)
    assert model.p_bad_to_good == pytest.approx(1 / mean_burst)
    drops = draws(model)
    assert abs(sum(drops) - DRAWS * rate) <= SIGMAS * ge_sigma_of_count(model, DRAWS)

    # Bursts are the bad-state sojourns: geometric with success probability p_bg.
    runs = burst_lengths(drops)
    q = model.p_bad_to_good
    sd_mean = math.sqrt((1 - q) / q**2 / len(runs))
    assert abs(sum(runs) / len(runs) - mean_burst) <= SIGMAS * sd_mean


def test_gilbert_elliott_is_burstier_than_bernoulli() -> None:
    ge = burst_lengths(draws(GilbertElliott.for_rate(0.05, 5, seed=2)))
    iid = burst_lengths(draws(Bernoulli(0.05, seed=2)))
    assert sum(ge) / len(ge) > 4
    assert sum(iid) / len(iid) < 1.2


def test_gilbert_elliott_general_stationary_loss() -> None:
    model = GilbertElliott(0.1, 0.4, loss_good=0.02, loss_bad=0.5, seed=5)
    bad = 0.1 / 0.5
    assert model.stationary_bad == pytest.approx(bad)
    assert model.stationary_loss == pytest.approx(0.8 * 0.02 + 0.2 * 0.5)
    assert abs(sum(draws(model)) - DRAWS * model.stationary_loss) <= SIGMAS * ge_sigma_of_count(model, DRAWS)


def test_gilbert_elliott_rate_zero_never_drops() -> None:
    assert not any(draws(GilbertElliott.for_rate(0.0, 3, seed=1), 1000))


@pytest.mark.parametrize(("rate", "burst"), [(-0.1, 3), (1.0, 3), (1.5, 3), (math.nan, 3), (0.05, 0.5),
                                             (0.05, 0), (0.05, math.inf), (0.05, math.nan), (0.8, 3)])
def test_for_rate_rejects(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        GilbertElliott.for_rate(rate, burst)


def test_for_rate_highest_reachable_rate() -> None:
    # With mean burst b the good state lasts at least one packet, so the rate is at most b / (b + 1).
    model = GilbertElliott.for_rate(0.75, 3.0)
    assert model.p_good_to_bad == pytest.approx(1.0)


@pytest.mark.parametrize("args", [(-0.1, 0.5), (1.1, 0.5), (0.1, 0.0), (0.1, 1.5), (0.1, math.nan),
                                  (0.1, 0.5, -0.1), (0.1, 0.5, 0.0, 1.1)])
def test_gilbert_elliott_rejects(args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        GilbertElliott(*args)


@pytest.mark.parametrize("rate", [-0.01, 1.01, math.nan, math.inf])
def test_bernoulli_rejects(rate: float) -> None:
    with pytest.raises(ValueError):
        Bernoulli(rate)


@pytest.mark.parametrize(("spec", "rate"), [("5%", 0.05), ("0.05", 0.05), (" 0.05 ", 0.05), ("bernoulli:0.05", 0.05),
                                            ("Bernoulli:12.5%", 0.125), ("1", 1.0), ("100%", 1.0)])
def test_parse_bernoulli(spec: str, rate: float) -> None:
    model = parse_loss(spec)
    assert isinstance(model, Bernoulli)
    assert model.rate == pytest.approx(rate)


@pytest.mark.parametrize("spec", ["0", "0%", "0.0"])
def test_parse_zero_is_no_loss(spec: str) -> None:
    assert isinstance(parse_loss(spec), NoLoss)


@pytest.mark.parametrize(("spec", "rate", "burst"), [("ge:0.05", 0.05, 3.0), ("ge:0.05:4", 0.05, 4.0),
                                                     ("GE:10%:2.5", 0.1, 2.5), ("ge: 0.05 : 4 ", 0.05, 4.0)])
def test_parse_gilbert_elliott(spec: str, rate: float, burst: float) -> None:
    model = parse_loss(spec)
    assert isinstance(model, GilbertElliott)
    assert model.stationary_loss == pytest.approx(rate)
    assert 1 / model.p_bad_to_good == pytest.approx(burst)
    assert (model.loss_good, model.loss_bad) == (0.0, 1.0)


def test_parse_passes_seed() -> None:
    for spec in ["5%", "ge:0.1:3"]:
        assert draws(parse_loss(spec, seed=4), 2000) == draws(parse_loss(spec, seed=4), 2000)


@pytest.mark.parametrize(("spec", "message"), [
    ("", "empty"),
    ("abc", "not a number"),
    ("5", "write a percentage"),
    ("-1%", "outside"),
    ("150%", "outside"),
    ("nan", "outside"),
    ("bernoulli", "not a number"),
    ("bernoulli:", "not a number"),
    ("bernoulli:0.1:3", "not understood"),
    ("ge:", "not a number"),
    ("ge:0.05:x", "mean burst"),
    ("ge:0.05:0.5", "at least 1"),
    ("ge:0.9:3", "unreachable"),
    ("ge:0.05:4:1", "not understood"),
    ("pareto:0.05", "not understood"),
])
def test_parse_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_loss(spec)
