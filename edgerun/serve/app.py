"""The HTTP side of `edgerun serve`: OpenAI's API, /health, /metrics and the live dashboard, one Starlette
application on uvicorn.

Starlette because it is small, typed, asyncio-native (the engines' tokens arrive on the event loop through
call_soon_threadsafe), streams responses with disconnect detection built in, and runs on uvicorn with
uvloop, which edgerun already uses; nothing of a larger framework is needed."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from enum import Enum
from importlib import resources
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgerun.model.generate import GenerationResult, StopReason
from edgerun.model.loader import Model
from edgerun.model.logits import LogitShaper, TokenLogprob
from edgerun.model.sampling import MAX_SEED, USER_DEFAULTS, SamplingParams
from edgerun.net.typed import plain
from edgerun.profile.device import device_summary
from edgerun.serve import ollama_api
from edgerun.serve.clusters import Counters
from edgerun.serve.metrics import Metrics
from edgerun.serve.openai_api import (
    ApiError,
    Endpoint,
    GenerationRequest,
    ResponseIds,
    StopText,
    chunk,
    logprobs_object,
    parse_request,
    response,
    response_choice,
    usage_chunk,
)
from edgerun.serve.openapi import openapi
from edgerun.serve.service import Job, Service
from edgerun.serve.switch import EngineSwitch, Mode
from edgerun.serve.tools import CallTags, ToolCall, ToolChoice, answer_call

MAX_EMBEDDING_INPUTS = 256  # texts in one /v1/embeddings request
# A request whose client left before its answer (nginx's "client closed request"), as /metrics counts it.
CLIENT_LEFT = 499
STATE_INTERVAL_S = 1.0  # how often the dashboard's event stream sends the state


@dataclass(frozen=True)
class Piece:
    """Text of an answer that can be sent now, with the log-probabilities of its tokens (where asked for)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ApiConfig:
    model_name: str  # what /v1/models lists and responses name
    api_key: str | None  # bearer token the /v1 endpoints require; None: open
    default_max_tokens: int  # when a request names none (capped by the context left)
    max_body: int = 1 << 20  # bytes of a request body at most
    threads: int = 1  # of the embeddings' engine
    cors_origins: tuple[str, ...] = ()  # web pages of these origins may call the API ("*": any)
    metrics_public: bool = False  # /metrics without the API key
    sampling: SamplingParams = USER_DEFAULTS  # what a request leaves out of its sampling


