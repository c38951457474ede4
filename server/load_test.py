"""A load test of a real `ssdmoe serve` process over HTTP: per repetition, C clients x R
seeded requests at once, beside clients that leave mid-stream and one that sends its body
slowly. It checks what a client relies on:
  - every completed output equals the same request run alone, one after another;
  - the engine ran the requests in arrival (FIFO) order: completions end in the order the
    server numbered them;
  - nothing leaks: the queue is back to 0 after each repetition and the server's RSS is
    stable across repetitions;
and reports latency (p50, p99) per repetition. No MLX here: the server is another process."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from server.serve_process import ServeProcess

PROMPT = "def parse(argv):\n    "
RSS_GROWTH_LIMIT = 0.05  # RSS after the last repetition within 5% of after the first


@dataclass
class LoadSpec:
    model: Path
    clients: int = 8
    requests: int = 5  # per client
    leavers: int = 2  # clients that disconnect after their first streamed chunk
    slow_body_s: float = 1.0  # how long the slow client takes to send its body
    repeats: int = 3
    max_tokens: int = 24
    preset: str = "staged"
    serve_args: list[str] = field(default_factory=list)


def _rss_kib(pid: int) -> int:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def _body(spec: LoadSpec, client: int, request: int, stream: bool = False) -> dict:
    return {"model": "m", "prompt": f"{PROMPT}{client}", "max_tokens": spec.max_tokens,
            "temperature": 1.0, "seed": 100 * client + request, "stream": stream}


def _complete(url: str, body: dict) -> tuple[str, int, float, float]:
    """-> (text, the server's job number, start, end)."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    out = r.json()
    return out["choices"][0]["text"], int(out["id"].split("-")[1]), t0, time.perf_counter()


def _leave_mid_stream(url: str, body: dict) -> bool:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        return any(line.startswith("data:") for line in r.iter_lines())  # then closes


def _slow_body(url: str, body: dict, seconds: float) -> str:
    raw = json.dumps(body).encode()
    size = max(len(raw) // 8, 1)
    pieces = [raw[i:i + size] for i in range(0, len(raw), size)]

    def trickle():
        for piece in pieces:
            time.sleep(seconds / len(pieces))
            yield piece

    r = httpx.post(f"{url}/v1/completions", content=trickle(), timeout=300,
                   headers={"content-type": "application/json"})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_load(spec: LoadSpec, say=print) -> dict:
    server = ServeProcess(spec.model, "--preset", spec.preset, "--model-id", "m",
                          "--max-tokens-limit", str(spec.max_tokens), *spec.serve_args)
    try:
        jobs = [(c, r) for c in range(spec.clients) for r in range(spec.requests)]
        say(f"sequential reference: {len(jobs)} requests")
        want = {job: _complete(server.url, _body(spec, *job))[0] for job in jobs}
        slow_want = _complete(server.url, _body(spec, 99, 0))[0]
        reps = []
        for rep in range(spec.repeats):
            say(f"repetition {rep + 1}/{spec.repeats}: {spec.clients} clients x "
                f"{spec.requests} requests, {spec.leavers} leaving mid-stream, 1 slow body")
            reps.append(_repetition(spec, server, jobs, want, slow_want))
        code, _ = server.stop()
    finally:
        server.stop()
    rss = [r["rss_kib"] for r in reps]
    latencies = [x for r in reps for x in r.pop("latencies_s")]
    checks = {
        "outputs_equal_sequential": all(r["outputs_equal"] for r in reps),
        "fifo": all(r["fifo"] for r in reps),
        "queue_back_to_zero": all(r["pending_after"] == 0 for r in reps),
        "rss_stable": rss[-1] <= rss[0] * (1 + RSS_GROWTH_LIMIT),
        "leavers_freed": all(r["leavers_ok"] for r in reps),
        "slow_body_served": all(r["slow_body_equal"] for r in reps),
        "exit_code_0": code == 0,
    }
    manifest = Path(spec.model) / "manifest.json"
    return {"spec": {**asdict(spec), "model": str(spec.model)},
            "model_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
            "repetitions": reps,
            "latency_s": {"p50": _percentile(latencies, 50), "p99": _percentile(latencies, 99),
                          "n": len(latencies)},
            "rss_growth": rss[-1] / rss[0] - 1 if rss[0] else None,
            "checks": checks, "passed": all(checks.values())}


def _repetition(spec: LoadSpec, server: ServeProcess, jobs: list, want: dict,
                slow_want: str) -> dict:
    got: dict = {}
    errors: list[str] = []
    leavers: list[bool] = []
    slow: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(spec.requests):
            try:
                result = _complete(server.url, _body(spec, c, r))
            except httpx.HTTPError as err:
                errors.append(f"client {c} request {r}: {err}")
                return
            with lock:
                got[(c, r)] = result

    def leaver(i: int) -> None:
        leavers.append(_leave_mid_stream(server.url, _body(spec, 50 + i, 0, stream=True)))

    def slow_client() -> None:
        slow.append(_slow_body(server.url, _body(spec, 99, 0), spec.slow_body_s))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(spec.clients)]
    threads += [threading.Thread(target=leaver, args=(i,)) for i in range(spec.leavers)]
    threads.append(threading.Thread(target=slow_client))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    pending = httpx.get(f"{server.url}/health", timeout=10).json()["pending"]
    t1 = time.monotonic()
    while pending and time.monotonic() - t1 < 10:  # a leaver's job ends within one step
        time.sleep(0.05)
        pending = httpx.get(f"{server.url}/health", timeout=10).json()["pending"]
    ends = sorted(got.values(), key=lambda g: g[1])  # by the server's arrival number
    latencies = [g[3] - g[2] for g in got.values()]
    return {
        "wall_s": wall, "errors": errors,
        "outputs_equal": not errors and {k: v[0] for k, v in got.items()} == want,
        "fifo": all(a[3] <= b[3] for a, b in zip(ends, ends[1:], strict=False)),
        "pending_after": pending, "rss_kib": _rss_kib(server.proc.pid),
        "leavers_ok": leavers == [True] * spec.leavers,
        "slow_body_equal": slow == [slow_want],
        "latencies_s": latencies,
        "p50_s": _percentile(latencies, 50), "p99_s": _percentile(latencies, 99),
    }


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def table(result: dict) -> str:
    lines = ["| repetition | wall s | p50 s | p99 s | equal | FIFO | queue after | RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["repetitions"]):
        lines.append(f"| {i + 1} | {r['wall_s']:.2f} | {r['p50_s']:.3f} | {r['p99_s']:.3f} | "
                     f"{r['outputs_equal']} | {r['fifo']} | {r['pending_after']} | "
                     f"{r['rss_kib'] / 1024:.0f} |")
    lat = result["latency_s"]
    lines.append(f"\nall requests: p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s (n={lat['n']}); "
                 f"RSS growth {100 * (result['rss_growth'] or 0):+.1f}%")
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}"
                                        for k, v in result["checks"].items()))
    return "\n".join(lines)
