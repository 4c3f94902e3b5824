"""`edgerun node`: one device of a tensor-parallel cluster.

The node registers with the master over TCP, receives its share (a ShardSpec) and then, for every
block it holds a unit of, waits for the master's normalized input, computes its partial output and
sends it back: over UDP for the lossy layers, over TCP for the first layer and the LM head. Inputs
are processed strictly in order so the KV cache stays whole; an input that went missing is fetched
over TCP (its partial output then arrives too late to count, which the master tolerates).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.loader import Model, load_model
from edgerun.net.channel import AsyncChannel, Counters, EventLoopThread, LossyUdp, listen_datagrams
from edgerun.net.loss import LossModel
from edgerun.net.model_files import fetch_model, model_sha256
from edgerun.net.wire import PROBE_FLAG, Block, Codec, Header, MsgType, Reassembly, WireError, fragment, seal
from edgerun.tp.shard import Shard, ShardSpec

HEARTBEAT_S = 0.5
# An input with some fragments but not all after this long is fetched: the rest is not coming.
FETCH_AFTER_S = 0.05


def uses_reliable(transport: str, layer: int, block: Block, seq: int) -> bool:
    """TCP for the first layer and the LM head (HALO), for everything with --transport tcp, and for
    prefill: a partial lost there corrupts the KV cache of every prompt token for the rest of the
    request, and prefill is not on the per-token latency path that timeouts protect."""
    return transport == "tcp" or layer == 0 or block == Block.HEAD or seq > 1


def shard_spec_from_json(data: dict) -> ShardSpec:
    return ShardSpec(attn_units=tuple(tuple(x) for x in data["attn_units"]),
                     mlp_groups=tuple(tuple(x) for x in data["mlp_groups"]),
                     vocab_blocks=tuple(data["vocab_blocks"]), group_size=int(data["group_size"]),
                     vocab_block=int(data["vocab_block"]))


def block_sequence(spec: ShardSpec) -> Iterator[tuple[int, Block]]:
    """The blocks this device computes in one step, in the order the master sends them."""
    for layer in range(len(spec.attn_units)):
        if spec.attn_units[layer]:
            yield layer, Block.ATTN
        if spec.mlp_groups[layer]:
            yield layer, Block.MLP
    if spec.vocab_blocks:
        yield 0, Block.HEAD


@dataclass
class _Input:
    reassembly: Reassembly
    first_seen: float
    fetched: bool = False
    full: np.ndarray | None = None  # set when it came whole over TCP


class Node:
    def __init__(self, master: tuple[str, int], model: Model | None, key: bytes, name: str, budget_mb: float,
                 speed: float, loss: LossModel | None = None, log=print) -> None:
        self.master = master
        self.model = model
        self.key = key
        self.name = name
        self.budget_mb = budget_mb
        self.speed = speed
        self.log = log
        self.udp = LossyUdp(key, loss=loss)  # sends; datagrams arrive on the event loop's endpoint
        self.counters = Counters()
        self.cond = threading.Condition()
        self.inputs: dict[tuple[int, int, int, int], _Input] = {}
        self.latest_seen: tuple[int, int, int] = (-1, -1, -1)  # (position, layer, block) of any input of the session
        self.session = -1
        self.spec: ShardSpec | None = None
        self.shard: Shard | None = None
        self.index = 0  # this node's index in the master's plan
        self.codec = Codec.F32
        self.transport = "udp"
        self.running = True
        self.channel: AsyncChannel | None = None
        self.master_udp_port = 0
        # Network I/O on an event loop (uvloop where installed); compute in the worker thread.
        self.net = EventLoopThread()

    def run(self) -> None:
        welcome = self.net.run(self._join(), timeout=60)
        self.master_udp_port = int(welcome["udp_port"])
        heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeat(), self.net.loop)
        self._use_masters_model(str(welcome["model_sha256"]), int(welcome["http_port"]))
        threading.Thread(target=self._work, daemon=True).start()
        try:
            self.net.run(self._control_loop())
        except (ConnectionError, OSError, WireError) as e:
            self.log(f"node {self.name}: master connection ended ({e})")
        finally:
            self.running = False
            with self.cond:
                self.cond.notify_all()
            self.udp.close()
            heartbeat.cancel()
            self.net.stop()

    async def _join(self) -> dict:
        reader, writer = await asyncio.open_connection(*self.master)
        self.channel = AsyncChannel(reader, writer, self.key, self.net.loop)
        self.datagrams = await listen_datagrams("0.0.0.0", self.key, self.counters, self._on_datagram)
        self.channel.send({"op": "register", "name": self.name, "budget_mb": self.budget_mb, "speed": self.speed,
                           "udp_port": self.datagrams.get_extra_info("sockname")[1]})
        welcome, _ = await self.channel.receive()
        if welcome.get("op") != "welcome":
            raise WireError(f"expected welcome, got {welcome.get('op')}")
        return welcome

    async def _control_loop(self) -> None:
        while self.running:
            message, payload = await self.channel.receive()
            if message["op"] == "assign":  # loading a share takes a while: keep the loop (heartbeats) going
                await asyncio.get_running_loop().run_in_executor(None, self._control, message, payload)
            else:
                self._control(message, payload)

    def _use_masters_model(self, sha256: str, http_port: int) -> None:
        """Keep the local model if it is the master's file; otherwise fetch the master's copy."""
        if self.model is not None and model_sha256(self.model.path) == sha256:
            return
        self.log(f"node {self.name}: the local model is not the master's ({sha256[:12]}); fetching it")
        self.model = load_model(fetch_model(self.master[0], http_port, sha256))

    async def _heartbeat(self) -> None:
        while self.running:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                self.channel.send({"op": "heartbeat", "rejected": self.counters.total()})
            except (OSError, ConnectionError):
                return

    def _control(self, message: dict, payload: bytes) -> None:
        op = message["op"]
        if op == "assign":
            spec = shard_spec_from_json(message["spec"])
            shard = Shard(self.model.config, self.model.weights, spec, int(message["max_len"]))
            with self.cond:
                self.spec, self.shard = spec, shard
                self.index = int(message["index"])
                self.codec = Codec(message["codec"])
                self.transport = message["transport"]
                self.master_udp_port = int(message["udp_port"])
                self._new_session(int(message["session"]))
            self.channel.send({"op": "ready", "session": self.session, "weight_bytes": shard.weight_bytes})
        elif op == "reset":
            with self.cond:
                self._new_session(int(message["session"]))
        elif op == "input":
            header = Header(MsgType.ACTIVATION, int(message["session"]), int(message["position"]),
                            int(message["layer"]), int(message["block"]))
            vector = np.frombuffer(payload, "<f4").astype(np.float32)
            with self.cond:
                entry = self._entry(header, vector.size)
                if entry is not None:
                    entry.full = vector
                    self.cond.notify_all()
        elif op == "ping":
            self.channel.send({"op": "pong", "seq": message["seq"]})
        elif op == "bw":
            self.channel.send({"op": "bw_reply"}, bytes(min(int(message["reply_bytes"]), 64 << 20)))
        elif op == "shutdown":
            self.running = False

    def _new_session(self, session: int) -> None:
        self.session = session
        self.inputs.clear()
        self.latest_seen = (-1, -1, -1)
        if self.shard is not None:
            self.shard.truncate(0)
        self.cond.notify_all()

    def _entry(self, header: Header, total: int) -> _Input | None:
        """The input record for a header of the current session (created on first sight)."""
        if header.session != self.session:
            return None
        key = (header.session, header.position, header.layer, header.block)
        entry = self.inputs.get(key)
        if entry is None:
            entry = self.inputs[key] = _Input(Reassembly(total), time.monotonic())
        self.latest_seen = max(self.latest_seen, (header.position, header.layer, header.block))
        return entry

    def _on_datagram(self, header: Header, payload: bytes, _: tuple[str, int]) -> None:
        if header.type == MsgType.HEARTBEAT and header.flags == PROBE_FLAG:
            # A link probe from the master: echo it, through this side's loss like any datagram.
            self.udp.send_all([seal(header, payload, self.key)], (self.master[0], self.master_udp_port))
            return
        if header.type != MsgType.ACTIVATION or header.block not in (Block.ATTN, Block.MLP) or self.model is None:
            self.counters.reject("unexpected")
            return
        with self.cond:
            # Activations carry the step's token count in the flags byte.
            entry = self._entry(header, header.flags * self.model.config.hidden) if header.flags else None
            if entry is None:
                self.counters.reject("stale")
                return
            try:
                entry.reassembly.add(header, payload)
            except WireError:
                self.counters.reject("misfit")
                return
            self.cond.notify_all()

    def _work(self) -> None:
        while self.running:
            with self.cond:
                while self.running and self.shard is None:
                    self.cond.wait()
                session, spec = self.session, self.spec
            position = 0
            while self.running:
                steps = 0  # the step's token count, from its first block (the LM head sees only the last)
                for layer, block in block_sequence(spec):
                    x = self._wait_input(session, position, layer, block)
                    if x is None:
                        break
                    seq = self._compute_and_send(session, position, layer, block, x)
                    steps = steps or seq
                else:
                    position += steps
                    continue
                break  # a new session or shutdown: start over

    def _wait_input(self, session: int, position: int, layer: int, block: Block) -> np.ndarray | None:
        key = (session, position, layer, block)
        with self.cond:
            while self.running and self.session == session:
                entry = self.inputs.get(key)
                if entry is not None and entry.full is not None:
                    return entry.full
                if entry is not None and entry.reassembly.complete:
                    return entry.reassembly.vector
                moved_on = self.latest_seen > (position, layer, int(block))
                stalled = entry is not None and time.monotonic() - entry.first_seen > FETCH_AFTER_S
                if (moved_on or stalled) and not (entry and entry.fetched):
                    if entry is not None:
                        entry.fetched = True
                    else:
                        self.inputs[key] = _Input(Reassembly(1), time.monotonic(), fetched=True)
                    self.channel.send({"op": "fetch", "session": session, "position": position, "layer": layer,
                                       "block": int(block)})
                self.cond.wait(FETCH_AFTER_S)
        return None

    def _compute_and_send(self, session: int, position: int, layer: int, block: Block, x: np.ndarray) -> int:
        hidden = self.model.config.hidden
        x = x.reshape(-1, hidden)
        if block == Block.ATTN:
            out = self.shard.attention(layer, x, position)
        elif block == Block.MLP:
            out = self.shard.mlp(layer, x)
        else:
            _, out = self.shard.logits(x[-1:])
        message = {"op": "partial", "session": session, "position": position, "layer": layer, "block": int(block)}
        reliable = uses_reliable(self.transport, layer, block, x.shape[0])
        if reliable:
            self.channel.send(message, np.ascontiguousarray(out, "<f4").tobytes())
        else:
            header = Header(MsgType.PARTIAL, session, position, layer, block, self.index, codec=self.codec,
                            flags=x.shape[0])
            self.udp.send_all(fragment(header, out.reshape(-1), self.key), (self.master[0], self.master_udp_port))
        return x.shape[0]


def run_node(master: tuple[str, int], model_path: Path | None, key: bytes, name: str, budget_mb: float,
             speed: float, loss: LossModel | None) -> None:
    try:
        model = load_model(model_path)
    except EdgerunError as e:  # no usable local copy: the master's is fetched after joining
        print(f"{e}; will fetch the master's model", file=sys.stderr)
        model = None
    node = Node(master, model, key, name, budget_mb, speed, loss,
                log=lambda m: print(m, file=sys.stderr, flush=True))
    node.run()
