"""Waking after a stall (sim.stall_wake, sim.compute_stream.wake_after, and its use at a fill
in sim.main_thread) against hand-worked numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import simpy
from sim_helpers import hardware, model, routing_input, scenario, uniform_routing

from contract.errors import BadInput
from sim.compute_stream import ComputeStream
from sim.cpu import Cores
from sim.replay import run_scenario
from sim.stall_wake import StallWake

CURVE = dict(stall_points_ms=[0.25, 1.0], stall_wake_main_ms=[0.05, 0.2],
             stall_wake_compute_ms=[0.1, 0.3])


def test_the_curve_is_linear_from_zero_through_the_points_and_flat_after():
    w = StallWake("hw", points_ms=[2.0, 10.0], main_ms=[0.5, 0.9], compute_ms=[0.6, 1.0])
    ms = 1e-3
    assert w.main_wait(0.0) == 0.0
    assert w.main_wait(1 * ms) == pytest.approx(0.25 * ms)  # half way to the first point
    assert w.main_wait(2 * ms) == pytest.approx(0.5 * ms)
    assert w.main_wait(6 * ms) == pytest.approx(0.7 * ms)  # half way between the points
    assert w.main_wait(50 * ms) == pytest.approx(0.9 * ms)  # flat after the last
    assert w.compute_wait(6 * ms) == pytest.approx(0.8 * ms)
    assert StallWake("hw", [], [], []).compute_wait(5 * ms) == 0.0


def test_a_curve_without_its_points_or_of_another_length_is_one_clear_line():
    with pytest.raises(BadInput, match="hardware x: stall_wake_main_ms has 1 values for 2"):
        StallWake("hardware x", [1.0, 2.0], [0.1], [0.1, 0.2])
    with pytest.raises(BadInput, match="need stall_points_ms"):
        StallWake("hardware x", [], [0.1], [])


@pytest.mark.parametrize("cores", [None, 1.0])
@pytest.mark.parametrize("shortcut", [True, False])
def test_an_idle_stream_starts_late_a_busy_one_does_not(cores, shortcut):
    """Idle at t=0: wake_after(0.3), then 1.0 of work: done at 1.3. Busy (1.0 handed over at
    t=1.3, running): wake_after(0.3) at t=1.5 and 0.5 more: done at 2.3 + 0.5 = 2.8, no wait.
    On a CPU backend the wait holds no core: a main-thread job of 0.2 s on the one core beside
    it, from t=0, is done at 0.2 (it would share the core with compute work)."""
    env = simpy.Environment()
    cpu = Cores(env, cores) if cores else None
    if cpu is None and not shortcut:
        pytest.skip("the accelerator process is the timeline's twin (tests/test_sim_cpu.py)")
    stream = ComputeStream(env, cpu, lazy=False, shortcut=shortcut)
    seen: list[float] = []

    def host():
        stream.wake_after(0.3)
        stream.submit(1.0)
        yield stream.sync()
        seen.append(env.now)
        stream.submit(1.0)
        yield env.timeout(0.2)
        stream.wake_after(0.3)
        stream.submit(0.5)
        yield stream.sync()
        seen.append(env.now)

    def beside():
        if cpu is not None:
            yield cpu.work(0.2, "main")
            seen.append(env.now)

    env.process(host())
    env.process(beside())
    env.run()
    expect = [1.3, 2.8] if cpu is None else [0.2, 1.3, 2.8]
    assert sorted(seen) == pytest.approx(expect)
    assert stream.waking_s == pytest.approx(0.3)
    assert stream.busy_s == pytest.approx(2.5)


L, C, S, D, B = 4, 1.5, 0.1, 0.5, 0.4  # tests/test_sim_lookahead.py's model and demand fills


def _demand_fills(curve: dict, lookahead: bool, on_cpu: bool, cold_overhead_ms: float = 0.0):
    """Six steps alternating two expert sets at every layer, with a one-bundle LRU and
    O_DIRECT: every fill reads two cold 250 kB bundles on the main thread (D = 0.5 ms of
    device time, and `cold_overhead_ms` of the main thread's CPU each)."""
    io = dict(ssd_latency_ms=0.0, ssd_bandwidth_gbps=1.0, load_overhead_ms=0.0,
              cold_overhead_ms=cold_overhead_ms, memcpy_gbps=0.0)
    hw = hardware(mem_bandwidth_gbps=1.0, sync_overhead_ms=S, lazy_compute=True,
                  compute_on_cpu=on_cpu, cpu_cores=0.0, **io, **curve)
    m = model(layers=L, experts=16, k=2, bundle_bytes=250_000, resident_bytes=4_000_000,
              build_ms_per_layer=B)
    sc = scenario(hw=hw, m=m, path="hot", lru_bytes=250_000, o_direct=True, readers=0,
                  decode_steps=6, lookahead=lookahead)
    sets = [[0, 1], [2, 3]]
    router = np.array([[sets[t % 2]] * L for t in range(6)], dtype=np.int16)
    return run_scenario(sc, routing=routing_input(router))


def _rows(result, col: str) -> list[float]:
    """Per decode step, ms: the window ("window") or a column of the step rows."""
    d = result.trace.steps.filter(pl.col("phase") == "decode").sort("step")
    if col == "window":
        return ((d["end_ns"] - d["start_ns"]) / 1e6).to_list()
    return (d[col] / 1e6).to_list()


@pytest.mark.parametrize("on_cpu", [False, True])
def test_a_blocked_fill_delays_the_main_thread_and_the_compute_after_it(on_cpu):
    """tests/test_sim_lookahead.py's demand fills: every fill blocks D = 0.5 ms (two cold
    250 kB reads at 1 GB/s on the main thread), b = 0.4 < c, so every fill is on the critical
    path: the window is L (c + s + D) + s. With the curve, a 0.5 ms stall costs the main
    thread mw = 0.05 + 0.15 x 1/3 = 0.1 ms (blocked) and the compute thread cw = 0.1 + 0.2 x
    1/3 = 0.1667 ms before the fill's gather (eval): the window grows by L (mw + cw)."""
    mw, cw = 0.1, 0.1 + 0.2 / 3

    def rows(result, col):  # the middle windows: the first builds its own graph
        return _rows(result, col)[1:-1]

    def run(curve: dict):
        return _demand_fills(curve, lookahead=True, on_cpu=on_cpu)

    base, woken = run({}), run(CURVE)
    assert rows(base, "window") == pytest.approx([L * (C + S + D) + S] * 4, abs=1e-6)
    assert rows(woken, "window") == pytest.approx([L * (C + S + D + mw + cw) + S] * 4, abs=1e-6)
    assert rows(woken, "blocked_ns") == pytest.approx([L * (D + mw)] * 4, abs=1e-6)
    grown = [w - b for w, b in zip(rows(woken, "eval_ns"), rows(base, "eval_ns"), strict=True)]
    assert grown == pytest.approx([L * cw] * 4, abs=1e-6)


@pytest.mark.parametrize("lookahead", [True, False])
def test_only_the_stalls_idle_part_wakes_the_threads(lookahead):
    """The same fills with 0.25 ms of the main thread's CPU per cold read (its faults): each
    fill blocks 2 x (0.25 + 0.25) = 1.0 ms, of which the host idles 0.5 ms (the device time).
    The curve is read at the idle part, so the threads wait what a 0.5 ms stall costs (mw, cw
    as above), not a 1.0 ms one (0.2, 0.3): the stall probe's delays are sleeps, and a thread
    reading on a busy host keeps it awake."""
    mw, cw = 0.1, 0.1 + 0.2 / 3
    curve = CURVE if lookahead else {f"sync_{k}": v for k, v in CURVE.items()}

    def run(curve: dict):
        return _demand_fills(curve, lookahead=lookahead, on_cpu=False, cold_overhead_ms=0.25)

    base, woken = run({}), run(curve)
    grown = [w - b for w, b in zip(_rows(woken, "window"), _rows(base, "window"), strict=True)]
    assert grown[1:-1] == pytest.approx([L * (mw + cw)] * 4, abs=1e-6)
    assert _rows(base, "blocked_ns")[2] == pytest.approx(L * 2 * (D / 2 + 0.25), abs=1e-6)


def test_each_decode_loop_takes_its_own_curve():
    """The lookahead loop reads the stall_* keys, the synchronous loop the sync_stall_* ones;
    a profile that measured only the lookahead loop leaves the synchronous loop without."""
    ms = 1e-3
    both = hardware(**CURVE, sync_stall_points_ms=[2.0], sync_stall_wake_main_ms=[0.4],
                    sync_stall_wake_compute_ms=[0.8])
    assert StallWake.for_loop(both, lookahead=True).compute_wait(1.0 * ms) == \
        pytest.approx(0.3 * ms)
    assert StallWake.for_loop(both, lookahead=False).compute_wait(1.0 * ms) == \
        pytest.approx(0.4 * ms)
    assert StallWake.for_loop(hardware(**CURVE), lookahead=False).compute_wait(1.0 * ms) == 0.0


@pytest.mark.parametrize("on_cpu", [False, True])
def test_a_blocked_fill_in_the_synchronous_loop_costs_build_and_eval(on_cpu):
    """The same demand fills in the synchronous loop (lazy compute): a step is
    L (b + c + s + D) + s = 10.1 ms. With a curve measured in this loop (sync_stall_*, the
    CURVE's figures), each 0.5 ms stall costs the main thread mw = 0.1 ms, counted as graph
    building (where the probe saw it land), and the compute thread cw before the next work
    it is handed (the next layer's sync, or the token's): the step grows by L (mw + cw), build
    by L mw, eval by L cw, blocked not at all. The lookahead loop's curve alone changes
    nothing here."""
    mw, cw = 0.1, 0.1 + 0.2 / 3
    sync_curve = {f"sync_{k}": v for k, v in CURVE.items()}

    def run(curve: dict):
        return _demand_fills(curve, lookahead=False, on_cpu=on_cpu)

    rows = _rows
    step = L * (B + C + S + D) + S
    base, other_loop, woken = run({}), run(CURVE), run(sync_curve)
    assert rows(base, "window") == pytest.approx([step] * 6, abs=1e-6)
    assert rows(other_loop, "window") == pytest.approx([step] * 6, abs=1e-6)
    assert rows(woken, "window") == pytest.approx([step + L * (mw + cw)] * 6, abs=1e-6)
    for col, grows in (("build_ns", L * mw), ("eval_ns", L * cw), ("blocked_ns", 0.0)):
        grown = [w - b for w, b in zip(rows(woken, col), rows(base, col), strict=True)]
        assert grown == pytest.approx([grows] * 6, abs=1e-6), col


def test_the_synchronous_loops_point_is_what_the_step_grew_by():
    """waits_from "step": per fill, the growth of build (main) and eval (compute) over the
    no-delay arm, not the run-queue waits. No delay: build 1.0, eval 5.0 (_run's), blocked 1
    over 5 fills; 1 ms held: build 3.5, eval 7.0, blocked 16: (3.0, 2.5/5, 2.0/5) per fill,
    whatever the run-queue waits (2.6 / 3.05 ms) say. A step that shrank gives 0, not less."""
    from calibration.stall_probe import curve_point

    base, held = _run(0, 1.0, 5, 0.1, 0.05), _run(1, 16.0, 5, 2.6, 3.05)
    held.build_ms, held.eval_ms = 3.5, 7.0
    assert curve_point([base, held], 1, "step") == pytest.approx((3.0, 0.5, 0.4))
    assert curve_point([base, held], 1) == pytest.approx((3.0, 0.5, 0.6))  # run-queue waits
    held.eval_ms = 4.0
    assert curve_point([base, held], 1, "step") == pytest.approx((3.0, 0.5, 0.0))


def test_the_probe_curve_is_sorted_by_stall_and_drops_ties():
    """Per fill, over the no-delay arm's 0.2 ms: delay 0.2 -> (1.0, 0, 0.01); delay 0.5 ->
    (3.5, 0.6, 0.6); delay 1 -> (3.0, 0.5, 0.5), less stall than the shorter delay's (a noisy
    round), so it comes first; delay 4 -> (3.0, 1.0, 1.0), a tie with delay 1's stall: the
    curve needs distinct stalls, and the first of the tie in sorted order stays."""
    from calibration.stall_probe import curve

    runs = [_run(0, 1.0, 5, 0.0, 0.0), _run(0.2, 6.0, 5, 0.0, 0.05),
            _run(0.5, 18.5, 5, 3.0, 3.0), _run(1, 16.0, 5, 2.5, 2.5),
            _run(4, 16.0, 5, 5.0, 5.0)]
    c = curve(runs, (0.2, 0.5, 1.0, 4.0), 1, "on-demand")
    assert c.stall_ms == pytest.approx([1.0, 3.0, 3.5])
    assert c.main_ms == pytest.approx([0.0, 0.5, 0.6])
    assert c.compute_ms == pytest.approx([0.01, 0.5, 0.6])
    assert c.preset == "on-demand"


def _run(delay: float, blocked: float, fills: float, main_wait: float, compute_wait: float):
    from calibration.stall_probe import StallRun

    threads = {"main": {"run_ms": 1.0, "runqueue_ms": main_wait, "switches": 1.0},
               "compute": {"run_ms": 1.0, "runqueue_ms": compute_wait, "switches": 1.0}}
    return StallRun(delay, Path("."), 10, 1.0, 5.0, blocked, fills, threads)


def test_the_probe_point_is_the_growth_per_blocked_fill_over_the_no_delay_arm():
    """Per step, round 1: no delay 1 ms blocked over 5 fills (0.2 ms each), run-queue waits
    0.1 / 0.05 ms; 1 ms held: 16 ms over 5 fills (3.2 ms each), waits 2.6 / 3.05 ms: the
    point is (3.0, 0.5, 0.6) ms per fill. Round 2 gives (5.0, 1.0, 1.0): medians over rounds
    (two: their means)."""
    from calibration.stall_probe import curve_point

    runs = [_run(0, 1.0, 5, 0.1, 0.05), _run(1, 16.0, 5, 2.6, 3.05),
            _run(1, 26.0, 5, 5.1, 5.05), _run(0, 1.0, 5, 0.1, 0.05)]
    assert curve_point(runs, 1) == pytest.approx((4.0, 0.75, 0.8))
    from contract.errors import IOFault

    with pytest.raises(IOFault, match="did not lengthen"):
        curve_point([_run(0, 1.0, 5, 0, 0), _run(1, 0.5, 5, 0, 0)], 1)


def test_a_profile_with_a_descending_curve_is_one_clear_line(tmp_path):
    from sim.profiles import load_hardware

    text = Path("scenarios/hardware/this-machine.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text("\n".join(
        "stall_points_ms = [3.0, 1.0]" if line.startswith("stall_points_ms") else line
        for line in text.splitlines()) + "\n")
    with pytest.raises(BadInput,
                       match=r"bad.toml: stall_points_ms: \[3.0, 1.0\] must be distinct"):
        load_hardware(bad)


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_busy_stall_costs_the_compute_thread_in_the_lookahead_loop(lookahead):
    """The fills above with 0.25 ms of the main thread's CPU per cold read: each blocks 1.0 ms,
    0.5 ms of it busy. With a busy curve of 0.2 ms at a 0.25 ms busy stall and 0.3 at 1 ms, the
    busy part costs the compute thread bw = 0.2 + 0.1 x 0.25 / 0.75 = 0.2333 ms before the next
    work it is handed: in the lookahead loop the window and eval grow by L bw, blocked not at
    all; the synchronous loop has no busy curve (its eval did not grow with cold reads). Beside
    the sleep curve, the two add up: L (mw + cw + bw)."""
    busy = dict(busy_stall_points_ms=[0.25, 1.0], busy_stall_compute_ms=[0.2, 0.3])
    bw, mw, cw = 0.2 + 0.1 / 3, 0.1, 0.1 + 0.2 / 3

    def run(curve: dict):
        return _demand_fills(curve, lookahead=lookahead, on_cpu=False, cold_overhead_ms=0.25)

    base, woken, both = run({}), run(busy), run({**busy, **CURVE})
    grown = {col: [w - b for w, b in zip(_rows(woken, col), _rows(base, col), strict=True)][1:-1]
             for col in ("window", "eval_ns", "blocked_ns")}
    expect = L * bw if lookahead else 0.0
    assert grown["window"] == pytest.approx([expect] * 4, abs=1e-6)
    assert grown["eval_ns"] == pytest.approx([expect] * 4, abs=1e-6)
    assert grown["blocked_ns"] == pytest.approx([0.0] * 4, abs=1e-6)
    if lookahead:
        total = [w - b for w, b in zip(_rows(both, "window"), _rows(base, "window"),
                                       strict=True)][1:-1]
        assert total == pytest.approx([L * (mw + cw + bw)] * 4, abs=1e-6)
    with pytest.raises(BadInput, match="busy_stall_compute_ms has 1 values for 2"):
        StallWake("hardware x", [], [], [], [0.5, 1.0], [0.1])


