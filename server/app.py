"""The OpenAI-compatible HTTP API on FastAPI (Starlette), served by uvicorn; streaming is
Server-Sent Events through sse-starlette.

  GET  /health                    liveness and the queue (waiting, running, its bound)
  GET  /version                   the server's version
  GET  /metrics                   Prometheus text format (server.metrics)
  GET  /v1/models, /v1/models/ID  the one model served, with the engine's metadata
  POST /v1/chat/completions       messages through the chat template
  POST /v1/completions            one prompt or several (one choice each), text or token ids
  POST /tokenize, /detokenize     the model's tokenizer (vLLM's shapes)

Every client error is a 4xx with an OpenAI error body (uvicorn's own parser errors included:
server.http_errors) and leaves the server as it was. A 5xx means the engine failed (an expert
read, an expert file changed under it) or the server is shutting down; the next request runs
as usual. Load is bounded: a full queue answers 503 with Retry-After, a request past its time
limit ends with 408, a body not received in time with 408.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import protocol
from server.chat_template import render
from server.logprobs import TokenBytes, chat_logprobs, completion_logprobs
from server.metrics import Metrics
from server.worker import GenParams, Job, Worker

VERSION = "0.1.0"
DISCONNECT_POLL_S = 0.1  # how often a waiting non-streamed request checks for its client
STREAM_GRACE_S = 5.0  # at shutdown, time a stream has to send its error event and [DONE]
PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # what an API key guards


@dataclass
class ServeConfig:
    model_id: str  # the name clients ask for ("model")
    max_tokens: int = 512  # the most tokens one request may ask for
    context: int = 4096  # prompt + completion tokens the model can hold
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    max_queue: int = 64  # requests that may wait for the engine; beyond: 503
    request_timeout_s: float = 600.0  # arrival to last token; beyond: 408
    body_timeout_s: float = 30.0  # to receive a request's whole body; beyond: 408
    cors_origins: list[str] = field(default_factory=lambda: ["*"])
    created: int = 0  # the model's creation time (the manifest's mtime)
    metadata: dict = field(default_factory=dict)  # preset, prerouter, lora, sha


class AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed from a bad request cannot fail
    to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return AsciiJSON(protocol.error_body(message, kind, param, code), status_code=status,
                     headers=headers)


class BearerAuth:
    """ASGI middleware: the protected paths need `Authorization: Bearer KEY` (compared in
    constant time)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                scope["path"].startswith(PROTECTED):
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                return await _error(401, "invalid or missing API key (Authorization: Bearer "
                                    "...)", "authentication_error",
                                    code="invalid_api_key")(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets a 413 before the app sees any of it,
    whether it declares its length or comes chunked; a body not received within `timeout`
    seconds (a client that declared more than it sends) gets a 408. Read here, then handed
    on whole."""

    def __init__(self, app, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = _error(413, f"request body over {self.limit} bytes", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_big(scope, receive, send)
        body, more = [], True
        try:
            async with asyncio.timeout(self.timeout):
                while more:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left before the end
                        return
                    body.append(message.get("body", b""))
                    more = message.get("more_body", False)
                    if sum(map(len, body)) > self.limit:
                        return await too_big(scope, receive, send)
        except TimeoutError:
            slow = _error(408, f"request body not received within {self.timeout:g} s",
                          code="body_timeout", headers={"connection": "close"})
            return await slow(scope, receive, send)
        whole = {"type": "http.request", "body": b"".join(body), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: disconnects, as the server reports them

        return await self.app(scope, replay, send)


def _where(loc: tuple) -> str | None:
    """A validation error's location as the request spells it (pydantic's union branch
    tags, like 'list[str]', dropped)."""
    parts = [str(p) for p in loc[1:]
             if isinstance(p, int) or ("[" not in str(p) and str(p) not in
                                       ("str", "int", "float", "bool", "none"))]
    return ".".join(parts) or None


PROMPT_SHAPES = ("a string, a list of strings, a list of token ids or a list of lists of "
                 f"token ids (1 to {protocol.MAX_PROMPTS} prompts)")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the error that says most: a refusal, an unknown field, a bound,
    then a wrong type (of a union, the branch whose type matched says what is wrong)."""
    order = {"value_error": 0, "extra_forbidden": 1}

    def rank(e: dict) -> int:
        kind = str(e.get("type"))
        return order.get(kind, 3 if kind.endswith("_type") else 2)

    first = sorted(errors, key=rank)[0]
    where = _where(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return f"unknown or unsupported parameter '{where}'", where
    if where == "prompt":
        return f"prompt: must be {PROMPT_SHAPES}", where
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{where or 'body'}: {msg}", where


def create_app(worker: Worker, cfg: ServeConfig) -> FastAPI:
    shutdown = anyio.Event()  # set when the server starts to shut down

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        # called from a signal handler: the work runs on the event loop, not inside it
        app.state.begin_shutdown = lambda: loop.call_soon_threadsafe(begin_shutdown)
        worker.start()
        yield
        worker.close()  # cancels the running request; the caller flushes the trace

    app = FastAPI(title="ssdmoe", version=VERSION, lifespan=lifespan,
                  default_response_class=AsciiJSON,
                  description="OpenAI-compatible API on the ssdmoe streaming engine")
    tokenizer = worker.tokenizer
    as_bytes = TokenBytes(tokenizer)
    vocab = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else None
    metrics = Metrics(worker)
    worker.observe = metrics.observe

    def begin_shutdown() -> None:
        """End every queued and running request with a 503 (uvicorn's exit hook calls it)."""
        worker.shutdown()
        shutdown.set()

    app.state.begin_shutdown = begin_shutdown  # until the loop runs (lifespan)

    # plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, timeout=cfg.body_timeout_s)
    if cfg.api_key is not None:
        app.add_middleware(BearerAuth, key=cfg.api_key)
    if cfg.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors_origins,
                           allow_methods=["GET", "POST", "OPTIONS", "HEAD"],
                           allow_headers=["*"], max_age=600)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", code="invalid_json")
        message, where = validation_message(errors or [{}])
        return _error(400, message, param=where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error(err.status_code, str(err.detail), "invalid_request_error",
                      headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(err).__name__}", "server_error",
                      code="internal_error")

    def model_card() -> dict:
        return {"id": cfg.model_id, "object": "model", "created": cfg.created,
                "owned_by": "ssdmoe",
                "metadata": {"concurrency": 1, "scheduling": "fifo, one request at a time",
                             "max_tokens": cfg.max_tokens, "context": cfg.context,
                             **cfg.metadata}}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "shutting_down" if shutdown.is_set() else "ok",
                "model": cfg.model_id, "pending": worker.pending(),
                "queue": {"waiting": worker.queued(), "running": int(worker.running is not None),
                          "max": worker.max_queue}}

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> dict:
        return {"version": VERSION}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != cfg.model_id:
            return _not_served(model_id)
        return model_card()

    def _not_served(name: str) -> JSONResponse:
        return _error(404, f"model {name!r} does not exist (this server serves "
                      f"{cfg.model_id!r})", param="model", code="model_not_found")

    def encode(text: str, param: str, special: bool = True) -> list[int] | JSONResponse:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return _error(400, f"{param}: not valid Unicode text (a lone surrogate at "
                          f"character {err.start})", param=param, code="invalid_text")
        return tokenizer.encode(text) if special else tokenizer.encode(
            text, add_special_tokens=False)

    def check_ids(ids: list[int], param: str) -> JSONResponse | None:
        if vocab is not None and ids and max(ids) >= vocab:
            return _error(400, f"{param}: token id {max(ids)} is outside the vocabulary "
                          f"(0..{vocab - 1})", param=param)
        return None

    def limit_for(req: protocol.Sampling, prompt: list[int], param: str) -> JSONResponse | int:
        if not prompt:
            return _error(400, f"{param}: encodes to no tokens", param=param)
        limit = req.token_limit(min(cfg.max_tokens, max(cfg.context - len(prompt), 1)))
        if limit > cfg.max_tokens:
            return _error(400, f"max_tokens {limit} is over this server's limit of "
                          f"{cfg.max_tokens}", param="max_tokens")
        if len(prompt) + limit > cfg.context:
            return _error(400, f"{param} ({len(prompt)} tokens) + max_tokens ({limit}) is over "
                          f"the model's context of {cfg.context} tokens", param="max_tokens",
                          code="context_length_exceeded")
        return limit

    def params(req: protocol.Sampling, prompt: list[int], limit: int,
               logprobs: int | None) -> GenParams:
        return GenParams(prompt=prompt, max_tokens=limit,
                         temp=1.0 if req.temperature is None else req.temperature,
                         top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                         seed=req.seed, stops=req.stops(), logprobs=logprobs,
                         logit_bias=req.bias(), presence_penalty=req.presence_penalty,
                         frequency_penalty=req.frequency_penalty,
                         repetition_penalty=req.repetition_penalty)

    async def run(req: protocol.Sampling, prompts: list[list[int]], echoes: list[str] | None,
                  logprobs: int | None, kind: str, request: Request):
        if req.model != cfg.model_id:
            return _not_served(req.model)
        bad = check_ids(list(req.bias()), "logit_bias")
        if bad is not None:
            return bad
        loop = asyncio.get_running_loop()
        deadline = time.perf_counter() + cfg.request_timeout_s
        jobs = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            limit = limit_for(req, prompt, "messages" if kind == "chat" else param)
            if isinstance(limit, JSONResponse):
                return limit
            jobs.append(Job(worker.number(), params(req, prompt, limit, logprobs), loop,
                            deadline))
        if shutdown.is_set():
            return _error(503, "server shutting down", "server_error", code="shutting_down")
        if not worker.submit(jobs):
            metrics.rejected.inc()
            return _error(503, f"the queue is full ({worker.max_queue} requests waiting); "
                          "retry later", "server_error", code="queue_full",
                          headers={"retry-after": str(worker.retry_after(len(jobs)))})
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{jobs[0].number}-" \
              f"{uuid.uuid4().hex[:12]}"
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(stream(jobs, rid, kind, include, logprobs, echoes),
                                       ping=15, shutdown_event=shutdown,
                                       shutdown_grace_period=STREAM_GRACE_S)
        return await complete(jobs, rid, kind, logprobs, echoes, request)

    async def outcome(job: Job, request: Request, text: list, tokens: list):
        """Wait for a job's end, gathering its text and tokens; -> ("done", info) or
        ("error", info); None when the client left (the job is cancelled)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while True:
            try:
                event, data = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            if loop.time() - checked >= DISCONNECT_POLL_S:
                checked = loop.time()
                if await request.is_disconnected():  # nobody to answer: free the engine
                    return None
            if event == "delta":
                text.append(data["text"])
                tokens += data["tokens"]
            elif event is not None:
                return event, data

    async def complete(jobs: list[Job], rid: str, kind: str, logprobs: int | None,
                       echoes: list[str] | None, request: Request) -> JSONResponse:
        choices, done = [], []
        try:
            for i, job in enumerate(jobs):
                text, tokens = [], []
                ended = await outcome(job, request, text, tokens)
                if ended is None:
                    return _error(499, "client closed the request", code="cancelled")
                event, data = ended
                if event == "error":
                    return _error(data["status"], data["message"], data["type"],
                                  code=data["code"])
                done.append(data)
                choices.append(choice(i, kind, "".join(text), tokens, logprobs, data,
                                      echoes[i] if echoes else ""))
        finally:
            for job in jobs:  # the client left, or one sequence failed: free the engine
                job.cancelled.set()
        return AsciiJSON({
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": protocol.now(), "model": cfg.model_id,
            "system_fingerprint": cfg.metadata.get("fingerprint"), "choices": choices,
            "usage": protocol.usage(sum(d["prompt_tokens"] for d in done),
                                    sum(d["completion_tokens"] for d in done)),
            "ssdmoe": protocol.engine_timing(done[0])})

    def choice(index: int, kind: str, text: str, tokens: list, logprobs: int | None,
               data: dict, echo: str) -> dict:
        out: dict = {"index": index, "finish_reason": data["finish_reason"]}
        if kind == "chat":
            out["message"] = {"role": "assistant", "content": text}
            out["logprobs"] = chat_logprobs(tokens, as_bytes) if logprobs is not None else None
        else:
            out["text"] = echo + text
            out["logprobs"] = (completion_logprobs(tokens, as_bytes, len(echo))
                               if logprobs is not None else None)
        return out

    async def stream(jobs: list[Job], rid: str, kind: str, include_usage: bool,
                     logprobs: int | None, echoes: list[str] | None) -> AsyncIterator[dict]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        created = protocol.now()

        def chunk(index: int | None, body: dict | None = None, **extra) -> dict:
            out = {"id": rid, "object": obj, "created": created, "model": cfg.model_id,
                   "system_fingerprint": cfg.metadata.get("fingerprint"),
                   "choices": [] if body is None else [{"index": index, **body}], **extra}
            return {"data": json.dumps(out)}

        def piece(text: str, tokens: list | None, finish: str | None) -> dict:
            if kind == "chat":
                lp = chat_logprobs(tokens, as_bytes) if tokens and logprobs is not None \
                    else None
                return {"delta": {"content": text} if text or finish is None else {},
                        "logprobs": lp, "finish_reason": finish}
            lp = (completion_logprobs(tokens, as_bytes) if tokens and logprobs is not None
                  else None)
            return {"text": text, "logprobs": lp, "finish_reason": finish}

        totals = [0, 0]
        try:
            for i, job in enumerate(jobs):
                if kind == "chat":
                    yield chunk(i, {"delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None})
                elif echoes and echoes[i]:
                    yield chunk(i, piece(echoes[i], None, None))
                while True:
                    event, data = await job.events.get()
                    if event == "delta":
                        if data["text"] or (logprobs is not None and data["tokens"]):
                            yield chunk(i, piece(data["text"], data["tokens"], None))
                        continue
                    if event == "error":
                        yield {"data": json.dumps(protocol.error_body(
                            data["message"], data["type"], code=data["code"]))}
                        yield {"data": "[DONE]"}
                        return
                    totals[0] += data["prompt_tokens"]
                    totals[1] += data["completion_tokens"]
                    yield chunk(i, piece("", None, data["finish_reason"]),
                                ssdmoe=protocol.engine_timing(data))
                    break
            if include_usage:
                yield chunk(None, None, usage=protocol.usage(*totals))
            yield {"data": "[DONE]"}
        finally:
            for job in jobs:  # a client gone mid-stream frees the engine at the next token
                job.cancelled.set()

    @app.post("/v1/chat/completions")
    async def chat_completions(req: protocol.ChatRequest, request: Request):
        messages = [m.for_template() for m in req.messages]
        prompt = encode(render(tokenizer, messages), "messages")
        if isinstance(prompt, JSONResponse):
            return prompt
        return await run(req, [prompt], None, (req.top_logprobs or 0) if req.logprobs else None,
                         "chat", request)

    @app.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest, request: Request):
        prompts, echoes = [], []
        for i, p in enumerate(req.prompts()):
            param = "prompt" if isinstance(req.prompt, str) else f"prompt.{i}"
            ids = encode(p, param) if isinstance(p, str) else p
            if isinstance(ids, JSONResponse):
                return ids
            bad = check_ids(ids, param)
            if bad is not None:
                return bad
            prompts.append(ids)
            echoes.append((p if isinstance(p, str) else tokenizer.decode(p)) if req.echo else "")
        return await run(req, prompts, echoes if req.echo else None, req.logprobs,
                         "completion", request)

    @app.post("/tokenize")
    async def tokenize(req: protocol.TokenizeRequest):
        if req.model is not None and req.model != cfg.model_id:
            return _not_served(req.model)
        if req.messages is not None:
            ids = encode(render(tokenizer, [m.for_template() for m in req.messages]),
                         "messages")
        else:
            ids = encode(req.prompt or "", "prompt", req.add_special_tokens)
        if isinstance(ids, JSONResponse):
            return ids
        return {"count": len(ids), "max_model_len": cfg.context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: protocol.DetokenizeRequest):
        if req.model is not None and req.model != cfg.model_id:
            return _not_served(req.model)
        bad = check_ids(req.tokens, "tokens")
        if bad is not None:
            return bad
        return {"prompt": tokenizer.decode(req.tokens)}

    return app
