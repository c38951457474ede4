"""`ssdmoe capture` and `ssdmoe generate --trace`: traces that open and add up, bad input as one
line, a run killed with SIGINT / SIGKILL leaves a trace that opens (incomplete); the overhead
benchmark's arithmetic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from contract.errors import BadInput
from engine.bench.trace_overhead import summarize
from traces.reader import read_trace

PROMPTS = [{"prompt": "def add(a, b):\n    return"}, {"prompt": "Once upon a time"}]


def _prompts(path: Path, rows=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_capture_cli_writes_a_trace(tiny_random_converted, tmp_path, ssdmoe):
    out = tmp_path / "trace"
    prompts = _prompts(tmp_path / "p.jsonl")
    r = ssdmoe("capture", str(tiny_random_converted), "--prompts", str(prompts),
               "--max-tokens", "5", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    trace = read_trace(out)
    assert trace.complete
    s = trace.steps
    assert sorted(set(s["request"])) == [0, 1]
    # each request: one or two prefill steps (prompt[:-1], last token), then 4 decode steps
    for req in (0, 1):
        part = s.filter(pl.col("request") == req)
        assert part.filter(pl.col("phase") == "decode").height == 4
        assert part.filter(pl.col("phase") == "prefill").height in (1, 2)
    assert s["step"].sort().to_list() == list(range(s.height))
    assert trace.run["extra"]["capture"]["max_tokens"] == 5
    assert trace.run["engine"]["preset"] == "on-demand"
    assert "capture" in trace.run["command"]
    summary = ssdmoe("trace", "summary", str(out), "--json")
    assert summary.returncode == 0 and json.loads(summary.stdout)["loads_per_step"] > 0
    # an existing trace is refused, then replaced with --force
    again = ssdmoe("capture", str(tiny_random_converted), "--prompts", str(prompts),
                   "--max-tokens", "2", "--out", str(out), "--no-progress")
    one_line_error(again, str(out), "--force")
    again = ssdmoe("capture", str(tiny_random_converted), "--prompts", str(prompts),
                   "--max-tokens", "2", "--out", str(out), "--no-progress", "--force")
    assert again.returncode == 0, again.stderr
    assert read_trace(out).steps.filter(pl.col("phase") == "decode").height == 2


def test_generate_trace(tiny_random_converted, tmp_path, ssdmoe):
    out = tmp_path / "g"
    r = ssdmoe("generate", str(tiny_random_converted), "--prompt", "x y z", "--max-tokens", "4",
               "--json", "--trace", str(out))
    assert r.returncode == 0, r.stderr
    trace = read_trace(out)
    n = len(json.loads(r.stdout)["tokens"])
    assert trace.complete and trace.steps.filter(pl.col("phase") == "decode").height == n - 1
    layers = trace.run["model"]["layers"]
    assert trace.routing.filter(pl.col("step") == trace.steps["step"].max()).height == layers
    one_line_error(ssdmoe("generate", str(tiny_random_converted), "--prompt", "x",
                          "--trace", str(out)), "not empty")


@pytest.mark.parametrize("case", ["missing", "bad_json", "no_prompt", "empty_file", "not_trace",
                                  "no_out", "preset", "tokens", "hot"])
def test_capture_bad_input(case, tiny_random_converted, tmp_path, ssdmoe):
    prompts = _prompts(tmp_path / "p.jsonl")
    out = tmp_path / "out"
    args = ["--max-tokens", "2"]
    needles: tuple[str, ...]
    if case == "missing":
        prompts, needles = tmp_path / "nope.jsonl", ("nope.jsonl", "not found")
    elif case == "bad_json":
        prompts.write_text('{"prompt": "ok"}\n\n{"prompt": "broken\n')
        needles = (f"{prompts}:3", "not valid JSON")
    elif case == "no_prompt":
        prompts.write_text('{"prompt": "ok"}\n{"text": "wrong key"}\n')
        needles = (f"{prompts}:2", '"prompt"')
    elif case == "empty_file":
        prompts.write_text("\n")
        needles = (str(prompts), "no prompts")
    elif case == "not_trace":
        out.mkdir()
        (out / "precious.txt").write_text("keep me")
        args += ["--force"]
        needles = (str(out), "not a trace")
    elif case == "no_out":
        out, needles = None, ("--out",)
    elif case == "preset":
        args += ["--preset", "warp"]
        needles = ("warp",)
    elif case == "hot":
        args += ["--preset", "hot", "--hot-mb", "0"]
        needles = ("--hot-mb", "must be > 0")
    else:
        args = ["--max-tokens", "0"]
        needles = ("--max-tokens",)
    cmd = ["capture", str(tiny_random_converted), "--prompts", str(prompts), *args]
    if out is not None:
        cmd += ["--out", str(out)]
    one_line_error(ssdmoe(*cmd), *needles)
    if case == "not_trace":
        assert (out / "precious.txt").read_text() == "keep me"


def _capture_cmd(model: Path, out: Path, prompts: Path) -> list[str]:
    code = "from ssdmoe_cli.main import main; main()"
    return [sys.executable, "-c", code, "capture", str(model), "--prompts", str(prompts),
            "--max-tokens", "100000", "--out", str(out), "--no-progress"]


def _wait_for_steps(out: Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait until a periodic flush has put some steps on disk."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            n = read_trace(out).steps.height
        except BadInput:
            n = 0
        if n >= 2:
            return n
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no flush within the timeout")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killed_capture_leaves_an_open_trace(sig, tiny_random_converted, tmp_path):
    out = tmp_path / "t"
    proc = subprocess.Popen(_capture_cmd(tiny_random_converted, out,
                                         _prompts(tmp_path / "p.jsonl")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    flushed = _wait_for_steps(out, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    trace = read_trace(out)
    assert not trace.complete
    steps = trace.steps["step"].to_list()
    assert steps == list(range(len(steps))) and len(steps) >= flushed
    assert set(trace.routing["step"]) <= set(steps) | {max(steps) + 1}
    if sig == signal.SIGINT:
        assert not list(out.glob(".*.tmp"))  # (SIGKILL mid-flush may leave one; it is ignored)
        assert proc.returncode == 130, err  # typer turns KeyboardInterrupt into exit 130
        # Ctrl-C writes what was captured since the last periodic flush
        assert trace.loads["bytes"].sum() >= trace.steps["bytes_read"].sum() > 0


def test_overhead_summary_arithmetic():
    runs = []
    for rnd, (off, on) in enumerate([(100.0, 96.0), (90.0, 89.0), (110.0, 100.0)]):
        runs.append({"round": rnd, "arm": "off", "decode_tok_s": off})
        runs.append({"round": rnd, "arm": "on", "decode_tok_s": on, "recorder_ms_per_step": 0.1})
    # paired: (round, prompt) generations; on/off ratios 0.9, 0.95, 1.0 -> median 0.95
    gens = [{"round": r, "prompt": 0, "arm": arm, "decode_steps": steps, "decode_s": 1.0}
            for r, (off, on) in enumerate([(100, 90), (100, 95), (50, 50)])
            for arm, steps in (("off", off), ("on", on))]
    s = summarize(runs, gens, rounds=3)
    assert s["median_decode_tok_s"] == {"off": 100.0, "on": 96.0}
    assert s["overhead_pct"] == pytest.approx(4.0)
    assert s["paired_overhead_pct"] == pytest.approx(5.0)
    assert s["recorder_ms_per_step"] == 0.1
    assert s["recorder_pct_of_step"] == pytest.approx(100 * 0.1 / (1000 / 96.0))


def test_overhead_cli_smoke(tiny_random_converted, tmp_path, ssdmoe):
    report = tmp_path / "o.json"
    r = ssdmoe("capture", str(tiny_random_converted), "--prompts",
               str(_prompts(tmp_path / "p.jsonl")), "--max-tokens", "3", "--overhead",
               "--rounds", "2", "--report", str(report), "--no-progress")
    assert r.returncode == 0, r.stderr
    data = json.loads(report.read_text())
    assert [(x["round"], x["arm"]) for x in data["runs"]] == [
        (0, "off"), (0, "on"), (1, "off"), (1, "on")]
    assert all(x["decode_steps"] == 2 * 2 for x in data["runs"])  # 2 prompts x 2 decode steps
    assert "overhead" in r.stdout and data["overhead_pct"] is not None


def test_hot_mb_sets_the_hot_pools_size(tiny_random_converted, tmp_path, ssdmoe):
    """--hot-mb reaches the engine: run.json's config and the pool the runtime holds."""
    prompts = _prompts(tmp_path / "p.jsonl")
    out = tmp_path / "hot"
    r = ssdmoe("capture", str(tiny_random_converted), "--prompts", str(prompts), "--max-tokens",
               "2", "--out", str(out), "--no-progress", "--preset", "hot", "--hot-mb", "0.5")
    assert r.returncode == 0, r.stderr
    assert read_trace(out).run["engine"]["hot_bytes"] == 2**19
