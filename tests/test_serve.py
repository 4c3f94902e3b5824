"""`edgerun serve` as a user runs it: a real server process, the official `openai` client, real
tensor-parallel node processes, kill -9, and the dashboard in Debian's Chromium."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.generate import generate
from edgerun.model.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.slow  # real servers, nodes and clients in processes

API_KEY = "sk-serve-test"
CLUSTER_KEY = "serve-test"
QUESTION = "What is the capital of France?"


class Serving:
    """A running `edgerun serve` process; its log is read on a thread so that its pipe never fills."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "EDGERUN_KEY": CLUSTER_KEY, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--threads", "1",
             *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = self.cluster = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(180):
            self.close()
            raise AssertionError("edgerun serve did not start:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"at (http://[\d.]+:\d+) ", line)
            if found:
                self.url = found.group(1)
                cluster = re.search(r"--master HOST:(\d+)", line)
                self.cluster = f"127.0.0.1:{cluster.group(1)}" if cluster else ""
                self.ready.set()

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def get(self, path: str, key: str | None = API_KEY) -> tuple[int, str]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: object, key: str | None = API_KEY) -> tuple[int, dict]:
        headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def state(self) -> dict:
        return json.loads(self.get("/api/state")[1])

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_node(master: str, name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", master, "--name", name,
                             "--key", CLUSTER_KEY, "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(shipped_path: Path) -> Iterator[Serving]:
    s = Serving("--api-key", API_KEY, "--no-cluster", "--cors-origin", "https://app.example")
    yield s
    s.close()


def chat(client: openai.OpenAI, content: str, **kw) -> str:
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": content}], **kw)
    return r.choices[0].message.content


def stream_chat(client: openai.OpenAI, content: str, on_text=None, **kw) -> str:
    """A streamed answer's text; `on_text()` runs at every piece of it as it arrives."""
    text = []
    for c in client.chat.completions.create(model="any", messages=[{"role": "user", "content": content}],
                                            stream=True, **kw):
        if c.choices and c.choices[0].delta.content:
            text.append(c.choices[0].delta.content)
            if on_text:
                on_text()
    return "".join(text)


def four_streams_killing(one: Callable[..., str], victim: subprocess.Popen) -> list[str]:
    """Four streams at once, `one(i, on_text)` each; kill -9 `victim` at the first piece of text of the first
    stream. Their texts (failing where the victim was never killed)."""
    killed: list[bool] = []

    def kill_once() -> None:
        if not killed:
            victim.send_signal(signal.SIGKILL)
            killed.append(True)

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda i: one(i, kill_once if i == 0 else None), range(4)))
    assert killed, "the victim was never killed"
    return texts


