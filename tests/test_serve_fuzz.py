"""No request makes `ssdmoe serve` answer 5xx: schemathesis over every operation of its own
OpenAPI schema, with the model name fixed to the served one so that requests reach the engine,
and a hypothesis strategy of text with lone surrogates and control characters in every string
a request carries. Seeds are fixed and the examples bounded, so CI runs the same cases each
time. Every answer is JSON (an OpenAI error body for the 4xx)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from serve_helpers import Server

pytestmark = pytest.mark.slow
MODEL = "tiny"
EXAMPLES = 30


@pytest.fixture(scope="module")
def server(tiny_random_converted):
    srv = Server(tiny_random_converted, "--preset", "on-demand", "--max-tokens-limit", "8",
                 "--model-id", MODEL)
    yield srv
    code, err = srv.stop()
    assert code == 0, err


def served_model_schema(raw: dict) -> dict:
    """The server's schema with every request's `model` fixed to the served name."""
    for body in raw["components"]["schemas"].values():
        props = body.get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": [MODEL]}
    return raw


def test_schemathesis_over_every_operation_finds_no_5xx(server):
    import schemathesis

    raw = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(served_model_schema(raw))
    seen: list[tuple[str, int]] = []

    def fuzz(op) -> None:
        @seed(20261205)
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), database=None)
        def call(case):
            r = case.call(base_url=server.url, timeout=60)
            seen.append((op.path, r.status_code))
            assert r.status_code < 500, (op.path, r.status_code, r.text[:300])
            if r.status_code >= 400 and case.method != "HEAD":
                assert r.json()["error"]["message"], (case.method, op.path, r.status_code,
                                                      r.text[:300])

        call()

    for result in schema.get_all_operations():
        fuzz(result.ok())
    paths = {p for p, _ in seen}
    assert paths >= {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
                     "/health", "/metrics", "/v1/models/{model_id}"}
    generated = [s for p, s in seen if p in ("/v1/chat/completions", "/v1/completions")]
    assert any(s == 200 for s in generated), "no request reached the engine"
    assert any(400 <= s < 500 for s in generated)


# every category, with lone surrogates (Cs), control and format characters drawn often
hostile = st.lists(st.one_of(
    st.sampled_from(["\ud800", "\udfff", "\x00", "\x1b[2J", "\x7f", "\u202e", "\ufeff"]),
    st.characters(categories=["Cs", "Cc", "Cf", "L", "N", "P", "S", "Z"])),
    max_size=8).map("".join)


@seed(5)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(text=hostile, other=hostile, where=st.sampled_from(
    ["content", "prompt", "prompts", "stop", "model", "user", "tokenize", "role"]))
def test_hostile_text_anywhere_gets_no_5xx(server, text, other, where):
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    path, body = "/v1/chat/completions", chat
    if where == "content":
        chat["messages"][0]["content"] = text
    elif where == "role":
        chat["messages"][0]["role"] = text
    elif where in ("stop", "user", "model"):
        chat[where] = text
    elif where == "tokenize":
        path, body = "/tokenize", {"prompt": text}
    else:
        path = "/v1/completions"
        body = {"model": MODEL, "max_tokens": 2,
                "prompt": text if where == "prompt" else [text or "x", other]}
    r = httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (where, repr(text), r.status_code, r.text[:300])
    assert r.headers["content-type"] == "application/json"
    assert ("error" in r.json()) == (r.status_code >= 400)
