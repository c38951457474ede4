"""Fill points and the decode loop's lookahead (engine.fill_points, engine.generate): staged
layers filled on demand defer their host sync to evaluation, the output stays bit-identical
to the exact path, an unresolved fill point really would corrupt the output (so the
mechanism is load-bearing, and the checks can fail), windows of a lookahead trace tile the
decode phase, and stopping at EOS leaves the engine consistent."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import polars as pl
import pytest

from contract.engine_config import EngineConfig
from engine.capture import capture, start_recorder
from engine.fill_points import resolve
from engine.generate import generate
from engine.loader import load_resident, load_streaming
from traces.reader import read_trace

PROMPT = "def merge(a, b):\n    out = []"
N = 16


@pytest.fixture(scope="module")
def reference(tiny_random_converted):
    """Greedy tokens of the exact path (on-demand preset): the correctness baseline."""
    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset("on-demand"))
    model, tok = eng.model, eng.tokenizer
    out = generate(model, tok, PROMPT, N, stop_at_eos=False, runtime=eng.runtime).tokens
    eng.close()
    return out


@pytest.fixture
def staged(tiny_random_converted):
    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset("staged"))
    yield eng
    eng.close()


@pytest.mark.parametrize("preset", ["staged", "hot"])
@pytest.mark.parametrize("lookahead", [True, False])
def test_decode_defers_every_sync_and_matches_exact(preset, lookahead, reference,
                                                    tiny_random_converted):
    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset(preset))
    model, tok, store = eng.model, eng.tokenizer, eng.store
    generate(model, tok, PROMPT, 4, stop_at_eos=False, runtime=eng.runtime)  # prefill loads aside
    loads: list[dict] = []
    store.on_load = loads.append
    before = eng.runtime.stats.snapshot()
    r = generate(model, tok, PROMPT, N, stop_at_eos=False, runtime=eng.runtime, lookahead=lookahead)
    d = eng.runtime.stats.delta(eng.runtime.stats.snapshot(), before)
    assert r.tokens == reference
    single = sum(1 for s in r.steps if s["tokens"] == 1)  # the last prompt token + decode
    layers = len(store.manifest.moe_layers)
    assert d["route_syncs"] == 0  # nothing synced while a graph was being built
    assert d["deferred_syncs"] == single * layers  # one fill point per layer and step
    # every routed expert of every single-token call was a hit or a miss that was read
    assert d["cache_hits"] + d["cache_misses"] == single * layers * store.manifest.top_k
    assert d["cache_misses"] == sum(1 for r in loads if r["expert"] >= 0)
    eng.close()


def test_unresolved_fill_points_would_corrupt_the_output(staged, tiny_random_converted):
    """A single-token forward built under `collecting()`: evaluated without resolving its
    fill points, the empty slots give zeros (wrong logits); resolved, the logits equal the
    fully resident mlx-lm model's."""
    from mlx_lm.models.cache import make_prompt_cache

    eng = staged

    model, tok = eng.model, eng.tokenizer
    fills = eng.runtime.fills
    resident, _ = load_resident(tiny_random_converted)
    token = mx.array([[tok.encode(PROMPT)[0]]])
    want = np.array(resident(token, cache=make_prompt_cache(resident)))

    with fills.collecting():
        skipped = model(token, cache=make_prompt_cache(model))
    fills.take()  # dropped: no slot is ever filled
    assert not np.allclose(np.array(skipped), want, atol=1e-3)

    with fills.collecting():
        logits = model(token, cache=make_prompt_cache(model))
    points = fills.take()
    assert len(points) == len(eng.runtime.staged())
    resolve(points)
    assert np.array_equal(np.array(logits), want)


