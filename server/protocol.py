"""The OpenAI API's request bodies as pydantic models (what FastAPI validates and documents in
the server's OpenAPI schema), the error body, and the response objects. No MLX.

Every parameter a request may carry is either honoured or refused with a 400 that names it:
unknown fields are refused (`extra="forbid"`), and the OpenAI parameters this single-sequence
engine does not implement (tools, structured output, several choices, suffix insertion) are
declared so that their no-op values (`n: 1`, `tools: []`, `response_format: {"type": "text"}`)
pass and anything else gets a reason. Types are strict: `"3"` is not a number, `"yes"` is not
a boolean.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_PROMPTS = 16  # prompts in one completions request (each runs as its own sequence)

Penalty = Annotated[float | None, Field(None, ge=-2, le=2)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    model_config = ConfigDict(extra="allow", strict=True)  # an image part's fields: refused below

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported (text "
                             "only)")
        if self.text is None:
            raise ValueError("a text part needs its 'text'")
        return self


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # passed to the chat template, as OpenAI's clients set it

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def for_template(self) -> dict[str, str]:
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(Strict):
    include_usage: bool = False


def _refuse(why: str) -> None:
    """A parameter this server does not implement (the message is prefixed with its name)."""
    raise ValueError(f"not supported by this server: {why}")


class Sampling(Strict):
    """Parameters both endpoints take."""

    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # mlx-lm's extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=300)
    n: int = 1
    user: str | None = None  # an end-user id: OpenAI's is for abuse monitoring; no effect here

    @field_validator("n")
    @classmethod
    def one_choice(cls, n: int) -> int:
        if n != 1:
            _refuse("one choice per prompt (the engine serves one sequence at a time)")
        return n

    @field_validator("logit_bias")
    @classmethod
    def token_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key[:40]!r}")
        return bias

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def no_tools(cls, tools: list | None) -> list | None:
        if tools:
            _refuse("tool calls are not implemented")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def no_tool_choice(cls, choice: str | dict | None) -> str | dict | None:
        if choice not in (None, "none"):
            _refuse("tool calls are not implemented")
        return choice

    @field_validator("response_format")
    @classmethod
    def text_format(cls, fmt: dict | None) -> dict | None:
        if fmt is not None and fmt != {"type": "text"}:
            _refuse(f"only {{'type': 'text'}}; structured output ({str(fmt.get('type'))[:40]!r}) "
                    "is not implemented")
        return fmt


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(Sampling):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1,
                                                          max_length=MAX_PROMPTS)])
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            _refuse("one sequence per prompt")
        return best_of

    @field_validator("suffix")
    @classmethod
    def no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            _refuse("insertion is not implemented")
        return suffix

    @model_validator(mode="after")
    def echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported by this server: the prompt's "
                             "log-probabilities are not computed")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 16)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def engine_timing(done: dict) -> dict:
    """The engine's own figures for a request (an extension field clients may ignore): how
    long it queued, its prefill, and its decode rate inside the server."""
    return {"queued_s": round(done["queued_s"], 6), "prefill_s": round(done["prefill_s"], 6),
            "decode_tok_s": round(done["decode_tok_s"], 3)}


def now() -> int:
    return int(time.time())