def test_the_busy_curve_is_eval_grown_per_fill_by_stall(tmp_path):
    """Busy holds of 0.5 and 1 ms: per step, no hold eval 5.0, blocked 1 over 5 fills; 0.5 ms:
    eval 5.5, blocked 8.5 (stall 1.5 per fill); 1 ms: eval 6.0, blocked 16 (stall 3.0): the
    curve is (1.5, 0.1), (3.0, 0.2). Written to the profile, it loads back; a profile whose
    busy curve has one value too few is one clear line."""
    from profile_helpers import MACHINE, compute, storage

    from calibration.profile_values import hardware_toml, hardware_values, write_hardware
    from calibration.stall_probe import curve

    held = [_run(0, 1.0, 5, 0, 0), _run(0.5, 8.5, 5, 0, 0), _run(1.0, 16.0, 5, 0, 0)]
    held[1].eval_ms, held[2].eval_ms = 5.5, 6.0
    found = curve(held, (1.0, 0.5), 1, "hot", "step")
    points, grown = found.stall_ms, found.compute_ms
    assert points == pytest.approx([1.5, 3.0]) and grown == pytest.approx([0.1, 0.2])
    c = compute(busy_stall_points_ms=points, busy_stall_compute_ms=grown,
                busy_stall_how="0.5, 1 ms of warm preads")
    values = hardware_values(storage(), c, MACHINE, active_params=1e6)
    assert values["busy_stall_compute_ms"][0] == pytest.approx([0.1, 0.2])
    assert "0.5, 1 ms of warm preads" in values["busy_stall_points_ms"][1]
    from sim.profiles import load_hardware

    path = write_hardware(tmp_path / "cal.toml",
                          hardware_toml(values, "cal", "now", "ssdmoe calibrate"))
    # half way between the points: 0.15 ms
    assert StallWake.for_loop(load_hardware(str(path)), lookahead=True).busy_compute_wait(
        2.25e-3) == pytest.approx(0.15e-3)
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace("busy_stall_compute_ms = [0.1, 0.2]",
                                            "busy_stall_compute_ms = [0.1]"))
    with pytest.raises(BadInput, match="busy_stall_compute_ms has 1 values for 2"):
        StallWake.for_loop(load_hardware(str(bad)), lookahead=True)