def test_outside_the_loop_staged_syncs_at_build(staged, tiny_random_converted):
    from mlx_lm.models.cache import make_prompt_cache

    eng = staged

    model, tok = eng.model, eng.tokenizer
    resident, _ = load_resident(tiny_random_converted)
    token = mx.array([[tok.encode(PROMPT)[1]]])
    before = eng.runtime.stats.snapshot()
    got = np.array(model(token, cache=make_prompt_cache(model)))
    d = eng.runtime.stats.delta(eng.runtime.stats.snapshot(), before)
    assert d["route_syncs"] == len(eng.runtime.staged()) and d["deferred_syncs"] == 0
    assert np.array_equal(got, np.array(resident(token, cache=make_prompt_cache(resident))))


def _hook_order(model, tok, eng) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []
    generate(model, tok, PROMPT, 6, stop_at_eos=False, runtime=eng.runtime,
             on_step_start=lambda s, ph, n: events.append(("start", s)),
             on_step=lambda row: events.append(("end", row["step"])))
    return events


@pytest.mark.parametrize("preset,overlapped", [("staged", True), ("hot", True),
                                                ("on-demand", False)])
def test_lookahead_builds_the_next_step_before_the_token_arrives(preset, overlapped,
                                                                 tiny_random_converted):
    """Order of hooks: with lookahead (staged, hot) step t+1 starts before step t ends; a
    preset whose decode path syncs while the graph is built (exact) runs steps one after the
    other."""
    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset(preset))
    model, tok = eng.model, eng.tokenizer
    events = _hook_order(model, tok, eng)
    ends = [s for kind, s in events if kind == "end"]
    for s in ends[-5:-1]:  # decode steps that have a successor
        starts_next = events.index(("start", s + 1))
        assert (starts_next < events.index(("end", s))) == overlapped, events
    assert ("start", ends[-1] + 1) not in events  # no step built past max_tokens
    assert bool(eng.runtime.syncs_at_build("decode")) == (not overlapped)
    eng.close()


def test_lookahead_trace_windows_tile_the_decode(staged, reference, tmp_path):
    eng = staged
    rec = start_recorder(tmp_path / "t", eng)
    results = capture(eng, [PROMPT], N, recorder=rec)
    rec.close()
    assert results[0].tokens == reference
    trace = read_trace(tmp_path / "t")
    s = trace.steps.sort("step")
    d = s.filter(pl.col("phase") == "decode")
    starts, ends = d["start_ns"].to_list(), d["end_ns"].to_list()
    assert starts[1:] == ends[:-1]  # each window starts where the previous one ended
    first = s.filter(pl.col("step") == d["step"][0] - 1)  # the last prompt token's step
    assert starts[0] == first["end_ns"][0]
    assert (s["end_ns"] - s["start_ns"] == s["build_ns"] + s["eval_ns"] + s["blocked_ns"]).all()
    assert (s["build_ns"] >= 0).all() and (s["eval_ns"] >= 0).all()
    # routing rows are keyed by the step that ran them although steps overlap: each decode
    # step's routed experts equal what its slots served (hits + misses = K per layer)
    r = trace.routing.filter(pl.col("step").is_in(d["step"].to_list()))
    assert r.group_by("step").len()["len"].to_list() == [len(eng.runtime.staged())] * len(d)
    loads = trace.loads.filter(pl.col("source") == "demand")
    assert set(loads["step"].to_list()) <= set(s["step"].to_list())


def test_stop_at_eos_drops_the_step_built_ahead(staged, reference):
    eng = staged
    model, tok = eng.model, eng.tokenizer
    eos = reference[5]
    stop = reference.index(eos)
    saved = tok.eos_token_ids
    tok.eos_token_ids = [eos]
    try:
        r = generate(model, tok, PROMPT, N, runtime=eng.runtime, step0=100)
    finally:
        tok.eos_token_ids = saved
    assert r.finish_reason == "stop" and r.tokens == reference[:stop]
    steps = [s["step"] for s in r.steps]
    assert steps == list(range(100, 100 + len(steps)))  # the dropped step left no gap
    fills = eng.runtime.fills
    assert not fills.backlog and not fills.pending  # nothing of it is left to resolve
    again = generate(model, tok, PROMPT, N, stop_at_eos=False, runtime=eng.runtime)
    assert again.tokens == reference  # the engine is consistent after the drop


