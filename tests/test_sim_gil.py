"""The simulator's interpreter lock and held reads on hand-built runs (sim.gil,
sim.reader_threads, sim.loads): a reader's Python waits for the main thread's build, a held read
takes no CPU or lock (a busy one takes CPU), hand-overs after a release, a warm load's copies
under the lock, and each pread of a sliced bundle taking the lock back once."""

from __future__ import annotations

import pytest
import simpy
from sim_helpers import hardware, read_beside_compute

from sim.cpu import Cores
from sim.loads import Fetcher, Load
from sim.page_cache import PageCache
from sim.storage import Device

IO = dict(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1e9, queue_depth=2, load_overhead_ms=0.05,
          cold_overhead_ms=0.0, memcpy_gbps=0.0, handoff_ms=0.0, mem_bandwidth_gbps=1e9)



def test_a_readers_python_bookkeeping_waits_for_the_main_threads_build():
    """GIL (sim.gil): a reader's read lands while the main thread builds a 1 ms layer; its
    bookkeeping (load_overhead, Python) runs only once the build releases the lock."""
    env = simpy.Environment()
    cores = Cores(env, 0)
    from sim.gil import Gil

    gil = Gil(env, True)
    device = Device(0.0002, 1e12)  # the read itself: 0.2 ms, no Python
    pc = PageCache(0, 1000, 16, enabled=False)
    f = Fetcher(env, hardware(**dict(IO, load_overhead_ms=0.1)), device, pc, cores, 16, 1000,
                gil=gil)
    load = Load(0, 0, 3, 3, 1000, 1, "prefetch", 0.0, env.event())
    seen = {}

    def main():
        yield from gil.run(cores, 0.001, "main")  # graph building from t=0 to 1 ms
        seen["build_end"] = env.now

    def reader():
        yield from f.perform(load, "reader0")

    env.process(main())
    env.process(reader())
    env.run()
    assert seen["build_end"] == pytest.approx(0.001)
    assert load.finished == pytest.approx(0.001 + 0.0001)  # lock at 1 ms, then 0.1 ms of Python
    assert gil.waited_s == pytest.approx(0.001 - 0.0002, abs=1e-8)


def _warm_read_beside_main(hw_io: dict, main_at: float, main_python: float,
                           **fetcher) -> tuple[float, float, float]:
    """A warm bundle read on reader0 from t=0 with the GIL modelled, and the main thread asking
    for the lock at `main_at` for `main_python` s: (the load's finish, main's end, reader0's
    CPU)."""
    from sim.gil import Gil

    env = simpy.Environment()
    cores = Cores(env, 0)
    gil = Gil(env, True)
    pc = PageCache(10_000, 1000, 16)
    pc.fill(3, (0, 0))
    f = Fetcher(env, hardware(**dict(IO, **hw_io)), Device(0.0002, 1e12), pc, cores, 16, 1000,
                gil=gil, **fetcher)
    load = Load(0, 0, 3, 3, 1000, 1, "prefetch", 0.0, env.event())
    ends = {}

    def main():
        yield env.timeout(main_at)
        yield from gil.run(cores, main_python, "main")
        ends["main"] = env.now

    env.process(f.perform(load, "reader0"))
    env.process(main())
    env.run()
    return load.finished, ends["main"], cores.busy_s["reader0"]


def test_a_held_read_waits_without_cpu_or_the_gil():
    """read_hold_ms (the stall probe's sleep in every read, for its replays): a warm read held
    1 ms finishes 1 ms later with no more CPU, and another thread takes the GIL meanwhile: the
    main thread's 0.5 ms of Python asked at 0.1 ms ends at 0.6 ms, as without the hold (held
    as CPU under the lock it would end at 1.6)."""
    def run(hold_ms: float):
        return _warm_read_beside_main(dict(load_overhead_ms=0.1, memcpy_gbps=0.0), 0.0001,
                                      0.0005, hold_ms=hold_ms)

    finished, main_end, cpu = run(0.0)
    held, held_main_end, held_cpu = run(1.0)
    assert finished == pytest.approx(0.0001)  # 0.1 ms of Python, warm
    assert held == pytest.approx(0.001 + 0.0001)
    assert held_cpu == pytest.approx(cpu) == pytest.approx(0.0001)
    assert main_end == pytest.approx(0.0006)  # the read's Python first, then main's
    assert held_main_end == pytest.approx(0.0006)  # main's at once: the held read lets go


