"""The OpenAI API's request bodies as pydantic models (what FastAPI validates and documents in
the server's OpenAPI schema), the error body, and the response objects. No MLX."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Parameters both endpoints take. Unknown fields are ignored, as OpenAI's clients send
    some the engine has no use for."""
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, max_length=4)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice: the engine serves one sequence at a time
    user: str | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(Sampling):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else "".join(self.prompt)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(tokens: list[dict]) -> dict:
    return {"content": [{"token": t["text"], "logprob": t["logprob"],
                         "bytes": list(t["text"].encode()),
                         "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())}
                                          for a, lp in t["top"]]} for t in tokens]}


def completion_logprobs(tokens: list[dict], offset: int = 0) -> dict:
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t["text"])
    return {"tokens": [t["text"] for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [dict(t["top"]) for t in tokens], "text_offset": offsets}


def engine_timing(done: dict) -> dict:
    """The engine's own figures for a request (an extension field clients may ignore): how
    long it queued, its prefill, and its decode rate inside the server."""
    return {"queued_s": round(done["queued_s"], 6), "prefill_s": round(done["prefill_s"], 6),
            "decode_tok_s": round(done["decode_tok_s"], 3)}


def now() -> int:
    return int(time.time())
