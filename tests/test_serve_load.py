"""Load on `ssdmoe serve` is bounded and visible, and shutdown ends every stream properly: a
full queue answers 503 with Retry-After, a request past its time limit ends with 408 (a stream
with an error event and [DONE]), a body that never arrives gets 408, /health reports the
queue, /metrics counts what happened (read with prometheus_client's own parser), and SIGTERM
gives every running and queued stream an error event and [DONE], queued plain requests a 503,
then exits 0. Long requests keep going because EOS is biased away (logit_bias)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from serve_helpers import Server

pytestmark = pytest.mark.slow
PROMPT = "def parse(argv):\n    "


@pytest.fixture(scope="module")
def no_eos(tiny_random_converted) -> dict[str, float]:
    from engine.loader import load_tokenizer
    from engine.manifest import read_manifest

    tok = load_tokenizer(read_manifest(tiny_random_converted))
    return {str(t): -100.0 for t in tok.eos_token_ids}


@pytest.fixture(scope="module")
def server(tiny_random_converted):
    srv = Server(tiny_random_converted, "--preset", "on-demand", "--max-tokens-limit", "5000",
                 "--model-id", "tiny", "--max-queue", "1", "--request-timeout", "2",
                 "--body-timeout", "1")
    yield srv
    code, err = srv.stop()
    assert code == 0, err


def long_body(no_eos: dict, stream: bool = False, seed: int = 0) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "temperature": 1.0,
            "seed": seed, "logit_bias": no_eos, "stream": stream}


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except Exception as err:  # noqa: BLE001 - the test reads it
            box["error"] = err

    t = threading.Thread(target=run)
    t.start()
    return t, box


def wait_for(server, pending: int, timeout: float = 10.0) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        if health["pending"] == pending:
            return health
        time.sleep(0.02)
    raise AssertionError(f"pending never reached {pending}: {health}")


def metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def stream_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        return [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]


def test_a_full_queue_answers_503_with_retry_after_and_a_long_request_times_out(server,
                                                                                 no_eos):
    before = metrics(server)
    url = f"{server.url}/v1/completions"
    running, a = in_background(lambda: httpx.post(url, json=long_body(no_eos), timeout=60))
    wait_for(server, 1)
    queued, b = in_background(lambda: stream_events(server.url, long_body(no_eos, True, 1)))
    health = wait_for(server, 2)
    assert health["queue"] == {"waiting": 1, "running": 1, "max": 1}
    full = httpx.post(url, json=long_body(no_eos), timeout=60)
    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    assert int(full.headers["retry-after"]) >= 1
    t0 = time.monotonic()
    running.join(30)
    queued.join(30)
    r = a["result"]
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    events = b["result"]  # queued behind it: its time limit ran out while it waited
    assert json.loads(events[-2])["error"]["code"] == "request_timeout" and events[-1] == \
        "[DONE]"
    assert time.monotonic() - t0 < 10
    assert wait_for(server, 0)["queue"]["waiting"] == 0
    after = metrics(server)
    assert after["ssdmoe_requests_rejected_total"] == before["ssdmoe_requests_rejected_total"] + 1
    key = 'ssdmoe_requests_total{"outcome": "request_timeout"}'
    assert after[key] == before.get(key, 0) + 2


def test_a_body_that_never_arrives_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: 100\r\n\r\n{\"model\": ")  # 10 of the 100 bytes
        t0 = time.monotonic()
        raw = b""
        while chunk := s.recv(4096):
            raw += chunk
        waited = time.monotonic() - t0
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and 0.9 < waited < 5
    assert json.loads(body)["error"]["code"] == "body_timeout"


def test_metrics_count_what_happened(server):
    before = metrics(server)
    r = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=5, seed=3)
    after = metrics(server)
    ok = 'ssdmoe_requests_total{"outcome": "ok"}'
    assert after[ok] == before.get(ok, 0) + 1
    assert after["ssdmoe_completion_tokens_total"] - before.get(
        "ssdmoe_completion_tokens_total", 0) == r.usage.completion_tokens
    assert after["ssdmoe_prompt_tokens_total"] - before.get(
        "ssdmoe_prompt_tokens_total", 0) == r.usage.prompt_tokens
    assert after["ssdmoe_time_to_first_token_seconds_count"] == before.get(
        "ssdmoe_time_to_first_token_seconds_count", 0) + 1
    assert after["ssdmoe_expert_loads_total"] > before.get("ssdmoe_expert_loads_total", 0)
    assert after["ssdmoe_queue_length"] == 0 and after["ssdmoe_requests_running"] == 0


def test_shutdown_ends_every_stream_with_an_error_event_and_done(tiny_random_converted,
                                                                 no_eos):
    srv = Server(tiny_random_converted, "--preset", "on-demand", "--max-tokens-limit", "5000",
                 "--model-id", "tiny")
    url = f"{srv.url}/v1/completions"
    try:
        streams = [in_background(stream_events, srv.url, long_body(no_eos, True, i))
                   for i in range(2)]
        wait_for(srv, 2)
        plain = in_background(lambda: httpx.post(url, json=long_body(no_eos), timeout=60))
        wait_for(srv, 3)
    finally:
        code, err = srv.stop(signal.SIGTERM)
    assert code == 0, err
    for t, box in streams:
        t.join(30)
        events = box["result"]
        assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
        assert events[-1] == "[DONE]"
    plain[0].join(30)
    r = plain[1]["result"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_the_load_test_command_passes_its_checks(tiny_random_converted, tmp_path, ssdmoe):
    """`ssdmoe loadtest`, small: a real server, concurrent and leaving clients, a slow body."""
    out = tmp_path / "load.json"
    r = ssdmoe("loadtest", str(tiny_random_converted), "--clients", "3", "--requests", "2",
               "--leavers", "1", "--repeats", "2", "--max-tokens", "6", "--preset",
               "on-demand", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["passed"] and all(result["checks"].values())
    assert len(result["repetitions"]) == 2 and result["latency_s"]["n"] == 12
    assert "| repetition |" in r.stdout