def test_sampling_is_the_same_with_and_without_lookahead(staged):
    eng = staged
    model, tok = eng.model, eng.tokenizer
    a = generate(model, tok, PROMPT, N, temp=0.8, seed=7, stop_at_eos=False, runtime=eng.runtime)
    b = generate(model, tok, PROMPT, N, temp=0.8, seed=7, stop_at_eos=False, runtime=eng.runtime,
                 lookahead=False)
    assert a.tokens == b.tokens


def test_cli_capture_no_lookahead_records_it(tiny_random_converted, tmp_path, ssdmoe,
                                             reference):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": ' + __import__("json").dumps(PROMPT) + "}\n")
    for flag in ("--lookahead", "--no-lookahead"):
        out = tmp_path / flag
        r = ssdmoe("capture", str(tiny_random_converted), "--out", str(out), "--preset",
                   "staged", "--prompts", str(prompts), "--max-tokens", str(N),
                   "--no-progress", flag)
        assert r.returncode == 0, r.stderr
        trace = read_trace(out)
        assert trace.run["engine"]["lookahead"] == (flag == "--lookahead")
        d = trace.steps.filter(pl.col("phase") == "decode").sort("step")
        tiled = d["start_ns"].to_list()[1:] == d["end_ns"].to_list()[:-1]
        assert tiled == (flag == "--lookahead")  # without lookahead: gaps between steps


def test_a_fill_resolved_during_a_later_build_labels_its_loads_with_its_own_step():
    """The step clock, not the store, says which step a load belongs to: a point registered
    at step 3 and resolved while step 4 is built reads at step 3, and the clock is back at 4
    afterwards."""
    from engine.fill_points import FillPoint, FillPoints

    fills = FillPoints()
    seen: list[int] = []
    fills.clock.step = 3
    with fills.collecting():
        fills.defer(FillPoint(lambda _inds: seen.append(fills.clock.step)), mx.array([1]))
    points = fills.take()
    assert [p.step for p in points] == [3]
    fills.clock.step = 4  # the next step is being built
    fills.begin(points, None)
    fills.drain()
    assert seen == [3] and fills.clock.step == 4


def test_queueing_a_fill_points_evaluation_is_not_graph_building(monkeypatch):
    """On CPU, MLX's async_eval blocks until only a few dozen operations remain queued: that is
    the main thread waiting on compute. progress() reports its whole span as busy (the loop
    cuts it out of build), the queueing included, not only the fill."""
    import time

    import engine.fill_points as fp

    block_s = 0.03

    def blocking_async_eval(*_arrays) -> None:
        time.sleep(block_s)

    monkeypatch.setattr(fp.mx, "async_eval", blocking_async_eval)
    fills = fp.FillPoints()
    with fills.collecting():  # two routed layers: the first is resolved by progress()
        fills.defer(fp.FillPoint(lambda _inds: None), mx.array([1]), gather=mx.array([2.0]))
        fills.defer(fp.FillPoint(lambda _inds: None), mx.array([4]), gather=mx.array([5.0]))
    fills.begin(fills.take(), mx.array([3.0]))
    fills.busy = []
    t0 = time.perf_counter_ns()
    fills.progress()  # the fill, then queueing its gather and the walk on: two blocks
    t1 = time.perf_counter_ns()
    covered = sum(min(z, t1) - max(a, t0) for a, z in fills.busy if z > t0 and a < t1)
    assert covered >= 2 * block_s * 1e9 * 0.99
    assert covered <= t1 - t0