def test_a_busy_held_read_takes_cpu_but_not_the_gil():
    """read_hold_busy (the busy probe's hold): the same read held 1 ms busy finishes as late
    and costs reader0 1 ms more CPU; the main thread still takes the GIL at once (0.6 ms). On
    one core beside a main-thread job of 1 ms from t=0, the two share it: the hold and the job
    each progress at half speed, so the job ends at 2 ms, not 1."""
    def run(hold_busy: bool):
        return _warm_read_beside_main(dict(load_overhead_ms=0.1, memcpy_gbps=0.0), 0.0001,
                                      0.0005, hold_ms=1.0, hold_busy=hold_busy)

    asleep, asleep_main, asleep_cpu = run(False)
    busy, busy_main, busy_cpu = run(True)
    assert busy == pytest.approx(asleep) == pytest.approx(0.0011)
    assert busy_cpu == pytest.approx(asleep_cpu + 0.001)
    assert busy_main == pytest.approx(asleep_main) == pytest.approx(0.0006)
    env = simpy.Environment()
    cores = Cores(env, 1)
    f = Fetcher(env, hardware(**IO), Device(0.0, 1e12), PageCache(10_000, 1000, 16), cores, 16,
                1000, hold_ms=1.0, hold_busy=True)
    ends = {}

    def beside():
        yield cores.work(0.001, "main")
        ends["main"] = env.now

    f.pc.fill(3, (0, 0))
    env.process(f.perform(Load(0, 0, 3, 3, 1000, 1, "prefetch", 0.0, env.event()), "reader0"))
    env.process(beside())
    env.run()
    assert ends["main"] == pytest.approx(0.002)


def _main_and_reader(main_steps: list[tuple[str, float]], reader_at: float,
                     reader_python: float, handoff_s: float = 0.00005,
                     interval_s: float = 0.005) -> tuple[dict[str, float], float]:
    """Main runs `main_steps` ("python" or "sleep", seconds) from 0; a reader asks for the GIL at
    `reader_at` for `reader_python` of Python. Returns the end times (ms) and the GIL waits."""
    from sim.gil import Gil

    env = simpy.Environment()
    cores = Cores(env, 0)
    gil = Gil(env, True, handoff_s=handoff_s, interval_s=interval_s)
    ends = {}

    def main():
        for kind, seconds in main_steps:
            if kind == "python":
                yield from gil.run(cores, seconds, "main")
            else:  # a blocking call that lets go of the lock, then takes it back
                yield env.timeout(seconds)
                yield from gil.take_back()
        ends["main"] = env.now * 1e3

    def reader():
        yield env.timeout(reader_at)
        yield from gil.run(cores, reader_python, "reader0")
        ends["reader"] = env.now * 1e3

    env.process(main())
    env.process(reader())
    env.run()
    return ends, gil.waited_s * 1e3


def test_a_thread_that_slept_on_the_gil_runs_a_hand_over_after_a_release_that_lasts():
    """GIL hand-over (sim.gil, gil_handoff_ms = 0.05). Main holds the lock 0 -> 1 ms; a reader
    asking at 0.2 sleeps on it.
    - Main goes on to 0.2 ms more Python at once: the release at 1.0 wakes the reader, but main
      takes the free lock first and keeps it to 1.2 (CPython's GIL is no queue); the reader,
      awake at 1.05 to a taken lock, sleeps again; main's release at 1.2 wakes it at 1.25, and
      its 0.1 ms ends at 1.35.
    - Main sleeps 0.1 ms instead (longer than the wake-up): the reader has the lock at 1.05
      and its Python ends at 1.15; main, back at 1.1 to a taken lock, sleeps on it and runs
      on at 1.2 (the release plus its own wake-up).
    - Main sleeps 0.02 ms (shorter than the wake-up): main is back at 1.02 and takes the free
      lock; the reader waits on to main's end.
    The old first-come queue gave the reader the lock at 1.0 in every case (1.15 in the first:
    this fails with it). A take nobody contends costs no hand-over: a lone thread's 0.1 ms
    ends at 0.1."""
    from sim.gil import Gil

    ends, waited = _main_and_reader([("python", 0.001), ("python", 0.0002)], 0.0002, 0.0001)
    assert ends == pytest.approx({"main": 1.2, "reader": 1.35})
    assert waited == pytest.approx(1.25 - 0.2)
    ends, waited = _main_and_reader([("python", 0.001), ("sleep", 0.0001),
                                     ("python", 0.0002)], 0.0002, 0.0001)
    assert ends == pytest.approx({"reader": 1.15, "main": 1.4})
    assert waited == pytest.approx((1.05 - 0.2) + (1.2 - 1.1))
    ends, _ = _main_and_reader([("python", 0.001), ("sleep", 0.00002), ("python", 0.0002)],
                               0.0002, 0.0001)
    assert ends == pytest.approx({"main": 1.22, "reader": 1.37})

    lone_env = simpy.Environment()
    lone = Gil(lone_env, True, handoff_s=0.00005)
    lone_env.process(lone.run(Cores(lone_env, 0), 0.0001, "reader0"))
    lone_env.run()
    assert lone_env.now == pytest.approx(0.0001) and lone.waited_s == 0.0


