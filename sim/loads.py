"""A load (one bundle, or one whole layer at prefill) and what performing it costs.

Where a load's bytes are decides its cost, on the thread doing it (main or a reader):
    page cache  a copy into engine memory (bytes / memcpy_gbps) and the per-read work
                (pieces x load_overhead: syscall, array, bookkeeping)
    device      first the device read of the bundle's ranges rounded out to pages
                (device_bundle_bytes; the edge pages shared with a neighbouring expert that
                the page cache holds are not read again; without readahead one request per
                range, bundle_reads, but for the slices in a page the expert's page group
                shares while that page is cached: sim.page_cache; sim.storage: throttle,
                queueing, latency, bytes / bandwidth; no CPU while it is in flight), then the bundle
                enters the page cache, then the copy, the per-read work and the fault work of
                the cold pieces (cold pieces x cold_overhead: page faults, VM mapping)
                beside the device time, a cold bundle's CPU that this leaves out: the hardware's
                cold_read_cpu_ms (the reading thread's CPU time of a cold read per request,
                measured) + its pages x cold_read_cpu_us_per_page, less the load's copy,
                fault and per-read work, on the shared cores
                while its requests are in flight (the kernel's work submitting and completing
                them). It does not lengthen a read the cores have room for; it competes with
                graph building and compute where a read runs beside them (a lead's prefetches)
With the engine's emulated page-cache budget, each bundle a fill pushes out costs the reading
thread `budget_evict_ms` of CPU after the read (the store drops its pages), before the load is
done: a thread waiting on it waits through the drops, as on a ticket in engine.readers. Under a
memory control group at its limit (`direct_reclaim`) the kernel frees the pages in the reading
thread inside the read itself: each bundle pushed out costs its pages x reclaim_us_per_page
of the read's time (measured at a group's limit; page_drop_us_per_page where a profile lacks it).
The per-read work is Python and holds the GIL (sim.gil) when the scenario models it; copy and
fault work happen inside the read (a warm load's preads return before a waiting thread is awake,
so with the GIL modelled its copies run inside its hold of the lock). In the bundled layout the
engine reads a bundle with one vectored read (bundle_reads 1: one device request of the
bundle's pages, one wake, one GIL hand-back). In the stacked (version-1) layout it reads one
pread per tensor slice and each takes the GIL back, so with the GIL modelled a cold load runs
slice by slice (`_by_syscall`), and slices under a page share it (sim.page_cache): those
mechanisms stay for traces of that layout and do nothing at bundle_reads 1.
`read_hold_ms` (Scenario) holds every expert read that long first: no CPU, the GIL let go;
with `read_hold_busy` the hold is that much CPU on the reading thread, the GIL let go.
All of it is CPU time on the host's shared cores (sim.cpu), so a load slows down when graph
building and compute run beside it, and slows them in turn.
A bundle may be read as several pieces (tensor-wise partial reads, `*_pieces`): with readahead
the first cold piece brings the whole bundle in and the others are warm; without it every piece
of a cold bundle is a separate device request.
"""

from __future__ import annotations

from collections.abc import Generator

import simpy

from contract.thresholds import PAGE
from sim.cpu import READER_THREAD, Cores
from sim.gil import Gil
from sim.page_cache import PageCache
from sim.scenario import Hardware
from sim.storage import Device


class Load:
    __slots__ = ("step", "layer", "expert", "nbytes", "pieces", "source", "issued", "started",
                 "finished", "cold", "cold_pieces", "waited", "wait", "thread", "key",
                 "done", "owed", "queued")

    def __init__(self, step: int, layer: int, expert: int, key: int, nbytes: int, pieces: int,
                 source: str, issued: float, done: simpy.Event) -> None:
        self.step = step
        self.layer = layer
        self.expert = expert
        self.key = key
        self.nbytes = nbytes
        self.pieces = pieces
        self.source = source
        self.issued = issued
        self.started = -1.0
        self.finished = -1.0  # < 0 until performed
        self.cold = False
        self.cold_pieces = 0
        self.waited = False
        self.wait = 0.0
        self.thread = ""
        self.done = done  # fires when the bytes are in engine memory
        self.owed = 0.0  # a native read's Python (its plan and row): the main thread's, when
        # it collects the load (sim.main_thread.wait)
        self.queued = False  # handed to the reader threads (sim.reader_threads)


