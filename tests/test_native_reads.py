"""Native reads (engine.native_reads, engine/native/readpool.c): bundle reads on threads with no
Python on the read path. Checked against the file's own bytes, the kernel's count of read
system calls, perf_counter_ns's clock, mincore before and after dropping the pages, the Python
readers' rows for the same reads, and an interpreter that will not hand its lock over."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from store_helpers import expert_buffers, needs_real_page_cache

from contract.engine_config import EngineConfig
from engine import native_reads
from engine.manifest import read_manifest
from engine.readers import ReaderPool
from engine.store import ExpertReadError, ExpertStore

lib, why = native_reads.load()
needs_pool = pytest.mark.skipif(lib is None, reason=f"native reads unavailable: {why}")
PROC_IO = Path("/proc/self/io")


def _file_bytes(store: ExpertStore, layer: int, expert: int) -> bytes:
    """The bundle's slices as the layer file holds them (the reference)."""
    raw = Path(store._files[layer].path).read_bytes()
    return b"".join(raw[off:off + n] for off, n in store.bundle_ranges(layer, expert))


def _got(into: dict[str, np.ndarray], store: ExpertStore, layer: int) -> bytes:
    order = [n for n in store.manifest.layers[layer].tensors]
    return b"".join(into[n].tobytes() for n in order)


@needs_pool
def test_a_native_read_is_the_files_bytes_on_perf_counters_clock(store):
    layer = store.manifest.moe_layers[-1]
    pool = native_reads.NativePool(2, lib)
    try:
        for expert in (0, 3):
            into = expert_buffers(store, layer)
            read = store.native_read(layer, expert, into)
            before = time.perf_counter_ns()
            job = pool.submit(read.file.fd, read.run.offset, read.run.length, read.iovecs,
                              read.file.addr)
            pool.wait([job])
            after = time.perf_counter_ns()
            assert job.state == native_reads.DONE and job.result == read.run.length
            assert _got(into, store, layer) == _file_bytes(store, layer, expert)
            assert before <= job.started_ns <= job.finished_ns <= after
    finally:
        pool.close()


@needs_pool
@pytest.mark.skipif(not PROC_IO.exists(), reason="no /proc/self/io")
def test_one_native_read_is_one_read_system_call_counted_by_the_kernel(store):
    def syscr() -> int:
        return int(next(line for line in PROC_IO.read_text().splitlines()
                        if line.startswith("syscr:")).split()[1])

    layer = store.manifest.moe_layers[0]
    pool = native_reads.NativePool(2, lib)
    try:
        reads = [store.native_read(layer, e, expert_buffers(store, layer)) for e in range(6)]
        own = syscr()
        own = syscr() - own  # reading the count is itself a read
        before = syscr()
        jobs = [pool.submit(r.file.fd, r.run.offset, r.run.length, r.iovecs, r.file.addr)
                for r in reads]
        pool.wait(jobs)
        assert syscr() - before - own == len(jobs)
    finally:
        pool.close()


@needs_pool
def test_the_cold_flag_is_mincores_before_the_read(store):
    needs_real_page_cache(store)
    layer = store.manifest.moe_layers[0]
    pool = native_reads.NativePool(1, lib)
    try:
        def once() -> int:
            r = store.native_read(layer, 2, expert_buffers(store, layer))
            job = pool.submit(r.file.fd, r.run.offset, r.run.length, r.iovecs, r.file.addr)
            pool.wait([job])
            return job.cold

        assert once() == 1  # dropped: read from the device
        assert once() == 0  # now cached
        r = store.native_read(layer, 2, expert_buffers(store, layer))
        job = pool.submit(r.file.fd, r.run.offset, r.run.length, r.iovecs, 0)
        pool.wait([job])
        assert job.cold == -1  # no mapping: unknown (the row counts it cold)
    finally:
        pool.close()