def test_chat_gives_the_engines_tokens(server: Serving, shipped_model, shipped_ggml) -> None:
    """Non-streaming and streaming answers are the single engine's greedy tokens, usage counts them; the server
    logs one line for each request with its tokens."""
    tok = shipped_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    reference = generate(shipped_ggml, prompt, 24, Sampler(SamplingParams()), tok.stop_ids)
    client = server.client()
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content == tok.decode(reference.tokens)
    assert r.choices[0].finish_reason == ("stop" if len(reference.tokens) < 24 else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(reference.tokens))
    chunks = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(reference.tokens)
    assert chunks[-1].usage.completion_tokens == len(reference.tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    spent = f"POST /v1/chat/completions 200 {len(prompt)}+{len(reference.tokens)} tokens "
    wait_until(lambda: sum(spent in line for line in server.lines) >= 2, 10, "a log line for each request")


def test_a_request_without_sampling_settings_gets_the_servers(server: Serving, shipped_model, shipped_ggml) -> None:
    """What a request leaves out is the server's default sampling (llama.cpp's: temperature 0.8, top-k 40, top-p
    0.95, min-p 0.05, seed 0): the same request gives the same answer, that of the engine sampled so; a request's
    own settings replace them."""
    from edgerun.model.sampling import USER_DEFAULTS

    tok = shipped_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    client = server.client()
    answers = [chat(client, QUESTION, max_tokens=24) for _ in range(2)]
    reference = generate(shipped_ggml, prompt, 24, Sampler(USER_DEFAULTS), tok.stop_ids)
    assert answers[0] == answers[1] == tok.decode(reference.tokens)
    own = SamplingParams(temperature=1.1, top_k=5, top_p=0.9, seed=3, min_p=0.1)
    status, body = server.post("/v1/chat/completions", {
        "model": "any", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 1.1,
        "top_k": 5, "top_p": 0.9, "seed": 3, "min_p": 0.1})
    assert status == 200
    assert body["choices"][0]["message"]["content"] == \
        tok.decode(generate(shipped_ggml, prompt, 24, Sampler(own), tok.stop_ids).tokens)


def test_completions_models_and_stop_strings(server: Serving, shipped_model, shipped_ggml) -> None:
    tok = shipped_model.tokenizer
    client = server.client()
    assert [m.id for m in client.models.list().data] == [shipped_model.name]
    prompt = "The three primary colors are"
    reference = tok.decode(generate(shipped_ggml, tok.encode(prompt), 16, Sampler(SamplingParams())).tokens)
    r = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == reference and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert streamed == reference
    # A stop string ends the answer before it; nothing after it is sent, streaming or not.
    stop = reference.strip().split()[2]
    cut = reference[:reference.index(stop)]
    r = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == cut


def test_seeded_concurrent_streams_get_what_they_get_alone(server: Serving) -> None:
    client = server.client()
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def one(i: int) -> str:
        return stream_chat(client, prompts[i], max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i)

    alone = [one(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(8)))
    assert together == alone
    assert len(set(alone)) > 1  # the seeds matter


def test_a_batching_server_gives_seeded_concurrent_streams_what_they_get_alone() -> None:
    """`serve --parallel 4`: eight seeded streams at once (four decoded together, the rest joining as slots free,
    one prompt prefilled in several chunks) get the tokens each gets alone, and so do four of one prompt, which is
    prefilled once; --parallel with a cluster is refused."""
    s = Serving("--api-key", API_KEY, "--no-cluster", "--parallel", "4")
    try:
        client = s.client()
        prompts = [f"Write one sentence about the number {i}." for i in range(7)] + ["Tell me about the sea. " * 20]

        def one(i: int) -> str:
            return stream_chat(client, prompts[i], max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i)

        alone = [one(i) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(one, range(8)))
        assert together == alone and len(set(alone)) > 1
        queue = s.state()["queue"]
        assert queue["parallel"] == 4 and queue["running"] == 0 and not queue["busy"]

        # one prompt, four seeds at once: prefilled once, the others take its cache rows and logits
        def same(seed: int) -> str:
            return stream_chat(client, "Name a colour of the sea.", max_tokens=10, temperature=0.9, seed=seed)

        before = queue["reused_prompt_tokens"]
        with ThreadPoolExecutor(4) as pool:
            shared = list(pool.map(same, range(4)))
        assert shared == [same(seed) for seed in range(4)] and len(set(shared)) > 1
        assert s.state()["queue"]["reused_prompt_tokens"] - before >= 3 * 10
        many = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Name a colour of "
                                                                      "the sea."}], max_tokens=10, temperature=0.9,
                                              seed=0, n=4)  # n: four sequences of one batch, one prefill
        assert [c.message.content for c in many.choices] == shared
    finally:
        s.close()
    refused = subprocess.run([sys.executable, "-m", "edgerun.cli", "serve", "--parallel", "2", "--port", "0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--no-cluster" in refused.stderr


def test_bench_serve_gives_every_row_new_prompts() -> None:
    """distinct: no stream's prompt is one an earlier row sent, even a row of the same count (--streams 1,8,1,8),
    which a --parallel server would otherwise take from the caches it kept; same: one prompt."""
    from edgerun.bench.serve import ServeBenchConfig, stream_prompts

    config = ServeBenchConfig(streams=(1, 8, 1, 8))
    prompts = [p for row, streams in enumerate(config.streams, 1) for p in stream_prompts(config, row, streams)]
    assert len(prompts) == len(set(prompts)) == 18 and all(p.endswith(config.prompt) for p in prompts)
    assert stream_prompts(replace(config, prompts="same"), 2, 3) == [config.prompt] * 3


def test_bench_serve_members_compute_on_the_cpu() -> None:
    """The bench's nodes and pipeline workers compute on the CPU, as the server's own engine does: their default
    (--device auto) takes a GPU where there is one, a node's after building ggml's CUDA backend for minutes."""
    from edgerun.bench.serve import ServeBenchConfig, member_argv
    from edgerun.cli import build_parser

    for members, mode in ({"nodes": 3}, "tp"), ({"workers": 2}, "pp"):
        argv = member_argv(replace(ServeBenchConfig(), **members), 1, "7000", "k" * 32, 512.0)
        assert argv[3] == "node"
        args = build_parser().parse_args(argv[3:])
        assert (args.mode, args.device, args.master, args.name) == (mode, "cpu", "127.0.0.1:7000", "bench-1")
    experts = build_parser().parse_args(member_argv(ServeBenchConfig(experts=2), 0, "7000", "k" * 32, None)[3:])
    assert experts.mode == "moe"


def test_bench_serve_members_poll_where_each_has_a_core() -> None:
    """--spin-us auto: the started cluster's master and members poll for their next message (20 ms) where this
    machine has a core for each of their compute threads, else sleep; a number is taken as it is, for the server and
    every member alike; a server alone has nothing to poll for; --url starts nothing to set it on."""
    from edgerun.bench.serve import ServeBenchConfig, cluster_spin_us, member_argv
    from edgerun.cli import build_parser
    from edgerun.errors import EdgerunError
    from edgerun.net.loops import AUTO_SPIN_US

    cores = len(os.sched_getaffinity(0))
    assert cluster_spin_us(ServeBenchConfig()) == 0.0
    auto = ServeBenchConfig(nodes=cores - 1)
    assert cluster_spin_us(auto) == AUTO_SPIN_US
    assert cluster_spin_us(replace(auto, nodes=cores)) == 0.0
    assert cluster_spin_us(replace(auto, threads=2)) == 0.0
    given = ServeBenchConfig(workers=2, spin_us=500.0)
    assert cluster_spin_us(given) == 500.0
    assert build_parser().parse_args(member_argv(given, 0, "7000", "k" * 32, 512.0)[3:]).spin_us == 500.0
    assert build_parser().parse_args(["serve", "--spin-us", "500"]).spin_us == 500.0
    for bad in ({"spin_us": -1.0}, {"spin_us": 100.0, "url": "http://127.0.0.1:1"}):
        with pytest.raises(EdgerunError, match="--spin-us"):
            ServeBenchConfig(**bad)


def _children() -> dict[int, str]:
    """This process's child processes: their command lines, by pid."""
    out = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("PPid:"))
            if ppid == os.getpid():
                out[int(status.parent.name)] = (status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, StopIteration, ValueError):  # a process that ended meanwhile
            continue
    return out


def test_bench_serve_pins_each_process_it_starts() -> None:
    """--pin 1: the started server runs on the first usable core and its node on the next (bench tp's devices'
    cores), and the cluster serves a stream; a negative --pin, or --pin with --url, is one line."""
    from edgerun.bench.cores import device_cores
    from edgerun.bench.serve import ServeBenchConfig, run_row, started_server
    from edgerun.errors import EdgerunError

    config = ServeBenchConfig(streams=(1,), max_tokens=3, nodes=1, pin=1)
    before = _children()  # other tests' servers, left as they are
    with started_server(config, lambda _: None) as url:
        started = {pid: argv for pid, argv in _children().items() if pid not in before}
        server = next(pid for pid, argv in started.items() if " serve " in argv)
        node = next(pid for pid, argv in started.items() if " node " in argv)
        assert os.sched_getaffinity(server) == device_cores(0, 1)
        assert os.sched_getaffinity(node) == device_cores(1, 1)
        timings, _ = run_row(url, [{"model": "any", "prompt": config.prompt, "max_tokens": 3, "temperature": 0.0,
                                    "stream": True, "stream_options": {"include_usage": True}}], None)
        assert [t.tokens for t in timings] == [3]
    for bad in ({"pin": -1}, {"pin": 1, "url": "http://127.0.0.1:1"}):
        with pytest.raises(EdgerunError, match="--pin"):
            ServeBenchConfig(**bad)


def test_bench_serve_measures_concurrent_streams_against_a_running_server(server: Serving) -> None:
    """`bench serve --url` against a running server: every stream's tokens come back (the usage), first tokens and
    gaps are timed, and the aggregate is the row's tokens over its wall time; a wrong key is one line naming 401."""
    from edgerun.bench.serve import ServeBenchConfig, bench_serve, percentile
    from edgerun.errors import EdgerunError

    rows = bench_serve(ServeBenchConfig(streams=(2, 1), max_tokens=4, url=server.url, api_key=API_KEY))
    assert [r.streams for r in rows] == [2, 1] and [r.tokens for r in rows] == [8, 4]
    for r in rows:
        assert 0 < r.ttft_p50_ms <= r.ttft_p95_ms and r.itl_p50_ms > 0
        assert r.aggregate_tok_s == pytest.approx(r.tokens / r.wall_s)
        assert r.ttft_p95_ms < r.wall_s * 1e3
    assert rows[1].vs_one == 1.0 and rows[0].vs_one == pytest.approx(rows[0].aggregate_tok_s / rows[1].aggregate_tok_s)
    assert all(r.served_by == "the single engine" for r in rows)
    with pytest.raises(EdgerunError, match="401"):
        bench_serve(ServeBenchConfig(streams=(1,), max_tokens=2, url=server.url, api_key="sk-wrong"))
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0 and percentile([1.0, 2.0], 95) == 2.0


def test_bench_serve_starts_its_own_server(shipped_path: Path) -> None:
    """`edgerun bench serve` as a user runs it: it starts edgerun serve, streams, prints JSON rows, stops it."""
    out = subprocess.run([sys.executable, "-m", "edgerun.cli", "bench", "serve", "--streams", "1,3", "--max-tokens",
                          "3", "--parallel", "3", "--json"], capture_output=True, text=True, timeout=600, check=True)
    rows = json.loads(out.stdout)
    assert [(r["streams"], r["tokens"]) for r in rows] == [(1, 3), (3, 9)] and rows[0]["vs_one"] == 1.0
    assert all(r["aggregate_tok_s"] > 0 and r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0 for r in rows)
    assert "starting edgerun serve" in out.stderr


def test_bench_serve_starts_a_cluster_and_says_which_devices_computed() -> None:
    """--nodes: a tensor-parallel cluster of the server and its nodes (with --parallel, batched on its shares);
    --workers: a pipeline of workers alone (with --parallel, batched on its stages). Each row says the devices of the
    plan it ran on; bad combinations are one line."""
    from edgerun.bench.serve import ServeBenchConfig, bench_serve, serve_table
    from edgerun.errors import EdgerunError

    rows = bench_serve(ServeBenchConfig(streams=(1, 2), max_tokens=4, nodes=1, parallel=2))
    assert [r.tokens for r in rows] == [4, 8]
    assert all(r.served_by == "the cluster, computed on 2 device(s): master, bench-0" for r in rows)
    # a batched pipeline, against the single engine's one stream timed first (--baseline)
    rows = bench_serve(ServeBenchConfig(streams=(2,), max_tokens=4, workers=2, parallel=2, baseline=True))
    assert rows[0].tokens == 8 and rows[0].served_by.startswith("the cluster, computed on 2 device(s): bench-")
    # the stages in order, each with its layers: the first from layer 0, the last to the model's last
    stages = re.fullmatch(r"the cluster, computed on 2 device\(s\): bench-\d \(layers 0-(\d+)\), "
                          r"bench-\d \(layers (\d+)-(\d+)\)", rows[0].served_by)
    assert stages is not None and int(stages[2]) == int(stages[1]) + 1 and int(stages[3]) == 29  # 30 layers
    assert rows[0].vs_single is not None and rows[0].vs_single > 0
    assert "x single" in serve_table(rows)
    for bad in (dict(nodes=1, workers=1), dict(workers=1, experts=1), dict(url="http://127.0.0.1:1", nodes=1),
                dict(url="http://127.0.0.1:1", baseline=True)):
        with pytest.raises(EdgerunError):
            ServeBenchConfig(**bad)


def test_n_choices_are_the_request_alone_with_successive_seeds(server: Serving) -> None:
    """n = 3 through the official client: three choices, choice i the same request alone with seed + i, the
    prompt counted once in the usage and every choice's tokens; streamed, each choice's chunks carry its index and
    add up to the same texts, and the usage chunk comes once."""
    client = server.client()
    messages = [{"role": "user", "content": "Name an animal."}]
    kw = {"model": "any", "messages": messages, "max_tokens": 8, "temperature": 1.0}
    many = client.chat.completions.create(n=3, seed=40, **kw)
    alone = [client.chat.completions.create(seed=40 + i, **kw) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts: dict[int, str] = {}
    usages = []
    for c in client.chat.completions.create(n=3, seed=40, stream=True, stream_options={"include_usage": True}, **kw):
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if c.usage is not None:
            usages.append(c.usage)
    assert [texts[i] for i in range(3)] == [c.message.content for c in many.choices]
    assert len(usages) == 1 and usages[0].completion_tokens == many.usage.completion_tokens
    completions = client.completions.create(model="any", prompt="Once upon a time", max_tokens=6, n=2, seed=5,
                                            temperature=1.0)
    assert [c.text for c in completions.choices] == [
        client.completions.create(model="any", prompt="Once upon a time", max_tokens=6, seed=5 + i,
                                  temperature=1.0).choices[0].text for i in range(2)]


def test_bad_requests_get_openai_errors(server: Serving) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ({**good, "temperature": 5}, 400, "temperature"),
        ({**good, "messages": []}, 400, "messages"),
        ({**good, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ({**good, "max_tokens": 0}, 400, "max_tokens"),
        ({**good, "n": 17}, 400, "n"),
        ({**good, "n": 0}, 400, "n"),
        ({**good, "stop": [1]}, 400, "stop"),
        ({**good, "seed": "x"}, 400, "seed"),
        ({**good, "stream": "yes"}, 400, "stream"),
        ({**good, "max_tokens": 100_000}, 413, "max_tokens"),
        ({**good, "response_format": {"type": "xml"}}, 400, "response_format"),
        ({**good, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
         400, "response_format"),
        ({**good, "tools": [{"type": "function", "function": {}}]}, 400, "tools"),
        ({**good, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {}}},
         400, "tools"),
        ({**good, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": "f"}},
         400, "tools"),
        ({**good, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]}, 400, "tools"),
        ({**good, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, 400, "tools"),
        ({**good, "top_logprobs": 2}, 400, "top_logprobs"),
        ({**good, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({**good, "presence_penalty": 3}, 400, "presence_penalty"),
        ({**good, "logit_bias": {"999999": 5}}, 400, "logit_bias"),
        ({**good, "logit_bias": {"42": 500}}, 400, "logit_bias"),
        ({**good, "echo": True}, 400, "echo"),
        ({**good, "best_of": 3}, 400, "best_of"),
    ]
    for body, status, param in cases:
        code, reply = server.post("/v1/chat/completions", body)
        assert code == status, (body, reply)
        assert reply["error"]["param"] == param and reply["error"]["message"]
    # What clients send by default, asking for nothing, is accepted.
    neutral = {**good, "response_format": {"type": "text"}, "logprobs": False, "presence_penalty": 0,
               "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none"}
    assert server.post("/v1/chat/completions", neutral)[0] == 200
    code, reply = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "tool_choice": "required",
                                                  "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert code == 400 and reply["error"]["param"] == "tools"  # no silent drop of what completions cannot do
    # tool_choice none with a response format: the format still shapes the answer.
    code, reply = server.post("/v1/chat/completions", {**good, "max_tokens": 40, "tool_choice": "none",
                                                       "tools": [{"type": "function", "function": {"name": "f"}}],
                                                       "response_format": {"type": "json_object"}})
    assert code == 200 and reply["choices"][0]["message"]["content"].startswith("{")
    assert server.post("/v1/chat/completions", b"{not json")[0] == 400
    assert server.post("/v1/completions", {"prompt": ""})[0] == 400
    assert server.post("/v1/chat/completions", good, key=None)[0] == 401
    code, reply = server.post("/v1/chat/completions", good, key="wrong")
    assert code == 401 and reply["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        chat(server.client("wrong"), "hi", max_tokens=2)
    code, body = server.get("/v1/nothing")
    assert code == 404 and "error" in json.loads(body)
    long_prompt = "word " * 3000  # more tokens than the 2048 of the context
    code, reply = server.post("/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
    assert code == 413 and reply["error"]["code"] == "context_length_exceeded"


def test_full_queue_gets_429_and_a_client_that_leaves_cancels(shipped_path: Path) -> None:
    s = Serving("--no-cluster", "--max-queue", "1")
    try:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "stream": True, "temperature": 0}
        request = urllib.request.Request(s.url + "/v1/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"}, method="POST")
        reply = urllib.request.urlopen(request, timeout=60)
        for _ in range(3):  # the stream is running
            reply.readline()
        code, error = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=None)
        assert code == 429 and error["error"]["type"] == "rate_limit_error"
        refused = urllib.request.Request(s.url + "/v1/completions", json.dumps({"prompt": "hi"}).encode(),
                                         {"content-type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(refused, timeout=30)
        assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
        reply.close()  # the client goes away: its generation stops at the next token
        wait_until(lambda: not s.state()["queue"]["busy"], 10, "the cancelled generation to stop")
        wait_until(lambda: 'edgerun_requests_total{status="499"} 1' in s.get("/metrics")[1], 10,
                   "the dropped stream to be counted")  # 499: the client left before its answer
        tokens = int(re.search(r"^edgerun_tokens_total (\d+)", s.get("/metrics")[1], re.M).group(1))
        assert tokens < 1500
        time.sleep(1)
        assert int(re.search(r"^edgerun_tokens_total (\d+)", s.get("/metrics")[1], re.M).group(1)) == tokens
        assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=None)[0] == 200
    finally:
        s.close()


def test_health_and_metrics(server: Serving) -> None:
    chat(server.client(), "hi", max_tokens=3)
    assert server.post("/v1/completions", {"prompt": "hi"}, key="wrong")[0] == 401
    code, body = server.get("/health")
    health = json.loads(body)
    assert code == 200 and health["status"] == "ok" and health["mode"] == "single"
    code, text = server.get("/metrics")
    assert code == 200
    for name in ("edgerun_tokens_total", "edgerun_ms_per_token_bucket", 'edgerun_requests_total{status="200"}',
                 'edgerun_nodes{state="alive"}', "edgerun_blocks_incomplete_total", "edgerun_recoveries_total"):
        assert name in text, name
    assert re.search(r'^edgerun_requests_total\{status="200"\} [1-9]', text, re.M)
    assert re.search(r'^edgerun_requests_total\{status="401"\} [1-9]', text, re.M)
    assert server.get("/")[0] == 200


# --- a tensor-parallel cluster behind the API -------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(shipped_path: Path) -> Iterator[tuple[Serving, dict[str, subprocess.Popen]]]:
    # Even shares: every node computes, so losing one matters; --prefer cluster: on this small machine the
    # cluster is not faster than the single engine, and auto would not move to it.
    # TCP: exact partials, so that a run is identical to another whatever the load on this machine (over UDP a
    # partial that misses its 10 ms deadline is left out, by design).
    # Float32 activations: a replan after a kill sums partials in another order, which int8 activations can turn
    # into a different token at a near-tie; float32 keeps a recovered stream identical to an undisturbed one.
    s = Serving("--plan", "even", "--prefer", "cluster", "--cluster-port", "0", "--transport", "tcp",
                "--activations", "f32")
    nodes = {name: start_node(s.cluster, name) for name in ("n1", "n2")}
    try:
        wait_until(lambda: s.state()["mode"] == "cluster" and len(s.state()["plan"]["devices"]) == 3, 180,
                   "a plan over both nodes")
        yield s, nodes
    finally:
        for proc in nodes.values():
            proc.kill()
            proc.wait()
        s.close()


def test_dashboard_shows_the_cluster_and_chats(cluster, tmp_path: Path) -> None:
    from test_browser_node import CHROMIUM, open_page

    reason = None if Path(CHROMIUM).exists() else "Debian's chromium is not installed"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "playwright is not installed (pip install -e '.[test]')"
    if reason is not None:  # CI installs both: there it is a failure
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)

    s, _ = cluster
    with sync_playwright() as p:
        browser, page, errors = open_page(p, console_errors=True)
        page.goto(s.url + "/")
        page.wait_for_selector('tr[data-node="n1"]', timeout=20_000)
        page.wait_for_selector('tr[data-node="n2"]', timeout=20_000)
        assert page.inner_text("#mode") == "cluster"
        assert " cores" in page.inner_text('tr[data-node="n1"]')  # the device it runs on
        plan = page.inner_text("#plan")
        assert plan.startswith("even over master, ") and "n1" in plan and "n2" in plan
        page.fill("#message", "Say hello.")
        page.click("#chat button")
        page.wait_for_function("document.querySelector('#log .assistant').textContent.length > 12",
                               timeout=60_000)
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        # Enter in the API-key box keeps the page (it reloaded it, losing the key) and moves to the message box
        page.evaluate("window.kept = true")
        page.fill("#apikey", "sk-typed")
        page.press("#apikey", "Enter")
        page.wait_for_timeout(500)
        assert page.evaluate("window.kept === true") and page.input_value("#apikey") == "sk-typed"
        # A narrow window gets one column: nothing sticks out past its right edge
        page.set_viewport_size({"width": 600, "height": 900})
        page.wait_for_timeout(200)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        browser.close()
    assert errors == []
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    # `edgerun status` shows the same.
    shown = subprocess.run([sys.executable, "-m", "edgerun.cli", "status", "--master", s.url.removeprefix("http://")],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "from the cluster engine" in shown.stdout and "plan even over master, " in shown.stdout
    for name in ("n1", "n2"):
        shown_node = rf"^  {name}: native \(\w+, \d+ cores\), serving, .* holds \d+ attention units"
        assert re.search(shown_node, shown.stdout, re.M), shown.stdout


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"]}


def structured(client: openai.OpenAI) -> tuple[str, list]:
    """A json_schema answer with its logprobs, checked against the schema."""
    import jsonschema

    r = client.chat.completions.create(
        model="any", max_tokens=40, logprobs=True, temperature=0.7, seed=3,
        messages=[{"role": "user", "content": "Name a city in France and its country, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    return text, [e.logprob for e in r.choices[0].logprobs.content]


def test_a_cluster_serves_structured_output(cluster) -> None:
    """The grammar runs where the draw runs: the tensor-parallel master gathers every logit for it."""
    s, _ = cluster
    first = structured(s.client())
    assert structured(s.client()) == first
    assert s.state()["mode"] == "cluster" and len(s.state()["plan"]["devices"]) == 3


def test_kill_a_node_during_four_streams(cluster) -> None:
    """Four concurrent streams while a node is killed with SIGKILL: each completes with exactly the text of
    an undisturbed run (the master replans over the node left and re-prefills)."""
    s, nodes = cluster
    client = s.client()
    prompts = [f"Name a fruit that starts with the letter {c}." for c in "ABCD"]

    def one(i: int, on_text=None) -> str:
        return stream_chat(client, prompts[i], on_text, max_tokens=16, temperature=0.7, seed=i)

    undisturbed = [one(i) for i in range(4)]
    assert four_streams_killing(one, nodes["n2"]) == undisturbed
    state = s.state()
    assert state["recoveries"] >= 1
    assert [n["state"] for n in state["nodes"] if n["name"] == "n2"] == ["lost"]
    assert state["mode"] == "cluster" and state["plan"]["devices"] == ["master", "n1"]
    # Every node gone: the single engine serves.
    nodes["n1"].send_signal(signal.SIGKILL)
    assert one(0) == undisturbed[0]
    wait_until(lambda: s.state()["mode"] == "single", 10, "the single engine")


def test_fuzzed_requests_never_get_a_5xx(server: Serving) -> None:
    """Random JSON bodies of the right and wrong shapes at both generation endpoints: a 2xx, 4xx, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | \
        st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) |
                          st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 3]),
                                     "content": values | st.text(max_size=30)})
    fields = {"messages": st.lists(message, max_size=3) | values, "prompt": st.text(max_size=30) | values,
              "max_tokens": st.integers(-2, 3) | values, "temperature": values, "top_p": values, "top_k": values,
              "seed": values, "stop": values, "stream": st.booleans() | values, "n": values,
              "stream_options": values, "model": values, "response_format": values | st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema"]), "json_schema": values}),
              "tools": values | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": values}),
                                         max_size=2),
              "tool_choice": values, "logprobs": values, "top_logprobs": values, "logit_bias": values,
              "presence_penalty": values, "frequency_penalty": values, "repetition_penalty": values}
    body = st.fixed_dictionaries({}, optional=fields) | values

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=body)
    def check(endpoint: str, body: object) -> None:
        data = json.dumps(body, allow_nan=True).encode()
        request = urllib.request.Request(server.url + endpoint, data, {"content-type": "application/json",
                                                                        "authorization": f"Bearer {API_KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        assert status < 500, (status, text)
        if status >= 400:
            assert json.loads(text)["error"]["message"]
        elif text.startswith("data: "):  # a stream: never an error event inside it
            assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")

    check()


# --- a pipeline behind the API ----------------------------------------------------------------------
def start_worker(master: str, name: str, budget_mb: float = 80) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--mode", "pp", "--master", master,
                             "--name", name, "--key", CLUSTER_KEY, "--threads", "1", "--memory-budget",
                             str(budget_mb)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_pipeline_serves_survives_a_kill_and_waits_for_workers(shipped_path: Path) -> None:
    """--plan dp --no-local: three 80 MB workers (two hold the model). Kill -9 one during four streams: each
    completes as undisturbed. Every worker gone: a 503 after --wait. A worker pair rejoins: served again.
    Float32 stages: with int8 ones, the re-prefill after the kill rounds unlike the one-token steps it replaces,
    so a stream may part from its undisturbed run at a near-tie (tests/test_pp.py checks that case exactly)."""
    s = Serving("--plan", "dp", "--no-local", "--wait", "3", "--cluster-port", "0", "--no-advertise",
                "--max-context", "512", "--activations", "f32")
    workers = {name: start_worker(s.cluster, name) for name in ("w1", "w2", "w3")}
    try:
        wait_until(lambda: s.state()["mode"] == "cluster" and len(s.state()["nodes"]) == 3, 180,
                   "a pipeline over the workers")
        client = s.client()
        prompts = [f"Name a city that starts with the letter {c}." for c in "ABCD"]

        def one(i: int, on_text=None) -> str:
            return stream_chat(client, prompts[i], on_text, max_tokens=16, temperature=0.7, seed=i)

        undisturbed = [one(i) for i in range(4)]
        # The last stage hands its logits back for a shaped draw (a grammar, logprobs): the same answer twice.
        assert structured(client) == structured(client)
        victim = next(n["name"] for n in s.state()["nodes"] if n["state"] == "serving")
        assert four_streams_killing(one, workers[victim]) == undisturbed
        state = s.state()
        assert victim not in [n["name"] for n in state["nodes"]]  # it left the list
        assert state["recoveries"] >= 1 and state["mode"] == "cluster"
        for proc in workers.values():
            proc.kill()
            proc.wait()
        wait_until(lambda: s.state()["nodes"] == [], 30, "the workers to leave")
        started = time.monotonic()
        code, reply = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2})
        assert code == 503 and reply["error"]["code"] == "no_capacity", reply
        assert 2.5 <= time.monotonic() - started < 30
        workers = {name: start_worker(s.cluster, name) for name in ("w4", "w5")}
        wait_until(lambda: len(s.state()["nodes"]) == 2, 120, "new workers")
        assert one(1) == undisturbed[1]
    finally:
        for proc in workers.values():
            proc.kill()
            proc.wait()
        s.close()


def test_a_pipeline_batches_parallel_requests(shipped_path: Path, shipped_model, shipped_ggml) -> None:
    """--plan dp --no-local --parallel 4: 100 MB workers' ggml stages hold four sequences each (two hold the
    model); four streams at once run in the pipeline's lanes, each answering as it does alone (greedy: the single
    engine's tokens; seeded: its own answer when run by itself). Kill -9 a serving worker during four streams: the
    pipeline replans over the workers left and every stream completes (its sequence prefilled again; int8 stages
    may then part from the undisturbed answer at a near-tie, so the text is not compared)."""
    tok = shipped_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    reference = tok.decode(generate(shipped_ggml, prompt, 16, Sampler(SamplingParams()), tok.stop_ids).tokens)
    s = Serving("--plan", "dp", "--no-local", "--parallel", "4", "--cluster-port", "0", "--no-advertise",
                "--max-context", "256")
    workers = {name: start_worker(s.cluster, name, 100) for name in ("w1", "w2", "w3")}  # 80 MB hold no 4 caches
    try:
        wait_until(lambda: s.state()["mode"] == "cluster" and len(s.state()["nodes"]) == 3, 180,
                   "a pipeline over the workers")
        client = s.client()
        prompts = [QUESTION] + [f"Name a city that starts with the letter {c}." for c in "ABC"]

        def one(i: int, on_text=None) -> str:
            return stream_chat(client, prompts[i], on_text, max_tokens=16,
                               **({"temperature": 0} if i == 0 else {"temperature": 0.7, "seed": i}))

        alone = [one(i) for i in range(4)]
        assert alone[0] == reference
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(one, range(4)))
        assert together == alone
        state = s.state()
        assert state["queue"]["parallel"] == 4, state
        victim = next(n["name"] for n in state["nodes"] if n["state"] == "serving")
        disturbed = four_streams_killing(one, workers[victim])
        assert all(disturbed), disturbed
        assert any("prefill their context again" in line for line in s.lines), "".join(s.lines[-20:])
        assert one(0) == reference  # served on the new plan
    finally:
        for proc in workers.values():
            proc.kill()
            proc.wait()
        s.close()


def test_a_tensor_parallel_cluster_batches_parallel_requests(shipped_path: Path) -> None:
    """--plan even --no-local --parallel 4: the master's and both nodes' shares hold four sequences' caches; four
    streams at once step together (every block carries the batch's rows) and each answers as it does alone
    (greedy and seeded). Kill -9 a node during four streams: the master plans over the one left, the batch's
    sequences prefill their context again and every stream completes (int8 shares may then part from the
    undisturbed answer at a near-tie, so the text is not compared); then served on the new plan. A decode step's
    blocks go over UDP with the merge timeout: a generous one keeps a busy machine's late partial from parting a
    stream from its answer alone."""
    s = Serving("--plan", "even", "--no-local", "--parallel", "4", "--cluster-port", "0", "--no-advertise",
                "--max-context", "256", "--timeout-ms", "2000")
    nodes = {name: start_node(s.cluster, name) for name in ("n1", "n2")}
    try:
        wait_until(lambda: s.state()["mode"] == "cluster" and len((s.state()["plan"] or {}).get("devices", ())) == 3,
                   180, "a plan over both nodes")
        client = s.client()
        prompts = [QUESTION] + [f"Name a city that starts with the letter {c}." for c in "ABC"]

        def one(i: int, on_text=None) -> str:
            return stream_chat(client, prompts[i], on_text, max_tokens=16,
                               **({"temperature": 0} if i == 0 else {"temperature": 0.7, "seed": i}))

        alone = [one(i) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(one, range(4)))
        assert together == alone
        assert s.state()["queue"]["parallel"] == 4
        disturbed = four_streams_killing(one, nodes["n1"])
        assert all(disturbed), disturbed
        assert any("prefill their context again" in line for line in s.lines), "".join(s.lines[-20:])
        wait_until(lambda: len(s.state()["plan"]["devices"]) == 2, 30, "a plan without n1")
        assert one(1)
    finally:
        for proc in nodes.values():
            proc.kill()
            proc.wait()
        s.close()


def test_a_browser_tab_serves_under_serve_at_the_cluster_port(shipped_path: Path, shipped_model,
                                                         shipped_onnx_f32) -> None:
    """--plan dp: the API at its port, the node page and the workers' WebSockets at the cluster port. A native
    worker (80 MB) and a Chromium tab (600 MB of float32 matrices: neither holds the model alone) join it; a
    streamed chat is the
    single engine's greedy answer, and the dashboard's state lists the tab as a browser node holding layers."""
    from test_browser_node import open_page, require_browser

    require_browser()
    from playwright.sync_api import sync_playwright

    tok = shipped_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    # A tab computes with float32 activations; with the native worker's float32 too (--activations f32), the
    # two give the float32 engine's tokens.
    reference = tok.decode(generate(shipped_onnx_f32, prompt, 16, Sampler(SamplingParams()), tok.stop_ids).tokens)
    s = Serving("--plan", "dp", "--no-local", "--no-advertise", "--max-context", "512", "--activations", "f32",
                "--cluster-port", "0")
    assert s.cluster != s.url.removeprefix("http://")  # workers and tabs come to the cluster port, not the API's
    native = start_worker(s.cluster, "native")
    try:
        with sync_playwright() as p:
            browser, page, errors = open_page(p)
            # weights=f32: onnxruntime-web on float32 matrices (without it the tab takes edgerun's WebAssembly
            # kernels, int8 activations: on this question's first token, a near-tie, int8 and float32 part).
            page.goto(f"http://{s.cluster}/node?name=tab&memory=600&weights=f32#key={CLUSTER_KEY}")
            wait_until(lambda: s.state()["mode"] == "cluster" and len(s.state()["nodes"]) == 2, 180,
                       "a pipeline over the worker and the tab")
            answer = stream_chat(s.client(), QUESTION, max_tokens=16, temperature=0)
            shaped = structured(s.client())  # the last stage, a tab or a native worker, hands its logits back
            nodes = {n["name"]: n for n in s.state()["nodes"]}
            browser.close()
        assert answer == reference and shaped
        assert nodes["tab"]["kind"] == "browser" and nodes["tab"]["holds"].startswith("layers ")
        assert nodes["native"]["kind"] == "native" and nodes["native"]["holds"].startswith("layers ")
        assert nodes["tab"]["device"] == "wasm" and nodes["native"]["device"].endswith(" cores, cpu")
        assert not errors, errors
    finally:
        native.kill()
        native.wait()
        s.close()


def test_serve_moves_a_mixture_of_experts_to_its_expert_workers(tmp_path: Path) -> None:
    """--plan moe --no-local: two expert workers join the server's port; completions over the API equal the numpy
    reference's greedy tokens, computed by the hub and its workers (float32 expert kernels, as the reference)."""
    from edgerun.model.generate import ReferenceEngine
    from edgerun.model.loader import load_model
    from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic

    path = tmp_path / "moe-tiny.gguf"
    write_synthetic(SynthSpec(SHAPES["moe-tiny"], "Q4_0", seed=5), path, "gguf")
    model = load_model(path)
    prompt = "Experts of a mixture, each on a worker of its own"
    expected = generate(ReferenceEngine(model, 512), model.tokenizer.encode(prompt), 24, Sampler(SamplingParams()),
                        model.tokenizer.stop_ids).tokens
    s = Serving("--model", str(path), "--plan", "moe", "--replicas", "2", "--no-local", "--no-advertise",
                "--max-context", "512", "--activations", "f32")
    workers = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--mode", "moe", "--master", s.cluster,
                                 "--name", name, "--key", CLUSTER_KEY, "--threads", "1", "--memory-budget", "50"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name in ("x1", "x2")]
    try:
        wait_until(lambda: s.state()["mode"] == "cluster" and len(s.state()["nodes"]) == 2, 180,
                   "the hub to place its experts")
        reply = s.client().completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
        assert reply.choices[0].text == model.tokenizer.decode(expected)
        assert {n["holds"] for n in s.state()["nodes"]} == {"32 experts"}  # r = 2 over 2: each holds all
        pick = {"type": "object", "properties": {"pick": {"enum": ["left", "right"]}}, "required": ["pick"]}
        shaped = s.client().completions.create(model="m", prompt=prompt, max_tokens=24, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": pick}}})
        assert json.loads(shaped.choices[0].text)["pick"] in ("left", "right")
        # `edgerun status` shows it (a placement predicts no time a token)
        shown = subprocess.run([sys.executable, "-m", "edgerun.cli", "status", "--master",
                                s.url.removeprefix("http://")], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert re.search(r"^  x1: .* holds 32 experts$", shown.stdout, re.M), shown.stdout
    finally:
        for proc in workers:
            proc.kill()
            proc.wait()
        s.close()


def test_an_expert_hub_batches_parallel_requests_through_a_killed_worker(tmp_path: Path) -> None:
    """--plan moe --no-local --parallel 4: the hub holds four sequences' caches and steps them together (each
    expert one dispatch of the step's tokens that chose it); four streams at once each answer as alone (greedy and
    seeded). Kill -9 an expert worker (one replica each) during four streams: its experts are placed on the workers
    left and the step runs again on the hub's caches, so every stream still gives its undisturbed answer."""
    from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic

    path = tmp_path / "moe-tiny.gguf"
    write_synthetic(SynthSpec(SHAPES["moe-tiny"], "Q4_0", seed=5), path, "gguf")
    s = Serving("--model", str(path), "--plan", "moe", "--replicas", "1", "--no-local", "--no-advertise",
                "--max-context", "256", "--parallel", "4")
    workers = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--mode", "moe", "--master", s.cluster,
                                 "--name", name, "--key", CLUSTER_KEY, "--threads", "1", "--memory-budget", "50"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name in ("x1", "x2", "x3")]
    try:
        wait_until(lambda: s.state()["mode"] == "cluster" and len(s.state()["nodes"]) == 3, 180,
                   "the hub to place its experts")
        client = s.client()
        prompts = ["Experts of a mixture", "Many sequences at once", "One dispatch per expert", "A batch of four"]

        def one(i: int, on_text=None) -> str:
            text = ""
            for chunk in client.completions.create(model="m", prompt=prompts[i], max_tokens=16, stream=True,
                                                   **({"temperature": 0} if i == 0 else
                                                      {"temperature": 0.8, "seed": i})):
                if chunk.choices and chunk.choices[0].text:
                    text += chunk.choices[0].text
                    if on_text is not None:
                        on_text()
            return text

        alone = [one(i) for i in range(4)]
        assert len(set(alone)) == 4 and all(alone), alone
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4))) == alone
        assert s.state()["queue"]["parallel"] == 4
        assert four_streams_killing(one, workers[0]) == alone
        wait_until(lambda: len([n for n in s.state()["nodes"] if n["alive"]]) == 2, 30, "the hub to see x1 go")
        assert one(1) == alone[1]
    finally:
        for proc in workers:
            proc.kill()
            proc.wait()
        s.close()


def test_ctrl_c_in_chat_stops_the_answer_and_the_chat_goes_on(shipped_path: Path) -> None:
    """At a terminal, Ctrl-C while an answer streams ends that answer (marked " [stopped]"), and the chat takes the
    next question; an empty line then ends it with status 0."""
    import os
    import pty
    import select
    import signal

    s = Serving("--no-cluster")
    controller, terminal = pty.openpty()
    chat = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "chat", "--url", s.url, "--api-key", API_KEY,
                             "--max-tokens", "2000"], stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = b""

    def read_until(marker: bytes, seconds: float) -> bytes:
        nonlocal out
        deadline = time.monotonic() + seconds
        while marker not in out and time.monotonic() < deadline:
            if select.select([chat.stdout], [], [], 0.2)[0]:
                out += os.read(chat.stdout.fileno(), 4096)
        return out

    try:
        read_until(b"> ", 60)
        os.write(controller, b"Write a long story about a dragon who learns to bake bread.\n")
        before = len(out)
        deadline = time.monotonic() + 60
        while len(out) < before + 10 and time.monotonic() < deadline:  # the answer is streaming
            read_until(b"\x00", 0.2)
        assert not out.endswith(b"> "), out  # still answering
        chat.send_signal(signal.SIGINT)
        assert b" [stopped]\n> " in read_until(b" [stopped]\n> ", 30), out
        os.write(controller, b"\n")
        assert chat.wait(timeout=60) == 0, chat.stderr.read()
    finally:
        chat.kill()
        os.close(controller)
        os.close(terminal)
        s.close()


def test_status_names_the_devices_that_compute() -> None:
    """A plan that leaves nodes out: `edgerun status` says the master serves alone and which nodes the plan left
    out (it said "serving from the cluster engine ... over master, a, b")."""
    from edgerun.serve.status import status_text

    state = {"measured_ms_per_token": {}, "single_ms_per_token": 10.0, "mode": "cluster", "model": "m",
             "device": "x", "nodes": [], "queue": {"waiting": 0, "busy": False, "running": 0, "parallel": 1},
             "tokens_per_second": [],
             "blocks": 0, "blocks_incomplete": 0, "late_packets": 0, "recoveries": 0, "events": [],
             "plan": {"strategy": "halo", "devices": ["master", "a", "b"], "memory_mb": [100.0, 0.0, 0.0],
                      "predicted_ms_per_token": 9.0}}
    lines = status_text(state).splitlines()
    assert lines[0] == "serving m from the cluster engine (the master alone: its plan leaves every node out); " \
                       "single engine 10.0 ms/token"
    assert lines[2] == "plan halo over master (left out: a, b): predicted 9.0 ms/token"
    state["plan"]["memory_mb"] = [60.0, 40.0, 0.0]
    lines = status_text(state).splitlines()
    assert lines[0].startswith("serving m from the cluster engine;")
    assert lines[2] == "plan halo over master, a (left out: b): predicted 9.0 ms/token"


def test_a_huge_body_is_refused_at_once_and_the_server_stays_responsive(server: Serving) -> None:
    """A request that declares a 10 MB body gets its 413 (OpenAI's error JSON) within a second, before it has sent
    the body, and /health answers meanwhile."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    health_s: list[float] = []

    def health() -> None:
        time.sleep(0.05)
        started = time.monotonic()
        assert server.get("/health")[0] == 200
        health_s.append(time.monotonic() - started)

    probe = threading.Thread(target=health)
    started = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        probe.start()
        conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
                     f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {10 << 20}\r\n\r\n".encode())  # the head alone: nothing unread is left
        # on the server's side when it answers and closes, so it closes cleanly (unread bytes would make it reset)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = conn.recv(65536)
            if not data:
                break
            reply += data
    took = time.monotonic() - started
    probe.join()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert json.loads(payload)["error"]["code"] == "body_too_large", payload
    assert took < 1.0, took
    assert health_s and health_s[0] < 0.2, health_s


def test_a_lone_surrogate_is_a_400(server: Serving) -> None:
    """JSON can spell half an emoji ("\\ud83d", what JavaScript leaves when it cuts one): a 400 naming it, not a
    500 and a dropped connection."""
    body = b'{"model": "any", "messages": [{"role": "user", "content": "cut \\ud83d here"}], "max_tokens": 4}'
    code, reply = server.post("/v1/chat/completions", body)
    assert code == 400 and "invalid Unicode" in reply["error"]["message"], reply
    code, reply = server.post("/v1/completions", b'{"model": "any", "prompt": "ok", "stop": ["\\udc00"]}')
    assert code == 400 and "'stop'" in reply["error"]["message"], reply


def test_tokenize_detokenize_one_model_lower_case_bearer_and_cors(server: Serving, shipped_model) -> None:
    """llama.cpp's /tokenize and /detokenize, OpenAI's /v1/models/{id}, the Bearer scheme in any case, and a web
    page of the origin --cors-origin names may call the API (its preflight answered, others not)."""
    tok = shipped_model.tokenizer
    code, reply = server.post("/tokenize", {"content": "The capital of France"})
    assert code == 200 and reply["tokens"] == tok.encode("The capital of France")
    code, reply = server.post("/detokenize", {"tokens": reply["tokens"]})
    assert code == 200 and reply["content"] == "The capital of France"
    assert server.post("/detokenize", {"tokens": [-1]})[0] == 400
    assert server.post("/tokenize", {"content": 5})[0] == 400
    assert server.post("/tokenize", {"content": "x"}, key=None)[0] == 401
    name = server.client().models.list().data[0].id
    assert server.client().models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("no-such-model")
    request = urllib.request.Request(server.url + "/v1/models", headers={"authorization": f"bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    request = urllib.request.Request(server.url + "/v1/chat/completions", headers=preflight, method="OPTIONS")
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    request = urllib.request.Request(server.url + "/v1/chat/completions", method="OPTIONS",
                                     headers={**preflight, "origin": "https://elsewhere.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400


def test_ollama_clients_chat_generate_and_list(server: Serving, shipped_model, shipped_ggml) -> None:
    """The `ollama` package against Ollama's routes: chat (streamed and not) and generate give the engine's tokens
    for the same sampling, the model is listed and shown, the version answers; errors are Ollama's."""
    import ollama

    client = ollama.Client(host=server.url, headers={"authorization": f"Bearer {API_KEY}"})
    tok = shipped_model.tokenizer
    messages = [{"role": "user", "content": QUESTION}]
    greedy = {"temperature": 0, "num_predict": 16}
    expected = tok.decode(generate(shipped_ggml, tok.encode(tok.apply_chat_template(messages)), 16,
                                   Sampler(SamplingParams()), tok.stop_ids).tokens)
    answer = client.chat(model="any", messages=messages, options=greedy)
    assert answer.message.content == expected and answer.done
    assert answer.eval_count == len(tok.encode(expected)) and answer.prompt_eval_count > 0
    streamed = list(client.chat(model="any", messages=messages, options=greedy, stream=True))
    assert "".join(part.message.content for part in streamed) == expected and streamed[-1].done
    generated = client.generate(model="any", prompt=QUESTION, options=greedy)
    assert generated.response == expected  # /api/generate renders the prompt through the chat template
    raw = client.generate(model="any", prompt="The capital of France is", raw=True, options=greedy)
    assert raw.response == tok.decode(generate(shipped_ggml, tok.encode("The capital of France is"), 16,
                                               Sampler(SamplingParams()), tok.stop_ids).tokens)
    listed = client.list().models
    assert len(listed) == 1 and listed[0].details.family == "llama" and listed[0].size > 0
    shown = client.show(listed[0].model)
    assert shown.details.format == "gguf" and "im_start" in (shown.template or "")
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    assert server.get("/api/version")[0] == 200
    shaped = client.chat(model="any", messages=messages, format="json", options=greedy)
    assert isinstance(json.loads(shaped.message.content), dict)
    # Tools (Ollama's arguments are an object), whole and streamed; a tool's result is taken back. Ollama has no
    # tool_choice: the model chooses, so the request names the call whole (asked more loosely, "Call get_weather for
    # Paris in celsius.", the greedy answer called it on AVX-512 CPUs and answered in text on an AVX2 one).
    ask = [{"role": "user", "content": "Call the get_weather function with city Paris and unit celsius."}]
    called = client.chat(model="any", messages=ask, tools=[WEATHER], options=greedy | {"num_predict": 60})
    assert [(c.function.name, c.function.arguments) for c in called.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})] and called.message.content == ""
    streamed = [p.message.tool_calls for p in client.chat(model="any", messages=ask, tools=[WEATHER], stream=True,
                                                          options=greedy | {"num_predict": 60})]
    assert streamed[0] == called.message.tool_calls and streamed[-1] is None
    # Logprobs, whole and streamed: one a token, the model's, the chosen one first under greedy decoding.
    scored = client.chat(model="any", messages=messages, options=greedy | {"num_predict": 5}, logprobs=True,
                         top_logprobs=2)
    assert len(scored.logprobs) == scored.eval_count and "".join(e.token for e in scored.logprobs) == \
        scored.message.content
    assert all(e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 2 for e in scored.logprobs)
    pieces = [e for p in client.chat(model="any", messages=messages, options=greedy | {"num_predict": 5},
                                     logprobs=True, top_logprobs=2, stream=True) for e in (p.logprobs or [])]
    assert [(e.token, e.logprob) for e in pieces] == [(e.token, e.logprob) for e in scored.logprobs]
    answered = client.chat(model="any", tools=[WEATHER], options=greedy | {"num_predict": 8}, messages=[
        *ask, {"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": "18 degrees and sunny"}])
    assert answered.done
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="any", messages=messages, format={"type": "nonsense"})
    assert refused.value.status_code == 400 and "format" in refused.value.error


def test_the_api_key_guards_every_data_route(server: Serving) -> None:
    """With --api-key, the state, its event stream (key as ?key=, which a browser's EventSource can send) and
    /metrics need the key too; /health and the dashboard page do not; `edgerun status` takes --api-key."""
    for path in ("/api/state", "/metrics", "/api/events", "/api/tags"):
        assert server.get(path, key=None)[0] == 401, path
    assert server.get("/api/state")[0] == 200 and server.get("/metrics")[0] == 200
    assert server.get("/health", key=None)[0] == 200 and server.get("/", key=None)[0] == 200
    with urllib.request.urlopen(f"{server.url}/api/events?key={API_KEY}", timeout=30) as events:
        assert events.status == 200 and events.readline().startswith(b"data: {")
    target = server.url.removeprefix("http://")
    status = subprocess.run([sys.executable, "-m", "edgerun.cli", "status", "--master", target], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode != 0 and "API key" in status.stderr, status.stderr
    status = subprocess.run([sys.executable, "-m", "edgerun.cli", "status", "--master", target, "--api-key",
                             API_KEY], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "single engine" in status.stdout, status.stderr


def test_embeddings_are_unit_vectors_of_the_model_and_repeat(server: Serving, shipped_model) -> None:
    """/v1/embeddings through the official client: one vector of the model's width per input, of unit length, the
    same for the same text (alone or in a batch, float or base64), different for different texts; related texts
    closer than unrelated ones."""
    client = server.client()
    texts = ["Paris is the capital of France.", "The capital of France is Paris.", "Photosynthesis needs light."]
    reply = client.embeddings.create(model="any", input=texts)
    vectors = np.array([d.embedding for d in reply.data])
    assert vectors.shape == (3, shipped_model.config.hidden)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert reply.usage.prompt_tokens == sum(len(shipped_model.tokenizer.encode(t)) for t in texts)
    alone = client.embeddings.create(model="any", input=texts[2]).data[0].embedding
    np.testing.assert_array_equal(np.array(alone, np.float32), vectors[2].astype(np.float32))
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    code, raw = server.post("/v1/embeddings", {"input": texts[0], "encoding_format": "base64"})
    assert code == 200, raw
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, vectors[0].astype(np.float32))
    assert server.post("/v1/embeddings", {"input": [1, 2]})[0] == 400
    assert server.post("/v1/embeddings", {"input": "x", "dimensions": 8})[0] == 400


# --- structured output, tools and logprobs (model/logits.py, serve/tools.py) ----------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def test_structured_output_tools_and_logprobs_with_the_openai_client(server: Serving) -> None:
    import jsonschema
    from pydantic import BaseModel

    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temperature": {"type": "integer"},
                                               "sky": {"enum": ["sunny", "cloudy", "rainy"]}},
              "required": ["city", "temperature", "sky"], "additionalProperties": False}
    texts = []
    for _ in range(2):  # the same request, the same answer
        r = client.chat.completions.create(model="any", messages=ask, max_tokens=80, response_format={
            "type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        texts.append(r.choices[0].message.content)
        jsonschema.validate(json.loads(texts[-1]), schema)
    assert texts[0] == texts[1]
    # (any object: on an AVX2 CPU the greedy one runs to 79 tokens)
    r = client.chat.completions.create(model="any", messages=ask, max_tokens=200,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)

    class City(BaseModel):
        name: str
        country: str

    parsed = client.chat.completions.parse(model="any", max_tokens=60, response_format=City, messages=[
        {"role": "user", "content": "Name a city in France, as JSON with its name and country."}])
    assert isinstance(parsed.choices[0].message.parsed, City)

    # Tools: required, a named function, auto; a call's arguments validate against its function's parameters.
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    clock = [{"role": "user", "content": "What time is it in the Europe/Paris zone?"}]
    for asked, choice, name in ((weather, "required", None),
                                (clock, {"type": "function", "function": {"name": "get_time"}}, "get_time")):
        r = client.chat.completions.create(model="any", messages=asked, tools=[WEATHER, CLOCK], tool_choice=choice,
                                           max_tokens=60)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert name in (None, call.function.name)
        spec = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), spec)
    r = client.chat.completions.create(model="any", messages=weather, tools=[WEATHER], max_tokens=60)
    message = r.choices[0].message
    assert (message.tool_calls is None) == (message.content is not None)
    # A streamed call assembles from its deltas, as the client's accumulator does.
    name, arguments, reasons = "", "", []
    for c in client.chat.completions.create(model="any", messages=weather, tools=[WEATHER], tool_choice="required",
                                            max_tokens=60, stream=True):
        for d in c.choices[0].delta.tool_calls or []:
            name += d.function.name or ""
            arguments += d.function.arguments or ""
        reasons.append(c.choices[0].finish_reason)
    assert name == "get_weather" and json.loads(arguments)["city"] and reasons[-1] == "tool_calls"
    # The conversation goes on with the call (null content) and its result.
    follow = [
        *weather,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model="any", messages=follow, tools=[WEATHER], tool_choice="none",
                                       max_tokens=24)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")

    # Logprobs: one entry a token, the model's, in whole answers and in streams alike.
    r = client.chat.completions.create(model="any", messages=ask, max_tokens=6, logprobs=True, top_logprobs=3,
                                       temperature=0)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens and "".join(e.token for e in entries) == \
        r.choices[0].message.content
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in entries)  # greedy
    streamed = []
    for c in client.chat.completions.create(model="any", messages=ask, max_tokens=6, logprobs=True, top_logprobs=3,
                                            temperature=0, stream=True):
        if c.choices and c.choices[0].logprobs:
            streamed += c.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=4, logprobs=2,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0
    # A penalty and a bias change the answer; the bias forces its token.
    plain = chat(client, "Count from one to ten.", max_tokens=24, temperature=0)
    assert chat(client, "Count from one to ten.", max_tokens=24, temperature=0, frequency_penalty=2.0,
                presence_penalty=2.0) != plain
    banana = server.post("/tokenize", {"content": " banana"})[1]["tokens"][0]
    r = client.chat.completions.create(model="any", messages=ask, max_tokens=3, temperature=0,
                                       logit_bias={str(banana): 100})
    assert r.choices[0].message.content == " banana" * 3


