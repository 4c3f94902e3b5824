"""MoEx's pure parts: expert placement by consistent hashing, the latency model of hedged dispatch (the MoEx paper
Eqs. 3, 8, 10-12, 18), and the MoEx frame, fuzzed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig
from edgerun.net.moex import (
    MOEX_HEADER,
    ExpertCancel,
    ExpertDispatch,
    ExpertHeartbeat,
    ExpertHello,
    ExpertResult,
    ExpertSet,
    ExpertStatus,
    HeldExpert,
    MoexDtype,
    SyncDone,
    WeightSync,
    moex_frame,
    open_moex_frame,
)
from edgerun.net.wire import WireError, WorkerKind, cluster_mac, derive_key
from edgerun.sched.moe import (
    ExpertWorker,
    LayerTimes,
    LogNormal,
    expected_expert_phase_ms,
    expert_phase_quantile_ms,
    place_experts,
    token_ms,
    worker_memory_bytes,
)

KEY = derive_key("moex")


def workers(n: int, budget: float = 1000.0) -> list[ExpertWorker]:
    return [ExpertWorker(f"w{i}", budget) for i in range(n)]


def test_every_expert_gets_distinct_replicas_within_every_budget() -> None:
    pool = [ExpertWorker("big", 2000), *workers(5, 500)]
    placement = place_experts(pool, n_layers=4, n_experts=16, replicas=2, expert_mb=10)
    assert len(placement.replicas) == 64
    assert all(len(set(names)) == 2 for names in placement.replicas.values())
    assert all(placement.held_mb[w.name] <= w.budget_mb for w in pool)
    # Weighted by memory: the worker with four times the budget holds more than any other.
    assert placement.held_mb["big"] == max(placement.held_mb.values())
    assert sum(placement.held_mb.values()) == pytest.approx(64 * 2 * 10)
    assert placement == place_experts(pool, 4, 16, 2, 10)  # deterministic: every hub computes the same


def test_a_join_or_a_leave_moves_few_experts() -> None:
    """Consistent hashing: adding a ninth worker moves about r*E*L/N replicas, not a reshuffle."""
    before = place_experts(workers(8), 8, 32, 2, 1.0)
    after = place_experts(workers(9), 8, 32, 2, 1.0)
    total = 8 * 32 * 2
    assert before.moved(after) < 2 * total / 9 and before.moved(after) > 0
    left = place_experts(workers(8)[1:], 8, 32, 2, 1.0)
    assert before.moved(left) <= len(before.experts_of("w0")) * 1.5  # mostly what w0 held


def test_placement_refuses_what_cannot_be_held() -> None:
    with pytest.raises(EdgerunError, match="need 2 workers"):
        place_experts(workers(1), 1, 4, 2, 1.0)
    with pytest.raises(EdgerunError, match="budgets hold"):
        place_experts(workers(2, 10), 2, 8, 2, 1.0)


def test_the_seeds_memory_formula() -> None:
    """Eq. 4 as the seed states it: 2 x 128 / 16 x 46 x 25M x 0.5 B = 9.2 GB."""
    assert worker_memory_bytes(2, 128, 16, 46, 25e6, 0.5) == pytest.approx(9.2e9)


def test_the_hedged_expert_phase_matches_its_own_integral_and_a_simulation() -> None:
    """Table 1's setting (k = 8, median 20 ms, sigma 0.5): integrating Eq. 18 gives 42.8 ms for h = 1, not the
    seed's 51.2 (DESIGN.md), and a Monte Carlo draw of the same model agrees at every h."""
    dist = LogNormal(20.0, 0.5)
    model = {h: expected_expert_phase_ms(dist, 8, h) for h in (1, 2, 3, 4)}
    assert model[1] == pytest.approx(42.7, abs=0.2)
    rng = np.random.default_rng(0)
    draws = np.exp(math.log(20.0) + 0.5 * rng.standard_normal((100_000, 8, 4)))
    for h, expected in model.items():
        assert draws[:, :, :h].min(axis=2).max(axis=1).mean() == pytest.approx(expected, rel=0.01)
    assert model[1] > model[2] > model[3] > model[4]
    # Quantiles invert Eq. 8: half of the draws lie below the median.
    assert np.median(draws[:, :, :2].min(axis=2).max(axis=1)) == pytest.approx(
        expert_phase_quantile_ms(dist, 8, 2, 0.5), rel=0.01)


def test_token_latency_adds_its_layers() -> None:
    times = LayerTimes(attn_ms=1.5, ffn_ms=0.7, net_ms=0.25)
    assert times.dispatch_ms() == pytest.approx(1.2)
    assert token_ms(48, times) == pytest.approx(48 * 2.7)