class Fetcher:
    """Performs loads against the page cache and the device; keeps the load log."""

    def __init__(self, env: simpy.Environment, hw: Hardware, device: Device,
                 page_cache: PageCache, cores: Cores, experts: int, bundle_bytes: int,
                 device_bundle_bytes: int = 0, evict_ms: float = 0.0,
                 gil: Gil | None = None, bundle_reads: int = 1, hold_ms: float = 0.0,
                 hold_busy: bool = False, direct_reclaim: bool = False,
                 native_reads: bool = False) -> None:
        self.env = env
        self.device = device
        self.pc = page_cache
        self.cores = cores
        self.experts = experts
        self.bundle_bytes = bundle_bytes
        self.device_bytes = device_bundle_bytes or bundle_bytes  # page-rounded ranges
        self.bundle_reads = bundle_reads  # device requests of a cold bundle (no readahead)
        self.overhead = hw.load_overhead_ms / 1e3
        self.cold_overhead = hw.cold_overhead_ms / 1e3
        self.copy_bps = hw.memcpy_gbps * 1e9
        self.readahead = hw.readahead
        self.cold_read_cpu = hw.cold_read_cpu_ms / 1e3
        self.cold_page_cpu = hw.cold_read_cpu_us_per_page / 1e6
        self.evict_s = evict_ms / 1e3  # Scenario.budget_evict_ms
        # Scenario.direct_reclaim: an evicted bundle's pages freed by the reading thread (the
        # measured reclaim figure; profiles from before it have the drop figure)
        pages = -(-(device_bundle_bytes or bundle_bytes) // PAGE)
        per_page = hw.reclaim_us_per_page or hw.page_drop_us_per_page
        self.reclaim_s = pages * per_page / 1e6 if direct_reclaim else 0.0
        self.hold_s = hold_ms / 1e3  # Scenario.read_hold_ms
        self.hold_busy = hold_busy  # Scenario.read_hold_busy
        self.gil = gil if gil is not None else Gil(env, False)
        # each pread takes the GIL back (the engine); False: once per load, as the sim did
        # before (kept for reports/validation/gil_probe.py's comparison)
        self.slices_take_the_gil = True
        # Scenario.native_reads: reader threads run no Python (engine.native_reads)
        self.native_readers = native_reads
        self.log: list[Load] = []

    def _edge_bytes(self, load: Load) -> int:
        """The partial pages at a bundle's range ends, shared with the neighbouring experts'
        ranges (half the page rounding on each side): read from the device only when that
        neighbour is not in the page cache."""
        extra = (self.device_bytes - self.bundle_bytes) * load.nbytes // self.bundle_bytes
        if extra <= 0:
            return 0
        side = extra // 2
        key, e = load.key, load.expert
        left = e == 0 or not self.pc.holds(key - 1)
        right = e == self.experts - 1 or not self.pc.holds(key + 1)
        return side * left + (extra - side) * right

    def _cold_bytes(self, load: Load, shared: int) -> int:
        """Bytes a cold bundle read moves from the device. With page sharing (sim.page_cache)
        its own slices' pages, and the shared pages only where they are not cached (`shared`
        of those slices missing); otherwise its bytes and the edge pages (_edge_bytes)."""
        if not self.pc.shared_reads:
            return load.nbytes + self._edge_bytes(load)
        own = max(self.device_bytes - self.pc.shared_reads * PAGE, PAGE)
        return own * load.nbytes // self.bundle_bytes + shared * PAGE

    def perform(self, load: Load, thread: str) -> Generator:
        """Run `load` now on `thread` (a SimPy sub-process: `yield from`)."""
        env = self.env
        load.started = env.now
        load.thread = thread
        if self.hold_s and load.expert >= 0:  # the stall probe's hold, the GIL let go:
            # asleep, or busy on a core
            yield self.cores.work(self.hold_s, thread) if self.hold_busy else \
                env.timeout(self.hold_s)
        if load.expert < 0:
            missing = self.pc.probe_layer(load.layer, (load.step, load.layer))
            requests, cold_bytes = load.pieces, missing * self.device_bytes
            cold_pieces = 1 if missing else 0
            syscalls, held = load.pieces, False
        else:
            syscalls = max(load.pieces, self.bundle_reads)  # one pread per tensor slice
            held = self.pc.probe(load.key, (load.step, load.layer))
            # slices whose page the expert's page group shares: cached or not as a group
            shared = 0 if self.readahead else self.pc.shared_missing(load.key)
            if held and not shared:
                requests = cold_bytes = cold_pieces = 0
            elif held:
                # the bundle is held but a group partner's eviction dropped the shared pages:
                # those slices alone read cold (engine.store classes the load cold)
                requests, cold_bytes, cold_pieces = shared, shared * PAGE, load.pieces
            else:
                # without readahead every range is its own device request, but for the
                # slices in a shared page that is cached
                requests = 1 if self.readahead else \
                    syscalls - (self.pc.shared_reads - shared)
                cold_bytes = self._cold_bytes(load, shared)
                cold_pieces = 1 if self.readahead else load.pieces
        # the fault work of the requests that go to the device (all of them, measured)
        cold_share = requests / syscalls if load.expert >= 0 and not self.readahead else 1.0
        faults = cold_pieces * self.cold_overhead * cold_share
        copy = load.nbytes / self.copy_bps if self.copy_bps else 0.0
        kernel = faults + copy  # inside pread
        python = load.pieces * self.overhead
        # the measured CPU of a cold bundle read that the parts above leave out (module doc)
        beside = max(self.cold_cpu(cold_bytes, cold_share, load.nbytes) - kernel - python,
                     0.0) if cold_bytes and load.expert >= 0 else 0.0
        fill = cold_bytes > 0 and not held
        # a bundle read on a native reader thread (engine.native_reads): no interpreter lock;
        # its Python (plan and row) is owed to the main thread, which collects the load
        native = self.native_readers and thread.startswith(READER_THREAD) and load.expert >= 0
        if (not native and self.gil.enabled and self.slices_take_the_gil and cold_bytes
                and syscalls > 1 and (requests == syscalls or not self.readahead)):
            evicted = yield from self._by_syscall(load, thread, syscalls, requests, cold_bytes,
                                                  faults, copy, python, beside, fill)
        else:
            evicted = 0
            if cold_bytes:
                yield from self._device_read(cold_bytes, requests, thread, beside)
                evicted = self._fill(load) if fill else 0
            if native:
                if kernel > 0:
                    yield self.cores.work(kernel, thread)
                load.owed = python
            elif not cold_bytes and self.gil.enabled and self.slices_take_the_gil:
                # a warm pread returns before a waiting thread is awake: the whole load,
                # its copies too, holds the GIL (_by_syscall)
                yield from self.gil.run(self.cores, python + kernel, thread)
            else:
                if kernel > 0:
                    yield self.cores.work(kernel, thread)
                yield from self.gil.run(self.cores, python, thread)
        if evicted and self.reclaim_s:  # direct reclaim, inside the read (Scenario)
            yield self.cores.work(evicted * self.reclaim_s, thread)
        load.cold = cold_pieces > 0
        load.cold_pieces = cold_pieces
        load.finished = env.now  # the engine's finished_ns: taken before the budget's drops
        self.log.append(load)
        if evicted and self.evict_s:
            if native:  # the native thread drops the budget's victims after its read, no GIL
                yield self.cores.work(evicted * self.evict_s, thread)
            else:
                yield from self._drop_evicted(evicted, thread)
        load.done.succeed()

    def cold_cpu(self, cold_bytes: int, cold_share: float, nbytes: int) -> float:
        """A cold read's CPU on the reading thread (s): per request plus per page where the
        hardware has the per-page figure, else the per-bundle figure scaled by bytes."""
        if self.cold_page_cpu:
            return self.cold_read_cpu * cold_share + -(-cold_bytes // PAGE) * self.cold_page_cpu
        return self.cold_read_cpu * cold_share * nbytes / self.bundle_bytes

    def _drop_evicted(self, evicted: int, thread: str) -> Generator:
        """The engine's page-cache budget drops the bundles the fill pushed out
        (engine.page_cache_budget.charge, one fadvise per range) inside the store's read, and
        engine.readers sets the load's event only after that read returns: a thread waiting on
        the load waits through the drops. Each fadvise returns in microseconds, before a waiting
        thread could take the GIL (as a warm pread, see _by_syscall), so the drops hold it."""
        yield from self.gil.run(self.cores, evicted * self.evict_s, thread)

    def _by_syscall(self, load: Load, thread: str, syscalls: int, requests: int,
                    cold_bytes: int, faults: float, copy: float, python: float,
                    beside: float = 0.0, fill: bool = True) -> Generator:
        """A cold load as the engine does it, one pread per tensor slice: each pread that goes
        to the device (`requests` of the `syscalls`; the others find their pages cached)
        waits on it and lets go of the GIL meanwhile, long enough for a waiting thread to take
        it, so a read that lands while another thread runs Python waits for it once per slice,
        not once per load. The load's Python comes in syscalls + 1 equal parts: one before the
        first pread (engine.store._load finds the ranges, the views and the bundle's residency
        before it reads, so a reader starts its first read only once it holds the GIL) and one
        after each. (A warm pread returns in microseconds, before a waiting thread is even
        awake: a GIL hand-over, the hardware's gil_handoff_ms, takes longer, so a warm load
        keeps the GIL, as a load always did in the sim.) Without a holder it
        costs what the one-shot load does (tests/test_sim_mechanisms.py). Each pread copies
        its share of the bytes; the fault work is the device requests'. With `fill` the
        bundle enters the page cache after its last request; returns how many bundles that
        pushed out."""
        requests = max(min(requests, syscalls), 1)
        share, evicted = cold_bytes // requests, 0
        python /= syscalls + 1
        yield from self.gil.run(self.cores, python, thread)
        for i in range(syscalls):
            if i < requests:
                last = i == requests - 1
                yield from self._device_read(cold_bytes - share * i if last else share, 1,
                                             thread, beside / requests)
                if last and fill:
                    evicted = self._fill(load)
            kernel = copy / syscalls + (faults / requests if i < requests else 0.0)
            if kernel > 0:
                yield self.cores.work(kernel, thread)
            yield from self.gil.run(self.cores, python, thread)
        return evicted

    def _device_read(self, nbytes: int, requests: int, thread: str = "",
                     beside: float = 0.0) -> Generator:
        """The device read of `nbytes` in `requests`; with `beside`, that much CPU on
        `thread`'s behalf runs on the cores meanwhile, and the read is done when both are."""
        env = self.env
        device = env.process(self.device.transfer(env, nbytes, requests))
        if beside <= 0:
            yield device
            return
        yield env.all_of([device, self.cores.work(beside, thread)])

    def _fill(self, load: Load) -> int:
        """The read's bytes enter the page cache; returns how many bundles that pushed out."""
        before = self.pc.lru.evictions
        if load.expert < 0:
            self.pc.fill_layer(load.layer, (load.step, load.layer))
        else:
            self.pc.fill(load.key, (load.step, load.layer))
        return self.pc.lru.evictions - before
