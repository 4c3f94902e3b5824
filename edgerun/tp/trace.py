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


class Event(Enum):
    # master
    SEND = "send"  # about to send the block's input
    SENT = "sent"  # every node's input is out
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


# A block's critical path, leg by leg: each from one event to the next, the nodes' legs at the node whose partial
# came last. "between blocks" is the master's work from one block's output to the next block's first send (the
# residual add and the norm, the bookkeeping of both blocks).
LEGS = (
    ("between blocks", "prev merged", Event.SEND),
    ("master sends", Event.SEND, Event.SENT),
    ("input to the node", Event.SEND, Event.RECEIVED),
    ("node picks it up", Event.RECEIVED, Event.HANDLED),
    ("node kernel", Event.HANDLED, Event.COMPUTED),
    # to the master's socket: on loopback the partial is there before the node's send returns (REPLIED)
    ("node's partial to the master", Event.COMPUTED, Event.ARRIVED),
    ("master merges", Event.ARRIVED, Event.MERGED),
    ("master's own share", Event.SENT, Event.OWN),
    ("block, send to merged", Event.SEND, Event.MERGED),
)


def breakdown(directory: Path, session: int | None = None) -> list[Leg]:
    """The legs of one-token blocks' critical paths over every trace file in `directory` (microseconds), of one
    session (None: the master's last): only blocks every event of which was recorded."""
    master: dict[BlockKey, dict[Event, float]] = {}
    arrivals: dict[BlockKey, dict[int, float]] = {}
    nodes: dict[tuple[str, BlockKey], dict[Event, float]] = {}
    index_of: dict[str, int] = {}  # node process -> its index, from its REPLIED events
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            key, event = tuple(r["k"]), Event(r["e"])
            if session is not None and key[0] != session:
                continue
            if r["p"] == "master":
                if event == Event.ARRIVED:
                    arrivals.setdefault(key, {})[r["n"]] = r["t"]
                else:
                    master.setdefault(key, {})[event] = r["t"]
            else:
                nodes.setdefault((r["p"], key), {})[event] = r["t"]
                if event == Event.REPLIED:
                    index_of[r["p"]] = r["n"]
    if session is None and master:  # the master's last session, and only it
        last = max(k[0] for k in master)
        return breakdown(directory, last)
    by_node: dict[tuple[int, BlockKey], dict[Event, float]] = {
        (index_of[p], key): events for (p, key), events in nodes.items() if p in index_of}
    ordered = sorted(master, key=lambda k: (k[0], k[1], k[3] == HEAD, k[2], k[3]))  # the head ends a step
    samples: dict[str, list[float]] = {name: [] for name, _, _ in LEGS}
    previous: dict[Event, float] | None = None
    previous_key: BlockKey = (-1, -1, -1, -1)
    for key in ordered:
        m = master[key]
        came = arrivals.get(key, {})
        if not came or any(e not in m for e in (Event.SEND, Event.SENT, Event.OWN, Event.MERGED)):
            previous, previous_key = m, key
            continue
        last = max(came, key=came.get)
        n = by_node.get((last, key))
        if n is None or len(n) < 4:
            previous, previous_key = m, key
            continue
        times = {**n, **m, Event.ARRIVED: came[last]}
        if previous is not None and previous_key[:2] == key[:2] and Event.MERGED in previous:
            times["prev merged"] = previous[Event.MERGED]  # the same step's block before
        for name, start, end in LEGS:
            if start in times and end in times:
                samples[name].append((times[end] - times[start]) * 1e6)
        previous, previous_key = m, key
    return [Leg(name, statistics.median(v), statistics.fmean(v)) for name, v in samples.items() if v]
