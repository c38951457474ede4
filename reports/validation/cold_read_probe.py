"""Where a cold bundle read's time goes on this machine: the reading thread's CPU or the device.

The simulator splits a cold read into device time (sim.storage: bundle_reads x ssd_latency_ms
+ bytes / ssd_bandwidth_gbps, no CPU) and CPU on the host's shared cores (cold_overhead_ms,
load_overhead_ms, the copy: sim.loads). This probe reads cold bundles through the engine's own
store (engine.store.ExpertStore.read_bundle, 9 preads each on the tiny fixture) on a thread of
its own that sleeps 1 ms before each read, as a reader waits on its queue, and takes that
thread's CPU time (time.thread_time) and /proc schedstat (run-queue wait, timeslices) around
the read alone. Arms keep 0-3 other cores busy (spinning processes), rotated over rounds.

It then prints the committed scenario's split of the same read for comparison: a read whose
wall is mostly the thread's own CPU competes for the cores with graph building and compute
(a lead's reads beside compute) where the sim has it wait on the device instead.

    uv run python reports/validation/cold_read_probe.py [--reads 200] [--rounds 3]

Linux only (page drops and schedstat). Prints a table; writes cold_read_probe.json next to
this file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "tiny-trained-stream"
SCENARIO = ROOT / "scenarios" / "this-machine-tiny-trained.toml"
BUSY = (0, 1, 2, 3)


def spin(stop: mp.synchronize.Event) -> None:
    while not stop.is_set():
        sum(range(10_000))


def schedstat() -> tuple[float, float, int]:
    """This thread's CPU ms, run-queue wait ms and timeslices so far."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        cpu, wait, slices = f.read().split()
    return int(cpu) / 1e6, int(wait) / 1e6, int(slices)


def read_arm(reads: int, seed: int) -> dict[str, float]:
    """`reads` cold reads, each followed by the same bundle read warm, on a fresh thread."""
    import numpy as np

    from engine.loader import open_manifest
    from engine.paths.kernel import alloc_stack, row_views
    from engine.store import ExpertStore

    manifest = open_manifest(MODEL, verify=False)
    out: dict[str, list[float]] = {k: [] for k in (
        "cold_wall_ms", "cold_cpu_ms", "cold_runq_ms", "cold_slices", "warm_wall_ms",
        "warm_cpu_ms")}
    not_cold = 0

    def work() -> None:
        nonlocal not_cold
        rng = np.random.default_rng(seed)
        with ExpertStore(manifest) as store:
            layers = manifest.moe_layers
            views = {}
            for layer in layers:
                _, stack = alloc_stack(store.expert_shapes(layer), 1)
                views[layer] = row_views(stack, 0)
            for _ in range(reads):
                layer = int(rng.choice(layers))
                expert = int(rng.integers(manifest.num_experts))
                store.drop_page_cache(layer)
                for kind in ("cold", "warm"):
                    time.sleep(0.001)  # blocked, as a reader on its queue
                    s0, c0, t0 = schedstat(), time.thread_time(), time.perf_counter()
                    row = store.read_bundle(layer, expert, views[layer], emit=False)
                    t1, c1, s1 = time.perf_counter(), time.thread_time(), schedstat()
                    if kind == "cold" and not row.get("cold", True):
                        not_cold += 1
                    out[f"{kind}_wall_ms"].append((t1 - t0) * 1e3)
                    out[f"{kind}_cpu_ms"].append((c1 - c0) * 1e3)
                    if kind == "cold":
                        out["cold_runq_ms"].append(s1[1] - s0[1])
                        out["cold_slices"].append(s1[2] - s0[2])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    summary = {k: statistics.median(v) for k, v in out.items() if k != "cold_runq_ms"}
    summary["cold_runq_ms_mean"] = statistics.fmean(out["cold_runq_ms"])
    summary["cold_slices"] = statistics.fmean(out["cold_slices"])
    summary["not_cold"] = not_cold
    return summary


def measure(reads: int, rounds: int) -> dict[str, dict[str, float]]:
    per_arm: dict[int, list[dict[str, float]]] = {b: [] for b in BUSY}
    for r in range(rounds):
        order = BUSY[r % len(BUSY):] + BUSY[:r % len(BUSY)]
        for busy in order:
            stop = mp.Event()
            spinners = [mp.Process(target=spin, args=(stop,)) for _ in range(busy)]
            for p in spinners:
                p.start()
            time.sleep(0.2)
            try:
                per_arm[busy].append(read_arm(reads, seed=r))
            finally:
                stop.set()
                for p in spinners:
                    p.join()
    return {f"busy={b}": {k: statistics.median(x[k] for x in rows) for k in rows[0]}
            for b, rows in per_arm.items()}


def modelled() -> dict[str, float]:
    """The committed scenario's uncontended cold read of one bundle, device and CPU."""
    from sim.profiles import load_scenario

    sc = load_scenario(str(SCENARIO))
    hw, m = sc.hardware, sc.model
    nbytes = m.bundle_bytes
    device_bytes = m.device_bundle_bytes or nbytes
    device = m.bundle_reads * hw.ssd_latency_ms + device_bytes / (hw.ssd_bandwidth_gbps * 1e6)
    cpu = hw.cold_overhead_ms + hw.load_overhead_ms + nbytes / (hw.memcpy_gbps * 1e6)
    return {"device_ms": device, "cpu_ms": cpu, "cpu_share": cpu / (cpu + device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=200, help="cold reads per arm and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("cold_read_probe.py: Linux only (page drops and /proc schedstat)")
    if not (MODEL / "manifest.json").exists():
        sys.exit(f"{MODEL}: no converted model (ssdmoe convert models/tiny-trained "
                 f"{MODEL.relative_to(ROOT)} --bits 4 --group-size 64)")
    arms = measure(args.reads, args.rounds)
    model = modelled()
    print(f"cold bundle reads through engine.store on {MODEL.name}, {args.reads} per arm x "
          f"{args.rounds} rounds (medians of the rounds' medians)")
    print(f"{'other cores busy':>16} {'cold wall':>9} {'its CPU':>8} {'CPU share':>9} "
          f"{'run-queue':>9} {'slices':>6} {'warm wall':>9} {'warm CPU':>8}")
    for name, a in arms.items():
        print(f"{name.split('=')[1]:>16} {a['cold_wall_ms']:9.3f} {a['cold_cpu_ms']:8.3f} "
              f"{a['cold_cpu_ms'] / a['cold_wall_ms']:9.2f} {a['cold_runq_ms_mean']:9.3f} "
              f"{a['cold_slices']:6.2f} {a['warm_wall_ms']:9.3f} {a['warm_cpu_ms']:8.3f}")
    print(f"modelled (scenario {SCENARIO.name}, isolated figures): device "
          f"{model['device_ms']:.3f} ms + CPU {model['cpu_ms']:.3f} ms, CPU share "
          f"{model['cpu_share']:.2f}")
    out = {"command": "uv run python reports/validation/cold_read_probe.py "
                      f"--reads {args.reads} --rounds {args.rounds}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "arms": arms, "modelled": model}
    (HERE / "cold_read_probe.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
