"""Scratch: a reader's cold bundle reads beside a main thread alternating busy Python and sleep,
every syscall timestamped (GIL held on both sides), to see per idle window how many slices land
and how late the reader runs after main lets go."""

import json
import sys
import threading
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np

import engine.store as st
from calibration.compute_probes import _one_row_views
from engine.loader import open_manifest
from engine.store import ExpertStore

MODEL = str(
    __import__("pathlib").Path(__file__).resolve().parents[3] / "models" / "tiny-trained-stream"
)
calls = []  # (kind, t_before, t_after)
_rb, _rn = st.read_buffered, st.read_nowait


def rb(*a, **k):
    t0 = time.perf_counter_ns()
    r = _rb(*a, **k)
    calls.append(("buf", t0, time.perf_counter_ns()))
    return r


def rn(*a, **k):
    t0 = time.perf_counter_ns()
    r = _rn(*a, **k)
    calls.append(("nowait", t0, time.perf_counter_ns()))
    return r


st.read_buffered, st.read_nowait = rb, rn


def run(busy_ms, idle_ms, reads=120, seed=0, release="sleep"):
    calls.clear()
    spells = []
    manifest = open_manifest(MODEL, verify=False)
    rng = np.random.default_rng(seed)
    loads = []
    with ExpertStore(manifest) as store:
        store.drop_until_cold()
        views = _one_row_views(store, manifest.moe_layers)
        picks = [
            (int(rng.choice(manifest.moe_layers)), int(rng.integers(manifest.num_experts)))
            for _ in range(reads)
        ]
        done = threading.Event()

        def reader():
            for layer, expert in picks:
                row = store.read_bundle(layer, expert, views[layer], emit=False)
                if row["cold"]:
                    loads.append((row["started_ns"], row["finished_ns"]))
                time.sleep(0.0005)
            done.set()

        t = threading.Thread(target=reader)
        t.start()
        buf = bytes(1 << 16)
        import hashlib

        while not done.is_set():
            t0 = time.perf_counter_ns()
            end = t0 + busy_ms * 1e6
            while time.perf_counter_ns() < end:
                pass
            t1 = time.perf_counter_ns()
            if release == "sleep":
                time.sleep(idle_ms / 1e3)
            else:  # CPU work without the GIL (hashlib lets go of it for big buffers)
                n = int(release)
                for _ in range(n):
                    hashlib.sha256(buf).digest()
            t2 = time.perf_counter_ns()
            spells.append((t0, t1, t2))
        t.join()
    return list(calls), spells, loads


def analyse(calls, spells, loads):
    sp = np.array(spells, dtype=np.int64)
    busy_end = sp[:, 1]
    idle_end = sp[:, 2]

    def window(t):  # index of the idle window containing t (main asleep), else -1
        i = np.searchsorted(busy_end, t, side="right") - 1
        if i >= 0 and t <= idle_end[i] + 0:
            return i
        return -1

    inwin, wake, nowait_d = [], [], []
    per_window = {}
    for kind, a, b in calls:
        if kind == "nowait":
            nowait_d.append((b - a) / 1e6)
            continue
        wa, wb = window(a), window(b)
        if wb >= 0:
            per_window[wb] = per_window.get(wb, 0) + 1
        if wa >= 0 and wa == wb:
            inwin.append((b - a) / 1e6)
        elif wb >= 0 and wb != wa:
            wake.append((b - busy_end[wb]) / 1e6)
    busy = (sp[:, 1] - sp[:, 0]) / 1e6
    idle = (sp[:, 2] - sp[:, 1]) / 1e6
    ld = [(f - s) / 1e6 for s, f in loads]
    def q(v, p):
        return float(np.quantile(v, p)) if len(v) else float("nan")
    return {
        "busy_p50": q(busy, 0.5),
        "idle_p50": q(idle, 0.5),
        "read_p50": q(ld, 0.5),
        "slice_in_window_p50": q(inwin, 0.5),
        "slice_in_window_p90": q(inwin, 0.9),
        "n_in_window": len(inwin),
        "wake_p10": q(wake, 0.1),
        "wake_p50": q(wake, 0.5),
        "wake_p90": q(wake, 0.9),
        "n_wake": len(wake),
        "nowait_p50": q(nowait_d, 0.5),
        "slices_per_used_window": float(np.mean(list(per_window.values()))) if per_window else 0,
        "buf_calls": sum(1 for c in calls if c[0] == "buf"),
    }


if __name__ == "__main__":
    arms = [
        (None, 1.0, "sleep"),
        (1.0, 0.1, "sleep"),
        (0.5, 0.1, "sleep"),
        (0.2, 0.05, "sleep"),
        (0.2, 0, "1"),
        (0.2, 0, "4"),
    ]
    out = []
    for busy, idle, rel in arms:
        if busy is None:
            c, s, ld = run(0.0, idle, release="sleep")
        else:
            c, s, ld = run(busy, idle, release=rel)
        r = analyse(c, s, ld)
        r["arm"] = f"busy {busy} {rel} {idle}"
        out.append(r)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
