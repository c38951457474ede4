"""Cold bundle reads through the engine's store on several threads at once: how long one read
takes when n are in flight, as the reader threads and the main thread read in decode.

Each run drops the expert files' pages, then n threads each read their own bundles (distinct,
spread over every MoE layer, every other expert so that no two share a page) back to back from
one barrier; a read's wall time is the store's own (its load row, start to finish). Thread
counts are rotated over rounds; per count, the read alone (median over rounds of a round's
median read) times the median over rounds of the count's ratio to the read alone in the same
round.
sim.read_overlap fits the device's concurrent-read speedup from these figures."""

from __future__ import annotations

import statistics
import threading
from pathlib import Path

from calibration.bundle_views import one_row_views
from engine.store import ExpertStore

THREADS = (1, 2, 3, 4)


def _run(store: ExpertStore, keys: list[tuple[int, int]], threads: int,
         per_thread: int) -> list[float]:
    """One run: `threads` threads, `per_thread` bundles each; the cold reads' wall ms."""
    if store.drop_until_cold() != 0:
        return []
    walls: list[float] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)
    layers = sorted({layer for layer, _ in keys})

    def read(i: int) -> None:
        try:
            views = one_row_views(store, layers)
            mine = keys[i::threads][:per_thread]
            barrier.wait()
            for layer, expert in mine:
                row = store.read_bundle(layer, expert, views[layer], emit=False)
                if row["cold"]:
                    walls.append((row["finished_ns"] - row["started_ns"]) / 1e6)
        except BaseException as err:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(err)
            barrier.abort()

    workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return walls


def concurrent_read_ms(converted: Path, threads: tuple[int, ...] = THREADS,
                       per_thread: int = 48, rounds: int = 12) -> dict[int, float]:
    """Thread count -> wall ms of one cold bundle read with that many threads reading at
    once: the read alone (the median over rounds of a round's median) times the median over
    rounds of the count's ratio to it. Empty when the pages could not be dropped (nothing is
    cold to measure)."""
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    keys = [(layer, e) for e in range(1, manifest.num_experts, 2) for layer in
            manifest.moe_layers]
    per_thread = min(per_thread, len(keys) // max(threads))
    runs: list[dict[int, float]] = []  # per round, thread count -> median wall of its reads
    with ExpertStore(manifest) as store:
        for r in range(rounds):
            order = threads[r % len(threads):] + threads[:r % len(threads)]
            shifted = keys[r * per_thread:] + keys[:r * per_thread]  # other bundles each round
            walls = {n: _run(store, shifted, n, per_thread) for n in order}
            if all(walls.values()):
                runs.append({n: statistics.median(w) for n, w in walls.items()})
    if not runs:
        return {}
    # paired within each round (the machine drifts between rounds): the read alone, times
    # the median over rounds of each count's ratio to it
    alone = statistics.median(run[threads[0]] for run in runs)
    return {n: alone * statistics.median(run[n] / run[threads[0]] for run in runs)
            for n in threads}