@needs_pool
def test_a_native_read_lands_while_the_interpreter_keeps_its_lock(store):
    """The point of the pool: with a switch interval of a second no Python thread could take
    the interpreter lock while this loop spins, yet the native read finishes meanwhile."""
    layer = store.manifest.moe_layers[0]
    pool = native_reads.NativePool(1, lib)
    interval = sys.getswitchinterval()
    try:
        r = store.native_read(layer, 1, expert_buffers(store, layer))
        sys.setswitchinterval(1.0)
        job = pool.submit(r.file.fd, r.run.offset, r.run.length, r.iovecs, r.file.addr)
        end = time.perf_counter() + 0.5
        while job.state != native_reads.DONE and time.perf_counter() < end:
            pass
        landed = job.state == native_reads.DONE
        sys.setswitchinterval(interval)
        pool.wait([job])
        assert landed
    finally:
        sys.setswitchinterval(interval)
        pool.close()


@needs_pool
def test_reader_pool_native_rows_and_bytes_equal_the_python_readers(store):
    """The same reads, warm and cold, through both kinds of reader: the same bytes, the same
    cold flags, rows on their own thread name, a ticket done before anyone waits."""
    layer = store.manifest.moe_layers[0]
    needs_real_page_cache(store)
    out = {}
    for kind in ("python", "native"):
        store.drop_page_cache()
        store.rows.clear()
        pool = ReaderPool(store, 2, native=kind == "native")
        assert pool.kind == kind
        intos = [expert_buffers(store, layer) for _ in range(4)]
        tickets = [pool.submit_bundle(layer, e, intos[e]) for e in range(4)]
        tickets += [pool.submit_bundle(layer, e, expert_buffers(store, layer)) for e in range(2)]
        end = time.perf_counter() + 5
        while not all(t.done() for t in tickets) and time.perf_counter() < end:
            time.sleep(0.001)
        assert all(t.done() for t in tickets)
        pool.wait(tickets)
        pool.close()
        for e in range(4):
            assert _got(intos[e], store, layer) == _file_bytes(store, layer, e)
        out[kind] = sorted((r["expert"], r["cold"], r["bytes"]) for r in store.rows)
        threads = {r["thread"] for r in store.rows}
        assert threads == ({"native"} if kind == "native" else threads - {"native"})
    assert out["native"] == out["python"]
    # the first four were cold (dropped), the two repeats warm, in either kind
    assert sorted(c for _, c, _ in out["native"]) == [False, False, True, True, True, True]


@needs_pool
@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_the_main_thread_runs_a_native_read_no_pool_thread_has_started(store):
    """help_main with native readers: while the pool's one thread is busy (4 GiB of
    /dev/zero), a queued bundle read is taken off the queue and run by the thread that waits
    for it: the file's bytes, its row on "main", the pool thread still busy when it returns.
    A read a pool thread has started is left to it."""
    import os

    from engine.range_reads import iovec_array

    layer = store.manifest.moe_layers[0]
    pool = ReaderPool(store, 1, native=True)
    zero = os.open("/dev/zero", os.O_RDONLY)
    buf = np.empty(4 << 20, np.uint8)
    busy_iov = iovec_array([buf] * native_reads.MAX_IOV)  # 4 GiB into one 4 MiB buffer
    try:
        first = pool.submit_bundle(layer, 0, expert_buffers(store, layer))
        pool.wait([first])  # the pool is started, its thread idle
        busy = pool._native.submit(zero, 0, buf.nbytes * native_reads.MAX_IOV, busy_iov)
        end = time.perf_counter() + 5
        while busy.state == 0 and time.perf_counter() < end:
            time.sleep(0.0005)
        assert busy.state == 1  # the pool thread has it
        assert pool._native.help(busy) is False
        store.rows.clear()
        into = expert_buffers(store, layer)
        queued = pool.submit_bundle(layer, 3, into)
        assert queued.job is not None and queued.job.state == 0
        pool.wait([queued])
        assert busy.state == 1  # still reading zeros: the bundle was read here
        assert [r["thread"] for r in store.rows] == ["main"]
        assert _got(into, store, layer) == _file_bytes(store, layer, 3)
        pool._native.wait([busy])
        assert busy.result == buf.nbytes * native_reads.MAX_IOV
    finally:
        pool.close()
        os.close(zero)


