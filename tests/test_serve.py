"""`ssdmoe serve` through the real `openai` client against a real server process on a free
loopback port: completions, streaming, stop sequences, seeds (equal to `ssdmoe generate`),
usage, bad requests (4xx, and the next request works), a fuzz run of its own OpenAPI schema,
a client gone mid-stream, 8 concurrent clients in FIFO order, an expert file failing
mid-request, authentication, and shutdown by signal with the trace flushed. Every test is
bounded in count and time and targets 127.0.0.1 only."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import Server

from engine.manifest import read_manifest

pytestmark = pytest.mark.slow
LIMIT = 24  # --max-tokens-limit of the servers here
PROMPT = "def parse(argv):\n    "
MESSAGES = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def model(tiny_random_converted, tmp_path_factory) -> Path:
    """A private copy: the fault test damages and restores an expert file."""
    return Path(shutil.copytree(tiny_random_converted,
                                tmp_path_factory.mktemp("serve") / "model"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    trace = tmp_path_factory.mktemp("serve-trace") / "trace"
    srv = Server(model, "--preset", "on-demand", "--max-tokens-limit", str(LIMIT),
                 "--max-body-bytes", "65536", "--trace", str(trace), "--model-id", "tiny")
    srv.trace = trace
    yield srv
    code, err = srv.stop(signal.SIGTERM)
    assert code == 0, err


def _generate(ssdmoe, model: Path, prompt: str, n: int, temp: float, seed: int) -> dict:
    r = ssdmoe("generate", str(model), "--prompt", prompt, "--max-tokens", str(n),
               "--temp", str(temp), "--seed", str(seed), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_completion_seed_and_usage_equal_generate(server, model, ssdmoe):
    from engine.loader import load_tokenizer

    c = server.client()
    a = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9,
                             seed=7)
    b = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9,
                             seed=7)
    other = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9,
                                 seed=8)
    assert a.choices[0].text == b.choices[0].text != other.choices[0].text
    ref = _generate(ssdmoe, model, PROMPT, 12, 0.9, 7)
    assert a.choices[0].text == ref["text"]
    tok = load_tokenizer(read_manifest(model))
    assert a.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert a.usage.completion_tokens == len(ref["tokens"])
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert a.choices[0].finish_reason == ("length" if len(ref["tokens"]) == 12 else "stop")


def test_chat_streaming_equals_the_whole_reply(server):
    c = server.client()
    whole = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, seed=3)
    chunks = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16,
                                            seed=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content and text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == whole.choices[0].finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    plain = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                           seed=3, stream=True))
    assert all(ch.usage is None for ch in plain)


def test_stop_sequences(server):
    c = server.client()
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=LIMIT, temperature=0.8,
                                seed=11).choices[0].text
    assert len(full) > 12
    stop = full[6:9]
    cut = full[:full.find(stop)]
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=LIMIT, temperature=0.8,
                             seed=11, stop=[stop, "\u2603never"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=LIMIT, temperature=0.8, seed=11, stop=stop,
        stream=True) if ch.choices)
    assert streamed == cut


@pytest.mark.parametrize("body, status, where", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": "many"}), 400,
     "max_tokens"),
    (json.dumps({"model": "nope", "messages": MESSAGES}), 404, "does not exist"),
    (json.dumps({"model": "tiny", "messages": []}), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": LIMIT + 1}), 400,
     "over this server's limit"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 70000}]}),
     413, "request body over"),
    (json.dumps({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 400,
     "role"),
])
def test_bad_requests_get_4xx_and_the_next_one_works(server, body, status, where):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert where in err["message"] and err["type"]
    ok = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_a_chunked_body_over_the_limit_is_refused_unread(server):
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 8192
        yield b'"}]}'

    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    small = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = httpx.post(f"{server.url}/v1/chat/completions", content=iter([small[:20], small[20:]]),
                   timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # a chunked body within the limit is served


def _trace_requests(trace: Path) -> dict[int, int]:
    from traces.reader import read_trace

    steps = read_trace(trace).steps
    out: dict[int, int] = {}
    for req, phase in zip(steps["request"].to_list(), steps["phase"].to_list(), strict=True):
        if phase == "decode":
            out[req] = out.get(req, 0) + 1
    return out


def test_a_client_gone_mid_stream_frees_the_engine(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": LIMIT,
                            "temperature": 1.0, "seed": 5, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        rid = json.loads(first[5:])["id"]
    t0 = time.monotonic()
    while httpx.get(f"{server.url}/health", timeout=10).json()["pending"] and \
            time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert httpx.get(f"{server.url}/health", timeout=10).json()["pending"] == 0
    server.cancelled = int(rid.split("-")[1])  # checked in the trace at shutdown


def test_eight_concurrent_clients_fifo_and_unchanged(server):
    c = server.client()
    jobs = [(i, j) for i in range(8) for j in range(5)]
    want = {(i, j): c.completions.create(model="tiny", prompt=f"{PROMPT}{i}", max_tokens=6,
                                         temperature=1.0, seed=100 * i + j).choices[0].text
            for i, j in jobs}
    got: dict = {}
    ids: dict = {}
    errors: list = []

    def client(i: int) -> None:
        cc = server.client()
        try:
            for j in range(5):
                r = cc.completions.create(model="tiny", prompt=f"{PROMPT}{i}", max_tokens=6,
                                          temperature=1.0, seed=100 * i + j)
                got[(i, j)], ids[(i, j)] = r.choices[0].text, int(r.id.split("-")[1])
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and got == want
    numbers = sorted(ids.values())
    assert len(set(numbers)) == 40
    server.concurrent = numbers


@pytest.mark.parametrize("damage", ["truncate", "zeros", "random"])
def test_an_expert_file_changed_under_the_server_fails_cleanly_until_restored(server, model,
                                                                               damage):
    """Truncated, or overwritten in place at the same size: a 500 naming the file by its
    path in the model directory (never the server's absolute path) with its real size; once
    restored, the same seeded request gives exactly what it gave before."""
    import os

    m = read_manifest(model)
    layer = m.moe_layers[1]
    name = m.layers[layer].file
    path = model / name
    saved = path.read_bytes()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 2}
    before = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    try:
        if damage == "truncate":
            path.write_bytes(b"")
        else:
            with open(path, "r+b") as f:
                f.write(bytes(len(saved)) if damage == "zeros" else os.urandom(len(saved)))
        for _ in range(2):  # refused every time, not only the first
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "expert_file_changed" and name in err["message"]
            assert str(model) not in r.text and "/tmp" not in r.text
            if damage == "truncate":
                assert f"size is 0 bytes, {len(saved)} expected" in err["message"]
    finally:
        path.write_bytes(saved)
    after = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_api_key_and_host_warning(model):
    srv = Server(model, "--preset", "on-demand", "--api-key", "s3cret", "--max-tokens-limit",
                 "4")
    try:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.get(f"{srv.url}/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert srv.client(api_key="s3cret").models.list().data[0].metadata["concurrency"] == 1
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200  # no key needed
    finally:
        code, err = srv.stop(signal.SIGINT)
    assert code == 0 and "warning" not in err
    wide = Server(model, "--host", "0.0.0.0", "--preset", "on-demand")
    try:
        assert httpx.get(f"http://127.0.0.1:{wide.port}/health", timeout=10).status_code == 200
    finally:
        code, err = wide.stop(signal.SIGINT)
    assert code == 0 and "no authentication" in err


@pytest.mark.parametrize("key, needle", [("", "empty"), ("s\u00e9cret", "printable ASCII"),
                                         ("two words", "printable ASCII")])
def test_an_api_key_clients_cannot_send_is_refused_at_start(model, ssdmoe, key, needle):
    r = ssdmoe("serve", str(model), "--api-key", key)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_sigint_mid_request_exits_0_and_flushes_the_trace(model, tmp_path):
    from traces.reader import read_trace

    trace = tmp_path / "trace"
    srv = Server(model, "--preset", "on-demand", "--max-tokens-limit", "512", "--trace",
                 str(trace))
    box: dict = {}

    def long_request():
        try:
            box["r"] = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
                "model": srv_id(model), "prompt": PROMPT, "max_tokens": 400,
                "temperature": 1.0})
        except httpx.HTTPError as err:
            box["err"] = err

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.5)
    code, err = srv.stop(signal.SIGINT)
    t.join(60)
    assert code == 0, err
    steps = read_trace(trace).steps
    assert steps.height > 0  # what ran before the signal is in the trace


def srv_id(model: Path) -> str:
    return model.resolve().name


def test_trace_at_shutdown_holds_every_request(server):
    """Runs last in this module: stop the shared server, then read its trace."""
    code, err = server.stop(signal.SIGTERM)
    assert code == 0, err
    per_request = _trace_requests(server.trace)
    cancelled = getattr(server, "cancelled", None)
    if cancelled is not None:
        assert per_request.get(cancelled, 0) < LIMIT - 1  # stopped early, not run out
    numbers = getattr(server, "concurrent", [])
    assert set(numbers) <= set(per_request)
    from traces.reader import read_trace

    order = [r for r in read_trace(server.trace).steps["request"].to_list()]
    firsts = list(dict.fromkeys(order))
    assert firsts == sorted(firsts)  # FIFO: requests ran in the order they arrived


def test_a_non_streamed_client_gone_frees_the_engine_too(model, tmp_path):
    trace = tmp_path / "trace"
    srv = Server(model, "--preset", "on-demand", "--max-tokens-limit", "400", "--trace",
                 str(trace), "--model-id", "tiny")
    # seed 9 samples no EOS in its first 380 tokens of PROMPT on this fixture
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 380, "temperature": 1.0,
            "seed": 9}
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up, closing its connection
            httpx.post(f"{srv.url}/v1/completions", json=body,
                       timeout=httpx.Timeout(60, read=0.4))
        t0 = time.monotonic()
        while httpx.get(f"{srv.url}/health", timeout=10).json()["pending"] and \
                time.monotonic() - t0 < 10:
            time.sleep(0.02)
        freed_s = time.monotonic() - t0
        full = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
    finally:
        code, err = srv.stop()
    assert code == 0, err
    assert full["usage"]["completion_tokens"] == 380  # uncancelled, this request runs long
    steps = _trace_requests(trace)
    assert steps[0] < 300 and freed_s < 2.0  # the abandoned one stopped soon after


@pytest.mark.parametrize("arch", ["gpt_oss", "glm_moe_dsa"])
def test_the_streamed_architectures_serve(arch, arch_model, ssdmoe):
    """gpt_oss (sliding-window cache, sinks, expert biases) and GLM-5.x (MLA with the DSA
    indexer) through the real server: a seeded completion equals `ssdmoe generate`."""
    _, converted = arch_model(arch)
    srv = Server(converted, "--preset", "staged", "--model-id", arch)
    try:
        got = srv.client().completions.create(model=arch, prompt=PROMPT, max_tokens=12,
                                              temperature=1.0, seed=3)
    finally:
        code, err = srv.stop()
    assert code == 0, err
    ref = _generate(ssdmoe, converted, PROMPT, 12, 1.0, 3)
    assert got.choices[0].text == ref["text"] and got.usage.completion_tokens == len(ref["tokens"])
