"""Continuous batching on the ggml engine: several sequences' caches in one engine (slots), a decode step of all of
them at once, and the batch loop that lets sequences join and leave between steps. Every sequence gets what it
gets alone."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.batch import BatchLoop
from edgerun.model.generate import Generation, GenerationResult, StopReason, generate, make_engine
from edgerun.model.sampling import Sampler, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time there was a", "1, 2, 3, 4,",
           "Write a long poem about the sea and the wind. " * 6]
PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7),
          SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(temperature=0.0)]


def assert_decoded_together_as_alone(model, prompts: list[list[int]], slots: list[int], n_slots: int, max_len: int,
                                     steps: int):
    """Each prompt prefilled apart into its slot of one engine, then `steps` greedy tokens of all of them decoded
    together: bit for bit the logits each gets decoded alone. The batched engine, for more checks."""
    alone = make_engine("ggml", model, max_len, threads=1)
    expected = []
    for p in prompts:
        alone.reset()
        tokens, logits = [int(alone.step(p).argmax())], []
        for _ in range(steps):
            logits.append(alone.step([tokens[-1]]))
            tokens.append(int(logits[-1].argmax()))
        expected.append(logits)
    engine = make_engine("ggml", model, max_len, threads=1, slots=n_slots)
    last = [int(engine.prefill(s, p, 0).argmax()) for s, p in zip(slots, prompts, strict=True)]
    for step in range(steps):
        logits = engine.decode([(s, len(p) + step, t) for s, p, t in zip(slots, prompts, last, strict=True)])
        for i in range(len(prompts)):
            assert np.array_equal(logits[i], expected[i][step]), (i, step)
        last = [int(row.argmax()) for row in logits]
    return engine


def test_a_batched_decode_step_gives_each_sequence_the_logits_it_gets_alone(shipped_model) -> None:
    """Sequences in slots 3, 0 and 2 of one engine, prefilled apart and decoded together: bit for bit the logits of
    each decoded alone (the products take every column at once; attention reads each slot's own rows)."""
    tok = shipped_model.tokenizer
    engine = assert_decoded_together_as_alone(shipped_model, [tok.encode(p) for p in PROMPTS[:3]], [3, 0, 2], 4,
                                              512, steps=6)
    with pytest.raises(EdgerunError, match="distinct slots"):
        engine.decode([(0, 10, 1), (0, 11, 2)])
    with pytest.raises(EdgerunError, match="slot 4"):
        engine.prefill(4, [1, 2], 0)


def run_batch(shipped_model, requests: list[int], slots: int) -> tuple[dict[int, GenerationResult], int]:
    """PROMPTS[i] with PARAMS[i] for each i of `requests`, through a batch of `slots` (prefill chunks of 16
    tokens), each joining as a slot frees: their results, and the most that ran at once."""
    tok = shipped_model.tokenizer
    loop = BatchLoop(make_engine("ggml", shipped_model, 512, threads=1, slots=slots), prefill_chunk=16)
    results: dict[int, GenerationResult] = {}
    most = 0
    waiting = list(requests)
    while waiting or loop.running:
        while waiting and loop.free:
            i = waiting.pop(0)
            loop.add(Generation(tok.encode(PROMPTS[i]), 16, Sampler(PARAMS[i]), tok.stop_ids),
                     lambda result, i=i: results.__setitem__(i, result))
        most = max(most, len(loop.running))
        loop.step()
    return results, most


@pytest.mark.slow
def test_sequences_join_and_leave_the_batch_with_the_tokens_they_get_alone(shipped_model) -> None:
    """Four requests (greedy and seeded sampling, one with a prompt of several prefill chunks) through a batch of
    two slots: each joins when a slot frees, and its tokens are those it gets alone in the batch; a prompt of one
    chunk gets `generate`'s tokens too. (From 64 tokens a step takes other ggml kernels, so a prompt of 64 or more
    prefilled whole by `generate` may round unlike its chunks and part from them at a near tie.)"""
    tok = shipped_model.tokenizer
    assert len(tok.encode(PROMPTS[3])) > 16 >= max(len(tok.encode(p)) for p in PROMPTS[:3])
    together, most = run_batch(shipped_model, [0, 1, 2, 3], 2)
    alone = {i: run_batch(shipped_model, [i], 2)[0][i] for i in range(4)}
    assert most == 2 and all(together[i].tokens == alone[i].tokens for i in range(4))
    engine = make_engine("ggml", shipped_model, 512, threads=1)
    for i in range(3):
        assert together[i].tokens == generate(engine, tok.encode(PROMPTS[i]), 16, Sampler(PARAMS[i]),
                                              tok.stop_ids).tokens
    assert all(r.stop_reason in (StopReason.MAX_TOKENS, StopReason.STOP_TOKEN) for r in together.values())
    assert len({tuple(r.tokens) for r in together.values()}) == 4


def test_a_cancelled_sequence_leaves_at_the_next_step_and_a_bad_one_is_refused(shipped_model) -> None:
    tok = shipped_model.tokenizer
    loop = BatchLoop(make_engine("ggml", shipped_model, 64, threads=1, slots=2))
    ended: list[GenerationResult] = []
    cancel = {"now": False}
    loop.add(Generation(tok.encode(PROMPTS[0]), 40, Sampler(PARAMS[0]), cancelled=lambda: cancel["now"]),
             ended.append)
    for _ in range(3):
        loop.step()
    cancel["now"] = True
    loop.step()
    assert not loop.running and len(ended) == 1 and ended[0].stop_reason == StopReason.CANCELLED
    assert 1 <= len(ended[0].tokens) < 40
    with pytest.raises(EdgerunError, match="exceeds the context"):
        loop.add(Generation(tok.encode(PROMPTS[3]), 40, Sampler(PARAMS[0])), ended.append)
    for _ in range(2):
        loop.add(Generation(tok.encode(PROMPTS[0]), 4, Sampler(PARAMS[0])), ended.append)
    with pytest.raises(EdgerunError, match="all 2 sequences"):
        loop.add(Generation(tok.encode(PROMPTS[0]), 4, Sampler(PARAMS[0])), ended.append)
    with pytest.raises(EdgerunError, match="batched decoding"):
        make_engine("numpy", shipped_model, 64, slots=2)


def test_a_sequence_whose_draw_fails_ends_alone(shipped_model) -> None:
    """A draw that raises (a grammar that allows no token) ends that sequence with its error; the others go on."""
    tok = shipped_model.tokenizer

    def refuse(logits: np.ndarray, position: int) -> int:
        raise ValueError("the grammar allows no token here")

    loop = BatchLoop(make_engine("ggml", shipped_model, 128, threads=1, slots=2))
    ended: dict[str, object] = {}
    loop.add(Generation(tok.encode(PROMPTS[0]), 6, Sampler(PARAMS[0])), lambda r: ended.__setitem__("good", r))
    loop.add(Generation(tok.encode(PROMPTS[1]), 6, refuse), lambda r: ended.__setitem__("bad", r))
    while loop.running:
        loop.step()
    assert isinstance(ended["bad"], ValueError) and isinstance(ended["good"], GenerationResult)
    assert len(ended["good"].tokens) == 6


def test_prompts_that_join_together_share_a_round_up_to_its_tokens(shipped_model) -> None:
    """Three short prompts and a long one join an empty batch. Where a round runs 24 prompt tokens (one chunk's),
    the short ones fill the first round, each has its first token after it, and the long one's first chunk runs in
    the next, alone. Where it runs 48, that chunk joins the first round and the second round runs the next. Every
    sequence's tokens are the same either way: its prompt is cut at the same places."""
    tok = shipped_model.tokenizer
    ends = {}
    for round_tokens in (24, 48):
        loop = BatchLoop(make_engine("ggml", shipped_model, 256, threads=1, slots=4), prefill_chunk=24,
                         round_tokens=round_tokens)
        gens = [Generation(tok.encode(p), 8, Sampler(PARAMS[0])) for p in PROMPTS[:3]]
        assert sum(len(g.prompt) for g in gens) <= 24
        for g in gens:
            loop.add(g, lambda r: None)
        long = Generation(tok.encode(PROMPTS[3]), 8, Sampler(PARAMS[0]))
        assert len(long.prompt) > 2 * 24
        loop.add(long, lambda r: None)
        prefilled = []
        for _ in range(2):
            loop.step()
            prefilled.append(next(s.prefilled for s in loop.running if s.gen is long))
        assert [len(g.tokens) for g in gens] == [2, 2, 2] and not long.tokens
        assert prefilled == ([0, 24] if round_tokens == 24 else [24, 48])
        while loop.running:
            loop.step()
        ends[round_tokens] = [g.tokens for g in [*gens, long]]
    assert ends[24] == ends[48] and all(len(tokens) == 8 for tokens in ends[24])
    with pytest.raises(EdgerunError, match="at least one token"):
        BatchLoop(loop.engine, round_tokens=0)


class Counting:
    """An engine's prefills and cache copies, counted (the engine itself does the work)."""

    def __init__(self, engine) -> None:
        self.engine, self.slots, self.max_len = engine, engine.slots, engine.max_len
        self.prefilled: list[int] = []  # tokens of each prefill call
        self.copies: list[tuple[int, int, int]] = []

    def prefill(self, slot, tokens, start):
        self.prefilled.append(len(tokens))
        return self.engine.prefill(slot, tokens, start)

    def decode(self, batch):
        return self.engine.decode(batch)

    def copy_cache(self, source, target, rows):
        self.copies.append((source, target, rows))
        self.engine.copy_cache(source, target, rows)


def drain(loop: BatchLoop, gens: list[Generation]) -> list[GenerationResult]:
    results: dict[int, GenerationResult] = {}
    for i, g in enumerate(gens):
        loop.add(g, lambda r, i=i: results.__setitem__(i, r))
    while loop.running:
        loop.step()
    return [results[i] for i in range(len(gens))]


def test_a_prompt_prefilled_once_serves_every_sequence_that_shares_it(shipped_model) -> None:
    """Four sequences of one prompt (greedy and seeded) joining together: one prefill, the other three wait for it
    and take its cache rows and logits, and each gets the tokens it gets alone. A fifth after them takes a slot that
    still holds the prompt: no prefill, no copy. A prompt that shares 40 tokens with a finished one prefills from
    the last whole chunk of them (32, chunks of 16) and gets the tokens it gets in an engine that never saw the
    other."""
    tok = shipped_model.tokenizer
    prompt = tok.encode(PROMPTS[1])
    params = [PARAMS[0], PARAMS[1], PARAMS[2], SamplingParams(temperature=0.9, seed=11)]
    engine = Counting(make_engine("ggml", shipped_model, 256, threads=1, slots=4))
    loop = BatchLoop(engine, prefill_chunk=16)
    results = drain(loop, [Generation(prompt, 10, Sampler(p), tok.stop_ids) for p in params])
    assert engine.prefilled == [len(prompt)] and loop.reused_tokens == 3 * len(prompt)
    assert sorted(target for _, target, _ in engine.copies) == [1, 2, 3]
    alone = make_engine("ggml", shipped_model, 256, threads=1)
    for p, r in zip(params, results, strict=True):
        assert r.tokens == generate(alone, prompt, 10, Sampler(p), tok.stop_ids).tokens
    assert len({tuple(r.tokens) for r in results}) >= 3

    engine.prefilled.clear(), engine.copies.clear()
    again = drain(loop, [Generation(prompt, 10, Sampler(params[1]), tok.stop_ids)])
    assert again[0].tokens == results[1].tokens and not engine.prefilled and not engine.copies

    long = tok.encode(PROMPTS[3])
    drain(loop, [Generation(long, 4, Sampler(PARAMS[0]), tok.stop_ids)])
    branch = long[:40] + tok.encode(" and then the story ends")
    engine.prefilled.clear()
    reused = loop.reused_tokens
    got = drain(loop, [Generation(branch, 8, Sampler(PARAMS[1]), tok.stop_ids)])
    assert loop.reused_tokens - reused == 32 and sum(engine.prefilled) == len(branch) - 32
    fresh = BatchLoop(make_engine("ggml", shipped_model, 256, threads=1, slots=2), prefill_chunk=16)
    assert got[0].tokens == drain(fresh, [Generation(branch, 8, Sampler(PARAMS[1]), tok.stop_ids)])[0].tokens
    assert fresh.reused_tokens == 0


def test_a_sequence_waiting_for_a_prompt_that_is_cancelled_prefills_its_own(shipped_model) -> None:
    """The sequence whose prefill another waits for is cancelled before it ends: the waiting one prefills the
    prompt itself and gets its own tokens."""
    tok = shipped_model.tokenizer
    long = tok.encode(PROMPTS[3])
    engine = Counting(make_engine("ggml", shipped_model, 256, threads=1, slots=2))
    loop = BatchLoop(engine, prefill_chunk=16)
    cancel = {"now": False}
    ended: list[GenerationResult] = []
    loop.add(Generation(long, 4, Sampler(PARAMS[0]), cancelled=lambda: cancel["now"]), ended.append)
    loop.add(Generation(long, 4, Sampler(PARAMS[0]), tok.stop_ids), ended.append)
    loop.step()  # the first chunk of the first; the second waits
    assert engine.prefilled == [16]
    cancel["now"] = True
    while loop.running:
        loop.step()
    assert ended[0].stop_reason == StopReason.CANCELLED and len(ended[1].tokens) == 4
    # the second took the first's one whole chunk and prefilled the rest
    assert sum(engine.prefilled) == 16 + len(long) - 16 and loop.reused_tokens == 16
    fresh = BatchLoop(make_engine("ggml", shipped_model, 256, threads=1, slots=1), prefill_chunk=16)
    assert ended[1].tokens == drain(fresh, [Generation(long, 4, Sampler(PARAMS[0]), tok.stop_ids)])[0].tokens


def same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_rounds_prompt_chunks_and_decode_step_as_one_step_give_each_sequence_its_logits(tiny_spec, synth_gguf,
                                                                                         qtype: str) -> None:
    """Where every product gives each column its bits at any column count (kernels.invariant_products), a round's
    prompt chunks (one token, a few, 64: ggml's flash-attention tile) and its decode step go as one step
    (round_step): each chunk's last logits and each decoded sequence's are bit for bit those of separate steps, and
    so are the steps after, which read the caches it wrote."""
    from edgerun.model.loader import load_model

    model = load_model(synth_gguf(tiny_spec(qtype=qtype, tied=False)))
    apart, one = (make_engine("ggml", model, 256, threads=2, slots=5) for _ in range(2))
    assert one.fuses
    first, second = list(range(10, 50)), list(range(60, 140))
    for engine in (apart, one):
        engine.prefill(0, first, 0)
        engine.prefill(1, second[:64], 0)
    chunks = [(1, second[64:], 64), (2, [7, 8, 9, 10, 11, 12, 13], 0), (3, [5], 0), (4, list(range(200, 264)), 0)]
    expected = [apart.prefill(slot, tokens, start) for slot, tokens, start in chunks]
    expected_rows = apart.decode([(0, 40, 3)])
    outs, rows = one.round_step(chunks, [(0, 40, 3)])
    assert len(outs) == 4 and all(same_bits(o, e) for o, e in zip(outs, expected, strict=True))
    assert rows.shape == (1, model.config.vocab_size) and same_bits(rows, expected_rows)
    batch = [(0, 41, 4), (1, 80, 5), (2, 7, 6), (3, 1, 7), (4, 64, 8)]
    assert same_bits(one.decode(batch), apart.decode(batch))


def test_an_engine_whose_products_depend_on_the_column_count_runs_a_round_as_steps(tiny_spec, synth_gguf) -> None:
    """Q4_K_M's repacked Q4_K and Q6_K products round a column by how many others it comes with: a prompt's chunk
    beside decode tokens would part from the chunk alone, so such an engine does not fuse a round and refuses
    round_step; the batch loop then runs its chunks and decode step apart."""
    from edgerun.model.loader import load_model

    engine = make_engine("ggml", load_model(synth_gguf(tiny_spec(qtype="Q4_K_M", tied=False))), 128, threads=1,
                         slots=2)
    assert not engine.fuses and not BatchLoop(engine).fused
    with pytest.raises(EdgerunError, match="steps of their own"):
        engine.round_step([(0, [1, 2, 3], 0)], [(1, 0, 4)])


class Fusing(Counting):
    """Counting, for an engine that fuses a round: its round steps counted too."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.fuses = engine.fuses
        self.rounds: list[tuple[int, int]] = []  # (chunks, decoded sequences) of each round step

    def round_step(self, chunks, batch):
        self.rounds.append((len(chunks), len(batch)))
        return self.engine.round_step(chunks, batch)


def test_the_batch_loop_runs_a_rounds_chunks_and_decode_step_as_one_step_with_the_tokens_of_steps_apart(
        shipped_model) -> None:
    """Requests joining a running batch on the shipped model (Q4_1 and Q8_0: it fuses): the loop runs each round's
    prompt chunks with the decode step in one engine step, and every sequence gets the tokens the loop gives it
    with chunks and decode steps apart."""
    tok = shipped_model.tokenizer

    def results(engine) -> list[GenerationResult]:
        loop = BatchLoop(engine, prefill_chunk=16)
        gens = [Generation(tok.encode(p), 10, Sampler(q), tok.stop_ids) for p, q in zip(PROMPTS, PARAMS, strict=True)]
        done: dict[int, GenerationResult] = {}
        loop.add(gens[0], lambda r: done.__setitem__(0, r))
        loop.step()  # the first is decoding when the others join
        for i in range(1, 4):
            loop.add(gens[i], lambda r, i=i: done.__setitem__(i, r))
        while loop.running:
            loop.step()
        return [done[i] for i in range(4)]

    fused = Fusing(make_engine("ggml", shipped_model, 512, threads=1, slots=4))
    apart = Counting(make_engine("ggml", shipped_model, 512, threads=1, slots=4))
    assert fused.fuses and BatchLoop(fused).fused and not BatchLoop(apart).fused
    together, separate = results(fused), results(apart)
    assert [r.tokens for r in together] == [r.tokens for r in separate]
    assert any(chunks and decoded for chunks, decoded in fused.rounds)  # chunks beside running sequences
    assert sum(chunks for chunks, _ in fused.rounds) + len(fused.prefilled) == len(apart.prefilled)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"])
def test_batched_decode_is_bit_exact_on_every_weight_type(tiny_spec, synth_gguf, qtype: str) -> None:
    """Repacked weights (Q4_0, Q4_K: ggml's 8x8 layouts, whose products of one column and of several take
    different code), the batched product's types (Q4_1, Q8_0), and Q4_K_M's Q6_K: three and nine sequences decoded
    together get the logits each gets alone, bit for bit. (ggml multiplies repacked Q4_K by 4 columns or more, and
    Q6_K by 8 or more, with other bits than one column's: the batch's products take such weights in smaller groups
    of columns, kernels.each_column_alone.)"""
    from edgerun.model.loader import load_model

    model = load_model(synth_gguf(tiny_spec(qtype=qtype, tied=False)))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400, 500, 60, 70]]
    assert_decoded_together_as_alone(model, prompts, [0, 1, 2], 3, 128, steps=4)
    nine = prompts + [[i, 2 * i + 1, 3 * i + 2] for i in range(10, 16)]
    assert_decoded_together_as_alone(model, nine, list(range(9)), 9, 128, steps=2)


class ChainEngine:
    """A drawing engine in-process, for the loop's bookkeeping alone: each slot's cache is the list of tokens fed
    to it, and the token drawn after a position is a pure function of the tokens before it, so a sequence goes on
    as it would undisturbed exactly when its cache holds what it held. `lose()` empties every cache (a pipeline
    replanned); a step on a cache that is not what its position says fails."""

    lanes = 2
    max_len = 256

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.caches: list[list[int]] = [[] for _ in range(slots)]

    def _feed(self, slot: int, tokens, start: int) -> int:
        cache = self.caches[slot]
        assert len(cache) >= start, (slot, len(cache), start)
        del cache[start:]
        cache += list(tokens)
        return hash(tuple(cache)) % 1000

    def round(self, chunks, batch, samplers):
        return ([self._feed(slot, tokens, start) for slot, tokens, start, _ in chunks],
                [self._feed(slot, [token], position) for slot, position, token in batch])

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        assert len(self.caches[source]) >= rows
        self.caches[target] = self.caches[source][:rows]

    def lose(self) -> None:
        self.caches = [[] for _ in range(self.slots)]


def test_a_batch_that_lost_its_caches_prefills_them_again_and_goes_on_undisturbed() -> None:
    """BatchLoop.recover after the engine lost every cache mid-batch: each running sequence prefills its prompt and
    the tokens fed since (in chunks, the one still prefilling its prompt from the start) and goes on with the token it
    drew last, so every sequence ends with the tokens of a run that lost nothing."""
    prompts = [list(range(1, 12)), list(range(50, 53)), list(range(7, 40))]

    def run(lose_at: int | None) -> list[list[int]]:
        engine = ChainEngine(3)
        loop = BatchLoop(engine, prefill_chunk=8, draws=True)
        results: dict[int, GenerationResult] = {}
        for i, p in enumerate(prompts):
            loop.add(Generation(p, 10, Sampler(SamplingParams())), lambda r, i=i: results.__setitem__(i, r))
        steps = 0
        while loop.running:
            loop.step()
            steps += 1
            if steps == lose_at:
                assert any(s.prefilling for s in loop.running) and any(not s.prefilling for s in loop.running)
                engine.lose()
                loop.recover()
        return [results[i].tokens for i in range(len(prompts))]

    undisturbed = run(None)
    assert all(len(t) == 10 for t in undisturbed)
    for lose_at in (2, 3):
        assert run(lose_at) == undisturbed