def test_latency_specs_parse_or_say_what_is_wrong() -> None:
    assert LogNormal.parse("lognormal:20:0.5") == LogNormal(20.0, 0.5)
    for bad in ("normal:20:0.5", "lognormal:x:1", "lognormal:-1:0.5", "lognormal:20"):
        with pytest.raises(EdgerunError, match="lognormal:MEDIAN_MS:SIGMA"):
            LogNormal.parse(bad)


def test_every_moex_message_round_trips() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    gates = np.array([0.25, 0.75], np.float32)
    dispatch = open_moex_frame(moex_frame(ExpertDispatch(7, 3, 11, x, gates), KEY), KEY)
    assert isinstance(dispatch, ExpertDispatch) and (dispatch.seq, dispatch.layer, dispatch.expert) == (7, 3, 11)
    assert np.array_equal(dispatch.x, x) and np.array_equal(dispatch.gates, gates)
    half = open_moex_frame(moex_frame(ExpertResult(8, 3, 11, x, MoexDtype.F16), KEY), KEY)
    assert isinstance(half, ExpertResult) and half.dtype == MoexDtype.F16 and np.array_equal(half.y, x)
    assert open_moex_frame(moex_frame(ExpertCancel(9), KEY), KEY) == ExpertCancel(9)
    for info in (ExpertHello("e0", 512.0, WorkerKind.BROWSER, "wasm"), ExpertStatus(3, 1, 2, 80.5),
                 SyncDone(True, 4, 0.25), SyncDone(False, error="no file")):
        beat = ExpertHeartbeat(1, info)
        assert open_moex_frame(moex_frame(beat, KEY), KEY) == beat
    config = ModelConfig("qwen2moe", 2, 16, 32, 4, 2, 4, 100, 1e4, 1e-6, 64, False, True, n_experts=4,
                         n_experts_used=2, expert_ffn=8)
    sync = WeightSync(2, ExpertSet(config, (HeldExpert(0, 1, "ab" * 32), HeldExpert(1, 3, "cd" * 32, "ef", "01"))))
    assert open_moex_frame(moex_frame(sync, KEY), KEY) == sync
    # A heartbeat or a sync whose object does not fit its type: refused like any frame that lies.
    for kind, text in ((4, b'{"name": 3}'), (4, b'{"ready": "yes"}'), (5, b'{"experts": []}'), (4, b"[]")):
        header = MOEX_HEADER.pack(b"MoEx", 1, kind, len(text), 1, 0, 0, 0, 0, 5, 0)
        with pytest.raises(WireError):
            open_moex_frame(header + text + cluster_mac(KEY, header + text), KEY)
    frame = moex_frame(ExpertDispatch(7, 3, 11, x, gates), KEY)
    assert frame[:4] == b"MoEx" and MOEX_HEADER.size == 28  # the seed's layout
    assert len(frame) == 28 + x.nbytes + gates.nbytes + 16


def test_nothing_malformed_gets_through_a_moex_frame() -> None:
    """Random bytes, truncations, bit flips (the MAC catches them) and frames with a valid MAC whose fields lie
    (the checks behind it catch those): each raises WireError, none crashes."""
    rng = np.random.default_rng(1)
    good = moex_frame(ExpertDispatch(1, 0, 2, np.ones((3, 8), np.float32), np.ones(3, np.float32)), KEY)
    cases = [rng.bytes(int(n)) for n in rng.integers(0, 200, 200)]
    cases += [good[:n] for n in range(0, len(good), 7)]
    cases += [bytes(b ^ (1 << int(rng.integers(8))) if i == j else b for i, b in enumerate(good))
              for j in rng.integers(0, len(good), 100)]

    def resealed(header: tuple, payload: bytes) -> bytes:
        body = MOEX_HEADER.pack(*header) + payload
        return body + cluster_mac(KEY, body)

    payload = good[28:-16]
    fields = list(MOEX_HEADER.unpack_from(good))
    for index, value in ((0, b"MoEy"), (1, 2), (2, 9), (3, 5), (7, 4), (8, 9), (9, 3), (9, 77), (10, 1), (7, 0)):
        lie = list(fields)
        lie[index] = value
        cases.append(resealed(tuple(lie), payload))
    json_lie = list(fields)
    json_lie[2], json_lie[3] = 4, 5
    cases += [resealed(tuple(json_lie), b"[1,2]"), resealed(tuple(json_lie), b"{{{{{")]
    for case in cases:
        with pytest.raises(WireError):
            open_moex_frame(case, KEY)
    with pytest.raises(WireError):
        open_moex_frame(good, derive_key("another cluster"))