@needs_pool
def test_a_native_read_cut_short_is_named_with_its_file(tiny_random_converted, tmp_path):
    import shutil

    root = tmp_path / "m"
    shutil.copytree(tiny_random_converted, root)
    with ExpertStore(read_manifest(root)) as s:
        layer = s.manifest.moe_layers[-1]
        last = s.manifest.num_experts - 1
        path = Path(s._files[layer].path)
        end = max(off + n for off, n in s.bundle_ranges(layer, last))
        pool = ReaderPool(s, 1, native=True)
        with open(path, "r+b") as f:
            f.truncate(end - 100)  # the last bundle's last bytes are gone
        t = pool.submit_bundle(layer, last, expert_buffers(s, layer))
        with pytest.raises(ExpertReadError, match=f"{path}.*short read"):
            pool.wait([t])
        pool.close()


def test_without_a_compiler_the_engine_keeps_python_readers(store, tmp_path, monkeypatch):
    monkeypatch.setattr(native_reads, "_loaded", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    got, reason = native_reads.load()
    assert got is None and "no C compiler" in reason and "\n" not in reason
    pool = ReaderPool(store, 2, native=True)
    assert pool.kind == "python" and pool.why_python == reason
    layer = store.manifest.moe_layers[0]
    into = expert_buffers(store, layer)
    pool.wait([pool.submit_bundle(layer, 0, into)])
    pool.close()
    assert _got(into, store, layer) == _file_bytes(store, layer, 0)


def test_a_failed_build_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(native_reads, "_loaded", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    got, reason = native_reads.load()
    assert got is None and reason.startswith("building readpool.c with false failed")
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left to load


def test_the_engine_config_records_who_read(tiny_random_converted):
    from engine.loader import load_streaming

    for native in (False, True):
        cfg = EngineConfig.from_preset("staged")
        cfg.native_reads = native
        with load_streaming(tiny_random_converted, config=cfg) as engine:
            kind = engine.config.readers_kind
        if native and lib is not None:
            assert kind == "native"
        else:
            assert kind.startswith("python: ")


@needs_pool
def test_the_engine_decodes_the_same_tokens_on_native_readers(tiny_random_converted):
    """Staged with the layer lead at a small page-cache budget (prefetches and cold reads on
    the readers), sampled: the same tokens and the same loads with either kind of reader, the
    native rows on their own thread, and the budget kept."""
    from engine.generate import generate
    from engine.loader import load_streaming

    prompt = "class LRUCache:\n    def __init__(self, capacity):"
    out = {}
    for native in (False, True):
        cfg = EngineConfig.from_preset("staged", lead_kind="layer", native_reads=native,
                                       page_cache_budget=300_000)
        loads: list[dict] = []
        with load_streaming(tiny_random_converted, config=cfg, on_load=loads.append) as eng:
            assert eng.config.readers_kind == ("native" if native else "python: native reads off")
            res = generate(eng.model, eng.tokenizer, prompt, 24, temp=1.0, seed=0,
                           stop_at_eos=False, runtime=eng.runtime)
            used = eng.store.budget.used_bytes
        bundle = [r for r in loads if r["expert"] >= 0 and r["source"] == "prefetch"]
        out[native] = (res.tokens, sorted((r["layer"], r["expert"]) for r in bundle),
                       {r["thread"] for r in bundle})
        assert used <= 300_000
    assert out[True][0] == out[False][0]
    assert out[True][1] == out[False][1]
    assert out[True][2] == {"native"} and "native" not in out[False][2]


@needs_pool
def test_the_budgets_victims_are_dropped_by_the_native_thread(store):
    """A job drops the (fd, offset, length) extents it is given after its read: a bundle read
    warm before is cold once a later job names its pages (mincore, through the store)."""
    needs_real_page_cache(store)
    layer = store.manifest.moe_layers[0]
    store.read_bundle(layer, 4, expert_buffers(store, layer))
    assert not store.is_cold(layer, 4)
    f = store._files[layer]
    (off, ln), = store._bundle(layer, 4).spans
    page = 4096
    start, end = off - off % page, -(-(off + ln) // page) * page
    pool = native_reads.NativePool(1, lib)
    try:
        r = store.native_read(layer, 5, expert_buffers(store, layer))
        job = pool.submit(f.fd, r.run.offset, r.run.length, r.iovecs, f.addr,
                          [(f.fd, start, end - start)])
        pool.wait([job])
    finally:
        pool.close()
    assert job.result == r.run.length
    assert store.is_cold(layer, 4) and not store.is_cold(layer, 5)
