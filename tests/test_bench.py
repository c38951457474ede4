"""`ssdmoe bench`: size parsing, the summary arithmetic against hand-computed values, and one
small real run (two arms in their own processes, rotated order, JSON + PNG written, same
greedy tokens in every arm)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from contract.errors import BadInput
from engine.bench.benchmark import add_bounds, parse_bytes, summarize_arm


def test_parse_bytes():
    assert parse_bytes("123", 0) == 123
    assert parse_bytes("64M", 0) == 64 << 20
    assert parse_bytes("1.5G", 0) == 3 << 29
    assert parse_bytes("256MiB", 0) == 256 << 20
    assert parse_bytes("25%", 1000) == 250
    with pytest.raises(BadInput, match="not a size"):
        parse_bytes("lots", 0)


def _run(decode_s: float, steps: int, blocked_ns: int, cold: int) -> dict:
    return {"prompts": [{"prompt_tokens": 10, "prefill_s": 0.5, "decode_s": decode_s,
                         "decode_steps": steps, "decode_loads": 2 * steps,
                         "decode_blocked_ns": blocked_ns, "decode_cold_bytes": cold,
                         "decode_bytes": 2 * cold}],
            "peak_mlx_bytes": 1, "peak_rss_bytes": 2, "stats": {}, "buffer_bytes": {}}


def test_summary_medians_and_bound():
    # three rounds of 10 decode steps: 1.0 s, 0.5 s, 0.4 s -> 10, 20, 25 tok/s; median 20
    resident = summarize_arm([_run(1.0, 10, 0, 0), _run(0.5, 10, 0, 0), _run(0.4, 10, 0, 0)])
    assert resident["decode_tok_s"] == 20 and resident["step_ms"] == 50
    assert resident["prefill_tok_s"] == 20  # 10 prompt tokens in 0.5 s
    # streaming: 4 tok/s, 3 MiB cold per step, 30 ms blocked per step
    streamed = summarize_arm([_run(2.5, 10, 300_000_000, 30 << 20)] * 3)
    assert streamed["decode_tok_s"] == 4
    assert streamed["blocked_ms_per_step"] == 30 and streamed["cold_mib_per_step"] == 3
    summary = {"resident": resident, "staged": streamed}
    add_bounds(summary, bandwidth=30 * 2**20)  # 30 MiB/s: 3 MiB cold -> 100 ms > 50 ms compute
    assert summary["staged"]["bound_ms_per_step"] == pytest.approx(100)
    assert summary["staged"]["bound_tok_s"] == pytest.approx(10)
    assert summary["staged"]["of_bound"] == pytest.approx(0.4)
    assert summary["staged"]["ratio_to_resident"] == pytest.approx(0.2)
    assert summary["resident"]["bound_tok_s"] == pytest.approx(20)  # compute bound


def test_cold_reads_covered_at_queue_depth():
    """Reads in flight together: each one's span includes the others' transfer, the time some
    read was in flight does not. Spans (ns) worked by hand: [0, 10) and [4, 12) overlap -> 12
    covered; [20, 25) alone -> 5; [30, 40) holds [32, 35) -> 10: 27 ns covered for 5 cold
    loads whose own spans sum to 10 + 8 + 5 + 10 + 3 = 36 ns (36 / 27 in flight)."""
    from engine.bench.arm import covered_ns

    spans = [(20, 25), (4, 12), (0, 10), (32, 35), (30, 40)]
    assert covered_ns(spans) == 27
    assert covered_ns([]) == 0 and covered_ns([(5, 9)]) == 4
    assert covered_ns([(0, 10), (10, 20)]) == 20  # back to back: no gap, no double count
    run = _run(1.0, 10, 0, 0)
    run["prompts"][0].update(decode_cold_loads=5, cold_reading_ns=covered_ns(spans),
                             cold_load_ms=[(end - start) / 1e6 for start, end in spans])
    s = summarize_arm([run])
    assert s["cold_load_covered_ms"] == pytest.approx(27e-6 / 5)
    assert s["cold_reads_in_flight"] == pytest.approx(36 / 27)
    run["prompts"][0].pop("cold_reading_ns")  # a JSON from before the figure: unknown (nan)
    s = summarize_arm([run])
    assert s["cold_load_covered_ms"] != s["cold_load_covered_ms"]


def test_an_arm_the_memory_limit_killed():
    """Resident killed in every round (what a memory limit below the model does to mlx-lm): its
    summary says so and carries no figures; the streaming arm's ratios to it are absent rather
    than infinite; the table shows the kill. Killed in one round of three: the other two make
    the medians and the killed round's tok/s is 0 in the per-round list."""
    from engine.bench.benchmark import markdown_table

    killed = {"arm": "resident", "killed": "out of memory (SIGKILL under the memory limit)"}
    resident = summarize_arm([killed] * 3)
    assert resident["killed_rounds"] == 3 and "step_ms" not in resident
    assert resident["decode_tok_s_rounds"] == [0.0, 0.0, 0.0]
    streamed = summarize_arm([_run(2.5, 10, 0, 0), killed, _run(0.5, 10, 0, 0)])
    assert streamed["killed_rounds"] == 1 and streamed["decode_tok_s"] == 12  # median of 4, 20
    assert streamed["decode_tok_s_rounds"] == [4.0, 0.0, 20.0]
    summary = {"resident": resident, "on-demand": streamed}
    add_bounds(summary, bandwidth=1e9)
    assert summary["on-demand"]["ratio_to_resident"] is None
    assert summary["on-demand"]["ratio_paired"] is None
    table = markdown_table({"summary": summary})
    assert "| resident | killed: out of memory" in table


