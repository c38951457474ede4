"""Per-load cost of `ExpertStore.read_bundle` on a small-bundle model, by residency method.

Run from the repository root:  uv run python reports/store/read_cost.py [--model DIR]

Arms, all in one process, interleaved and rotated over several rounds, same random (layer,
expert) sequence for every arm within a round, each load into a preallocated slot row
(engine.paths.kernel.alloc_stack/row_views, as the engine does):
- before:     the store as it was before the RWF_NOWAIT change (mincore with a fresh np.zeros
              vector per range, then one preadv per range); reproduced below by BeforeStore.
- mincore:    the current store with the mincore classification forced.
- rwf_nowait: the current store's default on Linux (read with RWF_NOWAIT first).
Warm loads: all expert files in the page cache. Cold loads: the layer file's pages dropped
(POSIX_FADV_DONTNEED) before each timed load. Writes reports/store/read-cost.json and README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.manifest import TENSOR_NAMES, read_manifest  # noqa: E402
from engine.platform import _libc  # noqa: E402
from engine.store import PAGE, ExpertStore  # noqa: E402

OUT = Path(__file__).resolve().parent
ARMS = ("before", "mincore", "rwf_nowait")


class BeforeStore(ExpertStore):
    """The read path as it was before this change (copied from engine/store.py): classify with
    mincore first (a fresh vector and numpy ops per range), then a memoryview and preadv per
    range."""

    def _resident_pages(self, f, ranges):
        page = PAGE
        if not f.addr:
            return 0, 0
        resident = total = 0
        for off, length in ranges:
            p0, p1 = off // page, -(-(off + length) // page)
            n = p1 - p0
            vec = np.zeros(n, dtype=np.uint8)
            if _libc.mincore(f.addr + p0 * page, n * page, vec.ctypes.data) != 0:
                return 0, 0
            resident += int(np.count_nonzero(vec & 1))
            total += n
        return resident, total

    def read_bundle(self, layer, expert, into, *, source="demand", thread="main",
                    issued_ns=None, waited=True, emit=True):
        entry = self.manifest.layers[layer]
        ranges = [entry.expert_range(n, expert) for n in TENSOR_NAMES]
        views = [into[n] for n in TENSOR_NAMES]
        return self._load(layer, expert, ranges, views, source, thread, issued_ns, waited, emit)

    def _load(self, layer, expert, ranges, views, source, thread, issued_ns, waited, emit):
        f = self._files[layer]
        started = time.perf_counter_ns()
        issued = started if issued_ns is None else issued_ns
        r, t = self._resident_pages(f, ranges)
        cold = r < t
        nbytes = 0
        for (off, length), view in zip(ranges, views, strict=True):
            if view.nbytes != length or not view.flags.c_contiguous or not view.flags.writeable:
                raise ValueError("buffer")
            buf = memoryview(view).cast("B")
            done = 0
            while done < length:
                n = os.preadv(f.fd, [buf[done:]], off + done)
                if n == 0:
                    raise self._fail(f, layer, expert, "short read")
                done += n
            nbytes += length
        finished = time.perf_counter_ns()
        row = {
            "step": self.step, "layer": layer, "expert": expert, "bytes": nbytes,
            "offset": ranges[0][0], "issued_ns": issued, "started_ns": started,
            "finished_ns": finished, "source": source, "cold": cold, "waited": waited,
            "wait_ns": finished - issued if waited else 0, "thread": thread,
        }
        if emit:
            self.emit(row)
        return row


def _stats(ns: list[int]) -> dict:
    us = sorted(x / 1000 for x in ns)
    q = statistics.quantiles(us, n=10)
    return {"n": len(us), "median_us": round(statistics.median(us), 2),
            "p10_us": round(q[0], 2), "p90_us": round(q[-1], 2)}


def _machine() -> dict:
    fs = "?"
    try:
        import subprocess
        fs = subprocess.run(["df", "-T", str(ROOT)], capture_output=True, text=True,
                            timeout=10).stdout.splitlines()[-1].split()[1]
    except Exception:  # noqa: BLE001 (informational only)
        pass
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "filesystem": fs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-trained-stream"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warm-loads", type=int, default=2000, help="per arm per round")
    ap.add_argument("--cold-loads", type=int, default=60, help="per arm per round")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    model = Path(a.model)
    if not (model / "manifest.json").exists():
        print(f"skipped: {model} is missing (build the tiny-trained fixture and convert it "
              "to get it)")
        return 0

    from engine.paths.kernel import alloc_stack, row_views

    m = read_manifest(model)
    stores = {"before": BeforeStore(m), "mincore": ExpertStore(m), "rwf_nowait": ExpertStore(m)}
    detected, why = stores["rwf_nowait"].residency_method, stores["rwf_nowait"].residency_fallback
    stores["before"].residency_method = stores["mincore"].residency_method = "mincore"
    if detected != "rwf_nowait":
        print(f"RWF_NOWAIT not usable here ({why}): the rwf_nowait arm measures mincore")
    rows = 8
    stacks = {layer: alloc_stack(stores["mincore"].expert_shapes(layer), rows)
              for layer in m.moe_layers}  # the MLX arrays stay referenced while we read
    slots = {layer: [row_views(stacks[layer][1], r) for r in range(rows)]
             for layer in m.moe_layers}
    pairs = [(layer, e) for layer in m.moe_layers for e in range(m.num_experts)]
    for layer, e in pairs:  # everything warm, and every code path run once
        for s in stores.values():
            s.read_bundle(layer, e, slots[layer][0])
    load0 = os.getloadavg()
    warm = {k: [] for k in ARMS}
    warm_cold = dict.fromkeys(ARMS, 0)
    cold = {k: [] for k in ARMS}
    cold_warm = dict.fromkeys(ARMS, 0)
    rng = random.Random(0)
    t0 = time.time()
    for rnd in range(a.rounds):
        order = ARMS[rnd % 3:] + ARMS[:rnd % 3]
        seq = [rng.choice(pairs) for _ in range(a.warm_loads)]
        for arm in order:
            s = stores[arm]
            out = warm[arm]
            for layer, e in pairs:  # the cold loads below dropped pages: warm everything again
                stores["rwf_nowait"].read_bundle(layer, e, slots[layer][0])
            for i, (layer, e) in enumerate(seq):
                into = slots[layer][i % rows]
                t = time.perf_counter_ns()
                row = s.read_bundle(layer, e, into)
                out.append(time.perf_counter_ns() - t)
                warm_cold[arm] += row["cold"]
        cseq = [rng.choice(pairs) for _ in range(a.cold_loads)]
        for arm in order:
            s = stores[arm]
            for i, (layer, e) in enumerate(cseq):
                s.drop_page_cache(layer)
                t = time.perf_counter_ns()
                row = s.read_bundle(layer, e, slots[layer][i % rows])
                cold[arm].append(time.perf_counter_ns() - t)
                cold_warm[arm] += not row["cold"]
    elapsed = time.time() - t0
    load1 = os.getloadavg()
    for layer, e in pairs:  # leave the files warm, as found
        stores["rwf_nowait"].read_bundle(layer, e, slots[layer][0])
    for s in stores.values():
        s.close()

    res = {
        "command": " ".join(["uv run python reports/store/read_cost.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": _machine(), "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in load1], "elapsed_s": round(elapsed, 1),
        "model": str(model.relative_to(ROOT) if model.is_relative_to(ROOT) else model),
        "bundle_bytes": m.layers[m.moe_layers[0]].bundle_bytes, "ranges_per_bundle": 9,
        "residency_method_detected": detected, "residency_fallback": why,
        "rounds": a.rounds,
        "warm": {k: {**_stats(warm[k]), "classed_cold": warm_cold[k]} for k in ARMS},
        "cold": {k: {**_stats(cold[k]), "classed_warm": cold_warm[k]} for k in ARMS},
    }
    for kind in ("warm", "cold"):
        base = res[kind]["before"]["median_us"]
        for k in ARMS:
            res[kind][k]["ratio_vs_before"] = round(res[kind][k]["median_us"] / base, 3)
        res[kind]["rwf_nowait"]["ratio_vs_mincore"] = round(
            res[kind]["rwf_nowait"]["median_us"] / res[kind]["mincore"]["median_us"], 3)
    table = _table(res)
    print(table)
    if not a.no_write:
        (OUT / "read-cost.json").write_text(json.dumps(res, indent=2) + "\n")
        (OUT / "README.md").write_text(_readme(res, table))
        print(f"wrote {OUT / 'read-cost.json'} and {OUT / 'README.md'}")
    return 0


def _table(res: dict) -> str:
    lines = ["| loads | arm | n | median us | p10 us | p90 us | vs before | misclassed |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for kind, miss in (("warm", "classed_cold"), ("cold", "classed_warm")):
        for k in ARMS:
            r = res[kind][k]
            lines.append(f"| {kind} | {k} | {r['n']} | {r['median_us']:.1f} | {r['p10_us']:.1f} "
                         f"| {r['p90_us']:.1f} | {r['ratio_vs_before']:.2f} | {r[miss]} |")
    return "\n".join(lines)


def _readme(res: dict, table: str) -> str:
    w, c = res["warm"], res["cold"]
    why = "" if res["residency_fallback"] is None else f" ({res['residency_fallback']})"
    return f"""# Store read cost per load (small bundles)

