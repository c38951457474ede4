"""A reader's cold bundle reads while the main thread runs Python, measured and simulated.

The engine reads a bundle as one pread per tensor slice (9 on the tiny model). Each pread lets
go of Python's GIL and takes it back afterwards, so a read that lands while the main thread
runs Python (graph building, fill work) waits for it once per slice. sim.loads models that
(`Fetcher._by_syscall`); before, it took the GIL once per load.

Measured: one reader thread reads cold bundles of models/tiny-trained-stream through the
engine's store (ExpertStore.read_bundle, pages dropped first) while the main thread alternates
`busy` ms of pure Python (or of MLX graph building) with `idle` ms of sleep (the GIL free);
arms rotated over rounds.
Simulated: the pattern as it was realized (the main thread's median busy spell beside the
reader, and its median sleep alone, before the reader starts: a sleep lasts longer than asked,
and beside the reader it also waits for the GIL back, which the simulation models) on this
machine's profile
(scenarios/hardware/this-machine.toml): one reader, the main thread holding the GIL for `busy`
ms then sleeping `idle` ms, the GIL taken per slice and (the old model) once per load. Per
arm the median read, measured and simulated.

    uv run python reports/validation/gil_probe.py [--rounds 3] [--reads 120]

Writes gil_probe.json next to this file. Linux (drops pages with POSIX_FADV_DONTNEED).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "tiny-trained-stream"
ARMS = {"main idle": None, "busy 0.2 / idle 0.05 ms": (0.2, 0.05),
        "busy 0.5 / idle 0.1 ms": (0.5, 0.1), "busy 1.0 / idle 0.1 ms": (1.0, 0.1),
        "mx graph 0.5 / idle 0.1 ms": (0.5, 0.1)}  # building an MLX graph, as decode does


def _spin(ms: float, graph: bool = False) -> None:
    """`ms` of pure Python, or (`graph`) of MLX graph building (never evaluated)."""
    end = time.perf_counter() + ms / 1e3
    if graph:
        import mlx.core as mx

        x = y = mx.ones((8, 8))
        while time.perf_counter() < end:
            y = mx.maximum(y * 1.0001 + 0.5, x)
        return
    while time.perf_counter() < end:
        pass


def _spells(arm: tuple[float, float], graph: bool, n: int) -> tuple[list[float], list[float]]:
    """`n` of the arm's busy / asleep cycles on the main thread: their realized spells (ms)."""
    busy, idle = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        _spin(arm[0], graph)
        t1 = time.perf_counter()
        time.sleep(arm[1] / 1e3)
        busy.append((t1 - t0) * 1e3)
        idle.append((time.perf_counter() - t1) * 1e3)
    return busy, idle


def measure(arm: tuple[float, float] | None, reads: int, seed: int,
            graph: bool = False) -> tuple[list[float], list[float], list[float], list[float]]:
    """One arm: the cold read times (ms), and the main thread's realized busy and idle spells
    beside the reader and its idle spells alone (ms: a sleep of 0.05 ms lasts longer on this
    VM, and beside the reader it ends only once the main thread has the GIL back, a wait the
    simulation models itself: it is given the sleep as it lasts alone)."""
    import numpy as np

    from calibration.bundle_views import one_row_views
    from engine.loader import open_manifest
    from engine.store import ExpertStore

    manifest = open_manifest(MODEL, verify=False)
    rng = np.random.default_rng(seed)
    times: list[float] = []
    busy: list[float] = []
    idle: list[float] = []
    alone = _spells(arm, graph, 200)[1] if arm is not None else []
    with ExpertStore(manifest) as store:
        store.drop_until_cold()
        views = one_row_views(store, manifest.moe_layers)
        picks = [(int(rng.choice(manifest.moe_layers)), int(rng.integers(manifest.num_experts)))
                 for _ in range(reads)]
        done = threading.Event()

        def reader() -> None:
            for layer, expert in picks:
                row = store.read_bundle(layer, expert, views[layer], emit=False)
                if row["cold"]:
                    times.append((row["finished_ns"] - row["started_ns"]) / 1e6)
                time.sleep(0.0005)
            done.set()

        t = threading.Thread(target=reader)
        t.start()
        while not done.is_set():
            if arm is None:
                time.sleep(0.001)
            else:
                b, i = _spells(arm, graph, 1)
                busy += b
                idle += i
        t.join()
    return times, busy, idle, alone


