"""The OpenAI-compatible HTTP API on FastAPI (Starlette), served by uvicorn; streaming is
Server-Sent Events through sse-starlette.

  GET  /health               liveness, and how many requests are queued or running
  GET  /v1/models            the one model served, with the engine's metadata (single request
                             at a time, FIFO; preset, heads, adapter)
  POST /v1/chat/completions  messages through the chat template
  POST /v1/completions       a raw prompt

Every bad request gets a 4xx with an OpenAI-style error body and leaves the server as it was;
an engine failure (an expert read that fails) gets a 500 naming the layer, expert and file, and
the next request runs as usual.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import protocol
from server.chat_template import render
from server.worker import GenParams, Job, Worker

DISCONNECT_POLL_S = 0.1  # how often a waiting non-streamed request checks for its client


@dataclass
class ServeConfig:
    model_id: str  # the name clients ask for ("model")
    max_tokens: int = 512  # the most tokens one request may ask for
    context: int = 4096  # prompt + completion tokens the model can hold
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    metadata: dict = field(default_factory=dict)  # preset, prerouter, lora, sha


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, kind, param, code), status_code=status)


class BearerAuth:
    """ASGI middleware: /v1/ needs `Authorization: Bearer KEY` (compared in constant time)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                return await _error(401, "invalid or missing API key (Authorization: Bearer "
                                    "...)", "authentication_error",
                                    code="invalid_api_key")(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets a 413 before the app sees any of it,
    whether it declares its length or comes chunked (read here, at most `limit` bytes, then
    handed on whole)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = _error(413, f"request body over {self.limit} bytes", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_big(scope, receive, send)
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.limit:
                return await too_big(scope, receive, send)
        whole = {"type": "http.request", "body": b"".join(body), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: disconnects, as the server reports them

        return await self.app(scope, replay, send)


def create_app(worker: Worker, cfg: ServeConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.close()  # cancels the running request; the caller flushes the trace

    app = FastAPI(title="ssdmoe", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API on the ssdmoe streaming engine")
    tokenizer = worker.tokenizer

    # plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    if cfg.api_key is not None:
        app.add_middleware(BearerAuth, key=cfg.api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", code="invalid_json")
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error(err.status_code, str(err.detail), "invalid_request_error")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": cfg.model_id, "pending": worker.pending()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": cfg.model_id, "object": "model", "created": 0, "owned_by": "ssdmoe",
            "metadata": {"concurrency": 1, "scheduling": "fifo, one request at a time",
                         "max_tokens": cfg.max_tokens, "context": cfg.context,
                         **cfg.metadata}}]}

    def check(req: protocol.Sampling, prompt: list[int]) -> JSONResponse | int:
        if req.model != cfg.model_id:
            return _error(404, f"model {req.model!r} does not exist (this server serves "
                          f"{cfg.model_id!r})", param="model", code="model_not_found")
        if not prompt:
            return _error(400, "the prompt encodes to no tokens", param="prompt")
        limit = req.token_limit(min(cfg.max_tokens, max(cfg.context - len(prompt), 1)))
        if limit > cfg.max_tokens:
            return _error(400, f"max_tokens {limit} is over this server's limit of "
                          f"{cfg.max_tokens}", param="max_tokens")
        if len(prompt) + limit > cfg.context:
            return _error(400, f"prompt ({len(prompt)} tokens) + max_tokens ({limit}) is over "
                          f"the model's context of {cfg.context} tokens", param="max_tokens",
                          code="context_length_exceeded")
        return limit

    def params(req: protocol.Sampling, prompt: list[int], limit: int,
               logprobs: int | None) -> GenParams:
        return GenParams(prompt=prompt, max_tokens=limit,
                         temp=1.0 if req.temperature is None else req.temperature,
                         top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                         seed=req.seed, stops=req.stops(), logprobs=logprobs)

    async def run(req: protocol.Sampling, prompt: list[int], logprobs: int | None,
                  kind: str, request: Request):
        limit = check(req, prompt)
        if isinstance(limit, JSONResponse):
            return limit
        job = Job(worker.number(), params(req, prompt, limit, logprobs),
                  asyncio.get_running_loop())
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{job.number}-{uuid.uuid4().hex[:12]}"
        worker.submit(job)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(stream(job, rid, kind, include, logprobs, len(prompt)),
                                       ping=15)
        return await complete(job, rid, kind, logprobs, len(prompt), request)

    async def complete(job: Job, rid: str, kind: str, logprobs: int | None, n_prompt: int,
                       request: Request) -> JSONResponse:
        text, tokens = [], []
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                try:
                    event, data = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    event = None
                if loop.time() - checked >= DISCONNECT_POLL_S:
                    checked = loop.time()
                    if await request.is_disconnected():  # nobody to answer: free the engine
                        job.cancelled.set()
                        return _error(499, "client closed the request", code="cancelled")
                if event is None:
                    continue
                if event == "delta":
                    text.append(data["text"])
                    tokens += data["tokens"]
                elif event == "error":
                    return _error(data["status"], data["message"], data["type"],
                                  code=data["code"])
                else:
                    break
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        out = "".join(text)
        choice: dict = {"index": 0, "finish_reason": data["finish_reason"]}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": out}
            choice["logprobs"] = protocol.chat_logprobs(tokens) if logprobs is not None else None
        else:
            choice["text"] = out
            choice["logprobs"] = (protocol.completion_logprobs(tokens)
                                  if logprobs is not None else None)
        return JSONResponse({
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": protocol.now(), "model": cfg.model_id,
            "system_fingerprint": cfg.metadata.get("fingerprint"), "choices": [choice],
            "usage": protocol.usage(n_prompt, data["completion_tokens"]),
            "ssdmoe": protocol.engine_timing(data)})

    async def stream(job: Job, rid: str, kind: str, include_usage: bool,
                     logprobs: int | None, n_prompt: int) -> AsyncIterator[dict]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        created = protocol.now()

        def chunk(choice: dict | None, **extra) -> dict:
            body = {"id": rid, "object": obj, "created": created, "model": cfg.model_id,
                    "system_fingerprint": cfg.metadata.get("fingerprint"),
                    "choices": [] if choice is None else [{"index": 0, **choice}], **extra}
            return {"data": json.dumps(body)}

        def piece(text: str, tokens: list | None, finish: str | None) -> dict:
            if kind == "chat":
                lp = protocol.chat_logprobs(tokens) if tokens and logprobs is not None else None
                return {"delta": {"content": text} if text or finish is None else {},
                        "logprobs": lp, "finish_reason": finish}
            lp = (protocol.completion_logprobs(tokens) if tokens and logprobs is not None
                  else None)
            return {"text": text, "logprobs": lp, "finish_reason": finish}

        try:
            if kind == "chat":
                yield chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            while True:
                event, data = await job.events.get()
                if event == "delta":
                    if data["text"] or (logprobs is not None and data["tokens"]):
                        yield chunk(piece(data["text"], data["tokens"], None))
                elif event == "error":
                    yield {"data": json.dumps(protocol.error_body(
                        data["message"], data["type"], code=data["code"]))}
                    return
                else:
                    yield chunk(piece("", None, data["finish_reason"]),
                                ssdmoe=protocol.engine_timing(data))
                    if include_usage:
                        yield chunk(None, usage=protocol.usage(n_prompt,
                                                               data["completion_tokens"]))
                    yield {"data": "[DONE]"}
                    return
        finally:
            job.cancelled.set()  # a client gone mid-stream frees the engine at the next token

    @app.post("/v1/chat/completions")
    async def chat_completions(req: protocol.ChatRequest, request: Request):
        prompt = tokenizer.encode(render(tokenizer, [m.model_dump() for m in req.messages]))
        return await run(req, prompt, (req.top_logprobs or 0) if req.logprobs else None,
                         "chat", request)

    @app.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest, request: Request):
        return await run(req, tokenizer.encode(req.text()), req.logprobs, "completion",
                         request)

    return app
