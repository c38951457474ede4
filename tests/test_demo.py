"""`ssdmoe demo`, the README's main job, end to end on a stand-in model: the tiny-random fixture
placed where the demo expects tiny-trained (training the real one takes minutes). The demo must
skip the build, convert once, generate with a trace and summarise it; a second run reuses the
conversion."""

from __future__ import annotations

import json
import shutil

from traces.reader import read_trace


def test_demo_converts_once_generates_with_a_trace_and_summarises(tiny_random_dir, tmp_path,
                                                                  ssdmoe):
    models = tmp_path / "models"
    source = models / "tiny-trained"
    shutil.copytree(tiny_random_dir, source)
    (source / "fixture.json").write_text(json.dumps({"fixture": "stand-in"}))

    trace = tmp_path / "trace"
    # --no-validate: the stand-in is not the tiny-trained that this machine's profile describes
    run = ssdmoe("demo", "--models", str(models), "--max-tokens", "6", "--trace", str(trace),
                 "--no-validate")
    assert run.returncode == 0, run.stderr
    assert "converting to the streaming layout" in run.stdout
    assert (models / "tiny-trained-stream" / "manifest.json").is_file()

    recorded = read_trace(trace)
    assert recorded.complete
    decode = recorded.steps.filter(recorded.steps["phase"] == "decode")
    assert decode.height == 5  # the first of 6 tokens comes from the prefill step
    assert recorded.run["engine"]["decode"] == "staged"
    assert "decode" in run.stdout and "blocked on loads" in run.stdout  # the summary table

    again = ssdmoe("demo", "--models", str(models), "--max-tokens", "2",
                   "--trace", str(tmp_path / "trace2"), "--no-validate")
    assert again.returncode == 0, again.stderr
    assert "is up to date" in again.stdout


def test_demo_validation_in_short(tiny_random_converted, model_copy, tmp_path, capsys):
    """The demo's last stage on a stand-in: quick heads trained, on-demand and the prerouter
    captured under the page-cache budget (and the throttle, where it can be set), each
    simulated, printed side by side."""
    from ssdmoe_cli.demo_cmd import _validate_short

    model = model_copy(tiny_random_converted)
    out = tmp_path / "short"
    _validate_short(model, out)
    printed = capsys.readouterr().out
    assert (model / "prerouter-quick" / "prerouter.json").is_file()
    assert "measured / simulated" in printed and "prerouter over on-demand" in printed
    results = sorted((out / "results").glob("*.json"))
    assert [p.name.split("-pc25")[0] for p in results] == ["on-demand", "staged-token"]
    for p in results:
        r = json.loads(p.read_text())
        assert r["measured"]["decode_tok_s"] > 0 and r["simulated"]["decode_tok_s"] > 0
        assert r["config"]["page_cache"] == "1/4"