def simulate(arm: tuple[float, float] | None, reads: int, per_slice: bool) -> float:
    """Median simulated cold read (ms) of one reader beside the arm's main thread."""
    import simpy

    from sim.cpu import Cores
    from sim.gil import Gil
    from sim.loads import Fetcher, Load
    from sim.page_cache import PageCache
    from sim.profiles import load_hardware, load_model
    from sim.storage import Device

    hw, m = load_hardware("this-machine"), load_model("tiny-trained")
    env = simpy.Environment()
    cores = Cores(env, hw.cpu_cores)
    gil = Gil(env, True, hw.gil_handoff_ms / 1e3)
    device = Device(hw.ssd_latency_ms / 1e3, hw.ssd_bandwidth_gbps * 1e9, hw.queue_depth)
    pc = PageCache(0, m.bundle_bytes, m.experts, enabled=False)  # every read cold
    fetcher = Fetcher(env, hw, device, pc, cores, m.experts, m.bundle_bytes,
                      m.device_bundle_bytes, gil=gil, bundle_reads=m.bundle_reads)
    if not per_slice:
        fetcher.slices_take_the_gil = False
    times: list[float] = []

    def reader():
        for i in range(reads):
            load = Load(0, 0, i % m.experts, i, m.bundle_bytes, 1, "prefetch", env.now,
                        env.event())
            yield from fetcher.perform(load, "reader0")
            times.append((load.finished - load.started) * 1e3)
            yield env.timeout(0.0005)

    def main():
        while len(times) < reads:
            yield from gil.run(cores, arm[0] / 1e3, "main")
            yield env.timeout(arm[1] / 1e3)

    proc = env.process(reader())
    if arm is not None:
        env.process(main())
    env.run(until=proc)
    return statistics.median(times)


def run(rounds: int, reads: int) -> dict:
    names = list(ARMS)
    measured: dict[str, list[float]] = {n: [] for n in names}
    spells: dict[str, tuple[list[float], list[float], list[float]]] = {
        n: ([], [], []) for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times, busy, idle, alone = measure(ARMS[name], reads, seed=r,
                                               graph=name.startswith("mx"))
            measured[name].append(statistics.median(times))
            for into, got in zip(spells[name], (busy, idle, alone), strict=True):
                into.extend(got)
    rows = []
    for name in names:
        busy, idle, alone = spells[name]
        realized = (statistics.median(busy), statistics.median(idle)) if busy else None
        replayed = (statistics.median(busy), statistics.median(alone)) if busy else None
        rows.append({"arm": name, "measured_ms": statistics.median(measured[name]),
                     "rounds_ms": measured[name],
                     "main_busy_idle_ms": list(realized) if realized else None,
                     "main_idle_alone_ms": replayed[1] if replayed else None,
                     "simulated_per_slice_ms": simulate(replayed, reads, True),
                     "simulated_per_load_ms": simulate(replayed, reads, False)})
    return {"command": " ".join(["uv run python reports/validation/gil_probe.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(MODEL),
            "rounds": rounds, "reads_per_arm": reads, "arms": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reads", type=int, default=120)
    args = ap.parse_args()
    if args.rounds < 1 or args.reads < 1:
        sys.exit(f"gil_probe: --rounds and --reads must be >= 1, got {args.rounds} and "
                 f"{args.reads}")
    if not (MODEL / "manifest.json").is_file():
        sys.exit(f"gil_probe: {MODEL}: no converted model (bash scripts/demo.sh builds it)")
    doc = run(args.rounds, args.reads)
    print(f"{'arm':26s} {'busy/idle (alone)':>24s} {'measured':>9s} {'sim/slice':>10s} "
          f"{'sim/load':>9s}  (median cold read, ms)")
    for r in doc["arms"]:
        spell = "/".join(f"{v:.3f}" for v in r["main_busy_idle_ms"] or []) or "-"
        if r["main_idle_alone_ms"] is not None:
            spell += f" ({r['main_idle_alone_ms']:.3f})"
        print(f"{r['arm']:26s} {spell:>24s} {r['measured_ms']:9.3f} "
              f"{r['simulated_per_slice_ms']:10.3f} {r['simulated_per_load_ms']:9.3f}")
    (HERE / "gil_probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {HERE / 'gil_probe.json'}")


if __name__ == "__main__":
    main()
