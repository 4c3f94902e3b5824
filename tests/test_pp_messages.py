"""The pipeline and tuning protocols (pp.messages, tune.messages): a sample of every message survives its frame,
every frame type has exactly one message, and nothing malformed decodes to anything but a Refused."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import numpy as np
import pytest

from edgerun.model.config import ModelConfig
from edgerun.net.wire import PP_HEADER, PpMsg, WireError, WorkerKind, cluster_mac, derive_key, pp_frame
from edgerun.pp import messages as m
from edgerun.tune import messages as t
from edgerun.tune.lora import LoraConfig, Target

Mutate = Callable[[object, random.Random], object]  # conftest's mutate fixture

KEY = derive_key("messages")
CONFIG = ModelConfig("llama", 2, 16, 32, 4, 2, 4, 100, 1e4, 1e-6, 64, False, False)
IDS = np.array([[3, 4, 5]], np.int64)
HIDDEN = np.arange(2 * 16, dtype=np.float32).reshape(1, 2, 16)
ROWS = np.ones((1, 2, 3, 4), np.float32)

SAMPLES = [
    m.Init(CONFIG, 256),
    m.Connect("w0", 512.0, 2e8, m.Capabilities(WorkerKind.NATIVE, "onnxruntime", True, "cpu", "a host", 4567, 2),
              ("ab" * 32,)),
    m.Connect("tab", 1024.0, 2e8, m.Capabilities(WorkerKind.BROWSER, "edgerun-kernels", backend="wasm", threads=1,
                                                 weights=m.TabWeights.KERNELS)),
    m.Ping(), m.Pong(),
    m.DownloadLayers(("ab" * 32, "cd" * 32)),
    m.LayerDownload("ab" * 32, 0.5, 1 << 20),
    m.PrepareModel(m.StageLayers(0, 2, True, (1,)), (m.StageFile("0/model.onnx", "ab" * 32),), 256, True),
    m.PrepareDone(True, (0, 1), True),
    m.CommitModel(256, 4, m.NextStage("10.0.0.2", 4567)),
    m.CommitDone(1.5),
    m.InvalidateCache(), m.ReleaseSession(),
    m.Computation(0, IDS, sampling=m.Sampling(0.7, 0.9, 40, 0.05, 11, False), prefix=m.Prefix.SAVE, chain=()),
    m.Computation(3, hidden=HIDDEN, chain=(0.001, 0.002)),
    m.ComputationResult(0.01, 42, (0.001, 0.002)),
    m.ComputationResult(0.01, hidden=HIDDEN),
    m.BatchComputation((0, 1), (5, 9), sampling=(m.Sampling(), m.Sampling(logits=True)), input_ids=IDS[0, :2]),
    m.BatchResult(0.02, (7, None), logits=np.ones((1, 100), np.float32)),
    m.SlotCopy(0, 1, 12), m.SlotCopied(), m.PassHello(),
    m.KvFetch(1, 3), m.KvData(ROWS, ROWS * 2), m.KvLoad(1, ROWS, ROWS, 3, True), m.KvLoaded(),
    m.Error("RuntimeError: out of memory"), m.Error("bad input", m.ErrorReason.INPUT),
    t.TuneLoad("ab" * 32, 0, 2, LoraConfig(4, 8.0, 0.0, (Target.Q, Target.V), 3), 1e-4, 0.1, 5, True,
               {"layers.0.q.lora_a": np.ones((4, 16), np.float32)}),
    t.TuneLoaded(1 << 20, 120.0, 110.0),
    t.TuneForward(1, 0, HIDDEN, np.array([[1, 2]], np.int64), 2),
    t.TuneOutput(2.5, 2, grad=HIDDEN), t.TuneOutput(hidden=HIDDEN),
    t.TuneBackward(0, HIDDEN), t.TuneGrad(HIDDEN), t.TuneGrad(),
    t.TuneEval(IDS), t.TuneStep(1e-4), t.TuneStepped(3.5, 200.0), t.TuneState(),
    t.TuneStateData(5, {"layers.0.q.lora_a": np.ones((4, 16), np.float32)}),
]
EVERYTHING = m.PIPELINE | t.TRAINING | t.REQUESTS


def same(a: object, b: object) -> bool:
    """Messages equal field by field, arrays by value."""
    if type(a) is not type(b):
        return False
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                    and np.array_equal(x, y)):
                return False
        elif isinstance(x, dict):
            if not (isinstance(y, dict) and x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)):
                return False
        elif x != y:
            return False
    return True


def test_every_frame_type_has_one_message_and_a_sample() -> None:
    assert set(EVERYTHING) == set(PpMsg)
    assert {type(s) for s in SAMPLES} == set(EVERYTHING.values())
    assert set(t.REQUESTS).isdisjoint(m.PIPELINE) and set(t.TRAINING) - set(m.PIPELINE) == \
        {cls.KIND for cls in (t.TuneLoaded, t.TuneOutput, t.TuneGrad, t.TuneStepped, t.TuneStateData)}


@pytest.mark.parametrize("message", SAMPLES, ids=lambda s: type(s).__name__)
def test_every_message_survives_its_frame(message: object) -> None:
    request, back = m.open_frame(m.seal(77, message, KEY), KEY, EVERYTHING)
    assert request == 77 and same(back, message), (back, message)


def test_a_table_takes_only_its_own_messages() -> None:
    frame = m.seal(5, t.TuneStep(1e-3), KEY)
    with pytest.raises(m.Refused, match="TUNE_STEP is not a message this end takes") as refused:
        m.open_frame(frame, KEY)  # a worker without a training role
    assert (refused.value.kind, refused.value.request) == (PpMsg.TUNE_STEP, 5)
    assert m.open_frame(frame, KEY, t.REQUESTS | m.PIPELINE)[1] == t.TuneStep(1e-3)


@pytest.mark.parametrize("kind, fields, tensors, why", [
    (PpMsg.COMPUTATION, {}, {}, "missing field position"),
    (PpMsg.COMPUTATION, {"position": "0"}, {}, "expected int"),
    (PpMsg.COMPUTATION, {"position": 0, "prefix": "keep"}, {}, "keep"),
    (PpMsg.COMPUTATION, {"position": 0}, {"weights": np.ones(2, np.float32)}, "unexpected tensors"),
    (PpMsg.KV_DATA, {}, {"keys": np.ones(2, np.float32)}, "missing values"),
    (PpMsg.BATCH_COMPUTATION, {"slots": [0, 1], "positions": [3]}, {}, "a slot and a position per sequence"),
    (PpMsg.CONNECT, {"name": "w", "memory_mb": 1, "speed": 1, "capabilities": {"kind": "phone"}}, {}, "phone"),
    (PpMsg.INIT, {"config": {**CONFIG.to_dict(), "n_layers": 0}, "max_len": 8}, {}, "n_layers must be positive"),
    (PpMsg.TUNE_LOAD, {"model_sha256": "", "first_layer": 0, "end_layer": 1, "lr": 1, "weight_decay": 0,
                       "lora": {"rank": 0}}, {}, "rank must be at least 1"),
])
def test_malformed_messages_are_refused_with_a_reason(kind: PpMsg, fields: dict, tensors: dict, why: str) -> None:
    with pytest.raises(m.Refused, match=why):
        m.open_frame(pp_frame(kind, 9, fields, KEY, tensors or None), KEY, EVERYTHING)


def _resealed(frame: bytes, fields: object) -> bytes:
    """`frame` with its JSON replaced by `fields` (its tensors' descriptions kept) and sealed again."""
    _, version, kind, request, text_len, payload_len = PP_HEADER.unpack_from(frame)
    old = json.loads(frame[PP_HEADER.size:PP_HEADER.size + text_len])
    if isinstance(fields, dict) and "tensors" in old:
        fields = {**fields, "tensors": old["tensors"]}
    text = json.dumps(fields).encode()
    payload = frame[PP_HEADER.size + text_len:PP_HEADER.size + text_len + payload_len]
    body = PP_HEADER.pack(b"EP", version, kind, request, len(text), len(payload)) + text + payload
    return body + cluster_mac(KEY, body)


def test_fuzzed_messages_decode_or_are_refused(mutate: Mutate) -> None:
    """Thousands of authentic frames whose JSON is structurally mutated: each decodes to a well-formed message of
    its frame's type or raises Refused; nothing else escapes."""
    rng = random.Random(0)
    decoded = refused = 0
    for i in range(4000):
        frame = m.seal(i, SAMPLES[i % len(SAMPLES)], KEY)
        _, _, _, _, text_len, _ = PP_HEADER.unpack_from(frame)
        fields = json.loads(frame[PP_HEADER.size:PP_HEADER.size + text_len])
        fields.pop("tensors", None)
        try:
            _, message = m.open_frame(_resealed(frame, mutate(fields, rng)), KEY, EVERYTHING)
        except m.Refused:
            refused += 1
            continue
        except WireError as e:  # only a JSON that is no object is refused before its type is known
            assert "not a JSON object" in str(e)
            refused += 1
            continue
        decoded += 1
        assert type(message) is EVERYTHING[PpMsg(PP_HEADER.unpack_from(frame)[2])]
        assert same(m.open_frame(m.seal(1, message, KEY), KEY, EVERYTHING)[1], message)
    assert refused > 1000 and decoded > 500


def test_a_worker_answers_what_it_does_not_take_with_an_error_at_once() -> None:
    """A worker without a training role given a tuning request, or any worker given a malformed one, answers its
    request with an Error (the master's call fails at once instead of timing out); a frame sealed with another key is
    dropped."""
    import asyncio

    from edgerun.pp.worker import PipelineWorker

    class Socket:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def send(self, data: bytes) -> None:
            self.sent.append(data)

    worker = PipelineWorker("ws://127.0.0.1:1/ws", KEY, "w", 80, 1e9, 1, log=lambda _: None)
    worker.ws = Socket()
    worker.heard = True  # past the master's first frame
    asyncio.run(worker._received(m.seal(7, t.TuneStep(1e-3), KEY)))
    asyncio.run(worker._received(pp_frame(PpMsg.KV_FETCH, 8, {"layer": "one"}, KEY)))
    asyncio.run(worker._received(m.seal(9, m.Ping(), derive_key("another cluster"))))
    answers = [m.open_frame(frame, KEY) for frame in worker.ws.sent]
    assert [(request, type(message)) for request, message in answers] == [(7, m.Error), (8, m.Error)]
    assert "TUNE_STEP is not a message this end takes" in answers[0][1].error
    assert "KvFetch.layer: expected int" in answers[1][1].error