class Api:
    """The handlers, over one Service."""

    def __init__(self, model: Model, service: Service, switch: EngineSwitch, metrics: Metrics,
                 config: ApiConfig) -> None:
        self.model, self.service, self.switch, self.metrics, self.config = model, service, switch, metrics, config
        self.started = time.time()
        self._embedder = None  # /v1/embeddings' engine, built at its first request
        self._embedder_lock = threading.Lock()
        self.device = device_summary()  # what the master runs on

    # --- OpenAI's endpoints -------------------------------------------------------------------------
    def _authorize(self, request: Request, query: bool = False) -> None:
        """With --api-key, the request must carry it: `Authorization: Bearer KEY` (the scheme in any case, RFC
        9110), or with `query` a `?key=KEY` (a browser's EventSource sends no headers)."""
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if query and request.query_params.get("key") == self.config.api_key:
            return
        if scheme.lower() != "bearer" or token.strip() != self.config.api_key:
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    def _model_card(self) -> dict[str, Any]:
        """OpenAI's model object of the one model served."""
        return {"id": self.config.model_name, "object": "model", "created": int(self.started), "owned_by": "edgerun"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def one_model(self, request: Request) -> Response:
        self._authorize(request)
        name = request.path_params["name"]
        if name != self.config.model_name:
            raise ApiError(404, f"no model {name!r} here: this server serves {self.config.model_name!r}",
                           kind="not_found_error", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        """llama.cpp's server's /tokenize: {"content": text} -> {"tokens": ids} (no BOS added)."""
        self._authorize(request)
        body = await self._body(request)
        text = body.get("content") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ApiError(400, "'content' must be a string", param="content")
        return JSONResponse({"tokens": await asyncio.to_thread(self.model.tokenizer.encode, text)})

    async def detokenize(self, request: Request) -> Response:
        """llama.cpp's server's /detokenize: {"tokens": ids} -> {"content": text}."""
        self._authorize(request)
        body = await self._body(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        vocab = self.model.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                                 for i in ids):
            raise ApiError(400, f"'tokens' must be a list of token ids from 0 to {vocab - 1}", param="tokens")
        return JSONResponse({"content": self.model.tokenizer.decode(ids)})

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's /v1/embeddings: each input's last-layer hidden states, final-normed, mean-pooled over its
        tokens and scaled to unit length (the model is a generator: its vectors suit similarity between texts,
        not a trained embedding model's uses)."""
        self._authorize(request)
        body = await self._body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts) or \
                len(texts) > MAX_EMBEDDING_INPUTS:
            raise ApiError(400, f"'input' must be a non-empty string or a list of 1 to {MAX_EMBEDDING_INPUTS} of "
                                "them (token arrays are not served)", param="input")
        form = body.get("encoding_format", "float")
        if form not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be float or base64", param="encoding_format")
        if body.get("dimensions") is not None:
            raise ApiError(400, f"'dimensions' is not served: the vectors have the model's "
                                f"{self.model.config.hidden}", param="dimensions")
        vectors, tokens = await asyncio.to_thread(self._embed, texts)
        data = [{"object": "embedding", "index": i,
                 "embedding": v.tolist() if form == "float" else base64.b64encode(v.astype("<f4").tobytes()).decode()}
                for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": self.config.model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _embed(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        """The inputs' vectors, one at a time on an engine of their own (built at the first request), and their
        tokens in all."""
        from edgerun.model.ggml_engine import GgmlEngine, check_supported
        from edgerun.model.reference import rms_norm

        with self._embedder_lock:
            if self._embedder is None:
                try:
                    check_supported(self.model)
                except Exception as e:
                    raise ApiError(400, f"embeddings are not served for this model: {e}") from e
                self._embedder = GgmlEngine(self.model, self.switch.max_len, threads=self.config.threads,
                                            head=False)
            engine, c = self._embedder, self.model.config
            vectors, total = [], 0
            for i, text in enumerate(texts):
                ids = self.model.tokenizer.encode(text)
                if len(ids) > engine.max_len:
                    raise ApiError(413, f"input[{i}] is {len(ids)} tokens; the context holds {engine.max_len}",
                                   param="input", code="context_length_exceeded")
                engine.reset()
                hidden = engine.run(engine.embed(np.asarray(ids, np.int64)))
                pooled = rms_norm(hidden, self.model.weights.output_norm, c.norm_eps).mean(axis=0)
                vectors.append((pooled / max(float(np.linalg.norm(pooled)), 1e-12)).astype(np.float32))
                total += len(ids)
            return vectors, total

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.COMPLETION)

    @functools.cached_property
    def tool_tags(self) -> CallTags | None:
        return CallTags.of(self.model.tokenizer)

    def _token_text(self, token: int) -> tuple[str, bytes]:
        """A token as logprobs show it: its text (a piece of a character shows as U+FFFD) and its own bytes."""
        tok = self.model.tokenizer
        return tok.decode([token]), tok.token_bytes(token)

    def _render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return self.model.tokenizer.apply_chat_template(messages, tools=tools)
        except Exception as e:  # the template's own raise_exception, or a model without one
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from e

    async def _body(self, request: Request) -> Any:
        """The request's JSON, read only up to the body limit: a larger one is refused as it arrives (or at once,
        where its Content-Length says so), not after it has been read and parsed whole."""
        limit = self.config.max_body
        declared = request.headers.get("content-length", "")
        too_big = ApiError(413, f"the body is larger than {limit} bytes (serve --max-body)", code="body_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        pieces, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise too_big
            pieces.append(piece)
        try:
            body = json.loads(b"".join(pieces))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON: {e}") from e
        _check_unicode(body, "the body")
        return body

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        self._authorize(request)
        body = await self._body(request)
        model_name = body.get("model") if isinstance(body, dict) else None
        if model_name is not None and not isinstance(model_name, str):
            raise ApiError(400, "'model' must be a string", param="model")
        req, jobs = await self._admit(lambda: parse_request(endpoint, body, self._render_chat, self.config.sampling,
                                                            self.model.config.vocab_size,
                                                            self.tool_tags))
        ids = ResponseIds.new(endpoint, self.config.model_name)
        if req.stream:
            return StreamingResponse(self._counted(request, jobs, self._sse_lines(jobs, req, ids, request),
                                                   lambda e: _sse(ApiError(500, f"generation failed: {e}",
                                                                           kind="server_error").body())),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        answers = await self._answer(request, jobs, req)
        if answers is None:  # its client left: nobody reads this
            return Response(status_code=CLIENT_LEFT)
        choices = []
        for index, (text, result, entries) in enumerate(answers):
            call = None if req.tools is None else answer_call(text, req.tools)
            logprobs = None if req.rules.top_logprobs is None else \
                logprobs_object(endpoint, entries, self._token_text)
            choices.append(response_choice(endpoint, index, text, _finish(result), logprobs, call))
        return JSONResponse(response(endpoint, ids, choices, *_counts([r for _, r, _ in answers])))

    async def _admit(self, parse: Callable[[], GenerationRequest]) -> tuple[GenerationRequest, list[Job]]:
        """The request parsed and its prompt tokenized, then queued, a job per choice (n). Rendering the chat template
        and tokenizing take milliseconds to seconds for a long prompt: off the event loop, which meanwhile serves
        every other request."""
        def prepare() -> tuple[GenerationRequest, list[int], list[LogitShaper | None]]:
            try:
                req = parse()
            except ValueError as e:  # the sampler's own checks
                raise ApiError(400, str(e)) from e
            prompt = self.model.tokenizer.encode(req.prompt)
            # The grammar is compiled here, off the event loop (milliseconds to a second for a large schema); each
            # choice draws through its own.
            shapers = [LogitShaper(req.rules, self.model.tokenizer, prompt, self.model.config.vocab_size)
                       if req.rules.active else None for _ in range(req.n)]
            return req, prompt, shapers

        req, prompt, shapers = await asyncio.to_thread(prepare)
        return req, self._submit(req, prompt, shapers)

    def _submit(self, req: GenerationRequest, prompt: list[int], shapers: list[LogitShaper | None]) -> list[Job]:
        """The request into the queue, a job per choice, choice i drawn with the request's seed + i (so each choice
        is the request alone with that seed); its max tokens checked against the context (413 where they overrun
        it)."""
        context = self.switch.max_len
        room = context - len(prompt)
        if room < 1:
            raise ApiError(413, f"the prompt is {len(prompt)} tokens; the context holds {context}",
                           code="context_length_exceeded")
        max_tokens = min(self.config.default_max_tokens, room) if req.max_tokens is None else req.max_tokens
        if max_tokens > room:
            raise ApiError(413, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                           f"context of {context}", param="max_tokens", code="context_length_exceeded")
        seed = req.sampling.seed
        return self.service.submit_many(prompt, max_tokens, [
            (req.sampling if i == 0 or seed is None else replace(req.sampling, seed=(seed + i) % MAX_SEED), shaper)
            for i, shaper in enumerate(shapers)])

    async def _answer(self, request: Request, jobs: list[Job],
                      req: GenerationRequest) -> list[tuple[str, GenerationResult, list[TokenLogprob]]] | None:
        """Every choice's whole text and result, counted in /metrics; None (counted as CLIENT_LEFT) where its
        client left meanwhile, which stopped the jobs at their next token."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, jobs))
        try:
            answers = list(await asyncio.gather(*(self._collect(job, req) for job in jobs)))
        finally:
            watcher.cancel()
        if watcher.done() and not watcher.cancelled() and watcher.result():
            self.metrics.request_done(CLIENT_LEFT)
            return None
        self.metrics.request_done(200)
        request.state.tokens = _counts([r for _, r, _ in answers])
        return answers

    async def _counted(self, request: Request, jobs: list[Job], lines: AsyncIterator[str],
                       failure: Callable[[Exception], str]) -> AsyncIterator[str]:
        """A streamed answer's lines, counted in /metrics as it ends: 200, or 500 with the error as the last line
        (`failure`: the headers are sent), or CLIENT_LEFT where its client went away (Starlette cancels the stream);
        its jobs stop with it."""
        try:
            async for line in lines:
                yield line
            self.metrics.request_done(200)
        except Exception as e:
            self.metrics.request_done(500)
            yield failure(e)
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.request_done(CLIENT_LEFT)
            raise
        finally:
            for job in jobs:
                job.cancel()

    async def _sse_lines(self, jobs: list[Job], req: GenerationRequest, ids: ResponseIds,
                         request: Request) -> AsyncIterator[str]:
        """Server-sent events: every choice's chunks as they come (_choice_lines), then the usage if asked (the
        prompt counted once) and [DONE]."""
        if len(jobs) == 1:  # the common case, without tasks
            choices = self._choice_lines(jobs[0], req, ids, 0)
        else:
            choices = _merged([self._choice_lines(job, req, ids, i) for i, job in enumerate(jobs)])
        results: list[GenerationResult] = []
        async for item in choices:
            if isinstance(item, GenerationResult):
                results.append(item)
            else:
                yield item
        tokens = _counts(results)
        if req.include_usage:
            yield _sse(usage_chunk(req.endpoint, ids, *tokens))
        yield "data: [DONE]\n\n"
        request.state.tokens = tokens

    async def _choice_lines(self, job: Job, req: GenerationRequest, ids: ResponseIds,
                            index: int) -> AsyncIterator[str | GenerationResult]:
        """One choice's server-sent events: a first chunk with the role, the text as it comes (with its tokens'
        logprobs where asked), a closing chunk with the finish reason; then its result. An answer that may be a
        tool call is sent whole at its end: either its text or the call."""
        yield _sse(chunk(req.endpoint, ids, "", first=True, index=index))
        sent = 0  # characters of the answer sent so far (completions' logprobs count text offsets)
        called = False
        async for piece in self._answer_pieces(job, req):
            if isinstance(piece, ToolCall):
                called = True
                yield _sse(chunk(req.endpoint, ids, None, call=piece, index=index))
            elif isinstance(piece, Piece):
                yield self._sse_piece(req, ids, piece, sent, index)
                sent += len(piece.text)
            else:
                yield _sse(chunk(req.endpoint, ids, None, _finish(piece), called=called, index=index))
                yield piece

    async def _answer_pieces(self, job: Job,
                             req: GenerationRequest) -> AsyncIterator[Piece | ToolCall | GenerationResult]:
        """The job's pieces as a stream sends them: as they come, or, for an answer that may be a tool call, held
        until it is whole and then sent as the call or as one piece of text; the result last."""
        may_call = req.tools is not None and req.tools.choice != ToolChoice.NONE
        held: list[Piece] = []
        async for piece in self._pieces(job, req):
            if isinstance(piece, GenerationResult):
                text = "".join(p.text for p in held)
                call = answer_call(text, req.tools) if may_call and req.tools is not None else None
                if call is not None:
                    yield call
                elif held:
                    yield Piece(text, tuple(e for p in held for e in p.logprobs))
                yield piece
                return
            if may_call:
                held.append(piece)
            else:
                yield piece

    def _sse_piece(self, req: GenerationRequest, ids: ResponseIds, piece: Piece, sent: int, index: int) -> str:
        logprobs = None if req.rules.top_logprobs is None else \
            logprobs_object(req.endpoint, piece.logprobs, self._token_text, sent)
        return _sse(chunk(req.endpoint, ids, piece.text, logprobs=logprobs, index=index))

    # --- Ollama's endpoints (ollama_api) ------------------------------------------------------------
    async def ollama_chat(self, request: Request) -> Response:
        return await self._ollama(request, chat=True)

    async def ollama_generate(self, request: Request) -> Response:
        return await self._ollama(request, chat=False)

    async def _ollama(self, request: Request, chat: bool) -> Response:
        self._authorize(request)
        body = await self._body(request)
        started = time.perf_counter()
        req, jobs = await self._admit(lambda: ollama_api.parse(chat, body, self._render_chat, self.config.sampling,
                                                               self.tool_tags))
        job = jobs[0]  # Ollama's requests have one answer
        if req.stream:
            return StreamingResponse(self._counted(request, jobs, self._ndjson_lines(job, req, chat, request, started),
                                                   lambda e: json.dumps({"error": f"generation failed: {e}"}) + "\n"),
                                     media_type="application/x-ndjson", headers={"cache-control": "no-cache"})
        answers = await self._answer(request, jobs, req)
        if answers is None:
            return Response(status_code=CLIENT_LEFT)
        text, result, entries = answers[0]
        call = None if req.tools is None else answer_call(text, req.tools)
        shown = None if req.rules.top_logprobs is None else ollama_api.logprobs(entries, self._token_text)
        return JSONResponse(ollama_api.final(self.config.model_name, chat, "" if call else text, _finish(result),
                                             result.prompt_tokens, len(result.tokens), started, result.prefill_s,
                                             result.decode_s, call, shown))

    async def _ndjson_lines(self, job: Job, req: GenerationRequest, chat: bool, request: Request,
                            started: float) -> AsyncIterator[str]:
        """Ollama's NDJSON: a line per piece of text, then the closing line with the counts. An answer that may be a
        tool call is sent whole at its end: a line with its text or its call."""
        name = self.config.model_name
        async for piece in self._answer_pieces(job, req):
            if isinstance(piece, ToolCall):
                yield json.dumps(ollama_api.piece(name, chat, "", piece), ensure_ascii=False) + "\n"
            elif isinstance(piece, Piece):
                shown = None if req.rules.top_logprobs is None else \
                    ollama_api.logprobs(piece.logprobs, self._token_text)
                yield json.dumps(ollama_api.piece(name, chat, piece.text, None, shown), ensure_ascii=False) + "\n"
            else:
                yield json.dumps(ollama_api.final(name, chat, "", _finish(piece), piece.prompt_tokens,
                                                  len(piece.tokens), started, piece.prefill_s, piece.decode_s)) + "\n"
                request.state.tokens = (piece.prompt_tokens, len(piece.tokens))

    async def ollama_tags(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(ollama_api.tags(self.model, self.config.model_name))

    async def ollama_show(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(ollama_api.show(self.model, self.config.model_name, await self._body(request)))

    async def ollama_version(self, request: Request) -> Response:
        return JSONResponse({"version": ollama_api.VERSION})

    async def _pieces(self, job: Job, req: GenerationRequest) -> AsyncIterator[Piece | GenerationResult]:
        """The job's text as it can be sent (cut at a stop string, which cancels the job), each piece with the
        logprobs of the tokens since the last (the shaper keeps them, one a token, before the token is put), then
        its result."""
        decoder = self.model.tokenizer.stream_decoder()
        stops = StopText(req.stop)
        logprobs = [] if job.shaper is None or req.rules.top_logprobs is None else job.shaper.logprobs
        tokens = taken = 0
        while True:
            item = await job.out.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, GenerationResult):
                tail = stops.push(decoder.flush())
                tail += stops.flush()
                if tail or taken < len(logprobs[:tokens]):
                    yield Piece(tail, tuple(logprobs[taken:tokens]))
                yield item
                return
            if not stops.stopped:  # tokens after a stop string (made before the cancel took) are not the answer's
                tokens += 1
            text = stops.push(decoder.push(item))
            if stops.stopped:
                job.cancel()
            if text:
                yield Piece(text, tuple(logprobs[taken:tokens]))
                taken = min(tokens, len(logprobs))

    async def _collect(self, job: Job, req: GenerationRequest) -> tuple[str, GenerationResult, list[TokenLogprob]]:
        pieces: list[Piece] = []
        async for piece in self._pieces(job, req):
            if isinstance(piece, GenerationResult):
                return "".join(p.text for p in pieces), piece, [e for p in pieces for e in p.logprobs]
            pieces.append(piece)
        raise RuntimeError("a job ended without its result")

    # --- operations ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What the dashboard and `edgerun status` show."""
        sw, cluster = self.switch, self.switch.cluster
        now = time.time()
        per_second = [0] * 120
        for t in list(self.service.tokens_log):
            age = int(now - t)
            if 0 <= age < 120:
                per_second[119 - age] += 1
        counters = Counters() if cluster is None else cluster.counters()
        plan = cluster.plan() if cluster is not None and sw.planned_for else None
        return {
            "model": self.config.model_name, "mode": sw.mode.value, "uptime_s": now - self.started,
            "device": self.device,
            "cluster": None if cluster is None else cluster.kind,
            "single_ms_per_token": sw.single_ms,
            "measured_ms_per_token": {m.value: v for m, v in sw.measured_ms.items()},
            "plan": None if plan is None else plain(plan),
            "nodes": [] if cluster is None else [plain(n) for n in cluster.nodes()],
            "queue": {"waiting": self.service.waiting, "busy": self.service.busy, "running": self.service.running,
                      "parallel": self.service.parallel, "reused_prompt_tokens": self.service.reused_prompt_tokens},
            "tokens_per_second": per_second,
            **plain(counters),
            "recoveries": self.metrics.recoveries,
            "events": [{"at": e.at, "text": e.text} for e in list(sw.events)],
        }

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(openapi(self.config.model_name))

    async def health(self, request: Request) -> Response:
        s = self.state()
        return JSONResponse({"status": "ok", "model": s["model"], "mode": s["mode"],
                             "nodes": sum(n["alive"] for n in s["nodes"]), "queue": s["queue"]})

    async def metrics_text(self, request: Request) -> Response:
        if not self.config.metrics_public:
            self._authorize(request)
        s = self.state()
        alive = sum(n["alive"] for n in s["nodes"])
        gauges = {
            "edgerun_nodes__state": ("Nodes by state.", {"alive": alive, "lost": len(s["nodes"]) - alive}),
            "edgerun_mode__mode": ("What generates: 1 for the engine in use.",
                                   {m.value: float(s["mode"] == m.value) for m in Mode}),
            "edgerun_queue_requests": ("Requests queued or running.", {"": s["queue"]["waiting"]}),
        }
        counters = {
            "edgerun_blocks_total": ("Tensor-parallel blocks merged.", s["blocks"]),
            "edgerun_blocks_incomplete_total": ("Blocks merged without some node's partial.", s["blocks_incomplete"]),
            "edgerun_packets_late_total": ("Partials that came after their block was merged.", s["late_packets"]),
            "edgerun_packets_rejected_total": ("Packets refused (bad tag, malformed, unexpected).", s["rejected"]),
        }
        return PlainTextResponse(self.metrics.render(gauges, counters),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def state_json(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self.state())

    async def state_events(self, request: Request) -> Response:
        self._authorize(request, query=True)

        async def events() -> AsyncIterator[str]:
            while True:
                yield f"data: {json.dumps(self.state())}\n\n"
                await asyncio.sleep(STATE_INTERVAL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(resources.files("edgerun.serve").joinpath("dashboard.html").read_text("utf-8"))


def _check_unicode(value: Any, where: str) -> None:
    """Refuse text that is not Unicode: JSON's escapes can spell a lone surrogate ("\\ud83d", what JavaScript
    leaves when it cuts an emoji in two), which no tokenizer or UTF-8 answer can carry."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{where} holds invalid Unicode (a lone surrogate at character {e.start})") from e
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, f"'{key}'" if where == "the body" else where)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item, where)


def _finish(result: GenerationResult) -> StopReason:
    """Why an answer ended, as the client hears it: a job cancelled with its client still there was cut by a
    stop string."""
    return StopReason.STOP_TOKEN if result.stop_reason == StopReason.CANCELLED else result.stop_reason


def _counts(results: list[GenerationResult]) -> tuple[int, int]:
    """A request's usage from its choices' results: the prompt's tokens once, every choice's completion tokens."""
    return results[0].prompt_tokens, sum(len(r.tokens) for r in results)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _cancel_on_disconnect(request: Request, jobs: list[Job]) -> bool:
    """A non-streaming request whose client leaves: its jobs stop at the next token. True once it has left."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for job in jobs:
                    job.cancel()
                return True
    return False


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as each comes (one task each); the first error is raised, and the
    others are stopped with it or when the consumer stops."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((0, item))
            await queue.put((0, done))
        except Exception as e:
            await queue.put((1, e))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            failed, item = await queue.get()
            if failed:
                raise item
            if item is done:
                running -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    ollama = request.url.path in ollama_api.PATHS
    if exc.status >= 400 and (request.url.path.startswith("/v1/") or ollama):
        request.app.state.metrics.request_done(exc.status)
    headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    body = {"error": exc.message} if ollama else exc.body()  # each API's own error shape
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Anything unforeseen: OpenAI's error JSON with a 500, counted, never a bare text page."""
    if request.url.path.startswith("/v1/"):
        request.app.state.metrics.request_done(500)
    return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(),
                        status_code=500)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind=kind).body(), status_code=exc.status_code)


class LogFormat(Enum):
    TEXT = "text"
    JSON = "json"


class RequestLog:
    """One line per HTTP request once it is answered (a stream once it ends): method, path, status, a generation's
    prompt and completion tokens, milliseconds. ASGI middleware around the whole app."""

    def __init__(self, app: ASGIApp, log: Callable[[str], None], form: LogFormat) -> None:
        self.app, self.log, self.form = app, log, form

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [0]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            ms = (time.perf_counter() - started) * 1e3
            tokens = scope.get("state", {}).get("tokens")  # (prompt, completion), set by a generation
            if self.form is LogFormat.JSON:
                entry = {"method": scope["method"], "path": scope["path"], "status": status[0] or CLIENT_LEFT,
                         "ms": round(ms, 1)}
                if tokens:
                    entry |= {"prompt_tokens": tokens[0], "completion_tokens": tokens[1]}
                self.log(json.dumps(entry))
            else:
                spent = f" {tokens[0]}+{tokens[1]} tokens" if tokens else ""
                self.log(f"{scope['method']} {scope['path']} {status[0] or CLIENT_LEFT}{spent} {ms:.0f} ms")


def build_app(api: Api, log: Callable[[str], None] | None = None, log_format: LogFormat = LogFormat.TEXT) -> Starlette:
    """The API and dashboard (the cluster's members come to its own port, not here); with `log`, one line per
    request (RequestLog)."""
    app = Starlette(routes=[
        Route("/", api.dashboard),
        Route("/health", api.health),
        Route("/openapi.json", api.openapi_json),
        Route("/metrics", api.metrics_text),
        Route("/api/state", api.state_json),
        Route("/api/events", api.state_events),
        Route("/v1/models", api.models),
        Route("/v1/models/{name:path}", api.one_model),
        Route("/v1/embeddings", api.embeddings, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/api/chat", api.ollama_chat, methods=["POST"]),
        Route("/api/generate", api.ollama_generate, methods=["POST"]),
        Route("/api/tags", api.ollama_tags),
        Route("/api/show", api.ollama_show, methods=["POST"]),
        Route("/api/version", api.ollama_version),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ], exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        middleware=([Middleware(RequestLog, log=log, form=log_format)] if log is not None else []) +
        ([Middleware(CORSMiddleware, allow_origins=list(api.config.cors_origins), allow_methods=["GET", "POST"],
                     allow_headers=["authorization", "content-type"], max_age=600)] if api.config.cors_origins else []))
    app.state.metrics = api.metrics
    return app
