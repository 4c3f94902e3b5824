"""Deployment as a pure function: a plan becomes the master's share and one Assign per node, with routes,
parity and dynamic priorities as data."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgerun.model.loader import load_model
from edgerun.net.wire import Block, Codec
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, model_profile
from edgerun.sched.tp_plan import plan_tp
from edgerun.tp.config import MasterConfig
from edgerun.tp.deployment import NodeLink, UnitOrder, deploy, holds, row_span, vocab_rows
from edgerun.tp.messages import Route


def device(name: str) -> DeviceProfile:
    return DeviceProfile(name=name, kind="node", cores=1, compute=Compute(0.0, 1e9),
                         memory=Memory(4096.0, 4096.0, 4096.0, 0.0), link=Link(0.1, 10_000.0, 10_000.0, 0.0))


def test_deploy_hands_every_unit_out_once_with_routes_and_parity(tiny_spec, synth_gguf) -> None:
    model = load_model(synth_gguf(tiny_spec()))
    c = model.config
    config = MasterConfig(strategy="minmax", group_size=32, vocab_block=64, codec=Codec.Q8, max_len=128)
    profile = model_profile("tiny", c, model.weights, context=128, group_size=32, vocab_block=64)
    plan = plan_tp(profile, [device("master"), device("a"), device("b")], "minmax")
    order = UnitOrder.index(c.n_layers, c.n_kv_heads, -(-c.ffn // 32))
    d = deploy(c, plan, config, order, session=7, udp_port=4000,
               links=[NodeLink(1472, lossy=False), NodeLink(65507, lossy=True)])
    assert [a.index for a in d.assignments] == [1, 2]
    assert all(a.session == 7 and a.codec == Codec.Q8 and a.udp_port == 4000 and a.max_len == 128
               for a in d.assignments)
    assert [a.parity for a in d.assignments] == [0, config.parity]  # parity only on the lossy link
    assert [a.datagram_bytes for a in d.assignments] == [1472, 65507]
    assert d.assignments[0].routes == d.routes and d.routes.of(0, Block.ATTN, 1) == Route.MIRRORED
    # --transport udp: every node opens a spare stream for a prompt's second copies; the strict tcp baseline none.
    assert all(a.spare_stream for a in d.assignments)
    strict = deploy(c, plan, replace(config, transport="tcp"), order, session=8, udp_port=4000,
                    links=[NodeLink(1472, lossy=False), NodeLink(65507, lossy=True)])
    assert not any(a.spare_stream for a in strict.assignments)
    # Every unit of every block on exactly one device, the master included.
    specs = [d.own_spec, *(a.spec for a in d.assignments)]
    for layer in range(c.n_layers):
        assert sorted(u for s in specs for u in s.attn_units[layer]) == list(range(c.n_kv_heads))
        assert sorted(g for s in specs for g in s.mlp_groups[layer]) == list(range(-(-c.ffn // 32)))
    assert sorted(b for s in specs for b in s.vocab_blocks) == list(range(-(-c.vocab_size // 64)))
    assert all(holds(s, None, layer, Block.MLP) == bool(s.mlp_groups[layer]) for s in specs
               for layer in range(c.n_layers))
    # The same inputs give the same deployment (a pure function); tcp makes every route reliable.
    assert deploy(c, plan, config, order, 7, 4000, [NodeLink(1472, False), NodeLink(65507, True)]) == d
    tcp = deploy(c, plan, replace(config, transport="tcp", parity_always=True), order, 7, 4000,
                 [NodeLink(1472, False)] * 2)
    assert {tcp.routes.of(layer, b, 1) for layer in range(c.n_layers) for b in Block} == {Route.RELIABLE}
    assert [a.parity for a in tcp.assignments] == [config.parity] * 2


def test_dynamic_deployment_holds_every_unit_and_sends_priorities(tiny_spec, synth_gguf) -> None:
    model = load_model(synth_gguf(tiny_spec()))
    c = model.config
    config = MasterConfig(strategy="minmax", group_size=32, vocab_block=64, mapping="dynamic")
    profile = model_profile("tiny", c, model.weights, context=64, group_size=32, vocab_block=64)
    plan = plan_tp(profile, [device("master"), device("a")], "minmax")
    order = UnitOrder.index(c.n_layers, c.n_kv_heads, -(-c.ffn // 32))
    d = deploy(c, plan, config, order, 1, 4000, [NodeLink(1472, False)])
    (a,) = d.assignments
    assert d.own_spec.attn_units[0] == tuple(range(c.n_kv_heads))  # the master holds every unit
    assert a.priorities == (tuple(layer[1] for layer in plan.attn), tuple(layer[1] for layer in plan.mlp))
    assert d.own_priorities == (tuple(layer[0] for layer in plan.attn), tuple(layer[0] for layer in plan.mlp))


def test_vocab_rows_are_each_blocks_rows_in_order_kept_read_only() -> None:
    rows = vocab_rows((3, 0), 4, 14)
    assert rows.tolist() == [12, 13, 0, 1, 2, 3]  # block 3 is cut at the vocabulary's end
    assert vocab_rows((3, 0), 4, 14) is rows  # kept: the master places every head partial with them each token
    with pytest.raises(ValueError):
        rows[0] = 1
    assert vocab_rows((), 4, 14).size == 0
    assert np.array_equal(vocab_rows((1,), 4, 14), np.arange(4, 8))


def test_a_run_of_vocabulary_blocks_places_its_logits_as_one_slice(tiny_spec, synth_gguf) -> None:
    assert row_span(vocab_rows((2, 3), 4, 14)) == slice(8, 14)  # the last block cut short at the vocabulary's end
    gapped = vocab_rows((0, 2), 4, 14)
    assert row_span(gapped) is gapped  # not consecutive: the index array itself
    logits, part = np.zeros(14, np.float32), np.arange(1, 7, dtype=np.float32)
    for rows in (vocab_rows((2, 3), 4, 14), vocab_rows((1, 3), 4, 14)):
        by_span, by_index = logits.copy(), logits.copy()
        by_span[row_span(rows)], by_index[rows] = part, part
        assert np.array_equal(by_span, by_index)
    assert len(np.zeros(14)[row_span(vocab_rows((), 4, 14))]) == 0
    # Every device of a plan holds a run of blocks (Alg. 3), so the master's merge copies slices.
    model = load_model(synth_gguf(tiny_spec()))
    c = model.config
    profile = model_profile("tiny", c, model.weights, context=64, group_size=32, vocab_block=16)
    plan = plan_tp(profile, [device("a"), device("b"), device("c")], "even")
    assert sum(1 for blocks in plan.vocab if blocks) == 3
    assert all(isinstance(row_span(vocab_rows(tuple(sorted(blocks)), 16, c.vocab_size)), slice)
               for blocks in plan.vocab if blocks)
