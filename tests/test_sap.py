"""Semantic-aware predictors and `edgerun eval`: calibration, training, static unit mapping, and
what loss does to the output under each placement policy, on a synthetic model and the shipped one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgerun.cli import main
from edgerun.model.loader import Model, load_model
from edgerun.model.reference import ReferenceModel
from edgerun.net.wire import Block
from edgerun.sap.calibrate import Calibration, attention_units, calibrate
from edgerun.sap.evaluate import evaluate, lossy_devices
from edgerun.sap.predictor import PredictorSet, top_k_recall, train
from edgerun.sap.text import calibration_text, evaluation_text
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, model_profile
from edgerun.sched.tp_plan import plan_tp
from edgerun.tp.deployment import UnitOrder, spec_for_device

GROUP = 32  # the tiny shape's FFN of 512 in 16 groups


@pytest.fixture(scope="module")
def synthetic(tiny_spec, synth_gguf) -> Model:
    # Weights large enough that every layer matters to the output (at the default scale the
    # embedding dominates and loss changes nothing).
    return load_model(synth_gguf(tiny_spec(qtype="Q8_0", tied=False, std=0.08)))


@pytest.fixture(scope="module")
def synthetic_sap(synthetic: Model) -> tuple[Calibration, PredictorSet]:
    calibration = calibrate(synthetic, "synthetic", calibration_text(), GROUP, tokens=2048, chunk=128)
    predictors, _ = train(calibration, "linear")
    return calibration, predictors


def test_text_sources_are_offline_and_disjoint() -> None:
    calibration, evaluation = calibration_text(), evaluation_text()
    assert sum(map(len, calibration)) > 100_000 and sum(map(len, evaluation)) > 100_000
    assert not set(calibration) & set(evaluation)
    assert calibration == calibration_text()  # a fixed order: runs are repeatable


def test_attention_units_sum_the_heads_of_each_kv_head() -> None:
    parts = np.random.default_rng(0).standard_normal((6, 4, 8)).astype(np.float32)
    units = attention_units(parts, 2)
    assert units.shape == (2, 4, 8)
    np.testing.assert_allclose(units[0], parts[:3].sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(units[1], parts[3:].sum(axis=0), rtol=1e-6)


def test_calibration_records_every_layer_and_round_trips(synthetic: Model, tmp_path: Path) -> None:
    c = synthetic.config
    calibration = calibrate(synthetic, "abc", calibration_text(), GROUP, tokens=256, chunk=128)
    assert calibration.inputs.shape == (c.n_layers, 256, c.hidden)
    assert calibration.attn_norms.shape == (c.n_layers, 256, c.n_kv_heads)
    assert calibration.group_norms.shape == (c.n_layers, 256, c.ffn // GROUP)
    assert calibration.mlp_inputs.shape == calibration.inputs.shape
    assert not np.array_equal(calibration.mlp_inputs, calibration.inputs)
    assert (calibration.attn_norms > 0).all() and (calibration.group_norms > 0).all()
    # The norms are those of the units' contributions: their squares bound the block output's.
    calibration.save(tmp_path / "c.npz")
    again = Calibration.load(tmp_path / "c.npz")
    assert again.model_sha256 == "abc" and again.group_size == GROUP
    assert np.array_equal(again.inputs, calibration.inputs)
    assert np.array_equal(again.group_norms, calibration.group_norms)
    assert np.array_equal(again.mlp_inputs, calibration.mlp_inputs)


def test_calibration_without_mlp_inputs_trains_ahead_only(synthetic_sap, tmp_path: Path) -> None:
    """A calibration file from before MLP inputs were recorded still loads and trains HALO's predictors."""
    from edgerun.errors import EdgerunError

    calibration, _ = synthetic_sap
    old = replace(calibration, mlp_inputs=np.zeros((0, 0, 0), np.float16))
    np.savez(tmp_path / "old.npz", model_sha256=np.array(old.model_sha256), group_size=np.array(old.group_size),
             inputs=old.inputs, attn_norms=old.attn_norms, group_norms=old.group_norms)
    loaded = Calibration.load(tmp_path / "old.npz")
    assert loaded.mlp_inputs.size == 0
    with pytest.raises(EdgerunError, match="no MLP inputs"):
        train(loaded, "linear", reads="same")
    assert train(loaded, "linear", reads="ahead")[0].ahead


def test_calibration_refuses_too_little_text(synthetic: Model) -> None:
    from edgerun.errors import EdgerunError

    with pytest.raises(EdgerunError, match="shorter than one chunk"):
        calibrate(synthetic, "x", ["tiny"], GROUP, tokens=256, chunk=128)
    with pytest.raises(EdgerunError, match="at least one chunk"):
        calibrate(synthetic, "x", calibration_text(), GROUP, tokens=64, chunk=128)