def test_a_waiter_past_the_switch_interval_gets_the_gil_at_the_next_release():
    """CPython's switch interval (sim.gil, 5 ms here 1 ms): main runs 0.3 ms Python segments
    back to back from 0, keeping the lock at every release; a reader asking at 0.1 waits. Its
    wait passes 1 ms at 1.1, so the release at 1.2 is forced: the lock is the reader's, at
    1.25 after its wake-up, for 0.1 ms to 1.35, and main, asking at 1.2, waits for it and for
    its own wake-up: its last segments run 1.4 - 1.7 and 1.7 - 2.0. Without the interval the
    reader waits for main's end (1.8 -> 1.85 -> 1.95)."""
    steps = [("python", 0.0003)] * 6
    ends, _ = _main_and_reader(steps, 0.0001, 0.0001, interval_s=0.001)
    assert ends == pytest.approx({"reader": 1.35, "main": 2.0})
    ends, _ = _main_and_reader(steps, 0.0001, 0.0001, interval_s=1.0)
    assert ends == pytest.approx({"main": 1.8, "reader": 1.95})


def test_a_thread_back_from_a_call_that_let_go_of_the_gil_takes_it_back():
    """sim.gil.Gil.take_back: main hands work over from 0 to 0.2 ms (async_eval: a core, not the
    lock); a reader takes the lock at 0.1 ms for 0.3 ms of Python. Main runs Python again only
    at 0.45 (the reader's release at 0.4 plus the 0.05 ms hand-over). A take-back nobody
    contends is free: no wait, no hand-over, no SimPy event."""
    from sim.gil import Gil

    def run(reader_at: float | None) -> tuple[float, float]:
        env = simpy.Environment()
        cores = Cores(env, 0)
        gil = Gil(env, True, handoff_s=0.00005)
        seen = {}

        def main():
            yield cores.work(0.0002, "main")
            yield from gil.take_back()
            seen["main"] = env.now

        def reader():
            yield env.timeout(reader_at)
            yield from gil.run(cores, 0.0003, "reader0")

        env.process(main())
        if reader_at is not None:
            env.process(reader())
        env.run()
        return seen["main"] * 1e3, gil.waited_s * 1e3

    assert run(0.0001) == pytest.approx((0.45, 0.25))
    assert run(0.0003) == pytest.approx((0.2, 0.0))  # the reader asks after main is back
    assert run(None) == pytest.approx((0.2, 0.0))
    env = simpy.Environment()
    off = Gil(env, False)
    assert list(off.take_back()) == []  # the lock not modelled: nothing to wait for
    on = Gil(env, True)
    assert list(on.take_back()) == []  # free: returns without an event


def test_a_warm_load_holds_the_gil_through_its_copies():
    """A warm bundle (page cache) of 3 preads: each returns before a waiting thread is awake, so
    its copies (0.1 ms at 10 MB/s for 1000 bytes) run inside its hold of the lock, with its
    0.03 ms of Python: a reader starting at 0 holds it to 0.13 ms, and main asking at 0.05 runs
    its 0.1 ms of Python from 0.13 to 0.23. With the copy outside the lock (as a cold read's
    copy is, inside its pread) main would have run at 0.1 - 0.2 (the Python after the copy)."""
    finished, main_end, _ = _warm_read_beside_main(dict(load_overhead_ms=0.03,
                                                        memcpy_gbps=0.01), 0.00005, 0.0001,
                                                   bundle_reads=3)
    assert finished * 1e3 == pytest.approx(0.13)
    assert main_end * 1e3 == pytest.approx(0.23)


def _sliced_load(main_build_s: float, readahead: bool = False, gil_on: bool = True,
                 warm: bool = False, cold_read_cpu_ms: float = 0.0) -> float:
    """A cold bundle of 3 tensor slices (3 preads, 0.2 ms each on the device, 0.03 ms of Python
    in all) read by a reader from t=0 while the main thread holds the GIL for `main_build_s`;
    returns when the load finished (ms)."""
    from sim.gil import Gil

    env = simpy.Environment()
    cores = Cores(env, 0)
    gil = Gil(env, gil_on)
    device = Device(0.0002, 1e12)
    pc = PageCache(10_000, 1000, 16)
    hw = hardware(**dict(IO, load_overhead_ms=0.03, readahead=readahead,
                         cold_read_cpu_ms=cold_read_cpu_ms))
    f = Fetcher(env, hw, device, pc, cores, 16, 1000, gil=gil, bundle_reads=3)
    load = Load(0, 0, 3, 3, 1000, 1, "prefetch", 0.0, env.event())
    if warm:
        pc.fill(3, (0, 0))

    def main():
        yield from gil.run(cores, main_build_s, "main")

    if main_build_s:
        env.process(main())
    env.process(f.perform(load, "reader0"))
    env.run()
    return load.finished * 1e3