Command: `{res['command']}` (run {res['date']}, {res['elapsed_s']} s of timed loads).
Machine: {res['machine']['platform']}, {res['machine']['cpus']} CPUs, filesystem
{res['machine']['filesystem']}, Python {res['machine']['python']}; load average (1/5/15 min)
{res['loadavg_before']} before, {res['loadavg_after']} after. Shared, noisy machine.

Model `{res['model']}`: bundle {res['bundle_bytes']} bytes in {res['ranges_per_bundle']} byte
ranges. Residency method the store picked here: `{res['residency_method_detected']}`{why}.
Arms (one process, {res['rounds']} rounds, order rotated each round, same random (layer, expert)
sequence per round, each load into a preallocated MLX slot row): `before` = the store as it was
(mincore with np.zeros per range, then preadv per range); `mincore` = current store with the
mincore classification forced; `rwf_nowait` = current default (read with RWF_NOWAIT first).
Cold loads: the layer file's pages dropped with POSIX_FADV_DONTNEED before each timed load.
"misclassed" counts warm loads classed cold (or cold loads classed warm).

{table}

Warm median: rwf_nowait / mincore = {w['rwf_nowait']['ratio_vs_mincore']:.2f},
rwf_nowait / before = {w['rwf_nowait']['ratio_vs_before']:.2f}. Cold median: rwf_nowait / before
= {c['rwf_nowait']['ratio_vs_before']:.2f} (cold loads are dominated by the disk; shared storage
drifts, so treat cold ratios as rough). Raw numbers: `read-cost.json`.
"""


if __name__ == "__main__":
    raise SystemExit(main())