def test_langchain_structured_output_and_tools(server: Serving) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model="any", max_retries=0, max_tokens=60)

    class City(BaseModel):
        name: str
        country: str

    for method in ("json_schema", "function_calling"):  # json_mode promises JSON, not these keys
        city = llm.with_structured_output(City, method=method).invoke(
            "Name a city in France, as JSON with its name and country.")
        assert isinstance(city, City), method

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)


def test_a_plain_serve_is_safe_by_default(shipped_path: Path, tmp_path: Path) -> None:
    """No --host, no --key: the API listens on loopback only, the cluster port on every interface with a key made
    on the first run (0600 in the config folder) and printed in the join line; a node without the key is refused
    with a line on both sides, and one with it (or reading the same config folder) joins, and rejoins the server
    started again."""
    import socket

    env = {k: v for k, v in os.environ.items() if k != "EDGERUN_KEY"} | \
        {"EDGERUN_CONFIG": str(tmp_path / "config"), "PYTHONUNBUFFERED": "1"}
    with socket.socket() as probe:  # a cluster port the server can be started on again
        probe.bind(("127.0.0.1", 0))
        fixed_port = probe.getsockname()[1]
    lines: list[str] = []

    def serve() -> subprocess.Popen:
        lines.clear()
        p = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "serve", "--port", "0", "--cluster-port",
                              str(fixed_port), "--no-advertise", "--threads", "1", "--prefer", "single"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
        wait_until(lambda: any("serving " in line for line in lines), 180, "the server")
        return p

    proc = serve()
    nodes: list[subprocess.Popen] = []
    try:
        joining = next(line for line in lines if "nodes join with" in line)
        found = re.search(r"at http://([\d.]+):(\d+) .*--master HOST:(\d+) --key (\S+)`", joining)
        assert found, joining
        host, port, cluster, key = found.group(1), int(found.group(2)), found.group(3), found.group(4)
        assert host == "127.0.0.1" and any("made a cluster key" in line for line in lines)
        kept = tmp_path / "config" / "cluster.key"
        assert kept.read_text().strip() == key and kept.stat().st_mode & 0o777 == 0o600
        listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
        assert re.search(rf"127\.0\.0\.1:{port}\s", listening) and not re.search(rf"0\.0\.0\.0:{port}\s", listening)
        assert re.search(rf"(0\.0\.0\.0|\*):{cluster}\s", listening), listening

        def node(name: str, node_env: dict[str, str], *extra: str) -> subprocess.Popen:
            p = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{cluster}",
                                  "--name", name, "--threads", "1", *extra], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, env=node_env)
            nodes.append(p)
            return p

        elsewhere = env | {"EDGERUN_CONFIG": str(tmp_path / "another machine")}
        keyless = node("keyless", elsewhere)
        _, said = keyless.communicate(timeout=120)
        assert keyless.returncode == 2 and "rejected this node's key" in said, said
        wait_until(lambda: any("a node at 127.0.0.1 failed authentication" in line for line in lines), 30,
                   "the server's line about the refused node")
        node("keyed", elsewhere, "--key", key)
        node("same config", env)  # on the server's machine: the kept key
        def joined() -> set[str]:
            state = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=10).read()
            return {n["name"] for n in json.loads(state)["nodes"]}

        wait_until(lambda: joined() == {"keyed", "same config"}, 120, "both keyed nodes to join")
        # The server restarts (same key, same cluster port): its nodes come back.
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        proc = serve()
        assert not any("made a cluster key" in line for line in lines)  # the kept one
        port = int(re.search(r"at http://[\d.]+:(\d+) ", next(x for x in lines if "serving " in x)).group(1))
        wait_until(lambda: joined() == {"keyed", "same config"}, 120, "the nodes to rejoin the restarted server")
    finally:
        for p in nodes:
            p.kill()
            p.wait()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_twenty_schemas_validate_through_the_openai_client(server: Serving) -> None:
    """The twenty schemas of tests/test_logits.py as a client sends them (response_format json_schema, strict),
    with the server's default sampling: every answer ends, parses and validates."""
    import jsonschema
    from test_logits import SCHEMAS

    client = server.client()
    for i, schema in enumerate(SCHEMAS):
        r = client.chat.completions.create(
            model="any", max_tokens=100,
            messages=[{"role": "user", "content": f"Answer with a short JSON value that follows this schema: "
                                                  f"{json.dumps(schema)}"}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


def test_a_template_with_its_own_tool_syntax(qwen_path: Path) -> None:
    """Qwen2.5's template lists the functions itself and wraps a call in <tool_call> tags: the server renders
    tools, earlier calls and tool results through it, holds the answer to its tags, and returns the call."""
    from edgerun.model.loader import load_model

    tok = load_model(qwen_path).tokenizer
    assert tok.tool_tags == ("<tool_call>", "</tool_call>")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert "<tools>" in rendered and '"get_weather"' in rendered
    s = Serving("--model", str(qwen_path), "--api-key", API_KEY, "--no-cluster", "--max-context", "1024")
    try:
        client = s.client()
        weather = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        r = client.chat.completions.create(model="any", messages=weather, tools=[WEATHER, CLOCK],
                                           tool_choice="required", max_tokens=60, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        follow = [*weather, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
        r = client.chat.completions.create(model="any", messages=follow, tools=[WEATHER], tool_choice="none",
                                           max_tokens=40, temperature=0)
        assert r.choices[0].message.tool_calls is None and "18" in r.choices[0].message.content
        r = client.chat.completions.create(model="any", messages=follow, tools=[WEATHER], max_tokens=40,
                                           temperature=0)  # auto: prose, or a call in the template's tags
        message = r.choices[0].message
        assert (message.tool_calls is None) != (message.content is None) and (message.content or "x")[0] not in "{<"
    finally:
        s.close()


def test_parallel_caches_that_would_not_fit_are_refused() -> None:
    """--parallel's caches are allocated when the server starts: where they would take more than the memory free,
    the server refuses with a line that names the size and the options that shrink it."""
    from edgerun.model.config import ModelConfig
    from edgerun.serve.server import check_batch_memory

    config = ModelConfig("llama", 30, 576, 1536, 9, 3, 64, 49152, 10000.0, 1e-5, 8192, True, False)
    assert config.kv_cache_bytes(1) == 192 * 2 * 2 * 30  # K and V rows of 192 F16 values, every layer
    cache = config.kv_cache_bytes(8 * 8192)
    check_batch_memory(cache, 8, 8192, available=4 * cache)
    with pytest.raises(EdgerunError, match=r"--parallel 8 with a context of 8192 tokens keeps 1\.4 GiB.*"
                                           r"lower --parallel or --max-context"):
        check_batch_memory(cache, 8, 8192, available=cache)
