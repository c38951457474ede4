"""Does RWF_NOWAIT tell a cold read from a warm one on this kernel? Two measurements on the
tiny-random fixture (built in a temp dir, seconds), printed as a table and written to
reports/store/nowait-probe.json:

- lands: drop a file's pages, check with mincore that page 0 is out, read it with RWF_NOWAIT;
  on EAGAIN, is page 0 resident 5 ms later? (control: the same without the read)
- warm after drop: copy the converted model, drop, verify with mincore that the bundle is out,
  read it with RWF_NOWAIT (a full read = "warm"), under buffered write load (two `dd` writers)
  or idle; and the same through ExpertStore as it opens now (its own classification).

    uv run python reports/store/nowait_probe.py [--copies 40]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.convert import convert
from engine.fixtures.random_models import build_tiny_random
from engine.manifest import read_manifest
from engine.platform import ResidencyProbe, map_for_residency, unmap
from engine.store import ExpertStore

OUT = Path(__file__).with_name("nowait-probe.json")
EXPERT = 7


def lands(path: Path, tries: int = 10) -> dict:
    """How often page 0 is resident 5 ms after a refused RWF_NOWAIT read (and without one)."""
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    addr, probe = map_for_residency(fd, size), ResidencyProbe()
    counts = {"read_refused": 0, "landed_after_refusal": 0, "landed_without_read": 0}
    try:
        for _ in range(tries):
            for read in (True, False):
                os.fdatasync(fd)  # a dirty page cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if probe.resident_pages(addr, [(0, 1)])[0]:
                    continue
                if read:
                    try:
                        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
                        continue  # read without refusal: not this measurement
                    except BlockingIOError:
                        counts["read_refused"] += 1
                time.sleep(0.005)
                key = "landed_after_refusal" if read else "landed_without_read"
                counts[key] += bool(probe.resident_pages(addr, [(0, 1)])[0])
    finally:
        unmap(addr, size)
        os.close(fd)
    return counts


def raw_read_after_drop(root: Path) -> list[tuple[bool, float]]:
    """(RWF_NOWAIT read full, ms) for expert EXPERT's gate slice of each layer, just dropped."""
    m, probe, out = read_manifest(root), ResidencyProbe(), []
    for layer in m.moe_layers:
        fd = os.open(root / m.layers[layer].file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(fd).st_size
        addr = map_for_residency(fd, size)
        t = m.layers[layer].tensors["gate_proj.weight"]
        off = t.offset + EXPERT * t.stride
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if probe.resident_pages(addr, [(off, t.stride)])[0] == 0:  # the premise, checked
            t0 = time.perf_counter()
            try:
                full = os.preadv(fd, [bytearray(t.stride)], off, os.RWF_NOWAIT) == t.stride
            except BlockingIOError:
                full = False
            out.append((full, (time.perf_counter() - t0) * 1e3))
        unmap(addr, size)
        os.close(fd)
    return out


def store_read_after_drop(root: Path) -> tuple[list[bool], str]:
    """Warm flags of the store's reads of expert EXPERT per layer after drop_until_cold."""
    s = ExpertStore(read_manifest(root))
    warm = []
    try:
        for layer in s.manifest.moe_layers:
            if s.drop_until_cold(layer, settle_s=0.01) != 0:
                continue
            buf = {n: np.zeros(sh, dtype=dt) for n, (sh, dt) in s.expert_shapes(layer).items()}
            warm.append(not s.read_bundle(layer, EXPERT, buf)["cold"])
        return warm, s.residency_method
    finally:
        s.close()


def writers(folder: Path) -> list[subprocess.Popen]:
    """Two `dd` writers, buffered, 3 GB each (the load the CI failures were reproduced under)."""
    return [subprocess.Popen(["dd", "if=/dev/zero", f"of={folder / f'load{i}'}", "bs=1M",
                              "count=3000", "status=none"]) for i in range(2)]


def arm(base: Path, work: Path, copies: int, load: bool) -> dict:
    procs = writers(work) if load else []
    raw, store, method = [], [], None
    try:
        for i in range(copies):
            root = work / f"copy{i % 3}"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(base, root)
            raw += raw_read_after_drop(root)
            warm, method = store_read_after_drop(root)
            store += warm
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for f in work.glob("load*"):
            f.unlink()
    full_ms = sorted(ms for full, ms in raw if full)
    return {"write_load": load, "raw_reads": len(raw), "raw_warm": sum(f for f, _ in raw),
            "raw_warm_read_ms_median": full_ms[len(full_ms) // 2] if full_ms else None,
            "store_method": method, "store_reads": len(store), "store_warm": sum(store)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[2]) as tmp:
        work = Path(tmp)
        base = work / "model"
        convert(build_tiny_random(work / "src", seed=0), base)
        m = read_manifest(base)
        landing = lands(base / m.layers[m.moe_layers[0]].file)
        arms = [arm(base, work, args.copies, load) for load in (True, False)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "kernel": platform.release(), "command": "uv run python reports/store/nowait_probe.py"
              f" --copies {args.copies}", "lands": landing, "arms": arms}
    print(f"kernel {result['kernel']}: refused RWF_NOWAIT reads {landing['read_refused']}, page "
          f"resident 5 ms later {landing['landed_after_refusal']} (without a read: "
          f"{landing['landed_without_read']})")
    print("| write load | RWF_NOWAIT 'warm' after a verified drop | median ms | store method | "
          "store warm after drop |")
    print("|---|---|---|---|---|")
    for a in arms:
        ms = a["raw_warm_read_ms_median"]
        print(f"| {'yes' if a['write_load'] else 'no'} | {a['raw_warm']}/{a['raw_reads']} | "
              f"{'-' if ms is None else f'{ms:.2f}'} | {a['store_method']} | "
              f"{a['store_warm']}/{a['store_reads']} |")
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
