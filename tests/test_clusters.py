"""The one way both `edgerun serve` and `edgerun master` start a cluster (serve.clusters: ClusterSettings ->
cluster_config -> build), and the one shape of the benchmarks' text tables (tables.text_table)."""

from __future__ import annotations

import pytest

from edgerun.errors import EdgerunError
from edgerun.model.onnx_graph import Activations
from edgerun.moe.hub import HubConfig
from edgerun.net.discovery import ClusterKind
from edgerun.net.wire import Transport
from edgerun.pp.config import PipelineConfig, Route
from edgerun.sched.plans import TPStrategy
from edgerun.sched.pp_plan import Pricing
from edgerun.serve.clusters import ClusterSettings, build, cluster_config
from edgerun.tables import Column, text_table
from edgerun.tp.config import MasterConfig


def settings(kind: ClusterKind, **more) -> ClusterSettings:
    return ClusterSettings(kind, "10.0.0.1", 7000, 512, Activations.INT8, threads=3, **more)


def test_each_kind_reads_its_part_of_the_settings() -> None:
    tp = cluster_config(settings(ClusterKind.TP, slots=4, strategy=TPStrategy.MINMAX, transport=Transport.TCP,
                                 spin_us=50.0, timeout_ms=250.0))
    assert isinstance(tp, MasterConfig)
    assert (tp.host, tp.port, tp.max_len, tp.threads, tp.slots, tp.strategy, tp.transport, tp.spin_us,
            tp.timeout_ms) == ("10.0.0.1", 7000, 512, 3, 4, TPStrategy.MINMAX, Transport.TCP, 50.0, 250.0)
    pp = cluster_config(settings(ClusterKind.PP, route=Route.STAR, prefix=(1, 2), replicas=2, slots=3))
    assert isinstance(pp, PipelineConfig)
    assert (pp.route, pp.prefix, pp.replicas, pp.slots, pp.activations) == (Route.STAR, (1, 2), 2, 3, Activations.INT8)
    # a batch: its pace is its slowest stage's, its products compute-bound, its plan for speed alone; one request
    # at a time waits for the stages' sum, each streaming its weights, and weighs the plan's start
    assert (pp.objective, pp.pricing, pp.init_cost) == ("max", Pricing.MACS, False)
    one = cluster_config(settings(ClusterKind.PP))
    assert (one.objective, one.pricing, one.init_cost) == ("sum", Pricing.BYTES, True)
    moe = cluster_config(settings(ClusterKind.MOE, replicas=3, hedge="auto"))
    assert isinstance(moe, HubConfig)
    assert (moe.replicas, moe.hedge, moe.adaptive_hedge, moe.slots, moe.threads) == (3, 3, True, 0, 3)
    assert cluster_config(settings(ClusterKind.MOE, replicas=2, hedge="2", slots=8)).slots == 8
    with pytest.raises(EdgerunError):
        cluster_config(settings(ClusterKind.MOE, replicas=1, hedge="2"))  # more copies than replicas
    with pytest.raises(TypeError, match="not a cluster's config"):
        build(None, b"k", settings(ClusterKind.TP), print)  # type: ignore[arg-type]


def test_a_text_table_aligns_every_column_to_its_widest_cell() -> None:
    columns = (Column("engine", lambda r: r[0], width=8, left=True), Column("tok/s", lambda r: r[1], ".1f"),
               Column("share", lambda r: r[2], ".0%"))
    assert text_table(columns, [("ggml", 12.34, 0.5), ("onnxruntime", 1234.56, 1.0)]) == [
        "engine       tok/s share",
        "ggml          12.3   50%",
        "onnxruntime 1234.6  100%"]
    assert text_table(columns, []) == ["engine   tok/s share"]