def test_a_cold_fill_delays_the_compute_threads_next_work():
    """cold_fill_compute_ms: after a fill that waited on a cold load, the compute thread's next
    work starts that much later, in either decode loop. Every read cold (O_DIRECT), eval grows
    by at most the charge times the cold fills (in the lookahead loop some of it lands while the
    main thread is busy elsewhere) and by at least half of it here, where compute sets the
    pace; no charge, no change."""
    m = model(layers=4, experts=16, k=2, build_ms_per_layer=0.1)
    for lookahead in (True, False):
        runs = {}
        for charge in (0.0, 0.5):
            hw = hardware(cpu_cores=2, compute_on_cpu=True, mem_bandwidth_gbps=1.0,
                          ssd_latency_ms=0.05, ssd_bandwidth_gbps=50.0)
            sc = scenario(hw=hw, m=m, path="hot", lookahead=lookahead, readers=2,
                          decode_steps=40, cold_fill_compute_ms=charge, o_direct=True,
                          lru_bytes=4 << 20)
            runs[charge] = run_scenario(
                sc, routing=routing_input(uniform_routing(40, 4, 16, 2, seed=1)))
        grown = runs[0.5].figures.eval_ms_per_step - runs[0.0].figures.eval_ms_per_step
        trace = runs[0.5].trace
        decode = trace.steps.filter(pl.col("phase") == "decode")
        waited = trace.loads.filter(pl.col("cold") & pl.col("waited")
                                    & pl.col("step").is_in(decode["step"].implode()))
        fills = waited.select(["step", "layer"]).unique().height / decode.height
        assert fills > 1
        assert 0.25 * fills <= grown <= 0.5 * fills + 1e-9, (lookahead, grown, fills)