def test_progress_times_each_part_where_it_happens(monkeypatch):
    """progress() charges each part to its own phase: a next point's early start, the head
    point's fill, handing the gather over and the kick each block a known, different time
    here, and each phase gets its own (not a neighbour's), once per call."""
    import time

    import engine.fill_points as fp

    def blocking_async_eval(arrays) -> None:  # the gather alone, then the kick's list
        time.sleep(0.004 if isinstance(arrays, list) else 0.008)

    monkeypatch.setattr(fp.mx, "async_eval", blocking_async_eval)
    fills = fp.FillPoints()
    inds = [mx.array([n]) for n in range(3)]
    with fills.collecting():
        fills.defer(fp.FillPoint(lambda _i: time.sleep(0.012)), inds[0], gather=mx.array([1.0]))
        for n in (1, 2):
            fills.defer(fp.FillPoint(lambda _i: None, start=lambda _i: time.sleep(0.016),
                                     early=True), inds[n])
    fills.begin(fills.take(), mx.array([9.0]))
    fills.progress()  # layer 0: layer 1's start, 0's fill, 0's gather, the kick to 1 and 2
    ms = {k: v / 1e6 for k, v in fills.phase_ns.items()}
    assert fills.phase_calls == 1
    for phase, slept in (("start_next", 16), ("fill", 12), ("gather", 8), ("kick", 4)):
        assert slept <= ms[phase] < slept + 3.5, (phase, ms)


def test_after_a_fill_the_walk_to_a_same_token_leads_next_ids_is_queued(monkeypatch):
    """Same-token lead: after layer N's fill the evaluation is queued up to the ids layer N+2
    was predicted with (layer N+1's input needs nothing N+1's fill writes), not only to N+1's
    ids, which its early start already brought to the host; and up to layer N+1's input, so
    the step's last layer, which no prediction comes from, has its attention queued before
    its fill too (not handed over with its gather while compute idles)."""
    import engine.fill_points as fp

    queued: list[set[int]] = []

    def record(arrays) -> None:
        queued.append({id(a) for a in (arrays if isinstance(arrays, list) else [arrays])})

    monkeypatch.setattr(fp.mx, "async_eval", record)
    fills = fp.FillPoints()
    inds = [mx.array([n]) for n in range(4)]
    xs = [mx.array([10.0 + n]) for n in range(4)]  # each layer's input
    final = mx.array([9.0])
    with fills.collecting():
        fills.defer(fp.FillPoint(lambda _i: None), inds[0], layer_input=xs[0])  # routed
        for n in (1, 2, 3):
            fills.defer(fp.FillPoint(lambda _i: None, start=lambda _i: None, early=True),
                        inds[n], layer_input=xs[n])
    fills.begin(fills.take(), final)
    assert queued[-1] == {id(inds[0]), id(inds[1])}  # a routed layer's ids need its input
    fills.progress()  # layer 0's fill (layer 1's reads started first)
    assert queued[-1] == {id(inds[1]), id(xs[1]), id(inds[2])}
    fills.progress()
    assert queued[-1] == {id(inds[2]), id(xs[2]), id(inds[3])}
    fills.progress()  # the last layer: no ids after it, its input still queued
    assert queued[-1] == {id(inds[3]), id(xs[3])}
    fills.progress()
    assert queued[-1] == {id(final)}


def test_a_blocking_async_eval_shows_as_eval_not_build(staged, monkeypatch):
    """The same in the decode loop: with every async_eval made to block, each staged decode
    step's added blocking (2 per staged layer in its fill points) goes to eval_ns, and build
    stays what it is with the blocking off."""
    import time

    import engine.fill_points as fp

    eng = staged
    layers = len(eng.runtime.staged())
    real = fp.mx.async_eval
    block_s = 0.004

    def blocking_async_eval(*arrays) -> None:
        real(*arrays)
        time.sleep(block_s)

    def decode_rows() -> list[dict]:
        rows: list[dict] = []
        generate(eng.model, eng.tokenizer, PROMPT, 8, stop_at_eos=False, runtime=eng.runtime,
                 on_step=rows.append)
        return [r for r in rows if r["phase"] == "decode"][1:]  # the first: built in prefill

    plain = decode_rows()
    monkeypatch.setattr(fp.mx, "async_eval", blocking_async_eval)
    blocked = decode_rows()
    added = 2 * layers * block_s * 1e9
    build = np.median([r["build_ns"] for r in blocked]) - np.median([r["build_ns"] for r in plain])
    evals = np.median([r["eval_ns"] for r in blocked]) - np.median([r["eval_ns"] for r in plain])
    assert evals >= 0.8 * added
    assert build < 0.2 * added


