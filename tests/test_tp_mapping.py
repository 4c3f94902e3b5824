"""Unit mapping in the tensor-parallel engine: static (the calibration's most important units on the
most reliable devices) and dynamic (re-ranked by the predictors every token), on the shipped model
with node processes on loopback, checked against the single-process reference."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest

from edgerun.model.generate import ReferenceEngine, generate
from edgerun.model.loader import Model, load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.model_files import model_sha256
from edgerun.net.wire import Block, derive_key
from edgerun.sap.calibrate import Calibration, calibrate
from edgerun.sap.predictor import PredictorSet, train
from edgerun.sap.text import calibration_text
from edgerun.tp.config import MasterConfig
from edgerun.tp.master import Master

SECRET = "mapping-test"
PROMPT = "The capital of France is"
GREEDY = Sampler(SamplingParams())
N_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


@pytest.fixture(scope="module")
def calibration(model: Model) -> Calibration:
    return calibrate(model, model_sha256(model.path), calibration_text(), 256, tokens=1024)


@pytest.fixture(scope="module")
def predictors(calibration: Calibration) -> PredictorSet:
    """Predictors that read each block's own input (the default)."""
    return train(calibration, "linear", reads="same")[0]


@pytest.fixture(scope="module")
def ahead_predictors(calibration: Calibration) -> PredictorSet:
    """HALO's predictors, reading the attention input one layer ahead."""
    return train(calibration, "linear", reads="ahead")[0]


@pytest.fixture(scope="module")
def reference_tokens(model: Model) -> list[int]:
    return generate(ReferenceEngine(model, 256), model.tokenizer.encode(PROMPT), N_TOKENS, GREEDY).tokens


def cluster(model: Model, losses: list[str], predictors: PredictorSet | None = None,
            **settings: object) -> Iterator[Master]:
    """A master and one node per loss rate (in-process loss on the node's sends)."""
    # Every node takes a share; float32 activations, so the cluster gives the numpy reference's tokens exactly.
    settings = {"activations": Activations.F32, **settings}
    config = MasterConfig(strategy="minmax", host="127.0.0.1", max_len=256, **settings)
    master = Master(model, derive_key(SECRET), config, predictors=predictors)
    nodes = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{master.port}",
                               "--name", f"n{i}", "--key", SECRET, "--loss", loss, "--loss-seed", str(i),
                               "--threads", "1"], stderr=subprocess.DEVNULL)
             for i, loss in enumerate(losses)]
    try:
        master.wait_for_nodes(len(losses), timeout_s=120)
        master.replan()
        yield master
    finally:
        master.close()
        for p in nodes:
            p.kill()
            p.wait()


@pytest.mark.parametrize("mapping,reads", [("static", "same"), ("dynamic", "same"), ("dynamic", "ahead")])
def test_mapped_cluster_equals_the_reference(model: Model, predictors: PredictorSet, ahead_predictors: PredictorSet,
                                             reference_tokens: list[int], mapping: str, reads: str) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    chosen = predictors if reads == "same" else ahead_predictors
    for master in cluster(model, ["0", "0"], mapping=mapping, predictors=chosen, timeout_ms=2000):
        for transport in ("udp", "tcp"):
            master.reconfigure(replace(master.config, transport=transport))
            master.replan()
            assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens, (mapping, transport)
            assert master.stats.blocks_incomplete == 0
        if mapping == "dynamic":
            # Every unit handed to exactly one device, every block of every token.
            c = model.config
            for (_, _, layer, block), a in master.assignments.items():
                units = sorted(u for us in a.units.values() for u in us)
                count = c.n_kv_heads if block == Block.ATTN else -(-c.ffn // 256)
                assert units == list(range(count)) == sorted(a.ranking), (layer, block, a)


def test_dynamic_mapping_hands_the_most_reliable_node_the_highest_ranked_units(model: Model,
                                                                               predictors: PredictorSet) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    for master in cluster(model, ["0", "10%"], mapping="dynamic", predictors=predictors, timeout_ms=50):
        by_name = {n.name: n for n in master.nodes}
        assert by_name["n0"].link.loss_rate < by_name["n1"].link.loss_rate  # measured, not told
        master.generate(prompt, N_TOKENS, GREEDY)
        rankings: dict[tuple[int, int], set[tuple[int, ...]]] = {}
        checked = 0
        for (_, position, layer, block), a in master.assignments.items():
            rank = {u: i for i, u in enumerate(a.ranking)}
            reliable, lossy = a.units["n0"], a.units["n1"]
            if reliable and lossy:
                # Every unit of the reliable node ranks above every unit of the lossy one.
                assert max(rank[u] for u in reliable) < min(rank[u] for u in lossy), (position, layer, block, a)
                checked += 1
            if a.units["master"] and reliable:
                assert max(rank[u] for u in a.units["master"]) < min(rank[u] for u in reliable)
            rankings.setdefault((layer, block), set()).add(a.ranking)
        assert checked > N_TOKENS  # blocks where both nodes computed something, on every token
        # Re-ranked per token: most layers see more than one ranking over the generation.
        assert sum(len(r) > 1 for r in rankings.values()) > len(rankings) // 2, rankings


def test_mapping_without_predictors_is_refused(model: Model) -> None:
    from edgerun.errors import EdgerunError

    with pytest.raises(EdgerunError, match="needs predictors"):
        Master(model, derive_key(SECRET), MasterConfig(host="127.0.0.1", mapping="dynamic"))
    with pytest.raises(EdgerunError, match="unknown mapping"):
        Master(model, derive_key(SECRET), MasterConfig(host="127.0.0.1", mapping="sideways"))


def test_predictors_of_another_model_or_group_size_are_refused(model: Model, predictors: PredictorSet) -> None:
    from edgerun.errors import EdgerunError

    with pytest.raises(EdgerunError, match="rank groups of 256"):
        Master(model, derive_key(SECRET), MasterConfig(host="127.0.0.1", mapping="static", group_size=128),
               predictors=predictors)
    other = replace(predictors, model_sha256="0" * 64)
    with pytest.raises(EdgerunError, match="another model"):
        Master(model, derive_key(SECRET), MasterConfig(host="127.0.0.1", mapping="static"), predictors=other)
    fine = replace(predictors, group_size=4)  # 384 groups: more than a ranking's bytes can name
    with pytest.raises(EdgerunError, match="at most 256 units"):
        Master(model, derive_key(SECRET), MasterConfig(host="127.0.0.1", mapping="dynamic", group_size=4),
               predictors=fine)


@pytest.mark.parametrize("overlap,reads", [((), "ahead"), (("pred",), "ahead"), (("pred",), "same")])
def test_overlaps_keep_the_reference_tokens(model: Model, predictors: PredictorSet, ahead_predictors: PredictorSet,
                                            reference_tokens: list[int], overlap: tuple[str, ...], reads: str) -> None:
    """Dynamic mapping on quantized shares, with and without the pred overlap, with predictors that read one
    layer ahead or the block's own input: the reference's tokens, and every device holds every unit."""
    prompt = model.tokenizer.encode(PROMPT)
    chosen = predictors if reads == "same" else ahead_predictors
    for master in cluster(model, ["0", "0"], mapping="dynamic", predictors=chosen, timeout_ms=2000,
                          overlap=overlap):
        assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens
        assert master.stats.pred_s > 0
        layers = sum(master.shard.block_bytes(layer, block) for layer in range(model.config.n_layers)
                     for block in (Block.ATTN, Block.MLP))
        assert layers > 0 and all(r.weight_bytes >= layers for r in master.fresh_reports())  # every unit held