def test_top_k_recall() -> None:
    true = np.array([[5.0, 4.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    assert top_k_recall(true, true, 2) == 1.0
    assert top_k_recall(-true, true, 2) == 0.0
    assert top_k_recall(np.array([[5.0, 0.0, 4.0, 1.0], [3.0, 2.0, 1.0, 0.0]]), true, 2) == 0.25


@pytest.mark.parametrize("reads", ["same", "ahead"])
def test_predictors_rank_groups_above_chance_and_round_trip(synthetic: Model, synthetic_sap, tmp_path: Path,
                                                            reads: str) -> None:
    calibration, _ = synthetic_sap
    predictors, qualities = train(calibration, "linear", reads=reads)
    assert predictors.reads == reads
    mlp = [q for q in qualities if q.block == "mlp"]
    assert len(mlp) == synthetic.config.n_layers - 1  # layer 0 travels reliably: no predictor
    chance = mlp[0].k / mlp[0].units
    assert np.mean([q.recall for q in mlp]) > chance + 0.15, (mlp, chance)
    predictors.save(tmp_path / "p.npz")
    loaded = PredictorSet.load(tmp_path / "p.npz")
    assert loaded.reads == reads
    x = calibration.inputs[0][:10]
    for block in (Block.ATTN, Block.MLP):
        assert np.array_equal(loaded.predict(1, block, x), predictors.predict(1, block, x))
    assert loaded.cost_per_token_s() > 0


def test_mlp_predictors_train(synthetic_sap) -> None:
    calibration, _ = synthetic_sap
    predictors, qualities = train(calibration, "mlp", width=64)
    assert predictors.kind == "mlp" and predictors.mlp[1].w1.shape == (calibration.inputs.shape[2], 64)
    assert all(0.0 <= q.recall <= 1.0 for q in qualities)


def test_eval_without_loss_is_the_lossless_model(synthetic: Model, synthetic_sap) -> None:
    _, predictors = synthetic_sap
    results = evaluate(synthetic, evaluation_text(), [0.0], [0.75], ["random", "sap"], predictors, GROUP,
                       tokens=128, chunk=128, prompt_tokens=16, continuation=4)
    for r in results:
        assert r.perplexity == pytest.approx(r.lossless_perplexity, rel=1e-5)
        assert r.top1_agreement == 1.0 and r.exact_match == 1.0 and r.units_lost == 0.0
        assert abs(r.kl) < 1e-5


@pytest.mark.parametrize("reads", ["same", "ahead"])
def test_eval_orders_policies_on_a_synthetic_model(synthetic: Model, synthetic_sap, reads: str) -> None:
    calibration, predictors = synthetic_sap
    if reads == "ahead":
        predictors = train(calibration, "linear", reads="ahead")[0]
    policies = ["random", "sap", "oracle", "high-norm"]
    results = evaluate(synthetic, evaluation_text(), [0.2], [0.75], policies, predictors, GROUP, tokens=512,
                       chunk=128, prompt_tokens=16, continuation=4)
    by = {r.policy: r for r in results}
    # The same loss events for every policy: only placement differs.
    assert len({r.units_lost for r in results}) == 1 and results[0].units_lost > 0.1
    assert by["oracle"].kl < by["sap"].kl < by["random"].kl < by["high-norm"].kl, {p: by[p].kl for p in by}
    again = evaluate(synthetic, evaluation_text(), [0.2], [0.75], ["sap"], predictors, GROUP, tokens=512,
                     chunk=128, prompt_tokens=16, continuation=4)
    assert again[0] == by["sap"]  # deterministic


def test_eval_parity_copies_lose_fewer_units(synthetic: Model) -> None:
    """With two parity copies a device loses a block only when its packet and both copies are lost:
    PLR cubed. The share of units lost follows (NGLR 0.75 puts three quarters of them at risk)."""
    shares = {}
    for parity in (0, 2):
        (r,) = evaluate(synthetic, evaluation_text(), [0.5], [0.75], ["random"], None, GROUP, tokens=256,
                        chunk=128, prompt_tokens=16, continuation=4, parity=parity)
        assert r.parity == parity
        shares[parity] = r.units_lost
    assert shares[0] == pytest.approx(0.75 * 0.5, abs=0.05)
    assert shares[2] == pytest.approx(0.75 * 0.125, abs=0.03)


def test_lossy_devices_follow_nglr() -> None:
    assert [lossy_devices(x) for x in (0.25, 0.5, 0.75, 0.875)] == [1, 1, 3, 7]


def test_static_mapping_gives_the_most_reliable_device_the_most_important_units(synthetic: Model,
                                                                                synthetic_sap) -> None:
    _, predictors = synthetic_sap
    c = synthetic.config
    groups = c.ffn // GROUP
    order = UnitOrder(predictors.static_order(Block.ATTN, c.n_layers, c.n_kv_heads),
                      predictors.static_order(Block.MLP, c.n_layers, groups))
    assert order.mlp[0] == tuple(range(groups))  # layer 0 has no predictor
    for layer in range(1, c.n_layers):
        means = predictors.mlp[layer].mean_norm
        assert list(means[list(order.mlp[layer])]) == sorted(means, reverse=True)

    profile = model_profile("m", c, synthetic.weights, group_size=GROUP)
    devices = [DeviceProfile(name=f"d{i}", kind="node", cores=1, compute=Compute(0.0, 1e9),
                             memory=Memory(1e4, 1e4, 1e4, 0.0), link=Link(0.1, 1e3, 1e3, loss))
               for i, loss in enumerate([0.05, 0.0, 0.02])]
    plan = plan_tp(profile, devices, "minmax")  # both devices take units (halo may leave one out: a tiny model)
    reliable = spec_for_device(plan, 1, GROUP, 4096, order)
    lossiest = spec_for_device(plan, 0, GROUP, 4096, order)
    for layer in range(1, c.n_layers):
        ranked = order.mlp[layer]
        assert ranked[0] in reliable.mlp_groups[layer]  # the calibration's most important group
        assert ranked[-1] in lossiest.mlp_groups[layer]  # and its least important one


def test_cli_sap_and_eval_end_to_end(synthetic: Model, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = str(synthetic.path)
    calib, sap = tmp_path / "m.calib.npz", tmp_path / "m.sap.npz"
    assert main(["sap", "calibrate", "--model", model, "--tokens", "512", "--chunk", "128", "--group-size",
                 str(GROUP), "--out", str(calib), "--threads", "1"]) == 0
    assert main(["sap", "train", "--model", model, "--calibration", str(calib), "--out", str(sap),
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "recall" in out and str(sap) in out and "reading the block input" in out
    assert main(["sap", "train", "--model", model, "--calibration", str(calib), "--out", str(tmp_path / "a.npz"),
                 "--reads", "ahead", "--threads", "1"]) == 0
    assert "reading one layer ahead" in capsys.readouterr().out
    assert PredictorSet.load(tmp_path / "a.npz").ahead
    assert main(["eval", "--model", model, "--sap", str(sap), "--plr", "10%", "--nglr", "0.5", "--tokens", "128",
                 "--chunk", "128", "--policy", "random,sap", "--json", "--threads", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["random", "sap"] and rows[0]["plr"] == 0.1


def test_cli_refuses_bad_input(synthetic: Model, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = str(synthetic.path)
    assert main(["eval", "--model", model, "--plr", "5", "--policy", "random"]) == 2
    assert "not a share" in capsys.readouterr().err
    assert main(["eval", "--model", model, "--policy", "clairvoyant"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["eval", "--model", model, "--policy", "sap", "--sap", str(tmp_path / "none.npz")]) == 2
    assert "no predictors" in capsys.readouterr().err
    assert main(["sap", "train", "--model", model, "--calibration", str(tmp_path / "none.npz")]) == 2
    assert "sap calibrate" in capsys.readouterr().err
    (tmp_path / "junk.npz").write_bytes(b"not numpy")
    assert main(["eval", "--model", model, "--policy", "sap", "--sap", str(tmp_path / "junk.npz")]) == 2
    assert "not a predictor file" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_model_predictors_and_policies() -> None:
    model = load_model()
    calibration = calibrate(model, "shipped", calibration_text(), 256, tokens=1024)
    predictors, qualities = train(calibration, "linear")
    for block in ("attention", "mlp"):
        q = [x for x in qualities if x.block == block]
        chance = q[0].k / q[0].units
        assert np.mean([x.recall for x in q]) > chance + 0.15, (block, np.mean([x.recall for x in q]), chance)
    results = evaluate(model, evaluation_text(), [0.05], [0.75], ["random", "sap", "oracle"], predictors, 256,
                       tokens=512)
    by = {r.policy: r.perplexity for r in results}
    print({p: f"{r.perplexity_increase:.1%}" for p, r in zip(by, results, strict=True)})
    assert by["oracle"] < by["sap"] < by["random"], by
    assert by["sap"] - by["oracle"] < by["random"] - by["sap"], by  # sap lies closer to oracle


def test_reference_hooks_may_replace_a_block_output(synthetic: Model) -> None:
    """The loss injector relies on it: a hook's return value becomes the block output."""
    from edgerun.model.reference import BlockHooks

    class ZeroLayerOneMlp(BlockHooks):
        wants_partials = True

        def group_outputs(self, layer: int, parts: np.ndarray) -> np.ndarray | None:
            return np.zeros(parts.shape[1:], np.float32) if layer == 1 else None

    reference = ReferenceModel(synthetic.config, synthetic.weights, GROUP)
    tokens = [1, 2, 3, 4]
    plain = reference.forward(tokens, reference.new_cache(8))
    assert np.array_equal(plain, reference.forward(tokens, reference.new_cache(8), BlockHooks()))
    assert not np.allclose(plain, reference.forward(tokens, reference.new_cache(8), ZeroLayerOneMlp()))
