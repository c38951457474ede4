"""Thread hand-off (handoff_ms): a wait on a reader thread's load costs the load plus h; a wait
on a load that is already done, or one the main thread read itself, costs no hand-off."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from sim_helpers import MB, hardware, model, routing_input, scenario, uniform_routing

from contract.errors import BadInput
from sim.compare import blocked_past_loads_ms
from sim.profiles import apply_overrides, load_hardware
from sim.reader_threads import INLINE_WARM_BYTES
from sim.replay import run_scenario

# one cold bundle read on an idle device: latency + bytes / bandwidth + load + cold overhead
IO = dict(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1.0, load_overhead_ms=0.05,
          cold_overhead_ms=0.02, memcpy_gbps=0.0, queue_depth=1)
LOAD_MS = 0.1 + MB / 1e9 * 1e3 + 0.05 + 0.02


def _decode(result) -> pl.DataFrame:
    return result.trace.steps.filter(pl.col("phase") == "decode")


def _hot_miss_every_layer(h: float, layers: int, steps: int = 30, wake: float = 0.0):
    """hot, one reader, a one-bundle LRU, O_DIRECT: every layer of every step waits on exactly
    one demand load that the (idle) reader does."""
    m = model(layers=layers, experts=16, k=1, build_ms_per_layer=0.5)
    hw = hardware(handoff_ms=h, reader_wake_ms=wake, **IO)
    sc = scenario(hw=hw, m=m, path="hot", lru_bytes=MB, readers=1, o_direct=True,
                  help_reads=False,
                  decode_steps=steps)
    router = np.array([[[(s + layer) % 16] for layer in range(layers)] for s in range(steps)],
                      dtype=np.int16)  # a new expert every step: the LRU never hits
    return run_scenario(sc, routing=routing_input(router))


@pytest.mark.parametrize(("layers", "h"), [(1, 0.2), (3, 0.2), (5, 0.037)])
def test_blocked_time_grows_by_waited_loads_times_handoff(layers, h):
    base, slow = _hot_miss_every_layer(0.0, layers), _hot_miss_every_layer(h, layers)
    n = layers  # waited reader loads per step
    b0, b1 = _decode(base), _decode(slow)
    assert b0["blocked_ns"].to_list() == [round(n * LOAD_MS * 1e6)] * 30  # closed form, h = 0
    assert b1["blocked_ns"].to_list() == [round(n * (LOAD_MS + h) * 1e6)] * 30
    step0 = (b0["end_ns"] - b0["start_ns"]).to_list()
    step1 = (b1["end_ns"] - b1["start_ns"]).to_list()
    assert all(s1 - s0 == pytest.approx(n * h * 1e6, abs=2) for s0, s1 in zip(step0, step1,
                                                                               strict=True))
    loads = slow.trace.loads
    assert set(loads["thread"]) == {"reader0"} and loads["waited"].all()
    assert loads["wait_ns"].to_list() == [round((LOAD_MS + h) * 1e6)] * (30 * n)
    assert slow.metrics["blocked_ms_per_step"] == pytest.approx(
        base.metrics["blocked_ms_per_step"] + n * h, abs=1e-5)
    # what validate fits the hand-off from reads it back: each fill is one load, so the main
    # thread blocks exactly its span at h = 0 and h past it otherwise
    assert blocked_past_loads_ms(base.trace) == pytest.approx(0.0, abs=1e-6)
    assert blocked_past_loads_ms(slow.trace) == pytest.approx(h, abs=1e-6)


@pytest.mark.parametrize(("layers", "w"), [(1, 0.3), (4, 0.07)])
def test_an_idle_reader_starts_a_handed_load_its_wake_up_late(layers, w):
    """reader_wake_ms: each demand load goes to the idle reader, which starts it w after the
    hand-over, so every wait (and the step) grows by exactly w per layer; help_reads off, the
    main thread waits rather than reading it itself."""
    h = 0.1
    base, slow = _hot_miss_every_layer(h, layers), _hot_miss_every_layer(h, layers, wake=w)
    assert _decode(slow)["blocked_ns"].to_list() == \
        [round(layers * (LOAD_MS + h + w) * 1e6)] * 30
    loads = slow.trace.loads
    assert ((loads["started_ns"] - loads["issued_ns"]) == round(w * 1e6)).all()
    assert slow.metrics["decode_tok_s"] < base.metrics["decode_tok_s"]
    assert (base.trace.loads["started_ns"] == base.trace.loads["issued_ns"]).all()


def test_a_reader_with_work_queued_starts_the_next_load_at_once():
    """K=2 on one reader: of a layer's two demand loads the first wakes the idle reader (w
    late), the second waits in the queue and starts the moment the first finishes: no wake."""
    w, steps = 0.4, 12
    m = model(layers=2, experts=16, k=2, build_ms_per_layer=0.5)
    sc = scenario(hw=hardware(reader_wake_ms=w, **IO), m=m, path="hot", lru_bytes=2 * MB,
                  readers=1, o_direct=True, decode_steps=steps, help_reads=False)
    router = np.array([[[(2 * (s * 2 + layer)) % 16, (2 * (s * 2 + layer) + 1) % 16]
                        for layer in range(2)] for s in range(steps)], dtype=np.int16)
    loads = run_scenario(sc, routing=routing_input(router)).trace.loads.sort("started_ns")
    first, second = loads[::2], loads[1::2]
    assert ((first["started_ns"] - first["issued_ns"]) == round(w * 1e6)).all()
    assert (second["started_ns"] == first["finished_ns"]).all()


@pytest.mark.parametrize("native", [False, True])
def test_a_load_needed_while_its_reader_wakes_is_read_by_the_main_thread(native):
    """help_reads: the token lead's prefetches go to an idle reader at the step boundary; with a
    wake-up longer than the run (1 s), the main thread reaches every unclaimed load first and
    reads it itself (the engine's claim; a native read it takes off the pool's queue); with no
    wake-up the reader has each of them."""
    m = model(layers=3, experts=32, k=1, build_ms_per_layer=0.05, consumer_first=1,
              consumer_last=2, heads=2, head_bytes=0)
    router = uniform_routing(20, 3, 32, 1, seed=8)
    threads = {}
    for wake in (0.0, 1000.0):
        sc = scenario(hw=hardware(reader_wake_ms=wake, **dict(IO, queue_depth=2)), m=m,
                      path="staged", lead="token", readers=1, o_direct=True, decode_steps=20,
                      help_reads=True, native_reads=native)
        loads = run_scenario(sc, routing=routing_input(router)).trace.loads
        threads[wake] = loads.filter(pl.col("source") == "prefetch")["thread"].to_list()
    assert threads[0.0] and set(threads[0.0]) == {"reader0"}
    assert len(threads[1000.0]) == len(threads[0.0]) and set(threads[1000.0]) == {"main"}


def test_loads_finishing_together_wake_the_main_thread_once():
    """K=2 on 2 readers, latency-only storage: both loads of a layer finish together (the
    second one transfer of ~1 ns later); the main thread blocks (and pays the hand-off) once
    per layer, not once per load."""
    io = dict(IO, ssd_bandwidth_gbps=1e12, queue_depth=2)
    load_ms = 0.1 + 0.05 + 0.02
    h, layers, steps = 0.3, 2, 20
    m = model(layers=layers, experts=16, k=2, build_ms_per_layer=0.5)
    runs = {}
    for handoff in (0.0, h):
        sc = scenario(hw=hardware(handoff_ms=handoff, **io), m=m, path="hot", lru_bytes=MB,
                      readers=2, o_direct=True, decode_steps=steps, help_reads=False)
        runs[handoff] = run_scenario(
            sc, routing=routing_input(uniform_routing(steps, layers, 16, 2, seed=4)))
    for handoff, result in runs.items():
        assert _decode(result)["blocked_ns"].to_list() == \
            [round(layers * (load_ms + handoff) * 1e6)] * steps
    waited = runs[h].trace.loads.filter(pl.col("waited"))
    assert waited.height == layers * steps  # one of the two loads per layer


def test_no_handoff_for_prefetches_done_in_time_or_main_thread_reads():
    """prerouter, K=1, 2 readers, plenty of graph building: the staged loads are done before
    their layers need them, so only layer 0's demand load (router mode, when its sticky slot
    misses) is waited on: h per such step; without reader threads the main thread reads
    everything itself and h changes nothing."""
    m = model(layers=4, experts=32, k=1, build_ms_per_layer=20.0, consumer_first=1,
              consumer_last=3, heads=3, head_bytes=0)
    router = uniform_routing(40, 4, 32, 1, seed=6)
    h = 0.25
    for readers in (2, 0):
        runs = {}
        for handoff in (0.0, h):
            sc = scenario(hw=hardware(handoff_ms=handoff, **dict(IO, queue_depth=2)), m=m,
                          path="staged", lead="token", readers=readers, o_direct=True,
                          decode_steps=40,
                          help_reads=False)
            runs[handoff] = run_scenario(sc, routing=routing_input(router))
        slow = runs[h].trace.loads
        waited = slow.filter(pl.col("waited"))
        if readers:
            assert set(waited["layer"]) == {0} and waited.height > 30
            per_step = waited.group_by("step").len()
            blocked = dict(zip(*_decode(runs[0.0])[["step", "blocked_ns"]], strict=True))
            for step, n in per_step.iter_rows():
                got = _decode(runs[h]).filter(pl.col("step") == step)["blocked_ns"].item()
                assert got - blocked[step] == pytest.approx(n * h * 1e6, abs=2)
        else:
            assert set(slow["thread"]) == {"main"}
            assert _decode(runs[h])["blocked_ns"].to_list() == \
                _decode(runs[0.0])["blocked_ns"].to_list()


def test_handoff_is_optional_non_negative_and_settable(tmp_path):
    hw = load_hardware("m2-16gb")
    assert hw.handoff_ms == 0.0  # the paper profiles have no hand-off term
    sc = apply_overrides(scenario(), ["handoff_ms=0.04"])
    assert sc.hardware.handoff_ms == 0.04
    with pytest.raises(BadInput, match="handoff_ms"):
        apply_overrides(scenario(), ["handoff_ms=-1"])


@pytest.mark.parametrize("bundle", [64 << 10, MB])
def test_small_warm_demand_read_is_done_by_the_main_thread_without_handoff(bundle):
    """hot, one reader, a one-bundle LRU, 64 GiB of page cache, routing 0, 1, 0, 1, ...: the
    first two loads are cold (a reader: load + h each); from step 2 on every load is a page
    cache copy. A small one (<= INLINE_WARM_BYTES) the main thread does itself, as the engine
    does (engine.readers): load overhead only, no hand-off; a big one still goes to the
    reader and costs overhead + h."""
    h, steps = 0.2, 12
    m = model(layers=1, experts=16, k=1, build_ms_per_layer=0.5, bundle_bytes=bundle)
    sc = scenario(hw=hardware(handoff_ms=h, **IO), m=m, path="hot", lru_bytes=bundle,
                  readers=1, decode_steps=steps, help_reads=False)
    router = np.array([[[s % 2]] for s in range(steps)], dtype=np.int16)
    result = run_scenario(sc, routing=routing_input(router))
    loads = result.trace.loads.sort("step")
    small = bundle <= INLINE_WARM_BYTES
    warm_thread = "main" if small else "reader0"
    assert loads["thread"].to_list() == ["reader0"] * 2 + [warm_thread] * (steps - 2)
    assert loads["cold"].to_list() == [True] * 2 + [False] * (steps - 2)
    cold_ms = 0.1 + bundle / 1e9 * 1e3 + 0.05 + 0.02  # latency + transfer + overheads
    warm_ms = 0.05 + (0.0 if small else h)  # load_overhead_ms (no copy term: memcpy_gbps=0)
    assert _decode(result)["blocked_ns"].to_list() == \
        [round((cold_ms + h) * 1e6)] * 2 + [round(warm_ms * 1e6)] * (steps - 2)