def test_each_pread_of_a_bundle_takes_the_gil_back_once():
    """The engine reads a bundle one pread per slice, its Python in 4 parts of 0.0075 ms: one
    before the first pread (ranges, views, residency) and one after each (sim.loads._by_syscall).
    Main builds 0 -> 1 ms: the reader waits for the lock before it reads at all, its first part
    to 1.0075; then each slice 0.2 ms on the device and its part: 1.215, 1.4225, 1.63. A one-shot
    load would finish at 1.03 (all three reads by 0.6, one wait, 0.03 of Python)."""
    assert _sliced_load(0.001) == pytest.approx(1.63, abs=1e-5)
    # nobody holds the lock: the same cost as one read of 3 requests and its Python
    assert _sliced_load(0.0) == pytest.approx(0.63, abs=1e-5)
    assert _sliced_load(0.0, gil_on=False) == pytest.approx(0.63, abs=1e-5)
    # with readahead the first pread brings the bundle in (one request), the others are warm
    assert _sliced_load(0.0, readahead=True) == pytest.approx(0.23, abs=1e-5)
    assert _sliced_load(0.001, readahead=True) == pytest.approx(1.03, abs=1e-5)
    # a warm pread returns before a waiting thread is awake: a warm load keeps the GIL
    assert _sliced_load(0.001, warm=True) == pytest.approx(1.03, abs=1e-5)


def _read_beside_compute(cold_read_cpu_ms: float, compute_ms: float, load_overhead_ms: float = 0.0,
                         warm: bool = False) -> tuple[float, float]:
    """One cold bundle (one pread, 0.2 ms on the device) read by a reader from t=0 on a host of
    ONE core, while a compute job of `compute_ms` runs from t=0 (none: 0). No GIL, no copy, no
    fault work. Returns (load finished, compute finished) in ms."""
    hw = hardware(**dict(IO, load_overhead_ms=load_overhead_ms,
                         cold_read_cpu_ms=cold_read_cpu_ms))
    return read_beside_compute(hw, 1000, Device(0.0002, 1e12), compute_ms, warm)


def test_a_cold_reads_cpu_runs_beside_its_device_time():
    """cold_read_cpu_ms (sim.loads): the measured CPU of a cold read that the load's modelled
    CPU leaves out runs on the cores while the read is on the device. Hand-worked on one core,
    where the reader runs before the compute thread (sim.cpu):
    - 0.1 ms of it, alone: inside the 0.2 ms device time, the read is not longer (0.2);
    - beside a 1 ms compute job: the reader's 0.1 first, so compute ends 0.1 late (1.1) and
      the read on time (0.2);
    - 0.3 ms of it: CPU-bound, 0.3 alone, and 0.3 beside compute too (the reader first),
      compute then runs its 1 ms (1.3);
    - 0.1 ms, of which 0.04 is the load's own Python (load_overhead): 0.06 beside the device
      (done at 0.06), the Python after it (0.2 -> 0.24); compute loses 0.1 in all (1.1);
    - a warm read has none (compute alone: 1.0; the read is its 0.04 ms of Python, first)."""
    assert _read_beside_compute(0.1, 0) == pytest.approx((0.2, 0.0), abs=1e-6)
    assert _read_beside_compute(0.1, 1.0) == pytest.approx((0.2, 1.1), abs=1e-6)
    assert _read_beside_compute(0.3, 0) == pytest.approx((0.3, 0.0), abs=1e-6)
    assert _read_beside_compute(0.3, 1.0) == pytest.approx((0.3, 1.3), abs=1e-6)
    assert _read_beside_compute(0.1, 1.0, load_overhead_ms=0.04) == pytest.approx((0.24, 1.1),
                                                                                  abs=2e-6)
    assert _read_beside_compute(0.1, 1.0, load_overhead_ms=0.04, warm=True) == pytest.approx(
        (0.04, 1.04), abs=2e-6)
    assert _read_beside_compute(0.0, 1.0) == pytest.approx((0.2, 1.0), abs=1e-6)  # none


def test_a_sliced_cold_read_spreads_its_cpu_over_its_preads():
    """Read slice by slice (3 preads of 0.2 ms, 0.03 ms of Python), a cold bundle's CPU beside
    the device is split over the preads: 0.33 ms measured less the 0.03 of Python leaves 0.1
    per pread, inside each 0.2 ms: as fast as without it (0.63). 0.93 ms leaves 0.3 per pread:
    each takes 0.3, 0.93 in all."""
    assert _sliced_load(0.0, cold_read_cpu_ms=0.33) == pytest.approx(0.63, abs=1e-5)
    assert _sliced_load(0.0, cold_read_cpu_ms=0.93) == pytest.approx(0.93, abs=1e-5)