def test_the_predicted_ids_come_to_the_host_in_one_sync(monkeypatch):
    """begin() brings the ids of every wait-only point (a prerouter's predictions) to the host
    with one evaluation before their starts run: each sync is a round trip to the compute
    thread, so five layers' ids fetched one by one cost five. The routed head's walk is
    queued first, and the starts then find their ids on the host."""
    import engine.fill_points as fp

    evals: list[list] = []
    real_eval = fp.mx.eval
    monkeypatch.setattr(fp.mx, "eval", lambda arrays: (evals.append(arrays), real_eval(arrays)))
    monkeypatch.setattr(fp.mx, "async_eval", lambda *_a: None)
    fills = fp.FillPoints()
    routed = mx.array([0])
    predicted = [mx.array([n]) + 0 for n in (1, 2, 3)]  # lazy, as a step's side outputs are
    started: list[bool] = []
    with fills.collecting():
        fills.defer(fp.FillPoint(lambda _i: None), routed)
        for inds in predicted:
            fills.defer(fp.FillPoint(lambda _i: None, wait_only=True,
                                     start=lambda i: started.append(bool(evals))), inds)
    fills.begin(fills.take(), mx.array([9.0]))
    # the routed head's ids in the same sync (every later point is wait-only: see below)
    assert len(evals) == 1
    assert [id(a) for a in evals[0]] == [id(a) for a in predicted] + [id(routed)]
    assert started == [True, True, True]  # every start ran after the one sync


def test_a_token_lead_step_is_handed_over_layer_by_layer_from_begin(monkeypatch):
    """A prerouter's token lead: the first MoE layer routes itself, the rest were predicted
    (wait-only). begin() queues the head's router, brings every id to the host in one sync,
    starts the head's reads, then the predicted layers', then resolves the head (its reads
    waited for, its gather queued) and the first predicted layer; each progress() then
    resolves one predicted layer (its reads waited for, its gather queued), and the step's
    result is queued after the last. Every read starts before any is waited for, no layer
    waits for a later layer's reads, and the evaluation runs a layer ahead of the build."""
    import engine.fill_points as fp

    log: list[str] = []
    names: dict[int, str] = {}

    def queued(arrays) -> None:
        for a in arrays if isinstance(arrays, list) else [arrays]:
            log.append("queue " + names[id(a)])

    monkeypatch.setattr(fp.mx, "async_eval", queued)
    monkeypatch.setattr(fp.mx, "eval", lambda arrays: log.append(
        "sync " + ",".join(names[id(a)] for a in arrays)))
    fills = fp.FillPoints()
    final = mx.array([9.0])
    names[id(final)] = "final"
    arrays = []
    with fills.collecting():
        for n in range(4):
            inds, gather = mx.array([n]), mx.array([float(n)])
            arrays += [inds, gather]
            names[id(inds)], names[id(gather)] = f"ids{n}", f"gather{n}"
            if n == 0:
                point = fp.FillPoint(lambda _i: log.append("fill 0"),
                                     issue=lambda _i: log.append("issue 0"))
            else:
                point = fp.FillPoint(lambda _i, n=n: log.append(f"fill {n}"), wait_only=True,
                                     start=lambda _i, n=n: log.append(f"start {n}"))
            fills.defer(point, inds, gather=gather)
    fills.begin(fills.take(), final)
    assert log == ["queue ids0", "sync ids1,ids2,ids3,ids0", "issue 0", "start 1", "start 2",
                   "start 3", "fill 0", "queue gather0", "fill 1", "queue gather1"]
    log.clear()
    fills.progress()
    assert log == ["fill 2", "queue gather2"]
    log.clear()
    fills.progress()
    assert log == ["fill 3", "queue gather3", "queue final"]
    log.clear()
    fills.progress()  # nothing left
    assert log == [] and not fills.backlog