@pytest.mark.slow  # four worker processes (one per arm and round), each imports MLX
def test_bench_cli_small_run(tiny_random_converted, tmp_path, ssdmoe):
    out = tmp_path / "b.json"
    from engine.throttle import ThrottleSpec, ThrottleUnavailable, check_available

    try:
        check_available(ThrottleSpec(read_mbps=200))
        throttle = ["--read-mbps", "200"]
    except ThrottleUnavailable:
        throttle = []
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "resident,staged,staged-layer",
               "--rounds", "2", "--max-tokens", "4", "--num-prompts", "1",
               "--page-cache-budget", "50%", "--json", str(out), *throttle)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    manifest = tiny_random_converted / "manifest.json"
    assert res["manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert res["order"] == [["resident", "staged", "staged-layer"],
                            ["staged", "staged-layer", "resident"]]
    # sampled by default, the same draws in every arm: resident and staged agree token for
    # token; staged-layer routes by prediction (its own tokens, agreement reported)
    assert res["decode_routing"] == {"mode": "sampled", "temp": 1.0, "seed": 0}
    assert res["tokens_identical"] is True
    assert 0 <= res["predicted_token_agreement"]["staged-layer"] <= 1
    assert res["runs"]["staged-layer"][0]["config"]["lead_kind"] == "layer"
    if throttle:
        assert res["runs"]["staged"][0]["throttle"]["read_bps"] == 200 * 10**6
        assert res["disk_bandwidth_bytes_s"] <= 200e6
    assert res["page_cache_budget"] == res["expert_bytes"] // 2
    assert res["runs"]["staged"][0]["config"]["page_cache_budget"] == res["page_cache_budget"]
    assert res["runs"]["staged"][0]["config"]["preset"] == "staged"
    s = res["summary"]
    assert s["resident"]["ratio_to_resident"] == 1.0 and s["staged"]["decode_tok_s"] > 0
    assert s["staged"]["loads_per_step"] > 0 and res["disk_bandwidth_bytes_s"] > 0
    assert "| staged |" in r.stdout


def test_bench_bad_input(tiny_random_converted, ssdmoe):
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "resident,turbo")
    assert r.returncode == 2 and "unknown arm 'turbo'" in r.stderr
    r = ssdmoe("bench", str(tiny_random_converted), "--page-cache-budget", "10")
    assert r.returncode == 2 and "minimum" in r.stderr


