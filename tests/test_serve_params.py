"""Every parameter of `ssdmoe serve` is honoured or refused, through the real `openai` client
and raw HTTP against a real server process: stop strings of any length, lists of prompts (one
choice each, equal to asking for each alone), token-id prompts, echo, penalties and logit bias
(equal to the engine's generate with mlx-lm's processors), content parts, per-token
log-probabilities with each token's own bytes, strict types, the refusals (each naming its
parameter), models.retrieve, /tokenize and /detokenize, /version, HEAD and CORS, lone
surrogates, and uvicorn's own parse errors in the OpenAI error shape."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from serve_helpers import Server

pytestmark = pytest.mark.slow
PROMPT = "def parse(argv):\n    "
MESSAGES = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def server(tiny_random_converted):
    srv = Server(tiny_random_converted, "--preset", "on-demand", "--max-tokens-limit", "24",
                 "--model-id", "tiny")
    yield srv
    code, err = srv.stop()
    assert code == 0, err


@pytest.fixture(scope="module")
def engine(tiny_random_converted):
    from engine.loader import load_streaming

    eng = load_streaming(tiny_random_converted)
    yield eng
    eng.close()


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json"})


def test_a_stop_string_longer_than_four_characters(server):
    c = server.client()
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.8,
                                seed=11).choices[0].text
    stop = full[4:12]
    assert len(stop) > 4
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.8,
                             seed=11, stop=stop)
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_a_list_of_prompts_gives_one_choice_each(server, engine):
    c = server.client()
    prompts = ["Hi there", "Bye now", PROMPT]
    r = c.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=1.0,
                             seed=4)
    alone = [c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=1.0,
                                  seed=4) for p in prompts]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed: dict[int, str] = {}
    for ch in c.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=1.0,
                                   seed=4, stream=True):
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {i: ch.text for i, ch in enumerate(r.choices)}
    ids = engine.tokenizer.encode(PROMPT)  # token ids, one prompt and a list of them
    as_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=1.0,
                                  seed=4)
    assert as_ids.choices[0].text == alone[2].choices[0].text
    two = c.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6, temperature=1.0,
                               seed=4)
    assert [ch.text for ch in two.choices] == [alone[2].choices[0].text] * 2


def test_echo_puts_the_prompt_first(server):
    c = server.client()
    plain = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, seed=1)
    echo = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, seed=1, echo=True)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, seed=1, echo=True, stream=True)
        if ch.choices)
    assert streamed == echo.choices[0].text


def test_penalties_and_logit_bias_equal_the_engine_with_mlx_lm_processors(server, engine):
    from mlx_lm.sample_utils import make_logits_processors

    c = server.client()
    ids = engine.tokenizer.encode(PROMPT)
    plain = engine.generate(ids, 16, temp=0.0, seed=0)
    favoured = plain.tokens[2]
    for kw in ({"presence_penalty": 1.5, "frequency_penalty": 1.0},
               {"logit_bias": {str(favoured): -100, "65": 8}}):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0,
                                 **kw)
        bias = {int(k): float(v) for k, v in kw.get("logit_bias", {}).items()}
        ref = engine.generate(ids, 16, temp=0.0, seed=0, logits_processors=make_logits_processors(
            logit_bias=bias or None, presence_penalty=kw.get("presence_penalty"),
            frequency_penalty=kw.get("frequency_penalty")))
        assert r.choices[0].text == ref.text != plain.text, kw
        assert r.usage.completion_tokens == len(ref.tokens)


def test_content_parts_equal_plain_content(server):
    c = server.client()
    text = "Write a function."
    plain = c.chat.completions.create(model="tiny", max_tokens=6, seed=2,
                                      messages=[{"role": "user", "content": text}])
    parts = c.chat.completions.create(model="tiny", max_tokens=6, seed=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Write a "},
                                     {"type": "text", "text": "function."}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_logprobs_are_per_token_with_their_own_bytes(server, engine):
    from server.logprobs import TokenBytes

    c = server.client()
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, seed=1,
                                  logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5
        assert t.top_logprobs[0].logprob >= t.logprob  # the best alternative is at least as good
        assert len({bytes(a.bytes) for a in t.top_logprobs}) == 5  # none collapsed
        for e in (t, *t.top_logprobs):
            raw = bytes(e.bytes)
            try:
                assert e.token == raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: named by its bytes
                assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    # the chosen tokens' bytes are the reply (the detokenizer drops a leading space)
    whole = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
    assert r.choices[0].message.content in (whole, whole[1:])
    # the reference: the engine's own sampled tokens, their bytes from the vocabulary
    as_bytes = TokenBytes(engine.tokenizer)
    comp = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, seed=6, logprobs=5)
    lp = comp.choices[0].logprobs
    gen = engine.generate(PROMPT, 12, temp=1.0, seed=6)
    assert len(lp.tokens) == len(gen.tokens)
    assert lp.tokens == [as_bytes.text(t) for t in gen.tokens]
    assert all(len(top) == 5 for top in lp.top_logprobs)


@pytest.mark.parametrize("extra, param, needle", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tools", "tool calls"),
    ({"response_format": {"type": "json_object"}}, "response_format", "structured output"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
     "structured output"),
    ({"n": 2}, "n", "one choice"),
    ({"functions": [{"name": "f"}]}, "functions", "unknown or unsupported"),
    ({"max_tokens": "3"}, "max_tokens", "integer"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
])
def test_chat_refusals_name_the_parameter(server, extra, param, needle):
    r = post(server, "/v1/chat/completions",
             {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("extra, param, needle", [
    ({"best_of": 2}, "best_of", "one sequence"),
    ({"suffix": "}"}, "suffix", "insertion"),
    ({"echo": True, "logprobs": 2}, None, "echo with logprobs"),
    ({"prompt": []}, "prompt", "token ids"),
    ({"prompt": ["ok", 3]}, "prompt", "list of strings"),
    ({"prompt": [0, 99999]}, "prompt.0", "outside the vocabulary"),
    ({"prompt": ["x"] * 17}, "prompt", "1 to 16"),
])
def test_completion_refusals_name_the_parameter(server, extra, param, needle):
    r = post(server, "/v1/completions",
             {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_an_image_part_is_refused(server):
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "'image_url'" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
                                                             "content": "a\ud800"}]}, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "a\udfff"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["ok", "\udc00"]}, "prompt.1"),
    ("/v1/completions", {"model": "\ud800", "prompt": "a"}, "model"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_lone_surrogates_are_a_400_and_the_connection_stays(server, path, body, param):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post(path, content=json.dumps(body),  # ensure_ascii: "\ud800" escapes
                        headers={"content-type": "application/json"})
        assert r.status_code in (400, 404) and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["param"] == param
        again = client.post("/v1/completions", json={"model": "tiny", "prompt": "a",
                                                     "max_tokens": 2})
        assert again.status_code == 200  # the same keep-alive connection


def test_models_retrieve_tokenize_detokenize_version(server, engine):
    c = server.client()
    card = c.models.retrieve("tiny")
    assert card.id == "tiny" and card.created > 0
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")
    tok = post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert tok["tokens"] == engine.tokenizer.encode(PROMPT) and tok["count"] == len(
        tok["tokens"]) and tok["max_model_len"] == 2048
    chat = post(server, "/tokenize", {"messages": MESSAGES}).json()
    usage = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
    assert post(server, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "a", "model": "other"}).status_code == 404
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_head_options_and_cors(server):
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert httpx.head(f"{server.url}/v1/models").status_code == 200
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "origin": "http://localhost:3000", "access-control-request-method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"


def test_uvicorns_own_parse_errors_are_openai_errors(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        raw = b""
        while chunk := s.recv(4096):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
