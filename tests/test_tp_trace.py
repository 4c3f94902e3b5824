"""tp.trace: the master's and the nodes' timelines of one-token blocks, and a block's critical path leg by leg."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgerun.tp.trace import Event, Trace, breakdown


def test_a_blocks_time_splits_into_the_legs_of_its_critical_path(tmp_path: Path) -> None:
    """Two nodes; node 1 answers last, so the nodes' legs are its, and 44 µs after the master's own share ended.
    Each step's second block starts 20 µs after the first merged ("between blocks"); the session before the last
    is left out."""
    master, n0, n1 = Trace(tmp_path / "master.jsonl", "master"), Trace(tmp_path / "n0.jsonl", "n0"), \
        Trace(tmp_path / "n1.jsonl", "n1")
    us = 1e-6
    for session in (1, 2):
        t = 100.0 * session
        for block in (0, 1):
            key = (session, 5, 3, block)
            master.add(Event.SEND, key, t)
            master.add(Event.SENT, key, t + 10 * us)
            master.add(Event.OWN, key, t + 110 * us)
            for node, trace, late in ((0, n0, 0), (1, n1, 30)):
                trace.add(Event.RECEIVED, key, t + 15 * us)
                trace.add(Event.HANDLED, key, t + 20 * us)
                trace.add(Event.COMPUTED, key, t + (120 + late) * us)
                trace.add(Event.REPLIED, key, t + (125 + late) * us, node)
                master.add(Event.ARRIVED, key, t + (124 + late) * us, node)
            master.add(Event.MERGED, key, t + 170 * us)
            t += 190 * us
    for trace in (master, n0, n1):
        trace.flush()
        assert not trace.events
    legs = {leg.name: leg for leg in breakdown(tmp_path)[None]}
    expected = {"between blocks": 20, "master sends": 10, "master's own share": 100, "waiting on the nodes": 44,
                "the master's share beyond the nodes'": 0, "master merges": 16, "block, send to merged": 170,
                "input to the node": 15, "node picks it up": 5, "node kernel": 130, "node's partial to the master": 4}
    assert set(legs) == set(expected)
    for name, value in expected.items():
        assert legs[name].median_us == pytest.approx(value) and legs[name].mean_us == pytest.approx(value), name
    assert len((tmp_path / "master.jsonl").read_text().splitlines()) == 2 * 2 * 6


def test_a_block_some_event_of_which_is_missing_or_out_of_order_is_left_out(tmp_path: Path) -> None:
    """A block with no node's events has nothing to split; a mirrored block whose TCP copy the node computed
    before its datagram was handled tells nothing of the datagram's way."""
    master, node = Trace(tmp_path / "master.jsonl", "master"), Trace(tmp_path / "n0.jsonl", "n0")
    for block, handled in ((0, None), (1, 1.0008)):
        key = (1, 0, 0, block)
        for event, at in ((Event.SEND, 1.0), (Event.SENT, 1.0001), (Event.OWN, 1.0004), (Event.MERGED, 1.001)):
            master.add(event, key, at)
        if handled is not None:
            master.add(Event.ARRIVED, key, 1.0006, 0)
            node.add(Event.COMPUTED, key, 1.0005)
            node.add(Event.REPLIED, key, 1.00055, 0)
            node.add(Event.RECEIVED, key, 1.0007)
            node.add(Event.HANDLED, key, handled)
    master.flush()
    node.flush()
    assert breakdown(tmp_path) == {None: []}


def test_the_legs_of_one_kind_of_block_come_from_its_blocks_alone(tmp_path: Path) -> None:
    """breakdown by kind: an attention block of 100 µs and an MLP block of 300 µs a step; each kind's legs are its
    own blocks' (the block before an MLP block is an attention block all the same: "between blocks" counts from
    it), and the legs of every kind together mix them."""
    master, node = Trace(tmp_path / "master.jsonl", "master"), Trace(tmp_path / "n0.jsonl", "n0")
    us = 1e-6
    for position in range(3):
        t = 10.0 + position
        for block, kernel in ((0, 100), (1, 300)):
            key = (1, position, 0, block)
            master.add(Event.SEND, key, t)
            master.add(Event.SENT, key, t + 10 * us)
            master.add(Event.OWN, key, t + (10 + kernel) * us)
            node.add(Event.RECEIVED, key, t + 15 * us)
            node.add(Event.HANDLED, key, t + 20 * us)
            node.add(Event.COMPUTED, key, t + (20 + kernel) * us)
            node.add(Event.REPLIED, key, t + (25 + kernel) * us, 0)
            master.add(Event.ARRIVED, key, t + (30 + kernel) * us, 0)
            master.add(Event.MERGED, key, t + (40 + kernel) * us)
            t += (50 + kernel) * us
    master.flush()
    node.flush()
    kinds = breakdown(tmp_path)
    attention = {leg.name: leg for leg in kinds[0]}
    mlp = {leg.name: leg for leg in kinds[1]}
    assert attention["node kernel"].median_us == pytest.approx(100)
    assert attention["block, send to merged"].median_us == pytest.approx(140)
    assert "between blocks" not in attention  # a step's first block has no block before it
    assert mlp["node kernel"].median_us == pytest.approx(300)
    assert mlp["between blocks"].median_us == pytest.approx(10)
    both = {leg.name: leg for leg in kinds[None]}
    assert both["node kernel"].mean_us == pytest.approx(200)
    assert 2 not in kinds  # no LM head traced
