"""A timeline of the one-token blocks of a tensor-parallel cluster on one host, to see where a synchronization's
time goes (`edgerun bench tp --trace DIR`).

The master and each node record, for every one-token block they take part in, the moments of its way through
them (`Event`) as perf_counter times, which on Linux are one clock (CLOCK_MONOTONIC) for every process of a
host: a node's times and the master's can be subtracted. Each process appends its events to its own file as
JSON lines, a batch at a time off the block's path (`flush`: the master between requests, a node with its
heartbeat). `breakdown` joins the files and splits a block's time into the legs of its critical path.

Recording costs one tuple append per event; a process without a trace records nothing.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

BlockKey = tuple[int, int, int, int]  # (session, position, layer, block)
HEAD = 2  # wire.Block.HEAD
# wire.Block's values as a report names them: a block's legs differ by kind (a 1B model's attention block streams a
# fifth of its MLP block's weights, and the LM head's partial is a top-k list), so a median over all of them
# together describes none of them.
BLOCK_KINDS = {0: "attention", 1: "MLP", HEAD: "LM head"}


class Event(Enum):
    # master
    SEND = "send"  # about to send the block's input
    SENT = "sent"  # every node's input is out and the block's bookkeeping done: the master's own share starts
    OWN = "own"  # the master's own share is computed
    ARRIVED = "arrived"  # a node's partial reached the master's socket (kernel time stamp), per node
    MERGED = "merged"  # the block's output is whole
    # node
    RECEIVED = "received"  # the input reached the node's socket (kernel time stamp)
    HANDLED = "handled"  # the node's handler took it
    COMPUTED = "computed"  # the node's kernel is done
    REPLIED = "replied"  # the node's partial is sent


class Trace:
    """Events of one process, appended to `path` (JSON lines) at each flush."""

    def __init__(self, path: Path, process: str) -> None:
        self.path, self.process = Path(path), process
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.events: list[tuple[Event, BlockKey, float, int]] = []

    def add(self, event: Event, key: BlockKey, at: float, node: int = -1) -> None:
        self.events.append((event, key, at, node))

    def flush(self) -> None:
        if not self.events:
            return
        events, self.events = self.events, []
        with self.path.open("a") as f:
            f.writelines(json.dumps({"p": self.process, "e": e.value, "k": list(k), "t": t, "n": n}) + "\n"
                         for e, k, t, n in events)


@dataclass(frozen=True)
class Leg:
    name: str
    median_us: float
    mean_us: float


# A block's legs. The master's: from the block before's output to this block's first send ("between blocks": the
# residual add, the norm, both blocks' bookkeeping), its sends, its own share, then whichever came last, its share
# or the last partial, the other's lead over it ("waiting on the nodes" or "the master's share beyond the nodes'"),
# and the merge from then to the block's output. The node's, at the node whose partial came last: its input's way
# there, its handler taking it, its kernel, its partial's way to the master's socket.
LEGS = ("between blocks", "master sends", "master's own share", "waiting on the nodes",
        "the master's share beyond the nodes'", "master merges", "block, send to merged",
        "input to the node", "node picks it up", "node kernel", "node's partial to the master")


def _legs(m: dict[Event, float], node: dict[Event, float], arrived: float, before: float | None) -> dict[str, float]:
    """One block's legs in seconds (see LEGS)."""
    last = max(m[Event.OWN], arrived)
    legs = {"master sends": m[Event.SENT] - m[Event.SEND], "master's own share": m[Event.OWN] - m[Event.SENT],
            "waiting on the nodes": max(0.0, arrived - m[Event.OWN]),
            "the master's share beyond the nodes'": max(0.0, m[Event.OWN] - arrived),
            "master merges": m[Event.MERGED] - last, "block, send to merged": m[Event.MERGED] - m[Event.SEND],
            "input to the node": node[Event.RECEIVED] - m[Event.SEND],
            "node picks it up": node[Event.HANDLED] - node[Event.RECEIVED],
            "node kernel": node[Event.COMPUTED] - node[Event.HANDLED],
            # to the master's socket: on loopback the partial is there before the node's send returns
            "node's partial to the master": arrived - node[Event.COMPUTED]}
    if before is not None:
        legs["between blocks"] = m[Event.SEND] - before
    return legs


def breakdown(directory: Path, session: int | None = None) -> dict[int | None, list[Leg]]:
    """The legs of one-token blocks' critical paths over every trace file in `directory` (microseconds), of one
    session (None: the master's last): of each kind of block (by wire.Block value; a kind with no block recorded is
    left out) and, under None, of every block together (there even when empty). Only blocks every event of which was
    recorded."""
    records = [json.loads(line) for path in sorted(Path(directory).glob("*.jsonl"))
               for line in path.read_text().splitlines()]
    if session is None:  # the master's last
        session = max((r["k"][0] for r in records if r["p"] == "master"), default=None)
    master: dict[BlockKey, dict[Event, float]] = {}
    arrivals: dict[BlockKey, dict[int, float]] = {}
    nodes: dict[tuple[str, BlockKey], dict[Event, float]] = {}
    index_of: dict[str, int] = {}  # node process -> its index, from its REPLIED events
    for r in records:
        key, event = tuple(r["k"]), Event(r["e"])
        if key[0] != session:
            continue
        if r["p"] == "master":
            if event == Event.ARRIVED:
                arrivals.setdefault(key, {})[r["n"]] = r["t"]
            else:
                master.setdefault(key, {})[event] = r["t"]
        else:  # a node's first sight of an input: a mirrored block's other copy comes later
            nodes.setdefault((r["p"], key), {}).setdefault(event, r["t"])
            if event == Event.REPLIED:
                index_of[r["p"]] = r["n"]
    by_node: dict[tuple[int, BlockKey], dict[Event, float]] = {
        (index_of[p], key): events for (p, key), events in nodes.items() if p in index_of}
    ordered = sorted(master, key=lambda k: (k[0], k[1], k[3] == HEAD, k[2], k[3]))  # the head ends a step
    samples: dict[int | None, dict[str, list[float]]] = {None: {name: [] for name in LEGS}}
    previous: dict[Event, float] | None = None
    previous_key: BlockKey = (-1, -1, -1, -1)
    for key in ordered:
        m, came = master[key], arrivals.get(key, {})
        before = previous.get(Event.MERGED) if previous is not None and previous_key[:2] == key[:2] else None
        previous, previous_key = m, key
        if not came or any(e not in m for e in (Event.SEND, Event.SENT, Event.OWN, Event.MERGED)):
            continue
        last = max(came, key=came.get)
        n = by_node.get((last, key), {})
        # Only an input the node took as a datagram and then computed: a mirrored block's TCP copy may have come
        # first, and its datagram was handled after the kernel.
        if not all(e in n for e in (Event.RECEIVED, Event.HANDLED, Event.COMPUTED)) or \
                not n[Event.RECEIVED] <= n[Event.HANDLED] <= n[Event.COMPUTED]:
            continue
        of_kind = samples.setdefault(key[3], {name: [] for name in LEGS})
        for name, value in _legs(m, n, came[last], before).items():
            samples[None][name].append(value * 1e6)
            of_kind[name].append(value * 1e6)
    return {kind: [Leg(name, statistics.median(v), statistics.fmean(v)) for name, v in legs.items() if v]
            for kind, legs in samples.items()}
