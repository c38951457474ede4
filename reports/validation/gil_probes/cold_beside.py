"""Cold bundle reads alone and beside one busy process of each kind: a spinner, an MLX matmul
loop (GEMM, and a chain of vector-matrix products), a memory copy, and the engine decoding warm
(hot and on-demand presets, on a copy of the model so the reads' page drops do not reach it).
The reads are reports/validation/cold_read_probe.py's (engine.store, 9 preads a bundle, 1 ms
asleep before each); for the decoding arms it also prints the child's busiest threads' share of
a core and timeslices a second (/proc schedstat). Arms rotated over rounds.

    uv run python reports/validation/gil_probes/cold_beside.py [READS] [ROUNDS]   # 300 3: ~3 min
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "reports" / "validation"))

import cold_read_probe as crp  # noqa: E402

from calibration.stall_probe import thread_stats  # noqa: E402

MODEL = ROOT / "models" / "tiny-trained-stream"


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def mlx_gemm(stop) -> None:
    import mlx.core as mx
    a, b = mx.random.normal((256, 1024)), mx.random.normal((1024, 1024))
    while not stop.is_set():
        mx.eval(a @ b)


def mlx_gemv(stop) -> None:
    import mlx.core as mx
    ws = [mx.random.normal((1024, 1024)) for _ in range(24)]
    x = mx.random.normal((1, 1024))
    mx.eval(ws)
    while not stop.is_set():
        y = x
        for w in ws:
            y = y @ w
        mx.eval(y)


def memcpy(stop) -> None:
    import numpy as np
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    while not stop.is_set():
        np.copyto(b, a)


PROCESSES = {"none": None, "spin": spin, "mlx_gemm": mlx_gemm, "mlx_gemv": mlx_gemv,
             "memcpy": memcpy}
DECODERS = {"decode_hot": "hot", "decode_on_demand": "on-demand"}


def decoder(model: Path, preset: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ssdmoe_cli", "generate", str(model), "--prompt",
         "Once upon a time", "--max-tokens", "20000", "--temp", "1.0", "--preset", preset,
         "--no-verify"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    reads = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if not (MODEL / "manifest.json").is_file():
        sys.exit(f"cold_beside.py: {MODEL}: no converted model")
    names = [*PROCESSES, *DECODERS]
    got: dict[str, list[dict]] = {n: [] for n in names}
    threads: dict[str, list[tuple[float, float]]] = {n: [] for n in DECODERS}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / MODEL.name
        shutil.copytree(MODEL, copy)
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                stop, proc, child = mp.Event(), None, None
                if PROCESSES.get(n):
                    proc = mp.Process(target=PROCESSES[n], args=(stop,))
                    proc.start()
                    time.sleep(1.0)
                elif n in DECODERS:
                    child = decoder(copy, DECODERS[n])
                    time.sleep(8.0)
                    before, t0 = thread_stats(child.pid), time.perf_counter()
                try:
                    got[n].append(crp.read_arm(reads, seed=r))
                finally:
                    if child is not None:
                        after, wall = thread_stats(child.pid), time.perf_counter() - t0
                        child.kill()
                        child.wait()
                        busiest = sorted(
                            ((after[t]["run_ms"] - before.get(t, {"run_ms": 0})["run_ms"],
                              after[t]["switches"] - before.get(t, {"switches": 0})["switches"])
                             for t in after), reverse=True)[:2]
                        threads[n] += [(ms / wall / 1e3, sl / wall) for ms, sl in busiest]
                    stop.set()
                    if proc is not None:
                        proc.join()
    print(f"cold bundle reads, {reads} per arm x {rounds} rounds (medians of the rounds')")
    for n in names:
        med = {k: statistics.median(x[k] for x in got[n])
               for k in ("cold_wall_ms", "cold_cpu_ms", "cold_runq_ms_mean", "warm_wall_ms")}
        walls = ", ".join(f"{x['cold_wall_ms']:.3f}" for x in got[n])
        print(f"{n:17s} cold wall {med['cold_wall_ms']:.3f} ms, its CPU "
              f"{med['cold_cpu_ms']:.3f}, run-queue {med['cold_runq_ms_mean']:.3f}, warm wall "
              f"{med['warm_wall_ms']:.3f}; rounds {walls}")
    for n, t in threads.items():
        print(f"{n}: the child's two busiest threads ran "
              f"{', '.join(f'{c:.2f}' for c, _ in t)} of a core, "
              f"{', '.join(f'{s:.0f}' for _, s in t)} timeslices a second")


if __name__ == "__main__":
    main()
