"""`ssdmoe trace summary|compare|export` through the real entry point (ssdmoe_cli.main.main)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_runner import run_cli
from trace_handmade import table_file, write_handmade

from traces.schema import STEPS, SUMMARY_KEYS
from traces.writer import TraceWriter


def _run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(monkeypatch, capsys, *args)


@pytest.fixture
def trace_dir(tmp_path):
    return write_handmade(tmp_path / "t")


def test_summary_json_has_exactly_the_keys(monkeypatch, capsys, trace_dir):
    code, out, err = _run(monkeypatch, capsys, "trace", "summary", str(trace_dir), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert tuple(data) == SUMMARY_KEYS
    assert data["cold_fraction"] == pytest.approx(0.6)
    assert "incomplete" not in err


def test_summary_table_shows_metrics_and_layers(monkeypatch, capsys, trace_dir):
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = _run(monkeypatch, capsys, "trace", "summary", str(trace_dir))
    assert code == 0
    assert "33.333" in out  # decode tok/s
    assert "per layer" in out and "0.833" in out and "0.667" in out  # per-layer overlap
    assert "incomplete" not in out


def test_summary_says_incomplete(monkeypatch, capsys, tmp_path):
    from trace_handmade import run_info, step_rows

    writer = TraceWriter(tmp_path / "t", run_info(), flush_every=1)
    for row in step_rows()[:3]:
        writer.add_step(row)
    code, out, _ = _run(monkeypatch, capsys, "trace", "summary", str(tmp_path / "t"))
    assert code == 0 and "incomplete trace" in out
    code, _, err = _run(monkeypatch, capsys, "trace", "summary", str(tmp_path / "t"), "--json")
    assert code == 0 and "incomplete trace" in err


def test_compare_ratio(monkeypatch, capsys, tmp_path):
    a = write_handmade(tmp_path / "a")
    b = write_handmade(tmp_path / "b")
    code, out, err = _run(monkeypatch, capsys, "trace", "compare", str(a), str(b), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["ratio_b_over_a"]["decode_tok_s"] == pytest.approx(1.0)
    assert data["a"] == data["b"]
    code, out, _ = _run(monkeypatch, capsys, "trace", "compare", str(a), str(b))
    assert code == 0 and "B/A" in out


def test_export_writes_chrome_json(monkeypatch, capsys, trace_dir, tmp_path):
    out_file = tmp_path / "x.json"
    code, out, err = _run(monkeypatch, capsys, "trace", "export", str(trace_dir),
                          "--chrome", str(out_file))
    assert code == 0, err
    events = json.loads(out_file.read_text())["traceEvents"]
    assert f"wrote {len(events)} events" in out


@pytest.mark.parametrize("args", [
    ("trace", "summary", "{missing}"),
    ("trace", "summary", "{broken}"),
    ("trace", "compare", "{ok}", "{broken}"),
    ("trace", "export", "{ok}", "--chrome", "{missing}/x/out.json"),
])
def test_bad_input_is_one_line_exit_2(monkeypatch, capsys, tmp_path, args):
    ok = write_handmade(tmp_path / "ok")
    broken = write_handmade(tmp_path / "broken")
    table_file(broken, STEPS).write_bytes(b"PAR1 truncated")
    paths = {"ok": ok, "broken": broken, "missing": tmp_path / "missing"}
    code, out, err = _run(monkeypatch, capsys, *(a.format(**paths) for a in args))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err + out


def test_entry_point_in_a_subprocess_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from ssdmoe_cli.main import main; main()",
         "trace", "summary", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope'}: trace directory does not exist"
    assert "Traceback" not in result.stdout + result.stderr
