"""The lookahead decode loop (Scenario.lookahead, sim.main_thread.decode_lookahead) against
hand-worked timelines, next to the synchronous loop on the same numbers, and the trace ->
scenario rule that turns it on (sim.compare).

Every timing test uses one model: L = 4 layers, K = 2, memory bandwidth 1 GB/s, so per layer
  attention a = resident 4 MB / 4 / 1 GB/s            = 1.0 ms
  experts   x = K x 250 kB / 1 GB/s                   = 0.5 ms,   c = a + x = 1.5 ms
  sync overhead s = 0.1 ms (accelerator time of a sync that finds work queued or running),
and graph building b per layer (the build segment of the next step).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from sim_helpers import hardware, model, routing_input, scenario

from sim.compare import engine_settings, looked_ahead, scenario_for
from sim.replay import run_scenario
from traces.reader import read_trace

L, A, X, S = 4, 1.0, 0.5, 0.1
C = A + X
FREE_IO = dict(ssd_latency_ms=0.0, ssd_bandwidth_gbps=1e12, load_overhead_ms=0.0,
               cold_overhead_ms=0.0, memcpy_gbps=0.0)
STEPS = 6
STAGED_TRACE = Path(__file__).resolve().parent / "data" / "tiny-trained-staged"  # a staged capture


def _model(b: float, **over):
    return model(layers=L, experts=16, k=2, bundle_bytes=250_000, resident_bytes=4_000_000,
                 build_ms_per_layer=b, **over)


def _hw(lazy: bool = True, **over):
    return hardware(mem_bandwidth_gbps=1.0, sync_overhead_ms=S, lazy_compute=lazy,
                    **{**FREE_IO, **over})


def _same_experts(steps: int = STEPS) -> np.ndarray:
    """Every step routes experts {0, 1} at every layer: after step 0 the sticky slots hold
    them, so no step but the first loads anything (and with free I/O that costs nothing)."""
    return np.tile(np.array([0, 1], dtype=np.int16), (steps, L, 1))


def _alternating(steps: int = STEPS) -> np.ndarray:
    """{0, 1} on even steps, {2, 3} on odd ones, every layer: every step misses every expert."""
    sets = np.array([[0, 1], [2, 3]], dtype=np.int16)
    return np.repeat(sets[np.arange(steps) % 2][:, None, :], L, axis=1)


def _cycling(steps: int = STEPS) -> np.ndarray:
    """{0, 1}, {2, 3}, {4, 5}, {0, 1}, ... at every layer: no step's set was used by either of
    the two steps before it (staging step t+1 happens while step t-1's set is still in the
    sticky slots, so an alternating pair would be resident)."""
    sets = np.array([[0, 1], [2, 3], [4, 5]], dtype=np.int16)
    return np.repeat(sets[np.arange(steps) % 3][:, None, :], L, axis=1)


def _rows_ms(result, col: str = "window") -> list[float]:
    d = result.trace.steps.filter(pl.col("phase") == "decode").sort("step")
    if col == "window":
        return ((d["end_ns"] - d["start_ns"]) / 1e6).to_list()
    return (d[col] / 1e6).to_list()


def _run(b: float, lookahead: bool, lazy: bool = True, router=None, m=None,
         hardware_over: dict | None = None, **over):
    router = _same_experts() if router is None else router
    sc = scenario(hw=_hw(lazy, **(hardware_over or {})), m=m or _model(b),
                  path=over.pop("path", "staged"),
                  lead=over.pop("lead", "none"),
                  decode_steps=len(router), lookahead=lookahead, **over)
    return run_scenario(sc, routing=routing_input(router))


def test_build_hides_behind_compute_when_shorter():
    """b = 0.4 ms < a. Middle window t (starts with step t's layer-0 attention just queued):
      layer 0: build 0.4; sync on router 0: accelerator busy till a = 1.0, + s  -> 1.1
               queue experts 0 + attention 1 (c) -> accelerator till 2.6
      layer l = 1..3: build 0.4 (< c: idle main thread), sync -> +c +s each    -> 1.1 + 3 x 1.6
      after layer 3 only its experts x are queued; token sync: + x + s
      window = (a + s) + 3 (c + s) + x + s = L (c + s) + s = 6.5 ms, build 4 b = 1.6 ms.
    First window: its own graph first (4 b = 1.6) then the same: 8.1 ms, build 3.2.
    Last window: no next step to build, same accelerator timeline: 6.5 ms, build 0.
    The synchronous loop on lazy compute (this machine's): each layer builds b, then its
    sync runs the previous experts and this attention: L (b + c + s) + s = 8.1 ms a step."""
    b = 0.4
    la = _run(b, lookahead=True)
    window = L * (C + S) + S
    assert window == pytest.approx(6.5)
    assert _rows_ms(la) == pytest.approx([L * b + window] + [window] * (STEPS - 1), abs=1e-6)
    assert _rows_ms(la, "build_ns") == pytest.approx(
        [2 * L * b] + [L * b] * (STEPS - 2) + [0.0], abs=1e-6)
    assert _rows_ms(la, "blocked_ns") == pytest.approx([0.0] * STEPS, abs=1e-6)
    windows = np.array(_rows_ms(la))
    evals = np.array(_rows_ms(la, "eval_ns"))
    builds = np.array(_rows_ms(la, "build_ns"))
    assert evals == pytest.approx(windows - builds, abs=1e-6)  # eval = the rest of the window
    sync = _run(b, lookahead=False)
    step = L * (b + C + S) + S
    assert step == pytest.approx(8.1)
    assert _rows_ms(sync) == pytest.approx([step] * STEPS, abs=1e-6)
    assert la.metrics["decode_tok_s"] > sync.metrics["decode_tok_s"]


def test_build_dominates_when_longer_than_the_compute():
    """b = 2.0 ms > c. Middle window: at every fill the accelerator has finished (layer 0's
    attention a < b; each later layer's c < b), so no sync waits and no sync overhead there;
      window = L b + (last layer's experts x) + s = 8 + 0.5 + 0.1 = 8.6 ms, build 8.
    First: own graph 4 b = 8 first -> 16.6 ms. Last (nothing to build): L (c + s) + s = 6.5.
    Synchronous loop, lazy: L (b + c + s) + s = 14.5 ms."""
    b = 2.0
    la = _run(b, lookahead=True)
    window = L * b + X + S
    last = L * (C + S) + S
    assert _rows_ms(la) == pytest.approx([L * b + window] + [window] * (STEPS - 2) + [last],
                                         abs=1e-6)
    assert _rows_ms(la, "build_ns") == pytest.approx(
        [2 * L * b] + [L * b] * (STEPS - 2) + [0.0], abs=1e-6)
    sync = _run(b, lookahead=False)
    assert _rows_ms(sync) == pytest.approx([L * (b + C + S) + S] * STEPS, abs=1e-6)


@pytest.mark.parametrize("b, window", [
    # b < c: the fill's loads D sit in the gap before experts l are queued:
    #   (a + s + D) + 3 (c + s + D) + x + s = L (c + s + D) + s = 4 x 2.1 + 0.1
    (0.4, L * (C + S + 0.5) + S),
    # b > c: the accelerator never waits for the main thread's compute, only the other way:
    #   L (b + D) + x + s = 4 x 2.5 + 0.6
    (2.0, L * (2.0 + 0.5) + X + S),
])
def test_demand_loads_add_their_wait_in_the_gap(b, window):
    """Every step misses both experts of every layer (alternating sets, a one-bundle LRU, no
    page cache): two cold reads per layer on the main thread (readers 0), each 250 kB at
    1 GB/s = 0.25 ms, so D = 0.5 ms per fill, blocked 4 D = 2 ms a step."""
    hw_io = dict(ssd_latency_ms=0.0, ssd_bandwidth_gbps=1.0, load_overhead_ms=0.0,
                 cold_overhead_ms=0.0, memcpy_gbps=0.0)
    sc = scenario(hw=_hw(**hw_io), m=_model(b), path="hot", lru_bytes=250_000,
                  o_direct=True, readers=0, decode_steps=STEPS, lookahead=True)
    result = run_scenario(sc, routing=routing_input(_alternating()))
    middle = _rows_ms(result)[1:-1]
    assert middle == pytest.approx([window] * (STEPS - 2), abs=1e-6)
    assert _rows_ms(result, "blocked_ns") == pytest.approx([L * 0.5] * STEPS, abs=1e-6)
    assert result.metrics["loads_per_step"] == pytest.approx(2 * L)
    if b < C:  # the synchronous loop, lazy: L (b + c + s + D) + s
        sc.lookahead = False
        sync = run_scenario(sc, routing=routing_input(_alternating()))
        assert _rows_ms(sync) == pytest.approx([L * (b + C + S + 0.5) + S] * STEPS, abs=1e-6)


@pytest.mark.parametrize("q, window", [
    # q = 0: async eval is a sync. Per layer b, then the experts x and the attention a run
    # while the main thread waits; the accelerator is idle at every sync: L (b + c) = 7.6
    (0.0, L * (0.4 + C)),
    # q = 0.2 < b: per layer b + (x - q) + a; the token sync finds q left (+ s):
    #   L (b + c - q) + s = 6.9
    (0.2, L * (0.4 + C - 0.2) + S),
    # q = 0.6 >= b: the bound never binds in the steady state: L (c + s) + s = 6.5
    (0.6, L * (C + S) + S),
])
@pytest.mark.parametrize("on_cpu", [False, True])
def test_a_bounded_queue_serialises_building_and_compute(q, window, on_cpu):
    """MLX's async eval returns once little is left queued (hardware queue_ahead_ms, sim.
    compute_stream): the main thread builds only while that little runs. b = 0.4 ms; the
    middle windows, on an accelerator timeline and on the CPU-backend process alike; the
    window's build is still L b, the waits are eval."""
    b = 0.4
    hw = _hw(queue_ahead_ms=q, compute_on_cpu=on_cpu, cpu_cores=0.0)
    sc = scenario(hw=hw, m=_model(b), path="staged", decode_steps=STEPS, lookahead=True)
    result = run_scenario(sc, routing=routing_input(_same_experts()))
    assert _rows_ms(result)[1:-1] == pytest.approx([window] * (STEPS - 2), abs=1e-6)
    assert _rows_ms(result, "build_ns")[1:-1] == pytest.approx([L * b] * (STEPS - 2),
                                                               abs=1e-6)
    unbounded = _run(b, lookahead=True)
    assert _rows_ms(unbounded)[1:-1] == pytest.approx([L * (C + S) + S] * (STEPS - 2), abs=1e-6)


@pytest.mark.parametrize("on_cpu", [False, True])
def test_dispatch_waits_on_the_main_thread_before_each_layer_is_handed_over(on_cpu):
    """Model fill_ms_per_layer f = 0.3 ms: before each layer's experts and the walk to the
    next router are handed over, the main thread prepares and dispatches them (MLX on the
    calling thread), and the accelerator, idle after the sync, waits. b = 0.4 ms < a, so the
    middle window of test_build_hides_behind_compute_when_shorter grows by f per layer:
      (a + s + f) + 3 (c + s + f) + x + s = L (c + s + f) + s = 7.7 ms, all of it eval
    but the L b of building. On this machine's CPU backend (2 cores: dispatch, compute and
    building never outnumber them) the same. The synchronous loop has no dispatch charge
    (its synced compute holds it): L (b + c + s) + s = 8.1 ms as before."""
    b, f = 0.4, 0.3
    hw = _hw(compute_on_cpu=on_cpu, cpu_cores=2.0 if on_cpu else 0.0)
    m = _model(b, fill_ms_per_layer=f)
    sc = scenario(hw=hw, m=m, path="staged", decode_steps=STEPS, lookahead=True)
    result = run_scenario(sc, routing=routing_input(_same_experts()))
    window = L * (C + S + f) + S
    assert window == pytest.approx(7.7)
    assert _rows_ms(result)[1:-1] == pytest.approx([window] * (STEPS - 2), abs=1e-6)
    assert _rows_ms(result, "eval_ns")[1:-1] == pytest.approx([window - L * b] * (STEPS - 2),
                                                              abs=1e-6)
    sc.lookahead = False
    sync = run_scenario(sc, routing=routing_input(_same_experts()))
    assert _rows_ms(sync) == pytest.approx([L * (b + C + S) + S] * STEPS, abs=1e-6)


def test_lookahead_compute_is_never_lazy():
    """The lookahead loop queues with async eval: lazy_compute (a property of the synchronous
    loop) changes nothing in it, while it does change the synchronous loop (b = 0.4 < x: with
    eager compute the build of layer l hides behind layer l-1's experts:
    b + (a + s) + 3 (c + s) + x + s = 6.9 ms instead of 8.1)."""
    b = 0.4
    assert _rows_ms(_run(b, True, lazy=True)) == _rows_ms(_run(b, True, lazy=False))
    eager = _run(b, False, lazy=False)
    assert _rows_ms(eager) == pytest.approx([b + L * (C + S) + S] * STEPS, abs=1e-6)


def test_prerouter_staged_layers_skip_the_sync_and_stage_at_their_step():
    """Layers 1-3 consume predictions (no router sync), heads owned by layers 0-2: head compute
    h = 200 kB / 1 GB/s = 0.2 ms, head building 0.1 ms, b = 0.4. A token lead's step is begun
    at the end of the window before it (engine.fill_points.begin): layer 0's attention + head
    queued, its router synced (a + h + s) and its reads issued, the step's predicted sets
    staged (prefetches issued), its experts queued, then layer 1 resolved (its attention + head
    and experts queued); each
    later layer is resolved as a layer of the next step is built, the unembedding queued after
    the last. The previous step's heads computed the predictions as a side output of its final
    evaluation, queued with its token, so they reach the host with it (reports/io/token-lead).
    Unbounded queue: the accelerator never waits on the host, so a middle window holds the
    same work as when every predicted layer was resolved at layer 0's fill point:
      window = 4 c + 3 h + 2 s = 6.8 ms (the token's sync and router 0's),
    the last (its begin was in the window before, and it begins no step) 6.8 - (a + h + s) =
    5.5, and every prefetch is issued at the end of the window before its step.
    Synchronous loop, lazy: every build is on the critical path: 3 (b + 0.1) + b + 6.8 = 8.7.
    Bounded queue (q = 0.3 ms): each hand-over returns once q is left, so building a layer
    (0.5 > q) idles the accelerator. Middle window, from its start (q of layer 1's experts left):
      0.5  layer 0 of the next step built; layer 2's a + h, x handed over, host back at 1.9
      2.4  layer 1 built; layer 3's a, x handed over (accelerator to 3.9), host back at 3.6
      4.5  layers 2 and 3 built; the token on the host (the accelerator idle: no s)
           begin: a + h queued, back at 5.4; router 0 synced at 5.7 + s = 5.8: the
           prefetches issued; x queued, back at 6.0; layer 1's a + h, x handed over: back
           at 7.7
    so a window is 7.7 ms and its prefetches are issued (x - q) + a + h + x = 1.9 ms before
    its end; the
    last window 3.6 (layers 2, 3 handed over from q left, then the token's sync: 3.5 + s).
    A layer's experts, a few large operations, leave more queued when handed over than a
    walk's many small ones: with g = 0.5 ms (gather_queue_ahead_ms) the host takes back each
    hand-over that ends in experts as they start. Begin, from the token: a + h queued (back
    at 0.9), router 0 synced at 1.3 (the prefetches issued), x queued (no wait), layer 1's
    a + h, x handed over, back at 3.0; the window: layer 0 built (0.5), layer 2's a + h, x
    handed over (back at 1.7), layer 1 built (2.2), layer 3's (back at 3.2), layers 2, 3 built
    (4.1): window 4.1 + 3.0 = 7.1 ms, prefetches 3.0 - 1.3 = 1.7 ms before its end; the last
    3.8 (from g left: layers 2, 3 handed over, 3.7, + s)."""
    m = _model(0.4, consumer_first=1, consumer_last=3, heads=3, head_bytes=200_000,
               head_build_ms=0.1)
    la = _run(0.4, True, m=m, lead="token", router=_cycling())
    window = 4 * C + 3 * 0.2 + 2 * S
    assert _rows_ms(la)[1:] == pytest.approx(
        [window] * (STEPS - 2) + [window - (A + 0.2 + S)], abs=1e-6)
    sync = _run(0.4, False, m=m, lead="token", router=_cycling())
    assert _rows_ms(sync) == pytest.approx([3 * 0.5 + 0.4 + window] * STEPS, abs=1e-6)
    bounded = _run(0.4, True, m=m, lead="token", router=_cycling(),
                   hardware_over=dict(queue_ahead_ms=0.3))
    assert _rows_ms(bounded)[1:] == pytest.approx([7.7] * (STEPS - 2) + [3.6], abs=1e-6)
    gather = _run(0.4, True, m=m, lead="token", router=_cycling(),
                  hardware_over=dict(queue_ahead_ms=0.3, gather_queue_ahead_ms=0.5))
    assert _rows_ms(gather)[1:] == pytest.approx([7.1] * (STEPS - 2) + [3.8], abs=1e-6)
    for run, before_end in ((la, 0.0), (bounded, (X - 0.3) + A + 0.2 + X), (gather, 1.7)):
        steps = run.trace.steps.filter(pl.col("phase") == "decode")
        ends = dict(zip(steps["step"].to_list(), steps["end_ns"].to_list(), strict=True))
        pre = run.trace.loads.filter(pl.col("source") == "prefetch")
        assert pre.height == STEPS * 3 * 2  # 3 consumer layers x K, every step
        later = pre.filter(pl.col("step") > 0)
        for s, issued in later.select("step", "issued_ns").iter_rows():
            assert (ends[s - 1] - issued) / 1e6 == pytest.approx(before_end, abs=1e-6)
    routing = la.trace.routing.filter(pl.col("layer") >= 1)
    assert set(routing["source"]) == {"prediction"}
    got = np.stack(routing.sort("step", "layer")["experts"].to_list())
    assert (got.reshape(STEPS, 3, 2) == _cycling()[:, 1:, :]).all()


def test_requests_and_prefill_restart_the_lookahead():
    """Two requests, each a prefill then 3 decode steps: each request's first decode step
    builds its own graph (nothing was built ahead across the prefill), its last builds nothing;
    b = 0.4 ms, so the decode windows are (4 b + 6.5, 6.5, 6.5) per request, build
    (8 b, 4 b, 0)."""
    from sim.routing_input import RoutingInput

    router = _same_experts(6)
    plan = [("prefill", 8, 0, -1)] + [("decode", 1, 0, i) for i in range(3)] + \
           [("prefill", 8, 1, -1)] + [("decode", 1, 1, i) for i in range(3, 6)]
    sc = scenario(hw=_hw(), m=_model(0.4), path="staged", decode_steps=6,
                  lookahead=True)
    result = run_scenario(sc, routing=RoutingInput(router, None, plan, "test"))
    window = L * (C + S) + S
    assert _rows_ms(result) == pytest.approx([1.6 + window, window, window] * 2, abs=1e-6)
    assert _rows_ms(result, "build_ns") == pytest.approx([3.2, 1.6, 0.0] * 2, abs=1e-6)


# ----------------------------------------------------------------- trace -> scenario


def test_lookahead_follows_the_engine_rule():
    m = model(layers=4, experts=16, k=2, bundle_bytes=1000)
    sc = scenario(m=m)
    staged = {"decode": "staged", "k": 2, "readers": 2}
    assert "lookahead=true" in engine_settings({**staged, "lookahead": True}, sc)[0]
    assert "lookahead=false" in engine_settings(staged, sc)[0]  # a trace from before lookahead
    assert "lookahead=false" in engine_settings({**staged, "lookahead": False}, sc)[0]
    # exact syncs at build: the engine turns lookahead off; hot defers like staged
    assert "lookahead=false" in engine_settings({"decode": "exact", "k": 2,
                                                 "lookahead": True}, sc)[0]
    assert "lookahead=true" in engine_settings({"decode": "hot", "k": 2, "readers": 2,
                                                "lookahead": True}, sc)[0]
    mixed = {**staged, "lookahead": True,
             "paths_in_use": {"decode": {"staged": [0, 1, 2], "exact": [3]}}}
    assert not looked_ahead(mixed)
    assert not looked_ahead({**staged, "lookahead": True, "paths_in_use": {},
                             "layers": {"3": {"decode": "exact"}}})
    assert looked_ahead({**staged, "lookahead": True,
                         "paths_in_use": {"decode": {"staged": [0, 1, 2, 3]}}})


def test_staged_trace_maps_to_the_lookahead_loop_only_when_recorded(tmp_path):
    """A staged trace whose run.json records no lookahead (as traces from before it existed)
    maps to the synchronous loop; the same trace with lookahead recorded runs the lookahead
    loop on this machine's scenario, which hides the staged path's graph building: faster, with
    the loop's own dispatch cost (fill_ms_per_layer, fitted per run) taken out; with it put
    back, slower than without it."""
    variants = {}
    for name, value in (("old", None), ("new", True)):
        copy = tmp_path / name
        shutil.copytree(STAGED_TRACE, copy)
        run = json.loads((copy / "run.json").read_text())
        run["engine"].pop("lookahead", None)
        if value is not None:
            run["engine"]["lookahead"] = value
        (copy / "run.json").write_text(json.dumps(run))
        variants[name] = read_trace(copy)
    old, new = variants["old"], variants["new"]
    sc_old, derived, _ = scenario_for(old)
    assert not sc_old.lookahead and "lookahead=false" in derived
    sc_new, derived, _ = scenario_for(new)
    assert sc_new.lookahead and "lookahead=true" in derived
    assert sc_new.hardware.lazy_compute  # this machine's synchronous loop stays lazy
    no_dispatch = replace(sc_new, model=replace(sc_new.model, fill_ms_per_layer=0.0))
    with_dispatch = replace(sc_new, model=replace(sc_new.model, fill_ms_per_layer=0.3))
    r_old = run_scenario(sc_old, trace=old)
    r_new = run_scenario(no_dispatch, trace=new)
    assert r_new.metrics["decode_tok_s"] > r_old.metrics["decode_tok_s"]
    assert r_new.trace.run["engine"]["lookahead"] is True
    slower = run_scenario(with_dispatch, trace=new).metrics["decode_tok_s"]
    assert slower < r_new.metrics["decode_tok_s"]


def test_asking_the_page_cache_first_costs_each_cold_miss():
    """engine.readers.wait asks the page cache for each small demand miss before it hands the
    reads out (hardware refused_warm_ms, r); a cold miss is refused, and that is main-thread
    time inside the fill's wait. Staged on demand, 2 readers, no page cache (every read cold),
    free I/O: per step 2 misses x L layers, so blocked grows by exactly 2 L r and, with the
    fills on the critical path (b < c), the window by as much (cycling sets: the staged slots
    never hold a step's set). With O_DIRECT nothing is asked."""
    from sim.compare import with_page_cache

    r = 0.05
    m = model(layers=L, experts=16, k=2, bundle_bytes=50_000, resident_bytes=4_000_000,
              build_ms_per_layer=0.4)

    def run(refused: float, o_direct: bool = False):
        sc = scenario(hw=_hw(refused_warm_ms=refused), m=m, path="staged", readers=2,
                      decode_steps=STEPS, lookahead=True, o_direct=o_direct)
        sc = with_page_cache(sc, 0, [])
        return run_scenario(sc, routing=routing_input(_cycling()))

    base, asked = run(0.0), run(r)
    assert asked.metrics["cold_fraction"] == pytest.approx(1.0)
    added = np.array(_rows_ms(asked, "blocked_ns")) - np.array(_rows_ms(base, "blocked_ns"))
    assert added == pytest.approx([2 * L * r] * STEPS, abs=1e-6)
    grown = np.array(_rows_ms(asked))[1:-1] - np.array(_rows_ms(base))[1:-1]
    assert grown == pytest.approx([2 * L * r] * (STEPS - 2), abs=1e-6)
    assert _rows_ms(run(r, o_direct=True)) == _rows_ms(run(0.0, o_direct=True))


def test_first_layer_hint_reads_at_the_token_beside_the_router():
    """The prerouter model above, cold reads of 0.5 ms (latency, no transfer time, 8 in
    flight), 4 readers; the page cache holds every set from step 3 on (warm reads are free).
    The first MoE layer (0) has no head: without a hint its two experts a step are demand
    loads issued once its router's ids are on the host, and in the cold steps 0-2 the main
    thread waits 0.5 ms for them. With the trace's hinted sets (engine.first_layer_hint)
    replayed they are prefetches issued when the previous step's token is on the host, before
    layer 0's router is synced (a + h + s = 1.3 ms later), and are done by then. Layer 1's
    reads are issued after router 0's sync (the prerouter test: begin at the end of the window
    before, 1.3 ms after the token, + 0.5 when cold). With the hint a cold step waits 0.5 ms
    for layer 1 alone, while layer 0's experts compute; without it, for layer 0's demand
    loads, while nothing computes (layer 1's reads, issued beside them, are done after): the
    same blocked time, but the run is 3 x 0.5 ms longer.
    A wrong hint of four experts reads two (4 slots less K: the call's own misses keep room)
    and the router's two still load on demand."""
    from sim.routing_input import RoutingInput

    m = _model(0.4, consumer_first=1, consumer_last=3, heads=3, head_bytes=200_000,
               head_build_ms=0.1)
    router = _cycling()
    plan = [("decode", 1, 0, i) for i in range(STEPS)]

    def run(hint: bool, hinted: np.ndarray):
        hints = {i: [(0, hinted[i, 0].tolist())] for i in range(STEPS)}
        sc = scenario(hw=_hw(ssd_latency_ms=0.5, queue_depth=8), m=m, path="staged", lead="token",
                      readers=4, decode_steps=STEPS, lookahead=True, first_layer_hint=hint)
        return run_scenario(sc, routing=RoutingInput(router, None, plan, "test", hints))

    def layer0(result):
        loads = result.trace.loads.filter((pl.col("layer") == 0) & (pl.col("step") > 0))
        return loads, loads.group_by("source").agg(pl.len()).sort("source").rows()

    # a wrong hint of four experts: room for two (4 slots - none in flight - K)
    wrong_sets = np.concatenate([(router + 6) % 16, (router + 8) % 16], axis=-1)
    hinted, plain, wrong = run(True, router), run(False, router), run(True, wrong_sets)
    loads, by_source = layer0(hinted)
    assert by_source == [("prefetch", 2 * (STEPS - 1))]
    steps = hinted.trace.steps.filter(pl.col("phase") == "decode")
    ends = dict(zip(steps["step"].to_list(), steps["end_ns"].to_list(), strict=True))
    for s, issued, waited in loads.select("step", "issued_ns", "wait_ns").iter_rows():
        cold_layer_1 = 0.5 if s < 3 else 0.0
        assert (ends[s - 1] - issued) / 1e6 == pytest.approx(A + 0.2 + S + cold_layer_1,
                                                            abs=1e-6)
        assert waited == 0
    assert layer0(plain)[1] == [("demand", 2 * (STEPS - 1))]
    assert layer0(plain)[0]["wait_ns"].sum() > 0
    assert layer0(wrong)[1] == [("demand", 2 * (STEPS - 1)), ("prefetch", 2 * (STEPS - 1))]
    got = hinted.trace.routing.filter(pl.col("hinted_experts").is_not_null())
    assert got.height == STEPS and set(got["layer"]) == {0}  # the simulated trace records them
    assert sum(_rows_ms(plain)) - sum(_rows_ms(hinted)) == pytest.approx(3 * 0.5, abs=1e-6)
    assert sum(_rows_ms(plain, "blocked_ns")) == pytest.approx(
        sum(_rows_ms(hinted, "blocked_ns")), abs=1e-6)
    window = 4 * C + 3 * 0.2 + 2 * S  # warm from step 3: the prerouter test's windows
    for run in (hinted, plain):
        assert _rows_ms(run)[3:] == pytest.approx([window] * 2 + [window - (A + 0.2 + S)],
                                                  abs=1e-6)


def test_token_host_work_runs_after_the_token_beside_compute():
    """The engine's main thread does each token's host work (the recorder's row: run.json
    extra.recorder overhead_ms / steps, `token_host_ms`) after the token, while the next step
    computes, then builds layer 0 of the step after (b = 0.4) and syncs on router 0, ready
    a = 1.0 ms after the window starts. With h = 0.3 it arrives at 0.7 and waits, as without
    (window 6.5 ms); with h = 0.8 it arrives at 1.2, after the router is ready (the sync finds
    nothing running: no s), so every window but the first (no token before it) and the last
    (nothing to build) is 1.2 - (a + s) = 0.1 ms longer, as eval time."""
    window = L * (C + S) + S
    for h, extra in ((0.0, 0.0), (0.3, 0.0), (0.8, 0.1)):
        result = _run(0.4, True, token_host_ms=h)
        want = [L * 0.4 + window] + [window + extra] * (STEPS - 2) + [window]
        assert _rows_ms(result) == pytest.approx(want, abs=1e-6)
        assert _rows_ms(result, "build_ns") == pytest.approx(
            [2 * L * 0.4] + [L * 0.4] * (STEPS - 2) + [0.0], abs=1e-6)


def test_token_host_work_comes_from_the_traces_recorder(tmp_path):
    """sim compare reads it from run.json: overhead_ms / steps."""
    shutil.copytree(STAGED_TRACE, tmp_path / "t")
    run = json.loads((tmp_path / "t" / "run.json").read_text())
    rec = run["extra"]["recorder"]
    sc, derived, _ = scenario_for(read_trace(tmp_path / "t"))
    assert sc.token_host_ms == pytest.approx(rec["overhead_ms"] / rec["steps"], abs=1e-4)
    del run["extra"]["recorder"]
    (tmp_path / "t" / "run.json").write_text(json.dumps(run))
    assert scenario_for(read_trace(tmp_path / "t"))[0].token_host_ms == 0.0
