"""Scratch: a reader thread's cold bundle reads alone, beside 1 and 2 spinning processes (cores
busy, no GIL shared), and beside 2 processes each bursting like a compute thread."""

import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np

from calibration.compute_probes import _one_row_views
from engine.loader import open_manifest
from engine.store import ExpertStore

MODEL = str(
    __import__("pathlib").Path(__file__).resolve().parents[3] / "models" / "tiny-trained-stream"
)


def reads(n=150, seed=0, gap=0.0005):
    manifest = open_manifest(MODEL, verify=False)
    rng = np.random.default_rng(seed)
    out, cpu = [], []
    with ExpertStore(manifest) as store:
        store.drop_until_cold()
        views = _one_row_views(store, manifest.moe_layers)
        for _ in range(n):
            layer, expert = (
                int(rng.choice(manifest.moe_layers)),
                int(rng.integers(manifest.num_experts)),
            )
            c0 = time.thread_time_ns()
            row = store.read_bundle(layer, expert, views[layer], emit=False)
            c1 = time.thread_time_ns()
            if row["cold"]:
                out.append((row["finished_ns"] - row["started_ns"]) / 1e6)
                cpu.append((c1 - c0) / 1e6)
            time.sleep(gap)
    return out, cpu


SPIN = "while True: pass"
BURST = (
    "import time\nwhile True:\n e=time.perf_counter()+0.002\n"
    " while time.perf_counter()<e: pass\n time.sleep(0.001)"
)
arms = {
    "alone": [],
    "1 spinner": [SPIN],
    "2 spinners": [SPIN, SPIN],
    "2 bursters 2/1ms": [BURST, BURST],
}
res = {a: [] for a in arms}
cpus = {a: [] for a in arms}
for rnd in range(3):
    names = list(arms)[rnd % 4 :] + list(arms)[: rnd % 4]
    for a in names:
        procs = [subprocess.Popen([sys.executable, "-c", code]) for code in arms[a]]
        time.sleep(0.3)
        try:
            t, c = reads(seed=rnd)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        res[a].append(statistics.median(t))
        cpus[a].append(statistics.median(c))
for a in arms:
    print(
        f"{a:20s} read p50 per round {[round(x, 3) for x in res[a]]} "
        f"median {statistics.median(res[a]):.3f}  thread cpu {statistics.median(cpus[a]):.3f}"
    )
