"""The deployment of a tensor-parallel plan: which units each device computes (through the unit order), and the
assignment each node is sent. Pure functions of the plan, the model and the config."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig
from edgerun.model.loader import Model
from edgerun.net.wire import Block, Transport
from edgerun.sap.predictor import PredictorSet
from edgerun.sched.tp_plan import TPPlan
from edgerun.tp.config import MAPPINGS, Mapping, MasterConfig, tcp_rto_min_ms
from edgerun.tp.messages import Assign, Priorities, Routes
from edgerun.tp.shard import ShardSpec, every_unit_spec


@dataclass(frozen=True)
class Assignment:
    """Dynamic mapping of one block at one position."""

    ranking: tuple[int, ...]  # units from the most to the least important (priority index -> unit)
    units: dict[str, tuple[int, ...]]  # device name -> the units it was handed


@dataclass(frozen=True)
class UnitOrder:
    """Per layer, the unit at each priority index (priority 0: the most important). The plan gives
    the most reliable devices the lowest priority indices (HALO Alg. 3)."""

    attn: tuple[tuple[int, ...], ...]
    mlp: tuple[tuple[int, ...], ...]

    @classmethod
    def index(cls, n_layers: int, attn_units: int, groups: int) -> UnitOrder:
        """Priority p is unit p: no knowledge of importance."""
        return cls((tuple(range(attn_units)),) * n_layers, (tuple(range(groups)),) * n_layers)


def unit_order_for(model: Model, sha256: str, mapping: str, predictors: PredictorSet | None,
                   group_size: int) -> UnitOrder:
    """The priority order of units: by index, or by the calibration's average importance."""
    c = model.config
    groups = -(-c.ffn // group_size)
    if mapping not in MAPPINGS:
        raise EdgerunError(f"unknown mapping {mapping!r} ({', '.join(MAPPINGS)})")
    if mapping == Mapping.INDEX:
        return UnitOrder.index(c.n_layers, c.n_kv_heads, groups)
    if predictors is None:
        raise EdgerunError(f"mapping {mapping} needs predictors: run `edgerun sap calibrate` and `edgerun sap train`")
    if predictors.model_sha256 != sha256:
        raise EdgerunError(f"the predictors were trained on another model ({predictors.model_sha256[:12]}, not "
                           f"{sha256[:12]}): calibrate and train on this one")
    if predictors.group_size != group_size:
        raise EdgerunError(f"the predictors rank groups of {predictors.group_size}, not {group_size}")
    if mapping == Mapping.DYNAMIC and max(groups, c.n_kv_heads) > 256:  # a ranking travels as one byte per unit
        raise EdgerunError(f"dynamic mapping ranks at most 256 units per block; groups of {group_size} make "
                           f"{groups}: choose a larger --group-size")
    return UnitOrder(predictors.static_order(Block.ATTN, c.n_layers, c.n_kv_heads),
                     predictors.static_order(Block.MLP, c.n_layers, groups))


def spec_for_device(plan: TPPlan, i: int, group_size: int, vocab_block: int, order: UnitOrder) -> ShardSpec:
    """Device i's units: its priority indices through the unit order."""
    def units(layers: tuple, orders: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sorted(o[p] for p in layer[i])) for layer, o in zip(layers, orders, strict=True))

    return ShardSpec(attn_units=units(plan.attn, order.attn), mlp_groups=units(plan.mlp, order.mlp),
                     vocab_blocks=tuple(sorted(plan.vocab[i])), group_size=group_size, vocab_block=vocab_block)


@functools.lru_cache(maxsize=256)
def vocab_rows(blocks: tuple[int, ...], block_rows: int, vocab: int) -> np.ndarray:
    """LM-head rows of the given vocabulary blocks, in block order (the order a shard returns them); read-only.
    Kept per share: the master sizes and places every node's head partial with them each token, and building
    them anew took ~0.1 ms per node (a 128k vocabulary in blocks of 256 rows)."""
    rows = np.concatenate([np.arange(b * block_rows, min((b + 1) * block_rows, vocab)) for b in blocks]
                          or [np.zeros(0, np.int64)])
    rows.flags.writeable = False
    return rows


def row_span(rows: np.ndarray) -> slice | np.ndarray:
    """Ascending `rows` as an index: a slice where they are consecutive, as a plan's vocabulary blocks are (Alg. 3
    hands each device a run of priority indices, which are the blocks themselves), so that placing a device's
    logits is one copy; scattering 16k rows through an index array took ~50 µs a device, a tenth of the LM head's
    merge at 8 devices."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def place_head_top(logits: np.ndarray, rows: np.ndarray, partial: np.ndarray) -> None:
    """A device's head_top partial into the whole vocabulary's logits, (vocab,) or a batch's (tokens, vocab): in
    each token's row its chosen rows get their logits, its other rows minus infinity (no draw of at most `top`
    candidates picks them)."""
    every = np.atleast_2d(logits)  # a view: the rows are written in place
    for row, part in zip(every, partial.reshape(every.shape[0], -1), strict=True):
        k = part.size // 2
        row[row_span(rows)] = -np.inf
        row[rows[part[k:].astype(np.int64)]] = part[:k]


@dataclass(frozen=True)
class NodeLink:
    """What a deployment needs to know of a node's link."""

    datagram_bytes: int  # path MTU's payload both ways
    lossy: bool  # it has lost a packet, or its measured loss rate is above zero


@dataclass(frozen=True)
class Deployment:
    """A plan made concrete: the master's own share, and the assignment each node (in plan order, from device 1)
    is sent."""

    plan: TPPlan
    routes: Routes
    own_spec: ShardSpec  # dynamic mapping: every unit, computing those at own_priorities
    own_priorities: Priorities | None
    assignments: tuple[Assign, ...]


def deploy(model: ModelConfig, plan: TPPlan, config: MasterConfig, order: UnitOrder, session: int, udp_port: int,
           links: Sequence[NodeLink]) -> Deployment:
    """The shares of `plan` (device 0 the master, device i the i-th of `links`) for a new session. Nodes on lossy
    links (or every node with parity_always) send and get parity fragments."""
    dynamic = config.mapping == Mapping.DYNAMIC

    def priorities(i: int) -> Priorities | None:
        return (tuple(layer[i] for layer in plan.attn), tuple(layer[i] for layer in plan.mlp)) if dynamic else None

    own = spec_for_device(plan, 0, config.group_size, config.vocab_block, order)
    if dynamic:  # every device holds every unit and computes those it is handed
        own = every_unit_spec(model, own)
    rto_min = tcp_rto_min_ms(config.transport, config.rto_min_ms)
    routes = Routes.for_transport(config.transport, model.n_layers)
    assignments = tuple(
        Assign(session, i, spec_for_device(plan, i, config.group_size, config.vocab_block, order), config.max_len,
               config.codec, routes, udp_port, rto_min,
               config.parity if config.parity_always or link.lossy else 0, link.datagram_bytes, priorities(i),
               config.activations, spare_stream=config.transport == Transport.UDP, slots=config.slots)
        for i, link in enumerate(links, start=1))
    return Deployment(plan, routes, own, priorities(0), assignments)


def holds(spec: ShardSpec, priorities: Priorities | None, layer: int, block: Block) -> bool:
    """Whether a device with this share computes any unit of the block."""
    if block == Block.HEAD:
        return bool(spec.vocab_blocks)
    if priorities is not None:
        return bool(priorities[0 if block == Block.ATTN else 1][layer])
    return bool((spec.attn_units if block == Block.ATTN else spec.mlp_groups)[layer])
