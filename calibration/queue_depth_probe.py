"""The device's throughput against reads in flight, with the engine's own read size (one
bundle of the model), and the reader count chosen from it (engine.queue_depth). Reads are
uncached (O_DIRECT; F_NOCACHE on macOS) at random aligned offsets of a scratch file beside the
model, n threads at once (`os.preadv` lets the GIL go, so they really queue at the device);
each depth's figure is the median over rounds, the depths rotated within a round so drift
spreads over all of them."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from calibration.storage_probes import queue_throughput, write_scratch
from contract.errors import BadInput
from contract.thresholds import ALIGN
from engine import platform, queue_depth
from engine.manifest import read_manifest

DEPTHS = (1, 2, 3, 4, 6, 8)
MIB = 1 << 20


@dataclass
class QueueDepth:
    curve: dict[int, float]  # reads in flight -> GB/s
    read_bytes: int
    readers: int
    how: str
    seconds: float


def measure(model_dir: Path, scratch_dir: Path | None = None, depths: tuple[int, ...] = DEPTHS,
            rounds: int = 3, scratch_bytes: int = 96 * MIB) -> QueueDepth:
    """Measure the curve for `model_dir`'s bundle size on the device holding `scratch_dir`
    (default: the model's own folder) and write MODEL/queue_depth.json."""
    t0 = time.perf_counter()
    m = read_manifest(model_dir)
    read_bytes = m.bundle_bytes
    size = -(-read_bytes // ALIGN) * ALIGN
    scratch_dir = Path(scratch_dir) if scratch_dir is not None else Path(model_dir)
    if not scratch_dir.is_dir():
        raise BadInput(f"{scratch_dir}: not a directory (the queue-depth scratch file's home)")
    # ~4 MiB per thread per round, at least 16 reads, within the scratch file
    per_thread = max(16, min(256, (4 * MIB) // size))
    scratch_bytes = max(scratch_bytes, -(-size * per_thread * max(depths) // MIB) * MIB)
    path = scratch_dir / f".ssdmoe-queue-depth-{os.getpid()}.bin"
    runs: dict[int, list[float]] = {n: [] for n in depths}
    try:
        write_scratch(path, scratch_bytes)
        for r in range(rounds):
            order = depths[r % len(depths):] + depths[:r % len(depths)]
            for n in order:
                got = queue_throughput(path, (n,), size, per_thread, seed=100 + r)
                if n in got:
                    runs[n].append(got[n])
    finally:
        path.unlink(missing_ok=True)
    curve = {n: statistics.median(v) for n, v in runs.items() if v}
    if not curve:
        raise BadInput(f"{scratch_dir}: {platform.current().uncached} reads refused on this "
                       "filesystem: the queue "
                       "depth cannot be measured here (--dir elsewhere, on the model's device)")
    how = (f"{platform.current().uncached} random reads of {size} bytes (the bundle, "
           f"{read_bytes} bytes, rounded to {ALIGN}) at random aligned offsets of a "
           f"{scratch_bytes // MIB} MiB scratch file in {scratch_dir}, {per_thread} per "
           f"thread, median of {rounds} rounds, depths rotated")
    queue_depth.write(model_dir, curve, read_bytes, how)
    return QueueDepth(curve, read_bytes, queue_depth.choose(curve), how,
                      time.perf_counter() - t0)


def summary(q: QueueDepth) -> str:
    curve = ", ".join(f"{n}: {g:.2f}" for n, g in sorted(q.curve.items()))
    return (f"queue depth: {q.readers} reads in flight for {q.read_bytes}-byte bundles "
            f"(GB/s by reads in flight: {curve}; {q.seconds:.0f} s)")
