"""The trace recorder against independent references: step counts from the generation plan,
counters from the load rows, routing from a resident mlx-lm forward with spies on its router
(and softmax-topk redone in NumPy from the spied logits), cold loads after dropping the page
cache; plus the writer's flush gating and bulk routing rows."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import polars as pl
import pytest

from engine.capture import capture, start_recorder
from engine.generate import generate
from engine.loader import load_resident, load_streaming
from engine.recorder import Recorder
from traces.reader import read_trace
from traces.run_info import RunInfo
from traces.schema import ROUTING_COLUMNS, STEP_COLUMNS
from traces.writer import TraceWriter

PROMPTS = ["def fibonacci(n):\n    return", "The quick brown fox"]
MAX_TOKENS = 6
CHUNK = 4  # prefill_step_size: several prefill steps per prompt


def _plan(tok, prompt: str) -> list[tuple[str, int]]:
    """(phase, tokens) of every step engine.generate runs (worked out from its contract:
    prompt[:-1] in chunks, the last prompt token alone, then MAX_TOKENS - 1 decode steps)."""
    n = len(tok.encode(prompt))
    rest, plan = n, []
    while rest > 1:
        c = min(CHUNK, rest - 1)
        plan.append(("prefill", c))
        rest -= c
    return plan + [("prefill", 1)] + [("decode", 1)] * (MAX_TOKENS - 1)


@pytest.fixture(scope="module")
def traced(tiny_random_converted, tmp_path_factory):
    """A capture of PROMPTS on tiny-random (on-demand / exact path) and its trace."""
    eng = load_streaming(tiny_random_converted)
    tok = eng.tokenizer
    out = tmp_path_factory.mktemp("trace") / "t"
    rec = start_recorder(out, eng, page_cache_every=1)
    results = capture(eng, PROMPTS, MAX_TOKENS, recorder=rec,
                      prefill_step_size=CHUNK)
    rec.close()
    plans = [_plan(tok, p) for p in PROMPTS]
    residency = (eng.store.residency_method, eng.store.residency_fallback,
                 eng.store.nowait_starts_io)
    eng.close()
    trace = read_trace(out)
    return trace, results, plans, residency


def test_steps_follow_the_generation_plan(traced):
    trace, results, plans, residency = traced
    s = trace.steps.sort("step")
    assert trace.complete
    assert dict(s.schema) == STEP_COLUMNS
    want = [(i, ph, n) for i, plan in enumerate(plans) for ph, n in plan]
    assert list(zip(s["request"], s["phase"], s["tokens"], strict=True)) == want
    assert s["step"].to_list() == list(range(len(want)))
    assert [len(r.tokens) for r in results] == [MAX_TOKENS] * len(PROMPTS)
    # wall = build + eval + blocked, every part non-negative
    wall = s["end_ns"] - s["start_ns"]
    assert (wall == s["build_ns"] + s["eval_ns"] + s["blocked_ns"]).all()
    assert (s["build_ns"] >= 0).all() and (s["eval_ns"] >= 0).all()
    assert (s["mlx_active_bytes"] > 0).all() and (s["mlx_peak_bytes"] >= s["mlx_active_bytes"]
                                                  ).all()
    assert (s["rss_bytes"] > 10 << 20).all()
    expert_files = sum(int(v["size"]) for k, v in _manifest_files(trace).items()
                       if k.startswith("experts/"))
    assert ((s["page_cache_bytes"] > 0) & (s["page_cache_bytes"] <= expert_files)).all()
    assert trace.run["model"]["experts"] == 32 and trace.run["model"]["k"] == 4
    assert trace.run["model"]["layers"] == 4 and len(trace.run["model"]["manifest_sha256"]) == 64
    assert trace.run["engine"]["paths_in_use"]["decode"] == {"exact": [0, 1, 2, 3]}
    assert trace.run["machine"]["filesystem"]
    # the cold flags mean what the store's classification measures: run.json says which
    method, fallback, starts_io = residency
    assert method in ("rwf_nowait", "mincore")
    assert trace.run["engine"]["residency"] == {"method": method, "fallback": fallback,
                                                "nowait_starts_io": starts_io}
    assert (method == "mincore") == (fallback is not None)


def _manifest_files(trace) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(trace.run["model"]["path"]) / "manifest.json").read_text())["files"]


def test_step_counters_equal_the_load_rows(traced):
    trace, _, _, _ = traced
    loads = trace.loads
    assert loads["bytes"].sum() == trace.steps["bytes_read"].sum() > 0
    per_step = loads.group_by("step").agg(
        pl.col("bytes").sum().alias("b"), pl.len().alias("n"),
        pl.col("cold").sum().alias("c"), pl.col("wait_ns").filter(pl.col("waited")).sum()
        .alias("w"))
    joined = trace.steps.join(per_step, on="step", how="left").fill_null(0)
    assert (joined["bytes_read"] == joined["b"]).all()
    assert (joined["loads"] == joined["n"]).all()
    assert (joined["cold_loads"] == joined["c"]).all()
    assert (joined["blocked_ns"] == joined["w"]).all()
    # exact path: each layer reads each of its distinct routed experts once per step
    routed = trace.routing.explode("experts").group_by("step", "layer").agg(
        pl.col("experts").n_unique().alias("distinct"))
    n_loads = loads.group_by("step", "layer").len()
    both = routed.join(n_loads, on=["step", "layer"])
    assert both.height == routed.height and (both["distinct"] == both["len"]).all()


def _spy(inner, fn) -> nn.Module:
    class Spy(nn.Module):
        def __call__(self, *args):
            out = inner(*args)
            fn(*args, out)
            return out

    return Spy()


def test_routing_equals_a_resident_forward(traced, tiny_random_converted):
    trace, results, _, _ = traced
    model, tok = load_resident(tiny_random_converted)
    step = [0]
    logits: dict[tuple[int, int], np.ndarray] = {}
    chosen: dict[tuple[int, int], np.ndarray] = {}
    for i, layer in enumerate(model.layers):
        def on_gate(x, out, i=i):
            logits[(step[0], i)] = np.array(out.astype(mx.float32)).reshape(-1, out.shape[-1])

        def on_switch(x, inds, out, i=i):
            chosen[(step[0], i)] = np.array(inds).reshape(-1, inds.shape[-1])

        layer.mlp.gate = _spy(layer.mlp.gate, on_gate)
        layer.mlp.switch_mlp = _spy(layer.mlp.switch_mlp, on_switch)
    step0 = 0
    for request, prompt in enumerate(PROMPTS):
        ref = generate(model, tok, prompt, MAX_TOKENS, prefill_step_size=CHUNK,
                       stop_at_eos=False, step0=step0,
                       on_step_start=lambda s, ph, n: step.__setitem__(0, s))
        assert ref.tokens == results[request].tokens
        step0 += len(ref.steps)
    k = trace.run["model"]["k"]
    rows = trace.routing.sort("step", "layer", "token")
    assert dict(rows.schema) == ROUTING_COLUMNS
    assert set(rows["source"]) == {"router"} and rows["router_experts"].null_count() == rows.height
    # one row per (step, layer, token): decode steps have layers x 1 rows
    got = {(s, la): [] for s, la in chosen}
    for s, la, t, e, w in rows.select("step", "layer", "token", "experts", "weights").iter_rows():
        assert t == len(got[(s, la)])
        got[(s, la)].append((e, w))
    assert set(got) == set(chosen)
    for key, ref_inds in chosen.items():
        assert len(got[key]) == ref_inds.shape[0]
        probs = np.exp(logits[key] - logits[key].max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        for t, (experts, weights) in enumerate(got[key]):
            assert len(set(experts)) == k == len(experts)
            assert set(experts) == set(ref_inds[t].tolist())
            topk = set(np.argsort(-probs[t])[:k].tolist())
            assert set(experts) == topk
            p = probs[t][experts]
            np.testing.assert_allclose(weights, p / p.sum(), rtol=1e-4, atol=1e-6)


def test_cold_loads_after_dropping_the_page_cache(tiny_random_converted, tmp_path):
    eng = load_streaming(tiny_random_converted)
    store = eng.store

    def drop() -> None:
        """The premise: no page of the expert files resident. DONTNEED leaves pages that are
        mapped or under writeback elsewhere, so try a few times, then skip rather than test
        the recorder on a cache that did not empty."""
        left = store.drop_until_cold(tries=5, settle_s=0.1)
        if left == 0:
            return
        eng.close()
        pytest.skip(f"the page cache kept {left} bytes of the expert files after "
                    "POSIX_FADV_DONTNEED (tmpfs, or pages pinned elsewhere)")

    drop()
    rec = start_recorder(tmp_path / "t", eng, page_cache_every=1)
    capture(eng, PROMPTS[:1], 3, recorder=rec, prefill_step_size=CHUNK)
    drop()  # the second prompt starts cold again
    capture(eng, PROMPTS[1:], 3, recorder=rec, prefill_step_size=CHUNK,
            step0=rec.steps, request0=1)
    rec.close()
    eng.close()
    trace = read_trace(tmp_path / "t")
    s = trace.steps.sort("step")
    first = [s.filter(pl.col("request") == r).row(0, named=True) for r in (0, 1)]
    for row in first:  # after a drop the step reads from the disk, and says so
        assert row["loads"] > 0 and row["cold_loads"] > 0
    # Not every read of such a step is cold, though: a read caches whole folios, which on a
    # 6.x kernel can hold neighbouring experts' pages, so later reads of the step may find
    # theirs resident (seen on tiny-random's 4 KiB slices). The very first read after the
    # first drop has nothing before it: it is cold.
    loads = trace.loads.filter(pl.col("step") == first[0]["step"]).sort("started_ns")
    assert loads["cold"][0]
    # the page cache grows from empty as the experts are read, and never exceeds what was read
    pc = s["page_cache_bytes"].to_list()
    assert 0 < pc[0] <= first[0]["bytes_read"] + 4096 * first[0]["loads"] * 9
    later = s.filter(pl.col("request") == 0)[1:]
    assert later["cold_loads"].sum() < later["loads"].sum()  # re-read experts come warm
    assert trace.loads["cold"].sum() == s["cold_loads"].sum()


def test_staged_preset_traces_cache_counters(tiny_random_converted, tmp_path):
    from contract.engine_config import EngineConfig

    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset("staged"))
    rec = start_recorder(tmp_path / "t", eng)
    capture(eng, PROMPTS[:1], 8, recorder=rec, prefill_step_size=CHUNK)
    rec.close()
    eng.close()
    trace = read_trace(tmp_path / "t")
    d = trace.steps.filter(pl.col("phase") == "decode")
    # staged: every routed expert of a decode step is a slot hit or a miss that was read
    assert ((d["cache_hits"] + d["cache_misses"]) == 4 * 4).all()
    demand = trace.loads.filter(pl.col("source") == "demand").group_by("step").len()
    j = d.join(demand, on="step", how="left").fill_null(0)
    assert (j["cache_misses"] == j["len"]).all()
    assert trace.loads["bytes"].sum() == trace.steps["bytes_read"].sum()
    assert (trace.steps["end_ns"] - trace.steps["start_ns"] == trace.steps["build_ns"]
            + trace.steps["eval_ns"] + trace.steps["blocked_ns"]).all()
    assert trace.run["engine"]["preset"] == "staged"


def test_recorder_context_keeps_an_interrupted_step(tiny_random_converted, tmp_path):
    eng = load_streaming(tiny_random_converted)
    model = eng.model
    stop_at = 3

    def boom(row):
        if row["step"] == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), start_recorder(tmp_path / "t", eng) as rec:
        capture(eng, PROMPTS[:1], MAX_TOKENS, recorder=rec,
                prefill_step_size=CHUNK, on_step=boom)
    eng.close()
    trace = read_trace(tmp_path / "t")
    assert not trace.complete
    assert trace.steps["step"].to_list() == list(range(stop_at + 1))
    assert set(trace.routing["step"]) <= set(range(stop_at + 1))
    for block in [b for b in model.layers]:  # detached
        assert block.mlp.on_routing is None


# ------------------------------------------------------------ writer additions


def _run() -> RunInfo:
    return RunInfo(model={"experts": 4}, engine={})


def test_writer_flush_waits_for_min_interval(tmp_path):
    w = TraceWriter(tmp_path / "t", _run(), flush_every=1, min_interval_s=3600)
    for s in range(5):
        w.add_step({"step": s, "phase": "decode", "tokens": 1})
    assert read_trace(tmp_path / "t").steps.height == 0  # due by count, not by time
    w.min_interval_s = 0
    w.add_step({"step": 5, "phase": "decode", "tokens": 1})
    assert read_trace(tmp_path / "t").steps.height == 5
    assert w.flushes == 2  # the empty one at creation and this one


def test_held_steps_are_written_between_requests_or_past_the_cap(tmp_path):
    """hold=True (the recorder's steps): no flush at flush_every however due, one at
    flush_if_due (a request boundary) once flush_every are held, and one past max_held_steps."""
    w = TraceWriter(tmp_path / "t", _run(), flush_every=2, max_held_steps=5)
    for s in range(5):
        w.add_step({"step": s, "phase": "decode", "tokens": 1}, hold=True)
    assert w.flushes == 1 and read_trace(tmp_path / "t").steps.height == 0
    w.add_step({"step": 5, "phase": "decode", "tokens": 1}, hold=True)  # 5 held: the cap
    assert w.flushes == 2 and read_trace(tmp_path / "t").steps.height == 5
    w.flush_if_due()  # one held, fewer than flush_every
    assert w.flushes == 2
    w.add_step({"step": 6, "phase": "decode", "tokens": 1}, hold=True)
    w.flush_if_due()
    assert w.flushes == 3 and read_trace(tmp_path / "t").steps.height == 7


def test_the_recorder_writes_between_requests_never_inside_one(tiny_random_converted, tmp_path):
    """Two prompts, a flush due after every step: the only flushes (besides the empty trace
    at the start and close) come before the second request's first step, when every step of
    the first is held, so no timed step (prefill chunk or decode) ever contains one."""
    eng = load_streaming(tiny_random_converted)
    rec = start_recorder(tmp_path / "t", eng, flush_every=1, flush_interval_s=0,
                         max_flush_fraction=0)
    at = []
    flush = rec.writer.flush
    rec.writer.flush = lambda *a, **k: (at.append(rec.steps), flush(*a, **k))[1]
    capture(eng, PROMPTS, MAX_TOKENS, recorder=rec, prefill_step_size=CHUNK)
    first = len(_plan(eng.tokenizer, PROMPTS[0]))
    rec.close()
    eng.close()
    assert at[:-1] == [first]  # then close's
    assert read_trace(tmp_path / "t").steps.height == rec.steps


def test_writer_bulk_routing_rows_and_nested_lists(tmp_path):
    w = TraceWriter(tmp_path / "t", _run())
    w.add_routing_columns({"step": [0, 0], "layer": [1, 1], "token": [0, 1],
                           "experts": [[3, 1], [0, 2]], "weights": [[0.25, 0.75], [0.5, 0.5]],
                           "source": ["router"] * 2}, 2)
    w.add_routing({"step": 1, "layer": 0, "token": 0, "experts": [2, 3], "weights": [1.0, 0.0],
                   "source": "prediction", "router_experts": [1, 2]})
    with pytest.raises(ValueError, match="experts"):
        w.add_routing_columns({"step": [0], "experts": [[1, 2], [3, 4]]}, 1)
    w.close()
    r = read_trace(tmp_path / "t").routing.sort("step", "token")
    assert dict(r.schema) == ROUTING_COLUMNS
    assert r["experts"].to_list() == [[3, 1], [0, 2], [2, 3]]
    assert r["weights"].to_list() == [[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]]
    assert r["router_experts"].to_list() == [None, None, [1, 2]]


def test_page_cache_sampling_is_adaptive(tmp_path, monkeypatch):
    """A fake clock, hand-worked: each sample costs 2 ms and may take 1% of wall time, so
    after a sample the next is due 200 ms later. Steps every 1 ms for 450 ms: samples at
    t = 0, at t = 202 ms (the first step >= 2 ms + 200 ms) and at t = 404 ms; -1 otherwise."""
    import engine.recorder as recorder

    clock = [0]

    class SlowStore:
        calls = 0

        def page_cache_bytes(self):
            SlowStore.calls += 1
            clock[0] += 2_000_000  # the sample takes 2 ms of the fake clock
            return 123

    monkeypatch.setattr(recorder.time, "perf_counter_ns", lambda: clock[0])
    rec = Recorder(tmp_path / "t", _run(), page_cache_fraction=0.01)
    rec.store = SlowStore()
    sampled = []
    for ms in range(450):
        clock[0] = max(clock[0], ms * 1_000_000)
        if rec._page_cache(clock[0]) == 123:
            sampled.append(ms)
    assert sampled == [0, 202, 404]