def test_bench_lora_arm_measures_the_adapter(tiny_random_converted, model_copy, tmp_path,
                                             ssdmoe):
    """staged-prerouter-lora runs the adapter trained for the heads (the default), paired
    with staged-prerouter; its load time and bytes come back; --no-lora refuses the arm."""
    from prerouter_helpers import _heads
    from test_lora import _rewrite, make_adapter

    from engine.manifest import sha256_file

    root = model_copy(tiny_random_converted)
    heads = _heads(root, root / "prerouter", seed=1)
    k = json.loads((root / "manifest.json").read_text())["top_k"]
    ad = make_adapter(root, root / "lora" / f"k{k}-sft", scale_b=0.3)
    _rewrite(ad, lambda s, a: s["provenance"].update(
        heads_sha256=sha256_file(heads / "prerouter.safetensors")))
    out = tmp_path / "b.json"
    r = ssdmoe("bench", str(root), "--arms", "staged-prerouter,staged-prerouter-lora",
               "--rounds", "2", "--max-tokens", "6", "--num-prompts", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    lora_run = res["runs"]["staged-prerouter-lora"][0]
    assert lora_run["config"]["lora"] == str(ad) and lora_run["lora_bytes"] > 0
    assert res["runs"]["staged-prerouter"][0]["config"]["lora"] is None
    cost = res["lora_cost"]
    assert cost["decode_ratio_paired"] > 0 and cost["load_s"] > 0
    assert "recovery LoRA" in r.stdout
    tokens = {a: res["runs"][a][0]["prompts"][0]["tokens"] for a in res["arms"]}
    assert tokens["staged-prerouter-lora"] != tokens["staged-prerouter"]  # the adapter acts
    r = ssdmoe("bench", str(root), "--arms", "staged-prerouter-lora", "--no-lora")
    assert r.returncode == 2 and "needs an adapter" in r.stderr


def test_before_code_runs_another_checkouts_engine(tiny_random_converted, tmp_path, ssdmoe):
    """--before-code DIR: each streaming arm runs again, as ARM@before, from that checkout in
    the same rounds (order rotated, paired); the JSON says which code each side ran. A
    checkout whose worker fails shows it ran there: the failure names the @before arm. A
    directory that is not a checkout is one line."""
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "b.json"
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "resident,staged", "--rounds",
               "2", "--max-tokens", "3", "--num-prompts", "1", "--before-code", str(repo),
               "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["order"] == [["resident", "staged", "staged@before"],
                            ["staged", "staged@before", "resident"]]
    assert res["before_code"]["path"] == str(repo) == res["code"]["path"]
    assert res["tokens_identical"] is True  # the same engine on both sides here
    assert res["summary"]["staged"]["over_before_paired"] > 0
    fake = tmp_path / "fake"
    (fake / "engine" / "bench").mkdir(parents=True)
    (fake / "engine" / "__init__.py").write_text("")
    (fake / "engine" / "bench" / "__init__.py").write_text("")
    (fake / "engine" / "bench" / "arm.py").write_text(
        "import sys\nsys.exit('the fake checkout ran')\n")
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "staged", "--rounds", "1",
               "--max-tokens", "3", "--num-prompts", "1", "--before-code", str(fake),
               "--json", str(tmp_path / "c.json"))
    assert r.returncode == 2
    assert "bench arm staged@before: worker failed (the fake checkout ran)" in r.stderr
    r = ssdmoe("bench", str(tiny_random_converted), "--before-code", str(tmp_path))
    assert r.returncode == 2 and "not a checkout of ssdmoe" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bench_hint_arm_keeps_the_heads_tokens(tiny_random_converted, model_copy, tmp_path,
                                               ssdmoe):
    """staged-prerouter-hint runs the heads with the first layer's token table: the same
    tokens as staged-prerouter (a hint never routes), first-layer prefetches in decode; heads
    without a table are refused in one line."""
    from prerouter_helpers import _heads, _hint_table

    root = model_copy(tiny_random_converted)
    heads = _heads(root, root / "prerouter", seed=1)
    r = ssdmoe("bench", str(root), "--arms", "staged-prerouter-hint")
    assert r.returncode == 2 and "no first-layer hint table" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    _hint_table(root, heads)
    out = tmp_path / "b.json"
    r = ssdmoe("bench", str(root), "--arms", "staged-prerouter,staged-prerouter-hint",
               "--rounds", "1", "--max-tokens", "6", "--num-prompts", "1",
               "--page-cache-budget", "25%", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["hint_tokens_identical"] is True
    assert res["runs"]["staged-prerouter-hint"][0]["config"]["first_layer_hint"] is True


def test_native_reads_reach_the_arms_workers(tiny_random_converted, tmp_path, ssdmoe):
    """--native-reads is each streaming arm's setting, in its worker: the raw rounds' engine
    config says who read (native where the pool builds), and without the flag Python readers."""
    from engine import native_reads

    lib, _ = native_reads.load()
    kinds = {}
    for flag in ("--native-reads", "--no-native-reads"):
        out = tmp_path / f"{flag}.json"
        r = ssdmoe("bench", str(tiny_random_converted), "--arms", "staged", "--rounds", "1",
                   "--max-tokens", "3", "--num-prompts", "1", flag, "--json", str(out))
        assert r.returncode == 0, r.stderr
        res = json.loads(out.read_text())
        kinds[flag] = res["runs"]["staged"][0]["config"]["readers_kind"]
        assert res["native_reads"] is (flag == "--native-reads")
    assert kinds["--no-native-reads"] == "python: native reads off"
    # --before-python-reads alone: each streaming arm again as ARM@before, Python readers
    out = tmp_path / "paired.json"
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "staged", "--rounds", "1",
               "--max-tokens", "3", "--num-prompts", "1", "--native-reads",
               "--before-python-reads", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["order"] == [["staged", "staged@before"]]
    assert res["runs"]["staged"][0]["config"]["readers_kind"] == kinds["--native-reads"]
    assert res["runs"]["staged@before"][0]["config"]["readers_kind"] == \
        "python: native reads off"
    if lib is not None:
        assert kinds["--native-reads"] == "native"
    else:  # no compiler here: the arm fell back, and says why
        assert kinds["--native-reads"].startswith("python: ") and "off" not in kinds[
            "--native-reads"]
