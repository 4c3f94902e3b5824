"""`edgerun eval`: what packet loss does to the model's output, with deterministic loss injected at
the level of the units the tensor-parallel engine would lose.

The model of a lossy cluster (HALO §V-B, Fig. 7): in every block of layers 1 and up, a share NGLR of
the units (attention units, each a KV head with its query heads, and MLP neuron groups) sits on
lossy devices, split evenly over
D = max(1, round(NGLR / (1 − NGLR))) of them (NGLR 0.75: 3 lossy devices and a reliable master);
each lossy device loses its whole contribution to a block when the packet carrying it is lost, with
probability PLR, as in HALO. With `parity` fragments (the engine sends 2 by default), which for a one-packet
partial are copies of it, it is lost only when it and every copy are: PLR^(1 + parity). Layer 0 and the LM head
travel over TCP and are never lost. The policy decides which units go to the lossy devices:

- none: the plan's index order, no importance (units with the highest indices are lossy);
- random: a fresh random choice per token;
- sap: the predictors' lowest-ranked units, from what they read (the attention input one layer ahead,
  or the block's own input);
- oracle: the units whose output norm is truly lowest (known only after computing: a bound);
- high-norm: the truly highest-norm units (HALO Table II's worst case).

Every policy sees the same loss events (which device loses which block at which position), so
their differences come from placement alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.loader import Model
from edgerun.model.reference import BlockHooks, ReferenceModel
from edgerun.net.wire import Block
from edgerun.sap.calibrate import attention_units, token_chunks
from edgerun.sap.predictor import PredictorSet
from edgerun.tables import Column, text_table

# "experts", for a mixture of experts: a share NGLR of each layer's experts sits on workers that miss the expert
# deadline with chance PLR per dispatch; a missed expert is left out of its token's mixture, the others' gates
# scaled to the full sum (what `edgerun master --plan moe --expert-deadline-ms` does).
POLICIES = ("none", "random", "sap", "oracle", "high-norm", "experts")


def lossy_devices(nglr: float) -> int:
    """How many lossy devices, beside one reliable device (the master) and with even shares, put the neuron-group
    loss rate `nglr` (HALO's NGLR: the share of a block's neuron groups on lossy devices) on the cluster."""
    return max(1, round(nglr / (1.0 - nglr))) if nglr < 1.0 else 1


class LossInjector(BlockHooks):
    """Drops the units of lost devices from every block output of one sequence. Set `start` to the
    first position of each forward call."""

    wants_partials = True

    def __init__(self, policy: str, plr: float, nglr: float, predictors: PredictorSet | None, seed: int,
                 sequence: int, max_len: int, n_kv_heads: int, parity: int = 0, n_experts: int = 0) -> None:
        if policy not in POLICIES:
            raise EdgerunError(f"unknown policy {policy!r} ({', '.join(POLICIES)})")
        if policy == "experts" and not n_experts:
            raise EdgerunError("policy experts needs a mixture-of-experts model")
        if policy == "sap" and predictors is None:
            raise EdgerunError("policy sap needs predictors: run `edgerun sap calibrate` and `edgerun sap train`")
        if not 0.0 <= plr <= 1.0 or not 0.0 <= nglr <= 1.0:
            raise EdgerunError(f"PLR and NGLR are shares in [0, 1], not {plr} and {nglr}")
        if parity < 0:
            raise EdgerunError(f"parity copies must not be negative, not {parity}")
        self.policy, self.plr, self.nglr, self.predictors = policy, plr, nglr, predictors
        self.block_loss = plr ** (1 + parity)  # a device's partial and all its parity copies lost
        self.seed, self.sequence, self.max_len = seed, sequence, max_len
        self.devices = lossy_devices(nglr)
        self.n_kv_heads, self.n_experts = n_kv_heads, n_experts
        self.start = 0
        self.previous_input: np.ndarray | None = None  # attention input of the layer before
        self.current_input: np.ndarray | None = None
        self.current_mlp_input: np.ndarray | None = None
        self.lost_units = 0
        self.units_seen = 0

    def _rng(self, layer: int, block: Block, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.sequence, layer, int(block), stream])

    def attention_input(self, layer: int, x_norm: np.ndarray) -> None:
        self.previous_input, self.current_input = self.current_input, x_norm

    def mlp_input(self, layer: int, x_norm: np.ndarray) -> None:
        self.current_mlp_input = x_norm

    def head_outputs(self, layer: int, parts: np.ndarray) -> np.ndarray | None:
        if self.policy == "experts":
            return None
        return self._drop(layer, Block.ATTN, attention_units(parts, self.n_kv_heads))

    def expert_kept(self, layer: int, chosen: np.ndarray) -> np.ndarray | None:
        if self.policy != "experts" or self.plr == 0.0 or self.nglr == 0.0:
            return None
        # Which experts sit on the lossy workers: the same in every sequence (a placement), drawn per layer.
        placement = np.random.default_rng([self.seed, layer]).permutation(self.n_experts)
        lossy = placement[:round(self.nglr * self.n_experts)]
        seq = chosen.shape[0]
        late = self._rng(layer, Block.MLP, 2).random((self.max_len, self.n_experts)) < self.plr
        dropped = np.isin(chosen, lossy) & late[self.start:self.start + seq][np.arange(seq)[:, None], chosen]
        self.lost_units += int(dropped.sum())
        self.units_seen += dropped.size
        return ~dropped

    def group_outputs(self, layer: int, parts: np.ndarray) -> np.ndarray | None:
        return self._drop(layer, Block.MLP, parts)

    def _scores(self, layer: int, block: Block, parts: np.ndarray) -> np.ndarray:
        """Importance per (position, unit): the lowest go to the lossy devices."""
        units, seq = parts.shape[0], parts.shape[1]
        if self.policy == "none":
            return np.broadcast_to(-np.arange(units, dtype=np.float32), (seq, units))
        if self.policy == "random":
            rows = self._rng(layer, block, 1).random((self.max_len, units))
            return rows[self.start:self.start + seq]
        if self.policy == "sap":
            if self.predictors.ahead:
                features = self.previous_input
            else:
                features = self.current_input if block == Block.ATTN else self.current_mlp_input
            return self.predictors.predict(layer, block, features)
        norms = np.linalg.norm(parts, axis=-1).T
        return norms if self.policy == "oracle" else -norms

    def _drop(self, layer: int, block: Block, parts: np.ndarray) -> np.ndarray | None:
        if layer == 0 or self.plr == 0.0 or self.nglr == 0.0:
            return None
        units, seq = parts.shape[0], parts.shape[1]
        lossy = round(self.nglr * units)
        order = np.argsort(-self._scores(layer, block, parts), axis=1, kind="stable")  # most important first
        device_of_rank = np.full(units, -1)
        for d, ranks in enumerate(np.array_split(np.arange(units - lossy, units), self.devices)):
            device_of_rank[ranks] = d
        lost_devices = self._rng(layer, block, 0).random((self.max_len, self.devices)) < self.block_loss
        lost_devices = lost_devices[self.start:self.start + seq]
        lost_rank = np.where(device_of_rank >= 0, lost_devices[:, np.maximum(device_of_rank, 0)], False)
        keep = np.ones((seq, units), np.float32)
        np.put_along_axis(keep, order, (~lost_rank).astype(np.float32), axis=1)
        self.lost_units += int(seq * units - keep.sum())
        self.units_seen += seq * units
        return np.einsum("uso,su->so", parts, keep)


@dataclass(frozen=True)
class EvalResult:
    plr: float  # packet loss rate of the lossy devices' links (HALO's PLR)
    nglr: float  # share of neuron groups on lossy devices (HALO's NGLR)
    policy: str
    parity: int  # parity fragments after every partial (copies of a one-packet partial)
    tokens: int  # predicted tokens scored
    perplexity: float
    lossless_perplexity: float
    top1_agreement: float  # share of positions whose argmax equals the lossless argmax
    kl: float  # mean KL(lossless || lossy) per position, nats
    exact_match: float  # share of greedy continuations equal to the lossless ones
    units_lost: float  # share of units dropped

    @property
    def perplexity_increase(self) -> float:
        return self.perplexity / self.lossless_perplexity - 1.0


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _greedy(reference: ReferenceModel, prompt: Sequence[int], n: int, max_len: int,
            hooks: LossInjector | None) -> list[int]:
    cache = reference.new_cache(max_len)
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < n:
        if hooks is not None:
            hooks.start = cache.length
        logits = reference.forward(tokens if not out else [out[-1]], cache, hooks)
        out.append(int(np.argmax(logits)))
    return out


def evaluate(model: Model, texts: Sequence[str], plrs: Sequence[float], nglrs: Sequence[float],
             policies: Sequence[str], predictors: PredictorSet | None = None, group_size: int = 256,
             tokens: int = 1024, chunk: int = 256, prompt_tokens: int = 32, continuation: int = 16, seed: int = 0,
             parity: int = 0, progress: Callable[[str], None] = lambda _: None) -> list[EvalResult]:
    """Every (PLR, NGLR, policy) over the same text and the same loss events; `parity` copies protect
    every partial (0: HALO's setting, one packet that is lost or not)."""
    if tokens < chunk or chunk < 2:
        raise EdgerunError(f"evaluate at least one sequence of {chunk} tokens (asked for {tokens})")
    if predictors is not None and predictors.group_size != group_size:
        raise EdgerunError(f"the predictors were trained for groups of {predictors.group_size}, not {group_size}")
    reference = ReferenceModel(model.config, model.weights, group_size)
    settings = [(p, g, pol) for p in plrs for g in nglrs for pol in policies]
    nll = {s: 0.0 for s in settings}
    agree = {s: 0 for s in settings}
    kl = {s: 0.0 for s in settings}
    matches = {s: 0 for s in settings}
    lost = {s: [0, 0] for s in settings}
    lossless_nll, scored, sequences = 0.0, 0, 0
    chunks = list(token_chunks(model, texts, chunk, tokens))
    if not chunks:
        raise EdgerunError(f"the evaluation text is shorter than one chunk of {chunk} tokens")
    max_len = max(chunk, prompt_tokens + continuation)
    for sequence, ids in enumerate(chunks):
        targets = np.asarray(ids[1:])
        ref = _log_softmax(reference.forward(ids, reference.new_cache(max_len), all_logits=True)[:-1])
        ref_top = ref.argmax(axis=-1)
        ref_p = np.exp(ref)
        lossless_nll -= float(ref[np.arange(len(targets)), targets].sum())
        ref_continuation = _greedy(reference, ids[:prompt_tokens], continuation, max_len, None)
        for s in settings:
            plr, nglr, policy = s
            hooks = LossInjector(policy, plr, nglr, predictors, seed, sequence, max_len, model.config.n_kv_heads,
                                 parity, model.config.n_experts)
            lossy = _log_softmax(reference.forward(ids, reference.new_cache(max_len), hooks, all_logits=True)[:-1])
            nll[s] -= float(lossy[np.arange(len(targets)), targets].sum())
            agree[s] += int((lossy.argmax(axis=-1) == ref_top).sum())
            kl[s] += float((ref_p * (ref - lossy)).sum())
            lost[s][0] += hooks.lost_units
            lost[s][1] += hooks.units_seen
            # Greedy continuations draw their loss events from another sequence number than the scoring pass.
            hooks = LossInjector(policy, plr, nglr, predictors, seed, len(chunks) + sequence, max_len,
                                 model.config.n_kv_heads, parity, model.config.n_experts)
            matches[s] += _greedy(reference, ids[:prompt_tokens], continuation, max_len, hooks) == ref_continuation
        scored += len(targets)
        sequences += 1
        progress(f"{sequences}/{len(chunks)} sequences of {chunk} tokens")
    lossless_ppl = float(np.exp(lossless_nll / scored))
    return [EvalResult(plr, nglr, policy, parity, scored, float(np.exp(nll[(plr, nglr, policy)] / scored)),
                       lossless_ppl,
                       agree[(plr, nglr, policy)] / scored, kl[(plr, nglr, policy)] / scored,
                       matches[(plr, nglr, policy)] / sequences,
                       lost[(plr, nglr, policy)][0] / max(1, lost[(plr, nglr, policy)][1]))
            for plr, nglr, policy in settings]


def eval_json(results: Sequence[EvalResult]) -> list[dict[str, object]]:
    return [{**asdict(r), "perplexity_increase": r.perplexity_increase} for r in results]


def eval_table(results: Sequence[EvalResult]) -> str:
    rows = text_table((
        Column("PLR", lambda r: r.plr, ".0%", width=5),  # the packet loss rate
        Column("NGLR", lambda r: r.nglr, ".1%", width=6),  # the neuron-group loss rate
        Column("policy", lambda r: r.policy, width=9),
        Column("parity", lambda r: r.parity),
        Column("perplexity", lambda r: r.perplexity, ".3f"),
        Column("increase", lambda r: r.perplexity_increase, ".2%", width=9),
        Column("top-1", lambda r: r.top1_agreement, ".1%", width=7),
        Column("KL", lambda r: r.kl, ".4f", width=8),
        Column("exact", lambda r: r.exact_match, ".0%", width=6),
        Column("units lost", lambda r: r.units_lost, ".2%")), results)
    if results:
        rows.append(f"lossless perplexity {results[0].lossless_perplexity:.3f} over {results[0].tokens} tokens")
    return "\n".join(rows)
